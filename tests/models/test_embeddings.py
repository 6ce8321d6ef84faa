"""Embeddings: pooled final hidden states as the checkpoint declares them, batched, through
`fx_engine.embed` and `/v1/embeddings` (the official `openai` client).

Oracle: mlx-lm's model on the same folder (`model.model(inputs)`: its final-norm hidden
states), pooled and normalized here with numpy."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.engine.embeddings import embed, pooling_of
from fx_engine.server.app import create_app

from tests.conftest import serve

pytestmark = pytest.mark.oracle


def _st_folder(src: Path, dst: Path, mode: str | None, normalize: bool) -> Path:
    """A copy of a model folder with sentence-transformers' pooling files."""
    shutil.copytree(src, dst)
    if mode is None:
        return dst
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize",
                     "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(mods))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "last"}))
    return dst


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return tiny_folder()


def _oracle(folder: Path, inputs, mode: str, normalize: bool) -> np.ndarray:
    from mlx_lm.utils import load_model

    ref, _ = load_model(folder)
    out = []
    for ids in inputs:
        h = np.array(ref.model(mx.array([ids]))[0].astype(mx.float32), np.float64)
        v = {"last": h[-1], "mean": h.mean(axis=0), "cls": h[0]}[mode]
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.array(out)


@pytest.mark.parametrize("mode,normalize", [("last", True), ("mean", True), ("cls", False),
                                            (None, True)])
def test_pooling_as_declared_matches_mlx_lm(tiny, tmp_path, mode, normalize):
    folder = _st_folder(tiny, tmp_path / "st", mode, normalize)
    model = fx_engine.load(folder)
    assert pooling_of(model) == (mode or "last", normalize)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(3, 200, size=n).tolist() for n in (1, 7, 40, 700, 13)]
    got = fx_engine.embed(model, inputs)  # one batch; 700 tokens: two chunks
    want = _oracle(folder, inputs, mode or "last", normalize)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    solo = np.concatenate([embed(model, [i]) for i in inputs])
    np.testing.assert_allclose(got, solo, rtol=1e-5, atol=1e-5)  # batched = alone


def test_gguf_pooling_type_is_read(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "e.gguf"), "llama")
    w.add_uint32("llama.pooling_type", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    class M:
        path = str(tmp_path / "e.gguf")

    assert pooling_of(M()) == ("mean", True)


@pytest.mark.server
def test_embeddings_endpoint_with_the_openai_client(tiny):
    from openai import OpenAI

    model = fx_engine.load(tiny)
    engine = fx_engine.Engine(model, max_rows=2)
    app = create_app(engine, "tiny")
    texts = ["hello world", "the quick brown fox", "a"]
    want = fx_engine.embed(model, texts)
    with serve(app, engine) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.embeddings.create(model="tiny", input=texts)
        got = np.array([d.embedding for d in r.data])
        assert [d.index for d in r.data] == [0, 1, 2]
        assert r.usage.prompt_tokens == sum(len(model.tokenizer.encode(t)) for t in texts)
        r = client.embeddings.create(model="tiny", input=model.tokenizer.encode(texts[1]),
                                     encoding_format="base64")
        b64 = np.frombuffer(base64.b64decode(r.data[0].embedding), "<f4") if isinstance(
            r.data[0].embedding, str) else np.array(r.data[0].embedding)
        import httpx

        bad = httpx.post(url + "/v1/embeddings", json={"input": ["x", ""]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        bad = httpx.post(url + "/v1/embeddings", json={"input": "x", "dimensions": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"
        # generation keeps running beside embedding calls
        h = engine.submit("hello", max_tokens=4)
        assert client.embeddings.create(model="tiny", input="a").data
        assert h.result().finish_reason in ("stop", "length")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b64, want[1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ chunked on the engine


def test_chunked_embedding_equals_one_shot(tiny):
    """embed_steps cut into small calls through the KV cache (here 32 tokens a call) gives
    the vectors of the one-shot forward (`embed`: every input in one 512-token call)."""
    from fx_engine.engine.embeddings import embed_steps
    from fx_engine.engine.jobs import run_steps

    model = fx_engine.load(tiny)
    rng = np.random.default_rng(1)
    inputs = [rng.integers(3, 200, size=n).tolist() for n in (300, 5, 130, 64)]
    for pooling in ("last", "mean", "cls"):
        whole = embed(model, inputs, pooling=pooling, normalize=False)
        steps = embed_steps(model, inputs, pooling=pooling, normalize=False, step_tokens=32)
        calls = []

        def counted():
            while True:
                try:
                    calls.append(next(steps))
                except StopIteration as stop:
                    return stop.value
        chunked = counted()
        assert max(calls) <= 32 and len(calls) >= 300 // 32  # really cut small
        np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    assert run_steps(embed_steps(model, inputs[:1], step_tokens=16)).shape == (1, 64)
    with pytest.raises(ValueError, match="step_tokens"):
        embed_steps(model, inputs, step_tokens=8)
    with pytest.raises(ValueError, match=r"input\[1\]"):
        embed_steps(model, [[5], []])  # validated at once, not at the first step


def _job_steps(engine) -> int:
    return sum(e["kind"] == "job_step" for e in engine.trace_events)


def test_embedding_job_interleaves_with_generation_and_cancels(tiny):
    """A long embedding job on a started engine runs one bounded call per step: a chat
    submitted after it finishes while it is still running, and a cancelled job stops
    taking steps (the engine goes idle)."""
    from fx_engine.engine.embeddings import embed_steps

    model = fx_engine.load(tiny)
    rng = np.random.default_rng(2)
    long = [rng.integers(3, 200, size=1000).tolist() for _ in range(4)]
    with fx_engine.Engine(model, max_rows=2, prefill_chunk=16) as engine:  # 16-token calls
        job = engine.call_steps(embed_steps(model, long, step_tokens=engine.step_token_budget))
        chat = engine.submit("hello there", max_tokens=8)
        assert chat.result(timeout=120).finish_reason in ("stop", "length")
        assert not job.done()  # needs ~250 steps; the chat needed ~10
        kinds = [e["kind"] for e in engine.trace_events]
        assert "decode" in kinds[kinds.index("job_step"):]  # decode steps between its calls
        assert job.cancel()
        deadline = time.monotonic() + 60
        while engine.stats()["jobs"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["jobs"] == 0 and not engine.has_work()
        ran = _job_steps(engine)
        time.sleep(0.3)
        assert _job_steps(engine) == ran < 4 * 1000 // 16  # stopped before the end
        assert any(e["kind"] == "job_cancelled" for e in engine.trace_events)
        # a job that runs to its end gives what embed gives
        done = engine.call_steps(embed_steps(model, long[:2], step_tokens=engine.step_token_budget))
        np.testing.assert_allclose(done.result(timeout=120), embed(model, long[:2]),
                                   rtol=1e-5, atol=1e-5)
