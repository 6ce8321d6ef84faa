"""pytest plugin of the golden-output kit. Enable it in your conftest.py (opt-in, so that
pytest runs of other projects in the same environment never import fx-engine and MLX):

    pytest_plugins = ["fx_engine.testing.pytest_plugin"]     # or: pytest -p fx_engine.testing.pytest_plugin

    def test_my_model(golden):
        golden.check("tests/golden.json")                    # every case
        golden.check("tests/golden.json", "paris")           # one case

    @pytest.mark.parametrize("name", golden_case_names("tests/golden.json"))
    def test_case(golden, name):
        golden.check("tests/golden.json", name)

A regression fails the test with the diff at the first divergent position. A model whose
fingerprint differs from the recording fails as a fingerprint mismatch (a different model,
not a regression), or is skipped with --golden-skip-mismatch. `pytest --golden-record`
re-records the golden documents the tests check (from their cases) instead of checking.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fx_engine.testing import golden as g


def golden_case_names(path: str | Path) -> list[str]:
    return [e["case"]["name"] for e in g.load_golden(path)["cases"]]


class GoldenMismatch(AssertionError):
    """A golden case produced different output (a regression)."""


class GoldenFingerprintMismatch(AssertionError):
    """The model is not the one the golden document was recorded with."""


class GoldenChecker:
    def __init__(self, config: Any):
        self.config = config
        self.models = g.ModelCache(config.getoption("golden_model"))
        self.recorded: set[Path] = set()

    def check(self, path: str | Path, *names: str) -> list[g.CaseResult]:
        path = Path(path)
        if self.config.getoption("golden_record"):
            doc = g.load_golden(path)
            producer = doc.get("origin", {}).get("producer")
            if producer != "fx_engine.generate":  # e.g. an independent oracle's recording
                raise pytest.UsageError(f"--golden-record: {path} was recorded by {producer!r}, not by "
                                        "fx-engine; re-record it with the tool that made it")
            if path.resolve() not in self.recorded:  # once per file per session
                cases = [g.parse_case(e["case"], str(path)) for e in doc["cases"]]
                g.save(g.record(cases, models=self.models), path)
                self.recorded.add(path.resolve())
            pytest.skip(f"re-recorded {path} (--golden-record)")
        results = g.check(path, names=list(names) or None, models=self.models)
        regressions = [r for r in results if r.status in ("regression", "error")]
        mismatches = [r for r in results if r.status == "fingerprint_mismatch"]
        if regressions:
            raise GoldenMismatch("\n\n".join(f"golden case {r.name!r} ({r.status}):\n{r.message}" for r in regressions))
        if mismatches:
            text = "\n".join(f"golden case {r.name!r}: {r.message}" for r in mismatches)
            if self.config.getoption("golden_skip_mismatch"):
                pytest.skip(text)
            raise GoldenFingerprintMismatch("MODEL FINGERPRINT MISMATCH (not a regression)\n" + text)
        return results


def pytest_addoption(parser: Any) -> None:
    grp = parser.getgroup("fx-engine golden outputs")
    grp.addoption("--golden-record", action="store_true", help="re-record golden documents instead of checking")
    grp.addoption("--golden-model", default=None, help="check golden cases on this model instead")
    grp.addoption("--golden-skip-mismatch", action="store_true",
                  help="skip (not fail) golden checks whose model fingerprint differs")


@pytest.fixture(scope="session")
def golden(pytestconfig: Any) -> GoldenChecker:
    return GoldenChecker(pytestconfig)
