"""Gemma 3 images through the text model (issue 46): the image rows spliced into a prefill
step after the embedding scale, the image-token attention rule of Hugging Face (during
prefill a token of an image sees every token of its image; text, boi/eoi and decode steps
stay causal; sliding layers keep the window on the query's own position), chunk planning
that never cuts an image, loading the image path with the model, and
`fx_engine.generate(model, messages_with_images)`.

Oracles: mlx-vlm 0.7.10's Gemma 3 (get_input_embeddings, then its language model on the
embeddings) runs image tokens causally: it checks `ImageInput(bidirectional=False)`. The
bidirectional rule is checked against mlx-vlm's own decoder layers driven with
transformers' masks per layer (`prompt_attention_mask`: full layers causal OR same image,
sliding ones AND the window), a plain-MLX reference of Hugging Face's composition.
Tolerance as tests/models/test_vision_gemma3.py: float32 on both sides, ~1e-5 measured.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.cache import span_bucket
from fx_engine.core.steps import logits_step, prefill_step_compiled
from fx_engine.core.vision import gemma3
from fx_engine.core.vision.gemma3 import ImageInput
from fx_engine.engine.image_prompt import image_prompt
from fx_engine.loading.vision import load_vision
from fx_engine.testing.vision import TINY_IDS, write_tiny_gemma3_vlm

TOL = 2e-4
IMG, BOI, EOI = TINY_IDS["image_token_index"], TINY_IDS["boi_token_index"], TINY_IDS["eoi_token_index"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm") / "m")


@pytest.fixture(scope="module")
def model(folder):
    return fx_engine.load(str(folder))


def _pixels(n: int, seed: int = 3) -> mx.array:
    return mx.random.uniform(-1, 1, (n, 3, 32, 32), key=mx.random.key(seed))


def _prompt(mm: int, images: int = 2) -> list[int]:
    run = [BOI] + [IMG] * mm + [EOI]
    out = [1, 5, 6]
    for i in range(images):
        out += run + [7 + i, 8, 9]
    return out


def _ours(model, ids, rows, bidirectional=True, chunks=None):
    """Logits at every position of `ids` (one row), prefilled in `chunks` (lengths)."""
    cache = model.new_cache(1, 256, headroom=128)
    out, pos, start = [], 0, 0
    for n in chunks or [len(ids)]:
        piece = ids[pos:pos + n]
        img = ImageInput(rows=rows, start=mx.array([start], mx.int32), token_index=IMG,
                         bidirectional=bidirectional)
        lg, cache = logits_step(model.params, cache, mx.array([piece], mx.int32), n, images=img)
        out.append(lg[0])
        pos += n
        start += piece.count(IMG)
    return mx.concatenate(out, axis=0)


def _mlx_vlm(folder):
    from mlx_vlm.utils import load_model

    return load_model(Path(folder))


def _close(a, b, tol=TOL) -> float:
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    assert diff <= tol, f"max |diff| = {diff}"
    return diff


# ---------------------------------------------------------------- the text forward with images


@pytest.mark.oracle
def test_causal_variant_matches_mlx_vlm(folder, model):
    ref = _mlx_vlm(folder)
    vis = load_vision(folder)
    ids = _prompt(vis.config.mm_tokens_per_image)
    pix = _pixels(2)
    emb = ref.get_input_embeddings(mx.array([ids]), pix, mask=mx.ones((1, len(ids)))).inputs_embeds
    want = ref.language_model(mx.array([ids]), inputs_embeds=emb).logits[0]
    rows = gemma3.encode_images(vis, pix)
    _close(_ours(model, ids, rows, bidirectional=False), want)


def _reference_bidirectional(ref, folder, ids, pix):
    """mlx-vlm's decoder layers with transformers' per-layer masks (no cache)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())["text_config"]
    emb = ref.get_input_embeddings(mx.array([ids]), pix, mask=mx.ones((1, len(ids)))).inputs_embeds
    lm = ref.language_model.model
    h = emb * mx.array(cfg["hidden_size"] ** 0.5, mx.bfloat16).astype(emb.dtype)
    tokens = mx.array([ids])
    full = gemma3.prompt_attention_mask(tokens, IMG)
    sliding = gemma3.prompt_attention_mask(tokens, IMG, cfg["sliding_window"])
    pattern = cfg["sliding_window_pattern"]
    for i, layer in enumerate(lm.layers):
        h = layer(h, full if i % pattern == pattern - 1 else sliding, None)
    return ref.language_model.lm_head(lm.norm(h))[0]


