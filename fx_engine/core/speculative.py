"""Speculative decoding's pure part: score K drafts per row in one target pass, accept per row,
produce the next token, and roll the cache back by length.

    verify_step(params, cache, state, drafts[B, K], n_draft[B], draft_probs=None, span=None,
                mask=None) -> (state, cache, VerifyResult)

Row b forwards its last sampled token and its first n_draft[b] drafts (K + 1 positions, a
static bucket; rows with n_draft == 0 just decode). The target's distribution at each
position is the one plain decoding would sample from there: logit_bias and penalties over
the row's history *including the drafts before that position*, then mlx-lm's filters and
temperature. A constrained row's allowed-token mask at each position (`mask[B, K+1, W]`,
computed by the host from the grammar state each draft leads to) applies first, so
acceptance is exact under the grammar too; the host drafts only allowed tokens.

Acceptance (exact):
* greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit
  the argmax at the first mismatch (or after the last draft: the bonus token), so greedy
  output is identical to non-speculative greedy output;
* sampled rows accept draft j with probability min(1, p_j(d) / q_j(d)) and on rejection
  draw from the normalised positive part of p_j - q_j; after n accepted drafts the bonus is
  drawn from p_n. The emitted tokens are then distributed exactly as the target's (the
  standard speculative-sampling theorem). q is the drafter's distribution (`draft_probs`
  [B, K, V]); None means deterministic drafts (prompt lookup): q is a point mass, so the
  draft is accepted with probability p_j(d) and the residual is p_j without d.
* PRNG: a speculating row splits its key into (next key, acceptance uniforms, final draw);
  a row that drafts nothing samples as `decode_step` would (the same key use and sampling
  code; its logits come from a (K+1)-token forward, bitwise equal to decode_step's in
  batch-invariant mode, equal up to BLAS rounding otherwise).

Rollback is pure: the cache's length of row b becomes old + 1 + accepted[b]; entries past
it are stale and never read (see fx_engine/core/cache.py; ring caches need headroom >= K).
Recurrent entries keep their state after every verified position during the forward and
`cache.commit` selects the one after each row's accepted tokens.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core import packing
from fx_engine.core.adapters import Adapters, with_adapters
from fx_engine.core.cache import CacheError, KVCache, check_cache, commit
from fx_engine.core.checks import counts_arg, float_arg, mask_arg, span_arg, tokens_arg
from fx_engine.core.models import AnyParams, Capture, forward, hidden_to_logits
from fx_engine.core.sampling import (SamplingParams, _categorical_rows, _fast_logsumexp, _split_rows, _uniform_rows, apply_token_mask, process_logits, push_history, sample, sampling_distribution, top_logprobs)
from fx_engine.core.state import DecodeState, check_state, stop_full_rows
from fx_engine.core.tree import STATIC, tree_replace


@attrs.frozen
class VerifyResult:
    """What one verify step emitted per row: `count[b]` tokens (accepted drafts, then the
    correction or bonus token) with the target's logprobs (and top-N alternatives)."""

    tokens: Int[mx.array, "B K1"]
    count: Int[mx.array, "B"]
    accepted: Int[mx.array, "B"]
    logprobs: Float[mx.array, "B K1"]
    top_ids: Int[mx.array, "B K1 N"]
    top_logprobs: Float[mx.array, "B K1 N"]


def _repeat_rows(params: SamplingParams, n: int) -> SamplingParams:
    """Each row's parameters repeated n times (row b -> rows b*n .. b*n + n - 1)."""
    leaves = {f.name: getattr(params, f.name) for f in attrs.fields(SamplingParams)
              if not f.metadata.get(STATIC)}
    return tree_replace(params, **{k: mx.repeat(v, n, axis=0) for k, v in leaves.items()})


def position_histories(history: mx.array, drafts: mx.array) -> mx.array:
    """[B, K+1, W]: the penalty history at each verified position (drafts pushed in order)."""
    hs = [history]
    for j in range(drafts.shape[1]):
        hs.append(push_history(hs[-1], drafts[:, j]))
    return mx.stack(hs, axis=1)


