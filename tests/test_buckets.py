"""fx_engine.buckets: the one power-of-two rounding rule behind every static shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fx_engine.buckets import pow2_ceil, pow2_floor


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
