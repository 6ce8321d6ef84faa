"""Learned drafters' checkpoints (issue 45): EAGLE-3 head folders as they are published,
and the MTP modules target checkpoints ship beside their layers.

    load_eagle3_head(path, target=None, dtype=None, revision=None) -> Eagle3Params
    load_mtp_module(path, target=None, dtype=None, revision=None) -> MtpParams
    mtp_summary(path) -> str | None            (`fx-engine info`'s line)

A head folder is a config.json (EAGLE's / SpecForge's flat Llama config with
draft_vocab_size and target_hidden_size, or vLLM's speculators format) and its weights in
safetensors (model.safetensors, or shards with model.safetensors.index.json) as SpecForge's,
vLLM's speculators', NVIDIA's and SGLang's heads are published, or in PyTorch's
pytorch_model.bin (or its shards) as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and AngelSlim's
are: read without torch and without running the pickle (`loading.torch_pickle`). `path`
is a local folder or a Hugging Face repo id (`loading.hub.resolve_model`). The config and
tensors are read by `fx_engine.core.drafters.eagle3` (which refuses, naming the field or
tensor, what it does not run); given the target (a Model or its config), the head is checked against it
(`eagle3.check_target`: hidden size, vocabulary, aux layers in range).

The engine's drafter around a loaded head is `fx_engine.engine.eagle3_drafter.Eagle3Drafter`
(`Eagle3Drafter.load(path, target)` calls this).

MTP modules (DeepSeek-V3, GLM-4.5, Qwen3-Next / Qwen3.5, MiMo) live in the target's own
checkpoint: a Hugging Face folder's safetensors (model.layers.{N}.*, mtp.*,
model.mtp_layers.*: only the shards holding them are opened, and only their tensors read)
or a GGUF where llama.cpp writes them (glm4moe's blk.{N}.nextn.*: only those tensors are
converted). The text model's own loader leaves them unread. `fx_engine.core.drafters.mtp`
reads the config and tensors (and refuses, naming the field or tensor, what it does not
run); the engine's drafter around them is `fx_engine.engine.mtp_drafter.MtpDrafter`
(`MtpDrafter.from_model(model)` calls `load_mtp_module(model.path, model)`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.core.checkpoint import LoadOptions, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Numerics
from fx_engine.core.drafters import eagle3, mtp
from fx_engine.loading.fp8 import dequantize_fp8, fp8_blocks
from fx_engine.loading.hub import resolve_model
from fx_engine.loading.torch_pickle import read_torch_checkpoint
from fx_engine.loading.weights import index_shards, read_weight_map

__all__ = ["is_eagle3_head", "is_mtp_checkpoint", "load_eagle3_head", "load_mtp_module", "mtp_config", "mtp_summary",
           "read_head_folder"]


def _config_file(path: str | Path) -> Path | None:
    """config.json of a local folder, or of a Hub repo id: its cached snapshot's, else that
    one small file fetched (not the weights); None when there is none to read."""
    local = Path(path).expanduser()
    if local.exists():
        return local / "config.json"
    from fx_engine.loading.hub import cached_snapshot, parse_model_id

    parsed = parse_model_id(str(path))
    if parsed is None or parsed[1] is not None:
        return None
    snap = cached_snapshot(parsed[0], None)
    if snap is not None and (snap / "config.json").is_file():
        return snap / "config.json"
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(parsed[0], "config.json"))
    except Exception:  # noqa: BLE001 - offline, no such repo or file: not a head we can see
        return None


def _config_of(path: str | Path) -> dict[str, Any] | None:
    """`_config_file`'s JSON object, None when there is none or it is not one."""
    cfg_file = _config_file(path)
    if cfg_file is None:
        return None
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def is_eagle3_head(path: str | Path) -> bool:
    """Whether `path` (a local folder or GGUF, or a Hub repo id) holds an EAGLE-3 head rather
    than a model (for a command line's or server's one draft option: a head's config.json
    names an Eagle3 architecture, vLLM's speculators type eagle3, or a draft_vocab_size; a
    GGUF's architecture is eagle3). A repo id's config.json alone is read (cached, or
    fetched: no weights)."""
    local = Path(path).expanduser()
    if local.is_file():  # llama.cpp's conversion: a GGUF of architecture eagle3
        from fx_engine.loading.gguf import read_gguf_metadata

        try:
            return read_gguf_metadata(local).get("general.architecture") == "eagle3"
        except WeightsError:
            return False
    raw = _config_of(path)
    if raw is None:
        return False
    archs = raw.get("architectures") or []
    return (raw.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in raw
            or any("eagle3" in str(a).lower() for a in archs))


