"""Qwen2.5-VL's and Qwen2-VL's text side (issue 46, second half): the prompt expansion
(against transformers' Qwen2_5_VLProcessor), the 3-D M-RoPE positions (against mlx-vlm
0.7.10's `get_rope_index`), the Qwen2 text forward with the image rows spliced in and
M-RoPE (against mlx-vlm's whole qwen2_5_vl / qwen2_vl `Model` with the same random
weights, whole and in chunks), greedy generation through the decode steps (which rotate at
plain cache positions: the prompt's ids are stored shifted by its rope delta), an Engine
batch with a text row, the prefix cache, and loading both config.json layouts.

Tolerance: float32 on both sides from identical weights; the differences are summation
order, our fused q|k|v and swiglu's `fast_exp`, and the rope angles of ids shifted by the
prompt's delta: TOL = 2e-4 on logits of magnitude ~1.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.steps import logits_step
from fx_engine.core.vision import qwen2_vl, vision_module
from fx_engine.core.vision.splice import ImageInput
from fx_engine.engine.image_prompt import (image_placeholder, image_prompt, image_prompt_from_text, prefix_key,
                                           step_images)
from fx_engine.loading.images_qwen2_vl import preprocess
from fx_engine.testing.vision import QWEN2_VL_IDS, write_tiny_qwen2_vl
from tests.models.vision_checks import (close, load_mlx_vlm, messages, png, qwen_greedy, qwen_pixels,
                                        two_images, whole_images)

TOL = 2e-4
IMAGE_ID = QWEN2_VL_IDS["image_token_id"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(kind: str = "qwen2_5_vl") -> Path:
        if kind not in made:
            mt, layout = {"qwen2_5_vl": ("qwen2_5_vl", "hf"), "qwen2_vl": ("qwen2_vl", "hf"),
                          "nested": ("qwen2_5_vl", "nested")}[kind]
            made[kind] = write_tiny_qwen2_vl(tmp_path_factory.mktemp(f"qwen-{kind}") / "m", mt, layout)
        return made[kind]

    return folder


@pytest.fixture(scope="module")
def model(folders):
    return fx_engine.load(str(folders("qwen2_5_vl")))


# ---------------------------------------------------------------- the prompt and its positions


def test_registered_and_prompt_layout(model):
    assert vision_module({"model_type": "qwen2_5_vl"}) is qwen2_vl
    assert vision_module({"model_type": "qwen2_vl"}) is qwen2_vl
    assert image_placeholder(model) == "<|vision_start|><|image_pad|><|vision_end|>"
    ip = image_prompt(model, messages(png(1)))
    cfg = model.vision.config
    # 40 x 30 -> 40 x 32 pixels: 8 x 10 patches, 4 x 5 merged tokens
    assert ip.spans == [(ip.spans[0][0], ip.spans[0][0] + 20)] and ip.image_tokens == (20,)
    a, b = ip.spans[0]
    assert ip.ids[a - 1] == cfg.vision_start_token_id and ip.ids[b] == cfg.vision_end_token_id
    assert ip.rows.shape == (20, 64)
    assert ip.rope_delta == 5 - 20  # the image advances the positions by max(4, 5), not 20
    assert ip.rope_until == b and not np.asarray(ip.rope_offsets)[:, b:].any()


@pytest.mark.oracle
def test_prompt_ids_match_transformers_processor(folders, model):
    """Our expansion against transformers' Qwen2_5_VLProcessor over the same rendered text."""
    import PIL.Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class Processor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # (its video processor's class needs torch)
            return arg

    path = folders("qwen2_5_vl")
    d = json.loads((path / "preprocessor_config.json").read_text())
    d.pop("image_processor_type")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    proc = Processor(image_processor=Qwen2VLImageProcessorPil(**d), tokenizer=tok)
    imgs = [PIL.Image.open(io.BytesIO(png(2))), PIL.Image.open(io.BytesIO(png(3, (30, 70))))]
    mark = image_placeholder(model)
    text = f"<|im_start|>user\n{mark}what is this? and {mark} that<|im_end|>\n<|im_start|>assistant\n"
    out = proc(text=[text], images=imgs)
    ip = image_prompt_from_text(model, text, imgs)
    assert ip.ids == list(np.asarray(out["input_ids"])[0])
    assert np.asarray(out["image_grid_thw"]).tolist() == preprocess(imgs, model.image_processor)[1].tolist()
    assert ip.image_tokens == tuple(int(t * h * w) // 4 for t, h, w in np.asarray(out["image_grid_thw"]))


@pytest.mark.oracle
def test_rope_positions_match_mlx_vlm(folders, model):
    ref = load_mlx_vlm(folders("qwen2_5_vl"))
    msgs = two_images()
    ip = image_prompt(model, msgs)
    _, grid = qwen_pixels(model, msgs)
    want, delta = ref.language_model.get_rope_index(mx.array([ip.ids]), grid)
    pos, ours = qwen2_vl.rope_positions(ip.ids, np.asarray(grid), model.vision.config)
    assert pos.tolist() == np.asarray(want)[:, 0].tolist()
    assert ours == ip.rope_delta == int(delta.reshape(-1)[0].item())
    # the offsets: ids shifted by -delta, minus the cache positions
    assert (np.asarray(ip.rope_offsets) == pos - ours - np.arange(len(ip.ids))).all()
    text_only, d0 = qwen2_vl.rope_positions([1, 5, 6 - 1, 9], None, model.vision.config)
    assert d0 == 0 and (text_only == np.arange(4)).all()


# ---------------------------------------------------------------- logits against mlx-vlm


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl"])
def test_logits_match_mlx_vlm(folders, kind):
    """The whole prompt (two images) through our Qwen2 forward with the image rows spliced
    in and M-RoPE, against mlx-vlm's Model(input_ids, pixel_values, image_grid_thw); then
    in chunks: text before the images (M-RoPE offsets, no image token), an image, the rest."""
    path = folders(kind)
    m = fx_engine.load(str(path))
    ref = load_mlx_vlm(path)
    msgs = two_images()
    ip = image_prompt(m, msgs)
    pixels, grid = qwen_pixels(m, msgs)
    ids = mx.array([ip.ids], mx.int32)
    want = ref(ids, pixels, image_grid_thw=grid).logits[0]
    n = len(ip.ids)
    got, _ = logits_step(m.params, m.new_cache(1, 256), ids, n, images=whole_images(ip, m))
    close(got[0], want, TOL)
    # (without the offsets the image prompt is not the model's: the check has teeth; a step
    # without them is refused, one with zero offsets is plain RoPE's)
    plain = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=IMAGE_ID,
                       positions=mx.zeros((3, n), mx.int32), position_start=mx.array([0], mx.int32))
    wrong, _ = logits_step(m.params, m.new_cache(1, 256), ids, n, images=plain)
    assert mx.abs(wrong[0] - want).max().item() > 100 * TOL
    cache, out, pos = m.new_cache(1, 256), [], 0
    holder = type("R", (), {"image": ip})()
    for end in (ip.spans[0][0] - 2, ip.spans[0][1] + 3, ip.spans[1][1], n):
        piece = ip.ids[pos:end]
        img = step_images([(holder, pos, len(piece))], IMAGE_ID)
        lg, cache = logits_step(m.params, cache, mx.array([piece], mx.int32), len(piece),
                                **({} if img is None else {"images": img}))
        out.append(lg[0])
        pos = end
    assert step_images([(holder, ip.spans[1][1], n - ip.spans[1][1])], IMAGE_ID) is None  # plain text after
    close(mx.concatenate(out, axis=0), want, TOL)


