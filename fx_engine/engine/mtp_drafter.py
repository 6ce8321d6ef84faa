"""The MTP modules target checkpoints ship (DeepSeek-V3, GLM-4.5, Qwen3-Next / Qwen3.5,
MiMo) as drafters of the engine (issue 45, items 1 and 4); the pure module is
fx_engine.core.drafters.mtp, its checkpoint reader fx_engine.loading.drafter.

    drafter = MtpDrafter.from_model(model)          # the checkpoint the model was loaded from
    fx_engine.generate(model, prompt, draft_model=drafter)
    fx_engine.generate(model, prompt, draft_model="mtp")   # the same, built once per model

How it runs, per request (row), as the EAGLE-3 heads do (engine/eagle3_drafter.py; the row
side is engine/captured_drafter.py's `CapturedRow`):

* The module reads one target state per position (`drafter.capture`, from
  `mtp.target_capture`): the final norm's output (DeepSeek-V3, GLM-4.5, Qwen3-Next), or the
  stream after the last layer (MiMo). Every target step over the row (prefill chunks,
  decode, verify) captures it inside the same compiled forward and hands the row the states
  of the positions it kept: no second forward.
* The row keeps the module's own 1-row KV cache (`mtp.cache_specs`: the family's kind of
  entry, DeepSeek's latent one included). Its pair at position t is (the target's state at
  t, the token at t + 1), fed lazily in power-of-two chunks (`mtp.mtp_step_compiled`, keyed
  on the chunk and span buckets).
* `propose(tokens, k)`: the new pairs, then k - 1 steps of module 0 chained on its own
  output (the hidden state the format feeds back, `chain_normed`, and its draft), vLLM's
  K > 1. Greedy rows draft the argmax; sampled rows (temperature > 0) draw each draft from
  the module's distribution processed with the row's sampling settings and report it as q
  for the target's acceptance rule (`core.drafters.sampled`). The next `propose` rolls the
  module's cache back by length to its real pairs and feeds the target's states of the
  accepted positions: the module's state rolls back with the target's, recurrent targets
  (Qwen3-Next's linear-attention layers) included: the target rolls its own state back, the
  module's layer is full attention.

Refused (ValueError / ConfigError / CaptureError, at construction): targets split over
processes (tensor / pipeline parallel), a module of another family or size than the target
(`mtp.check_target`), a family whose steps cannot capture, a checkpoint that ships no module
(or whose weights dropped it).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.core.cache import KVCache, init_cache
from fx_engine.core.drafters import mtp
from fx_engine.core.models import forward
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.captured_drafter import CapturedDrafter

__all__ = ["MtpDrafter", "mtp_drafter_for"]


class MtpDrafter(CapturedDrafter):
    """A checkpoint's MTP module drafting for `target` (a Model): a Drafter (`new_row`) whose
    rows are fed the target's captured states by the engine (`capture`). module: the
    modules' params (`loading.drafter.load_mtp_module`); tables: the embedding table and
    output head they read (None: the target's, `mtp.target_tables`)."""

    kind = "mtp"  # (usage's and /metrics' name for it)

    def __init__(self, module: mtp.MtpParams, tables: mtp.MtpTables | None, target: Any):
        if getattr(target, "tensor_parallel", 1) > 1 or getattr(target, "pipeline_parallel", 1) > 1:
            raise ValueError("MTP drafting is not supported for targets split over processes (tensor / "
                             "pipeline parallelism): use prompt_lookup there")
        cfg = module.config
        mtp.check_target(cfg, target.config)
        self.module = module
        self.tables = tables if tables is not None else mtp.target_tables(target.params)
        # evaluated here: lazily read arrays belong to this thread's stream, and the engine
        # drafts on its own thread (MLX: "no Stream(cpu, 0) in current thread")
        mx.eval(tree_leaves(module), tree_leaves(self.tables))
        self.config = cfg
        self.target_config = target.config  # (not the Model: `mtp_drafter_for` caches per model)
        self.capture = mtp.target_capture(cfg, target.config.num_layers)
        # the target's family must capture: a refusal (CaptureError naming its model type)
        # now, not at its first request; building the graph computes nothing
        forward(target.params, target.new_cache(1, 8), mx.zeros((1, 1), mx.int32), mx.ones((1,), mx.int32),
                None, self.capture)

    @classmethod
    def load(cls, path: str | Path, target: Any, *, dtype: str | None = None,
             revision: str | None = None) -> "MtpDrafter":
        """The drafter of the MTP modules in the checkpoint at `path` (a model folder, a GGUF
        file or a Hub repo id) for `target`."""
        from fx_engine.loading.drafter import load_mtp_module

        return cls(load_mtp_module(path, target, dtype=dtype, revision=revision), None, target)

    @classmethod
    def from_model(cls, model: Any) -> "MtpDrafter":
        """The drafter of the MTP module shipped in the checkpoint `model` was loaded from
        (its folder's safetensors or its GGUF); a ConfigError naming the checkpoint if it
        ships none."""
        return cls.load(model.path, model)

    # ---------------------------------------------------------------- what its rows run
    def step(self, hidden: mx.array, ids: mx.array, cache: KVCache, n_valid: mx.array,
             span: int) -> tuple[mx.array, mx.array, mx.array, KVCache]:
        """One step of module 0 over pairs (hidden [B, T, H], ids [B, T]): the greedy draft
        after the last valid pair, the logits it is the argmax of (over the target's
        vocabulary: what a sampled row draws from), the hidden state a chained step feeds
        back, the cache."""
        return mtp.mtp_step_compiled(self.module, self.tables, hidden, ids, cache, n_valid, span)

    def new_cache(self, capacity: int) -> KVCache:
        return init_cache(mtp.cache_specs(self.config), 1, capacity, getattr(mx, self.module.dtype))


_FOR_MODEL: dict[int, MtpDrafter] = {}
_LOCK = threading.Lock()


def mtp_drafter_for(model: Any) -> MtpDrafter:
    """`draft_model="mtp"`: the MtpDrafter of `model`'s own checkpoint, built on first use
    and kept while the model's params live (its variants, `with_kv_cache` and the like,
    share it)."""
    key = id(model.params)
    with _LOCK:
        d = _FOR_MODEL.get(key)
        if d is None:
            d = MtpDrafter.from_model(model)
            try:
                weakref.finalize(model.params, _FOR_MODEL.pop, key, None)
            except TypeError:  # (params that take no weak reference: not kept)
                return d
            _FOR_MODEL[key] = d
    return d
