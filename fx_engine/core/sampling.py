"""Per-row token sampling: logits processors, filters, PRNG discipline.

Semantics follow mlx-lm (``mlx_lm.sample_utils`` + ``mlx_lm.generate.generate_step``) so
results can be checked against it; see ``specs/sampling.md`` for the contract.

One step, for a batch of B rows with different settings sharing ONE compiled graph::

    logits = process_logits(logits, history, params)        # bias, repetition, presence, frequency
    tokens, logprobs, keys = sample(logits, params, keys)   # logprobs = logits - logsumexp(logits)
    history = push_history(history, tokens)

Everything per step is an array leaf of ``SamplingParams`` (never a Python scalar baked into
the graph). The only static metadata is ``features`` (the union of the filters any row uses,
so a greedy-only batch compiles to an argmax) and ``vocab_size``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Bool, Float, Float32, Int, Int32, UInt32

from fx_engine.core.buckets import pow2_ceil
from fx_engine.core.nn import fast_exp
from fx_engine.core.tree import static_field

__all__ = [
    "FEATURES",
    "MAX_LOGPROBS",
    "SamplingConfig",
    "SamplingParams",
    "make_sampling_params",
    "init_keys",
    "history_width",
    "init_history",
    "push_history",
    "process_logits",
    "apply_filters",
    "sampling_distribution",
    "sampling_logits",
    "sample",
    "top_logprobs",
    "num_top_logprobs",
    "mask_words",
    "apply_token_mask",
]

#: Every feature name that can appear in ``SamplingParams.features``.
FEATURES = frozenset({"top_p", "min_p", "xtc", "top_k", "random", "penalties", "bias"})
#: Largest number of top-N alternative logprobs a request may ask for.
MAX_LOGPROBS = 20

# jaxtyping works directly on mx.array: it reads the dtype name from repr(x.dtype)
# ("mlx.core.float32" -> "float32"), so `Float32[mx.array, "B V"]` checks dtype and shape.
Logits = Float32[mx.array, "B V"]
Keys = UInt32[mx.array, "B 2"]
History = Int32[mx.array, "B W"]
Tokens = Int32[mx.array, "B"]


# --------------------------------------------------------------------------------------
# Per-request configuration (host side, validated on construction)
# --------------------------------------------------------------------------------------


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    if math.isinf(value) or abs(value) > _F32_MAX:  # sampling runs in float32
        raise ValueError(f"{name} must be finite in float32 (|x| <= 3.4e38), got {value!r}")
    return value


_F32_MAX = 3.4028234663852886e38


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _copy_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a dict[int, float] or None, got {type(value).__name__}")
    out: dict[int, float] = {}
    for k, v in value.items():
        tok = _integer("logit_bias token id", k)
        if tok < 0:
            raise ValueError(f"logit_bias token id must be >= 0, got {tok}")
        out[tok] = _real(f"logit_bias[{tok}]", v)
    return out


@attrs.frozen(kw_only=True)
class SamplingConfig:
    """One request's sampling settings (mlx-lm names and defaults).

    temperature 0 means greedy (argmax; the filters are ignored, as in mlx-lm's
    ``make_sampler``). top_p 1, top_k 0, min_p 0 and xtc_probability 0 switch that filter
    off; repetition_penalty None and presence/frequency penalty 0 switch that processor off.
    Every invalid value raises ``ValueError`` whose message starts with the parameter name.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: dict[int, float] | None = attrs.field(default=None, converter=_copy_bias, hash=False)
    seed: int | None = None
    logprobs: int = 0

    def __attrs_post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        t = _real("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t!r}")
        put("temperature", t)

        p = _real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        put("top_p", p)

        k = _integer("top_k", self.top_k)
        if k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {k!r}")
        put("top_k", k)

        m = _real("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        put("min_p", m)

        xp = _real("xtc_probability", self.xtc_probability)
        if not 0.0 <= xp <= 1.0:
            raise ValueError(f"xtc_probability must be in [0, 1] (0 = off), got {xp!r}")
        put("xtc_probability", xp)

        xt = _real("xtc_threshold", self.xtc_threshold)
        if not 0.0 <= xt <= 0.5:
            raise ValueError(f"xtc_threshold must be in [0, 0.5], got {xt!r}")
        put("xtc_threshold", xt)

        if self.repetition_penalty is not None:
            r = _real("repetition_penalty", self.repetition_penalty)
            if r <= 0:
                raise ValueError(f"repetition_penalty must be None or > 0, got {r!r}")
            put("repetition_penalty", r)

        put("presence_penalty", _real("presence_penalty", self.presence_penalty))
        put("frequency_penalty", _real("frequency_penalty", self.frequency_penalty))

        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            c = _integer(name, getattr(self, name))
            if c < 1:
                raise ValueError(f"{name} must be >= 1, got {c!r}")
            put(name, c)

        if self.seed is not None:
            s = _integer("seed", self.seed)
            if not 0 <= s < 2**64:
                raise ValueError(f"seed must be None or an integer in [0, 2**64), got {s!r}")
            put("seed", s)

        n = _integer("logprobs", self.logprobs)
        if not 0 <= n <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {n!r}")
        put("logprobs", n)

    def validate(self, vocab_size: int) -> "SamplingConfig":
        """Checks that depend on the model's vocabulary; returns self."""
        vocab_size = _integer("vocab_size", vocab_size)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if self.logit_bias:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)
            if bad:
                raise ValueError(
                    f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}"
                )
        return self

    def features(self, vocab_size: int) -> frozenset[str]:
        """The features this row needs (a subset of ``FEATURES``)."""
        out: set[str] = set()
        if self.temperature > 0:
            out.add("random")
            if self.top_p < 1.0:
                out.add("top_p")
            if self.min_p > 0.0:
                out.add("min_p")
            if self.xtc_probability > 0.0:
                out.add("xtc")
            if 0 < self.top_k < vocab_size:
                out.add("top_k")
        if (
            (self.repetition_penalty is not None and self.repetition_penalty != 1.0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        ):
            out.add("penalties")
        if self.logit_bias:
            out.add("bias")
        return frozenset(out)

    def max_context_size(self) -> int:
        """Longest penalty window this row actually uses (0 when it uses none)."""
        sizes = []
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            sizes.append(self.repetition_context_size)
        if self.presence_penalty != 0.0:
            sizes.append(self.presence_context_size)
        if self.frequency_penalty != 0.0:
            sizes.append(self.frequency_context_size)
        return max(sizes, default=0)


# --------------------------------------------------------------------------------------
# Batched parameters (a pytree: array leaves + static metadata)
# --------------------------------------------------------------------------------------


@attrs.frozen
class SamplingParams:
    """Per-row settings of a batch, as arrays with leading dimension B.

    ``logit_bias`` is dense float32 [B, V] when "bias" is in ``features`` and [B, 0]
    otherwise; ``xtc_special`` (tokens XTC never removes) is bool [B, V] when "xtc" is in
    ``features`` and [B, 0] otherwise. Their shapes are a function of ``features``, which is
    already part of the compile key, so they never cause an extra trace.

    ``inv_temperature`` (= fl32(1.0 / temperature), computed in float64 on the host, 1 for
    greedy rows) and ``log_min_p`` (= fl32(log(min_p)), -inf for 0) exist so that the
    arithmetic is bit-identical to mlx-lm, which does those two operations on Python floats.
    """

    temperature: Float32[mx.array, "B"]
    inv_temperature: Float32[mx.array, "B"]
    top_p: Float32[mx.array, "B"]
    top_k: Int32[mx.array, "B"]
    min_p: Float32[mx.array, "B"]
    log_min_p: Float32[mx.array, "B"]
    xtc_probability: Float32[mx.array, "B"]
    xtc_threshold: Float32[mx.array, "B"]
    repetition_penalty: Float32[mx.array, "B"]
    repetition_context_size: Int32[mx.array, "B"]
    presence_penalty: Float32[mx.array, "B"]
    presence_context_size: Int32[mx.array, "B"]
    frequency_penalty: Float32[mx.array, "B"]
    frequency_context_size: Int32[mx.array, "B"]
    logit_bias: Float32[mx.array, "B _"]
    xtc_special: Bool[mx.array, "B _"]
    features: frozenset = static_field()
    vocab_size: int = static_field()

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])


