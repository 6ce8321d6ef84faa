"""Testing helpers for users' suites: tiny random models, and the golden-output kit
(`fx_engine.testing.golden`, its pytest fixture `golden`, and `fx-engine golden`; your own
decoding loop is pinned with a producer returning `Produced`)."""

from fx_engine.runtime import setup

setup()  # a shell entry point: process set-up (BLAS, malloc) before mlx is imported

from fx_engine.testing.golden import (CaseResult, GoldenCase, GoldenError, Produced, ProducerError, check, load_cases, load_golden, record, resolve_producer, save)  # noqa: E402
from fx_engine.testing.tiny import write_tiny_model  # noqa: E402

__all__ = ["CaseResult", "GoldenCase", "GoldenError", "Produced", "ProducerError", "check", "load_cases",
           "load_golden", "record", "resolve_producer", "save", "write_tiny_model"]
