"""The supported-model table of docs/models.md, generated from the registry
(`fx_engine.core.models`), so the docs cannot drift from the code.

    python tools/model_table.py            # rewrite the table in docs/models.md (and the
                                           # count in README.md) if they are stale
    python tools/model_table.py --check    # exit 1 if either is stale (tests/tools/test_model_table.py)
    python tools/model_table.py --print    # the generated Markdown on stdout

What it writes, between `<!-- model-table:start -->` and `<!-- model-table:end -->` in
docs/models.md: one row per config.json `model_type` the registry reads (`model_types()`),
with its family, its module file and whether it is a multimodal wrapper whose text model
runs (`Family.wrappers`); then one row per family with its `model_type`s, the GGUF
`general.architecture` names it reads (`Family.gguf_architectures`: the registry maps GGUF
architectures to families, not to model_types), whether it splits over tensor-parallel
ranks and cuts into pipeline stages (`Family.tensor_split` / `Family.layer_range`), and the
first sentence of its module's docstring. Between `<!-- model-count:start -->` and
`<!-- model-count:end -->` in README.md: "N `model_type`s in M families".

The module file of a model_type comes from the registry's own mapping when it has one
(a dict `MODEL_TYPE_MODULES` / `MODEL_MODULES` / `MODULES` / `MODULE_OF`, or
`model_type_modules()`, `module_of(model_type)`, `module_for(model_type)`), else from the
module whose `FAMILY` is the family's record (found with `inspect`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"
README = ROOT / "README.md"
START, END = "<!-- model-table:start -->", "<!-- model-table:end -->"
COUNT_START, COUNT_END = "<!-- model-count:start -->", "<!-- model-count:end -->"


def _registry() -> Any:
    sys.path.insert(0, str(ROOT))
    return importlib.import_module("fx_engine.core.models")


def _family_modules(reg: Any) -> dict[str, Any]:
    """family name -> the module object whose FAMILY is that family's record."""
    out: dict[str, Any] = {}
    for info in pkgutil.iter_modules(reg.__path__):
        try:
            mod = importlib.import_module(f"{reg.__name__}.{info.name}")
        except Exception:  # pragma: no cover - a broken module is the registry tests' business
            continue
        fam = getattr(mod, "FAMILY", None)
        if fam is not None and fam in reg.FAMILIES:
            out.setdefault(fam.name, mod)
    for fam in reg.FAMILIES:  # a FAMILY defined outside the package: where its functions live
        if fam.name not in out:
            mod = inspect.getmodule(fam.config_from_hf) or inspect.getmodule(fam.forward)
            if mod is not None:
                out[fam.name] = mod
    return out


def _rel(path: str | None) -> str:
    if not path:
        return "?"
    p = Path(path).resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return p.name


def _module_file(reg: Any, model_type: str, fam: Any, fam_mods: dict[str, Any]) -> str:
    """The module file that holds model_type: the registry's mapping if it has one."""
    for name in ("MODEL_TYPE_MODULES", "MODEL_MODULES", "MODULES", "MODULE_OF"):
        table = getattr(reg, name, None)
        if isinstance(table, dict) and model_type in table:
            try:
                return _as_file(table[model_type], reg)
            except (ImportError, TypeError, ValueError):
                pass
    for name in ("model_type_modules", "module_of", "module_for"):
        fn = getattr(reg, name, None)
        if callable(fn):
            try:
                return _as_file(fn()[model_type] if name == "model_type_modules" else fn(model_type), reg)
            except Exception:
                continue
    mod = fam_mods.get(fam.name)
    return _rel(inspect.getsourcefile(mod)) if mod is not None else "?"


def _as_file(x: Any, reg: Any) -> str:
    """A module object, a module name (dotted, or short within the registry's package) or a
    .py path (from the repo root or the package folder) -> the file relative to the repo."""
    if inspect.ismodule(x):
        return _rel(inspect.getsourcefile(x))
    s = str(x)
    if s.endswith(".py"):
        p = Path(s)
        if not p.is_absolute():
            p = ROOT / p if (ROOT / p).exists() else Path(reg.__file__).parent / p
        return _rel(str(p))
    try:
        mod = importlib.import_module(s)
    except ImportError:
        mod = importlib.import_module(f"{reg.__name__}.{s}")
    return _rel(inspect.getsourcefile(mod))


