"""EAGLE-3 heads as drafters of the engine (issue 45, items 2 and 4); the pure head is
fx_engine.core.drafters.eagle3, its checkpoint reader fx_engine.loading.drafter.

    drafter = Eagle3Drafter.load("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", model)  # or a folder
    fx_engine.generate(model, prompt, draft_model=drafter)      # any request's draft_model=

How it runs, per request (row):

* The head reads the target's hidden states at three layer boundaries (`drafter.capture`,
  a `core.models.Capture`). A drafter that has a `capture` is fed by the engine: every
  target step that processes one of its rows' positions (prefill chunks, decode, verify)
  runs with that capture, inside the same compiled forward, and hands the row drafter the
  states of the positions it processed and kept (`observe(start, states)`: a verify's
  accepted ones). Rows of one step share the union of their drafters' captures.
* The row's head keeps its own 1-row KV cache beside the target's. Its pair at position t
  is (the target's captured states at t, the token at t + 1), EAGLE's input: fed lazily when
  the next token is known (at `propose`, or early when many states wait), in chunks of a
  few power-of-two shapes (`head_step_compiled`, keyed on the chunk and span buckets).
* `propose(tokens, k)` feeds the new pairs, then chains the head on its own output (its
  pre-norm hidden state and the token it drafted) for k greedy drafts, mapped from the
  draft vocabulary through d2t (deterministic drafts: `verify_step` keeps sampled rows'
  output distribution exact). The chained entries are the head's guesses, not the target's:
  the next `propose` rolls the head's cache back by length to its real pairs (`with_lengths`)
  and feeds the target's states of the positions the verify accepted, as EAGLE and vLLM do.
  So rollback after a rejection needs no call, and the head never sees a rejected token.

A row whose captured states have a gap (a prefix restored from the prefix cache is skipped
for these requests so that does not happen) stops drafting (`broken` says why) and decodes.
Refused: targets split over processes (tensor / pipeline parallel: their captured layers and
embedding table live on several ranks) and families whose forward does not go through
`skeleton.decoder_step` (a CaptureError naming the model type, at construction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from fx_engine.core.buckets import pow2_ceil
from fx_engine.core.cache import KVCache, init_cache, span_bucket, with_lengths
from fx_engine.core.drafters import eagle3
from fx_engine.core.models import Capture, forward
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.drafters import Draft
from fx_engine.engine.kv_rows import resize

__all__ = ["Eagle3Drafter", "FEED_CHUNK", "FLUSH_AT"]

FEED_CHUNK = 128  # the most pairs one head step feeds (longer runs: several steps)
FLUSH_AT = 256  # waiting states that make `observe` feed the head early (bounded memory)
MIN_CAPACITY = 256  # the head cache's smallest capacity (grown in powers of two)


class Eagle3Drafter:
    """An EAGLE-3 head drafting for `target` (a Model): a Drafter (`new_row`) whose rows are
    fed the target's captured hidden states by the engine (`capture`). `head`: the head's
    params (`loading.drafter.load_eagle3_head`, or `Eagle3Drafter.load`)."""

    kind = "eagle3"  # (usage's and /metrics' name for it)

    def __init__(self, head: eagle3.Eagle3Params, target: Any):
        if getattr(target, "tensor_parallel", 1) > 1 or getattr(target, "pipeline_parallel", 1) > 1:
            raise ValueError("EAGLE-3 drafting is not supported for targets split over processes (tensor / "
                             "pipeline parallelism): use prompt_lookup or a draft model there")
        layers = eagle3.check_target(head.config, target.config, own_embed=head.embed is not None)
        # evaluated here: lazily read arrays belong to this thread's stream, and the engine
        # drafts on its own thread (MLX: "no Stream(cpu, 0) in current thread")
        mx.eval(tree_leaves(head))
        self.head = head
        self.target = target
        self.table = head.embed if head.embed is not None else target.params.embed
        self.capture = Capture(layers)
        # the target's family must capture: a refusal (CaptureError naming its model type)
        # now, not at its first request; building the graph computes nothing
        forward(target.params, target.new_cache(1, 8), mx.zeros((1, 1), mx.int32), mx.ones((1,), mx.int32),
                None, self.capture)

    @classmethod
    def load(cls, path: str | Path, target: Any, *, dtype: str | None = None,
             revision: str | None = None) -> "Eagle3Drafter":
        """The drafter of the head at `path` (a folder or a Hugging Face repo id) for `target`."""
        from fx_engine.loading.drafter import load_eagle3_head

        return cls(load_eagle3_head(path, target, dtype=dtype, revision=revision), target)

    def new_row(self, prompt: list[int], sampling: SamplingConfig) -> "Eagle3Row":
        return Eagle3Row(self)


class Eagle3Row:
    """One request's head: its cache (`fed` real pairs, positions [0, fed)) and the captured
    states of positions [fed, fed + waiting) not fed yet."""

    def __init__(self, owner: Eagle3Drafter):
        self.owner = owner
        self.cache: KVCache | None = None
        self.fed = 0
        self.states: list[mx.array] = []  # [n_i, 3 H_t] chunks, contiguous from position `fed`
        self.waiting = 0
        self.length = 0  # the head cache's length (fed, plus chained pairs while drafting)
        self.broken: str | None = None  # why this row stopped drafting (None: it drafts)

    @property
    def captured(self) -> int:
        """Positions whose states the row has (fed or waiting)."""
        return self.fed + self.waiting

    def observe(self, start: int, states: mx.array, tokens: Sequence[int] | None = None) -> None:
        """The target processed positions [start, start + n) and kept them: their captured
        states [n, 3 H_t]. A start before `captured` replaces what the row had from there
        (the target ran those positions again); a gap stops the row's drafting. tokens: the
        row's sequence as far as it is known (feeds the head early when many states wait)."""
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
        for _ in range(k - 1):  # chained: the head's own hidden state and draft (no fc)
            span = span_bucket(self.length + 1, self.cache.capacity)
            tok, h, self.cache = eagle3.head_step_compiled(owner.head, owner.table, h[:, None], tok[:, None],
                                                           self.cache, one, span=span)
            self.length += 1
            out.append(tok)
        return Draft(tuple(int(t) for t in mx.concatenate(out).tolist()))

    # ---------------------------------------------------------------- the head's cache
    def _feed(self, tokens: Sequence[int], upto: int, extra: int = 0) -> tuple[mx.array, mx.array]:
        """Feed pairs [fed, upto) (states waiting, tokens[t + 1]) after rolling the head's cache
        back to its real pairs; room for `extra` chained pairs after them. Returns the draft
        and hidden state after the last pair ([1] and [1, H])."""
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
            tok, h, self.cache = eagle3.head_step_compiled(
                owner.head, owner.table, hid[None], mx.array([ids], mx.int32), self.cache,
                mx.array([m], mx.int32), span=span)
            done += m
            self.length += m
        self.fed = upto
        self.states = [rest] if rest.shape[0] else []
        self.waiting = rest.shape[0]
        return tok, h

    def _ensure(self, needed: int) -> None:
        """A head cache of at least `needed` positions (grown in powers of two, kept)."""
        cap = max(MIN_CAPACITY, pow2_ceil(needed))
        if self.cache is None:
            self.cache = init_cache(eagle3.cache_specs(self.owner.head.config), 1, cap,
                                    getattr(mx, self.owner.head.dtype))
        elif needed > self.cache.capacity:
            self.cache = resize(self.cache, capacity=cap)

    def _truncate(self, position: int) -> None:
        """Forget the states (and, before `fed`, the head's pairs) from `position` on."""
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