@pytest.mark.oracle
@pytest.mark.parametrize("chunks", [None, [24, 40]], ids=["one-chunk", "two-chunks"])
def test_bidirectional_images_match_transformers_rule(folder, model, chunks):
    """Two images; prompt (50 tokens) past the 16-token window; whole or in two chunks that
    each hold whole images."""
    ref = _mlx_vlm(folder)
    vis = load_vision(folder)
    ids = _prompt(vis.config.mm_tokens_per_image)
    pix = _pixels(2, seed=11)
    want = _reference_bidirectional(ref, folder, ids, pix)
    rows = gemma3.encode_images(vis, pix)
    if chunks:
        chunks = [chunks[0], len(ids) - chunks[0]]
        spans = gemma3.image_token_runs(ids, vis.config)
        assert all(not a < chunks[0] < b for a, b in spans)
    got = _ours(model, ids, rows, chunks=chunks)
    _close(got, want)
    # and the rule matters: the causal variant differs at the image tokens
    causal = _ours(model, ids, rows, bidirectional=False)
    assert mx.abs(causal - want).max().item() > 1e-3


def test_without_images_the_step_is_unchanged(model):
    ids = [1, 5, 6, 7, 8, 9, 10, 11]
    cache = model.new_cache(1, 64)
    a, _ = logits_step(model.params, cache, mx.array([ids], mx.int32), len(ids))
    rows = mx.zeros((16, model.config.hidden_size))
    img = ImageInput(rows=rows, start=mx.array([0], mx.int32), token_index=IMG)
    b, _ = logits_step(model.params, model.new_cache(1, 64), mx.array([ids], mx.int32), len(ids), images=img)
    assert mx.array_equal(a, b).item()  # no image tokens: same logits


def test_prefill_compiled_with_images_batch_equals_solo(model):
    """Two rows, one with an image, one without (and padding), in one compiled step: each
    row's logits equal its solo run."""
    vis = load_vision(Path(model.path))
    rows = gemma3.encode_images(vis, _pixels(1, seed=5))
    a = _prompt(16, 1)
    b = [1, 9, 8, 7, 6, 5, 4]
    size = 32
    start = mx.array([0, 0], mx.int32)

    def run(prompts):
        cache = model.new_cache(len(prompts), 64, headroom=size)
        toks = mx.array([p + [0] * (size - len(p)) for p in prompts], mx.int32)
        img = ImageInput(rows=rows.reshape(-1, rows.shape[-1]), start=start[:len(prompts)], token_index=IMG)
        lg, _ = prefill_step_compiled(model.params, cache, toks, mx.array([len(p) for p in prompts], mx.int32),
                                      span=span_bucket(size, 64), images=img)
        return lg

    both = run([a, b])
    _close(both[0], run([a])[0], 1e-5)
    _close(both[1], run([b])[0], 1e-5)


def test_images_refused_by_other_families(tmp_path):
    from fx_engine.testing.tiny import write_tiny_model

    # (the Llama family takes image rows since Idefics3 / SmolVLM: tests/models/test_vision_idefics3.py)
    m = fx_engine.load(str(write_tiny_model(tmp_path / "phi3", "phi3")))
    img = ImageInput(rows=mx.zeros((4, m.config.hidden_size)), start=mx.array([0], mx.int32), token_index=3)
    with pytest.raises(ValueError, match="take no image rows"):
        logits_step(m.params, m.new_cache(1, 16), mx.array([[1, 2]], mx.int32), 2, images=img)


