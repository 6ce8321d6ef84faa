"""Idefics3 / SmolVLM's image path (issue 46, a second vision-language family): the SigLIP
tower + connector (pixel shuffle, projection) against mlx-vlm 0.7.10's idefics3 / smolvlm
classes with the same random weights, the Llama text forward with image rows spliced in
against mlx-vlm's whole forward, preprocessing (tiling) against transformers' torch-free
Idefics3ImageProcessorPil / SmolVLMImageProcessorPil (bit for bit), the prompt expansion
against transformers' Idefics3Processor, and `fx_engine.generate` / an Engine batch.

Tolerance: float32 on both sides from identical weights (summation order, fused q|k|v):
~1e-5 measured, TOL = 2e-4.
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
from fx_engine.core.vision import idefics3, vision_module
from fx_engine.core.vision.splice import ImageInput
from fx_engine.engine.image_prompt import image_placeholder, image_prompt, image_prompt_from_text
from fx_engine.loading.images import Idefics3ProcessorConfig, idefics3_config_from_dict, idefics3_tiles
from fx_engine.loading.vision import load_vision
from fx_engine.testing.vision import IDEFICS3_IMAGE_ID as IMAGE_ID
from fx_engine.testing.vision import IDEFICS3_PREPROCESSOR as PREPROCESSOR
from fx_engine.testing.vision import IDEFICS3_VISION as VISION
from fx_engine.testing.vision import write_tiny_idefics3
from tests.models.vision_checks import close, greedy_tokens, load_mlx_vlm, messages, png

TOL = 2e-4
SIZE = (48, 40)  # the test images' (width, height) where a test names none


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(kind: str = "idefics3") -> Path:
        if kind not in made:
            mt, layout = {"idefics3": ("idefics3", "hf"), "smolvlm": ("smolvlm", "hf"),
                          "mlx": ("idefics3", "mlx"), "nosplit": ("idefics3", "hf")}[kind]
            made[kind] = write_tiny_idefics3(tmp_path_factory.mktemp(f"idefics3-{kind}") / "m", mt, layout,
                                             preprocessor={"do_image_splitting": False} if kind == "nosplit" else None)
        return made[kind]

    return folder


@pytest.fixture(scope="module")
def model(folders):
    return fx_engine.load(str(folders("idefics3")))


def _mlx_vlm(path: Path):
    ref = load_mlx_vlm(path)
    # mlx-vlm's post_layernorm has LayerNorm's default eps (1e-5); Hugging Face's the config's
    ref.vision_model.post_layernorm.eps = VISION["layer_norm_eps"]
    return ref


# ---------------------------------------------------------------- the encoder


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["idefics3", "smolvlm", "mlx"])
def test_encoder_matches_mlx_vlm(folders, kind):
    path = folders(kind)
    params, ref = load_vision(path), _mlx_vlm(path)
    assert vision_module({"model_type": params.config.model_type}) is idefics3
    pix = mx.random.uniform(-1, 1, (3, 3, 32, 32), key=mx.random.key(3))
    feats, _, _ = ref.vision_model(pix.transpose(0, 2, 3, 1))
    want = ref.connector(feats)
    got = idefics3.encode_images(params, pix)
    assert got.shape == (3, 16, 64)
    close(got, want, TOL)
    assert mx.array_equal(idefics3.encode_images_compiled(params, pix), got)


def test_position_ids_follow_hugging_face():
    assert (idefics3.bucketized_positions(8) == np.arange(64)).all()
    assert (idefics3.bucketized_positions(32) == np.arange(32 * 32)).all()
    ids = idefics3.bucketized_positions(25)  # float32 rounding: not the identity
    assert ids.shape == (625,) and not (ids == np.arange(625)).all()


# ---------------------------------------------------------------- preprocessing


@pytest.mark.oracle
@pytest.mark.parametrize("flavour", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("split", [True, False])
def test_tiles_match_transformers(flavour, split):
    import PIL.Image

    if flavour == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as P
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as P
    rng = np.random.default_rng(0)
    for longest in (96, 32):  # 32: the whole image is one tile (rows = cols = 0 even when splitting)
        d = {**PREPROCESSOR, "do_image_splitting": split, "size": {"longest_edge": longest}}
        d.pop("image_processor_type")
        hf, cfg = P(**d), idefics3_config_from_dict(d, image_size=32)
        for h, w in [(40, 40), (50, 90), (90, 37), (20, 25), (300, 200)]:
            img = PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            out = hf(images=[[img]], return_row_col_info=True)
            tiles, rows, cols = idefics3_tiles(img, cfg)
            assert (rows, cols) == (out["rows"][0][0], out["cols"][0][0])
            np.testing.assert_array_equal(tiles, np.asarray(out["pixel_values"])[0])


# ---------------------------------------------------------------- the prompt and the text forward


def test_prompt_layout(model):
    assert image_placeholder(model) == "<image>"
    ip = image_prompt(model, messages(png(1, SIZE)))
    cfg = model.vision.config
    # 48 x 40 -> 64 x 54 -> 64 x 64: 2 x 2 tiles and the global image, 16 tokens each
    assert len(ip.spans) == 5 and all(b - a == 16 for a, b in ip.spans)
    assert ip.rows.shape == (5 * 16, 64) and len(ip.digests) == 1
    assert sum(t == cfg.image_token_index for t in ip.ids) == 80
    segs = idefics3.prompt_segments(cfg, 1, 2)
    assert segs == ["<fake_token_around_image><row_1_col_1>", 16, "<fake_token_around_image><row_1_col_2>", 16,
                    "\n\n<fake_token_around_image><global-img>", 16, "<fake_token_around_image>"]
    assert idefics3.prompt_segments(cfg, 0, 0) == ["<fake_token_around_image><global-img>", 16,
                                                   "<fake_token_around_image>"]


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["idefics3", "nosplit"])
def test_prompt_ids_match_transformers_processor(folders, kind):
    import PIL.Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    path = folders(kind)
    m = fx_engine.load(str(path))
    d = json.loads((path / "preprocessor_config.json").read_text())
    d.pop("image_processor_type")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**d), tokenizer=tok, image_seq_len=16)
    imgs = [PIL.Image.open(io.BytesIO(png(2, SIZE))), PIL.Image.open(io.BytesIO(png(3, (30, 70))))]
    text = "<|im_start|>user\n<image>what is this? and <image> that<|im_end|>\n<|im_start|>assistant\n"
    want = proc(text=[text], images=[imgs])["input_ids"][0]
    ip = image_prompt_from_text(m, text, imgs)
    assert ip.ids == list(want)
    tiles = np.concatenate([idefics3_tiles(im, m.image_processor)[0] for im in imgs])
    assert ip.rows.shape[0] == tiles.shape[0] * 16 == len(ip.spans) * 16
    assert (len(ip.spans) == 2) == (kind == "nosplit")


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["idefics3", "smolvlm", "mlx"])
def test_logits_match_mlx_vlm(folders, kind):
    """The whole prompt through our Llama forward with the image rows spliced in, against
    mlx-vlm's Model(input_ids, pixel_values) on the same ids and tiles; also in chunks.
    "mlx": mlx-vlm's converted names (language_model.*, vision_model.*, connector.*)."""
    import PIL.Image

    path = folders(kind)
    m = fx_engine.load(str(path))
    ref = _mlx_vlm(path)
    imgs = [PIL.Image.open(io.BytesIO(png(4, SIZE))), PIL.Image.open(io.BytesIO(png(5, (70, 30))))]
    ip = image_prompt(m, messages(*[{"type": "image", "image": i} for i in imgs]))
    tiles = np.concatenate([idefics3_tiles(im, m.image_processor)[0] for im in imgs])
    ids = mx.array([ip.ids], mx.int32)
    want = ref(ids, mx.array(tiles)[None]).logits[0]
    n = len(ip.ids)
    cache = m.new_cache(1, 512, headroom=256)
    img = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=m.vision.config.image_token_index,
                     bidirectional=False)
    got, _ = logits_step(m.params, cache, ids, n, images=img)
    close(got[0], want, TOL)
    # in chunks at the spans' edges (each run whole): the rows before a chunk counted
    cache = m.new_cache(1, 512, headroom=256)
    out, pos, used = [], 0, 0
    cuts = [ip.spans[1][0], ip.spans[3][1], n]
    for end in cuts:
        piece = ip.ids[pos:end]
        img = ImageInput(rows=ip.rows, start=mx.array([used], mx.int32), token_index=IMAGE_ID, bidirectional=False)
        lg, cache = logits_step(m.params, cache, mx.array([piece], mx.int32), len(piece), images=img)
        out.append(lg[0])
        used += piece.count(IMAGE_ID)
        pos = end
    close(mx.concatenate(out, axis=0), want, TOL)


