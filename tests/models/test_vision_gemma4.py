"""Gemma 4's image path (model_type `gemma4`: core/vision/gemma4.py,
loading/images_gemma4.py): the tower and embedder against mlx-vlm 0.7.10's gemma4 classes
on the same random weights (Hugging Face's and mlx-vlm's names, clipped linears,
standardize, a quantized tower), the pixels and patch positions against transformers'
torch-free Gemma4ImageProcessorPil (bit for bit), the prompt ids against mlx-vlm's
Gemma4Processor (transformers' imports torch-only video code), the text forward with the
image rows spliced in against mlx-vlm's whole Model (image tokens causal, as the E2B /
E4B configs say; and with use_bidirectional_attention "vision", against mlx-vlm's model
run with Hugging Face's masks: sliding layers see the whole image, full layers stay
causal), greedy generation, a text-only prompt against the text model alone, and an
Engine batch against solo runs.

Tolerance: float32 on both sides from identical weights (summation order): ~2e-6
measured on the encoder; on logits TOL = 2e-4 at text positions (measured <= 3e-5) and
IMAGE_TOL = 3e-3 at the image tokens' own positions (their logits are never sampled;
measured up to 8e-4 with mlx-vlm's own rows spliced in, so the text side's float order,
not the rows; a wrong per-layer id there reads 24).
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
from fx_engine.core.vision import gemma4, vision_module
from fx_engine.core.vision.splice import ImageInput
from fx_engine.engine.image_prompt import image_placeholder, image_prompt, image_prompt_from_text
from fx_engine.loading.images import ImageError
from fx_engine.loading.images_gemma4 import (Gemma4ProcessorConfig, preprocess_one, processor_config_from_dict,
                                             target_size)
from fx_engine.loading.vision import load_vision
from fx_engine.testing.vision import GEMMA4_IDS, GEMMA4_PREPROCESSOR, tiny_gemma4_config, write_tiny_gemma4
from tests.models.vision_checks import close, greedy_tokens, image, load_mlx_vlm, messages, png

TOL, IMAGE_TOL = 2e-4, 3e-3
IMAGE_ID, BOI, EOI = GEMMA4_IDS["image_token_id"], GEMMA4_IDS["boi_token_id"], GEMMA4_IDS["eoi_token_id"]
BIDI = {"text": {"use_bidirectional_attention": "vision"}}
KINDS = {"hf": ("hf", {}), "mlx": ("mlx", {}),
         # clipped linears and the standardized output (Gemma4ClippableLinear, std_bias / std_scale)
         "clipped": ("hf", {"vision": {"use_clipped_linears": True, "standardize": True}}),
         # image tokens see each other on sliding layers (the 26B / 31B configs)
         "bidi": ("hf", BIDI)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(kind: str = "hf") -> Path:
        if kind not in made:
            layout, top = KINDS[kind]
            made[kind] = write_tiny_gemma4(tmp_path_factory.mktemp(f"gemma4-{kind}") / "m", layout, **top)
        return made[kind]

    return folder


@pytest.fixture(scope="module")
def model(folders):
    return fx_engine.load(str(folders("hf")))


def _hf_pixels(images, soft: int = 70):
    """transformers' Gemma4ImageProcessorPil at the tiny geometry: (pixel_values [N, max
    patches, 48], image_position_ids [N, max patches, 2], soft tokens per image)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    out = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=soft, pooling_kernel_size=3).preprocess(
        images, return_tensors="np")
    return (np.asarray(out["pixel_values"]), np.asarray(out["image_position_ids"]),
            list(out["num_soft_tokens_per_image"]))


