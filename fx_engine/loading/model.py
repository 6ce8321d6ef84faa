"""`fx_engine.load`: a model = config + params pytree + tokenizer (+ where it came from)."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import attrs
import mlx.core as mx

from fx_engine.loading.adapters import AdapterSet, fuse_params
from fx_engine.loading.default_model import default_model_path
from fx_engine.loading.gguf import gguf_files
from fx_engine.loading.hub import resolve_model
from fx_engine.progress import working
from fx_engine.runtime import native as fx_native
from fx_engine.loading.weights import KeepQuantized, WeightsError, load_gguf, load_hf_folder
from fx_engine.core.cache import KVCache, LayerSpec, init_cache
from fx_engine.core.models import AnyParams, cache_layout
from fx_engine.core.adapters import map_linears
from fx_engine.core.nn import (MatmulPlan, Numerics, interleave_for_a8, linears, row_major, two_codes,
                               with_implied_bias)
from fx_engine.core.config import ConfigError
from fx_engine.core.tree import tree_leaves

QUANTIZED_KV_START = 5000  # mlx-lm's default: short contexts keep a float cache


@attrs.frozen
class Model:
    config: Any  # the family's frozen config (fx_engine.core.models)
    params: AnyParams
    tokenizer: Any
    path: str
    fingerprint: str
    weight_format: str  # e.g. "gguf (Q4_1/Q8_0) -> float32"
    # KV cache options (mlx-lm's kv_bits / kv_group_size / quantized_kv_start)
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START
    # The float KV cache's element type (None: the activations' dtype). "float16" halves
    # the bytes a decode step's attention reads (llama.cpp's default cache type).
    kv_dtype: str | None = None
    # What fx_engine.runtime.native.plan measured to choose params.numerics.matmul (None: not
    # measured: no native kernels, 8-bit activations, or no quantized linears).
    matmul_report: Any = attrs.field(default=None, eq=False)
    # The LoRA / DoRA adapters this model serves (`load_adapter`; loading/adapters.py).
    # Shared by the model's variants (with_numerics, with_kv_cache): same linears.
    adapters: AdapterSet = attrs.field(factory=AdapterSet, eq=False)
    # how many processes hold this model's shards or stages (core/parallel.py; 1: all here)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # A cap on the context below the model's own (`with_max_context`; CLI --max-kv-size):
    # prompt + max_tokens beyond it is refused. None: the model's max_position_embeddings.
    max_context: int | None = None
    # A multimodal checkpoint's image path (issue 46): the vision tower and projector's
    # params (`core.vision`, e.g. gemma3.Gemma3VisionParams; None: a text-only model) and
    # the folder's preprocessing rules (`loading.images.ImageProcessorConfig`)
    vision: Any = attrs.field(default=None, eq=False)
    image_processor: Any = attrs.field(default=None, eq=False)

    @property
    def context_length(self) -> int:
        """The longest sequence (prompt + generated tokens) a request may reach: the model's
        max_position_embeddings, or `max_context` when that is smaller."""
        own = int(self.config.max_position_embeddings)
        return own if self.max_context is None else min(own, self.max_context)

    def with_max_context(self, tokens: int | None) -> "Model":
        """The same model with its context capped at `tokens` (llama.cpp's -c, mlx-lm's
        --max-kv-size as a hard limit): requests whose prompt + max_tokens exceed it are
        refused, so no cache grows past it. None: the model's own context. The RoPE and
        every other numeric stay the model's."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"max_context must be a positive integer or None, got {tokens!r}")
        return attrs.evolve(self, max_context=tokens)

    @property
    def ranks(self) -> int:
        """The processes that run this model together (every one runs the same steps)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_ids)
        return tuple(sorted(ids))

    @property
    def numerics(self) -> str:
        """Which numerics run: "int8" (8-bit activations into the quantized matmuls) or
        "exact" (float32 activations), as `load(numerics=...)` chose."""
        return "int8" if self.params.numerics.activation_bits == 8 else "exact"

    def with_numerics(self, numerics: Numerics | str) -> "Model":
        """The same weights in other numerics: "exact" or "int8" (see `load`), or a
        `fx_engine.core.nn.Numerics`. The 8-bit mode's matrices are re-laid out (its
        interleaved layout, or back to rows) so each mode reads what it expects."""
        old = self.params.numerics
        if isinstance(numerics, str):
            if numerics not in ("exact", "int8"):
                raise ValueError(f"numerics must be 'exact', 'int8' or a Numerics, got {numerics!r}")
            if numerics == "int8" and not old.native:
                raise ValueError("numerics='int8' needs fx-engine's native CPU kernels (this model "
                                 "was loaded with native=False)")
            numerics = attrs.evolve(old, activation_bits=8 if numerics == "int8" else None)
        elif not isinstance(numerics, Numerics):
            raise ValueError(f"numerics must be 'exact', 'int8' or a Numerics, got {numerics!r}")
        params = self.params
        if numerics.activation_bits == 8 and old.activation_bits != 8 and _on_cpu():
            params = _interleave_a8(params)
        elif numerics.activation_bits != 8 and old.activation_bits == 8:
            params = map_linears(params, lambda _, lin: _by_row_chunks(row_major, lin))
            if numerics.native and numerics.matmul == MatmulPlan() and _on_cpu():
                # (an 8-bit load measures no float32 kernel plan: take the one `load` would,
                # measured once per machine and shape, so the logits are a fresh load's)
                from fx_engine.runtime.native import plan

                report = plan.choose(params)
                if report is not None:
                    numerics = attrs.evolve(numerics, matmul=report.plan)
        fingerprint = self.fingerprint.removesuffix("-int8") + ("-int8" if numerics.activation_bits == 8 else "")
        return attrs.evolve(self, params=attrs.evolve(params, numerics=numerics), fingerprint=fingerprint)

    def with_kv_cache(
        self, bits: int | None = None, group_size: int = 64,
        quantized_kv_start: int = QUANTIZED_KV_START,
    ) -> "Model":
        """The same model with another KV cache kind: bits None (float), 4 or 8 (quantized
        as mlx-lm's QuantizedKVCache, positions below quantized_kv_start kept in float)."""
        out = attrs.evolve(self, kv_bits=bits, kv_group_size=group_size,
                           quantized_kv_start=quantized_kv_start)
        out.cache_layout()  # validates the options (clear errors naming the option)
        return out

    def with_kv_dtype(self, dtype: str | None) -> "Model":
        """The same model with the float KV cache stored as `dtype` ("float32", "float16",
        "bfloat16"; None: the activations' dtype). Values are rounded once when written;
        attention computes in the activations' dtype."""
        if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"kv_dtype must be None, 'float32', 'float16' or 'bfloat16', got {dtype!r}")
        return attrs.evolve(self, kv_dtype=dtype)

    @property
    def dtype(self) -> mx.Dtype:
        return getattr(mx, self.params.dtype)

    @property
    def cache_dtype(self) -> mx.Dtype:
        """The KV cache's element type (its float parts, for a quantized cache)."""
        return getattr(mx, self.kv_dtype) if self.kv_dtype else self.dtype

    def cache_layout(self, headroom: int = 512) -> tuple[LayerSpec, ...]:
        """This model's cache layout; headroom: see `fx_engine.core.models.cache_layout`."""
        return cache_layout(self.config, headroom=headroom, kv_bits=self.kv_bits,
                            kv_group_size=self.kv_group_size,
                            quantized_kv_start=self.quantized_kv_start)

    def new_cache(self, rows: int, capacity: int, headroom: int = 512) -> KVCache:
        """An empty KV cache for `rows` rows of `capacity` positions; sliding-window layers
        get rings of window + headroom slots (headroom >= the longest step - 1)."""
        return init_cache(self.cache_layout(headroom), rows, capacity, self.cache_dtype)


