"""Image rows compose with the engine's other per-row features (issue 46, item 3): a LoRA
adapter on the text model, output constraints (a grammar), and batching beside text rows
on other adapters. Oracle: the reference loop (`reference_generate`, one row, plain
prefill and decode steps: itself checked against mlx-vlm and transformers' masks in
tests/models/test_vision_engine.py) with the same adapter / constraint.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.engine.generate import reference_generate
from fx_engine.testing.vision import write_tiny_gemma3_vlm


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 40, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _messages(seed: int, text: str = "what is in the picture") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": _png(seed)}]}]


def _write_adapter(folder: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """An mlx-lm LoRA adapter on the MLP of every layer, under the multimodal checkpoint's
    names (`language_model.model.layers.N.mlp.*`, as mlx-lm's lora on a Gemma 3 folder
    saves it), random non-zero factors."""
    text = json.loads((folder / "config.json").read_text())["text_config"]
    hid, inter = text["hidden_size"], text["intermediate_size"]
    key = mx.random.key(seed)
    tensors = {}
    for i in range(text["num_hidden_layers"]):
        for name, (fan_in, fan_out) in {"down_proj": (inter, hid), "up_proj": (hid, inter)}.items():
            key, ka, kb = mx.random.split(key, 3)
            base = f"language_model.model.layers.{i}.mlp.{name}"
            tensors[base + ".lora_a"] = 0.3 * mx.random.normal((fan_in, rank), key=ka)
            tensors[base + ".lora_b"] = 0.3 * mx.random.normal((rank, fan_out), key=kb)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), tensors)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": text["num_hidden_layers"],
        "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0, "keys": ["mlp.down_proj", "mlp.up_proj"]}}))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-compose")
    folder = write_tiny_gemma3_vlm(root / "m")
    m = fx_engine.load(str(folder))
    for i in range(2):
        fx_engine.load_adapter(m, _write_adapter(folder, root / f"a{i}", seed=i), name=f"a{i}")
    return m


def _lps(out) -> list:
    """Each step's chosen and top alternatives' log-probabilities (the tiny model is nearly
    certain of its chosen tokens: the alternatives show the distribution)."""
    return [(x.logprob, tuple(t[2] for t in x.top)) for x in out.logprobs]


def _same(a, b, tol: float = 1e-4):
    """Same tokens and alternatives, log-probabilities within `tol` (summation order: a
    batch's prefill calls hold other rows; tests/models/test_vision_engine.py's rule)."""
    assert list(a.token_ids) == list(b.token_ids)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert [t[0] for t in x.top] == [t[0] for t in y.top]
        assert max(abs(p - q) for p, q in zip(_lps_of(x), _lps_of(y))) <= tol


def _lps_of(step) -> list[float]:
    return [step.logprob, *(t[2] for t in step.top)]


def test_an_image_row_on_an_adapter_is_the_reference_loop_on_it(model):
    kw = dict(max_tokens=6, temperature=1.0, logprobs=2)
    msgs = _messages(1)
    on = reference_generate(model, msgs, adapter="a0", seed=3, **kw)
    base = reference_generate(model, msgs, seed=3, **kw)
    assert _lps(on) != _lps(base)  # the adapter acts
    _same(fx_engine.generate(model, msgs, adapter="a0", seed=3, **kw), on)


def test_image_and_text_rows_on_different_adapters_batch_as_alone(model):
    kw = dict(max_tokens=6, temperature=1.0, logprobs=2)
    jobs = [(_messages(2), "a0"), ([{"role": "user", "content": "tell me a story"}], "a1"),
            (_messages(3, "and this one"), None), (_messages(2), "a1")]
    alone = [reference_generate(model, p, adapter=a, seed=i, prefill_chunk=32, **kw) for i, (p, a) in enumerate(jobs)]
    with fx_engine.Engine(model, max_rows=4, prefill_chunk=32, prefix_cache_bytes=0) as engine:
        handles = [engine.submit(p, adapter=a, seed=i, **kw) for i, (p, a) in enumerate(jobs)]
        got = [h.result() for h in handles]
    for g, a in zip(got, alone):
        _same(g, a)


def test_an_image_row_keeps_its_grammar(model):
    msgs = _messages(4)
    pattern = "[a-z]{2,5}( [a-z]{2,5}){0,2}"
    out = fx_engine.generate(model, msgs, max_tokens=24, regex=pattern, temperature=1.0, seed=5)
    assert re.fullmatch(pattern, out.text), out.text
    ref = reference_generate(model, msgs, max_tokens=24, regex=pattern, temperature=1.0, seed=5)
    assert out.text == ref.text and list(out.token_ids) == list(ref.token_ids)
    pick = fx_engine.generate(model, msgs, max_tokens=8, choice=["a cat", "a dog", "a bird"], temperature=1.0, seed=6)
    assert pick.text in ("a cat", "a dog", "a bird") and pick.finish_reason == "stop", pick


def test_prefix_cache_reuses_per_image(model):
    """Entries are keyed per image (image_prompt.prefix_key): a follow-up turn that adds a
    second picture reuses the first turn's KV through its picture; a prompt whose first
    picture differs reuses nothing past the text before it; the outputs are the reference
    loop's."""
    from fx_engine.engine.image_prompt import image_prompt, prefix_key

    first = _messages(20, "describe this picture in some detail please")
    with fx_engine.Engine(model, max_rows=2, prefill_chunk=32) as engine:
        a = engine.submit(first, max_tokens=4).result()
        turn = first + [{"role": "assistant", "content": a.text},
                        {"role": "user", "content": [{"type": "text", "text": "and this one?"},
                                                     {"type": "image", "image": _png(21)}]}]
        b = engine.submit(turn, max_tokens=4, logprobs=2).result()
        swapped = _messages(22, "describe this picture in some detail please") + turn[1:]
        c = engine.submit(swapped, max_tokens=4, logprobs=2).result()
    first_image_end = image_prompt(model, turn).spans[0][1]
    assert b.usage.cached_tokens >= first_image_end  # through the first picture (and the reply)
    assert c.usage.cached_tokens <= image_prompt(model, swapped).spans[0][0]
    _same(b, reference_generate(model, turn, max_tokens=4, logprobs=2, prefill_chunk=32))
    _same(c, reference_generate(model, swapped, max_tokens=4, logprobs=2, prefill_chunk=32))
    # the keys themselves: text ids kept, image tokens content-derived and negative
    ip = image_prompt(model, turn)
    key = prefix_key(ip, ip.ids)
    inside = {p for s, e in ip.spans for p in range(s, e)}
    assert all(k == i for p, (k, i) in enumerate(zip(key, ip.ids)) if p not in inside)
    assert all(key[p] < 0 for p in inside)
    assert key[ip.spans[0][0]] != key[ip.spans[1][0]]  # two pictures, two keys


def test_image_rows_draft_with_prompt_lookup_and_draft_models(model):
    """Speculation composes with images: prompt lookup and a draft model (here the model's
    own text path, fed the image tokens as tokens) draft an image row; the greedy output is
    plain decoding's. (EAGLE-3 heads on image rows: tests/engine/test_drafters_with_images.py;
    "mtp" on a checkpoint without MTP modules is refused as for text.)"""
    msgs = _messages(30, "repeat after me: red green blue red green blue red green")
    plain = fx_engine.generate(model, msgs, max_tokens=12, logprobs=2)
    for kw in ({"prompt_lookup": True, "num_draft_tokens": 3}, {"draft_model": model, "num_draft_tokens": 2}):
        out = fx_engine.generate(model, msgs, max_tokens=12, logprobs=2, **kw)
        _same(out, plain)
        assert out.usage.draft_rounds > 0, kw  # it did draft
    with pytest.raises(ValueError, match="ships no MTP module"):
        fx_engine.generate(model, msgs, max_tokens=2, draft_model="mtp")
