"""docs/cli.md names every flag that `fx-engine COMMAND --help` shows (issue 44: serve's
--model NAME=PATH, --memory-budget, --idle-unload and --max-kv-size were missing), for each
command and each of trace's and golden's subcommands; the README mentions several models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fx_engine.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [["generate"], ["chat"], ["cache-prompt"], ["serve"], ["info"], ["trace"],
            ["trace", "graphs"], ["trace", "run"], ["trace", "diff"], ["golden"],
            ["golden", "record"], ["golden", "check"]]


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    """The option strings of --help's option lines ("  -c N, --ctx-size N   help...")."""
    out = set()
    for line in text.splitlines():
        m = re.match(r"  (-\S.*?)(?:\s{2,}|$)", line)
        if m:
            out |= set(re.findall(r"(?:^|, )(--?[A-Za-z][\w-]*)", m.group(1)))
    return out - {"-h", "--help"}


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_flag_of_the_help_is_in_the_cli_docs(argv, capsys):
    flags = _flags(_help(argv, capsys))
    doc = (ROOT / "docs" / "cli.md").read_text()
    missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}[`\s]", doc))
    assert not missing, f"fx-engine {' '.join(argv)}: flags not in docs/cli.md: {missing}"


def test_the_flag_reader_sees_short_and_long_forms(capsys):
    flags = _flags(_help(["serve"], capsys))
    assert {"--max-kv-size", "--ctx-size", "-c", "--model", "-m", "--memory-budget",
            "--idle-unload", "--threads", "-t", "--no-warmup"} <= flags


def test_the_readme_mentions_several_models_in_one_server():
    readme = (ROOT / "README.md").read_text()
    assert "--memory-budget" in readme and re.search(r"--model \w+=", readme)
