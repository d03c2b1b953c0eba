"""Evaluation beside the library: gradients to test on and the measurements made with them.

* :mod:`.sources`: gradient generators, one deterministic fp32 tensor per rank from a spec string
  (``make_source("lognormal-mixture", world_size=8)``), the data of ``dqcoll eval``, ``dqcoll
  tune`` and ``dqcoll simulate``;
* :mod:`.tinylm`: a tiny transformer LM on the Python standard library's source (real gradients
  for the ``stdlib-lm`` source, the convergence experiment and the examples);
* :mod:`.accuracy`: real all-reduces of every scheme on one source, measured vNMSE and wire
  bits (``dqcoll eval``, ``tools/make_accuracy_docs.py``).

The runtime never imports this package (``import dqcoll`` and the integrations load none of it;
tests/test_layers.py pins it): only the command line (``dqcoll/cli``), tools, examples and tests
do. Nothing is imported here, so ``import dqcoll.eval.sources`` does not load the model or the
measurement code.
"""