def model_fingerprint(meta: list[str], files: list[Path]) -> str:
    """Identify a model by its source (config + weight files), not its in-memory layout.

    Hashes the config text and, per file, its size and three 1 MiB samples (head, middle,
    tail): cheap for multi-GB checkpoints, and any re-quantization or other checkpoint
    changes it.
    """
    h = hashlib.sha256("|".join(meta).encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for offset in (0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))):
                fh.seek(offset)
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _weight_kinds(params: Any) -> str:
    """What the matmul weights became, e.g. "4-bit+8-bit (native)" or "float32"."""
    lins = linears(params)
    bits = sorted({lin.quant.bits for lin in lins if lin.quantized})
    kinds = [f"{b}-bit" for b in bits] + sorted({str(lin.weight.dtype).split(".")[-1]
                                                 for lin in lins if not lin.quantized})
    native = " (native kernels)" if bits and getattr(params, "numerics", None) and params.numerics.native else ""
    return "+".join(kinds) + native if kinds else str(params.dtype)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def load(
    path: str | Path | None = None,
    *,
    dtype: str | None = None,
    keep_quantized: bool | None = None,
    batch_invariant: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = QUANTIZED_KV_START,
    native: bool | None = None,
    numerics: str | None = None,
    activation_bits: int | None = None,
    kv_dtype: str | None = None,
    matmul_plan: MatmulPlan | None = None,
    tensor_parallel: int | None = None,
    pipeline_parallel: int | None = None,
    pipeline_layers: Sequence[int] | None = None,
    revision: str | None = None,
    mmproj: str | Path | None = None,
) -> Model:
    """Load a model from a GGUF file (a split file's first shard), a Hugging Face style
    folder, a Hugging Face repo id `org/name` or `org/name:QUANT` (a GGUF repo's
    quantization; resolved through the local Hugging Face cache first, then downloaded
    unless HF_HUB_OFFLINE is set: `fx_engine.loading.hub`), or None: the default model.
    revision: the repo's branch, tag or commit (repo ids only).

    dtype: activation/weight dtype ("float32", "float16", "bfloat16"); default float32 on
    CPU (MLX's CPU f16/bf16 math is 10-60x slower) and the stored dtype elsewhere.
    native: use fx-engine's native CPU kernels (`fx_engine.runtime.native`; default: on the CPU when
    they build on this machine). keep_quantized: keep quantized tensors quantized. Default:
    yes on GPU; on CPU, the 4-/8-bit formats the native kernels run (they stream the packed
    weights), everything else dequantized to float32 (MLX's own CPU quantized matmul is a
    naive kernel, ~10x slower than float32 through BLAS). batch_invariant: every row's
    arithmetic independent of the batch and chunk (see fx_engine.core.nn.Numerics).
    kv_bits / kv_group_size / quantized_kv_start: the KV cache kind (see
    `Model.with_kv_cache`; mlx-lm's options of the same names).
    numerics: how activations meet quantized weights. "exact" (None, the default here): float32
    activations, mlx-lm's numerics, so a loop of your own and golden tests match mlx-lm.
    "int8": each activation row entering a 4/5/6/8-bit matmul is rounded to 8 bits per
    weight group and multiplied with int8 dot products in the native kernels, as llama.cpp
    does (1.5-2.5x faster decode and prefill; next-token KL ~0.004 from float32, what
    llama.cpp's own rounding costs: docs/numerics.md). "auto" (the CLI's and server's
    default): "int8" for a model with such quantized matmuls on a CPU whose native build has
    an int8 dot product, else "exact". `Model.numerics` says which runs.
    activation_bits: 8 is the older spelling of numerics="int8".
    kv_dtype: the float KV cache's element type ("float16": half the memory and half the
    bytes attention reads per decode step; None: the activations' dtype).
    matmul_plan: which native kernel runs the float32 quantized matmuls (a
    `fx_engine.core.nn.MatmulPlan`); None: measured on this machine once and cached
    (`fx_engine.runtime.native.plan`, `fx-engine info`). Pin it to make the numerics independent
    of timing.
    tensor_parallel: N shards the model over the N processes of `mx.distributed`'s world
    group (started by `mlx.launch -n N ...`; core/parallel.py): each rank keeps its heads,
    MLP features and vocabulary rows, and every rank must then run the same requests in the
    same order (`fx-engine generate --tensor-parallel N` does). Families with a
    `tensor_split` (core/parallel.py; docs/distributed.md lists them).
    pipeline_parallel: N splits the layers over N processes (each rank one stage). Both:
    T x P processes, P stages of T ranks each (rank r: stage r // T, tensor rank r % T);
    this needs subgroups, which MLX's MPI backend has and its ring backend does not
    (launch with `mpirun -np T*P` or `mlx.launch --backend mpi`).
    pipeline_layers: each stage's number of layers (e.g. (20, 10): hosts of unequal
    memory; their sum is the model's layers; implies pipeline_parallel=len). None: as even
    as possible. Every rank must pass the same.
    mmproj: llama.cpp's mmproj GGUF for a GGUF text model (Gemma 3, Gemma 4, Idefics3 /
    SmolVLM, Mistral 3, Qwen-VL: its vision tower and projector, `fx_engine.loading.mmproj`): the model's
    image path. A folder has its own.
    """
    from fx_engine.loading.tokenizer import Tokenizer
    from fx_engine.runtime import setup

    setup()  # BLAS and malloc (no-op when the entry point already ran it)

    if path is None and revision is not None:
        raise ValueError("revision applies to a Hugging Face repo id (path='org/name'), not the default model")
    p = resolve_model(path, revision=revision) if path is not None else default_model_path()
    if mmproj is not None and not p.is_file():
        raise ValueError(f"mmproj applies to a GGUF text model; {p} is a folder (its image path, if any, "
                         "comes from its own vision_config)")
    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if native is None:
        native = _on_cpu() and fx_native.ensure() is not None
    elif native and fx_native.ensure() is None:
        raise RuntimeError(f"native=True but fx-engine's native kernels are unavailable: "
                           f"{fx_native.status()['error']}")
    keep: KeepQuantized
    if keep_quantized is not None:
        keep = keep_quantized
    elif not _on_cpu():
        keep = True
    else:
        # what the native kernels run stays packed (qmm_a8 runs the same formats)
        keep = (lambda gs, bits: fx_native.supports(gs, bits)) if native else False
    mx_dtype = getattr(mx, dtype) if dtype else (mx.float32 if _on_cpu() else None)
    choice = _numerics_choice(numerics, activation_bits, matmul_plan, bool(native))
    if matmul_plan is not None and not isinstance(matmul_plan, MatmulPlan):
        raise ValueError(f"matmul_plan must be a fx_engine.core.nn.MatmulPlan or None, got {matmul_plan!r}")
    if matmul_plan is not None and not native:
        raise ValueError("matmul_plan chooses the native float32 kernels: it needs native=True")
    # (the weights are read in either numerics: the 8-bit mode is chosen once they are)
    numerics_ = Numerics(batch_invariant=batch_invariant, native=bool(native))
    if pipeline_layers is not None:
        counts = tuple(pipeline_layers) if isinstance(pipeline_layers, (list, tuple)) else ()
        if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
            raise ValueError(f"pipeline_layers must be a list of positive layer counts, one per stage, "
                             f"got {pipeline_layers!r}")
        pipeline_layers = counts
        if pipeline_parallel not in (None, len(pipeline_layers)):
            raise ValueError(f"pipeline_layers has {len(pipeline_layers)} counts but pipeline_parallel="
                             f"{pipeline_parallel}: give one count per stage")
        pipeline_parallel = len(pipeline_layers)
    sharded = tensor_parallel is not None or pipeline_parallel is not None
    spill = None
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise WeightsError(f"{p}: unsupported model file (expected a .gguf file or a folder)")
        # sharded: each converted tensor spills to a temporary folder and comes back lazy,
        # so this rank reads back only its part (removed once the shard is evaluated)
        spill = Path(tempfile.mkdtemp(prefix="fx-engine-gguf-", dir=spill_dir())) if sharded else None
        if spill is not None:  # (also gone at exit if the load fails before it is removed)
            atexit.register(shutil.rmtree, spill, True)
        try:
            with working(f"reading {p.name}"):
                cfg, params, metadata = load_gguf(p, mx_dtype or mx.float16, keep, numerics_, spill)
        except BaseException:
            if spill is not None:
                shutil.rmtree(spill, ignore_errors=True)
            raise
        tokenizer = Tokenizer.from_gguf_metadata(metadata, source=str(p))
        fmt = "gguf"
        # the file alone (its header holds the metadata): not fx-engine's config class,
        # whose fields change between versions while the model does not
        fp_src = ["gguf", str(sum(f.stat().st_size for f in gguf_files(p)))]
    else:
        with working(f"reading {p.name}"):
            cfg, params, raw = load_hf_folder(p, mx_dtype, keep, numerics_)
        tokenizer = Tokenizer.from_hf_folder(p)
        fmt = "mlx-quantized" if raw.get("quantization") else "safetensors"
        fp_src = [json.dumps(raw, sort_keys=True)] + [
            f"{f.name}:{f.stat().st_size}" for f in sorted(p.glob("*.safetensors"))
        ]
    files = gguf_files(p) if p.is_file() else sorted(p.glob("*.safetensors"))
    fingerprint = model_fingerprint(fp_src, files)
    if sharded:
        # sharded before anything is evaluated: safetensors are read lazily (mx.load),
        # so evaluating one leaf at a time reads each tensor once and keeps only this
        # rank's part (peak memory ~ the shard + one tensor); a GGUF's converted tensors
        # were spilled to safetensors for the same reason
        try:
            params, fingerprint = _shard(params, fingerprint, tensor_parallel, pipeline_parallel,
                                         pipeline_layers)
            cfg = params.config
            for leaf in tree_leaves(params):
                mx.eval(leaf)
                mx.clear_cache()  # the whole tensors read for this leaf go back to the OS
        finally:
            if p.is_file() and spill is not None:  # every leaf is read: the files are done
                shutil.rmtree(spill, ignore_errors=True)
    activation_bits = _activation_bits(choice, params, bool(native))
    if activation_bits == 8:
        numerics_ = attrs.evolve(numerics_, activation_bits=8)
        params = attrs.evolve(params, numerics=numerics_)
        fingerprint += "-int8"  # (a disk prefix cache holds KV computed in these numerics)
        if _on_cpu():
            params = _interleave_a8(params)
    elif numerics_.native and _on_cpu():  # (the float32 products read float16 scales alone
        params = map_linears(params, lambda _, lin: with_implied_bias(lin))  # where they can)
    with working(f"loading {p.name}'s weights"):
        mx.eval(tree_leaves(params))
    quant_kinds = _weight_kinds(params)
    report = None
    if matmul_plan is not None:
        params = attrs.evolve(params, numerics=attrs.evolve(numerics_, matmul=matmul_plan))
    elif native and activation_bits is None and _on_cpu():
        from fx_engine.runtime.native import plan

        report = plan.choose(params)  # measured once per machine and shape (cached)
        if report is not None:
            params = attrs.evolve(params, numerics=attrs.evolve(numerics_, matmul=report.plan))
    if mmproj is not None:  # llama.cpp's second file: the image path of a GGUF text model
        from fx_engine.loading.mmproj import load_mmproj

        with working(f"loading {Path(mmproj).name}'s vision tower"):
            vision, processor = load_mmproj(mmproj, cfg, metadata, dtype=getattr(mx, params.dtype),
                                            keep_quantized=keep, numerics=numerics_)
            mx.eval(tree_leaves(vision))
        fingerprint = model_fingerprint([fingerprint, "mmproj"], [Path(mmproj)])
    else:
        vision, processor = (None, None) if p.is_file() else _load_image_path(p, raw, mx_dtype, keep, numerics_)
    model = Model(
        config=cfg, params=params, tokenizer=tokenizer, path=str(p),
        fingerprint=fingerprint, weight_format=f"{fmt} -> {quant_kinds}",
        matmul_report=report, tensor_parallel=tensor_parallel or 1,
        pipeline_parallel=pipeline_parallel or 1, vision=vision, image_processor=processor,
    )
    return model.with_kv_cache(kv_bits, kv_group_size, quantized_kv_start).with_kv_dtype(kv_dtype)


