"""The per-request side of drafters fed the target's captured hidden states (learned heads:
EAGLE-3 in engine/eagle3_drafter.py, checkpoints' MTP modules in engine/mtp_drafter.py).

A `CapturedRow` keeps its drafter's own 1-row cache beside the target's. Its pair at
position t is (the target's captured states at t, the token at t + 1), the input both
EAGLE and MTP modules take: fed lazily when the next token is known (at `propose`, or early
when many states wait), in chunks of a few power-of-two shapes. `propose(tokens, k)` feeds
the new pairs, then chains the drafter on its own output (its hidden state and the token it
drafted) for k greedy drafts. The chained entries are the drafter's guesses, not the
target's: the next `propose` rolls the cache back by length to its real pairs
(`with_lengths`) and feeds the target's states of the positions the verify accepted. So
rollback after a rejection needs no call, and the drafter never sees a rejected token.

The drafter (the row's `owner`) supplies the step and the cache:

    owner.step(hidden [1, T, W], ids [1, T], cache, n_valid [1], span) -> (tok [1], h [1, H], cache)
    owner.new_cache(capacity) -> KVCache

`step` runs the pairs (hidden[t], ids[t]) for t < n_valid from the cache's length and
returns the greedy draft after the last valid pair and the hidden state a chained step
feeds back (T = 1 with a chained step's own state and draft).

A row whose captured states have a gap (a prefix restored from the prefix cache is skipped
for these requests so that does not happen) stops drafting (`broken` says why) and decodes.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from fx_engine.core.buckets import pow2_ceil
from fx_engine.core.cache import KVCache, span_bucket, with_lengths
from fx_engine.engine.drafters import Draft
from fx_engine.engine.kv_rows import resize

__all__ = ["CapturedRow", "FEED_CHUNK", "FLUSH_AT", "MIN_CAPACITY"]

FEED_CHUNK = 128  # the most pairs one step feeds (longer runs: several steps)
FLUSH_AT = 256  # waiting states that make `observe` feed the drafter early (bounded memory)
MIN_CAPACITY = 256  # the drafter cache's smallest capacity (grown in powers of two)


class CapturedRow:
    """One request's drafter state: its cache (`fed` real pairs, positions [0, fed)) and the
    captured states of positions [fed, fed + waiting) not fed yet."""

    def __init__(self, owner: Any):
        self.owner = owner
        self.cache: KVCache | None = None
        self.fed = 0
        self.states: list[mx.array] = []  # [n_i, W] chunks, contiguous from position `fed`
        self.waiting = 0
        self.length = 0  # the cache's length (fed, plus chained pairs while drafting)
        self.broken: str | None = None  # why this row stopped drafting (None: it drafts)

    @property
    def captured(self) -> int:
        """Positions whose states the row has (fed or waiting)."""
        return self.fed + self.waiting

    def observe(self, start: int, states: mx.array, tokens: Sequence[int] | None = None) -> None:
        """The target processed positions [start, start + n) and kept them: their captured
        states [n, W]. A start before `captured` replaces what the row had from there (the
        target ran those positions again); a gap stops the row's drafting. tokens: the row's
        sequence as far as it is known (feeds the drafter early when many states wait)."""
        if self.broken is not None or states.shape[0] == 0:
            return
        if start > self.captured:
            self._break(f"no captured states for positions {self.captured} .. {start - 1}")
            return
        if start < self.captured:
            self._truncate(start)
        self.states.append(states)
        self.waiting += states.shape[0]
        if tokens is not None and self.waiting >= FLUSH_AT:
            # keep the last waiting state: `propose` always has a pair to start drafting from
            self._feed(tokens, min(self.captured - 1, len(tokens) - 1))

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Up to k greedy drafts after `tokens` (prompt and generated tokens; the target has
        processed all but the last)."""
        if k <= 0 or self.broken is not None:
            return Draft()
        n = len(tokens) - 1
        if self.captured < n:
            self._break(f"the target processed {n} positions, the row has states for {self.captured}")
            return Draft()
        if self.captured > n:
            self._truncate(n)
        if n <= self.fed:  # no new pair (asked twice without a target step between): no draft
            return Draft()
        tok, h = self._feed(tokens, n, extra=k - 1)
        owner, out = self.owner, [tok]
        one = mx.ones((1,), mx.int32)
        for _ in range(k - 1):  # chained: the drafter's own hidden state and draft
            span = span_bucket(self.length + 1, self.cache.capacity)
            tok, h, self.cache = owner.step(h[:, None], tok[:, None], self.cache, one, span)
            self.length += 1
            out.append(tok)
        return Draft(tuple(int(t) for t in mx.concatenate(out).tolist()))

    # ---------------------------------------------------------------- the drafter's cache
    def _feed(self, tokens: Sequence[int], upto: int, extra: int = 0) -> tuple[Any, Any]:
        """Feed pairs [fed, upto) (states waiting, tokens[t + 1]) after rolling the cache back
        to its real pairs; room for `extra` chained pairs after them. Returns the draft and
        hidden state after the last pair ([1] and [1, H])."""
        owner = self.owner
        self._ensure(upto + max(extra, FEED_CHUNK))  # (a padded piece's sink writes fit too)
        if self.length != self.fed:  # chained guesses past the real pairs: dropped
            self.cache = with_lengths(self.cache, mx.array([self.fed], mx.int32))
            self.length = self.fed
        count = upto - self.fed
        if count <= 0:
            return None, None
        states = mx.concatenate(self.states, axis=0) if len(self.states) > 1 else self.states[0]
        rest = states[count:]
        tok = h = None
        done = 0
        while done < count:
            m = min(FEED_CHUNK, count - done)
            size = pow2_ceil(m)
            hid = states[done : done + m]
            ids = list(tokens[self.fed + done + 1 : self.fed + done + m + 1])
            if size > m:
                hid = mx.pad(hid, [(0, size - m), (0, 0)])
                ids += [0] * (size - m)
            span = span_bucket(self.length + size, self.cache.capacity)
            tok, h, self.cache = owner.step(hid[None], mx.array([ids], mx.int32), self.cache,
                                            mx.array([m], mx.int32), span)
            done += m
            self.length += m
        self.fed = upto
        self.states = [rest] if rest.shape[0] else []
        self.waiting = rest.shape[0]
        return tok, h

    def _ensure(self, needed: int) -> None:
        """A cache of at least `needed` positions (grown in powers of two, kept)."""
        cap = max(MIN_CAPACITY, pow2_ceil(needed))
        if self.cache is None:
            self.cache = self.owner.new_cache(cap)
        elif needed > self.cache.capacity:
            self.cache = resize(self.cache, capacity=cap)

    def _truncate(self, position: int) -> None:
        """Forget the states (and, before `fed`, the drafter's pairs) from `position` on."""
        if position < self.fed:
            self.fed = position
            self.states, self.waiting = [], 0
            if self.cache is not None:
                self.cache = with_lengths(self.cache, mx.array([position], mx.int32))
                self.length = position
            return
        keep = position - self.fed
        if keep < self.waiting:
            states = mx.concatenate(self.states, axis=0)[:keep]
            self.states = [states] if keep else []
            self.waiting = keep

    def _break(self, why: str) -> None:
        self.broken = why
        self.states, self.waiting, self.cache, self.length = [], 0, None, 0