def is_mtp_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds MTP modules alone, published apart from their target (for a
    command line's or server's one draft option): SGLang's NextN exports (config.json's
    architecture ...NextN, e.g. DeepseekV3ForCausalLMNextN: the module as layer 0, no
    trunk; a local folder or a Hub repo id, its config.json alone read), or a GGUF whose
    metadata declares NextN layers and which holds no trunk layer (llama.cpp's MTP-only
    files: `convert_hf_to_gguf.py --mtp`, the companion of a `--no-mtp` target)."""
    from fx_engine.loading.gguf import read_gguf_metadata, read_gguf_tensor_names

    local = Path(path).expanduser()
    if local.is_file():
        try:
            if not mtp.mtp_layers_in_gguf(read_gguf_metadata(local)):
                return False
            return not any(n.startswith("blk.0.") for n in read_gguf_tensor_names(local))
        except (WeightsError, ConfigError):
            return False
    raw = _config_of(path)
    return raw is not None and mtp.is_nextn_export(raw)


def _weight_files(folder: Path) -> list[Path]:
    """The head's weight files: the safetensors (one file, or the shards
    model.safetensors.index.json names, all present), else PyTorch's pytorch_model.bin (or
    the shards pytorch_model.bin.index.json names)."""
    for index, pattern in ((folder / "model.safetensors.index.json", "*.safetensors"),
                           (folder / "pytorch_model.bin.index.json", "pytorch_model*.bin")):
        if index.is_file():
            return [folder / n for n in index_shards(index)]
        files = sorted(folder.glob(pattern))
        if files:
            return files
    return []


def read_head_folder(folder: Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(config.json as a dict, every tensor of the folder's weight files: `_weight_files`)."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{folder}: no config.json (an EAGLE-3 head folder has config.json and its weights)")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ConfigError(f"{cfg_file}: not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object")
    files = _weight_files(folder)
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        raise WeightsError(f"{folder}: no weights (model*.safetensors or pytorch_model*.bin)"
                           + (f"; it has {', '.join(others)}" if others else ""))
    tensors: dict[str, mx.array] = {}
    for f in files:
        if f.suffix == ".bin":
            loaded = read_torch_checkpoint(f)
        else:
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
    folder = resolve_model(path, revision=revision, torch_bins=True)
    target_cfg = getattr(target, "config", target)
    name = dtype or getattr(getattr(target, "params", None), "dtype", None) or "float32"
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {name!r}")
    if folder.is_file() and _is_gguf(folder):  # llama.cpp's conversion of a head (architecture eagle3)
        cfg, params = _gguf_head(folder, getattr(mx, name))
    elif not folder.is_dir():
        raise ConfigError(f"{path}: an EAGLE-3 head is a folder (config.json and its weights) or llama.cpp's "
                          f"eagle3 GGUF, got {folder}")
    else:
        raw, tensors = read_head_folder(folder)
        cfg = eagle3.config_from_hf(raw, str(folder / "config.json"))
        params = eagle3.eagle3_params_from_tensors(
            tensors, cfg, LoadOptions(dtype=getattr(mx, name), where=str(folder)))
    if target_cfg is not None:
        eagle3.check_target(cfg, target_cfg, own_embed=params.embed is not None)
    return params


def _is_gguf(path: Path) -> bool:
    """Whether a file starts with GGUF's magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_head(path: Path, dtype: Any) -> tuple[eagle3.Eagle3Config, eagle3.Eagle3Params]:
    """A head llama.cpp's converter wrote (`convert_hf_to_gguf.py HEAD --target-model-dir
    TARGET`: architecture eagle3), its matrices dequantized to `dtype` (a CLI head is
    requantized for the native kernels by `Eagle3Drafter.load(bits=8)`)."""
    from fx_engine.loading.gguf import read_gguf, read_gguf_metadata

    md = read_gguf_metadata(path)
    if md.get("general.architecture") != "eagle3":
        raise ConfigError(f"{path}: GGUF architecture {md.get('general.architecture')!r} is a model, not an "
                          "EAGLE-3 head (eagle3)")
    tensors, _ = read_gguf(path)
    if "output.weight" not in tensors:
        raise WeightsError(f"{path}: missing tensor 'output.weight' (the head's draft-vocabulary lm_head)")
    cfg = eagle3.config_from_gguf(md, tensors["output.weight"].shape[0], str(path))
    return cfg, eagle3.eagle3_params_from_gguf(tensors, cfg, LoadOptions(dtype=dtype, where=str(path)))


# ---------------------------------------------------------------- MTP modules in target checkpoints