# ---------------------------------------------------------------- chunk planning


def test_prefill_pieces_never_cut_a_span():
    from fx_engine.core.buckets import max_piece, prefill_pieces

    assert prefill_pieces(0, 100, 32, ()) == prefill_pieces(0, 100, 32)
    spans = [(10, 50), (60, 70)]
    pieces = prefill_pieces(0, 100, 32, spans)
    ends = [p + n for p, n, _ in pieces]
    assert all(not a < e < b for e in ends for a, b in spans)
    assert pieces[0] == (0, 10, 16) and pieces[1] == (10, 40, 64)  # a span longer than the chunk: whole
    assert sum(n for _, n, _ in pieces) == 100 and max_piece(pieces) == 64
    with pytest.raises(ValueError, match="inside the span"):
        prefill_pieces(20, 100, 32, spans)


# ---------------------------------------------------------------- loading


def test_load_keeps_the_image_path(model, tmp_path):
    from fx_engine.testing.tiny import write_tiny_model

    assert model.vision is not None and model.vision.config.mm_tokens_per_image == 16
    assert (model.image_processor.height, model.image_processor.width) == (32, 32)
    text_only = fx_engine.load(str(write_tiny_model(tmp_path / "g", "gemma3_text")))
    assert text_only.vision is None and text_only.image_processor is None


# ---------------------------------------------------------------- the Python API


def _png(seed: int, size=(40, 28)) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _messages(*images, text="what is in the picture"):
    content = [{"type": "text", "text": text}]
    for im in images:
        if isinstance(im, bytes):
            im = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(im).decode()}}
        content.append(im)
    return [{"role": "user", "content": content}]


def test_image_prompt_layout(model):
    from fx_engine.engine.image_prompt import image_prompt

    ip = image_prompt(model, _messages(_png(1), {"type": "image", "image": _png(2)}))
    assert len(ip.spans) == 2 and ip.rows.shape == (32, model.config.hidden_size)
    for a, b in ip.spans:
        assert ip.ids[a - 1] == BOI and ip.ids[b] == EOI and set(ip.ids[a:b]) == {IMG}
    # the same image (as a data URL or as bytes): the same digest, the same rows
    assert ip.digests[0] != ip.digests[1]
    again = image_prompt(model, _messages({"type": "image", "image": _png(1)}))
    assert again.digests[0] == ip.digests[0]
    _close(again.rows, ip.rows[:16], 0)


def _greedy_reference(model, folder, messages, n):
    """Greedy decoding with mlx-vlm's layers under transformers' masks, no cache (each
    step the whole sequence): the independent run."""
    from fx_engine.engine.image_prompt import image_prompt, split_messages
    from fx_engine.loading.images import preprocess

    ref = _mlx_vlm(folder)
    ip = image_prompt(model, messages)
    _, images = split_messages(messages)
    pix = mx.array(preprocess(images, model.image_processor))
    ids, out, first = list(ip.ids), [], None
    for _ in range(n):
        logits = _reference_bidirectional(ref, folder, ids, pix)[-1].astype(mx.float32)
        if first is None:
            first = logits - mx.logsumexp(logits)
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        if tok in model.eos_ids:
            break
        ids.append(tok)
    return ip.ids, out, first


@pytest.mark.oracle
def test_generate_with_an_image_equals_solo_and_reference(folder, model):
    msgs = _messages(_png(3), {"type": "image", "image": _png(4)})
    from fx_engine.engine.generate import reference_generate

    done = fx_engine.generate(model, msgs, max_tokens=8, logprobs=3)  # the Engine, one row
    prompt, want, first = _greedy_reference(model, folder, msgs, 8)
    assert list(done.prompt_token_ids) == prompt
    assert list(done.token_ids) == want[:len(done.token_ids)] and len(done.token_ids) == len(want)
    top = done.logprobs[0].top  # the first token's alternatives against the reference's
    _close(mx.array([t[2] for t in top]), first[mx.array([t[0] for t in top])], 1e-3)
    # the reference loop, in 16-token chunks (each 16-token image whole in its own piece)
    _same_logprobs(reference_generate(model, msgs, max_tokens=8, logprobs=3, prefill_chunk=16), done)
    streamed = list(fx_engine.stream(model, msgs, max_tokens=8))
    assert [t for d in streamed for t in d.token_ids] == list(done.token_ids)