def _load_image_path(folder: Path, raw: dict[str, Any], dtype: Any, keep: Any,
                     numerics: Numerics) -> tuple[Any, Any]:
    """(vision params, preprocessing rules) of a multimodal folder whose image path
    fx-engine runs (`core.vision.VISION_MODULES`: a vision_config beside the text model);
    (None, None) for a text-only model. A folder without preprocessor_config.json gets
    the processor's defaults at the tower's image size."""
    from fx_engine.core.vision import VISION_MODULES
    from fx_engine.loading.images import ImageProcessorConfig, read_processor_config
    from fx_engine.loading.vision import load_vision

    if raw.get("model_type") not in VISION_MODULES or not isinstance(raw.get("vision_config"), dict):
        return None, None
    try:
        with working(f"loading {folder.name}'s vision tower"):
            vision = load_vision(folder, dtype, keep, numerics)
            mx.eval(tree_leaves(vision))
        if vision.config.model_type in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):  # (no fixed image size: its own rules)
            from fx_engine.loading.images_qwen2_vl import folder_processor_config

            return vision, folder_processor_config(folder, vision.config)
        if raw.get("model_type") == "gemma4":  # (any aspect ratio within a soft-token budget)
            from fx_engine.loading.images_gemma4 import folder_processor_config as gemma4_rules

            return vision, gemma4_rules(folder, vision.config)
        if raw.get("model_type") == "mistral3":  # (Pixtral: any image size, its own rules)
            from fx_engine.loading.images_pixtral import folder_processor_config as pixtral_rules

            return vision, pixtral_rules(folder, vision.config)
        size = vision.config.image_size
        if (folder / "preprocessor_config.json").exists():
            processor = read_processor_config(folder, size)
        else:
            processor = ImageProcessorConfig(height=size, width=size)
    except (ConfigError, WeightsError) as e:
        # the text model still runs (as before the image path existed); images are refused
        warnings.warn(f"{folder}: the image path is not loaded, images will be refused ({e})", stacklevel=3)
        return None, None
    return vision, processor


