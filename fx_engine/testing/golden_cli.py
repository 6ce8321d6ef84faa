"""`fx-engine golden record|check`: the golden-output kit on the command line.

    fx-engine golden record CASES.{json,yaml} -o GOLDEN.json [--model M] [--producer P]
    fx-engine golden check GOLDEN.json [--model M] [--case NAME ...] [--ignore-fingerprint]
                                       [--producer P] [--allow-producer-mismatch]

--producer runs your own decoding loop instead of fx_engine.generate: P is MODULE:FUNCTION
(imported from the current directory or sys.path) or path/to/file.py:FUNCTION, a callable
fn(model, case) returning fx_engine.testing.Produced, a list of token ids or a Completion
(see fx_engine.testing.golden). record writes P into the document's origin; check refuses
to run another producer than the recorded one unless --allow-producer-mismatch.

check exits 0 when every case passes, 1 on a regression or error, 3 when the only failures
are model fingerprint mismatches (a different model, not a regression). A malformed case
file or golden document, or a producer that cannot be imported or returns the wrong thing,
is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fx-engine golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    producer_help = ("your decoding loop instead of fx_engine.generate: MODULE:FUNCTION or "
                     "FILE.py:FUNCTION, called as fn(model, case)")
    r = sub.add_parser("record", help="run the cases and write the expected outputs")
    r.add_argument("cases", help="cases file (JSON or YAML)")
    r.add_argument("-o", "--out", required=True, help="golden document to write (JSON)")
    r.add_argument("--model", "-m", default=None, help="run every case on this model instead")
    r.add_argument("--producer", default=None, help=producer_help)
    c = sub.add_parser("check", help="compare the model's outputs with a golden document")
    c.add_argument("golden")
    c.add_argument("--model", "-m", default=None, help="check every case on this model instead")
    c.add_argument("--case", action="append", default=None, help="only this case (repeatable)")
    c.add_argument("--ignore-fingerprint", action="store_true",
                   help="compare outputs even when the model's fingerprint differs")
    c.add_argument("--producer", default=None, help=producer_help + " (the one the document records)")
    c.add_argument("--allow-producer-mismatch", action="store_true",
                   help="compare even when the producer is not the one the document was recorded with")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from fx_engine.testing import golden as g

    try:
        return _run(a, g)
    except g.GoldenError as e:  # a bad case, document or producer: one line, no traceback
        print(f"fx-engine golden {a.cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace, g) -> int:
    console = Console(highlight=False, soft_wrap=True)  # (diffs unwrapped, also in CI logs)
    producer, pname = g.resolve_producer(a.producer) if a.producer else (None, None)
    if a.cmd == "record":
        doc = g.record(g.load_cases(a.cases), model=a.model, producer=producer, producer_name=pname)
        g.save(doc, a.out)
        for e in doc["cases"]:
            console.print(escape(f"{e['case']['name']}: {len(e['token_ids'])} tokens {e['text'][:60]!r}"))
        console.print(escape(f"wrote {a.out} ({len(doc['cases'])} cases; producer {doc['origin']['producer']}; "
                      f"fx-engine {doc['origin']['fx_engine']}, MLX {doc['origin']['mlx']}, "
                      f"{doc['origin']['backend']})"))
        return 0
    results = g.check(a.golden, model=a.model, names=a.case, ignore_fingerprint=a.ignore_fingerprint,
                      producer=producer, producer_name=pname,
                      allow_producer_mismatch=a.allow_producer_mismatch)
    style = {"pass": "green", "regression": "bold red", "fingerprint_mismatch": "yellow", "error": "red"}
    for res in results:
        console.print(f"[{style[res.status]}]{res.status.upper():<20}[/] {escape(f'{res.name}: {res.message}')}")
    bad = [r for r in results if not r.ok]
    console.print(f"{len(results) - len(bad)} passed, {sum(r.status == 'regression' for r in bad)} regressions, "
                  f"{sum(r.status == 'fingerprint_mismatch' for r in bad)} fingerprint mismatches, "
                  f"{sum(r.status == 'error' for r in bad)} errors (producer {escape(pname or g.DEFAULT_PRODUCER)})")
    if not bad:
        return 0
    return 3 if all(r.status == "fingerprint_mismatch" for r in bad) else 1
