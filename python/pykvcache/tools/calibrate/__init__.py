"""The gate's calibration: ``measure`` (prefill, load path, storage, copy),
``fit`` (the cost model, shared with the TTFT benchmark) and ``cli``
(``pykvcache calibrate``; also ``python -m pykvcache.tools.calibrate``)."""
