"""Helpers shared by tests, the demo and benchmarks (no test framework imports here)."""

from pykvcache.testing.tiny_model import TinyModelSpec, build_tiny_model

__all__ = ["TinyModelSpec", "build_tiny_model"]
