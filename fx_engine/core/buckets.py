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


MIN_PIECE = 16  # the smallest padded prefill piece


def prefill_pieces(start: int, end: int, chunk: int) -> list[tuple[int, int, int]]:
    """How a prompt's tokens [start, end) are fed in chunks: (position, tokens, padded size)
    per piece, every piece `chunk` tokens but the last, each padded to the power-of-two
    bucket of its length (at least MIN_PIECE): the shapes prefill steps compile for. The
    one chunking rule of the single-request paths (the reference loop, scoring, drafters);
    the engine's scheduler plans pieces of several requests under a step budget with the
    same buckets."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(p, min(chunk, end - p), pow2_ceil(min(chunk, end - p), MIN_PIECE))
            for p in range(start, end, chunk)]
