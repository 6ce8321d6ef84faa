"""Sampled drafting for the learned drafters (EAGLE-3 heads, MTP modules; issue 45).

A sampled row (temperature > 0) drafts each token by drawing from its head's distribution
processed with the row's own sampling settings (`core.sampling.sampling_distribution`:
temperature, top-p, top-k, min-p), and hands that distribution q to verification
(`speculative.verify_step`'s draft_probs): accepted with min(1, p / q), the residual
max(0, p - q) drawn otherwise, the standard speculative sampling rule, exact for any q that
is the one the drafts were drawn from. A draft from q (rather than the head's argmax, a
point mass) is accepted more often wherever the head's distribution is close to the
target's. Greedy rows (temperature 0) keep the head's argmax.

    tokens, q, keys = draw(logits, greedy, params, keys, active, target_ids)

`logits` [B, Vs] are the head's (over its own vocabulary: an EAGLE-3 head's draft
vocabulary, `target_ids` its target id per draft id; None: the target's own), `params`
their rows' `SamplingParams` (vocab_size Vs), `keys` their PRNG keys: each drawing row
consumes one split of its key (as `core.sampling.sample`), other rows (greedy, inactive)
keep theirs and their `greedy` token. Row-wise throughout: a row's draw does not depend on
the batch it is drawn in.
"""

from __future__ import annotations

import mlx.core as mx
from jaxtyping import Bool, Float, Int, UInt32

from fx_engine.core.sampling import SamplingParams, sampling_logits
from fx_engine.core.tree import CompiledFunction

__all__ = ["draw", "draw_compiled"]


def draw(
    logits: Float[mx.array, "B Vs"], greedy: Int[mx.array, "B"], params: SamplingParams,
    keys: UInt32[mx.array, "B 2"], active: Bool[mx.array, "B"], target_ids: Int[mx.array, "Vs"] | None = None,
) -> tuple[Int[mx.array, "B"], Float[mx.array, "B Vs"], UInt32[mx.array, "B 2"]]:
    """Each active sampled row's draft drawn from q = softmax(its processed logits): the
    draft (a target id), q [B, Vs] (meaningful on drawing rows) and the keys after the
    draw. Greedy and inactive rows keep `greedy` and their key."""
    x, keys_after_filters = sampling_logits(logits.astype(mx.float32), params, keys)
    q = mx.softmax(x, axis=-1, precise=True)
    both = mx.vmap(lambda k: mx.random.split(k))(keys_after_filters)  # [B, 2, 2]
    after, sub = both[:, 0], both[:, 1]
    u = mx.vmap(lambda k: mx.random.uniform(0, 1, (1,), key=k))(sub)  # [B, 1]
    # inverse CDF over q: the first index whose inclusive cumsum exceeds u * total (tokens
    # with q 0 have an empty interval), kept on a token with q > 0 at the rounding corner
    cs = mx.cumsum(q, axis=-1)
    total = cs[:, -1:]
    idx = mx.minimum((cs <= u * total).sum(axis=-1), (cs < total).sum(axis=-1)).astype(mx.int32)
    tok = idx if target_ids is None else mx.take(target_ids.astype(mx.int32), idx)
    drawing = active & (params.temperature > 0)
    return (mx.where(drawing, tok, greedy.astype(mx.int32)), q,
            mx.where(drawing[:, None], after, keys))


# the engine's compiled form (keyed on B, Vs and the rows' sampling features: a few shapes)
draw_compiled = CompiledFunction(draw, name="sampled_draft")
