"""The engine's record of one request while it runs (dropped when it finishes): where it
is (queued, prefilling, in a decode row), its prefill cache, its output so far and its
speculation state. Every part of the engine reads it (the executor, the emitter, lockstep
records), so it lives apart from all of them."""

from __future__ import annotations

from typing import Any

from fx_engine.core.cache import KVCache
from fx_engine.core.state import DecodeState
from fx_engine.engine.speculation import DraftState

__all__ = ["RequestState"]


class RequestState:
    """Engine-side per-request state. Its output so far is `out` (output.TokenOutput;
    `generated` is `out.generated`), its speculation state `spec` (speculation.DraftState),
    its phase "queued" -> "prefill" -> "decode" -> "done"."""

    __slots__ = (
        "handle", "ids", "cfg", "max_tokens", "out", "generated", "want_logprobs", "need",
        "prefilled", "pcache", "row", "cache_len", "phase", "t_admit", "t_first", "row_state",
        "processors", "drafter", "row_drafter", "spec", "cached", "salt", "grammar", "plp",
        "slot", "record", "image",
    )

    def __init__(self, handle, ids, cfg, max_tokens, out, processors=(), drafter=None,
                 k_max=0, salt=None, grammar=None):
        self.handle = handle
        self.grammar = grammar  # constraints.RowGrammar: the output's grammar state, or None
        self.plp: int | None = None  # prompt_logprobs: top-N per prompt token (None: off)
        self.salt = salt  # the prefix-cache scope (cache_salt)
        self.ids = ids
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.out = out
        self.generated: list[int] = out.generated
        self.want_logprobs = out.want_logprobs
        self.need = len(ids) + max_tokens
        self.prefilled = 0
        self.pcache: KVCache | None = None
        self.row: int | None = None
        self.cache_len = 0
        self.phase = "queued"
        self.t_admit = 0.0
        self.t_first = 0.0
        self.row_state: DecodeState | None = None
        self.processors = processors
        # speculative decoding: the request's drafter, its per-row state, the adaptive draft
        # length and counters
        self.drafter = drafter
        self.row_drafter = None
        self.spec = DraftState(k_max)
        self.cached = 0  # prompt tokens restored from the prefix cache
        self.slot = 0  # the row's adapter slot in the model's adapter bank (0: the base)
        # lockstep rank 0: the record the other ranks have not been sent yet (None: sent,
        # or not lockstep)
        self.record: Any = None
        # a prompt with images (engine/image_prompt.ImagePrompt: its rows, runs, digests), or None
        self.image: Any = None
