"""`fx-engine golden record|check`: the golden-output kit on the command line.

    fx-engine golden record CASES.{json,yaml} -o GOLDEN.json [--model M]
    fx-engine golden check GOLDEN.json [--model M] [--case NAME ...] [--ignore-fingerprint]

check exits 0 when every case passes, 1 on a regression or error, 3 when the only failures
are model fingerprint mismatches (a different model, not a regression).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fx-engine golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the cases and write the expected outputs")
    r.add_argument("cases", help="cases file (JSON or YAML)")
    r.add_argument("-o", "--out", required=True, help="golden document to write (JSON)")
    r.add_argument("--model", "-m", default=None, help="run every case on this model instead")
    c = sub.add_parser("check", help="compare the model's outputs with a golden document")
    c.add_argument("golden")
    c.add_argument("--model", "-m", default=None, help="check every case on this model instead")
    c.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    c.add_argument("--ignore-fingerprint", action="store_true",
                   help="compare outputs even when the model's fingerprint differs")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from fx_engine.testing import golden as g

    console = Console(highlight=False)
    if a.cmd == "record":
        doc = g.record(g.load_cases(a.cases), model=a.model)
        g.save(doc, a.out)
        for e in doc["cases"]:
            console.print(f"{e['case']['name']}: {len(e['token_ids'])} tokens {e['text'][:60]!r}")
        console.print(f"wrote {a.out} ({len(doc['cases'])} cases; fx-engine {doc['origin']['fx_engine']}, "
                      f"MLX {doc['origin']['mlx']}, {doc['origin']['backend']})")
        return 0
    results = g.check(a.golden, model=a.model, names=a.case, ignore_fingerprint=a.ignore_fingerprint)
    style = {"pass": "green", "regression": "bold red", "fingerprint_mismatch": "yellow", "error": "red"}
    for res in results:
        console.print(f"[{style[res.status]}]{res.status.upper():<20}[/] {res.name}: {res.message}")
    bad = [r for r in results if not r.ok]
    console.print(f"{len(results) - len(bad)} passed, {sum(r.status == 'regression' for r in bad)} regressions, "
                  f"{sum(r.status == 'fingerprint_mismatch' for r in bad)} fingerprint mismatches, "
                  f"{sum(r.status == 'error' for r in bad)} errors")
    if not bad:
        return 0
    return 3 if all(r.status == "fingerprint_mismatch" for r in bad) else 1
