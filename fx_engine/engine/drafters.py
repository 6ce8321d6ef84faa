"""Drafters for speculative decoding (the shell side; the pure part is fx_engine.core.speculative).

The interface a user implements (also usable in their own loop around `verify_step`):

    class MyDrafter:
        def new_row(self, prompt: list[int], sampling: SamplingConfig) -> RowDrafter: ...

    class RowDrafter:
        def propose(self, tokens: list[int], k: int) -> Draft: ...

`tokens` is the row's whole sequence so far (prompt, generated tokens, ending with the last
sampled token, which the target has not processed yet); `propose` returns at most k draft
tokens that would follow it (an empty draft: this row just decodes this step), and, for
drafters that sample, their distribution q at each draft position ([n, V] probabilities,
None for deterministic drafts). Rollback needs no call: the next `propose` receives the
sequence as accepted, and a stateful drafter (a draft model's cache) rewinds itself to the
longest common prefix of what it has seen.

Shipped: `PromptLookup` (n-gram matching, no second model) and `DraftModel` (a smaller model
with the same tokenizer; `self_draft_model` builds one from the target's first layers and
its output head, LayerSkip-style, when no smaller model is at hand), and in
engine/eagle3_drafter.py `Eagle3Drafter` (an EAGLE-3 head reading the target's hidden states)
and engine/mtp_drafter.py `MtpDrafter` (the MTP module a target checkpoint ships;
`draft_model="mtp"` names the model's own), both fed through engine/captured_drafter.py.

Drafters that read the target's hidden states (learned heads: EAGLE-3, MTP) declare which
ones as `capture` (a `core.models.Capture`); the engine then runs every target step over
their rows with that capture (inside the same compiled forward: `step_capture`) and hands
each row drafter the states of the positions the step processed and kept:

    class RowDrafter:
        def observe(self, start: int, states: mx.array, tokens: list[int]) -> None: ...

`states` [n, points * hidden] are those of positions start .. start + n - 1 (a prefill
chunk, a decode position, a verify's accepted positions); `tokens` the row's sequence as
known then (`observe_captured`).
"""

from __future__ import annotations

import secrets
import time

from typing import Any, Callable, Protocol, Sequence

import attrs
import mlx.core as mx

from fx_engine.core.buckets import pow2_ceil, prefill_pieces
from fx_engine.core.cache import span_bucket, with_lengths
from fx_engine.core.models import Capture, family_of
from fx_engine.core.sampling import SamplingConfig, make_sampling_params, sampling_distribution
from fx_engine.core.state import init_state, sample_step
from fx_engine.core.steps import prefill_step_compiled
from fx_engine.core.tree import total_traces, tree_leaves
from fx_engine.engine.speculation import draft_candidates


@attrs.frozen
class Draft:
    tokens: tuple[int, ...] = ()
    probs: Any = None  # mx.array [len(tokens), V] of the drafter's distribution, or None


class RowDrafter(Protocol):
    def propose(self, tokens: list[int], k: int) -> Draft: ...


class Drafter(Protocol):
    def new_row(self, prompt: list[int], sampling: SamplingConfig) -> RowDrafter: ...


# ----------------------------------------------------------------------- prompt lookup


@attrs.frozen
class PromptLookup:
    """Prompt-lookup (n-gram) drafting: find the most recent earlier occurrence of the last
    n tokens (n from ngram_max down to ngram_min) in the prompt and generated text, and
    propose the tokens that followed it. No second model; deterministic drafts."""

    ngram_min: int = 1
    ngram_max: int = 3

    def __attrs_post_init__(self) -> None:
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"prompt_lookup: need 1 <= ngram_min <= ngram_max, got "
                             f"{self.ngram_min}, {self.ngram_max}")

    def new_row(self, prompt: list[int], sampling: SamplingConfig) -> "PromptLookup":
        return self

    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft(tuple(lookup(tokens, k, self.ngram_min, self.ngram_max)))