def _processor(path: Path):
    """mlx-vlm's Gemma4Processor over its own torch-free image processor, built offline
    from the folder's files."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4Processor
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    for attr, text in (("image_token", "<|image|>"), ("boi_token", "<|image>"), ("eoi_token", "<image|>")):
        setattr(tok, attr, text)
    tok.image_token_id = IMAGE_ID
    return Gemma4Processor(image_processor=Gemma4ImageProcessor(patch_size=4, max_soft_tokens=70,
                                                                pooling_kernel_size=3), tokenizer=tok)


# ---------------------------------------------------------------- the checkpoint and the encoder


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["mlx", "clipped"])
def test_tiny_checkpoint_is_mlx_vlms_model(folders, kind):
    """The tiny folder's image path holds exactly the tensors (names, shapes) of mlx-vlm's
    own gemma4.Model built from its config.json (after mlx-vlm's sanitize for Hugging
    Face's names)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models import gemma4 as ref

    path = folders(kind)
    cfg = json.loads((path / "config.json").read_text())
    mc = ref.ModelConfig.from_dict(cfg)
    mc.text_config = ref.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = ref.VisionConfig.from_dict(cfg["vision_config"])
    net = ref.Model(mc)
    want = {n: tuple(p.shape) for n, p in tree_flatten(net.parameters()) if n.startswith(("vision_tower.",
                                                                                          "embed_vision."))}
    got = net.sanitize(mx.load(str(path / "model.safetensors")))
    assert {n: tuple(t.shape) for n, t in got.items() if n.startswith(("vision_tower.", "embed_vision."))} == want


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["hf", "mlx", "clipped"])
def test_encoder_matches_mlx_vlm(folders, kind):
    """Soft-token rows against mlx-vlm's vision tower + embedder on the processor's padded
    patches, for images of several shapes (wide, tall, tiny, the whole budget), eager and
    compiled (padded to a size bucket)."""
    path = folders(kind)
    params, ref = load_vision(path), load_mlx_vlm(path)
    assert vision_module({"model_type": "gemma4"}) is gemma4
    rules = Gemma4ProcessorConfig(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    for size in [(40, 30), (120, 20), (10, 90), (12, 12), (300, 300)]:
        img = image(size[0] * 7 + size[1], size)
        pv, pos, soft = _hf_pixels([img])
        want = ref.encode_image(mx.array(pv), mx.array(pos))
        want = want[0] if want.ndim == 3 else want
        patches, grid = preprocess_one(img, rules)
        assert gemma4.image_tokens(params.config, grid) == soft[0] == want.shape[0]
        got = gemma4.encode_image(params, mx.array(patches), grid)
        close(got, want, 1e-4)
        close(gemma4.encode_image_compiled(params, mx.array(patches), grid), want, 1e-4)


@pytest.mark.oracle
def test_quantized_tower_matches_mlx_vlm(tmp_path):
    """A tower whose linears are MLX 4-bit (an mlx-community conversion's) against mlx-vlm
    loading the same folder, kept quantized and dequantized alike."""
    path = write_tiny_gemma4(tmp_path / "q", "mlx", quantize_vision={"group_size": 32, "bits": 4})
    ref = load_mlx_vlm(path)
    img = image(4, (50, 40))
    pv, pos, _ = _hf_pixels([img])
    want = ref.encode_image(mx.array(pv), mx.array(pos))
    want = want[0] if want.ndim == 3 else want
    patches, grid = preprocess_one(img, Gemma4ProcessorConfig(patch_size=4, max_soft_tokens=70,
                                                              pooling_kernel_size=3))
    for keep in (False, True):
        params = load_vision(path, keep_quantized=keep)
        close(gemma4.encode_image(params, mx.array(patches), grid), want, 1e-4)


def test_compiled_encoder_traces_once_per_size_bucket(folders):
    """Patch grids whose patch and soft-token counts fall in the same buckets share one
    trace, each equal to its eager unpadded encoding; another bucket traces once more."""
    params = load_vision(folders("hf"))
    fn = gemma4._compiled
    for grids in ([(9, 12), (12, 9)], [(15, 18), (18, 15)]):  # 108 -> 112 patches, 12 tokens; 270 -> 288, 30 -> 32
        seen = None
        for grid in grids:
            x = mx.random.uniform(0, 1, (grid[0] * grid[1], 48), key=mx.random.key(sum(grid)))
            close(gemma4.encode_image_compiled(params, x, grid), gemma4.encode_image(params, x, grid), 1e-5)
            if seen is not None:
                assert fn.traces == seen  # (the same bucket: no new trace)
            seen = fn.traces
    with pytest.raises(ValueError, match="pool"):
        gemma4.encode_image(params, mx.zeros((10 * 9, 48)), (10, 9))
    with pytest.raises(ValueError, match="patches must be"):
        gemma4.encode_image(params, mx.zeros((81, 47)), (9, 9))


def test_attention_in_query_blocks_is_the_same(folders, monkeypatch):
    params = load_vision(folders("hf"))
    x = mx.random.uniform(0, 1, (18 * 15, 48), key=mx.random.key(9))
    whole = gemma4.encode_image(params, x, (18, 15))
    monkeypatch.setattr(gemma4, "QUERY_BLOCK", 64)
    close(gemma4.encode_image(params, x, (18, 15)), whole, 1e-5)


def test_config_refusals():
    cfg = tiny_gemma4_config()
    c = gemma4.config_from_hf(cfg)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.text_hidden_size) == (4, 2, 8, 64)
    # (the image tokens' attention rule is the text model's)
    from fx_engine.core.models import config_from_hf as text_config

    assert not text_config(cfg["text_config"]).vision_bidirectional
    assert text_config(tiny_gemma4_config(**BIDI)["text_config"]).vision_bidirectional
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        text_config({**cfg["text_config"], "use_bidirectional_attention": "all"})
    v = cfg["vision_config"]
    for bad, match in (({"vision_config": {**v, "head_dim": 6}}, "head_dim"),
                       ({"vision_config": {**v, "hidden_activation": "relu"}}, "hidden_activation"),
                       ({"vision_config": {**v, "attention_bias": True}}, "attention_bias"),
                       ({"vision_config": {**v, "num_key_value_heads": 3}}, "num_key_value_heads"),
                       ({"vision_config": {**v, "rope_parameters": {"rope_type": "yarn"}}}, "rope_type"),
                       ({"vision_config": {**v, "model_type": "siglip_vision_model"}}, "model_type"),
                       ({"image_token_id": 4}, "must differ"),
                       ({"vision_config": None}, "vision_config")):
        with pytest.raises(ConfigError, match=match):
            gemma4.config_from_hf({**cfg, **bad})