def test_without_images_the_llama_step_is_unchanged(model):
    ids = mx.array([[1, 5, 6, 7]], mx.int32)
    a, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4)
    img = ImageInput(rows=mx.zeros((16, 64)), start=mx.array([0], mx.int32), token_index=IMAGE_ID)
    b, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4, images=img)  # no image token: same
    close(a, b, 0)


# ---------------------------------------------------------------- generation


def _greedy_mlx_vlm(folder, model, msgs, n):
    """Greedy decoding with mlx-vlm's whole forward, no cache (each step the whole sequence)."""
    import PIL.Image

    ref = _mlx_vlm(folder)
    ip = image_prompt(model, msgs)
    imgs = [PIL.Image.open(io.BytesIO(p["image"])) for m in msgs for p in m["content"] if p["type"] == "image"]
    tiles = mx.array(np.concatenate([idefics3_tiles(im, model.image_processor)[0] for im in imgs]))[None]
    return ip.ids, greedy_tokens(lambda ids: ref(ids, tiles).logits, ip.ids, n, model.eos_ids)


@pytest.mark.oracle
def test_generate_with_an_image_equals_mlx_vlm_greedy(folders, model):
    msgs = messages(png(6, SIZE), text="describe")
    done = fx_engine.generate(model, msgs, max_tokens=6)
    prompt, want = _greedy_mlx_vlm(folders("idefics3"), model, msgs, 6)
    assert len(want) == 6  # (no early end: six tokens compared)
    assert list(done.prompt_token_ids) == prompt
    assert list(done.token_ids) == want[:len(done.token_ids)] and len(done.token_ids) == len(want)
    from fx_engine.engine.generate import reference_generate

    again = reference_generate(model, msgs, max_tokens=6, prefill_chunk=32)
    assert list(again.token_ids) == list(done.token_ids)


