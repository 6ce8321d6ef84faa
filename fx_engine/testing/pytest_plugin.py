"""pytest plugin of the golden-output kit. Enable it in your conftest.py (opt-in, so that
pytest runs of other projects in the same environment never import fx-engine and MLX):

    pytest_plugins = ["fx_engine.testing.pytest_plugin"]     # or: pytest -p fx_engine.testing.pytest_plugin

    def test_my_model(golden):
        golden.check("tests/golden.json")                    # every case
        golden.check("tests/golden.json", "paris")           # one case

    @pytest.mark.parametrize("name", golden_case_names("tests/golden.json"))
    def test_case(golden, name):
        golden.check("tests/golden.json", name)

    def test_my_loop(golden):                                # pin your own decoding loop
        golden.check("tests/cfg.json", producer=cfg, cases="tests/cfg_cases.yaml")

A regression fails the test with the diff at the first divergent position. A model whose
fingerprint differs from the recording fails as a fingerprint mismatch (a different model,
not a regression), or is skipped with --golden-skip-mismatch. `pytest --golden-record`
records the golden documents the tests check instead of checking: again from their own
cases, or from `cases=` (a cases file; needed when the document does not exist yet).

producer=fn runs your loop, fn(model, case) -> Produced | token ids | Completion, instead
of fx_engine.generate, for the check and for --golden-record (see fx_engine.testing.golden);
the document must have been recorded with the same producer (else an error saying which,
unless allow_producer_mismatch=True), and --golden-record refuses to overwrite a document
another producer made (an independent oracle's, or another loop's: delete it to switch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from fx_engine.testing import golden as g


def golden_case_names(path: str | Path, cases: str | Path | None = None) -> list[str]:
    """The case names of a golden document (for parametrize); from `cases` (a cases file)
    while the document does not exist yet (before its first `pytest --golden-record`)."""
    if cases is not None and not Path(path).exists():
        return [c.name for c in g.load_cases(cases)]
    return [e["case"]["name"] for e in g.load_golden(path)["cases"]]


class GoldenMismatch(AssertionError):
    """A golden case produced different output (a regression)."""


class GoldenFingerprintMismatch(AssertionError):
    """The model is not the one the golden document was recorded with."""


class GoldenChecker:
    def __init__(self, config: Any):
        self.config = config
        self.models = g.ModelCache(config.getoption("golden_model"))
        self.recorded: dict[Path, str] = {}  # --golden-record: path -> the producer that recorded it

    def check(self, path: str | Path, *names: str, producer: Callable[[Any, g.GoldenCase], Any] | None = None,
              cases: str | Path | None = None, producer_name: str | None = None,
              allow_producer_mismatch: bool = False) -> list[g.CaseResult]:
        """Check the golden document at `path` (every case, or those named) with `producer`
        (None: fx_engine.generate); with --golden-record, record it instead (from `cases`,
        a cases file, or the document's own cases) and skip."""
        path = Path(path)
        pname = producer_name or g.producer_name_of(producer)
        if self.config.getoption("golden_record"):
            self._record(path, producer, pname, cases)
        if not path.exists():
            hint = f" (cases from {cases})" if cases is not None else "; pass cases= (a cases file)"
            pytest.fail(f"golden document {path} does not exist: record it with `pytest --golden-record`{hint} "
                        f"or `fx-engine golden record CASES -o {path}`", pytrace=False)
        results = g.check(path, names=list(names) or None, models=self.models, producer=producer,
                          producer_name=pname, allow_producer_mismatch=allow_producer_mismatch)
        regressions = [r for r in results if r.status in ("regression", "error")]
        mismatches = [r for r in results if r.status == "fingerprint_mismatch"]
        if regressions:
            cause = next((r.exc for r in regressions if r.exc is not None), None)
            raise GoldenMismatch("\n\n".join(f"golden case {r.name!r} ({r.status}):\n{r.message}"
                                             for r in regressions)) from cause
        if mismatches:
            text = "\n".join(f"golden case {r.name!r}: {r.message}" for r in mismatches)
            if self.config.getoption("golden_skip_mismatch"):
                pytest.skip(text)
            raise GoldenFingerprintMismatch("MODEL FINGERPRINT MISMATCH (not a regression)\n" + text)
        return results

    def _record(self, path: Path, producer: Any, pname: str, cases: str | Path | None) -> None:
        done = self.recorded.get(path.resolve())
        if done is not None and not g.same_producer(done, pname):
            raise pytest.UsageError(f"--golden-record: {path} was just recorded with {done!r}; a test "
                                    f"checks it with {pname!r}")
        if done is None:  # once per file per session
            doc = g.load_golden(path) if path.exists() else None
            if doc is not None:
                made_by = g.recorded_producer(doc)
                if not g.same_producer(made_by, pname) or not g.same_producer(g.expected_producer(doc), pname):
                    raise pytest.UsageError(
                        f"--golden-record: {path} was recorded by {made_by!r}, not by {pname!r} (an "
                        "independent oracle's or another loop's outputs); re-record it with the tool that "
                        "made it, or delete it to record it with this producer")
            if cases is not None:
                todo = g.load_cases(cases)
            elif doc is not None:
                todo = [g.parse_case(e["case"], str(path)) for e in doc["cases"]]
            else:
                raise pytest.UsageError(f"--golden-record: {path} does not exist; pass cases= (a cases "
                                        "file) to golden.check to record it")
            g.save(g.record(todo, models=self.models, producer=producer, producer_name=pname), path)
            self.recorded[path.resolve()] = pname
        pytest.skip(f"re-recorded {path} (--golden-record)")


def pytest_addoption(parser: Any) -> None:
    grp = parser.getgroup("fx-engine golden outputs")
    grp.addoption("--golden-record", action="store_true", help="re-record golden documents instead of checking")
    grp.addoption("--golden-model", default=None, help="check golden cases on this model instead")
    grp.addoption("--golden-skip-mismatch", action="store_true",
                  help="skip (not fail) golden checks whose model fingerprint differs")


@pytest.fixture(scope="session")
def golden(pytestconfig: Any) -> GoldenChecker:
    return GoldenChecker(pytestconfig)
