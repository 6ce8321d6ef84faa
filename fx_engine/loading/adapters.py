"""LoRA / DoRA adapter files, and the set of adapters a model serves.

Formats read:
* mlx-lm (`mlx_lm.lora`): `adapters.safetensors` + `adapter_config.json` (`fine_tune_type`
  "lora" or "dora", `lora_parameters` {rank, scale, dropout, keys}, `num_layers`). Tensors
  `<module>.lora_a` [in, r], `<module>.lora_b` [r, out], DoRA's `<module>.m` [out];
  y = x W^T + scale (x a) b; DoRA: y = m / ||W + scale (a b)^T||_row * that, bias after.
* PEFT: `adapter_model.safetensors` + `adapter_config.json` (`peft_type` "LORA", `r`,
  `lora_alpha`, `use_rslora`, `use_dora`, `alpha_pattern`). Tensors
  `base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight` [out, r], DoRA's
  `lora_magnitude_vector` [out]; scale = alpha / r (alpha / sqrt(r) with rsLoRA).

Module names are the checkpoint's (`model.layers.3.self_attn.q_proj`); on a GGUF base they
are matched through llama.cpp's names (`blk.3.attn_q`). Dropout is ignored (inference).
Embedding, expert-stack and trained-bias adapters are refused with an error naming them.

The base weights are never changed: `AdapterSet` (one per loaded model, `Model.adapters`)
maps each adapter onto the model's linears (`nn.Linear.origin`) and keeps the stacked bank
the steps take (`core.adapters`). `fuse` merges one adapter into dense weights, as
`mlx_lm.fuse --dequantize` does.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.adapters import AdapterBank, Segment, bank_from, bucket
from fx_engine.core.checkpoint import WeightsError, dequantized
from fx_engine.core.nn import Linear, Quant, linears, row_major
from fx_engine.loading.weights import _TEXT_PREFIXES

__all__ = ["AdapterError", "AdapterSet", "RawAdapter", "fuse_params", "map_adapter", "read_adapter"]

MIN_SLOTS = 4  # slot bucket: no adapter + up to 3 before the stacks grow (a recompile)
MIN_RANK = 8


class AdapterError(WeightsError):
    """A missing, malformed or mismatched adapter; the message names the file and module."""


@attrs.frozen
class Factors:
    """One module's adapter: y += scale * (x @ a) @ b; DoRA: magnitude m (None: LoRA)."""

    a: Any  # [in, r]
    b: Any  # [r, out]
    scale: float
    m: Any = None  # [out] or None
    dora: bool = False


@attrs.frozen
class RawAdapter:
    path: str
    fmt: str  # "mlx-lm" or "peft"
    kind: str  # "lora" or "dora"
    modules: dict = attrs.field(eq=False)  # module name -> Factors
    num_layers: int | None  # mlx-lm's: the last N layers (None / -1: all)
    base: str | None  # the base model the adapter config names (for messages)
    fingerprint: str


