"""Scoring prompts with images (issue 46): `prompt_logprobs` and `max_tokens=0` on chat
messages with images, through the Engine's score calls (score_step with the image rows).

Oracles: mlx-vlm 0.7.10's whole forward (Idefics3, Qwen2.5-VL: same random weights, the
processor's pixels) for every prompt position's log-softmax; for Gemma 3 (whose image
tokens see the whole image) the model's own `logits_step` over the whole prompt, itself
checked against mlx-vlm in tests/models/test_vision_gemma3.py. Prefill pieces smaller than
the prompt cut the causal families' images, so the chunked score path is what is checked.
Tolerance: float32 logits of magnitude ~1 from identical weights, 2e-4.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.steps import logits_step
from fx_engine.engine.engine import Engine
from fx_engine.engine.image_prompt import image_prompt
from fx_engine.testing.vision import write_tiny_gemma3_vlm, write_tiny_idefics3, write_tiny_qwen2_vl
from tests.models.vision_checks import load_mlx_vlm, messages, png, qwen_pixels, two_images, whole_images

TOL = 2e-4


def _log_softmax(logits: mx.array) -> np.ndarray:
    lg = logits.astype(mx.float32)
    return np.asarray(lg - mx.logsumexp(lg, axis=-1, keepdims=True))


def _check(scored, ids: list[int], lsm: np.ndarray, n_top: int) -> None:
    """Completion.prompt_logprobs against the oracle's log-softmax rows [len(ids), V]:
    position i's row predicts ids[i + 1]; the first token has no record."""
    recs = scored.prompt_logprobs
    assert recs is not None and len(recs) == len(ids) and recs[0] is None
    worst = 0.0
    for i, rec in enumerate(recs[1:]):
        row = lsm[i]
        assert rec.token_id == ids[i + 1]
        worst = max(worst, abs(rec.logprob - float(row[ids[i + 1]])))
        want_top = np.argsort(-row, kind="stable")[:n_top]
        assert [t[0] for t in rec.top] == want_top.tolist(), i
        worst = max(worst, max(abs(t[2] - float(row[t[0]])) for t in rec.top))
    assert worst <= TOL, f"max |diff| = {worst}"


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    path = write_tiny_idefics3(tmp_path_factory.mktemp("score-idefics3") / "m")
    return path, fx_engine.load(str(path))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_tiny_qwen2_vl(tmp_path_factory.mktemp("score-qwen") / "m")
    return path, fx_engine.load(str(path))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = write_tiny_gemma3_vlm(tmp_path_factory.mktemp("score-gemma3") / "m")
    return path, fx_engine.load(str(path))


@pytest.mark.oracle
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_idefics3_prompt_logprobs_match_mlx_vlm(idefics3, max_tokens):
    import PIL.Image

    from fx_engine.loading.images import idefics3_tiles
    from fx_engine.testing.vision import IDEFICS3_VISION

    path, model = idefics3
    pngs = [png(4, (48, 40)), png(5, (70, 30))]
    msgs = messages(*pngs)
    ip = image_prompt(model, msgs)
    ref = load_mlx_vlm(path)
    ref.vision_model.post_layernorm.eps = IDEFICS3_VISION["layer_norm_eps"]
    tiles = np.concatenate([idefics3_tiles(PIL.Image.open(io.BytesIO(p)), model.image_processor)[0] for p in pngs])
    lsm = _log_softmax(ref(mx.array([ip.ids], mx.int32), mx.array(tiles)[None]).logits[0])
    # 10-token pieces: every tile's run of image tokens is cut across score calls
    assert min(b - a for a, b in ip.spans) > 10
    scored = fx_engine.generate(model, msgs, prompt_logprobs=3, max_tokens=max_tokens, prefill_chunk=10,
                                temperature=0)
    assert list(scored.prompt_token_ids) == ip.ids
    _check(scored, ip.ids, lsm, 3)
    if max_tokens == 0:
        assert scored.token_ids == () and scored.finish_reason == "length"
        assert scored.usage.prompt_tokens == len(ip.ids) and scored.usage.completion_tokens == 0
    else:  # scoring does not change what is generated
        plain = fx_engine.generate(model, msgs, max_tokens=max_tokens, temperature=0)
        assert scored.token_ids == plain.token_ids and scored.prompt_logprobs is not None