# ---------------------------------------------------------------- preprocessing


@pytest.mark.oracle
def test_pixels_match_transformers(model):
    """Our patches and grids against transformers' Gemma4ImageProcessorPil, bit for bit
    (its padding stripped), over aspect ratios that take every branch of the resize rule
    (a side rounding to 0: 200 x 5, 5 x 200; an image already the target size; larger
    budgets)."""
    rules = model.image_processor
    assert isinstance(rules, Gemma4ProcessorConfig) and (rules.max_soft_tokens, rules.resample) == (70, 3)
    for soft in (70, 280):
        r = Gemma4ProcessorConfig(patch_size=4, max_soft_tokens=soft, pooling_kernel_size=3)
        for w, h in [(40, 30), (37, 100), (200, 5), (5, 200), (96, 84), (12, 12), (1000, 999), (13, 7)]:
            img = image(w * 1000 + h, (w, h))
            pv, pos, soft_n = _hf_pixels([img], soft)
            patches, grid = preprocess_one(img, r)
            n = patches.shape[0]
            assert n == grid[0] * grid[1] and soft_n[0] == gemma4.image_tokens(model.vision.config, grid)
            np.testing.assert_array_equal(patches, pv[0, :n])
            np.testing.assert_array_equal(gemma4.positions_of(*grid), pos[0, :n])
            assert (pos[0, n:] == -1).all() and n <= soft * 9


def test_preprocessor_config_checks(tmp_path):
    cfg = processor_config_from_dict(GEMMA4_PREPROCESSOR)
    assert (cfg.patch_size, cfg.max_soft_tokens, cfg.max_patches, cfg.do_normalize) == (4, 70, 630, False)
    assert target_size(30, 40, cfg) == (84, 108)
    for bad, match in (({"max_soft_tokens": 100}, "max_soft_tokens"), ({"do_resize": False}, "do_resize"),
                       ({"patch_size": 0}, "patch_size"),
                       ({"image_processor_type": "Gemma3ImageProcessor"}, "image_processor_type")):
        with pytest.raises(ConfigError, match=match):
            processor_config_from_dict({**GEMMA4_PREPROCESSOR, **bad})
    # transformers 5 saves the rules inside processor_config.json; a patch size other than the tower's is refused
    path = write_tiny_gemma4(tmp_path / "m")
    (path / "preprocessor_config.json").unlink()
    (path / "processor_config.json").write_text(json.dumps({"image_processor": {**GEMMA4_PREPROCESSOR,
                                                                                  "max_soft_tokens": 140}}))
    assert fx_engine.load(str(path)).image_processor.max_soft_tokens == 140
    (path / "processor_config.json").write_text(json.dumps({"image_processor": {**GEMMA4_PREPROCESSOR,
                                                                                  "patch_size": 8}}))
    with pytest.warns(UserWarning, match="patch_size"):
        assert fx_engine.load(str(path)).vision is None


# ---------------------------------------------------------------- the prompt


@pytest.mark.oracle
def test_prompt_ids_match_the_processor(folders, model):
    proc = _processor(folders("hf"))
    imgs = [image(2, (70, 40)), image(3, (20, 90)), image(4, (8, 8))]
    text = "<|im_start|>user\n<|image|>what is this? and <|image|> that, <|image|><|im_end|>\n<|im_start|>assistant\n"
    want = proc(text=[text], images=imgs)
    ip = image_prompt_from_text(model, text, imgs)
    assert ip.ids == np.asarray(want["input_ids"][0]).tolist()
    assert [b - a for a, b in ip.spans] == list(ip.image_tokens)
    assert ip.rows.shape == (sum(ip.image_tokens), 64)
    assert not ip.whole  # (causal image tokens: prefill may cut an image)


