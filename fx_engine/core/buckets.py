"""Shape buckets (pure): the rounding rules behind the static shapes that keep steady state
from recompiling: powers of two (prefill chunks, cache capacities, decode batch rows,
penalty windows, attention spans) and, where padding costs compute in proportion,
finer sizes (`size_bucket`: the vision towers' image sizes)."""

from __future__ import annotations

from typing import Sequence


def pow2_ceil(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n, and at least `minimum` (n <= 1 gives 1)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"pow2_floor needs n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def size_bucket(n: int, least: int = 1, per_octave: int = 8) -> int:
    """The smallest size >= max(n, least) of the form 2^k * (per_octave + j) / per_octave,
    j in [0, per_octave) (per_octave a power of two; below per_octave every integer): at
    most 1 / (per_octave + 1) of a padded size is padding, and sizes up to S compile
    per_octave * log2(S) shapes at most. The any-size vision towers (core/vision/qwen2_vl.py,
    qwen3_vl.py, pixtral.py) pad their patches and image tokens to it with 8 per octave:
    one compiled trace per bucket instead of one per image size (issue 46), at <= 11%
    padding (4 per octave measured 14% slower on a Qwen2.5-VL-3B tower: 391 image tokens
    padded to 448)."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"size_bucket: per_octave must be a power of two, got {per_octave}")
    n = max(int(n), int(least), 1)
    step = max(1, (1 << (n.bit_length() - 1)) // per_octave)
    return -(-n // step) * step


MIN_PIECE = 16  # the smallest padded prefill piece


def prefill_pieces(start: int, end: int, chunk: int,
                   keep_whole: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int, int]]:
    """How a prompt's tokens [start, end) are fed in chunks: (position, tokens, padded size)
    per piece, every piece `chunk` tokens but the last, each padded to the power-of-two
    bucket of its length (at least MIN_PIECE): the shapes prefill steps compile for. The
    one chunking rule of the single-request paths (the reference loop, scoring, drafters);
    the engine's scheduler plans pieces of several requests under a step budget with the
    same buckets.

    keep_whole: sorted [a, b) spans no piece may cut (an image's tokens attend to each
    other: `vision.gemma3.image_token_runs`): a piece that would end inside one ends at its
    start instead, or, when the span starts the piece, at its end (a piece longer than
    `chunk`: `max_piece` says the longest). ValueError when `start` lies inside a span."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not keep_whole:
        return [(p, min(chunk, end - p), pow2_ceil(min(chunk, end - p), MIN_PIECE))
                for p in range(start, end, chunk)]
    for a, b in keep_whole:
        if a < start < b:
            raise ValueError(f"prefill from position {start} would start inside the span [{a}, {b}) "
                             "that must be fed whole (an image)")
    out, p = [], start
    while p < end:
        e = min(p + chunk, end)
        for a, b in keep_whole:
            if a < e < b:
                e = a if a > p else min(b, end)
                break
        out.append((p, e - p, pow2_ceil(e - p, MIN_PIECE)))
        p = e
    return out


def max_piece(pieces: Sequence[tuple[int, int, int]]) -> int:
    """The longest padded size of `prefill_pieces`' pieces (the ring headroom they need + 1)."""
    return max((size for _, _, size in pieces), default=MIN_PIECE)


def prefill_plan(lengths: Sequence[int], room: int, chunk: int = 512) -> tuple[int, list[tuple[int, int, int]]]:
    """The static shapes of a multi-row prefill into a fresh cache (`fx_engine.prefill`):
    (capacity, pieces). capacity = the power of two >= the longest prompt + `room` (at
    least MIN_PIECE); pieces: `prefill_pieces(0, longest, chunk)`, shared by every row (a
    row shorter than a piece sends fewer real tokens, padding goes to the cache's sink).
    Prompts whose longest row and longest + room fall in the same buckets get the same
    shapes, so they run the same compiled steps (lengths 40 and 43 with room 64: one
    64-token piece into a 128-position cache). chunk: a power of two >= MIN_PIECE, so
    every piece fits in the capacity."""
    lengths = list(lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"prefill_plan: every prompt needs at least one token, got lengths {lengths[:8]}")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"room must be an int >= 0 (tokens to decode after the prompt), got {room!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < MIN_PIECE or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {MIN_PIECE}, got {chunk!r}")
    longest = max(lengths)
    return pow2_ceil(longest + room, MIN_PIECE), prefill_pieces(0, longest, chunk)