def test_image_errors(model, tmp_path):
    from fx_engine.loading.images import ImageError
    from fx_engine.testing.tiny import write_tiny_model

    text_only = fx_engine.load(str(write_tiny_model(tmp_path / "g", "gemma3_text")))
    with pytest.raises(ImageError, match="no vision tower"):
        fx_engine.generate(text_only, _messages(_png(1)), max_tokens=2)
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@notbase64"}}
    with pytest.raises(ImageError, match="invalid base64"):
        fx_engine.generate(model, _messages(bad), max_tokens=2)
    pdf = {"type": "image_url", "image_url": {"url": "data:application/pdf;base64,AAAA"}}
    with pytest.raises(ImageError, match="unsupported media type"):
        fx_engine.generate(model, _messages(pdf), max_tokens=2)
    garbage = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"xyz").decode()}}
    with pytest.raises(ImageError, match="not a readable image"):
        fx_engine.generate(model, _messages(garbage), max_tokens=2)
    with pytest.raises(ImageError, match="only data URLs"):
        fx_engine.generate(model, _messages({"type": "image_url", "image_url": {"url": "https://x/y.png"}}),
                           max_tokens=2)
    with pytest.raises(ImageError, match="more than 16 images"):
        fx_engine.generate(model, _messages(*[_png(1)] * 17), max_tokens=2)
    big = {"type": "image", "image": np.zeros((9000, 8000, 3), np.uint8)}
    with pytest.raises(ImageError, match="pixels is more than"):
        fx_engine.generate(model, _messages(big), max_tokens=2)


def test_token_ids_cannot_carry_images(model):
    from fx_engine.engine.request import prompt_ids

    with pytest.raises(ValueError, match="token ids cannot carry them"):
        prompt_ids(model, _messages(_png(1)))


# ---------------------------------------------------------------- the Engine