def _first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring, on one line (Markdown table-safe)."""
    para = (doc or "").strip().split("\n\n")[0]
    text = " ".join(re.sub(r"(?<=\w)-\n\s*", "-", para).split())  # "mixture-of-\nexperts"
    m = re.search(r"(?<=[.!?])\s+(?=[A-Z`(])", text)
    text = text[: m.start()] if m else text
    return text.replace("|", "\\|")


def _code(xs: Any) -> str:
    return ", ".join(f"`{x}`" for x in xs) if xs else "-"


def rows(reg: Any | None = None) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(one dict per model_type, one dict per family), in registry order."""
    reg = reg or _registry()
    fam_mods = _family_modules(reg)
    by_name = {f.name: f for f in reg.FAMILIES}
    types = reg.model_types()  # model_type -> family name, or "name (text model)"
    per_type = []
    for fam in reg.FAMILIES:  # registry order: family by family, each family's own order
        for mt in (*fam.model_types, *fam.wrappers):
            label = types.get(mt)
            if label is None:
                continue
            note = ""
            if mt in fam.wrappers:
                note = f"multimodal checkpoint: its text model (`{fam.wrappers[mt][0]}`) runs"
            per_type.append({"model_type": mt, "family": fam.name,
                             "module": _module_file(reg, mt, fam, fam_mods), "note": note})
    listed = {r["model_type"] for r in per_type}
    for mt, label in types.items():  # anything model_types() knows that no family lists
        if mt not in listed:
            fam = by_name.get(label.split(" ")[0])
            per_type.append({"model_type": mt, "family": label, "module": "?",
                             "note": "" if fam else "family not found"})
    per_family = []
    for fam in reg.FAMILIES:
        mod = fam_mods.get(fam.name)
        per_family.append({
            "family": fam.name, "module": _rel(inspect.getsourcefile(mod)) if mod else "?",
            "model_types": _code((*fam.model_types, *fam.wrappers)),
            "gguf": _code(fam.gguf_architectures),
            "split": ", ".join(w for w, ok in (("tensor", fam.tensor_split is not None),
                                                ("pipeline", fam.layer_range is not None)) if ok) or "-",
            "about": _first_sentence(getattr(mod, "__doc__", None)),
        })
    return per_type, per_family


def count_text(per_type: list[dict[str, str]], per_family: list[dict[str, str]]) -> str:
    return f"{len(per_type)} `model_type`s in {len(per_family)} families"


def table(reg: Any | None = None) -> str:
    """The generated Markdown (what goes between the markers)."""
    per_type, per_family = rows(reg)
    out = [
        f"<!-- generated by tools/model_table.py from fx_engine.core.models: "
        f"{count_text(per_type, per_family)}; do not edit by hand -->",
        "",
        "| `model_type` | family | module | note |",
        "|---|---|---|---|",
    ]
    for r in per_type:
        out.append(f"| `{r['model_type']}` | {r['family']} | "
                   f"[`{r['module']}`](../{r['module']}) | {r['note']} |")
    out += ["", "| family | module | `model_type`s | GGUF `general.architecture`s | splits over ranks "
                "| what its module says it is |", "|---|---|---|---|---|---|"]
    for r in per_family:
        out.append(f"| {r['family']} | [`{r['module']}`](../{r['module']}) | "
                   f"{r['model_types']} | {r['gguf']} | {r['split']} | {r['about']} |")
    return "\n".join(out)


def _between(text: str, start: str, end: str, new: str, where: Path) -> str:
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{where}: the markers {start} / {end} are missing")
    return text[: i + len(start)] + new + text[j:]


def render(doc_text: str, readme_text: str, reg: Any | None = None) -> tuple[str, str]:
    """(docs/models.md, README.md) with the generated parts in place."""
    reg = reg or _registry()
    per_type, per_family = rows(reg)
    doc = _between(doc_text, START, END, "\n" + table(reg) + "\n", DOC)
    readme = readme_text
    if COUNT_START in readme_text:
        readme = _between(readme_text, COUNT_START, COUNT_END, count_text(per_type, per_family), README)
    return doc, readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/models.md or README.md is stale")
    ap.add_argument("--print", action="store_true", help="print the generated table")
    ap.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    ap.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.print:
        print(table())
        return 0
    doc_text, readme_text = a.doc.read_text(), a.readme.read_text()
    doc, readme = render(doc_text, readme_text)
    stale = [p for p, old, new in ((a.doc, doc_text, doc), (a.readme, readme_text, readme)) if old != new]
    if a.check:
        for p in stale:
            print(f"{p}: the model table is stale; run python tools/model_table.py", file=sys.stderr)
        return 1 if stale else 0
    for p, new in ((a.doc, doc), (a.readme, readme)):
        if p in stale:
            p.write_text(new)
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
