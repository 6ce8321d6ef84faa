"""Qwen3-VL end to end (issue 46): the vision tower with its learned position grid and
DeepStack mergers (against mlx-vlm 0.7.10's qwen3_vl VisionModel), the prompt expansion
(against transformers' Qwen3VLProcessor), the 3-D positions (mlx-vlm's get_rope_index), the
Qwen3 text forward with the image rows spliced in, interleaved M-RoPE and the DeepStack
features added after the first layers (against mlx-vlm's whole qwen3_vl `Model` with the
same random weights, whole and in chunks), greedy generation, a text-only prompt equal to
plain Qwen3, an Engine batch with a text row and the prefix cache.

Tolerance: float32 on both sides from identical weights; the differences are summation
order, our fused q|k|v, swiglu's and the tower's tanh-GELU's `fast_exp`, and the rope
angles of ids shifted by the prompt's delta: TOL = 2e-4 on logits of magnitude ~1.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.steps import logits_step
from fx_engine.core.vision import qwen2_vl, qwen3_vl, vision_module
from fx_engine.engine.image_prompt import (image_placeholder, image_prompt, image_prompt_from_text, prefix_key,
                                           step_images)
from fx_engine.loading.images_qwen2_vl import preprocess
from fx_engine.testing.tiny import write_tiny_model
from fx_engine.testing.vision import QWEN2_VL_IDS, QWEN3_VL_MROPE, write_tiny_qwen3_vl
from tests.models.vision_checks import (close, load_mlx_vlm, messages, png, qwen_decode_matches, qwen_greedy,
                                        qwen_pixels, two_images, whole_images)

TOL = 2e-4
IMAGE_ID = QWEN2_VL_IDS["image_token_id"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3-vl") / "m")


@pytest.fixture(scope="module")
def model(folder):
    return fx_engine.load(str(folder))


@pytest.fixture(scope="module")
def ref(folder):
    return load_mlx_vlm(folder)


# ---------------------------------------------------------------- config, tower, prompt


def test_registered_config_and_prompt_layout(model):
    assert vision_module({"model_type": "qwen3_vl"}) is qwen3_vl
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.mrope_interleaved
    assert cfg.mrope_section == tuple(QWEN3_VL_MROPE)
    assert model.vision.config.deepstack_visual_indexes == (0, 2)
    assert image_placeholder(model) == "<|vision_start|><|image_pad|><|vision_end|>"
    ip = image_prompt(model, messages(png(1)))
    # 40 x 30 -> 40 x 32 pixels: 8 x 10 patches, 4 x 5 merged tokens
    assert ip.image_tokens == (20,) and ip.rows.shape == (20, 64) and ip.deepstack.shape == (2, 20, 64)
    a, b = ip.spans[0]
    assert ip.ids[a - 1] == QWEN2_VL_IDS["vision_start_token_id"] and ip.ids[b] == QWEN2_VL_IDS["vision_end_token_id"]
    assert ip.rope_delta == 5 - 20 and ip.rope_until == b


def test_interleaved_frequency_rows():
    """transformers' recomposition_frequencies on [24, 20, 20]: t h w t h w ... then t t t t."""
    from fx_engine.core.models.mrope import frequency_rows

    rows = frequency_rows([24, 20, 20], interleaved=True)
    assert rows.tolist() == [0, 1, 2] * 20 + [0] * 4
    assert frequency_rows([16, 24, 24]).tolist() == [0] * 16 + [1] * 24 + [2] * 24


