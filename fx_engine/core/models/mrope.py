"""Multimodal RoPE (M-RoPE), Qwen2-VL's and Qwen2.5-VL's text-side rotary embedding: each
token has three position ids (temporal, height, width; `vision.qwen2_vl.rope_positions`
gives a prompt's), and the head_dim / 2 rotary frequencies are split into three
consecutive sections (config rope_scaling.mrope_section, e.g. [16, 24, 24]), section i
taking its angles from position row i (transformers' Qwen2_5_VLRotaryEmbedding; mlx-vlm's
`MRoPERotaryEmbedding(style="chunked")`). The frequencies are plain RoPE's (rope_theta, no
scaling), applied rotate-half style.

Qwen3-VL interleaves the sections instead (`LlamaConfig.mrope_interleaved`; transformers'
Qwen3VLTextRotaryEmbedding.recomposition_frequencies, mlx-vlm's style="interleaved"):
frequency j reads the height row where j % 3 == 1 and j < 3 * section[1], the width row
where j % 3 == 2 and j < 3 * section[2], the temporal row otherwise.

A token whose three ids are equal (every text token) is rotated exactly as plain RoPE
rotates it at that position (the same angles, the same float32 products), so text-only
steps keep `blocks.scaled_rope` and its graph.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from jaxtyping import Float, Int


def frequency_rows(section: Any, interleaved: bool = False) -> np.ndarray:
    """int32 [head_dim / 2]: the position row (0 t, 1 h, 2 w) each rotary frequency reads."""
    if not interleaved:
        return np.repeat(np.arange(3), section).astype(np.int32)
    half = int(sum(section))
    rows = np.zeros(half, np.int32)
    for dim in (1, 2):
        rows[dim:min(3 * int(section[dim]), half):3] = dim
    return rows


def mrope_tables(p: Any, positions: Int[mx.array, "3 B T"]) -> tuple[
        Float[mx.array, "B T 1 D"], Float[mx.array, "B T 1 D"], Float[mx.array, "D D"]]:
    """`nn.rope_tables`' (cos, signed sin, pair permutation) for 3-D position ids, in the
    params' activation dtype (what `blocks.apply_partial_rope` reads)."""
    cfg = p.config
    d = cfg.head_dim
    half = d // 2
    # the position row (t, h, w) each frequency reads: section sizes from the config
    which = mx.array(frequency_rows(cfg.mrope_section, getattr(cfg, "mrope_interleaved", False)))
    inv = mx.power(mx.array(cfg.rope_theta, mx.float32), -mx.arange(0, d, 2, dtype=mx.float32) / d)
    pos = mx.take(positions, which, axis=0)  # [D/2, B, T]
    theta = pos.transpose(1, 2, 0).astype(mx.float32) * inv  # [B, T, D/2]
    cos, sin = mx.cos(theta), mx.sin(theta)
    cos_f = mx.concatenate([cos, cos], axis=-1)
    sin_f = mx.concatenate([-sin, sin], axis=-1)
    idx = mx.arange(d)
    perm = (idx[:, None] == ((idx + half) % d)[None, :]).astype(mx.float32)  # (x @ P)[j] = x[partner[j]]
    dt = getattr(mx, p.dtype)
    return cos_f[:, :, None, :].astype(dt), sin_f[:, :, None, :].astype(dt), perm.astype(dt)
