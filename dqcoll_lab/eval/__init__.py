"""Evaluation: gradients made from models and the accuracy measurements made on them.

* :mod:`.sources`: the ``stdlib-lm`` and ``minilm`` gradient sources, registered with the
  runtime's registry (:mod:`dqcoll.topology.sources`: ``gaussian``, ``lognormal-mixture``,
  ``files``) when imported; its ``make_source`` builds every kind;
* :mod:`.tinylm`: a tiny transformer LM on the Python standard library's source (real gradients
  for the ``stdlib-lm`` source, the convergence experiment and the examples);
* :mod:`.minilm`: the pretrained all-MiniLM-L6-v2 encoder of the ``minilm`` source;
* :mod:`.accuracy`: real all-reduces of every scheme on one source, measured vNMSE and wire
  bits (``python -m dqcoll_lab eval``, ``tools/make_accuracy_docs.py``).

Nothing is imported here, so ``import dqcoll_lab.eval.tinylm`` does not load the measurement code.
"""