def _load_safetensors(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as e:
        raise AdapterError(f"{path}: cannot read adapter weights ({e}); is the file truncated or corrupt?") from e


def _folder(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        p = p.parent
    if not p.exists():
        raise AdapterError(f"adapter path does not exist: {p}")
    if not p.is_dir():
        raise AdapterError(f"{p}: an adapter is a folder (adapter_config.json + adapters.safetensors "
                           "or adapter_model.safetensors)")
    if not (p / "adapter_config.json").exists():
        raise AdapterError(f"{p}: no adapter_config.json (is this an mlx-lm or PEFT adapter folder?)")
    return p


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _module_name(name: str) -> str:
    """A module of a multimodal checkpoint under its text model's name (the loader's rules)."""
    dotted = name + "."
    for old, new in _TEXT_PREFIXES:
        if dotted.startswith(old):
            return (new + dotted[len(old):])[:-1]
    return name


def read_adapter(path: str | Path) -> RawAdapter:
    """An adapter folder's factors, in either format (see the module docstring)."""
    p = _folder(path)
    try:
        cfg = json.loads((p / "adapter_config.json").read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{p / 'adapter_config.json'}: invalid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{p / 'adapter_config.json'}: expected a JSON object")
    if "peft_type" in cfg or (p / "adapter_model.safetensors").exists():
        return _read_peft(p, cfg)
    return _read_mlx(p, cfg)


def _read_mlx(p: Path, cfg: dict) -> RawAdapter:
    where = p / "adapter_config.json"
    # older mlx-lm versions wrote use_dora / lora_layers instead of fine_tune_type / num_layers
    kind = cfg.get("fine_tune_type", "dora" if cfg.get("use_dora") else "lora")
    if kind == "full":
        raise AdapterError(f"{where}: fine_tune_type 'full' is a full fine-tune, not an adapter: "
                           "load its weights as a model")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{where}: fine_tune_type must be 'lora' or 'dora', got {kind!r}")
    lp = cfg.get("lora_parameters")
    if not isinstance(lp, dict) or "scale" not in lp or "rank" not in lp:
        raise AdapterError(f"{where}: lora_parameters must be an object with 'rank' and 'scale'")
    scale, rank = float(lp["scale"]), int(lp["rank"])
    f = p / "adapters.safetensors"
    if not f.exists():
        raise AdapterError(f"{p}: no adapters.safetensors")
    tensors = _load_safetensors(f)
    modules: dict[str, dict[str, mx.array]] = {}
    for key, t in tensors.items():
        mod, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b", "m") or not mod:
            raise AdapterError(f"{f}: tensor '{key}' is not an adapter parameter (lora_a, lora_b, m)")
        modules.setdefault(mod, {})[leaf] = t
    out = {}
    for mod, parts in modules.items():
        if "lora_a" not in parts or "lora_b" not in parts:
            raise AdapterError(f"{f}: module '{mod}' needs both lora_a and lora_b")
        a, b = parts["lora_a"], parts["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != rank or b.shape[0] != rank:
            raise AdapterError(
                f"{f}: module '{mod}': lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not "
                f"have the configured rank {rank} (expected [in, {rank}] and [{rank}, out]; an "
                "embedding or expert adapter is not supported)")
        m = parts.get("m")
        if m is not None and (kind != "dora" or tuple(m.shape) != (b.shape[1],)):
            raise AdapterError(f"{f}: module '{mod}': magnitude 'm' {tuple(m.shape)} "
                               f"{'in a LoRA adapter' if kind != 'dora' else f'expected ({b.shape[1]},)'}")
        out[_module_name(mod)] = Factors(a=a, b=b, scale=scale, m=m, dora=kind == "dora")
    if not out:
        raise AdapterError(f"{f}: no adapter tensors")
    n = cfg.get("num_layers", cfg.get("lora_layers"))
    return RawAdapter(str(p), "mlx-lm", kind, out, None if n is None else int(n), cfg.get("model"),
                      _fingerprint([where, f]))


_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+?)\.(lora_A|lora_B|lora_magnitude_vector|"
                       r"lora_embedding_A|lora_embedding_B)(?:\.[A-Za-z_]+)?(?:\.weight)?$")


def _read_peft(p: Path, cfg: dict) -> RawAdapter:
    where = p / "adapter_config.json"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for field, ok in (("fan_in_fan_out", lambda v: not v), ("bias", lambda v: v in (None, "none")),
                      ("modules_to_save", lambda v: not v), ("use_qalora", lambda v: not v),
                      ("lora_bias", lambda v: not v), ("layer_replication", lambda v: not v)):
        if field in cfg and not ok(cfg[field]):
            raise AdapterError(f"{where}: {field}={cfg[field]!r} is not supported (an adapter that "
                               "changes the base's own tensors or layout)")
    f = p / "adapter_model.safetensors"
    if not f.exists():
        other = "adapter_model.bin" if (p / "adapter_model.bin").exists() else None
        raise AdapterError(f"{p}: no adapter_model.safetensors" + (
            f" ({other} is a pickle: convert it to safetensors)" if other else ""))
    alpha = float(cfg.get("lora_alpha", 8))  # PEFT's LoraConfig default
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rs = bool(cfg.get("use_rslora", False))
    dora = bool(cfg.get("use_dora", False))
    tensors = _load_safetensors(f)
    modules: dict[str, dict[str, mx.array]] = {}
    for key, t in tensors.items():
        hit = _PEFT_KEY.match(key)
        if hit is None:
            raise AdapterError(f"{f}: tensor '{key}' is not a LoRA parameter")
        mod, leaf = hit.groups()
        if leaf.startswith("lora_embedding"):
            raise AdapterError(f"{f}: module '{mod}' is an embedding adapter (not supported)")
        modules.setdefault(mod, {})[leaf] = t
    out = {}
    for mod, parts in modules.items():
        if "lora_A" not in parts or "lora_B" not in parts:
            raise AdapterError(f"{f}: module '{mod}' needs both lora_A and lora_B")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{f}: module '{mod}': lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               "are not [r, in] and [out, r] (a convolution or expert adapter?)")
        r = int(a.shape[0])
        al = alpha
        for pat, v in alpha_pattern.items():  # PEFT: the first pattern matching the name's end
            if re.fullmatch(rf"(.*\.)?{pat}", mod):
                al = float(v)
                break
        m = parts.get("lora_magnitude_vector")
        if dora and m is None:
            raise AdapterError(f"{f}: use_dora but module '{mod}' has no lora_magnitude_vector")
        if m is not None and (not dora or m.reshape(-1).shape[0] != b.shape[0]):
            raise AdapterError(f"{f}: module '{mod}': unexpected lora_magnitude_vector {tuple(m.shape)}")
        out[_module_name(mod)] = Factors(a=a.T, b=b.T, scale=al / (math.sqrt(r) if rs else r),
                                         m=None if m is None else m.reshape(-1), dora=dora)
    if not out:
        raise AdapterError(f"{f}: no adapter tensors")
    return RawAdapter(str(p), "peft", "dora" if dora else "lora", out, None,
                      cfg.get("base_model_name_or_path"), _fingerprint([where, f]))


# llama.cpp's names of the common projections: a GGUF base's linears carry these
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate_up_proj": "ffn_up"}


def _gguf_name(module: str) -> str | None:
    if module == "lm_head":
        return "output"
    hit = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)", module)
    if hit and hit.group(2) in _GGUF:
        return f"blk.{hit.group(1)}.{_GGUF[hit.group(2)]}"
    return None


def _rows_of(lin: Linear, start: int, n: int) -> mx.array:
    """Rows [start, start + n) of a linear's weight as float32 [n, in]."""
    lin = row_major(lin)  # (the 8-bit mode's interleaved weights: back in rows)
    if lin.quantized:
        q = lin.quant
        rows = Quant(q.scales[start : start + n], None if q.biases is None else q.biases[start : start + n],
                     q.group_size, q.bits, q.mode)
        return dequantized(Linear(weight=lin.weight[start : start + n], quant=rows), mx.float32).weight
    w = lin.weight.T if lin.transposed else lin.weight
    return w[start : start + n].astype(mx.float32)


def _index(params: Any) -> tuple[list[Linear], dict[str, tuple[int, int, int, int, int]]]:
    """{module name: (linear index, first row in the linear, rows, first row in the module,
    the module's rows)}: a tensor-parallel shard holds a slice of a module's rows."""
    lins = linears(params)
    where: dict[str, tuple[int, int, int, int, int]] = {}
    for i, lin in enumerate(lins):
        start = 0
        for name, rows, *part in lin.origin:
            m0, total = part if part else (0, rows)
            where[name] = (i, start, rows, m0, total)
            start += rows
    return lins, where


def map_adapter(params: Any, raw: RawAdapter, num_layers: int | None = None
                ) -> tuple[dict[int, list[Segment]], dict[int, tuple[int, int]]]:
    """Each module's factors placed on the model's linears: ({linear index: segments},
    {linear index: (in, out)}).
    Raises AdapterError for a module the model does not have (or cannot adapt), a shape
    that does not match, or a layer outside the adapter's own num_layers."""
    lins, where = _index(params)
    base = f" (the adapter was made for {raw.base})" if raw.base else ""
    # a pipeline stage holds some layers: modules of the others' are theirs to apply
    pipe = getattr(params, "pipeline", None)  # core.models.skeleton.PipelineStage, or None
    if pipe:
        num_layers = pipe.num_layers
    out: dict[int, list[Segment]] = {}
    shapes: dict[int, tuple[int, int]] = {}
    for mod, fac in sorted(raw.modules.items()):
        hit = where.get(mod) or where.get(_gguf_name(mod) or "")
        if hit is None and re.search(r"embed|wte|token_embd", mod):
            raise AdapterError(f"{raw.path}: module '{mod}' is an embedding table (adapters on "
                               "embeddings are not supported)")
        layer = re.search(r"(?:layers|blk)\.(\d+)\.", mod)
        if hit is None and pipe and layer and not pipe.first_layer <= int(layer.group(1)) < pipe.first_layer + len(
                params.layers) and int(layer.group(1)) < pipe.num_layers:
            continue  # another stage's layer
        if hit is None and pipe and not layer and pipe.hands_on:
            continue  # the head's (or another module outside the layers): the last stage's
        if hit is None and mod in ("lm_head", "output") and getattr(params, "lm_head", None) is not None \
                and params.lm_head.shard is not None:
            raise AdapterError(f"{raw.path}: module '{mod}': adapters on a vocabulary-sharded output "
                               "head (tensor parallelism) are not supported")
        if hit is None:  # (a linear kept apart by name: "<module> (why)", `nn.Linear.origin`)
            why = next((n[len(mod) + 2 : -1] for n in where if n.startswith(mod + " (")), None)
            if why:
                raise AdapterError(f"{raw.path}: module '{mod}' cannot be adapted: {why}")
            close = difflib.get_close_matches(mod, list(where), n=2)
            raise AdapterError(f"{raw.path}: module '{mod}' is not a linear of this model{base}"
                               + (f"; close: {', '.join(close)}" if close else ""))
        i, start, rows, m0, total = hit
        lin = lins[i]
        if lin.weight.ndim != 2 or (lin.quantized and lin.quant.mode != "affine"):
            raise AdapterError(f"{raw.path}: module '{mod}' is an expert stack (adapters on "
                               "experts are not supported)")
        if raw.num_layers is not None and num_layers is not None and 0 <= raw.num_layers < num_layers:
            m = re.search(r"(?:layers|blk)\.(\d+)\.", mod)
            if m and int(m.group(1)) < num_layers - raw.num_layers:
                raise AdapterError(f"{raw.path}: module '{mod}' is outside the adapter's last "
                                   f"num_layers={raw.num_layers} of {num_layers} layers")
        k = lin.in_features
        # a row-parallel shard (a "sum" Shard) holds input features [first, end) of width
        summed = lin.shard is not None and lin.shard.kind == "sum"
        k0, k1, k_full = (lin.shard.first, lin.shard.end, lin.shard.width) if summed else (0, k, k)
        if fac.a.shape[0] != k_full or fac.b.shape[1] != total:
            raise AdapterError(
                f"{raw.path}: module '{mod}' maps [{fac.a.shape[0]} -> {fac.b.shape[1]}] but the "
                f"model's is [{k_full} -> {total}]{base}: an adapter for another base model?")
        a = fac.a.astype(mx.float32)[k0:k1]
        b = (fac.b.astype(mx.float32) * fac.scale)[:, m0 : m0 + rows]
        mag = None
        if fac.dora:
            w = _rows_of(lin, start, rows)
            sq_w = mx.sum(w * w, axis=1)
            adapted = w + (b.T @ a.T)
            sq = mx.sum(adapted * adapted, axis=1)
            if summed:  # the row norms span every rank's input slice
                sq, sq_w = (mx.distributed.all_sum(v, group=lin.shard.group) for v in (sq, sq_w))
            m = fac.m.astype(mx.float32)[m0 : m0 + rows] if fac.m is not None else mx.sqrt(sq_w)
            mag = m / mx.sqrt(sq)
        out.setdefault(i, []).append(Segment(start=start, a=a, b=b, mag=mag))
        shapes[i] = (k, lin.out_features)
    for segs in out.values():
        segs.sort(key=lambda s: s.start)
    mx.eval([[s.a, s.b] + ([s.mag] if s.mag is not None else []) for segs in out.values() for s in segs])
    return out, shapes


@attrs.frozen
class LoadedAdapter:
    name: str
    slot: int
    raw: RawAdapter = attrs.field(eq=False)
    segments: dict = attrs.field(eq=False)  # linear index -> [Segment]
    shapes: dict = attrs.field(eq=False)  # linear index -> (in, out)

    @property
    def fingerprint(self) -> str:
        return self.raw.fingerprint


class AdapterSet:
    """The adapters one loaded model serves (shell state: `Model.adapters`). Each adapter
    keeps its slot for the model's lifetime; the stacked bank is rebuilt on a load and
    handed to the steps as a whole (immutable arrays), so a step never sees a half-built
    bank. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, LoadedAdapter] = {}
        self._bank: AdapterBank | None = None
        self._n_linears = 0
        self._frozen: str | None = None

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> LoadedAdapter:
        hit = self._by_name.get(name)
        if hit is None:
            known = ", ".join(self._by_name) or "none loaded"
            raise ValueError(f"adapter: unknown adapter {name!r} ({known})")
        return hit

    def freeze(self, why: str) -> None:
        """No more loads (every rank of a sharded model must hold the same adapters)."""
        self._frozen = why

    def add(self, params: Any, path: str | Path, name: str | None, num_layers: int | None) -> LoadedAdapter:
        if self._frozen:
            raise ValueError(f"load_adapter: {self._frozen}")
        raw = read_adapter(path)
        name = name if name is not None else Path(raw.path).name
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._\-/]{1,128}", name):
            raise ValueError(f"name must be 1-128 characters of letters, digits and ._-/, got {name!r}")
        segments, shapes = map_adapter(params, raw, num_layers)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"name: an adapter named {name!r} is already loaded")
            slot = len(self._by_name) + 1
            entry = LoadedAdapter(name, slot, raw, segments, shapes)
            n = len(linears(params))
            bank = self._build(list(self._by_name.values()) + [entry], n)
            # materialized here: a running engine's thread must only ever see finished arrays
            mx.eval([[st.a, st.b] + ([st.mag] if st.mag is not None else []) for st in bank.stacks if st is not None])
            self._bank = bank
            self._by_name[name] = entry
            self._n_linears = n
        return entry

    @staticmethod
    def _build(entries: list[LoadedAdapter], n_linears: int) -> AdapterBank:
        shapes: dict[int, tuple[int, int]] = {}
        slots: dict[int, dict[int, list[Segment]]] = {}
        for e in entries:
            for i, segs in e.segments.items():
                slots.setdefault(i, {})[e.slot] = segs
                shapes[i] = e.shapes[i]
        return bank_from(n_linears, shapes, slots, bucket(len(entries) + 1, MIN_SLOTS), MIN_RANK)

    def bank(self) -> AdapterBank | None:
        return self._bank


def fuse_params(params: Any, segments: dict[int, list[Segment]], dtype: Any) -> Any:
    """params with each adapted linear made dense and the adapter merged into its rows:
    W[rows] += (a b)^T (scale folded into b), then DoRA's magnitude over the rows."""
    from fx_engine.core.adapters import map_linears

    def fuse(i: int, lin: Linear) -> Linear:
        segs = segments.get(i)
        if not segs:
            return lin
        w = _rows_of(lin, 0, lin.out_features)
        parts, at = [], 0
        for s in segs:
            rows = s.b.shape[1]
            parts.append(w[at : s.start])
            seg = w[s.start : s.start + rows] + (s.a @ s.b).T
            parts.append(seg if s.mag is None else s.mag[:, None] * seg)
            at = s.start + rows
        parts.append(w[at:])
        merged = mx.concatenate(parts, axis=0).astype(dtype)
        return attrs.evolve(lin, weight=mx.contiguous(merged.T), quant=None,
                            transposed=True)  # tensor-parallel marks (shard) kept

    return map_linears(params, fuse)
