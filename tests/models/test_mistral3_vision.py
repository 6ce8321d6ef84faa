"""Mistral 3's image path (issue 46, item 1: Mistral-Small-3.1 / 3.2 layout, model_type
`mistral3`): the Pixtral tower and the projector with its patch merger
(core/vision/pixtral.py) against mlx-vlm 0.7.10's mistral3 / pixtral classes on the same
random weights, the Mistral text forward with the image rows spliced in against mlx-vlm's
whole `Model`, greedy generation, the pixels against transformers' torch-free
PixtralImageProcessorPil (bit for bit) and mlx-vlm's PixtralImageProcessor (to the last
float32 bit: it normalizes in another order), the prompt ids
against mlx-vlm's Mistral3Processor (transformers' PixtralProcessor imports torch at module
level, so it cannot be built here; mlx-vlm's is its port, same expansion), a text-only
prompt against the text model alone, an Engine batch against solo runs, and the HTTP
chat route.

Tolerance: float32 on both sides from identical weights (summation order, fused q|k|v and
gate|up): ~3e-6 measured on the tower and projector, TOL = 2e-4 on logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.steps import logits_step
from fx_engine.core.vision import pixtral, vision_module
from fx_engine.core.vision.splice import ImageInput
from fx_engine.engine.image_prompt import image_placeholder, image_prompt, image_prompt_from_text
from fx_engine.loading.images import ImageError
from fx_engine.loading.images_pixtral import PixtralProcessorConfig, preprocess_one, processor_config_from_dict
from fx_engine.loading.vision import load_vision
from fx_engine.testing.vision import MISTRAL3_IMAGE_ID as IMAGE_ID
from fx_engine.testing.vision import MISTRAL3_PREPROCESSOR as PREPROCESSOR
from fx_engine.testing.vision import tiny_mistral3_config, write_tiny_mistral3
from tests.models.vision_checks import close, greedy_tokens, image, load_mlx_vlm, messages, png

TOL = 2e-4
SIZE = (48, 40)  # the test images' (width, height) where a test names none
KINDS = {"hf": ("hf", {}), "legacy": ("legacy", {}), "mlx": ("mlx", {}),
         # a projector with biases and the tower's next-to-last hidden state
         "variant": ("hf", {"multimodal_projector_bias": True, "vision_feature_layer": -2}),
         # head_dim 16 (the native attention kernel's sizes, where the load turns it on)
         "wide": ("hf", {"vision": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 96}})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(kind: str = "hf") -> Path:
        if kind not in made:
            layout, top = KINDS[kind]
            made[kind] = write_tiny_mistral3(tmp_path_factory.mktemp(f"mistral3-{kind}") / "m", layout, **top)
        return made[kind]

    return folder


@pytest.fixture(scope="module")
def model(folders):
    return fx_engine.load(str(folders("hf")))


def _processor(path: Path):
    """mlx-vlm's Mistral3Processor (PixtralProcessor's expansion) over its own torch-free
    PixtralImageProcessor, built offline from the folder's files."""
    from mlx_vlm.models.mistral3.processing_mistral3 import Mistral3Processor
    from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    from transformers import PreTrainedTokenizerFast

    d = json.loads((path / "preprocessor_config.json").read_text())
    for k in ("image_processor_type", "processor_class"):
        d.pop(k)
    cfg = json.loads((path / "config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    return Mistral3Processor(image_processor=PixtralImageProcessor(**d), tokenizer=tok,
                             patch_size=cfg["vision_config"]["patch_size"],
                             spatial_merge_size=cfg["spatial_merge_size"])


# ---------------------------------------------------------------- the checkpoint and the encoder


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["mlx", "variant"])
def test_tiny_checkpoint_is_mlx_vlms_model(folders, kind):
    """The tiny folder holds exactly the tensors (names, shapes) of mlx-vlm's own
    mistral3.Model built from its config.json."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models import mistral3 as ref

    path = folders(kind)
    cfg = json.loads((path / "config.json").read_text())
    mc = ref.ModelConfig.from_dict(cfg)
    mc.text_config = ref.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = ref.VisionConfig.from_dict(cfg["vision_config"])
    net = ref.Model(mc)
    want = {n: tuple(p.shape) for n, p in tree_flatten(net.parameters())}
    stored = mx.load(str(path / "model.safetensors"))
    if kind == "mlx":  # (stored as mlx-vlm's conversions store them)
        assert {n: tuple(t.shape) for n, t in stored.items()} == want
    # Hugging Face's names: what mlx-vlm's loader makes of them (its sanitize steps)
    got = net.vision_tower.sanitize(net.sanitize(stored))
    assert {n: tuple(t.shape) for n, t in got.items()} == want


@pytest.mark.oracle
@pytest.mark.parametrize("kind", list(KINDS))
def test_encoder_matches_mlx_vlm(folders, kind):
    """Tower features and projected rows against mlx-vlm's vision tower and projector, for
    images of several sizes (odd token grids, one token), and two images of one size in one
    batch (each attends to itself only: mlx-vlm's block mask over the concatenation)."""
    path = folders(kind)
    params, ref = load_vision(path), load_mlx_vlm(path)
    if kind == "wide":  # (with the numerics fx_engine.load picks)
        params = fx_engine.load(str(path)).vision
    assert vision_module({"model_type": "mistral3"}) is pixtral
    layer = ref.config.vision_feature_layer
    for h, w in [(64, 48), (24, 40), (8, 8), (40, 64)]:
        pix = mx.random.uniform(-1, 1, (1, 3, h, w), key=mx.random.key(h * 100 + w))
        _, states = ref.vision_tower(pix.transpose(0, 2, 3, 1), output_hidden_states=True, image_sizes=[(h, w)])
        close(pixtral.tower(params, pix)[0], states[layer][0], 1e-4)
        want = ref.multi_modal_projector(states[layer][0], [(h, w)])
        got = pixtral.encode_images(params, pix)[0]
        assert got.shape == ((h // 8) * (w // 8), 64)
        close(got, want, 1e-4)
        close(pixtral.encode_images_compiled(params, pix)[0], want, 1e-4)  # (padded to a size bucket)
    pix = mx.random.uniform(-1, 1, (2, 3, 16, 24), key=mx.random.key(5))
    _, states = ref.vision_tower(pix.transpose(0, 2, 3, 1), output_hidden_states=True, image_sizes=[(16, 24)] * 2)
    want = ref.multi_modal_projector(states[layer][0], [(16, 24)] * 2)
    close(pixtral.encode_images(params, pix).reshape(-1, 64), want, 1e-4)


def test_compiled_encoder_traces_once_per_size_bucket(folders):
    """Image sizes whose patch and token counts fall in the same buckets (9 x 10 and 10 x 9
    patches: 96 padded patches, 20 tokens) share one compiled trace, each
    padded encoding equal to its eager unpadded one; another bucket traces once more."""
    params = load_vision(folders("hf"))
    fn = pixtral._compiled
    before = fn.traces
    for h, w in [(36, 40), (40, 36)]:
        pix = mx.random.uniform(-1, 1, (1, 3, h, w), key=mx.random.key(h + w))
        close(pixtral.encode_images_compiled(params, pix), pixtral.encode_images(params, pix), 1e-5)
    assert fn.traces - before == 1
    pix = mx.random.uniform(-1, 1, (2, 3, 52, 80), key=mx.random.key(3))  # 260 -> 288 patches
    close(pixtral.encode_images_compiled(params, pix), pixtral.encode_images(params, pix), 1e-5)
    assert fn.traces - before == 2


def test_attention_in_query_blocks_is_the_same(folders, monkeypatch):
    """A large image's attention runs in blocks of QUERY_BLOCK queries: the same rows."""
    params = load_vision(folders("hf"))
    pix = mx.random.uniform(-1, 1, (1, 3, 64, 56), key=mx.random.key(9))  # 224 patches
    whole = pixtral.encode_images(params, pix)
    monkeypatch.setattr(pixtral, "QUERY_BLOCK", 48)
    close(pixtral.encode_images(params, pix), whole, 1e-5)


def test_config_refusals():
    cfg = tiny_mistral3_config()
    assert pixtral.config_from_hf(cfg).num_layers == 2
    assert pixtral.config_from_hf({**cfg, "vision_feature_layer": -2}).num_layers == 1
    for bad, match in (({"vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
                       ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
                       ({"vision_config": {**cfg["vision_config"], "hidden_act": "relu"}}, "hidden_act"),
                       ({"vision_config": {**cfg["vision_config"], "head_dim": 16}}, "head_dim"),
                       ({"text_config": None}, "text_config")):
        with pytest.raises(ConfigError, match=match):
            pixtral.config_from_hf({**cfg, **bad})


# ---------------------------------------------------------------- preprocessing


@pytest.mark.oracle
def test_pixels_match_transformers_and_mlx_vlm(model):
    """Our pixels against transformers' PixtralImageProcessorPil (bit for bit) and mlx-vlm's
    PixtralImageProcessor (within a float32 ulp), at the patch size PixtralProcessor passes
    them (patch_size * spatial_merge_size): shapes (the resize rule) and values."""
    from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    d = {k: v for k, v in PREPROCESSOR.items() if k not in ("image_processor_type", "processor_class")}
    rules = model.image_processor
    assert isinstance(rules, PixtralProcessorConfig) and rules.factor == 8
    hf, mv = PixtralImageProcessorPil(**d), PixtralImageProcessor(**d)
    for w, h in [(48, 40), (37, 100), (90, 7), (64, 64), (200, 300), (5, 5), (65, 64)]:
        img = image(w * 1000 + h, (w, h))
        ours = preprocess_one(img, rules)
        for out, exact in ((hf(images=[img], patch_size=8), True), (mv(images=[img], patch_size=8), False)):
            theirs = np.asarray(out["pixel_values"])[0]
            assert tuple(np.asarray(out["image_sizes"])[0]) == ours.shape[1:]
            if exact:
                np.testing.assert_array_equal(ours, theirs)
            else:  # (mlx-vlm's normalizes in another order: the last float32 bit of some pixels)
                np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
        assert ours.shape[1] <= 64 and ours.shape[2] <= 64 and ours.shape[1] % 8 == ours.shape[2] % 8 == 0


def test_preprocessor_config_checks():
    cfg = processor_config_from_dict(PREPROCESSOR, merge_size=2)
    assert (cfg.longest_edge, cfg.patch_size, cfg.factor, cfg.resample) == (64, 4, 8, 3)
    for bad, match in (({"size": {"height": 3, "width": 4}}, "size"), ({"do_resize": False}, "do_resize"),
                       ({"patch_size": {"height": 4, "width": 8}}, "patch_size"),
                       ({"image_processor_type": "Gemma3ImageProcessor"}, "image_processor_type")):
        with pytest.raises(ConfigError, match=match):
            processor_config_from_dict({**PREPROCESSOR, **bad})


# ---------------------------------------------------------------- the prompt


@pytest.mark.oracle
def test_prompt_ids_match_the_processor(folders, model):
    path = folders("hf")
    proc = _processor(path)
    imgs = [image(2, (70, 40)), image(3, (20, 90)), image(4, (8, 8))]
    text = "<|im_start|>user\n[IMG]what is this? and [IMG] that, [IMG]<|im_end|>\n<|im_start|>assistant\n"
    want = proc(text=[text], images=imgs)
    ip = image_prompt_from_text(model, text, imgs)
    assert ip.ids == np.asarray(want["input_ids"][0]).tolist()
    sizes = np.asarray(want["image_sizes"]).tolist()
    grids = [(h // 8, w // 8) for h, w in sizes]
    assert ip.image_tokens == tuple(r * c for r, c in grids)
    assert [b - a for a, b in ip.spans] == [c for r, c in grids for _ in range(r)]
    assert ip.rows.shape == (sum(ip.image_tokens), 64)
    brk, end = (model.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("[IMG_BREAK]", "[IMG_END]"))
    assert ip.ids.count(end) == 3 and ip.ids.count(brk) == sum(r - 1 for r, _ in grids)


def test_prompt_layout_and_errors(model):
    assert image_placeholder(model) == "[IMG]"
    cfg = model.vision.config
    assert pixtral.prompt_ids(cfg, 2, 3, 90, 91) == [IMAGE_ID] * 3 + [90] + [IMAGE_ID] * 3 + [91]
    assert pixtral.prompt_ids(cfg, 1, 1, 90, 91) == [IMAGE_ID, 91]
    ip = image_prompt(model, messages(png(1, SIZE)))  # 48 x 40: 5 rows of 6 tokens
    assert [b - a for a, b in ip.spans] == [6] * 5 and ip.image_tokens == (30,)
    with pytest.raises(ImageError, match="placeholder"):
        image_prompt(model, messages(png(1, SIZE), text="a literal [IMG] in the text"))


# ---------------------------------------------------------------- the text forward


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["hf", "mlx", "variant"])
def test_logits_match_mlx_vlm(folders, kind):
    """The whole prompt through our Mistral forward with the image rows spliced in, against
    mlx-vlm's Model(input_ids, pixel_values, image_sizes=...) on the processor's own ids and
    (padded) pixels; also in prefill chunks cut inside an image (the text model is causal)."""
    path = folders(kind)
    m = fx_engine.load(str(path))
    ref = load_mlx_vlm(path)
    imgs = [image(5, (70, 30)), image(6, (30, 60))]
    text = "<|im_start|>user\n[IMG]describe [IMG] both<|im_end|>\n<|im_start|>assistant\n"
    inputs = _processor(path)(text=[text], images=imgs)
    want = ref(mx.array(inputs["input_ids"]), mx.array(inputs["pixel_values"]), mask=None,
               image_sizes=np.asarray(inputs["image_sizes"]).tolist()).logits[0]
    ip = image_prompt_from_text(m, text, imgs)
    assert ip.ids == np.asarray(inputs["input_ids"][0]).tolist()
    n = len(ip.ids)
    img = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=IMAGE_ID, bidirectional=False)
    got, _ = logits_step(m.params, m.new_cache(1, 512, headroom=256), mx.array([ip.ids], mx.int32), n, images=img)
    close(got[0], want, TOL)
    cache, out, pos, used = m.new_cache(1, 512, headroom=256), [], 0, 0
    for end in (ip.spans[1][0] + 2, ip.spans[-2][1] - 1, n):
        piece = ip.ids[pos:end]
        img = ImageInput(rows=ip.rows, start=mx.array([used], mx.int32), token_index=IMAGE_ID, bidirectional=False)
        lg, cache = logits_step(m.params, cache, mx.array([piece], mx.int32), len(piece), images=img)
        out.append(lg[0])
        used += piece.count(IMAGE_ID)
        pos = end
    close(mx.concatenate(out, axis=0), want, TOL)


def test_text_only_prompt_is_the_text_model_alone(folders, model, tmp_path):
    """A mistral3 folder's text-only chat equals the same weights as a plain `mistral`
    folder (the text model alone): same prompt, same logprobs and tokens; and an
    ImageInput without image tokens changes nothing."""
    src = folders("hf")
    cfg = json.loads((src / "config.json").read_text())
    alone = tmp_path / "text"
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps({**cfg["text_config"], "architectures": ["MistralForCausalLM"]}))
    tensors = {("model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n): t
               for n, t in mx.load(str(src / "model.safetensors")).items()
               if n.startswith("model.language_model.") or n == "lm_head.weight"}
    mx.save_safetensors(str(alone / "model.safetensors"), tensors, metadata={"format": "mlx"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (alone / f).write_text((src / f).read_text())
    text_model = fx_engine.load(str(alone))
    assert text_model.vision is None
    msgs = [{"role": "user", "content": "what is the capital of France?"}]
    a = fx_engine.generate(model, msgs, max_tokens=6, logprobs=2)
    b = fx_engine.generate(text_model, msgs, max_tokens=6, logprobs=2)
    assert list(a.prompt_token_ids) == list(b.prompt_token_ids) and list(a.token_ids) == list(b.token_ids)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-5
    ids = mx.array([[1, 5, 6, 7]], mx.int32)
    plain, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4)
    img = ImageInput(rows=mx.zeros((16, 64)), start=mx.array([0], mx.int32), token_index=IMAGE_ID)
    same, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4, images=img)
    close(plain, same, 0)


# ---------------------------------------------------------------- generation


@pytest.mark.oracle
def test_generate_with_images_equals_mlx_vlm_greedy(folders, model):
    """fx_engine.generate's greedy tokens against mlx-vlm's whole forward run again on the
    growing sequence (no cache), the images as the processor gives them."""
    path = folders("hf")
    ref, proc = load_mlx_vlm(path), _processor(path)
    imgs = [image(7, (64, 40)), image(8, (24, 56))]
    msgs = messages(*[{"type": "image", "image": i} for i in imgs], text="describe")
    done = fx_engine.generate(model, msgs, max_tokens=6)
    text = "<|im_start|>user\n[IMG][IMG]describe<|im_end|>\n<|im_start|>assistant\n"
    inputs = proc(text=[text], images=imgs)
    ids = np.asarray(inputs["input_ids"][0]).tolist()
    assert list(done.prompt_token_ids) == ids
    pixels, sizes = mx.array(inputs["pixel_values"]), np.asarray(inputs["image_sizes"]).tolist()
    want = greedy_tokens(lambda x: ref(x, pixels, mask=None, image_sizes=sizes).logits, ids, 6, model.eos_ids)
    assert len(want) == 6  # (no early end: six tokens compared)
    assert list(done.token_ids) == want
    from fx_engine.engine.generate import reference_generate

    again = reference_generate(model, msgs, max_tokens=6, prefill_chunk=16)
    assert list(again.token_ids) == list(done.token_ids)


def test_engine_batches_image_rows_with_text_rows(model):
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    prompts = [messages(png(9, SIZE)), [{"role": "user", "content": "a plain text request"}],
               messages(png(10, SIZE), png(11, (20, 90)), text="two of them")]
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


def test_engine_prefix_cache_and_encoder_cache(model):
    """A follow-up turn reuses the first turn's KV (image included) and its image rows; the
    same text with other pixels reuses at most the text before the image; all equal the
    reference loop."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    first = messages(png(12, SIZE), text="describe this picture in some detail please")
    with Engine(model, max_rows=2, prefill_chunk=32) as engine:
        a = engine.submit(first, max_tokens=4).result()
        turn = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "and more?"}]
        b = engine.submit(turn, max_tokens=4, logprobs=2).result()
        other = messages(png(13, SIZE), text="describe this picture in some detail please")
        c = engine.submit(other, max_tokens=4, logprobs=2).result()
        enc = engine.encoder_cache
    assert b.usage.cached_tokens > 30
    assert c.usage.cached_tokens <= image_prompt(model, other).spans[0][0]
    assert (enc.hits, enc.misses, len(enc)) == (1, 2, 2)
    for got, msgs in ((b, turn), (c, other)):
        want = reference_generate(model, msgs, max_tokens=4, logprobs=2)
        assert got.token_ids == want.token_ids
        for x, y in zip(got.logprobs, want.logprobs, strict=True):
            assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4


def test_http_chat_with_an_image(model):
    """The chat route answers a Mistral 3 chat with an image as the Python API does, and
    /tokenize counts its image tokens."""
    import base64

    import httpx

    from fx_engine.server.app import create_app
    from tests.conftest import serve

    url_ = "data:image/png;base64," + base64.b64encode(png(14, (60, 40))).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "describe the picture"},
                                         {"type": "image_url", "image_url": {"url": url_}}]}]
    want = fx_engine.generate(model, msgs, max_tokens=6, temperature=0)
    engine = fx_engine.Engine(model, max_rows=2)
    with serve(create_app(engine, "tiny-mistral3"), engine) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"messages": msgs, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        tok = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=120).json()
        assert tok["tokens"] == list(want.prompt_token_ids)
