"""Tools built on the product: the ``pykvcache`` command and what it runs.

The product is the engine binding (``pykvcache._core``), the direct API
(``pykvcache``, ``pykvcache.aio``, ``pykvcache.preformat``), ``pykvcache.vllm``
and ``pykvcache.gate``. Everything here uses it and nothing there imports
this package (``tests/tools/test_tools_layering.py`` checks both directions):

* ``cli``            the ``pykvcache`` command: ``bench``, ``calibrate``, ``demo``
* ``bench/``         the characterization harness (parts: storage, fs tier, memory, ttft, ...)
* ``calibrate/``     the gate's calibration: ``measure`` (vLLM and the disk), ``fit``
                     (one cost-model fit, shared with the TTFT bench), ``cli``
* ``demo``           ``pykvcache demo``: prefix reuse in vLLM, then ``bench --quick``
* ``vllm_run``       scripted vLLM engines in a child process (demo, memory part)
* ``progress``       rich progress bars (rich is a tools dependency, the ``tools`` extra)
* ``vllm_adapter``   the only module that reaches private vLLM / manager attributes
"""
