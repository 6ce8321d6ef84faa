"""Qwen3-VL-MoE end to end (issue 46): Qwen3-VL's tower and prompt side on a Qwen3-MoE text
model (the MoE family's `qwen3_vl_moe` wrapper: interleaved M-RoPE, DeepStack, a router that
renormalizes its top k), from the released checkpoints' fused expert tensors
(mlp.experts.gate_up_proj [E, H, 2F], down_proj [E, F, H]) and from mlx-vlm's switch_mlp
stacks, against mlx-vlm 0.7.10's whole qwen3_vl_moe `Model` with the same random weights.

mlx-vlm's qwen3_vl_moe tower swaps two GELUs against transformers' Qwen3VLMoe (its blocks'
MLP runs the exact GELU and its patch mergers the tanh one; transformers' modeling_qwen3_vl_moe
runs `hidden_act`, gelu_pytorch_tanh, in the MLP and nn.GELU() in the mergers, as Qwen3-VL
does): the oracle gets transformers' activations back before it is compared (`_oracle`).

Tolerance: float32 on both sides from identical weights: TOL = 2e-4 on logits (test_qwen3_vl.py's).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import fx_engine
from fx_engine.core.models.moe import fused_hf_experts
from fx_engine.core.checkpoint import TensorSource
from fx_engine.core.vision import qwen3_vl, vision_module
from fx_engine.engine.image_prompt import image_prompt
from fx_engine.testing.vision import write_tiny_qwen3_vl
from tests.models.vision_checks import close, load_mlx_vlm, qwen_decode_matches, qwen_greedy, qwen_pixels, two_images

TOL = 2e-4


def _oracle(path: Path):
    """mlx-vlm's Model with transformers' tower activations (see the module docstring)."""
    ref = load_mlx_vlm(path)
    tower = ref.vision_tower
    for blk in tower.blocks:
        blk.mlp.act_fn = nn.GELU(approx="tanh")
    for merger in (tower.merger, *tower.deepstack_merger_list):
        merger.act_fn = nn.GELU()
    return ref


@pytest.fixture(scope="module", params=["hf", "mlx"])
def pair(request, tmp_path_factory):
    folder = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl-moe") / "m", moe=True, layout=request.param)
    return fx_engine.load(str(folder)), _oracle(folder)


def test_registered_as_a_qwen3_moe_text_model_with_qwen3_vls_tower(pair):
    model, _ = pair
    assert vision_module({"model_type": "qwen3_vl_moe"}) is qwen3_vl
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.norm_topk_prob, cfg.mrope_interleaved) == ("qwen3_moe", 8, True, True)
    assert model.params.layers[0].experts is not None
    ip = image_prompt(model, two_images())
    assert ip.deepstack.shape[0] == 2 and len(ip.spans) == 2


@pytest.mark.oracle
def test_logits_and_decode_match_mlx_vlm(pair):
    """The whole two-image prompt (image rows, interleaved M-RoPE, DeepStack, routed experts)
    and three decode steps after it, against mlx-vlm's whole forward."""
    model, ref = pair
    msgs = two_images()
    ip = image_prompt(model, msgs)
    pixels, grid = qwen_pixels(model, msgs)
    prompt = qwen_decode_matches(ref, model, msgs, 3, TOL)
    close(prompt, ref(mx.array([ip.ids]), pixels, image_grid_thw=grid).logits[0], TOL)


@pytest.mark.oracle
def test_greedy_generation_matches_mlx_vlm(pair):
    """fx_engine.generate with images (the Engine's image rows and decode) gives mlx-vlm's
    greedy tokens."""
    model, ref = pair
    msgs = two_images()
    done = fx_engine.generate(model, msgs, max_tokens=6)
    prompt, want = qwen_greedy(ref, model, msgs, 6)
    assert list(done.prompt_token_ids) == prompt
    assert list(done.token_ids) == want


def test_fused_experts_either_orientation():
    """Hugging Face's fused expert tensors as x @ W ([E, H, 2F], [E, F, H]: Qwen3-VL-MoE's
    release) and as rows ([E, 2F, H], [E, H, F]: transformers 5's fused experts) give the
    same stacks, including H == 2F, where down_proj's shape decides."""
    e, f = 3, 8
    for h in (24, 16):
        g, u, d = (mx.random.normal(s, key=mx.random.key(k)) for k, s in ((1, (e, f, h)), (2, (e, f, h)), (3, (e, h, f))))
        as_x = TensorSource()
        as_x.add("x", {"experts.gate_up_proj": mx.concatenate([g, u], 1).swapaxes(1, 2),
                       "experts.down_proj": d.swapaxes(1, 2)})
        rows = TensorSource()
        rows.add("r", {"experts.gate_up_proj": mx.concatenate([g, u], 1), "experts.down_proj": d})
        for src in (as_x, rows):
            got = fused_hf_experts(src, "experts.", e, f, h, "test")
            for lin, w in zip(got, (g, u, d)):
                assert np.array_equal(np.asarray(lin.weight), np.asarray(w))
