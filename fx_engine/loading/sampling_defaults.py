"""The sampling settings a model ships with, and the chat defaults built on them.

    settings, source = model_sampling("model.gguf")    # ({"temperature": 0.6, ...}, "GGUF general.sampling.*")
    chosen, sources = chat_sampling(model.path, {"temperature": None, "top_k": 20})

A Hugging Face folder carries them in `generation_config.json` (temperature, top_p, top_k,
min_p, repetition_penalty; `"do_sample": false` means greedy, as in transformers); a GGUF
file in llama.cpp's `general.sampling.*` keys (written by its convert_hf_to_gguf.py from
the same generation_config.json: temp, top_k, top_p, min_p, penalty_repeat, penalty_last_n,
xtc_probability, xtc_threshold). `fx-engine chat` takes each setting from, in order: its
flag, the model's file, else llama.cpp's defaults (`CHAT_DEFAULTS`), key by key as llama.cpp
does (mlx-lm's chat is greedy by default, which makes small models repeat themselves to the
token limit). `fx-engine generate` stays greedy unless flags say otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["CHAT_DEFAULTS", "CHAT_DEFAULTS_SOURCE", "chat_sampling", "describe", "model_sampling"]

# llama.cpp's common_params_sampling defaults (temp 0.8, top_k 40, top_p 0.95, min_p 0.05;
# repeat penalty 1.0 = off)
CHAT_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
CHAT_DEFAULTS_SOURCE = "llama.cpp's defaults"

# GGUF metadata key (gguf-py's Keys.General.SAMPLING_*) -> fx_engine.generate's argument
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repetition_context_size",
    "general.sampling.xtc_probability": "xtc_probability",
    "general.sampling.xtc_threshold": "xtc_threshold",
}
# generation_config.json keys read as they are (transformers' names = ours)
_HF_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_INTS = ("top_k", "repetition_context_size")


def _number(key: str, value: Any) -> int | float | None:
    """A finite number of the argument's type, or None (a value that is not one is skipped:
    a model file's odd entry never stops a chat)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number) or number < 0:
        return None
    # (GGUF stores float32: 0.6 reads back as 0.60000002; 7 significant digits are exact)
    return int(number) if key in _INTS else float(f"{number:.7g}")


def _from_generation_config(folder: Path) -> dict[str, Any]:
    try:
        d = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict):
        return {}
    if d.get("do_sample") is False:  # transformers: greedy, whatever else the file says
        return {"temperature": 0.0}
    out = {k: _number(k, d[k]) for k in _HF_KEYS if k in d}
    return {k: v for k, v in out.items() if v is not None}


def _from_gguf(path: Path) -> dict[str, Any]:
    from fx_engine.loading.gguf import _Header

    try:
        meta = _Header(path).metadata
    except Exception:  # noqa: BLE001 - the load reports a bad file; here it only has no settings
        return {}
    out = {arg: _number(arg, meta[key]) for key, arg in _GGUF_KEYS.items() if key in meta}
    return {k: v for k, v in out.items() if v is not None}


def model_sampling(path: str | Path | None) -> tuple[dict[str, Any], str | None]:
    """The sampling settings stored with the model at `path` (a GGUF file or a Hugging Face
    folder) and where they came from; ({}, None) when it stores none."""
    if not path:
        return {}, None
    p = Path(path)
    if p.is_dir():
        found = _from_generation_config(p)
        return (found, "the model's generation_config.json") if found else ({}, None)
    if p.suffix.lower() == ".gguf" and p.is_file():
        found = _from_gguf(p)
        return (found, "the model's GGUF general.sampling.*") if found else ({}, None)
    return {}, None


def chat_sampling(path: str | Path | None, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The chat's sampling arguments and each one's source: `given` (the flags; None = not
    given) wins, then the model's stored settings, then CHAT_DEFAULTS; key by key."""
    stored, where = model_sampling(path)
    chosen: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in dict.fromkeys([*CHAT_DEFAULTS, *stored, *given]):
        if given.get(key) is not None:
            chosen[key], sources[key] = given[key], "flags"
        elif key in stored:
            chosen[key], sources[key] = stored[key], where or ""
        elif key in CHAT_DEFAULTS:
            chosen[key], sources[key] = CHAT_DEFAULTS[key], CHAT_DEFAULTS_SOURCE
    if chosen.get("repetition_penalty") == 1.0:  # 1.0 = off: no penalty processor at all
        chosen["repetition_penalty"] = None
    # settings of an option that is off are left out (llama.cpp's penalty_last_n 0 or -1,
    # an xtc_threshold without xtc_probability): they would only be validated for nothing
    if not chosen.get("repetition_penalty") or chosen.get("repetition_context_size", 1) < 1:
        for key in ("repetition_context_size",):
            chosen.pop(key, None)
            sources.pop(key, None)
    if not chosen.get("xtc_probability"):
        for key in ("xtc_probability", "xtc_threshold"):
            chosen.pop(key, None)
            sources.pop(key, None)
    return chosen, sources


def describe(chosen: dict[str, Any], sources: dict[str, str]) -> str:
    """One line for chat's banner: the settings grouped by where they came from."""
    short = {"temperature": "temp", "repetition_penalty": "repeat-penalty",
             "repetition_context_size": "repeat-last-n"}
    groups: dict[str, list[str]] = {}
    for key, source in sources.items():
        value = chosen.get(key)
        text = "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
        groups.setdefault(source, []).append(f"{short.get(key, key.replace('_', '-'))} {text}")
    return "; ".join(f"{', '.join(items)} ({source})" for source, items in groups.items())