def test_prompt_layout_and_errors(model, folders):
    assert image_placeholder(model) == "<|image|>"
    ip = image_prompt(model, messages(png(1, (40, 30))))  # 84 x 108 pixels: 7 x 9 soft tokens
    (a, b), = ip.spans
    assert ip.image_tokens == (63,) and b - a == 63 and ip.ids[a - 1] == BOI and ip.ids[b] == EOI
    with pytest.raises(ImageError, match="placeholder"):
        image_prompt(model, messages(png(1, (40, 30)), text="a literal <|image|> in the text"))
    assert image_prompt(fx_engine.load(str(folders("bidi"))), messages(png(1, (40, 30)))).whole


# ---------------------------------------------------------------- the text forward


def _close_logits(ours: mx.array, ref: mx.array, ids: list[int]) -> None:
    """Logits [T, V] within TOL at text positions and IMAGE_TOL at image tokens."""
    text = mx.array([i != IMAGE_ID for i in ids])
    close(mx.where(text[:, None], ours, ref), ref, TOL)
    close(ours, ref, IMAGE_TOL)


def _hf_masks(language_model, seq: list[int], window: int):
    """A replacement for mlx-vlm's gemma4 `_make_masks` giving Hugging Face's masks for a
    whole prompt (create_masks_for_vision_model): full-attention layers causal, sliding
    layers (key > query - window) AND (causal OR both tokens of one image)."""
    t = len(seq)
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    ids = np.asarray(seq)
    is_img = ids == IMAGE_ID
    group = np.where(is_img, np.cumsum(is_img & ~np.concatenate([[False], is_img[:-1]])) - 1, -1)
    same = (group[:, None] == group[None, :]) & (group[:, None] >= 0)
    masks = {"full_attention": mx.array((k <= q)[None, None]),
             "sliding_attention": mx.array((((k <= q) | same) & (k > q - window))[None, None])}

    def make(h, cache, mm_token_type_ids=None):
        return [masks[layer.layer_type] for layer in language_model.model.layers]

    return make


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["hf", "mlx", "clipped", "bidi"])
def test_logits_match_mlx_vlm(folders, kind, monkeypatch):
    """The whole prompt through our Gemma 4 forward with the image rows spliced in (and the
    per-layer inputs of image tokens read as the pad token), against mlx-vlm's
    Model(input_ids, pixel_values, image_position_ids=...) on the processor's ids and
    transformers' patches; causal configs also in prefill chunks cut inside an image. "bidi": against
    mlx-vlm run with Hugging Face's masks (its own overlays full layers too)."""
    path = folders(kind)
    m = fx_engine.load(str(path))
    ref = load_mlx_vlm(path)
    imgs = [image(5, (70, 30)), image(6, (30, 60))]
    text = "<|im_start|>user\n<|image|>describe <|image|> both<|im_end|>\n<|im_start|>assistant\n"
    inputs = _processor(path)(text=[text], images=imgs)
    ip = image_prompt_from_text(m, text, imgs)
    assert ip.ids == np.asarray(inputs["input_ids"][0]).tolist()
    if kind == "bidi":
        lm = ref.language_model.model
        monkeypatch.setattr(lm, "_make_masks", _hf_masks(ref.language_model, ip.ids, m.config.sliding_window))
    pv, pos, _ = _hf_pixels(imgs)  # (transformers' padded patches: what mlx-vlm's tower takes with positions)
    want = ref(mx.array(inputs["input_ids"]), mx.array(pv), mask=None, image_position_ids=mx.array(pos)).logits[0]
    n = len(ip.ids)
    img = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=IMAGE_ID)
    got, _ = logits_step(m.params, m.new_cache(1, 512, headroom=256), mx.array([ip.ids], mx.int32), n, images=img)
    _close_logits(got[0], want, ip.ids)
    if kind == "bidi":  # (the image's tokens attend to its later ones: not the causal answer)
        causal = ImageInput(rows=ip.rows, start=mx.array([0], mx.int32), token_index=IMAGE_ID, bidirectional=False)
        other, _ = logits_step(m.params, m.new_cache(1, 512, headroom=256), mx.array([ip.ids], mx.int32), n,
                               images=causal)
        assert mx.abs(other[0] - want).max().item() > 1e-2
        return
    cache, out, pos, used = m.new_cache(1, 512, headroom=256), [], 0, 0
    for end in (ip.spans[0][0] + 5, ip.spans[1][1] - 3, n):
        piece = ip.ids[pos:end]
        img = ImageInput(rows=ip.rows, start=mx.array([used], mx.int32), token_index=IMAGE_ID)
        lg, cache = logits_step(m.params, cache, mx.array([piece], mx.int32), len(piece), images=img)
        out.append(lg[0])
        used += piece.count(IMAGE_ID)
        pos = end
    _close_logits(mx.concatenate(out, axis=0), want, ip.ids)