def accept_drafts(
    processed: Float[mx.array, "B K1 V"], logprobs: Float[mx.array, "B K1 V"],
    drafts: Int[mx.array, "B K"], n_draft: Int[mx.array, "B"], params: SamplingParams,
    keys: mx.array, draft_probs: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The acceptance rule. Returns (accepted [B], final token [B], keys after [B, 2]) for
    rows that speculate (n_draft > 0); the caller takes plain-decoding results elsewhere.
    The greedy token is the argmax of `logprobs` (processed - logsumexp), as `sample` takes
    it, so a near tie breaks the same way as in plain decoding."""
    b, k1, v = processed.shape
    k = k1 - 1
    greedy_tok = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # [B, K+1]
    if k == 0:
        return mx.zeros((b,), mx.int32), greedy_tok[:, 0], keys
    j = mx.arange(k, dtype=mx.int32)[None, :]
    in_range = j < n_draft[:, None]
    if "random" not in params.features:  # every row greedy
        ok = (drafts == greedy_tok[:, :k]) & in_range
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
        final = mx.take_along_axis(greedy_tok, accepted[:, None], axis=1)[:, 0]
        return accepted, final, keys
    # The target's sampling distribution at every position (mlx-lm's chain: exact log-softmax,
    # filters, temperature). XTC rows never speculate (the shell gives them n_draft == 0).
    flat = processed.reshape(b * k1, v)
    rep = _repeat_rows(params, k1)
    p = sampling_distribution(flat, rep, mx.repeat(keys, k1, axis=0)).reshape(b, k1, v)
    p_d = mx.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    if draft_probs is None:
        q_d = mx.ones_like(p_d)
    else:
        q_d = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    after, sub = _split_rows(keys)
    k_acc, k_fin = _split_rows(sub)
    u = _uniform_rows(k_acc, (k,))  # [B, K]
    random_row = (params.temperature > 0)[:, None]
    ok = mx.where(random_row, u * q_d < p_d, drafts == greedy_tok[:, :k]) & in_range
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    # Final draw at position `accepted`: the residual max(p - q, 0) after a rejection, p itself
    # for the bonus (all drafts accepted).
    p_a = mx.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = (accepted < n_draft)[:, None]
    if draft_probs is None:
        d_a = mx.take_along_axis(drafts, mx.minimum(accepted, k - 1)[:, None], axis=1)
        q_a = (mx.arange(v)[None, :] == d_a).astype(p.dtype)
    else:
        q_pad = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)
        q_a = mx.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
    resid = mx.where(rejected, mx.maximum(p_a - q_a, 0.0), p_a)
    # p == q exactly leaves no positive part: then any draw from p is correct; fall back to p.
    resid = mx.where(mx.sum(resid, axis=-1, keepdims=True) > 0, resid, p_a)
    drawn = _categorical_rows(mx.log(resid), k_fin)
    g_final = mx.take_along_axis(greedy_tok, accepted[:, None], axis=1)[:, 0]
    final = mx.where(random_row[:, 0], drawn, g_final)
    keys = mx.where(random_row, after, keys)
    return accepted, final, keys


def verify_step(
    params: AnyParams, cache: KVCache, state: DecodeState, drafts: Int[mx.array, "B K"],
    n_draft: Int[mx.array, "B"], draft_probs: Float[mx.array, "B K V"] | None = None,
    span: int | None = None, mask: Int[mx.array, "B K1 W"] | None = None,
    adapters: Adapters | None = None, capture: Capture | None = None, pack: int | None = None,
) -> tuple[DecodeState, KVCache, VerifyResult]:
    """Verify up to K drafts per row in one target pass (see the module docstring).

    span (static): attend over the first `span` cache slots (>= max(lengths) + K + 1).
    mask: allowed-token bitmask per row and verified position (None: no constraint).
    adapters: each row's LoRA adapter (`core.adapters.Adapters`; None: the base model).
    capture: also return the hidden states at these layer boundaries (`core.models.Capture`)
    of the K + 1 verified positions [B, K + 1, points * H], fourth: those of the first
    `result.count[b]` positions are the accepted sequence's (the rest were rejected).
    pack (static): the products, the output head included, on this many rows holding the
    active rows' last tokens and drafts (core/packing.py; rows drafting fewer than K: no
    work on their padding), the same outputs. Rows filled in order; a row's drafts past
    `pack` are not verified (as drafts past the capacity are not), an active row with no
    room at all stops as a full row does.
    """
    cache = check_cache(cache)
    b = cache.rows
    drafts = tokens_arg(drafts, b, "drafts")
    k = drafts.shape[1]
    if k + 1 > cache.capacity:
        raise CacheError(f"drafts: {k} drafts + the last token per row exceed the cache's "
                         f"capacity of {cache.capacity} positions")
    n_draft = counts_arg(n_draft, b, "n_draft")
    span = span_arg(span, k + 1, cache.capacity)
    if draft_probs is not None:
        draft_probs = float_arg(draft_probs, (b, k, None), "draft_probs", f"f32[B, K, V] (B = {b}, K = {k})")
    if mask is not None:
        mask = mask_arg(mask, (b, k + 1), None)
    # A row whose cache is full cannot take even its last token: it stops (`full`).
    state = stop_full_rows(check_state(state, b), cache.lengths, cache.capacity, 1)
    act = state.active
    # Only drafts whose positions fit in the cache are verified: a row never has accepted
    # tokens written past its capacity (they would land in the sink and be lost).
    room = mx.maximum(cache.capacity - 1 - cache.lengths, 0)
    n_draft = mx.where(act, mx.minimum(mx.minimum(n_draft.astype(mx.int32), room), k), 0)
    if "xtc" in state.params.features:  # XTC's random removal is not a fixed distribution
        n_draft = mx.where(state.params.xtc_probability > 0, 0, n_draft)
    pack = packing.check_pack(pack, adapters)
    if pack is not None:  # what fits in the packed rows: fewer drafts, or no room (the row stops)
        fit = packing.fitted(act.astype(mx.int32) * (1 + n_draft), pack)
        lost = act & (fit == 0)
        state = tree_replace(state, active=act & ~lost, full=state.full | lost)
        act = state.active
        n_draft = mx.where(act, mx.minimum(n_draft, fit - 1), 0)
    tokens = mx.concatenate([state.tokens[:, None], drafts.astype(mx.int32)], axis=1)
    old = cache.lengths
    recurrent = any(s.state for s in cache.layout)
    if recurrent:  # recurrent states cannot be rolled back: keep the one after each position
        cache = tree_replace(cache, keep_steps=True)
    params = with_adapters(params, adapters)
    n_valid = act.astype(mx.int32) * (1 + n_draft)
    out = forward(params, cache, tokens, n_valid, span, capture, pack=pack)
    h, cache = out[0], out[1]
    if pack is None:
        logits = hidden_to_logits(params, h).astype(mx.float32)  # [B, K+1, V]
    else:  # the head on the packed rows alone
        logits = packing.on_packed(lambda x: hidden_to_logits(params, x).astype(mx.float32),
                                   h.reshape(b * (k + 1), -1), n_valid, k + 1, pack).reshape(b, k + 1, -1)
    if mask is not None:
        logits = apply_token_mask(logits, mask)
    v = logits.shape[-1]
    hist = position_histories(state.history, drafts.astype(mx.int32))  # [B, K+1, W]
    rep = _repeat_rows(state.params, k + 1)
    processed = process_logits(logits.reshape(b * (k + 1), v), hist.reshape(b * (k + 1), -1), rep)
    logprobs = (processed - _fast_logsumexp(processed)).reshape(b, k + 1, v)
    processed = processed.reshape(b, k + 1, v)

    # Rows that draft nothing: exactly decode_step's sample at position 0.
    plain_tok, _, plain_keys = sample(processed[:, 0], state.params, state.keys)
    accepted, spec_tok, spec_keys = accept_drafts(
        processed, logprobs, drafts.astype(mx.int32), n_draft, state.params, state.keys,
        draft_probs)
    spec = n_draft > 0
    accepted = mx.where(spec, accepted, 0)
    final = mx.where(spec, spec_tok, plain_tok)
    keys = mx.where(spec[:, None], spec_keys, plain_keys)

    # Emitted tokens: accepted drafts, then the final token; the target's logprobs for each.
    pos = mx.arange(k + 1, dtype=mx.int32)[None, :]
    padded = mx.concatenate([drafts.astype(mx.int32), mx.zeros((b, 1), mx.int32)], axis=1)
    emitted = mx.where(pos < accepted[:, None], padded, mx.where(pos == accepted[:, None], final[:, None], 0))
    lp = mx.take_along_axis(logprobs, emitted[..., None], axis=-1)[..., 0]
    top_ids, top_vals = top_logprobs(logprobs.reshape(b * (k + 1), v), state.n_top)
    top_ids = top_ids.reshape(b, k + 1, state.n_top)
    top_vals = top_vals.reshape(b, k + 1, state.n_top)
    count = mx.where(act, accepted + 1, 0)

    hist_a = mx.take_along_axis(hist, accepted[:, None, None], axis=1)[:, 0]
    col = act[:, None]
    at_a = lambda x: mx.take_along_axis(x, accepted[:, None, None], axis=1)[:, 0]  # noqa: E731
    new_state = tree_replace(
        state,
        tokens=mx.where(act, final, state.tokens),
        keys=mx.where(col, keys, state.keys),
        history=mx.where(col, push_history(hist_a, final), state.history),
        logprob=mx.where(act, mx.take_along_axis(lp, accepted[:, None], axis=1)[:, 0], state.logprob),
        top_ids=mx.where(col, at_a(top_ids), state.top_ids),
        top_logprobs=mx.where(col, at_a(top_vals), state.top_logprobs),
    )
    new_len = mx.where(act, mx.minimum(old + 1 + accepted, cache.capacity), old)
    cache = commit(cache, new_len, new_len - old)
    result = VerifyResult(tokens=emitted, count=count, accepted=accepted, logprobs=lp,
                          top_ids=top_ids, top_logprobs=top_vals)
    return (new_state, cache, result) if capture is None else (new_state, cache, result, out[2])


# ------------------------------------------------------------------ the drafter's side


@attrs.frozen
class DraftSync:
    """A speculative loop's bookkeeping after `verify_step`, per row (`draft_sync`).

    count: emitted tokens to keep, `result.tokens[b, :count[b]]`: the verify's count, cut
    just after the first stop token (EOS) inside the accepted run. stopped: a stop token
    was kept: the row is finished (`stop_rows(state, stopped)`; the target's cache may hold
    tokens past it, which no longer matter). draft_lengths: the drafter's cache rolled back
    to what it processed that the target accepted (`with_lengths(draft_cache,
    draft_lengths)`). feed[b, :n_feed[b]]: the tokens the drafter must process next, in
    order, ending with the new `state.tokens` (its next draft's input): 1 token usually, 2
    after a fully accepted draft (the last draft was never fed to the drafter); n_feed is
    0 for rows that emitted nothing."""

    count: Int[mx.array, "B"]
    stopped: mx.array  # bool [B]
    draft_lengths: Int[mx.array, "B"]
    feed: Int[mx.array, "B K2"]
    n_feed: Int[mx.array, "B"]


def draft_sync(
    result: VerifyResult, last_tokens: Int[mx.array, "B"], draft_lengths: Int[mx.array, "B"],
    n_fed: Int[mx.array, "B"], stop_ids: Int[mx.array, "S"] | None = None,
) -> DraftSync:
    """What the drafter does after a verify, for a drafter with its own cache.

    last_tokens: `state.tokens` before the verify (t0, the token the drafts follow).
    draft_lengths: the drafter cache's lengths after drafting. n_fed: how many of
    [t0, d_1, .., d_K] it processed while drafting (K drafts sampled one at a time feed t0
    and d_1 .. d_{K-1}: n_fed = n_draft; 0 for a drafter without a cache).
    stop_ids: token ids that end a row (EOS); None: none.

    The drafter's processed tokens agree with the accepted sequence t0, d_1 .. d_a for the
    first min(n_fed, 1 + a); it keeps those and must feed the rest plus the final token.
    """
    b, k1 = result.tokens.shape
    count = result.count.astype(mx.int32)
    stopped = mx.zeros((b,), mx.bool_)
    if stop_ids is not None:
        stop_ids = mx.array(stop_ids, mx.int32) if not isinstance(stop_ids, mx.array) else stop_ids
        pos = mx.arange(k1, dtype=mx.int32)[None, :]
        hit = mx.any(result.tokens[..., None] == stop_ids.reshape(1, 1, -1), axis=-1) & (pos < count[:, None])
        stopped = mx.any(hit, axis=-1)
        first = mx.argmax(hit.astype(mx.int32), axis=-1).astype(mx.int32)  # first stop position
        count = mx.where(stopped, first + 1, count)
    seq = mx.concatenate([last_tokens.astype(mx.int32)[:, None], result.tokens.astype(mx.int32)], axis=1)
    keep = mx.minimum(n_fed.astype(mx.int32), count)  # count = 1 + accepted (before a stop cut)
    emitted = count > 0
    n_feed = mx.where(emitted, count + 1 - keep, 0)
    cols = mx.minimum(keep[:, None] + mx.arange(k1 + 1, dtype=mx.int32)[None, :], k1)
    feed = mx.take_along_axis(seq, cols, axis=1)
    lengths = draft_lengths.astype(mx.int32) - n_fed.astype(mx.int32) + mx.where(emitted, keep, n_fed)
    return DraftSync(count=count, stopped=stopped, draft_lengths=lengths, feed=feed, n_feed=n_feed)
