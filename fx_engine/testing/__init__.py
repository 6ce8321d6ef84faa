"""Testing helpers for users' suites: tiny random models, and the golden-output kit
(`fx_engine.testing.golden`, its pytest fixture `golden`, and `fx-engine golden`)."""

from .golden import CaseResult, GoldenCase, GoldenError, check, load_cases, load_golden, record, save
from .tiny import write_tiny_model

__all__ = ["CaseResult", "GoldenCase", "GoldenError", "check", "load_cases", "load_golden", "record",
           "save", "write_tiny_model"]
