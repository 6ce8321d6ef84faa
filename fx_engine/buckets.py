"""Power-of-two shape buckets (pure): the one rounding rule behind the static shapes that
keep steady state from recompiling (prefill chunks, cache capacities, decode batch rows,
penalty windows, attention spans)."""

from __future__ import annotations


def pow2_ceil(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least `minimum` (n <= 1 gives 1)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"pow2_floor needs n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)
