"""Learned drafters' checkpoints (issue 45): EAGLE-3 head folders as they are published.

    load_eagle3_head(path, target=None, dtype=None, revision=None) -> Eagle3Params

A head folder is a config.json (EAGLE's / SpecForge's flat Llama config with
draft_vocab_size and target_hidden_size, or vLLM's speculators format) and its weights in
safetensors (model.safetensors, or shards with model.safetensors.index.json), as
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's, vLLM's speculators' and SGLang's heads
are published (a head that only ships pytorch_model.bin must be converted to safetensors
first: reading pickles is not done here). `path` is a local folder or a Hugging Face repo
id (`loading.hub.resolve_model`). The config and tensors are read by
`fx_engine.core.drafters.eagle3` (which refuses, naming the field or tensor, what it does
not run); given the target (a Model or its config), the head is checked against it
(`eagle3.check_target`: hidden size, vocabulary, aux layers in range).

The engine's drafter around a loaded head is `fx_engine.engine.eagle3_drafter.Eagle3Drafter`
(`Eagle3Drafter.load(path, target)` calls this).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.core.checkpoint import LoadOptions, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import eagle3
from fx_engine.loading.hub import resolve_model

__all__ = ["is_eagle3_head", "load_eagle3_head", "read_head_folder"]


def is_eagle3_head(path: str | Path) -> bool:
    """Whether the local folder `path` holds an EAGLE-3 head rather than a model (for a
    command line's or server's one draft option: a head's config.json names an Eagle3
    architecture, vLLM's speculators type eagle3, or a draft_vocab_size). No download."""
    cfg_file = Path(path).expanduser() / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    archs = raw.get("architectures") or []
    return (raw.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in raw
            or any("eagle3" in str(a).lower() for a in archs))


def read_head_folder(folder: Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(config.json as a dict, every tensor of the folder's safetensors files): one file, or
    the shards its model.safetensors.index.json names (all present)."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{folder}: no config.json (an EAGLE-3 head folder has config.json and safetensors)")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ConfigError(f"{cfg_file}: not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: malformed index ({e})") from e
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WeightsError(f"{index}: shard files missing: {', '.join(missing)}")
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" (it has {', '.join(pickles)}: convert them to safetensors, e.g. with safetensors.torch."
                "save_file over torch.load's state dict)") if pickles else ""
        raise WeightsError(f"{folder}: no *.safetensors files{hint}")
    tensors: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except Exception as e:  # mlx's messages are terse
            raise WeightsError(f"{f}: cannot read weights ({e}); is the file truncated or corrupt?") from e
        for name in loaded:
            if name in tensors:
                raise WeightsError(f"{folder}: tensor '{name}' is in more than one file")
        tensors.update(loaded)
    return raw, tensors


def load_eagle3_head(path: str | Path, target: Any = None, *, dtype: str | None = None,
                     revision: str | None = None) -> eagle3.Eagle3Params:
    """An EAGLE-3 head's params from its folder (or Hub repo id).

    target: the Model (or its config) the head drafts for: checked against it (ConfigError
    naming the field: target_hidden_size vs hidden_size, vocab_size, the aux layer ids, the
    embeddings); None: not checked. dtype: the head's activation/weight dtype ("float32",
    "float16", "bfloat16"); default the target's (a Model's), else float32."""
    folder = resolve_model(path, revision=revision)
    if not folder.is_dir():
        raise ConfigError(f"{path}: an EAGLE-3 head is a folder (config.json and safetensors), got {folder}")
    raw, tensors = read_head_folder(folder)
    cfg = eagle3.config_from_hf(raw, str(folder / "config.json"))
    target_cfg = getattr(target, "config", target)
    name = dtype or getattr(getattr(target, "params", None), "dtype", None) or "float32"
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {name!r}")
    params = eagle3.eagle3_params_from_tensors(
        tensors, cfg, LoadOptions(dtype=getattr(mx, name), where=str(folder)))
    if target_cfg is not None:
        eagle3.check_target(cfg, target_cfg, own_embed=params.embed is not None)
    return params
