"""Every registered model_type works with everything else (issue 23 item 3), on its tiny
example model: continuous batching with rows joining at different steps and a sampled row,
chunked prefill, the prefix cache, prompt-lookup speculation (verify with row-wise
rollback), the served OpenAI endpoint, `fx-engine trace`'s step graphs, and a steady state
without recompiles. Numerics against mlx-lm: every family in tests/models/test_parity.py's
test_family_against_mlx_lm (and each family's own variants in tests/models/)."""

import pytest

import fx_engine
from fx_engine.core.models import FAMILIES
from fx_engine.engine.generate import reference_generate
from fx_engine.tracing import Bucket, RecompileWatch, step_graphs

MODEL_TYPES = [mt for fam in FAMILIES for mt in fam.model_types]


@pytest.fixture(scope="module")
def folders(family_folders):
    return family_folders  # conftest: every model_type's tiny folder, shared with tests/models/test_parity.py


def _workload(engine, n=4):
    base = list(range(10, 200))
    hs = [engine.submit(base[i * 7 : i * 7 + 20 + 9 * i], max_tokens=6 + i,
                        **({"temperature": 0.8, "seed": i} if i % 2 else {})) for i in range(n)]
    while engine.step():
        pass
    return [h.result() for h in hs]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.slow
def test_family_runs_with_every_engine_feature(folders, model_type):
    model = fx_engine.load(folders[model_type])
    base = list(range(10, 200))
    prompts = [base[:33], base[5:12], base[:33] + [7, 8, 9]]  # the third shares a prefix
    refs = [reference_generate(model, p, max_tokens=12, temperature=0.0).token_ids for p in prompts]
    engine = fx_engine.Engine(model, max_rows=3, prefill_chunk=16)
    first = engine.submit(prompts[0], max_tokens=12)
    engine.step()  # the others join a running batch
    rest = [engine.submit(prompts[1], max_tokens=12, prompt_lookup=True),
            engine.submit(prompts[2], max_tokens=12)]
    outs = [h.result() for h in [first, *rest]]
    engine.close()
    assert [o.token_ids for o in outs] == refs
    assert outs[2].usage.cached_tokens > 0  # the shared prefix came from the prefix cache

    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=32, prefix_cache_bytes=0)
    with RecompileWatch() as w:
        _workload(engine)
        w.mark_warm()
        _workload(engine)
    engine.close()
    assert w.recompiles == [], [e["reason"] for e in w.recompiles]

    # a float16 KV cache: the engine's batch equals that model's own reference loop
    half = fx_engine.load(folders[model_type], kv_dtype="float16")
    want = [reference_generate(half, p, max_tokens=8, temperature=0.0).token_ids for p in prompts[:2]]
    with fx_engine.Engine(half, max_rows=2, prefill_chunk=16) as eng:
        assert [h.result().token_ids for h in [eng.submit(p, max_tokens=8) for p in prompts[:2]]] == want

    graphs = step_graphs(model, Bucket(rows=2, capacity=256, chunk=16, draft=3), steps=("decode_step",),
                         views=("traced",))
    assert graphs[("decode_step", "traced")].num_ops > 10


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "glm4"])
@pytest.mark.server
def test_family_served_to_the_openai_client(folders, model_type):
    """The server end to end with the official client: the chat answer equals generate's."""
    from openai import OpenAI

    from fx_engine.server.app import create_app

    from tests.conftest import serve

    model = fx_engine.load(folders[model_type])
    want = fx_engine.generate(model, [{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.0)
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=32)
    with serve(create_app(engine, model_type), engine) as (url, _):
        out = OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            model=model_type, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    assert out.choices[0].message.content == want.text and out.usage.completion_tokens == len(want.token_ids)