def make_sampling_params(
    configs: Sequence[SamplingConfig],
    vocab_size: int,
    special_token_ids: Iterable[int] = (),
) -> SamplingParams:
    """Stack per-request configs into one ``SamplingParams`` (host side).

    ``special_token_ids`` are the tokens XTC must never remove (mlx-lm's
    ``xtc_special_tokens``, e.g. the newline and EOS ids); they apply to every row.
    """
    configs = list(configs)
    if not configs:
        raise ValueError("configs must hold at least one SamplingConfig")
    vocab_size = _integer("vocab_size", vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for c in configs:
        if not isinstance(c, SamplingConfig):
            raise ValueError(f"configs must be SamplingConfig instances, got {type(c).__name__}")
        c.validate(vocab_size)
    special = sorted({_integer("special_token_ids", t) for t in special_token_ids})
    if special and not (0 <= special[0] and special[-1] < vocab_size):
        raise ValueError(f"special_token_ids must lie in [0, {vocab_size}), got {special[:8]}")

    features = frozenset().union(*(c.features(vocab_size) for c in configs))
    B = len(configs)

    def f32(values: Iterable[float]) -> mx.array:
        return mx.array(np.asarray(list(values), dtype=np.float32))

    def i32(values: Iterable[int]) -> mx.array:
        return mx.array(np.asarray(list(values), dtype=np.int32))

    def clip32(n: int) -> int:
        return min(n, 2**31 - 1)

    if "bias" in features:
        bias = np.zeros((B, vocab_size), dtype=np.float32)
        for row, c in enumerate(configs):
            for tok, val in (c.logit_bias or {}).items():
                bias[row, tok] = val  # float64 -> float32, as mx.array(list(values)) in mlx-lm
    else:
        bias = np.zeros((B, 0), dtype=np.float32)
    if "xtc" in features:
        xtc_special = np.zeros((B, vocab_size), dtype=np.bool_)
        xtc_special[:, special] = True
    else:
        xtc_special = np.zeros((B, 0), dtype=np.bool_)

    return SamplingParams(
        temperature=f32(c.temperature for c in configs),
        # mlx-lm: logits * (1.0 / temp) with a Python float -> fl32(1/t computed in float64)
        inv_temperature=f32(1.0 / c.temperature if c.temperature > 0 else 1.0 for c in configs),
        top_p=f32(c.top_p for c in configs),
        top_k=i32(clip32(c.top_k) for c in configs),
        min_p=f32(c.min_p for c in configs),
        # mlx-lm: max + math.log(min_p) -> fl32(log computed in float64)
        log_min_p=f32(math.log(c.min_p) if c.min_p > 0 else -math.inf for c in configs),
        xtc_probability=f32(c.xtc_probability for c in configs),
        xtc_threshold=f32(c.xtc_threshold for c in configs),
        repetition_penalty=f32(
            1.0 if c.repetition_penalty is None else c.repetition_penalty for c in configs
        ),
        repetition_context_size=i32(clip32(c.repetition_context_size) for c in configs),
        presence_penalty=f32(c.presence_penalty for c in configs),
        presence_context_size=i32(clip32(c.presence_context_size) for c in configs),
        frequency_penalty=f32(c.frequency_penalty for c in configs),
        frequency_context_size=i32(clip32(c.frequency_context_size) for c in configs),
        logit_bias=mx.array(bias),
        xtc_special=mx.array(xtc_special),
        features=features,
        vocab_size=vocab_size,
    )


def init_keys(configs: Sequence[SamplingConfig]) -> UInt32[mx.array, "B 2"]:
    """Initial per-row PRNG keys: ``mx.random.key(seed)``. The pure core draws no entropy: a
    row whose seed is None gets seed 0 here (the shell's request parsing gives every
    unseeded request a fresh OS seed before it reaches the core)."""
    keys = [mx.random.key(c.seed if c.seed is not None else 0) for c in configs]
    return mx.stack(keys).astype(mx.uint32)


def num_top_logprobs(configs: Sequence[SamplingConfig]) -> int:
    """The static ``n`` to pass to ``top_logprobs`` for this batch (max over rows)."""
    return max((c.logprobs for c in configs), default=0)


# --------------------------------------------------------------------------------------
# Penalty history
# --------------------------------------------------------------------------------------


def history_width(configs: Sequence[SamplingConfig], minimum: int = 16) -> int:
    """A static bucket W (power of two, >= minimum) covering every row's penalty windows."""
    need = max([minimum, 1] + [c.max_context_size() for c in configs])
    return pow2_ceil(need)


def init_history(
    prompt_ids_per_row: Sequence[Sequence[int]], width: int, vocab_size: int | None = None
) -> Int32[mx.array, "B W"]:
    """Host side: the last ``width`` tokens of each row's prompt, right-aligned, -1 = empty.

    Feed it everything the penalties must see so far (mlx-lm: the whole prompt plus the
    tokens generated so far), then ``push_history`` every sampled token. Ids are checked
    against ``vocab_size`` when given (an id >= V would index outside the logits).
    """
    width = _integer("width", width)
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    limit = 2**31 if vocab_size is None else _integer("vocab_size", vocab_size)
    rows = list(prompt_ids_per_row)
    out = np.full((len(rows), width), -1, dtype=np.int32)
    for r, ids in enumerate(rows):
        tail = np.asarray(list(ids), dtype=np.int64)[-width:] if len(ids) else np.zeros(0, np.int64)
        if tail.size and (tail.min() < 0 or tail.max() >= limit):
            raise ValueError(f"prompt_ids_per_row[{r}] holds a token id outside [0, {limit})")
        if tail.size:
            out[r, width - tail.size :] = tail
    return mx.array(out)


def push_history(history: History, tokens: Tokens) -> History:
    """Shift every row left by one and append ``tokens`` (pure; shapes unchanged)."""
    return mx.concatenate([history[:, 1:], tokens.astype(mx.int32)[:, None]], axis=1)


# --------------------------------------------------------------------------------------
# Logits processors
# --------------------------------------------------------------------------------------


def _check_batch(name: str, x: mx.array, params: SamplingParams) -> None:
    if x.shape[0] != params.batch_size:
        raise ValueError(f"{name} has batch {x.shape[0]} but params has {params.batch_size} rows")


def _window(history: mx.array, context: mx.array) -> tuple[mx.array, mx.array]:
    """(valid [B,W], safe indices [B,W]) for each row's last `context` history entries.

    Invalid slots point at the row's newest token (valid in every window with context >= 1)
    or at token 0 when the row's history is empty, so gather/modify/scatter writes are
    either identical to a valid write or a write-back of the original value.
    """
    W = history.shape[1]
    pos = mx.arange(W, dtype=mx.int32)[None, :]
    valid = (history >= 0) & (pos >= (W - context)[:, None])
    newest = history[:, W - 1 :]
    fallback = mx.where(newest >= 0, newest, mx.zeros_like(newest))
    return valid, mx.where(valid, history, fallback)


def _penalise_once(logits, history, context, fn):
    """Apply `fn` once to every distinct token in each row's window (mlx-lm's
    ``logits[:, tokens] = fn(logits[:, tokens])``)."""
    valid, idx = _window(history, context)
    selected = mx.take_along_axis(logits, idx, axis=1)
    any_valid = (history[:, -1:] >= 0)
    updated = mx.where(any_valid, fn(selected), selected)
    return mx.put_along_axis(logits, idx, updated, axis=1)


def process_logits(logits: Logits, history: History, params: SamplingParams) -> Logits:
    """logit_bias, then repetition, presence and frequency penalties (mlx-lm's order).

    Each penalty sees its own window: the last ``*_context_size`` entries of ``history``
    (capped at W). Rows with a processor switched off get exact identities (bias 0,
    repetition 1, presence/frequency 0). Compiles to nothing unless "bias" or "penalties"
    is in ``params.features``.
    """
    _check_batch("logits", logits, params)
    _check_batch("history", history, params)
    if logits.shape[1] != params.vocab_size:
        raise ValueError(f"logits has vocab {logits.shape[1]} but params has {params.vocab_size}")
    if "bias" in params.features:
        logits = logits + params.logit_bias
    if "penalties" in params.features:
        rep = params.repetition_penalty[:, None]
        logits = _penalise_once(
            logits,
            history,
            params.repetition_context_size,
            lambda x: mx.where(x < 0, x * rep, x / rep),
        )
        pres = params.presence_penalty[:, None]
        logits = _penalise_once(
            logits, history, params.presence_context_size, lambda x: x - pres
        )
        # Frequency: once per occurrence, accumulated in history order like mlx-lm's
        # `logits.at[:, tokens].subtract(penalty)`; invalid slots subtract exactly 0.
        valid, idx = _window(history, params.frequency_context_size)
        amount = mx.where(valid, params.frequency_penalty[:, None], 0.0)
        rows = mx.arange(logits.shape[0], dtype=mx.int32)[:, None]
        logits = logits.at[rows, idx].subtract(amount)
    return logits


# --------------------------------------------------------------------------------------
# Allowed-token masks (constrained decoding)
# --------------------------------------------------------------------------------------


def mask_words(vocab_size: int) -> int:
    """32-bit words in one row of an allowed-token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def apply_token_mask(
    logits: Float[mx.array, "*B V"], mask: Int[mx.array, "*B W"]
) -> Float[mx.array, "*B V"]:
    """-inf for every token whose bit is 0: token v is bit v % 32 of word v // 32 (the
    layout llguidance and XGrammar fill; int32 or uint32 words, W >= ceil(V / 32)).

    Applied before everything else `sample_step` does, so the bias, penalties, filters,
    the greedy argmax, the draw and the reported logprobs all see only allowed tokens (the
    logprobs are those of the constrained distribution). The mask is an array input: rows
    and steps with different masks share one compiled graph; a row that is not constrained
    sends all ones. Its cost is one elementwise pass over [B, V]."""
    v, w = logits.shape[-1], mask.shape[-1]
    if w * 32 < v or mask.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not cover logits of shape "
                         f"{tuple(logits.shape)} (need [..., >= {mask_words(v)}] words)")
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (mask.astype(mx.uint32)[..., None] >> shifts) & 1  # [*B, W, 32]
    allowed = bits.reshape(*mask.shape[:-1], w * 32)[..., :v] != 0
    return mx.where(allowed, logits, mx.array(-math.inf, logits.dtype))


# --------------------------------------------------------------------------------------
# Filters (mlx-lm's sampler chain: top_p, min_p, xtc, top_k, then categorical)
# --------------------------------------------------------------------------------------


def _top_p(x: mx.array, sorted_x: mx.array, top_p: mx.array) -> mx.array:
    # Same ops as mlx_lm.sample_utils.apply_top_p, with top_p per row ([B, 1]).
    sorted_probs = mx.exp(sorted_x)
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_x, num_dropped.astype(mx.int32), axis=-1)
    return mx.where(x < threshold, -mx.inf, x)


def _min_p(x: mx.array, log_min_p: mx.array) -> mx.array:
    # mlx_lm apply_min_p with min_tokens_to_keep=1.
    scaled = mx.max(x, axis=-1, keepdims=True) + log_min_p
    return mx.where(x < scaled, -mx.inf, x)


def _xtc(x: mx.array, threshold: mx.array, special: mx.array, removes: mx.array) -> mx.array:
    # mlx_lm apply_xtc; `removes` is the per-row outcome of `uniform() <= probability`.
    probs = mx.softmax(x, -1)
    floor = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = (probs > floor) & ~special
    return mx.where(removes, mx.where(mask, -mx.inf, x), x)


def _top_k(x: mx.array, sorted_x: mx.array, k: mx.array) -> mx.array:
    # Keep x >= the k-th largest value: all ties at the threshold survive (mlx-lm's
    # argpartition keeps exactly k, breaking ties arbitrarily).
    V = x.shape[-1]
    kth = mx.clip(V - k, 0, V - 1).astype(mx.int32)
    threshold = mx.take_along_axis(sorted_x, kth, axis=-1)
    return mx.where(x < threshold, -mx.inf, x)


def _split_rows(keys: mx.array) -> tuple[mx.array, mx.array]:
    """Per-row ``k, sub = mx.random.split(key)`` (the global-state discipline)."""
    both = mx.vmap(lambda k: mx.random.split(k))(keys)  # [B, 2, 2]
    return both[:, 0], both[:, 1]


def _uniform_rows(subkeys: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.vmap(lambda k: mx.random.uniform(0, 1, shape, key=k))(subkeys)


def _categorical_rows(x: mx.array, subkeys: mx.array) -> mx.array:
    """Row b equals ``mx.random.categorical(x[b:b+1], key=subkeys[b])``, bit for bit.

    MLX (this build) samples a categorical with a batch dimension by inverse CDF: one
    uniform u per row, S = exp(x - max) (or the one-hot of the max when the max is
    infinite), pick the first index whose inclusive cumsum exceeds u * sum(S). A [V]-shaped
    call uses Gumbel-max instead, so vmapping categorical over rows would NOT match mlx-lm,
    which samples [1, V]; and searchsorted cannot be vmapped over the sorted sequence.
    The draw is rebuilt here with per-row keys (checked against MLX in the tests).
    """
    u = _uniform_rows(subkeys, (1,))  # [B, 1]
    m = mx.max(x, axis=-1, keepdims=True)
    special = (m == mx.inf) | (m == -mx.inf)
    s = mx.where(special, (x == m).astype(mx.float32), mx.exp(x - m))
    cs = mx.cumsum(s, axis=-1)
    total = mx.sum(s, axis=-1, keepdims=True)
    target = u * total
    idx = (cs <= target).sum(axis=-1)
    # Guard the rounding corner u * total >= cs[-1]: stay on a token with S > 0.
    last = (cs < cs[:, -1:]).sum(axis=-1)
    return mx.minimum(idx, last).astype(mx.int32)


def apply_filters(
    logprobs: Logits, params: SamplingParams, keys: Keys
) -> tuple[Logits, Keys]:
    """mlx-lm's sampler chain before the draw: top_p, min_p, xtc, top_k, per row.

    Each filter is applied only where the row enables it (and only compiled in when some
    row does). XTC consumes one split of the row's key for its uniform draw; the keys after
    that are returned. Greedy rows pass through unchanged.
    """
    _check_batch("logprobs", logprobs, params)
    _check_batch("keys", keys, params)
    features = params.features
    x = logprobs
    if "random" not in features:
        return x, keys
    col = lambda a: a[:, None]  # noqa: E731
    random_row = params.temperature > 0
    sorted_x = None
    if "top_p" in features or "top_k" in features:
        # One ascending sort serves top_p and top_k: top_p and min_p keep an upper set of
        # the values, so the k-th largest survivor is the k-th largest input value (or the
        # survivors are fewer than k and all stay either way).
        sorted_x = mx.sort(x, axis=-1)
    if "top_p" in features:
        on = col(random_row & (params.top_p < 1.0))
        x = mx.where(on, _top_p(x, sorted_x, col(params.top_p)), x)
    if "min_p" in features:
        on = col(random_row & (params.min_p > 0.0))
        x = mx.where(on, _min_p(x, col(params.log_min_p)), x)
    if "xtc" in features:
        xtc_row = random_row & (params.xtc_probability > 0.0)
        after, sub = _split_rows(keys)
        u = _uniform_rows(sub, ())  # [B]
        removes = col(xtc_row & ~(u > params.xtc_probability))
        x = _xtc(x, col(params.xtc_threshold), params.xtc_special, removes)
        keys = mx.where(col(xtc_row), after, keys)
        if "top_k" in features:
            # XTC removes top tokens, so the survivors are no longer an upper set.
            sorted_x = mx.sort(x, axis=-1)
    if "top_k" in features:
        V = params.vocab_size
        on = col(random_row & (params.top_k > 0) & (params.top_k < V))
        x = mx.where(on, _top_k(x, sorted_x, col(params.top_k)), x)
    return x, keys


def _fast_logsumexp(x: Logits) -> Float32[mx.array, "B 1"]:
    m = mx.max(x, axis=-1)
    m = mx.where(mx.isinf(m), 0.0, m)  # all -inf (or +inf) rows: as mx.logsumexp
    # Computed on [B] and only then given its [B, 1] shape: with keepdims, mx.compile fuses
    # the log into the caller's `x - lse` and evaluates it once per logit (49k logs per
    # row) instead of once per row. Same values, bit for bit; 7.5 vs 11.9 ms at 32 rows.
    return (m + mx.log(mx.sum(fast_exp(x - m[:, None]), axis=-1)))[:, None]


def sample(
    logits: Logits, params: SamplingParams, keys: Keys
) -> tuple[Tokens, Logits, Keys]:
    """Sample one token per row.

    Returns ``(tokens int32[B], logprobs [B,V], new_keys uint32[B,2])`` where
    ``logprobs = logits - logsumexp(logits)`` (before any filter, as mlx-lm yields).

    Two normalizations: the *reported* logprobs (and the greedy argmax) use a logsumexp
    built on `fast_exp` (MLX's CPU exp costs ~25 ns per element: over a 49k vocabulary
    that was 1.2 ms per row per step, a third of a 32-row decode step); they agree with
    mlx-lm's to ~1e-7. Only when some row samples does the graph also compute mlx-lm's own
    ``logits - mx.logsumexp(logits)``, bit for bit, as the input of the filters and the
    categorical draw, so seeded draws stay identical to mlx-lm's.
    Greedy rows (temperature 0) take the argmax and leave their key untouched. Sampling
    rows go through ``apply_filters`` (which consumes one split of the key for XTC's
    uniform draw when the row uses XTC), then scale by 1/temperature and consume one split
    for the categorical draw, exactly like mlx-lm's global ``mx.random.state``.
    """
    _check_batch("logits", logits, params)
    _check_batch("keys", keys, params)
    if logits.shape[1] != params.vocab_size:
        raise ValueError(f"logits has vocab {logits.shape[1]} but params has {params.vocab_size}")
    logprobs = logits - _fast_logsumexp(logits)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if "random" not in params.features:
        return greedy, logprobs, keys
    x, keys = sampling_logits(logits, params, keys)
    random_row = params.temperature > 0
    after, sub = _split_rows(keys)
    drawn = _categorical_rows(x, sub)
    tokens = mx.where(random_row, drawn, greedy)
    new_keys = mx.where(random_row[:, None], after, keys)
    return tokens, logprobs, new_keys


def sampling_logits(
    logits: Float[mx.array, "B V"], params: SamplingParams, keys: UInt32[mx.array, "B 2"]
) -> tuple[Float[mx.array, "B V"], UInt32[mx.array, "B 2"]]:
    """The logits each row draws from: mlx-lm's sampler chain (the exact log-softmax, the
    filters, then 1/temperature). Returns them and the keys after the filters' draws (XTC).
    The one definition of the target distribution: `sample` draws from it, speculative
    verification and the drafters compare against its softmax (`sampling_distribution`)."""
    exact = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # mlx-lm's sampler input
    x, keys = apply_filters(exact, params, keys)
    return x * params.inv_temperature[:, None], keys


def sampling_distribution(
    logits: Float[mx.array, "B V"], params: SamplingParams, keys: UInt32[mx.array, "B 2"]
) -> Float[mx.array, "B V"]:
    """The probabilities `sample` draws each row's token with (softmax of sampling_logits)."""
    return mx.softmax(sampling_logits(logits, params, keys)[0], axis=-1, precise=True)


def top_logprobs(
    logprobs: Float[mx.array, "B V"], n: int
) -> tuple[Int32[mx.array, "B N"], Float[mx.array, "B N"]]:
    """The ``n`` (static) most likely tokens per row, most likely first."""
    n = _integer("n", n)
    B, V = logprobs.shape
    if not 0 <= n <= V:
        raise ValueError(f"n must be in [0, {V}], got {n}")
    if n == 0:
        return mx.zeros((B, 0), dtype=mx.int32), mx.zeros((B, 0), dtype=logprobs.dtype)
    if n < V:
        ids = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:, :n]
    else:
        ids = mx.broadcast_to(mx.arange(V)[None, :], (B, V))
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    values = mx.take_along_axis(values, order, axis=-1)
    return ids, values