def test_text_only_prompt_is_the_text_model_alone(folders, model, tmp_path):
    """A gemma4 folder's text-only chat equals the same weights as a plain `gemma4_text`
    folder, and an ImageInput without image tokens changes nothing."""
    src = folders("hf")
    cfg = json.loads((src / "config.json").read_text())
    alone = tmp_path / "text"
    alone.mkdir()
    (alone / "config.json").write_text(json.dumps({**cfg["text_config"], "architectures": ["Gemma4ForCausalLM"]}))
    tensors = {"model." + n[len("model.language_model."):]: t for n, t in mx.load(str(src / "model.safetensors")).items()
               if n.startswith("model.language_model.")}
    mx.save_safetensors(str(alone / "model.safetensors"), tensors, metadata={"format": "mlx"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (alone / f).write_text((src / f).read_text())
    text_model = fx_engine.load(str(alone))
    assert text_model.vision is None
    msgs = [{"role": "user", "content": "what is the capital of France?"}]
    a = fx_engine.generate(model, msgs, max_tokens=6, logprobs=2)
    b = fx_engine.generate(text_model, msgs, max_tokens=6, logprobs=2)
    assert list(a.prompt_token_ids) == list(b.prompt_token_ids) and list(a.token_ids) == list(b.token_ids)
    ids = mx.array([[1, 7, 8, 9]], mx.int32)
    plain, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4)
    img = ImageInput(rows=mx.zeros((16, 64)), start=mx.array([0], mx.int32), token_index=IMAGE_ID)
    same, _ = logits_step(model.params, model.new_cache(1, 16), ids, 4, images=img)
    close(plain, same, 0)


# ---------------------------------------------------------------- generation and the engine


@pytest.mark.oracle
def test_generate_with_images_equals_mlx_vlm_greedy(folders, model):
    path = folders("hf")
    ref, proc = load_mlx_vlm(path), _processor(path)
    imgs = [image(7, (64, 40)), image(8, (24, 56))]
    done = fx_engine.generate(model, messages(*[{"type": "image", "image": i} for i in imgs], text="describe"),
                              max_tokens=6)
    text = "<|im_start|>user\n<|image|><|image|>describe<|im_end|>\n<|im_start|>assistant\n"
    inputs = proc(text=[text], images=imgs)
    ids = np.asarray(inputs["input_ids"][0]).tolist()
    assert list(done.prompt_token_ids) == ids
    pv, pos, _ = _hf_pixels(imgs)
    pixels, pos = mx.array(pv), mx.array(pos)
    want = greedy_tokens(lambda x: ref(x, pixels, mask=None, image_position_ids=pos).logits, ids, 6, model.eos_ids)
    assert list(done.token_ids) == want


@pytest.mark.parametrize("kind", ["hf", "bidi"])
def test_engine_batches_image_rows_with_text_rows(folders, kind):
    """Image and text requests batched in an Engine equal their solo reference runs, with
    a prefill chunk smaller than an image (causal: cut inside it; bidirectional: each image
    whole in one piece)."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    model = fx_engine.load(str(folders(kind)))
    prompts = [messages(png(9, (40, 30))), [{"role": "user", "content": "a plain text request"}],
               messages(png(10, (40, 30)), png(11, (20, 90)), text="two of them")]
    solo = [reference_generate(model, p, max_tokens=5, prefill_chunk=64, logprobs=2) for p in prompts]
    with Engine(model, max_rows=3, prefill_chunk=64, step_token_budget=256, prefix_cache_bytes=0) as engine:
        done = [h.result() for h in [engine.submit(p, max_tokens=5, logprobs=2) for p in prompts]]
    for d, s in zip(done, solo):
        assert d.prompt_token_ids == s.prompt_token_ids and d.token_ids == s.token_ids
        for x, y in zip(d.logprobs, s.logprobs, strict=True):
            assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4