@pytest.mark.oracle
def test_text_only_prompt_is_plain_rope(folders, model):
    """A text-only prompt is the Qwen2 step unchanged (no image input, plain RoPE), equal to
    mlx-vlm's text path; an M-RoPE step whose three ids are the cache positions gives the
    same bits."""
    ref = load_mlx_vlm(folders("qwen2_5_vl"))
    ids = mx.array([model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")], mx.int32)
    n = ids.shape[1]
    a, _ = logits_step(model.params, model.new_cache(1, 64), ids, n)
    close(a[0], ref(ids).logits[0], TOL)
    zeros = ImageInput(rows=mx.zeros((16, 64)), start=mx.array([0], mx.int32), token_index=IMAGE_ID,
                       positions=mx.zeros((3, 64), mx.int32), position_start=mx.array([0], mx.int32))
    b, _ = logits_step(model.params, model.new_cache(1, 64), ids, n, images=zeros)
    assert mx.array_equal(a, b)


@pytest.mark.oracle
def test_nested_config_layout_loads_the_same_model(folders, model):
    """transformers >= 4.52's folders (text_config, model.language_model.*, model.visual.*)."""
    nested = fx_engine.load(str(folders("nested")))
    assert nested.config == model.config and nested.vision.config == model.vision.config
    ip = image_prompt(model, messages(png(6)))
    ids = mx.array([ip.ids], mx.int32)
    a, _ = logits_step(model.params, model.new_cache(1, 64), ids, len(ip.ids), images=whole_images(ip, model))
    ip2 = image_prompt(nested, messages(png(6)))
    b, _ = logits_step(nested.params, nested.new_cache(1, 64), ids, len(ip.ids), images=whole_images(ip2, nested))
    assert ip2.ids == ip.ids and mx.array_equal(a, b)


# ---------------------------------------------------------------- generation


@pytest.mark.oracle
def test_decode_logits_match_mlx_vlm(folders, model):
    """Decode steps (one token, no image input: plain RoPE at the cache position) after an
    image prompt, against mlx-vlm's whole forward over the prompt and the tokens so far
    (its ids for them: cache position + rope delta on all three rows)."""
    ref = load_mlx_vlm(folders("qwen2_5_vl"))
    msgs = two_images()
    ip = image_prompt(model, msgs)
    pixels, grid = qwen_pixels(model, msgs)
    ids = mx.array([ip.ids], mx.int32)
    lg, cache = logits_step(model.params, model.new_cache(1, 256), ids, len(ip.ids), images=whole_images(ip, model))
    seq = list(ip.ids)
    for _ in range(4):
        tok = int(mx.argmax(lg[0, -1]).item())
        seq.append(tok)
        lg, cache = logits_step(model.params, cache, mx.array([[tok]], mx.int32), 1)
        want = ref(mx.array([seq]), pixels, image_grid_thw=grid).logits[0, -1]
        close(lg[0, -1], want, TOL)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl"])
def test_generate_with_images_equals_mlx_vlm_greedy(folders, kind):
    m = fx_engine.load(str(folders(kind)))
    msgs = two_images()
    done = fx_engine.generate(m, msgs, max_tokens=6)
    prompt, want = qwen_greedy(load_mlx_vlm(folders(kind)), m, msgs, 6)
    assert len(want) == 6  # (no early end: six tokens compared)
    assert list(done.prompt_token_ids) == prompt
    assert list(done.token_ids) == want
    from fx_engine.engine.generate import reference_generate

    again = reference_generate(m, msgs, max_tokens=6, prefill_chunk=32)  # chunks before and between images
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


def test_prefix_keys_carry_the_rope_delta(model):
    """Prompts of another rope delta never share a prefix-cache entry (their keys are rotated
    by other shifts), nor with text; the same images do."""
    a = image_prompt(model, messages(png(1)))
    b = image_prompt(model, messages(png(1), png(2)))
    assert a.rope_delta != b.rope_delta
    ka, kb = prefix_key(a, a.ids), prefix_key(b, b.ids)
    assert ka[0] != kb[0] and ka[0] != a.ids[0] and ka[1:a.spans[0][0]] == a.ids[1:a.spans[0][0]]
    assert prefix_key(a, a.ids) == ka


def test_engine_prefix_cache_follow_up_turn(model):
    """A follow-up turn (same image, no new one: the same delta) reuses the first turn's
    prompt; a turn adding an image reuses nothing; both equal the reference loop."""
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


def test_routes_serve_a_qwen2_5_vl_model(model):
    """The chat routes are family-neutral: an OpenAI chat with an image data URL answers as
    the Python API does, and /tokenize gives the expanded prompt."""
    import base64

    import httpx

    from fx_engine.server.app import create_app
    from tests.conftest import serve

    url_img = "data:image/png;base64," + base64.b64encode(png(12, (60, 40))).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url_img}}]}]
    want = fx_engine.generate(model, msgs, max_tokens=6, temperature=0)
    engine = fx_engine.Engine(model, max_rows=2)
    with serve(create_app(engine, "tiny-qwen2.5-vl"), engine) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"messages": msgs, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        tok = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=120).json()
        assert tok["tokens"] == list(want.prompt_token_ids)


