"""docs/models.md's model table (and README.md's model count) is what tools/model_table.py
generates from the registry (fx_engine.core.models): a family or model_type added, removed
or renamed without regenerating the docs fails here."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import model_table  # noqa: E402

from fx_engine.core.models import FAMILIES, model_types  # noqa: E402


def test_the_docs_table_is_the_generated_one():
    doc, readme = (ROOT / "docs" / "models.md").read_text(), (ROOT / "README.md").read_text()
    want_doc, want_readme = model_table.render(doc, readme)
    assert doc == want_doc, "docs/models.md's model table is stale: run python tools/model_table.py"
    assert readme == want_readme, "README.md's model count is stale: run python tools/model_table.py"
    assert model_table.main(["--check"]) == 0


def test_every_model_type_and_family_has_a_row():
    table = model_table.table()
    for mt in model_types():
        assert f"| `{mt}` |" in table, mt
    for fam in FAMILIES:
        assert f"| {fam.name} | [`" in table, fam.name
    assert f"{len(model_types())} `model_type`s in {len(FAMILIES)} families" in (ROOT / "README.md").read_text()
    assert "docs/models.md" in (ROOT / "README.md").read_text()


def test_check_detects_a_stale_table_and_a_rewrite_fixes_it(tmp_path, capsys):
    doc, readme = tmp_path / "models.md", tmp_path / "README.md"
    shutil.copy(ROOT / "docs" / "models.md", doc)
    shutil.copy(ROOT / "README.md", readme)
    args = ["--doc", str(doc), "--readme", str(readme)]
    assert model_table.main(["--check", *args]) == 0

    lines = doc.read_text().split("\n")
    row = next(i for i, line in enumerate(lines) if line.startswith("| `mistral` |"))
    doc.write_text("\n".join(lines[:row] + lines[row + 1:]))  # a model_type's row gone
    assert model_table.main(["--check", *args]) == 1
    assert "models.md" in capsys.readouterr().err

    assert model_table.main(args) == 0  # regenerate
    assert model_table.main(["--check", *args]) == 0
    assert doc.read_text() == (ROOT / "docs" / "models.md").read_text()

    readme.write_text(readme.read_text().replace("`model_type`s in", "`model_type`s (stale) in"))
    assert model_table.main(["--check", *args]) == 1


def test_markers_missing_is_an_error(tmp_path):
    doc, readme = tmp_path / "models.md", tmp_path / "README.md"
    doc.write_text("# no markers here\n")
    readme.write_text("# readme\n")
    try:
        model_table.main(["--check", "--doc", str(doc), "--readme", str(readme)])
    except SystemExit as e:
        assert "markers" in str(e)
    else:
        raise AssertionError("missing markers were not reported")
