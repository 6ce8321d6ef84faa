"""The project's golden outputs (specs/golden/expected.json, recorded by tools/make_golden.py
from the mlx-lm oracle with the golden kit): fx-engine must reproduce the oracle's token ids
exactly (greedy and seeded), or its logprobs within the case's tolerance. Checked with the
kit's own pytest fixture, as a user's suite would."""

import json
from pathlib import Path

import pytest

from fx_engine.testing.golden import load_cases, load_golden
from fx_engine.testing.pytest_plugin import golden_case_names

pytestmark = pytest.mark.real_model

GOLDEN = Path(__file__).resolve().parents[2] / "specs" / "golden"
EXPECTED = GOLDEN / "expected.json"


def test_every_case_is_recorded_by_the_oracle():
    doc = load_golden(EXPECTED)
    assert doc["origin"]["generated_by"] == "tools/make_golden.py"
    assert doc["origin"]["producer"].startswith("mlx-lm ")
    assert [c.name for c in load_cases(GOLDEN / "cases.json")] == [e["case"]["name"] for e in doc["cases"]]
    raw = json.loads((GOLDEN / "cases.json").read_text())["cases"]
    for r, e in zip(raw, doc["cases"]):  # recorded from exactly these inputs
        assert {k: e["case"][k] for k in r} == r


@pytest.mark.parametrize("name", golden_case_names(EXPECTED))
@pytest.mark.slow
def test_golden(golden, name):
    golden.check(EXPECTED, name)