def mtp_config(path: str | Path) -> mtp.MtpConfig:
    """The MTP modules a checkpoint (a local model folder or GGUF file) ships, from its
    config.json or GGUF metadata; a checkpoint that ships none is a ConfigError naming it
    and the field that says so."""
    from fx_engine.loading.gguf import read_gguf_metadata
    from fx_engine.loading.weights import read_json_object

    path = Path(path)
    try:
        if path.is_file():
            return mtp.config_from_gguf(read_gguf_metadata(path), str(path))
        raw, cfg_file = read_json_object(path)
        return mtp.config_from_hf(raw, str(cfg_file))
    except ConfigError as e:
        raise ConfigError(f"{path}: the checkpoint ships no MTP module fx-engine can draft with ({e})") from None


def _prefixes(cfg: mtp.MtpConfig) -> tuple[str, ...]:
    """Where a checkpoint keeps the modules' tensors (Hugging Face names)."""
    if cfg.kind == "qwen3_next":
        return ("mtp.",)
    if cfg.kind == "mimo":
        return ("model.mtp_layers.",)
    return tuple(mtp.module_prefix(cfg, k) for k in range(cfg.num_modules))


def _safetensors_names(folder: Path) -> dict[str, list[str]]:
    """file name -> the tensor names it holds, from the index or each file's header (no
    tensor read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, list[str]] = {}
        for name, file in read_weight_map(index).items():
            out.setdefault(file, []).append(name)
        return out
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError) as e:
            raise WeightsError(f"{f}: cannot read the safetensors header ({e})") from e
        out[f.name] = [n for n in header if n != "__metadata__"]
    return out


def _mtp_checkpoint(path: str | Path, revision: str | None) -> Path:
    """The local checkpoint holding `path`'s MTP modules: a local path, a cached snapshot, or
    for a Hub repo id of a sharded folder only what reading the modules needs: config.json,
    the index and the shards holding their tensors (an original checkpoint is hundreds of
    GB; its modules one or two shards). Other repos resolve as models do."""
    from fx_engine.loading.hub import cached_snapshot, parse_model_id

    parsed = parse_model_id(str(path))
    if Path(path).expanduser().exists() or parsed is None or parsed[1] is not None:
        return resolve_model(path, revision=revision)
    repo = parsed[0]
    snap = cached_snapshot(repo, revision)
    index_name = "model.safetensors.index.json"
    try:
        from huggingface_hub import HfApi, hf_hub_download, snapshot_download

        if snap is None or not (snap / "config.json").is_file():
            files = HfApi().list_repo_files(repo, revision=revision)
            if index_name not in files or "config.json" not in files:
                return resolve_model(path, revision=revision)
            for name in ("config.json", index_name):
                snap = Path(hf_hub_download(repo, name, revision=revision)).parent
        if not (snap / index_name).is_file():
            return resolve_model(path, revision=revision)
        prefixes = _prefixes(mtp_config(snap))
        shards = sorted({f for f, names in _safetensors_names(snap).items()
                         if any(n.startswith(prefixes) for n in names)})
        if all((snap / f).is_file() for f in shards):
            return snap
        return Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=["config.json", index_name, *shards]))
    except (ConfigError, WeightsError):
        raise
    except Exception:  # noqa: BLE001 - offline or no such repo: resolve_model says what it tried
        return resolve_model(path, revision=revision)


def _keep_like(target: Any) -> Any:
    """Which quantized linears stay quantized, as the target's load chose (on CPU: what the
    native kernels run when the target uses them, else none; elsewhere all)."""
    if mx.default_device() != mx.cpu:
        return True
    numerics = getattr(getattr(target, "params", None), "numerics", None)
    if numerics is not None and numerics.native:
        from fx_engine.runtime import native

        return lambda group, bits: native.supports(group, bits)
    return False


def load_mtp_module(path: str | Path, target: Any = None, *, dtype: str | None = None,
                    revision: str | None = None) -> mtp.MtpParams:
    """The MTP modules of the checkpoint at `path` (a model folder, a GGUF file, or a Hub
    repo id): its config read with `mtp.config_from_hf` / `config_from_gguf`, the modules'
    tensors alone read under their published names (the target's tables are not read
    again: the drafter uses the loaded target's).

    target: the Model the modules draft for: checked against it (`mtp.check_target`:
    family, hidden size, vocabulary, layer count), and its dtype, numerics and quantized-
    weight policy used; None: float32, not checked. A checkpoint that ships no module is a
    ConfigError naming it; one whose config declares modules its weights do not hold (mlx-lm
    and most converters drop them) a WeightsError saying so."""
    from fx_engine.loading.weights import gguf_read_options, mlx_quantization

    where = _mtp_checkpoint(path, revision)
    cfg = mtp_config(where)
    if where.is_dir():  # (before any weights are read: a scheme not read is refused by name)
        mlx_quantization(json.loads((where / "config.json").read_text()), where / "config.json")
    target_cfg = getattr(target, "config", None)
    if target_cfg is not None:
        mtp.check_target(cfg, target_cfg)
    name = dtype or getattr(getattr(target, "params", None), "dtype", None) or "float32"
    if name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {name!r}")
    keep = _keep_like(target) if target is not None else False
    # the target's numerics, its 8-bit mode included: the modules read the target's head
    # (lm_head or the tied table), which that mode keeps in qmm_a8's interleaved layout that
    # only its product reads; the modules' own matrices stay in rows, which qmm_a8 reads too
    # (as an EAGLE-3 head quantized at load runs in the target's numerics)
    numerics = getattr(getattr(target, "params", None), "numerics", None) or Numerics()
    described = f"{cfg.num_modules} MTP module{'s' if cfg.num_modules > 1 else ''}"
    if where.is_file():  # a GGUF: llama.cpp's NextN layers, blk.{N + k}.*
        from fx_engine.loading.gguf import read_gguf

        blocks = tuple(f"blk.{cfg.first_layer + k}." for k in range(cfg.num_modules))
        store_bits, compact = gguf_read_options(getattr(mx, name), keep, numerics)
        tensors, _ = read_gguf(where, store_bits, compact, only=lambda n: n.startswith(blocks))
        if not any(".nextn." in n for n in tensors):
            raise WeightsError(f"{where}: its metadata declares {described} but the file holds no "
                               f"blk.{cfg.first_layer}.nextn.* tensors")
        opts = LoadOptions(dtype=getattr(mx, name), keep_quantized=keep, numerics=numerics, where=str(where))
        return mtp.mtp_params_from_gguf(tensors, cfg, opts)
    prefixes = _prefixes(cfg)
    files = {f: names for f, names in _safetensors_names(where).items()
             if any(n.startswith(prefixes) for n in names)}
    if not files:
        raise WeightsError(f"{where}: config.json declares {described} but its weights hold no tensor under "
                           f"{', '.join(repr(p + '*') for p in prefixes)} (mlx-lm's conversions, and most "
                           "others, drop them: use the original checkpoint)")
    tensors: dict[str, mx.array] = {}
    for f in sorted(files):
        if not (where / f).is_file():
            raise WeightsError(f"{where}: shard file missing: {f}")
        try:
            loaded = mx.load(str(where / f))  # (lazy: only the modules' tensors are read)
        except Exception as e:  # mlx's messages are terse
            raise WeightsError(f"{where / f}: cannot read weights ({e}); is the file truncated or corrupt?") from e
        tensors.update({n: a for n, a in loaded.items() if n.startswith(prefixes)})
    raw = json.loads((where / "config.json").read_text())
    quant = mlx_quantization(raw, where / "config.json")
    blocks = fp8_blocks(raw, where / "config.json")
    if blocks is not None:  # DeepSeek-V3's original and its NextN exports: FP8 blocks
        tensors = dequantize_fp8(tensors, blocks, getattr(mx, name), where)
    opts = LoadOptions(dtype=getattr(mx, name), keep_quantized=keep, numerics=numerics, quant=quant,
                       where=str(where))
    return mtp.mtp_params_from_tensors(tensors, cfg, opts)


def mtp_summary(path: str | Path) -> str | None:
    """`fx-engine info`'s line on the speculative modules a local checkpoint ships (None:
    none): e.g. "1 MTP module (DeepSeek-V3 format, from model.layers.61.*)", with a note
    when the config declares modules the weights do not hold. Reads headers only."""
    from fx_engine.loading.gguf import read_gguf_metadata

    path = Path(path)
    alone = f"; published alone (no trunk): --draft-model {path} drafts with it beside its target"
    if path.is_file():
        md = read_gguf_metadata(path)
        n = mtp.mtp_layers_in_gguf(md)
        if not n:
            return None
        arch = md.get("general.architecture")
        try:
            cfg = mtp.config_from_gguf(md, str(path))
        except ConfigError:
            return f"{n} MTP (NextN) layer{'s' if n > 1 else ''} ({arch}; not read by fx-engine for this architecture)"
        line = f"{n} MTP (NextN) layer{'s' if n > 1 else ''} ({arch}, from blk.{cfg.first_layer}.nextn.*)"
        return line + (alone if is_mtp_checkpoint(path) else "; --draft-model mtp drafts with it")
    from fx_engine.loading.weights import read_json_object

    raw, _ = read_json_object(path)
    line = mtp.describe(raw)
    if line is None:
        return None
    try:
        prefixes = _prefixes(mtp.config_from_hf(raw))
        names = [n for names in _safetensors_names(path).values() for n in names]
    except (ConfigError, WeightsError) as e:
        return f"{line}; not usable here: {e}"
    if not any(n.startswith(prefixes) for n in names):
        return f"{line}; but the weights do not hold it (dropped at conversion): --draft-model mtp is refused"
    return line + (alone if is_mtp_checkpoint(path) else "; --draft-model mtp drafts with it")
