"""dqcoll's lab: evaluation and research beside the runtime.

The runtime package :mod:`dqcoll` holds what users run (the collectives, the integrations, the
planner, the tuner and the ``dqcoll`` command). This package holds what measures it: gradient
sources made from models, the tiny LM the examples train, the accuracy harness
(:mod:`dqcoll_lab.eval`) and their command line (``python -m dqcoll_lab <command>``, console
script ``dqcoll-lab``). The lab imports the runtime; no module of the runtime imports the lab,
not even lazily inside a function (tests/test_lab_split.py), so ``import dqcoll`` and the
integrations load none of it.

Nothing is imported here: ``import dqcoll_lab.eval.tinylm`` loads the model alone.
"""