NUMERICS = ("auto", "exact", "int8")


def _numerics_choice(numerics: Any, activation_bits: Any, matmul_plan: Any, native: bool) -> str:
    """`load`'s numerics request, checked: "auto", "exact" or "int8" (errors name the option)."""
    if numerics is None:
        numerics = "int8" if activation_bits == 8 else "exact"
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(map(repr, NUMERICS))}, got {numerics!r}")
    if activation_bits not in (None, 8):
        raise ValueError(f"activation_bits must be None or 8, got {activation_bits!r}")
    if activation_bits == 8:
        if numerics == "exact":
            raise ValueError("activation_bits=8 asks for numerics='int8', but numerics='exact' was given")
        numerics = "int8"
    if matmul_plan is not None:
        if numerics == "int8":
            raise ValueError("matmul_plan chooses the native float32 kernels: it needs numerics='exact' "
                             "(or 'auto'), not 'int8'")
        numerics = "exact"
    if numerics == "int8":
        if not native:
            raise ValueError("numerics='int8' needs fx-engine's native CPU kernels (native=True; "
                             f"available: {fx_native.available()})")
        if fx_native.available() and not fx_native.int8_dot():
            # without AVX-512 VNNI or AVX2 (a build for another CPU), qmm_a8 runs its scalar
            # loop (exact, the same bits, but many times slower than the float kernels): say
            # so, never silently ("auto" does not choose it there)
            warnings.warn("numerics='int8': this CPU's native build has no int8 dot-product "
                          f"kernel ({fx_native.isa()}: a scalar loop), so this mode is slower "
                          "than numerics='exact' here (fx-engine info)", stacklevel=3)
    return numerics


