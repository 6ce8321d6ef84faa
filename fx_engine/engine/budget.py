"""The KV budget admission works against (the scheduler's side of memory): what one token
position and one row's recurrent state cost for this model's cache kind, the budget in
token slots those costs leave, and the checks made with it (a request that can never fit
is refused at submit; `scheduler.can_admit` admits against it each step).

Why an object: the arithmetic (bytes or tokens given, recurrent states reserved for
`max_rows` rows, sliding-window rings) belongs together, and a tensor- or pipeline-parallel
engine replaces the token budget by the smallest rank's (`engine/lockstep.py`), after
which every check must use the shared one.
"""

from __future__ import annotations

import math
from typing import Any

from fx_engine.core.cache import bytes_per_token, state_dtype
from fx_engine.engine import scheduler as sched

__all__ = ["KVBudget", "with_kv_cache_kind"]


def with_kv_cache_kind(model: Any, bits: int | None, group_size: int | None, start: int | None) -> Any:
    """The model with the engine's KV cache kind (as in mlx-lm; each None keeps the
    model's own setting): the kind sets what a position costs, hence the budget."""
    if (bits, group_size, start) == (None, None, None):
        return model
    return model.with_kv_cache(
        bits if bits is not None else model.kv_bits,
        group_size if group_size is not None else model.kv_group_size,
        start if start is not None else model.quantized_kv_start,
    )


class KVBudget:
    """A model's KV costs and the engine's budget in token slots (`tokens`, None: no bound).

    bytes_per_token: what one position costs in the model's cache kind (dense or
    quantized entries; sliding-window rings are a fixed window per row on top);
    float_bytes_per_token: what it would cost in a float cache (`stats()`: what kv_bits
    saves); state_bytes_per_row: the recurrent layers' fixed state per row, reserved out
    of the budget for `max_rows` rows.
    """

    def __init__(self, bytes_per_token: float, float_bytes_per_token: float, state_bytes_per_row: int,
                 max_rows: int, prefill_chunk: int, tokens: int | None) -> None:
        self.bytes_per_token = bytes_per_token
        self.float_bytes_per_token = float_bytes_per_token
        self.state_bytes_per_row = state_bytes_per_row
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.tokens = tokens

    @classmethod
    def of_model(cls, model: Any, layout: Any, headroom: int, max_rows: int, prefill_chunk: int,
                 kv_budget_tokens: int | None, kv_budget_bytes: int | None) -> "KVBudget":
        """The budget of `model` (its cache `layout`) from the engine's arguments: bytes
        become token slots at this cache kind's cost per position; the recurrent states of
        max_rows rows are taken out of either (a budget that cannot hold them is an error
        naming them, as is a budget <= 0)."""
        if kv_budget_tokens is not None and kv_budget_bytes is not None:
            raise ValueError("give kv_budget_tokens or kv_budget_bytes, not both")
        dtype = model.cache_dtype
        per_token = bytes_per_token(layout, dtype)
        per_token_float = bytes_per_token(model.with_kv_cache(None).cache_layout(headroom), dtype)
        per_row = sum(math.prod(shape) * state_dtype(s, i, dtype).size
                      for s in layout for i, shape in enumerate(s.state))
        tokens = cls._tokens(per_token, per_row * max_rows, max_rows, per_row,
                             kv_budget_tokens, kv_budget_bytes)
        return cls(per_token, per_token_float, per_row, max_rows, prefill_chunk, tokens)

    @staticmethod
    def _tokens(per_token: float, states: int, max_rows: int, per_row: int,
                tokens: int | None, nbytes: int | None) -> int | None:
        """The token slots left for per-token entries once the states are reserved."""
        if nbytes is not None:
            if nbytes <= 0:
                raise ValueError(f"kv_budget_bytes must be > 0, got {nbytes!r}")
            if nbytes <= states:
                raise ValueError(f"kv_budget_bytes ({nbytes}) cannot hold the recurrent "
                                 f"states of max_rows={max_rows} rows ({states} bytes)")
            # no per-token entries (a purely recurrent model): only the states count
            tokens = int((nbytes - states) // per_token) if per_token else None
        elif tokens is not None and states and per_token:
            reserved = -(-states // int(per_token))
            if tokens <= reserved:
                raise ValueError(
                    f"the KV budget ({tokens} token slots) cannot hold the recurrent "
                    f"states of max_rows={max_rows} rows ({reserved} slots' worth: "
                    f"{per_row} bytes per row)")
            tokens -= reserved
        if tokens is not None and tokens <= 0:
            raise ValueError(f"kv_budget_tokens must be > 0, got {tokens!r}")
        return tokens

    def prefill_slots(self, prompt_len: int) -> int:
        """Token slots of a request's 1-row prefill cache (`scheduler.prefill_slots`)."""
        return sched.prefill_slots(prompt_len, self.prefill_chunk)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError for a request whose KV memory alone (its decode row and its prefill
        cache) exceeds the budget: it could never be admitted, so it is refused at submit
        instead of waiting forever."""
        need, pslots = prompt_len + max_tokens, self.prefill_slots(prompt_len)
        if not sched.ever_fits(need, self.max_rows, self.tokens, pslots):
            slots = sched.kv_footprint([need], self.max_rows, [pslots])
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs a KV cache "
                f"of {slots} token slots ({int(slots * self.bytes_per_token)} bytes: its decode "
                f"row and its prefill cache), more than the KV budget of "
                f"{self.tokens} tokens"
            )
