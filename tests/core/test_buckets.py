"""fx_engine.core.buckets: the power-of-two rounding rule behind every static shape, and the
finer size buckets of the vision towers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fx_engine.core.buckets import pow2_ceil, pow2_floor


@given(st.integers(min_value=-5, max_value=1 << 40), st.integers(min_value=1, max_value=1 << 12))
def test_pow2_ceil_is_the_smallest_power_of_two_covering_n(n: int, minimum: int) -> None:
    b = pow2_ceil(n)
    assert b & (b - 1) == 0 and b >= max(n, 1)
    assert b == 1 or b // 2 < n  # the smallest such
    assert pow2_ceil(n, minimum) == max(minimum, b)


@given(st.integers(min_value=1, max_value=1 << 40))
def test_pow2_floor_is_the_largest_power_of_two_under_n(n: int) -> None:
    b = pow2_floor(n)
    assert b & (b - 1) == 0 and b <= n < 2 * b


def test_pow2_floor_rejects_what_has_no_floor() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        pow2_floor(0)


@given(st.integers(min_value=0, max_value=3000), st.integers(min_value=0, max_value=3000),
       st.integers(min_value=1, max_value=2048))
def test_prefill_pieces_cover_the_tokens_once_in_bucketed_shapes(start: int, n: int, chunk: int) -> None:
    from fx_engine.core.buckets import MIN_PIECE, prefill_pieces

    pieces = prefill_pieces(start, start + n, chunk)
    pos = start
    for p, length, size in pieces:
        assert p == pos and 1 <= length <= chunk and size == pow2_ceil(length, MIN_PIECE)
        pos += length
    assert pos == start + n  # every token once, in order
    assert all(length == chunk for _, length, _ in pieces[:-1])  # only the last is short


def test_prefill_pieces_rejects_an_empty_chunk() -> None:
    from fx_engine.core.buckets import prefill_pieces

    with pytest.raises(ValueError, match="chunk"):
        prefill_pieces(0, 10, 0)


def test_the_ring_rule_for_reusing_a_cached_row() -> None:
    """A row whose sliding-window ring has wrapped keeps only its latest positions: only
    the whole row can be reused; rows that never wrapped (or have no ring) serve any prefix."""
    from fx_engine.core.cache import LayerSpec, prefix_in_cache

    dense, ring = LayerSpec(3, 64), LayerSpec(3, 64, window=32, ring=64)
    assert prefix_in_cache((dense,), 1000, 10)  # no ring: any prefix
    assert prefix_in_cache((dense, ring), 64, 10)  # never wrapped
    assert prefix_in_cache((dense, ring), 100, 100)  # wrapped, the whole row
    assert not prefix_in_cache((dense, ring), 100, 99)  # wrapped: a prefix is gone


@given(st.integers(1, 1 << 20), st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 16]))
def test_size_bucket_pads_at_most_one_part_in_per_octave_and_is_monotonic(n: int, least: int, per: int) -> None:
    from fx_engine.core.buckets import size_bucket

    b = size_bucket(n, least, per)
    assert b >= max(n, least) and (b - max(n, least)) * (per + 1) < b
    assert size_bucket(b, least, per) == b  # a bucket is its own bucket
    assert size_bucket(n + 1, least, per) >= b


def test_size_buckets_per_octave() -> None:
    from fx_engine.core.buckets import size_bucket

    assert [size_bucket(n, per_octave=4) for n in (1, 7, 8, 9, 11, 16, 17, 21, 33, 1000)] == [
        1, 7, 8, 10, 12, 16, 20, 24, 40, 1024]
    assert {size_bucket(n, per_octave=4) for n in range(65, 129)} == {80, 96, 112, 128}
    assert {size_bucket(n) for n in range(129, 257)} == set(range(144, 257, 16))  # 8 per octave by default
    assert size_bucket(391) == 416
    with pytest.raises(ValueError, match="power of two"):
        size_bucket(5, per_octave=6)