def auto_numerics(params: Any, native: bool) -> str:
    """What numerics="auto" chooses for loaded weights: "int8" where the 8-bit mode pays and
    costs what llama.cpp's numerics cost (decided by measurement, docs/numerics.md): native
    kernels on the CPU with an int8 dot product, and at least one quantized matmul they run
    with 8-bit activations; else "exact"."""
    if not (native and _on_cpu() and fx_native.int8_dot()):
        return "exact"
    from fx_engine.core import kernels

    eligible = any(lin.quantized and kernels.supports(lin.quant.group_size, lin.quant.bits, 8)
                   for lin in linears(params))
    return "int8" if eligible else "exact"


def _activation_bits(choice: str, params: Any, native: bool) -> int | None:
    """8 where the loaded model runs in the 8-bit mode, None for float32 activations."""
    if choice == "auto":
        choice = auto_numerics(params, native)
    return 8 if choice == "int8" else None


def _interleave_a8(params: Any) -> Any:
    """The 8-bit mode's 4-/5-/6-/8-bit matrices in qmm_a8's interleaved layout
    (nn.interleave_for_a8: the same bits, one contiguous stream per 16 rows in a decode
    step). Embedding tables stay in rows for their lookups, except one the head is tied to:
    it is the largest matrix of a small model (a 6-bit Q6_K table at the 1B shape: a third
    of a decode step's bytes) and its lookups gather the interleaved rows (nn.embed)."""
    tied = hasattr(params, "lm_head") and params.lm_head is None
    names = ("embed_per_layer",) if tied else ("embed", "embed_per_layer")
    tables = {id(t) for t in (getattr(params, n, None) for n in names) if t is not None}
    return map_linears(params, lambda _, lin: lin if id(lin) in tables else _by_row_chunks(interleave_for_a8, lin))


