"""Embeddings: the final hidden state of a prompt, pooled and normalized as the checkpoint
declares (`/v1/embeddings`, `fx_engine.embed`).

Pooling comes from the model's files: a sentence-transformers folder's `modules.json` and
its Pooling module's `config.json` (`pooling_mode_lasttoken` / `_mean_tokens` /
`_cls_token`; a `Normalize` module turns normalization on), or a GGUF's
`{arch}.pooling_type` (llama.cpp: 1 mean, 2 cls, 3 last). Without either: last-token pooling,
normalized, what decoder-only embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) use
and vLLM's default for them.

Inputs are batched: up to `ROWS` prompts per `hidden_step` call, chunked like prefill through
a KV cache, each row's pooled vector accumulated over its valid positions only. Where the
family packs rows, a call's products run on its valid tokens alone (`pack`, core/packing.py):
the row bucket's empty rows and the shorter prompts' padding cost nothing there.

`embed_steps` is the same work as a generator that yields after every `hidden_step` call of
at most `step_tokens` tokens (rows x chunk, powers of two): the Engine advances it by one
call per engine step (`Engine.call_steps`, what `/v1/embeddings` uses), so a long
embedding request never holds the engine thread for more than one such call, and a
cancelled one stops at the next step. `embed` runs it to the end on the calling thread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Generator, Sequence

import mlx.core as mx
import numpy as np

from fx_engine.core.buckets import pow2_ceil, pow2_floor
from fx_engine.core.cache import span_bucket
from fx_engine.core.models import packs_rows
from fx_engine.core.steps import hidden_step_compiled
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.jobs import run_steps
from fx_engine.engine.request import ContextLengthExceeded, context_limit
from fx_engine.engine.scheduler import pack_arg

__all__ = ["POOLINGS", "pooling_of", "embed", "embed_steps"]

POOLINGS = ("last", "mean", "cls")
ROWS = 8  # prompts per hidden_step call
CHUNK = 512
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def pooling_of(model: Any) -> tuple[str, bool]:
    """(pooling, normalize) the checkpoint declares (see the module docstring)."""
    path = Path(model.path)
    if path.is_dir():
        modules = path / "modules.json"
        if modules.is_file():
            try:
                mods = json.loads(modules.read_text())
                pool, norm = "last", False
                for m in mods:
                    kind = str(m.get("type", ""))
                    if kind.endswith("Pooling"):
                        cfg = json.loads((path / m.get("path", "") / "config.json").read_text())
                        pool = next((p for key, p in (("pooling_mode_lasttoken", "last"),
                                                      ("pooling_mode_mean_tokens", "mean"),
                                                      ("pooling_mode_cls_token", "cls"))
                                     if cfg.get(key)), None)
                        if pool is None:
                            raise ValueError(f"{path}: its Pooling module uses a mode fx-engine "
                                             f"does not implement ({cfg})")
                    if kind.endswith("Normalize"):
                        norm = True
                return pool, norm
            except (OSError, ValueError, AttributeError) as e:
                raise ValueError(f"{modules}: cannot read the pooling configuration ({e})") from None
        return "last", True
    if path.suffix == ".gguf":
        from fx_engine.loading.gguf import _Header

        meta = _Header(path).metadata
        arch = meta.get("general.architecture")
        kind = meta.get(f"{arch}.pooling_type")
        if kind is not None:
            if int(kind) not in _GGUF_POOLING:
                raise ValueError(f"{path}: {arch}.pooling_type = {kind} is not supported "
                                 "(1 mean, 2 cls, 3 last)")
            return _GGUF_POOLING[int(kind)], True
    return "last", True


def embed(model: Any, inputs: Sequence[str | Sequence[int]], pooling: str | None = None,
          normalize: bool | None = None) -> np.ndarray:
    """Pooled final hidden states [N, hidden] (float32) of prompts (strings, tokenized with
    the model's tokenizer, or token-id lists). pooling ("last", "mean", "cls") / normalize
    default to the checkpoint's (`pooling_of`). Runs MLX work: call it on the thread that
    owns the model's MLX state (with a started Engine: `Engine.call_steps(embed_steps(...))`)."""
    return run_steps(embed_steps(model, inputs, pooling, normalize))


def embed_steps(model: Any, inputs: Sequence[str | Sequence[int]], pooling: str | None = None,
                normalize: bool | None = None,
                step_tokens: int = ROWS * CHUNK) -> Generator[int, None, np.ndarray]:
    """`embed` as a generator: the inputs are tokenized and validated now (ValueError
    naming the input), then each `next()` runs one `hidden_step` call of at most
    `step_tokens` (>= 16) padded tokens and yields that count; the generator returns the
    [N, hidden] array. Results do not depend on `step_tokens` (only how the work is cut)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    inputs = [model.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
    declared = pooling_of(model)
    pooling = declared[0] if pooling is None else pooling
    normalize = declared[1] if normalize is None else normalize
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if step_tokens < 16:
        raise ValueError(f"step_tokens must be >= 16, got {step_tokens!r}")
    # the model's context, or the smaller cap of `Model.with_max_context` (serve
    # --max-kv-size): embeddings honour it as generation does
    limit, context = context_limit(model)
    for i, ids in enumerate(inputs):
        if not ids:
            raise ValueError(f"input[{i}]: encodes to zero tokens")
        if len(ids) > limit:
            raise ContextLengthExceeded(f"input[{i}]: {len(ids)} tokens exceed {context}",
                                        limit, len(ids))
    return _embed_all(model, inputs, pooling, normalize, step_tokens)


def _embed_all(model: Any, inputs: list[list[int]], pooling: str, normalize: bool,
               step_tokens: int) -> Generator[int, None, np.ndarray]:
    out = np.zeros((len(inputs), model.config.hidden_size), np.float32)
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))  # similar lengths together
    at = 0
    while at < len(order):
        group = order[at : at + _group_rows(max(len(inputs[i]) for i in order[at : at + ROWS]),
                                            step_tokens)]
        at += len(group)
        out[group] = yield from _embed_rows(model, [list(inputs[i]) for i in group], pooling,
                                            step_tokens)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def _chunk(longest: int, step_tokens: int) -> int:
    """Tokens per row per call: up to CHUNK, no more than the row needs or the step allows."""
    return min(pow2_ceil(min(CHUNK, longest), 16), pow2_floor(step_tokens))


def _group_rows(longest: int, step_tokens: int) -> int:
    """Prompts per call: up to ROWS while rows (a power of two) x chunk fits step_tokens."""
    return max(1, min(ROWS, pow2_floor(step_tokens // _chunk(longest, step_tokens))))


def _embed_rows(model: Any, rows: list[list[int]], pooling: str,
                step_tokens: int) -> Generator[int, None, np.ndarray]:
    b = pow2_ceil(len(rows), 1)  # power-of-two row counts: bounded compile shapes
    longest = max(len(r) for r in rows)
    chunk = _chunk(longest, step_tokens)
    cache = model.new_cache(b, pow2_ceil(longest + chunk, 256), headroom=chunk)
    lengths = np.array([len(r) for r in rows] + [0] * (b - len(rows)))
    packs = packs_rows(model.params)
    acc = mx.zeros((b, model.config.hidden_size), mx.float32)
    for start in range(0, longest, chunk):
        n = np.clip(lengths - start, 0, chunk)
        toks = np.zeros((b, chunk), np.int32)
        for i, r in enumerate(rows):
            piece = r[start : start + chunk]
            toks[i, : len(piece)] = piece
        pack = pack_arg(int(n.sum()), b * chunk) if packs else {}  # (padding: no products)
        h, cache = hidden_step_compiled(model.params, cache, mx.array(toks), mx.array(n, mx.int32),
                                        span=span_bucket(start + chunk, cache.capacity), **pack)
        h = h.astype(mx.float32)
        if pooling == "mean":
            valid = (mx.arange(chunk)[None, :] < mx.array(n)[:, None])[..., None]
            acc = acc + mx.sum(mx.where(valid, h, 0.0), axis=1)
        elif pooling == "cls" and start == 0:
            acc = h[:, 0]
        elif pooling == "last":
            ends = (n > 0) & (lengths <= start + chunk)  # rows whose last token is here
            last = mx.take_along_axis(h, mx.array(np.maximum(n - 1, 0))[:, None, None], axis=1)[:, 0]
            acc = mx.where(mx.array(ends)[:, None], last, acc)
        mx.eval(acc, *tree_leaves(cache))
        yield b * chunk
    out = np.array(acc[: len(rows)])
    if pooling == "mean":
        out /= lengths[: len(rows), None]
    return out
