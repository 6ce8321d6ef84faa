"""Golden outputs from the mlx-lm oracle (specs/golden/*.json, made by tools/make_golden.py):
fx-engine must reproduce the oracle's token ids exactly, greedy and seeded."""

import json
from pathlib import Path

import pytest

import fx_engine

GOLDEN = Path(__file__).resolve().parents[1] / "specs" / "golden"
FILES = sorted(p for p in GOLDEN.glob("*.json") if p.name != "cases.json")
_models: dict = {}


def _model(spec: str):
    if spec not in _models:
        if spec == "default":
            _models[spec] = fx_engine.load()
        else:
            import tempfile

            from fx_engine.testing import write_tiny_model

            model_type = spec.split(":", 1)[1]
            _models[spec] = fx_engine.load(
                write_tiny_model(Path(tempfile.mkdtemp()) / model_type, model_type, seed=0)
            )
    return _models[spec]


def test_every_case_has_a_golden_file():
    names = {c["name"] for c in json.loads((GOLDEN / "cases.json").read_text())["cases"]}
    assert names == {p.stem for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_golden(path):
    g = json.loads(path.read_text())
    case = g["case"]
    model = _model(case["model"])
    assert g["origin"]["generated_by"] == "tools/make_golden.py"
    if case["model"] == "default":
        assert model.fingerprint == g["origin"]["model_fingerprint"], "model fingerprint changed"
    sampling = dict(case.get("sampling", {}))
    if "logit_bias" in sampling:
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    out = fx_engine.generate(model, g["prompt_token_ids"], max_tokens=case["max_tokens"], **sampling)
    assert list(out.token_ids) == g["expected_token_ids"], (
        f"diverges at {next((i for i, (a, b) in enumerate(zip(out.token_ids, g['expected_token_ids'])) if a != b), min(len(out.token_ids), len(g['expected_token_ids'])))}"
    )
