"""Image-size buckets for the compiled vision towers (issue 46: "its compiled forward
bucketed by image size").

Towers that take images of any size (Qwen2-VL / Qwen2.5-VL / Qwen3-VL's dynamic resolution,
Pixtral's) pad their token count up to a bucket and pass the geometry (orders, rotary rows,
attention segments) as array inputs, so one compiled trace serves every image whose size
falls in the bucket instead of one trace per image size. Buckets are 4 per octave (as the
text steps' capacity buckets would be if they were finer): at most 25% of the padded tokens
are padding, and a server that sees images of every size compiles O(log size) traces.
"""

from __future__ import annotations


def size_bucket(n: int, least: int = 1) -> int:
    """The smallest of 1, 2, ..., 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (2^k * {4, 5,
    6, 7} / 4) that is >= max(n, least)."""
    n = max(int(n), int(least), 1)
    step = max(1, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step