def test_engine_batches_image_rows_with_text_rows(model):
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    prompts = [messages(png(7, SIZE)), [{"role": "user", "content": "a plain text request"}],
               messages(png(8, SIZE), png(9, (20, 90)), text="two of them")]
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


def test_no_preprocessor_config_uses_the_processor_defaults(folders, tmp_path):
    import shutil

    path = shutil.copytree(folders("idefics3"), tmp_path / "m")
    (path / "preprocessor_config.json").unlink()
    m = fx_engine.load(str(path))
    assert not isinstance(m.image_processor, Idefics3ProcessorConfig)
    ip = image_prompt(m, messages(png(1, SIZE)))
    # the defaults at the tower's 32-pixel tiles: longest edge 128, 48 x 40 -> 128 x 128: 4 x 4 tiles + global
    assert len(ip.spans) == 17


def test_engine_prefix_cache_and_encoder_cache(model):
    """A follow-up turn reuses the first turn's prompt (tiles and all) and its image rows;
    the same text with other pixels reuses at most the text before the image; both equal the
    reference loop."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    first = messages(png(10, SIZE), text="describe this picture in some detail please")
    with Engine(model, max_rows=2, prefill_chunk=32) as engine:
        a = engine.submit(first, max_tokens=4).result()
        turn = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "and more?"}]
        b = engine.submit(turn, max_tokens=4, logprobs=2).result()
        other = messages(png(11, SIZE), text="describe this picture in some detail please")
        c = engine.submit(other, max_tokens=4, logprobs=2).result()
        enc = engine.encoder_cache
    assert b.usage.cached_tokens > 80
    assert c.usage.cached_tokens <= image_prompt(model, other).spans[0][0]  # never past the first image token
    assert (enc.hits, enc.misses, len(enc)) == (1, 2, 2)
    for got, msgs in ((b, turn), (c, other)):
        want = reference_generate(model, msgs, max_tokens=4, logprobs=2)
        assert got.token_ids == want.token_ids
        for x, y in zip(got.logprobs, want.logprobs, strict=True):
            assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4