#: rows re-laid out at a time (a multiple of 16: the layouts are per 16-row block)
RELAYOUT_ROWS = 4096


def _by_row_chunks(relayout: Any, lin: Any) -> Any:
    """relayout(lin) (nn.interleave_for_a8 or nn.row_major), made RELAYOUT_ROWS rows at a
    time (an expert stack: as many whole experts), each evaluated before the next: the
    5-/6-bit planes' repacking holds ~10 bytes of temporaries per weight byte (a 1B model's
    tied Q6_K table: ~2 GB at once), and the 16-row layouts are block-local, so the pieces
    concatenate to the whole's result."""
    out = relayout(lin)
    per = lin.weight.shape[1] if lin.weight.ndim == 3 else 1  # rows per index of axis 0
    if out is lin or lin.weight.ndim not in (2, 3) or lin.weight.shape[0] * per <= RELAYOUT_ROWS:
        return out
    parts = []
    step = max(1, RELAYOUT_ROWS // per)
    for r0 in range(0, lin.weight.shape[0], step):
        piece = relayout(_rows_of(lin, r0, r0 + step))
        if piece.quant.scales.dtype != out.quant.scales.dtype:  # (the whole's form: one code a
            piece = piece.with_quant(scales=two_codes(piece.quant.scales))  # group only if all agree)
        mx.eval(piece.weight, piece.quant.scales, piece.quant.biases)
        parts.append(piece)
    cat = lambda name: mx.concatenate([getattr(p.quant, name) for p in parts])  # noqa: E731
    return attrs.evolve(out, weight=mx.concatenate([p.weight for p in parts])).with_quant(
        scales=cat("scales"), biases=cat("biases"))


def _rows_of(lin: Any, r0: int, r1: int) -> Any:
    """Rows [r0, r1) of a quantized linear, or experts [r0, r1) of a stack (weight, scales,
    biases; its bias, if any, stays: only the matrices are re-laid out here)."""
    q = lin.quant
    return attrs.evolve(lin, weight=lin.weight[r0:r1]).with_quant(scales=q.scales[r0:r1], biases=q.biases[r0:r1])


def ram_backed(path: str | Path, mounts: str | None = None) -> bool:
    """Whether `path` lies on a tmpfs or ramfs mount (its longest mount point in
    /proc/mounts, or the `mounts` text): files there sit in memory."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return False
    target, best, kind = os.path.realpath(path), "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind in ("tmpfs", "ramfs")


def spill_dir(mounts: str | None = None) -> str | None:
    """Where a sharded GGUF load converts its tensors: FX_ENGINE_SPILL_DIR, else the
    system's temporary folder, unless that is in memory (a tmpfs /tmp: the converted copy,
    about the file's size, would cost each rank as much RAM as sharding saves); then
    fx-engine's cache folder on disk (FX_ENGINE_CACHE, ~/.cache/fx-engine)."""
    chosen = os.environ.get("FX_ENGINE_SPILL_DIR")
    if chosen:
        return chosen
    if not ram_backed(tempfile.gettempdir(), mounts):
        return None
    from fx_engine.loading.default_model import cache_dir

    folder = cache_dir() / "spill"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def _shard(params: Any, fingerprint: str, tensor: Any, pipeline: Any,
           layers: tuple[int, ...] | None = None) -> tuple[Any, str]:
    """This process's tensor-parallel shard and/or pipeline stage (and a fingerprint naming
    it: a disk prefix cache holds one rank's KV heads or layers)."""
    from fx_engine.core.parallel import shard_params, stage_layers, stage_params

    for size, kind in ((tensor, "tensor"), (pipeline, "pipeline")):
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"{kind}_parallel must be a positive integer, got {size!r}")
    tensor, pipeline = tensor or 1, pipeline or 1
    # (checked here: one stage, pipeline_layers=[n], returns before stage_params)
    n = params.config.num_layers
    uneven = layers is not None and stage_layers(n, pipeline, layers) != stage_layers(n, pipeline)
    if tensor * pipeline == 1:
        return params, fingerprint
    from fx_engine.runtime.distributed import mesh

    m = mesh(tensor, pipeline)  # checks the group's size; starts the lost-rank watchdog
    if tensor > 1:  # (first: a stage keeps the embedding or head only where it needs them)
        params = shard_params(params, m.tensor_rank, tensor, m.tensor_group)
        fingerprint += f"-tp{m.tensor_rank}of{tensor}"
    if pipeline > 1:
        params = stage_params(params, m.stage, pipeline, m.pipeline_group, layers)
        fingerprint += f"-pp{m.stage}of{pipeline}"
        if uneven:  # (other layers than the even cut's: a disk prefix cache keys on them)
            fingerprint += "-layers{}to{}".format(*stage_layers(n, pipeline, layers)[m.stage])
    return params, fingerprint


