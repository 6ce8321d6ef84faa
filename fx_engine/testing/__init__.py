"""Testing helpers for users' suites: tiny random models written as HF folders."""

from .tiny import write_tiny_model

__all__ = ["write_tiny_model"]