def test_engine_cuts_an_image_larger_than_a_prefill_piece(model):
    """Qwen's image tokens attend causally, so a prefill piece may end inside an image (a
    photo's ~1,000 tokens against the Engine's 512-token pieces): pieces smaller than either
    image give the reference loop's tokens and logprobs (whole images), with the image rows
    and M-RoPE offsets picked up where each piece starts; a prefix-cache hit that ends
    inside an image is reused the same way."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    msgs = messages(png(1, (16, 16)), png(2, (48, 48)))
    runs = [b - a for a, b in image_prompt(model, msgs).spans]
    assert runs[0] < runs[1]
    want = reference_generate(model, msgs, max_tokens=4, logprobs=2)
    for chunk in (runs[0] - 3, runs[1] - 4):
        with Engine(model, max_rows=1, prefill_chunk=chunk, prefix_cache_bytes=0) as engine:
            got = engine.submit(msgs, max_tokens=4, logprobs=2).result()
        assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids, chunk
        for x, y in zip(got.logprobs, want.logprobs, strict=True):
            assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4
    with Engine(model, max_rows=1, prefill_chunk=runs[1] - 4) as engine:
        first = engine.submit(msgs, max_tokens=4, logprobs=2).result()
        again = engine.submit(msgs, max_tokens=4, logprobs=2).result()  # (its prefix cached)
    assert first.token_ids == again.token_ids == want.token_ids


def test_mrope_config_forms_and_refusals(folders, model):
    """rope_scaling {"type": "mrope" | "default", "mrope_section"} and transformers 5's
    rope_parameters read alike; sections that do not cover head_dim / 2 frequencies, or
    M-RoPE with a scaling, are refused naming the field."""
    from fx_engine.core.config import ConfigError
    from fx_engine.core.models import config_from_hf

    d = json.loads((folders("qwen2_5_vl") / "config.json").read_text())
    section = list(model.config.mrope_section)
    assert config_from_hf(d) == model.config and model.config.rope_scaling is None
    bare = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}
    for form in ({**d, "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": section}},
                 {**bare, "rope_parameters": {"rope_type": "default", "mrope_section": section,
                                              "rope_theta": d["rope_theta"]}}):
        assert config_from_hf(form) == model.config
    for bad in ({"type": "mrope", "mrope_section": [2, 3, 4]}, {"type": "mrope", "mrope_section": [5, 3]},
                {"type": "yarn", "factor": 2.0, "mrope_section": section}):
        with pytest.raises(ConfigError, match="mrope_section"):
            config_from_hf({**d, "rope_scaling": bad})


def test_steps_refuse_images_without_their_mrope_positions(model):
    """An M-RoPE model (rope_scaling.mrope_section) given image rows without their 3-D
    position offsets would run plain RoPE over the image tokens: the step refuses, naming
    the field (a hand-made ImagePrompt without rope_offsets likewise, at the engine)."""
    from fx_engine.engine.engine import Engine

    ip = image_prompt(model, messages(png(1)))
    n = len(ip.ids)
    ids = mx.array([ip.ids], mx.int32)
    bare = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=IMAGE_ID)
    with pytest.raises(ValueError, match=r"images\.positions: .*M-RoPE"):
        logits_step(model.params, model.new_cache(1, 64), ids, n, images=bare)
    whole = whole_images(ip, model)
    assert whole.positions is not None
    logits_step(model.params, model.new_cache(1, 64), ids, n, images=whole)  # (the prompt's own: runs)
    with Engine(model, max_rows=1) as engine:
        with pytest.raises(ValueError, match="rope_offsets"):
            engine.submit(ip._replace(rope_offsets=None), max_tokens=2)
        assert engine.submit(ip, max_tokens=2).result().token_ids