def load_adapter(model: Model, path: str | Path, name: str | None = None) -> str:
    """Load a LoRA / DoRA adapter (an mlx-lm or PEFT adapter folder) for `model` to serve
    per request (`generate(..., adapter=name)`, `Engine.submit(..., adapter=name)`); the
    base weights are not changed. Returns its name (default: the folder's name). Errors
    (AdapterError, ValueError) name the file and module: a missing file, a module the
    model does not have, a shape or rank that does not match (an adapter for another base),
    a name already taken."""
    entry = model.adapters.add(model.params, path, name, getattr(model.config, "num_layers", None))
    return entry.name


def fuse_adapter(model: Model, adapter: str | Path) -> Model:
    """A new model with one adapter merged into its weights (as `mlx_lm.fuse
    --dequantize`): every adapted linear becomes dense (W + scale * (a b)^T, DoRA's
    magnitude applied to the rows), the others stay as loaded. `adapter`: a loaded
    adapter's name or an adapter folder. The new model serves no adapters."""
    if isinstance(adapter, str) and adapter in model.adapters.names():
        entry = model.adapters.get(adapter)
        segments = entry.segments
        fp = entry.fingerprint
    else:
        from fx_engine.loading.adapters import map_adapter, read_adapter

        raw = read_adapter(adapter)
        segments, _ = map_adapter(model.params, raw, getattr(model.config, "num_layers", None))
        fp = raw.fingerprint
    params = fuse_params(model.params, segments, model.dtype)
    mx.eval(tree_leaves(params))
    fused = attrs.evolve(model, params=params, adapters=AdapterSet(),
                         fingerprint=hashlib.sha256(f"{model.fingerprint}+{fp}".encode()).hexdigest()[:16],
                         weight_format=f"{model.weight_format} + fused adapter")
    return fused