def _text(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _same_logprobs(a, b, tol=1e-3) -> None:
    """Same tokens and top-3 alternatives, log-probabilities within `tol` (the tiny model's
    greedy text is one repeated token: the alternatives' values carry the image)."""
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert [t[0] for t in x.top] == [t[0] for t in y.top]
        assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= tol


def test_engine_batches_image_rows_with_text_rows(model):
    """Image requests (one and two images, different pictures) and text requests submitted
    together, under a step budget that cuts prefill pieces: each equals its solo run on the
    reference loop (chunks holding whole images)."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.generate import reference_generate

    prompts = [_messages(_png(5)), _text("a plain text request with a few words"),
               _messages(_png(6), {"type": "image", "image": _png(7)}, text="two of them"),
               _text("another one")]
    solo = [reference_generate(model, p, max_tokens=6, prefill_chunk=32, logprobs=3) for p in prompts]
    for budget in (48, 128):  # 128: image rows and text rows in the same prefill calls
        with Engine(model, max_rows=4, prefill_chunk=32, step_token_budget=budget, prefix_cache_bytes=0) as engine:
            handles = [engine.submit(p, max_tokens=6, logprobs=3) for p in prompts]
            done = [h.result() for h in handles]
            calls = [e for e in engine.trace_events if e.get("kind") == "prefill"]
        for d, s in zip(done, solo):
            assert d.prompt_token_ids == s.prompt_token_ids
            _same_logprobs(d, s)
        image_rows = {0, 2}
        assert all(not a < e["start"] + e["tokens"] < b for e in calls if e["request"] in image_rows
                   for a, b in image_prompt(model, prompts[e["request"]]).spans)
    assert any(e["rows"] > 1 and e["request"] in image_rows and e["start"] == 0 for e in calls)


def test_engine_prefix_cache_keys_images_by_content(model):
    from fx_engine.engine.engine import Engine

    first = _messages(_png(8), text="describe this picture in some detail please")
    with Engine(model, max_rows=2, prefill_chunk=32) as engine:
        a = engine.submit(first, max_tokens=4).result()
        turn = first + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "and more?"}]
        b = engine.submit(turn, max_tokens=4, logprobs=3).result()
        other = _messages(_png(9), text="describe this picture in some detail please")
        c = engine.submit(other, max_tokens=4, logprobs=3).result()
        enc = engine.encoder_cache
    assert b.usage.cached_tokens > 30  # the first turn's prompt, image and all, reused
    # the same text with other pixels: at most the text before the image is reused
    assert c.usage.cached_tokens <= image_prompt(model, other).spans[0][0]
    assert (enc.hits, enc.misses, len(enc)) == (1, 2, 2)  # the follow-up's image was not re-encoded
    from fx_engine.engine.generate import reference_generate

    _same_logprobs(b, reference_generate(model, turn, max_tokens=4, logprobs=3))
    _same_logprobs(c, reference_generate(model, other, max_tokens=4, logprobs=3))


def test_engine_keeps_gemma3_images_whole(tmp_path):
    """Gemma 3's image tokens attend to each other, so an image's run is prefilled in one
    piece: an engine whose pieces are shorter refuses it (naming the fix), also for a
    prompt made by hand without the `whole` mark."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.image_prompt import image_prompt

    model = fx_engine.load(str(write_tiny_gemma3_vlm(tmp_path / "m", mm_tokens_per_image=64)))
    msgs = _messages(_png(1))
    ip = image_prompt(model, msgs)
    assert ip.whole and max(b - a for a, b in ip.spans) == 64
    with Engine(model, max_rows=1, prefill_chunk=32) as engine:
        for prompt in (msgs, ip._replace(whole=False)):
            with pytest.raises(ValueError, match="whole images"):
                engine.submit(prompt, max_tokens=2)


def test_encoder_cache_budget_and_identity(model):
    from fx_engine.engine.image_prompt import EncoderCache

    cache = EncoderCache(max_bytes=2 * 16 * model.config.hidden_size * 4)  # two images' rows
    first = image_prompt(model, _messages(_png(1), _png(2)), cache=cache)
    again = image_prompt(model, _messages(_png(2), _png(1)), cache=cache)  # both cached, other order
    assert (cache.hits, cache.misses) == (2, 2)
    _close(again.rows[:16], first.rows[16:], 0)
    _close(again.rows[16:], first.rows[:16], 0)
    image_prompt(model, _messages(_png(3)), cache=cache)  # evicts the least recently used
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.get(first.digests[1]) is None and cache.get(first.digests[0]) is not None


def test_a_prompt_rendered_elsewhere_enters_the_engine(model):
    """The server's seam: its own rendered text with one placeholder per image ->
    `image_prompt_from_text` -> `Engine.submit`: the same as the messages."""
    from fx_engine.engine.engine import Engine
    from fx_engine.engine.image_prompt import image_prompt_from_text

    msgs = _messages({"type": "image", "image": _png(4)}, text="hi")
    text = "<|im_start|>user\nhi<start_of_image><|im_end|>\n<|im_start|>assistant\n"
    with Engine(model, max_rows=1, prefill_chunk=32) as engine:
        ip = image_prompt_from_text(model, text, [_png(4)], cache=engine.encoder_cache)
        a = engine.submit(ip, max_tokens=3, logprobs=3).result()
        b = engine.submit(msgs, max_tokens=3, logprobs=3).result()
    assert a.prompt_token_ids == b.prompt_token_ids == tuple(ip.ids)
    _same_logprobs(a, b)
    with pytest.raises(Exception, match="placeholder"):
        image_prompt_from_text(model, text, [_png(4), _png(5)])