@pytest.mark.oracle
def test_tower_matches_mlx_vlm(model, ref):
    """Rows and DeepStack features of two images of different sizes (each resampling the
    learned position grid), together and compiled, against mlx-vlm's VisionModel."""
    msgs = two_images()
    pixels, grid = qwen_pixels(model, msgs)
    want_rows, want_deep = ref.vision_tower(pixels, grid)
    rows, deep = qwen3_vl.encode_images(model.vision, pixels, np.asarray(grid))
    close(rows, want_rows, 1e-4)
    assert deep.shape[0] == len(want_deep) == 2
    for d, w in zip(deep, want_deep):
        close(d, w, 1e-4)
    # compiled: the patches padded to a size bucket (one trace per bucket), the output alike
    cfg = model.vision.config
    assert qwen3_vl.padded_tokens(qwen3_vl._grids(grid, cfg), cfg.merge_unit) > pixels.shape[0]
    rc, dc = qwen3_vl.encode_images_compiled(model.vision, pixels, np.asarray(grid))
    close(rc, want_rows, 1e-4)
    for d, w in zip(dc, want_deep):
        close(d, w, 1e-4)
    n0 = int(np.prod(np.asarray(grid)[0]))
    first, _ = qwen3_vl.encode_images_compiled(model.vision, pixels[:n0], np.asarray(grid)[:1])
    close(first, want_rows[:n0 // cfg.merge_unit], 1e-4)


@pytest.mark.oracle
def test_prompt_ids_match_transformers_processor(folder, model):
    """Our expansion against transformers' Qwen3VLProcessor over the same rendered text."""
    import PIL.Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class Processor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # (its video processor's class needs torch)
            return arg

    d = json.loads((folder / "preprocessor_config.json").read_text())
    d.pop("image_processor_type")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    proc = Processor(image_processor=Qwen2VLImageProcessorPil(**d), tokenizer=tok, video_processor=None)
    imgs = [PIL.Image.open(io.BytesIO(png(2))), PIL.Image.open(io.BytesIO(png(3, (30, 70))))]
    mark = image_placeholder(model)
    text = f"<|im_start|>user\n{mark}what is this? and {mark} that<|im_end|>\n<|im_start|>assistant\n"
    out = proc(text=[text], images=imgs)
    ip = image_prompt_from_text(model, text, imgs)
    assert ip.ids == list(np.asarray(out["input_ids"])[0])
    assert np.asarray(out["image_grid_thw"]).tolist() == preprocess(imgs, model.image_processor)[1].tolist()
    assert np.allclose(np.asarray(out["pixel_values"]), preprocess(imgs, model.image_processor)[0], atol=1e-6)


@pytest.mark.oracle
def test_rope_positions_match_mlx_vlm(model, ref):
    msgs = two_images()
    ip = image_prompt(model, msgs)
    _, grid = qwen_pixels(model, msgs)
    want, delta = ref.language_model.get_rope_index(mx.array([ip.ids]), grid)
    pos, ours = qwen3_vl.rope_positions(ip.ids, np.asarray(grid), model.vision.config)
    assert pos.tolist() == np.asarray(want)[:, 0].tolist()
    assert ours == ip.rope_delta == int(delta.reshape(-1)[0].item())


# ---------------------------------------------------------------- logits against mlx-vlm


@pytest.mark.oracle
def test_logits_match_mlx_vlm(model, ref):
    """The whole prompt (two images) through our Qwen3 forward (image rows spliced in,
    interleaved M-RoPE, DeepStack), against mlx-vlm's Model(input_ids, pixel_values,
    image_grid_thw); then in chunks: text before the images, an image, the rest. Without
    the DeepStack rows, or with chunked M-RoPE, the logits differ (the checks have teeth)."""
    msgs = two_images()
    ip = image_prompt(model, msgs)
    pixels, grid = qwen_pixels(model, msgs)
    ids = mx.array([ip.ids], mx.int32)
    want = ref(ids, pixels, image_grid_thw=grid).logits[0]
    n = len(ip.ids)
    whole = whole_images(ip, model)
    assert whole.deepstack is not None
    got, _ = logits_step(model.params, model.new_cache(1, 256), ids, n, images=whole)
    close(got[0], want, TOL)
    bare = attrs.evolve(whole, deepstack=mx.zeros_like(whole.deepstack))  # (None: refused)
    no_deep, _ = logits_step(model.params, model.new_cache(1, 256), ids, n, images=bare)
    assert mx.abs(no_deep[0] - want).max().item() > 100 * TOL
    chunked = attrs.evolve(model.params, config=attrs.evolve(model.config, mrope_interleaved=False))
    other, _ = logits_step(chunked, model.new_cache(1, 256), ids, n, images=whole)
    assert mx.abs(other[0] - want).max().item() > 100 * TOL
    cache, out, pos = model.new_cache(1, 256), [], 0
    holder = type("R", (), {"image": ip})()
    for end in (ip.spans[0][0] - 2, ip.spans[0][1] + 3, ip.spans[1][1], n):
        piece = ip.ids[pos:end]
        img = step_images([(holder, pos, len(piece))], IMAGE_ID)
        lg, cache = logits_step(model.params, cache, mx.array([piece], mx.int32), len(piece),
                                **({} if img is None else {"images": img}))
        out.append(lg[0])
        pos = end
    close(mx.concatenate(out, axis=0), want, TOL)


@pytest.mark.oracle
def test_decode_logits_match_mlx_vlm(model, ref):
    """Decode steps after an image prompt (plain RoPE at the cache position, no DeepStack)
    against mlx-vlm's whole forward over the prompt and the tokens so far."""
    qwen_decode_matches(ref, model, two_images(), 3, TOL)


@pytest.mark.oracle
def test_text_only_prompt_is_plain_qwen3(folder, model, ref, tmp_path):
    """A text-only prompt is the Qwen3 step unchanged: equal to mlx-vlm's text path, and bit
    for bit to a plain Qwen3 folder holding the same text weights."""
    ids = mx.array([model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")], mx.int32)
    n = ids.shape[1]
    a, _ = logits_step(model.params, model.new_cache(1, 64), ids, n)
    close(a[0], ref(ids).logits[0], TOL)
    plain = write_tiny_model(tmp_path / "qwen3", "qwen3", tie_word_embeddings=False)
    tensors = mx.load(str(folder / "model.safetensors"))
    pre = "model.language_model."
    mx.save_safetensors(str(plain / "model.safetensors"),
                        {("model." + k[len(pre):] if k.startswith(pre) else k): v
                         for k, v in tensors.items() if not k.startswith("model.visual.")})
    q3 = fx_engine.load(str(plain))
    b, _ = logits_step(q3.params, q3.new_cache(1, 64), ids, n)
    assert mx.array_equal(a, b)


# ---------------------------------------------------------------- generation and the engine


@pytest.mark.oracle
def test_generate_with_images_equals_mlx_vlm_greedy(folder, model, ref):
    msgs = two_images()
    done = fx_engine.generate(model, msgs, max_tokens=6)
    prompt, want = qwen_greedy(ref, model, msgs, 6)
    assert len(want) == 6
    assert list(done.prompt_token_ids) == prompt
    assert list(done.token_ids) == want
    from fx_engine.engine.generate import reference_generate

    again = reference_generate(model, msgs, max_tokens=6, prefill_chunk=32)  # chunks before and between images
    assert list(again.token_ids) == list(done.token_ids)


def test_engine_batches_image_rows_with_text_rows(model):
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    prompts = [messages(png(7)), [{"role": "user", "content": "a plain text request"}], two_images()]
    solo = [reference_generate(model, p, max_tokens=5, prefill_chunk=32, logprobs=2) for p in prompts]
    for budget in (48, 256):
        with Engine(model, max_rows=3, prefill_chunk=32, step_token_budget=budget, prefix_cache_bytes=0) as engine:
            done = [h.result() for h in [engine.submit(p, max_tokens=5, logprobs=2) for p in prompts]]
        for d, s in zip(done, solo):
            assert d.prompt_token_ids == s.prompt_token_ids
            assert d.token_ids == s.token_ids
            for x, y in zip(d.logprobs, s.logprobs, strict=True):
                assert [t[0] for t in x.top] == [t[0] for t in y.top]
                assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4


def test_engine_prefix_cache_follow_up_turn(model):
    """A follow-up turn (same image, the same delta) reuses the first turn's prompt; a turn
    adding an image reuses nothing; both equal the reference loop."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    first = messages(png(10), text="describe this picture in some detail please")
    with Engine(model, max_rows=2, prefill_chunk=32) as engine:
        a = engine.submit(first, max_tokens=4).result()
        turn = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "and more?"}]
        b = engine.submit(turn, max_tokens=4, logprobs=2).result()
        more = turn + [{"role": "assistant", "content": b.text},
                       {"role": "user", "content": [{"type": "image", "image": png(11)},
                                                    {"type": "text", "text": "and this?"}]}]
        c = engine.submit(more, max_tokens=4, logprobs=2).result()
    assert b.usage.cached_tokens > 20
    assert c.usage.cached_tokens == 0
    for got, msgs in ((b, turn), (c, more)):
        want = reference_generate(model, msgs, max_tokens=4, logprobs=2)
        assert got.token_ids == want.token_ids
        for x, y in zip(got.logprobs, want.logprobs, strict=True):
            assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4
    ka = prefix_key(image_prompt(model, first), image_prompt(model, first).ids)
    assert ka[0] != image_prompt(model, first).ids[0]


def test_encoder_cache_keeps_the_deepstack_rows(model):
    """An image met again comes from the encoder cache with its DeepStack rows."""
    from fx_engine.engine.image_prompt import EncoderCache

    cache = EncoderCache()
    a = image_prompt(model, messages(png(1), png(2, (24, 40))), cache=cache)
    b = image_prompt(model, messages(png(2, (24, 40))), cache=cache)
    assert cache.hits == 1
    n = a.image_tokens[0]
    assert mx.array_equal(b.rows, a.rows[n:]) and mx.array_equal(b.deepstack, a.deepstack[:, n:])


def test_config_refusals(folder):
    from fx_engine.core.config import ConfigError

    d = json.loads((folder / "config.json").read_text())
    for bad, field in (({"hidden_act": "silu"}, "hidden_act"), ({"num_position_embeddings": 15}, "num_position"),
                       ({"deepstack_visual_indexes": [0, 9]}, "deepstack_visual_indexes"),
                       ({"out_hidden_size": 32}, "out_hidden_size")):
        with pytest.raises(ConfigError, match=field):
            qwen3_vl.config_from_hf({**d, "vision_config": {**d["vision_config"], **bad}})
    assert qwen2_vl.config_from_hf  # (the prompt side is shared)


@pytest.mark.oracle
def test_mlx_layout_loads_the_same_model(tmp_path, model, folder):
    """mlx-vlm's converted names (language_model.model.*, vision_tower.*, the patch conv
    channels last) load the same model as transformers' names; mlx-vlm reads it too."""
    other = write_tiny_qwen3_vl(tmp_path / "mlx", layout="mlx")
    m = fx_engine.load(str(other))
    assert m.config == model.config and m.vision.config == model.vision.config
    ip = image_prompt(model, messages(png(6)))
    ids = mx.array([ip.ids], mx.int32)
    a, _ = logits_step(model.params, model.new_cache(1, 64), ids, len(ip.ids), images=whole_images(ip, model))
    ip2 = image_prompt(m, messages(png(6)))
    b, _ = logits_step(m.params, m.new_cache(1, 64), ids, len(ip.ids), images=whole_images(ip2, m))
    assert ip2.ids == ip.ids and mx.array_equal(a, b)
    pixels, grid = qwen_pixels(m, messages(png(6)))
    close(b[0], load_mlx_vlm(other)(ids, pixels, image_grid_thw=grid).logits[0], TOL)


def test_engine_refuses_an_image_prompt_without_its_deepstack_rows(model):
    from fx_engine.engine.engine import Engine

    ip = image_prompt(model, messages(png(1)))
    with Engine(model, max_rows=1) as engine:
        with pytest.raises(ValueError, match="DeepStack"):
            engine.submit(ip._replace(deepstack=None), max_tokens=2)
        with pytest.raises(ValueError, match="rope_offsets"):
            engine.submit(ip._replace(rope_offsets=None), max_tokens=2)
        assert engine.submit(ip, max_tokens=2).result().token_ids


def test_steps_refuse_images_without_deepstack_rows_or_mrope_positions(model):
    """Composed by hand, a Qwen3-VL step's images without their DeepStack rows (or without
    their M-RoPE offsets) would run the wrong model without a word: refused, naming the
    field; the prompt's own (`step_images`) run."""
    ip = image_prompt(model, messages(png(1)))
    n, ids = len(ip.ids), mx.array([ip.ids], mx.int32)
    whole = whole_images(ip, model)
    assert whole.deepstack is not None and whole.positions is not None
    logits_step(model.params, model.new_cache(1, 64), ids, n, images=whole)
    with pytest.raises(ValueError, match=r"images\.deepstack: .*Qwen3-VL"):
        logits_step(model.params, model.new_cache(1, 64), ids, n, images=attrs.evolve(whole, deepstack=None))
    no_pos = attrs.evolve(whole, positions=None, position_start=None)
    with pytest.raises(ValueError, match=r"images\.positions: .*M-RoPE"):
        logits_step(model.params, model.new_cache(1, 64), ids, n, images=no_pos)


def test_routes_serve_a_qwen3_vl_model(model):
    """The chat routes are family-neutral: an OpenAI chat with an image data URL answers as
    the Python API does."""
    import base64

    import httpx

    from fx_engine.server.app import create_app
    from tests.conftest import serve

    url_img = "data:image/png;base64," + base64.b64encode(png(12, (60, 40))).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url_img}}]}]
    want = fx_engine.generate(model, msgs, max_tokens=6, temperature=0)
    engine = fx_engine.Engine(model, max_rows=2)
    with serve(create_app(engine, "tiny-qwen3-vl"), engine) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"messages": msgs, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_an_image_prompt_travels_to_other_ranks_bit_for_bit(model):
    """image_prompt.portable / from_portable: what a lockstep engine's rank 0 sends with a
    request (pickled): rows (bfloat16 too), DeepStack rows and M-RoPE offsets come back
    equal, so the other ranks splice what rank 0 encoded."""
    import pickle

    from fx_engine.engine.image_prompt import from_portable, portable

    ip = image_prompt(model, messages(png(1), png(2, (24, 56))))
    for sent in (ip, ip._replace(rows=ip.rows.astype(mx.bfloat16), deepstack=ip.deepstack.astype(mx.bfloat16))):
        back = from_portable(pickle.loads(pickle.dumps(portable(sent))))
        assert back.ids == sent.ids and back.spans == sent.spans and back.digests == sent.digests
        assert back.rope_delta == sent.rope_delta and back.whole == sent.whole
        assert back.rows.dtype == sent.rows.dtype and mx.array_equal(back.rows, sent.rows)
        assert back.deepstack.dtype == sent.deepstack.dtype and mx.array_equal(back.deepstack, sent.deepstack)
        assert np.array_equal(np.asarray(back.rope_offsets), np.asarray(sent.rope_offsets))
