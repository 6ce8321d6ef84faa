"""The per-request side of drafters fed the target's captured hidden states (learned heads:
EAGLE-3 in engine/eagle3_drafter.py, checkpoints' MTP modules in engine/mtp_drafter.py).

A `CapturedRow` keeps its drafter's own 1-row cache beside the target's. Its pair at
position t is (the target's captured states at t, the token at t + 1), the input both
EAGLE and MTP modules take: fed lazily when the next token is known (at `propose`, or early
when many states wait), in chunks of a few power-of-two shapes. `propose(tokens, k)` feeds
the new pairs, then chains the drafter on its own output (its hidden state and the token it
drafted) for k drafts: a greedy row's (temperature 0, or no sampling settings) are the
argmax; a sampled row's are drawn from the drafter's distribution processed with the row's
sampling settings (`core.drafters.sampled.draw`; the row's own PRNG key stream, derived from
the request's seed as the draft model's is: `drafters.draft_sampling`) and reported as the
Draft's probs (q over the target's vocabulary) for the target's acceptance rule. The chained
entries are the drafter's guesses, not the target's: the next `propose` rolls the cache back
by length to its real pairs (`with_lengths`) and feeds the target's states of the positions
the verify accepted. So rollback after a rejection needs no call, and the drafter never sees
a rejected token (nor a rejected draw: a sampled row's key stream just moves on).

The drafter (the row's `owner`) supplies the step and the cache:

    owner.step(hidden [B, T, W], ids [B, T], cache, n_valid [B], span)
        -> (tok [B], logits [B, Vs], h [B, H], cache)
    owner.new_cache(capacity) -> KVCache   (one row)
    owner.draft_ids: [Vs] int32 target id of each of the logits' ids (None: the same ids)
    owner.target_probs(q [n, Vs]) -> [n, V]   (q over the target's vocabulary)

`step` runs each row's pairs (hidden[b, t], ids[b, t]) for t < n_valid[b] from the row's
cache length and returns the greedy draft after its last valid pair (a target id), the
float32 logits it is the argmax of (what a sampled row draws from) and the hidden state a
chained step feeds back (T = 1 with a chained step's own state and draft); rows with
n_valid 0 are left as they were.

Rows of one drafter asked in the same engine step draft together (`propose_batch`, the
drafters' `propose_rows`, used by the engine's `propose_drafts`): their caches stacked into
one B-row cache (B a power of two, padding rows idle), the new pairs fed in one call per
round (T: a power-of-two bucket of the round's largest count, n_valid per row), the k - 1
chained steps in one call each (rows past their own k idle), the caches split back. One
drafter call per step instead of one per row; the drafts are each row's own (bitwise the
same under batch-invariant numerics, which a batch-invariant target's drafters take).
Greedy and sampled rows draft together: the sampled rows' draws are one `draw` call per
round, row-wise (each row's key), greedy rows keep the argmax.

A row whose captured states have a gap (a prefix restored from the prefix cache is skipped
for these requests so that does not happen) stops drafting (`broken` says why) and decodes.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from fx_engine.core.buckets import pow2_ceil
from fx_engine.core.cache import KVCache, span_bucket, with_lengths
from fx_engine.core.drafters.sampled import draw_compiled
from fx_engine.core.sampling import SamplingConfig, init_keys, make_sampling_params
from fx_engine.engine.drafters import Draft, draft_sampling
from fx_engine.engine.kv_rows import resize, row_view, stack_rows

__all__ = ["CapturedDrafter", "CapturedRow", "FEED_CHUNK", "FLUSH_AT", "MIN_CAPACITY"]

FEED_CHUNK = 128  # the most pairs one step feeds (longer runs: several steps)
FLUSH_AT = 256  # waiting states that make `observe` feed the drafter early (bounded memory)
MIN_CAPACITY = 256  # the drafter cache's smallest capacity (grown in powers of two)
_GREEDY = SamplingConfig()  # (a greedy or padding row's settings in a sampled batch's draw)


class CapturedRow:
    """One request's drafter state: its cache (`fed` real pairs, positions [0, fed)) and the
    captured states of positions [fed, fed + waiting) not fed yet."""

    def __init__(self, owner: Any, sampling: SamplingConfig | None = None):
        self.owner = owner
        # a sampled row's own settings and PRNG key [1, 2] (None: it drafts greedily)
        self.sampling = None if sampling is None or sampling.temperature == 0 else draft_sampling(sampling)
        self.keys = None if self.sampling is None else init_keys([self.sampling])
        self._params: Any = None  # (its SamplingParams, made at its first draw)
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
        """Up to k drafts after `tokens` (prompt and generated tokens; the target has
        processed all but the last): greedy, or, for a sampled row, drawn (with q)."""
        n = self._prepare(tokens, k)
        if n is None:
            return Draft()
        tok, lg, h = self._feed(tokens, n, extra=k - 1)
        owner = self.owner
        one = mx.ones((1,), mx.int32)
        keys, qs = self.keys, []
        if self.sampling is not None:
            if self._params is None or self._params.vocab_size != lg.shape[-1]:
                self._params = make_sampling_params([self.sampling], lg.shape[-1])
            tok, q, keys = draw_compiled(lg, tok, self._params, keys, one.astype(mx.bool_), _draft_ids(owner))
            qs.append(q)
        out = [tok]
        for _ in range(k - 1):  # chained: the drafter's own hidden state and draft
            span = span_bucket(self.length + 1, self.cache.capacity)
            tok, lg, h, self.cache = owner.step(h[:, None], tok[:, None], self.cache, one, span)
            self.length += 1
            if self.sampling is not None:
                tok, q, keys = draw_compiled(lg, tok, self._params, keys, one.astype(mx.bool_), _draft_ids(owner))
                qs.append(q)
            out.append(tok)
        drafted = tuple(int(t) for t in mx.concatenate(out).tolist())
        if self.sampling is None:
            return Draft(drafted)
        self.keys = keys
        return Draft(drafted, _target_probs(owner, mx.concatenate(qs, axis=0)))

    def _prepare(self, tokens: Sequence[int], k: int) -> int | None:
        """The checks before drafting: None when the row drafts nothing this time (k <= 0,
        broken, no new pair), else n (the positions the target processed: pairs up to n are
        fed). Truncates states the target did not keep."""
        if k <= 0 or self.broken is not None:
            return None
        n = len(tokens) - 1
        if self.captured < n:
            self._break(f"the target processed {n} positions, the row has states for {self.captured}")
            return None
        if self.captured > n:
            self._truncate(n)
        if n <= self.fed:  # no new pair (asked twice without a target step between): no draft
            return None
        return n

    @classmethod
    def propose_batch(cls, rows: Sequence["CapturedRow"], tokens_list: Sequence[Sequence[int]],
                      ks: Sequence[int]) -> list[Draft]:
        """`propose` for several rows of one drafter in one batched drafter call per step
        (issue 45): the rows' caches stacked into one (capacities padded to the largest,
        rows to a power of two: padding rows idle with n_valid 0), the new pairs fed in
        rounds of at most FEED_CHUNK per row (T: the round's power-of-two bucket, n_valid per
        row), then max(k) - 1 chained steps (a row whose k is reached idles), the caches
        split back. The same drafts as each row's `propose` (bitwise so under batch-invariant
        numerics). Nothing is kept on the rows unless every row's drafting succeeds (an
        error leaves them as `_prepare` left them: the caller may ask each row alone)."""
        drafts = [Draft()] * len(rows)
        todo = []  # (index, n, k)
        for i, (row, tokens, k) in enumerate(zip(rows, tokens_list, ks)):
            n = row._prepare(tokens, k)
            if n is not None:
                todo.append((i, n, k))
        if not todo:
            return drafts
        owner = rows[todo[0][0]].owner
        if len(todo) == 1 or any(rows[i].owner is not owner for i, _, _ in todo):
            for i, _, k in todo:  # (one row: the per-row path, its own shapes)
                drafts[i] = rows[i].propose(list(tokens_list[i]), k)
            return drafts
        for i, n, k in todo:  # each row's capacity, as its own `propose` would grow it
            row = rows[i]
            row._ensure(n + max(k - 1, FEED_CHUNK))
            if row.length != row.fed:  # chained guesses past the real pairs: dropped
                row.cache = with_lengths(row.cache, mx.array([row.fed], mx.int32))
                row.length = row.fed
        caps = [rows[i].cache.capacity for i, _, _ in todo]
        cap = max(caps)
        b = len(todo)
        bp = pow2_ceil(b)
        parts = [rows[i].cache if c == cap else resize(rows[i].cache, capacity=cap)
                 for (i, _, _), c in zip(todo, caps)]
        if bp > b:
            parts += [owner.new_cache(cap)] * (bp - b)
        cache = stack_rows(parts)
        lengths = [rows[i].fed for i, _, _ in todo] + [0] * (bp - b)
        counts = [n - rows[i].fed for i, n, _ in todo]
        states = []
        for i, _, _ in todo:
            st = rows[i].states
            states.append(mx.concatenate(st, axis=0) if len(st) > 1 else st[0])
        width = states[0].shape[-1]
        last_tok: list[Any] = [None] * b
        last_lg: list[Any] = [None] * b
        last_h: list[Any] = [None] * b
        done = [0] * b
        while any(d < c for d, c in zip(done, counts)):  # feed: rounds of <= FEED_CHUNK pairs a row
            ms = [min(FEED_CHUNK, c - d) for d, c in zip(done, counts)]
            size = pow2_ceil(max(ms))
            hid, ids = [], []
            for j, (i, _, _) in enumerate(todo):
                m, d, fed = ms[j], done[j], rows[i].fed
                piece = states[j][d : d + m]
                if size > m:
                    piece = mx.pad(piece, [(0, size - m), (0, 0)])
                hid.append(piece)
                ids.append(list(tokens_list[i][fed + d + 1 : fed + d + m + 1]) + [0] * (size - m))
            if bp > b:
                hid += [mx.zeros((size, width), states[0].dtype)] * (bp - b)
                ids += [[0] * size] * (bp - b)
            span = span_bucket(max(lengths) + size, cap)  # (the step's contract: max(lengths) + T)
            tok, lg, h, cache = owner.step(mx.stack(hid), mx.array(ids, mx.int32), cache,
                                           mx.array(ms + [0] * (bp - b), mx.int32), span)
            for j in range(b):
                if ms[j]:
                    done[j] += ms[j]
                    lengths[j] += ms[j]
                    if done[j] == counts[j]:
                        last_tok[j], last_lg[j], last_h[j] = tok[j : j + 1], lg[j : j + 1], h[j : j + 1]
        pad = bp > b
        tok = mx.concatenate(last_tok + [mx.zeros((bp - b,), last_tok[0].dtype)] * pad)
        h = mx.concatenate(last_h + [mx.zeros((bp - b, last_h[0].shape[-1]), last_h[0].dtype)] * pad)
        chained = [k - 1 for _, _, k in todo]
        sampled = [rows[i].sampling is not None for i, _, _ in todo]
        qs: list[Any] = []
        if any(sampled):  # one draw per round for the sampled rows (greedy rows keep the argmax)
            lg = mx.concatenate(last_lg + [mx.zeros((bp - b, last_lg[0].shape[-1]), last_lg[0].dtype)] * pad)
            params = make_sampling_params([rows[i].sampling or _GREEDY for i, _, _ in todo]
                                          + [_GREEDY] * (bp - b), lg.shape[-1])
            keys = mx.concatenate([rows[i].keys if rows[i].sampling is not None else mx.zeros((1, 2), mx.uint32)
                                   for i, _, _ in todo] + [mx.zeros((bp - b, 2), mx.uint32)] * pad)
            act = mx.array([1] * b + [0] * (bp - b), mx.bool_)
            tok, q, keys = draw_compiled(lg, tok, params, keys, act, _draft_ids(owner))
            qs.append(q)
        out = [tok]
        for step in range(max(chained)):  # chained: each row's own hidden state and draft
            act = [1 if step < c else 0 for c in chained] + [0] * (bp - b)
            span = span_bucket(max(lengths) + 1, cap)
            tok, lg, h, cache = owner.step(h[:, None], tok[:, None], cache, mx.array(act, mx.int32), span)
            lengths = [ln + a for ln, a in zip(lengths, act)]
            if any(sampled):
                tok, q, keys = draw_compiled(lg, tok, params, keys, mx.array(act, mx.bool_), _draft_ids(owner))
                qs.append(q)
            out.append(tok)
        got = mx.stack(out, axis=1).tolist()  # [bp, 1 + max chained] (evaluates: errors surface here)
        probs = mx.stack(qs, axis=1) if qs else None  # [bp, 1 + max chained, Vs]
        for j, (i, n, k) in enumerate(todo):  # every row succeeded: keep its new state
            row = rows[i]
            view = row_view(cache, j)
            row.cache = view if caps[j] == cap else resize(view, capacity=caps[j])
            row.length = lengths[j]
            rest = states[j][counts[j]:]
            row.fed = n
            row.states = [rest] if rest.shape[0] else []
            row.waiting = rest.shape[0]
            if row.sampling is None:
                drafts[i] = Draft(tuple(int(t) for t in got[j][:k]))
            else:
                row.keys = keys[j : j + 1]
                drafts[i] = Draft(tuple(int(t) for t in got[j][:k]), _target_probs(owner, probs[j, :k]))
        return drafts

    # ---------------------------------------------------------------- the drafter's cache
    def _feed(self, tokens: Sequence[int], upto: int, extra: int = 0) -> tuple[Any, Any, Any]:
        """Feed pairs [fed, upto) (states waiting, tokens[t + 1]) after rolling the cache back
        to its real pairs; room for `extra` chained pairs after them. Returns the draft and
        logits and hidden state after the last pair ([1], [1, Vs] and [1, H])."""
        owner = self.owner
        self._ensure(upto + max(extra, FEED_CHUNK))  # (a padded piece's sink writes fit too)
        if self.length != self.fed:  # chained guesses past the real pairs: dropped
            self.cache = with_lengths(self.cache, mx.array([self.fed], mx.int32))
            self.length = self.fed
        count = upto - self.fed
        if count <= 0:
            return None, None, None
        states = mx.concatenate(self.states, axis=0) if len(self.states) > 1 else self.states[0]
        rest = states[count:]
        tok = lg = h = None
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
            tok, lg, h, self.cache = owner.step(hid[None], mx.array([ids], mx.int32), self.cache,
                                                mx.array([m], mx.int32), span)
            done += m
            self.length += m
        self.fed = upto
        self.states = [rest] if rest.shape[0] else []
        self.waiting = rest.shape[0]
        return tok, lg, h

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


def _draft_ids(owner: Any) -> Any:
    return getattr(owner, "draft_ids", None)


def _target_probs(owner: Any, q: mx.array) -> mx.array:
    fn = getattr(owner, "target_probs", None)
    return q if fn is None else fn(q)


class CapturedDrafter:
    """What a drafter fed the target's captured states shares (EAGLE-3 heads, MTP modules):
    its rows are `CapturedRow`s, proposed together per step. Subclasses supply `capture`,
    `step` and `new_cache`, and where the step's logits are over another vocabulary than the
    target's, `draft_ids` and `target_probs` (the module docstring's owner interface)."""

    draft_ids: Any = None  # (the step's logits are over the target's vocabulary)

    def new_row(self, prompt: list[int], sampling: Any) -> CapturedRow:
        """A request's row: it drafts greedily, or sampled when `sampling` (the request's
        SamplingConfig) has a temperature > 0."""
        return CapturedRow(self, sampling)

    def target_probs(self, q: mx.array) -> mx.array:
        """A sampled row's q [n, Vs] over the target's vocabulary (here: the same)."""
        return q

    def propose_rows(self, rows: list[CapturedRow], tokens_list: list[list[int]], ks: list[int]) -> list:
        """Several of its rows' `propose` in one batched call per step (the engine's
        `propose_drafts` uses it for the rows of one step): the same drafts as each alone."""
        return CapturedRow.propose_batch(rows, tokens_list, ks)