@pytest.mark.oracle
def test_qwen2_5_vl_prompt_logprobs_match_mlx_vlm(qwen):
    """M-RoPE positions through the score calls (the prompt's ids stored shifted by its rope
    delta, pieces starting inside an image)."""
    path, model = qwen
    msgs = two_images()
    ip = image_prompt(model, msgs)
    patches, grid = qwen_pixels(model, msgs)
    lsm = _log_softmax(load_mlx_vlm(path)(mx.array([ip.ids], mx.int32), patches, image_grid_thw=grid).logits[0])
    for chunk in (16, 512):
        scored = fx_engine.generate(model, msgs, prompt_logprobs=2, max_tokens=0, prefill_chunk=chunk)
        _check(scored, ip.ids, lsm, 2)


def test_gemma3_prompt_logprobs_match_the_whole_prompt_step(gemma3):
    """Gemma 3's images stay whole in every piece (bidirectional within an image); the text
    around them is cut at the piece size."""
    _, model = gemma3
    msgs = messages(png(6, (40, 40)), text="describe the picture in a few words please")
    ip = image_prompt(model, msgs)
    run = max(b - a for a, b in ip.spans)
    img = whole_images(ip, model)
    got, _ = logits_step(model.params, model.new_cache(1, 512, headroom=256), mx.array([ip.ids], mx.int32),
                         len(ip.ids), images=img)
    lsm = _log_softmax(got[0])
    for chunk in (run + 4, 512):
        scored = fx_engine.generate(model, msgs, prompt_logprobs=2, max_tokens=0, prefill_chunk=chunk)
        _check(scored, ip.ids, lsm, 2)


def test_scoring_image_rows_batch_with_text_rows_and_fill_the_prefix_cache(idefics3):
    """An Engine scoring an image prompt beside a text request and a generating image
    request: each equals its solo run; the scored prompt's KV is kept, so a follow-up turn
    on the same image starts from it."""
    _, model = idefics3
    first = messages(png(8, (48, 40)), text="remember this picture")
    text = [{"role": "user", "content": "a plain text request"}]
    other = messages(png(9, (30, 60)))
    solo = [fx_engine.generate(model, first, prompt_logprobs=1, max_tokens=0, prefill_chunk=32),
            fx_engine.generate(model, text, prompt_logprobs=1, max_tokens=2, prefill_chunk=32, temperature=0),
            fx_engine.generate(model, other, max_tokens=3, prefill_chunk=32, temperature=0)]
    with Engine(model, max_rows=3, prefill_chunk=32, step_token_budget=64) as engine:
        hs = [engine.submit(first, prompt_logprobs=1, max_tokens=0),
              engine.submit(text, prompt_logprobs=1, max_tokens=2, temperature=0),
              engine.submit(other, max_tokens=3, temperature=0)]
        done = [h.result() for h in hs]
        turn = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "what was it?"}]
        follow = engine.submit(turn, max_tokens=2, temperature=0).result()
    for d, s in zip(done, solo):
        assert d.token_ids == s.token_ids
        if s.prompt_logprobs is None:
            assert d.prompt_logprobs is None
            continue
        assert len(d.prompt_logprobs) == len(s.prompt_logprobs)
        for x, y in zip(d.prompt_logprobs[1:], s.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4
    assert follow.usage.cached_tokens >= len(done[0].prompt_token_ids) - 1
    want = fx_engine.generate(model, turn, max_tokens=2, temperature=0)
    assert follow.token_ids == want.token_ids


def test_the_reference_loop_still_refuses_scoring_images(idefics3):
    from fx_engine.engine.generate import reference_generate

    _, model = idefics3
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with images"):
        reference_generate(model, messages(png(1, (48, 40))), prompt_logprobs=1)