def lookup(tokens: Sequence[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching
    suffix n-gram (n in [ngram_min, ngram_max])."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    seq = list(tokens)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        tail = seq[n_tok - n:]
        # latest start i < n_tok - n with seq[i:i+n] == tail, that has a continuation
        for i in range(n_tok - n - 1, -1, -1):
            if seq[i : i + n] == tail:
                return seq[i + n : i + n + k]
    return []


# -------------------------------------------------------------------------- draft model


class DraftModel:
    """A smaller model with the target's tokenizer proposing k tokens per step from its own
    1-row cache (prefilled with the prompt, kept in lockstep: each `propose` rewinds it by
    length to the accepted sequence and feeds what it has not seen). It samples with the
    request's own sampling settings (greedy rows draft greedily) and reports q for the
    target's rejection rule."""

    def __init__(self, model: Any, prefill_chunk: int = 512):
        self.model = model
        self.prefill_chunk = prefill_chunk

    def new_row(self, prompt: list[int], sampling: SamplingConfig) -> "_DraftRow":
        return _DraftRow(self, sampling)


def draft_sampling(sampling: SamplingConfig) -> SamplingConfig:
    """A sampling drafter's own sampling settings (the draft model's, the learned heads'):
    the request's filters and temperature, no penalties or bias (their effect belongs to the
    target; q only needs to be the distribution drawn from). A seeded request's drafts get
    their own key stream: drawing drafts with the target's own uniforms would correlate them
    with the target's later draws. (An unseeded row, possible in users' own loops, gets
    fresh entropy: the core would otherwise give both streams seed 0.)"""
    seed = (secrets.randbits(63) if sampling.seed is None
            else (sampling.seed * 0x9E3779B1 + 0x7F4A7C15) % 2**64)
    return SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p, seed=seed)


class _DraftRow:
    def __init__(self, owner: DraftModel, sampling: SamplingConfig):
        self.owner = owner
        m = owner.model
        self.sampling = draft_sampling(sampling)
        self.params = make_sampling_params([self.sampling], m.config.vocab_size)
        self.keys = None
        self.cache = None
        self.fed: list[int] = []

    def _feed(self, tokens: list[int]) -> mx.array:
        """Rewind to the common prefix with `tokens`, feed the rest; logits of the last."""
        m, chunk = self.owner.model, self.owner.prefill_chunk
        common = 0
        for a, b in zip(self.fed, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # always feed at least the last token
        need = len(tokens) + 64
        if self.cache is None or need > self.cache.capacity:
            from fx_engine.engine.scheduler import capacity_bucket

            cap = capacity_bucket(need + chunk)
            old = self.cache
            # pieces are padded to a power of two >= 16: ring headroom for the padded size
            self.cache = m.new_cache(1, cap, headroom=pow2_ceil(chunk, 16))
            if old is not None:  # start over (rare: a capacity bucket change)
                common = 0
        if common < len(self.fed) and any(s.state for s in self.cache.layout):
            # a recurrent state cannot be rewound: start over (the cache restarts at 0)
            self.cache = m.new_cache(1, self.cache.capacity, headroom=pow2_ceil(chunk, 16))
            common = 0
        self.cache = with_lengths(self.cache, mx.array([common], mx.int32))
        logits = None
        vocab = m.config.vocab_size  # (ids it does not have, e.g. a multimodal target's image
        ids = [t if t < vocab else 0 for t in tokens]  # tokens, are fed as 0: drafts only)
        for pos, n, size in prefill_pieces(common, len(tokens), chunk):
            logits, self.cache = prefill_step_compiled(
                m.params, self.cache, mx.array([ids[pos : pos + n] + [0] * (size - n)], mx.int32),
                mx.array([n], mx.int32), span=span_bucket(pos + size, self.cache.capacity))
        self.fed = list(tokens)
        return logits

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft()
        m = self.owner.model
        logits = self._feed(list(tokens))
        state = init_state([self.sampling], [tokens], m.config.vocab_size)
        if self.keys is not None:
            state = attrs.evolve(state, keys=self.keys)
        out, probs = [], []
        for i in range(k):
            probs.append(self._q(logits, state))
            state = sample_step(state, logits)
            out.append(int(state.tokens[0].item()))
            if i + 1 < k:
                lg, self.cache = prefill_step_compiled(
                    m.params, self.cache, state.tokens[:, None], mx.array([1], mx.int32),
                    span=span_bucket(len(self.fed) + 1, self.cache.capacity))
                self.fed.append(out[-1])
                logits = lg
        self.keys = state.keys
        q = None if self.sampling.temperature == 0 else mx.concatenate(probs, axis=0)
        return Draft(tuple(out), q)

    def _q(self, logits: mx.array, state: Any) -> mx.array:
        """The draft's sampling distribution [1, V] (what sample_step draws from)."""
        if self.sampling.temperature == 0:
            return mx.zeros((1, 0))
        return sampling_distribution(logits.astype(mx.float32), self.params, state.keys)


def self_draft_model(model: Any, num_layers: int) -> Any:
    """A draft model made of the target's first `num_layers` layers, its final norm and
    output head (self-speculative, as in LayerSkip): no second checkpoint needed. It shares
    the target's arrays (no copy)."""
    cfg, family = model.config, family_of(model.config)
    if family.layer_range is None:
        raise ValueError(f"self_draft_model: {family.name} models are not supported (use draft_model=)")
    if not 1 <= num_layers < cfg.num_layers:
        raise ValueError(f"self_draft_model: num_layers must be in [1, {cfg.num_layers}), got {num_layers}")
    if getattr(model, "pipeline_parallel", 1) > 1:  # the first layers live on the first stages only
        raise ValueError("self_draft_model: not available with pipeline parallelism (use a separate "
                         "draft model, or tensor parallelism)")
    try:
        params = family.layer_range(model.params, 0, num_layers)
    except ValueError as e:  # (ConfigError: the family's layers cannot be cut there)
        raise ValueError(f"self_draft_model: {e}") from None
    # arrays the cut made (Gemma 4's per-layer table columns) are computed here, on the
    # caller's thread: the engine's thread cannot evaluate another thread's lazy arrays
    mx.eval(tree_leaves(params))
    return attrs.evolve(model, config=params.config, params=params,
                        fingerprint=f"{model.fingerprint}-first{num_layers}")


def capture_of(drafter: Any) -> Capture | None:
    """The hidden states a drafter reads from the target's steps (None: none)."""
    return getattr(drafter, "capture", None)


def step_capture(rows: Sequence[Any]) -> Capture | None:
    """The capture a target step over `rows` (engine requests or None) runs with: the one
    its rows' drafters share, else their union (boundaries in first-seen order, normed if any
    asks); None when no row's drafter reads hidden states (the step is the plain one)."""
    caps = [c for c in (capture_of(r.drafter) for r in rows if r is not None) if c is not None]
    if not caps:
        return None
    if all(c == caps[0] for c in caps):
        return caps[0]
    layers: list[int] = []
    for c in caps:
        layers += [b for b in c.layers if b not in layers]
    return Capture(tuple(layers), normed=any(c.normed for c in caps))


def observe_captured(req: Any, union: Capture, states: mx.array, start: int, tokens: Sequence[int]) -> None:
    """Hand a row's drafter the captured states [n, union.points * hidden] of positions start
    .. start + n - 1, cut to its own capture's points (its row drafter made if need be). A
    drafter without a capture is left alone; its errors are the caller's (the request's)."""
    mine = capture_of(req.drafter)
    if mine is None or states.shape[0] == 0:
        return
    if mine != union:
        width = states.shape[-1] // union.points
        order = list(union.layers) + (["normed"] if union.normed else [])
        pick = list(mine.layers) + (["normed"] if mine.normed else [])
        cols = [order.index(x) * width + j for x in pick for j in range(width)]
        states = mx.take(states, mx.array(cols, mx.int32), axis=-1)
    if req.row_drafter is None:
        req.row_drafter = req.drafter.new_row(list(req.ids), req.cfg)
    req.row_drafter.observe(start, states, tokens)


def as_drafter(spec: Any) -> Drafter | None:
    """Normalise the request's drafter argument (None, a Drafter, or a Model)."""
    if spec is None or hasattr(spec, "new_row"):
        return spec
    if hasattr(spec, "params") and hasattr(spec, "tokenizer"):
        return DraftModel(spec)
    raise ValueError(f"draft_model must be a fx_engine Model or a drafter with new_row(), "
                     f"got {type(spec).__name__}")


# ----------------------------------------------------------------------- the engine's side


def propose_drafts(plan: dict[Any, int], vocab: int,
                   on_error: Callable[[Any, BaseException], None]) -> dict[Any, Any]:
    """Ask each planned row (an engine request: `drafter`, `row_drafter`, `ids`, `cfg`,
    `generated`) for up to k tokens: {row: (tokens, probs or None)}, rows that proposed
    nothing left out. A drafter is user code: one that raises or returns something
    malformed (too many tokens, negative or non-int ids, probs of the wrong shape) goes to
    `on_error` (it fails its own request only). A draft model over another vocabulary
    size is trimmed or zero-padded to the target's `vocab`, and a draft stops at the first
    token the target's vocabulary does not have.

    Rows of one drafter object that has `propose_rows(rows, tokens_list, ks)` (the learned
    heads: one batched drafter call per step for all of them) are asked together; if that
    call raises, each of its rows is asked alone (a bad row fails only itself)."""
    batched = _batched_drafts(plan)
    out: dict[Any, Any] = {}
    for req, k in plan.items():
        try:
            if req in batched:
                d = batched[req]
            else:
                if req.row_drafter is None:
                    req.row_drafter = req.drafter.new_row(list(req.ids), req.cfg)
                d = req.row_drafter.propose(list(req.ids) + req.generated, k)
            toks = tuple(getattr(d, "tokens", ()))
            probs = getattr(d, "probs", None)
            if len(toks) > k or any(not isinstance(t, int) or t < 0 for t in toks):
                raise ValueError(f"drafter proposed {toks!r}: expected at most {k} "
                                 "non-negative token ids")
            if probs is not None and (probs.ndim != 2 or probs.shape[0] != len(toks)):
                raise ValueError(f"drafter probs must have shape [{len(toks)}, vocab], "
                                 f"got {tuple(probs.shape)}")
        except Exception as e:
            on_error(req, e)
            continue
        n = next((i for i, t in enumerate(toks) if t >= vocab), len(toks))
        toks = toks[:n]
        if probs is not None:
            probs = probs[:n, :vocab]
            if probs.shape[1] < vocab:
                probs = mx.pad(probs, [(0, 0), (0, vocab - probs.shape[1])])
        if toks:
            out[req] = (toks, probs)
    return out


def _batched_drafts(plan: dict[Any, int]) -> dict[Any, Any]:
    """{row: its Draft} for the planned rows whose drafter proposes rows together
    (`propose_rows`), two or more rows of one drafter object per call. Rows left out (a
    drafter without the hook, a lone row, a row drafter that could not be made, a batched
    call that raised) are asked alone by the caller."""
    groups: dict[int, list[Any]] = {}
    for req in plan:
        if callable(getattr(req.drafter, "propose_rows", None)):
            groups.setdefault(id(req.drafter), []).append(req)
    got: dict[Any, Any] = {}
    for reqs in groups.values():
        if len(reqs) < 2:
            continue
        try:
            for req in reqs:
                if req.row_drafter is None:
                    req.row_drafter = req.drafter.new_row(list(req.ids), req.cfg)
            drafts = reqs[0].drafter.propose_rows([r.row_drafter for r in reqs],
                                                  [list(r.ids) + r.generated for r in reqs],
                                                  [plan[r] for r in reqs])
            if len(drafts) != len(reqs):
                raise ValueError(f"propose_rows returned {len(drafts)} drafts for {len(reqs)} rows")
        except Exception:  # (each row alone: the error, if it is one row's, fails it only)
            continue
        got.update(zip(reqs, drafts))
    return got


def speculate(policy: Any, batch: Any, vocab: int, decided: Callable[[Callable[[], Any]], Any],
              on_error: Callable[[Any, BaseException], None]) -> tuple[dict[Any, Any], int]:
    """A step's drafting, planned in two halves by the speculation policy
    (engine/speculation.py) because the drafts it weighs exist only once drafters have
    run: which live rows of `batch` to ask for how many tokens (nothing when drafting is
    not expected to pay: drafters' work is not free), then K from what they proposed (0: a
    plain decode step). Returns ({row: (tokens, probs)} cut to K, K). `decided(decide)`
    makes a decision every rank of a sharded engine shares (rank 0's: they depend on
    timing); a drafter's failure goes to on_error."""
    live = batch.live()
    by_id = {r.handle.id: r for r in live}
    asked = {by_id[i]: n for i, n in decided(lambda: {
        r.handle.id: n for r, n in policy.plan_drafts(
            len(batch.rows), draft_candidates(live), len(live)).items()}).items()}
    if not asked:
        return {}, 0
    t0, traces = time.perf_counter(), total_traces()
    drafts = propose_drafts(asked, vocab, on_error)
    if total_traces() == traces:  # (a drafter's first compile is not its cost)
        policy.observe_drafting(time.perf_counter() - t0)
    live = batch.live()  # a drafter may fail its row
    k = decided(lambda: policy.choose_k(
        len(batch.rows), [(r.spec.alpha, len(t)) for r, (t, _) in drafts.items()],
        len(live)) if drafts else 0)
    if not k:
        return {}, 0
    return {r: (t[:k], None if p is None else p[:k]) for r, (t, p) in drafts.items()}, k


def draft_inputs(rows: Sequence[Any], drafts: dict[Any, Any], k: int,
                 vocab: int) -> tuple[mx.array, mx.array, mx.array | None, list[int]]:
    """verify_step's draft inputs for the batch's rows: tokens [B, K] (zero-padded), counts
    [B] (0: the row decodes), and the drafters' distributions [B, K, V] (None when every
    draft is deterministic; else a point mass on each deterministic row's tokens, so one
    array serves the batch), plus the counts as a list (what the emit loop adapts by)."""
    b = len(rows)
    arr = [[0] * k for _ in range(b)]
    n = [0] * b
    for req, (toks, _) in drafts.items():
        if req.row is None:
            continue
        arr[req.row][: len(toks)] = toks
        n[req.row] = len(toks)
    probs = None
    if any(p is not None for _, p in drafts.values()):
        per_row = []
        for req in rows:
            toks, p = drafts.get(req, ((), None)) if req is not None else ((), None)
            if p is None:  # deterministic drafts: a point mass on each token
                p = mx.zeros((len(toks), vocab)) if not toks else (
                    mx.arange(vocab)[None, :] == mx.array(toks)[:, None]).astype(mx.float32)
            per_row.append(mx.pad(p.astype(mx.float32), [(0, k - p.shape[0]), (0, 0)]))
        probs = mx.stack(per_row)
    return mx.array(arr, mx.int32), mx.array(n, mx.int32), probs, n


__all__ = ["Draft", "DraftModel", "Drafter", "PromptLookup", "RowDrafter", "as_drafter", "capture_of", "draft_sampling",
           "lookup", "observe_captured", "self_draft_model", "propose_drafts", "draft_inputs", "speculate",
           "step_capture"]
