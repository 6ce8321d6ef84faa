"""LoRA / DoRA adapters per request (issue 26).

Oracle: mlx-lm. Adapters are made by mlx-lm's own `linear_to_lora_layers` (random non-zero
factors instead of training steps; tools/oracle.write_mlx_lm_adapter) and loaded into
mlx-lm's model by its own `load_adapters`; fx-engine's logits with the same adapter must
match. PEFT files are the same factors written in PEFT's layout (tools/oracle.peft_from_mlx_lm).
"""

from __future__ import annotations

import json
import shutil

import attrs
import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled
from fx_engine.engine.generate import reference_generate
from fx_engine.loading.adapters import AdapterError, AdapterSet
from tools.oracle import mlx_lm_with_adapter, peft_from_mlx_lm, write_hf_folder, write_mlx_lm_adapter

from tests.conftest import LONG_TEXT

pytestmark = pytest.mark.oracle

TOL = 2e-3
KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def fresh(model):
    """The model with an empty adapter set (session fixtures are shared)."""
    return attrs.evolve(model, adapters=AdapterSet())


def _close(ours: mx.array, ref: mx.array, tol: float = TOL) -> float:
    assert ours.shape == ref.shape
    diff = mx.abs(ours - ref).max().item()
    assert diff <= tol, f"max |diff| = {diff}"
    return diff


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return tiny_folder("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny_q(tiny_folder):
    """The same architecture 4-bit quantized (the native kernels' format on CPU)."""
    return tiny_folder("llama", num_hidden_layers=3,
                       quantize={"group_size": 32, "bits": 4})


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "quantized"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_matches_mlx_lm(tiny, tiny_q, tmp_path, quantized, dora):
    path = tiny_q if quantized else tiny
    ad = write_mlx_lm_adapter(path, tmp_path / "ad", rank=4, scale=3.0, dora=dora, num_layers=2,
                              keys=KEYS, seed=1)
    model = fx_engine.load(path)
    assert fx_engine.load_adapter(model, ad, name="ft") == "ft"
    ids = list(range(3, 70))
    ref = mlx_lm_with_adapter(path, ad)(mx.array([ids]))[0]
    ours = fx_engine.logits(model, ids, chunk=16, adapter="ft")
    _close(ours, ref)
    base = fx_engine.logits(model, ids, chunk=16)
    assert mx.abs(base - ref).max().item() > 50 * TOL  # the adapter changes the output
    # the reference loop and the engine give the same tokens as each other
    got = fx_engine.generate(model, ids, max_tokens=12, temperature=1.0, seed=3, adapter="ft")
    want = reference_generate(model, ids, max_tokens=12, temperature=1.0, seed=3, adapter="ft")
    assert got.token_ids == want.token_ids


def test_peft_format_matches_mlx_lm(tiny, tmp_path):
    for dora in (False, True):
        ad = write_mlx_lm_adapter(tiny, tmp_path / f"m{dora}", rank=4, scale=2.0, dora=dora, keys=KEYS, seed=2)
        peft = peft_from_mlx_lm(ad, tmp_path / f"p{dora}")
        model = fx_engine.load(tiny)
        fx_engine.load_adapter(model, peft, name="p")
        ids = list(range(5, 50))
        _close(fx_engine.logits(model, ids, adapter="p"), mlx_lm_with_adapter(tiny, ad)(mx.array([ids]))[0])


def test_peft_rslora_and_alpha_pattern(tiny, tmp_path):
    """PEFT scales: alpha / r, alpha / sqrt(r) with rsLoRA, and alpha_pattern per module."""
    ad = write_mlx_lm_adapter(tiny, tmp_path / "m", rank=4, scale=2.0, keys=["self_attn.q_proj", "mlp.down_proj"])
    peft = peft_from_mlx_lm(ad, tmp_path / "p")
    cfg = json.loads((peft / "adapter_config.json").read_text())
    # rsLoRA with alpha = scale * sqrt(r): the same effective scale as the mlx-lm adapter
    cfg.update(use_rslora=True, lora_alpha=2.0 * 2.0, alpha_pattern={"down_proj": 2.0 * 2.0})
    (peft / "adapter_config.json").write_text(json.dumps(cfg))
    model = fx_engine.load(tiny)
    fx_engine.load_adapter(model, peft, name="p")
    ids = list(range(5, 40))
    _close(fx_engine.logits(model, ids, adapter="p"), mlx_lm_with_adapter(tiny, ad)(mx.array([ids]))[0])
    cfg["alpha_pattern"] = {"down_proj": 40.0}  # a different scale on down_proj only: differs
    (peft / "adapter_config.json").write_text(json.dumps(cfg))
    fx_engine.load_adapter(model, peft, name="q")
    assert mx.abs(fx_engine.logits(model, ids, adapter="q") - fx_engine.logits(model, ids, adapter="p")).max().item() > 1e-3


@pytest.mark.slow
def test_gguf_base_matches_mlx_lm(default_model, tmp_path):
    """An adapter made on the checkpoint's (HF) names, served on the GGUF file (llama.cpp's
    names and q/k row order) of the real default model."""
    hf = write_hf_folder(default_model, tmp_path / "hf")
    ad = write_mlx_lm_adapter(hf, tmp_path / "ad", rank=8, scale=4.0, keys=KEYS, num_layers=8, seed=4,
                              init_scale=0.02)
    model = fresh(default_model)
    fx_engine.load_adapter(model, ad, name="g")
    ids = default_model.tokenizer.encode(LONG_TEXT)[:96]
    ref = mlx_lm_with_adapter(hf, ad)(mx.array([ids]))[0]
    _close(fx_engine.logits(model, ids, chunk=32, adapter="g"), ref)
    assert mx.abs(fx_engine.logits(model, ids, chunk=32) - ref).max().item() > 0.1


def test_mixed_batch_equals_each_row_alone(tiny, tmp_path):
    """Rows on three adapters and on none, in one running batch (joining at different
    steps), give exactly each row's tokens and logprobs alone (the batch-invariant mode)."""
    model = fx_engine.load(tiny, batch_invariant=True)
    for i, dora in enumerate((False, True, False)):
        ad = write_mlx_lm_adapter(tiny, tmp_path / f"a{i}", rank=(4, 8, 16)[i], dora=dora, keys=KEYS[: 3 + 2 * i],
                                  seed=10 + i, init_scale=0.1)
        fx_engine.load_adapter(model, ad, name=f"a{i}")
    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(4)]
    names = ["a0", None, "a1", "a2"]
    kw = dict(max_tokens=10, temperature=1.0, logprobs=2)
    alone = [reference_generate(model, p, seed=i, adapter=n, **kw) for i, (p, n) in enumerate(zip(prompts, names))]
    assert len({a.token_ids for a in alone}) == 4
    with fx_engine.Engine(model, max_rows=4, prefill_chunk=8) as engine:
        hs = [engine.submit(p, seed=i, adapter=n, **kw) for i, (p, n) in enumerate(zip(prompts, names))]
        got = [h.result() for h in hs]
    for g, a in zip(got, alone):
        assert g.token_ids == a.token_ids
        assert [x.logprob for x in g.logprobs] == [x.logprob for x in a.logprobs]


def test_no_recompile_after_first_step_of_a_bucket(tiny, tmp_path):
    """Loading another adapter of the same rank bucket (on the same modules) and serving it
    reuses the compiled steps."""
    model = fx_engine.load(tiny)
    ads = [write_mlx_lm_adapter(tiny, tmp_path / f"a{i}", rank=(4, 5, 3)[i], keys=KEYS[:4], seed=i) for i in range(3)]
    fx_engine.load_adapter(model, ads[0], name="a0")
    ids = list(range(4, 30))
    kw = dict(max_tokens=8, temperature=1.0, seed=5, logprobs=1)
    with fx_engine.Engine(model, max_rows=2, prefill_chunk=32, prefix_cache_bytes=0) as engine:
        engine.submit(ids, adapter="a0", **kw).result()
        [h.result() for h in [engine.submit(ids, adapter=n, **kw) for n in ("a0", None)]]
        d, p = decode_step_compiled.traces, prefill_step_compiled.traces
        outs = {}
        for i in (1, 2):
            fx_engine.load_adapter(model, ads[i], name=f"a{i}")
            outs[f"a{i}"] = engine.submit(ids, adapter=f"a{i}", **kw).result()
        both = [engine.submit(ids, adapter=n, **kw) for n in ("a1", "a2")]
        [h.result() for h in both]
        assert (decode_step_compiled.traces, prefill_step_compiled.traces) == (d, p)
    for name, out in outs.items():  # and the new adapters were used
        want = reference_generate(model, ids, adapter=name, **kw)
        assert [x.logprob for x in out.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)


def test_prefix_cache_is_keyed_by_adapter(tiny, tmp_path):
    model = fx_engine.load(tiny)
    for n in ("x", "y"):
        fx_engine.load_adapter(model, write_mlx_lm_adapter(tiny, tmp_path / n, keys=KEYS, seed=ord(n),
                                                           init_scale=0.1), name=n)
    ids = list(range(3, 60))
    want = {n: reference_generate(model, ids, max_tokens=6, adapter=n).token_ids for n in ("x", "y", None)}
    with fx_engine.Engine(model, max_rows=1, prefill_chunk=16) as engine:
        def run(n):
            c = engine.submit(ids, max_tokens=6, adapter=n).result()
            assert c.token_ids == want[n]
            return c.usage.cached_tokens

        assert run("x") == 0
        assert run("y") == 0  # never restored from x's KV
        assert run(None) == 0
        assert run("x") > 0 and run("y") > 0 and run(None) > 0  # each its own


def test_disk_tier_is_keyed_by_adapter_contents(tiny, tmp_path):
    """A new engine (a restart: empty memory tier) restores an adapter's prefix from disk
    only for that adapter's contents, under any name."""
    ads = {n: write_mlx_lm_adapter(tiny, tmp_path / n, keys=KEYS, seed=ord(n), init_scale=0.1) for n in "xy"}
    ids = list(range(3, 60))
    m1 = fx_engine.load(tiny)
    fx_engine.load_adapter(m1, ads["x"], name="x")
    with fx_engine.Engine(m1, max_rows=1, prefill_chunk=16, prefix_cache_dir=str(tmp_path / "pc")) as e1:
        e1.submit(ids, max_tokens=4, adapter="x").result()
    m2 = fx_engine.load(tiny)
    fx_engine.load_adapter(m2, ads["y"], name="x")  # y's contents under x's name
    fx_engine.load_adapter(m2, ads["x"], name="renamed")
    with fx_engine.Engine(m2, max_rows=1, prefill_chunk=16, prefix_cache_dir=str(tmp_path / "pc"),
                          prefix_cache_bytes=1 << 20) as e2:
        assert e2.submit(ids, max_tokens=4, adapter="x").result().usage.cached_tokens == 0
        assert e2.submit(ids, max_tokens=4).result().usage.cached_tokens == 0
        got = e2.submit(ids, max_tokens=4, adapter="renamed").result()
        assert got.usage.cached_tokens > 0
        assert got.token_ids == reference_generate(m2, ids, max_tokens=4, adapter="renamed").token_ids


def test_speculation_grammar_logprobs_with_adapter(tiny, tmp_path):
    model = fx_engine.load(tiny)
    fx_engine.load_adapter(model, write_mlx_lm_adapter(tiny, tmp_path / "a", keys=KEYS, init_scale=0.1), name="a")
    ids = list(range(3, 30)) * 2
    plain = fx_engine.generate(model, ids, max_tokens=16, adapter="a", logprobs=1)
    spec = fx_engine.generate(model, ids, max_tokens=16, adapter="a", prompt_lookup=True, logprobs=1)
    assert spec.token_ids == plain.token_ids
    assert [x.logprob for x in spec.logprobs] == pytest.approx([x.logprob for x in plain.logprobs], abs=1e-4)
    choice = fx_engine.generate(model, "pick", max_tokens=8, adapter="a", choice=["yes", "no"])
    assert choice.text in ("yes", "no")


def test_fuse_adapter_equals_serving_it(tiny, tiny_q, tmp_path):
    for path in (tiny, tiny_q):
        for dora in (False, True):
            ad = write_mlx_lm_adapter(path, tmp_path / f"{path.name}{dora}", keys=KEYS, dora=dora, seed=7)
            model = fx_engine.load(path)
            fx_engine.load_adapter(model, ad, name="a")
            ids = list(range(3, 40))
            fused = fx_engine.fuse_adapter(model, "a")
            assert len(fused.adapters) == 0 and fused.fingerprint != model.fingerprint
            ref = mlx_lm_with_adapter(path, ad)(mx.array([ids]))[0]
            _close(fx_engine.logits(fused, ids), ref)
            _close(fx_engine.logits(fx_engine.fuse_adapter(model, ad), ids), ref)  # from the folder


def test_bad_adapters_are_clear_errors(tiny, tmp_path, tiny_folder):
    model = fx_engine.load(tiny)
    with pytest.raises(AdapterError, match="does not exist"):
        fx_engine.load_adapter(model, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json"):
        fx_engine.load_adapter(model, tmp_path / "empty")
    ad = write_mlx_lm_adapter(tiny, tmp_path / "ok", keys=KEYS[:2])
    # rank in the config differs from the tensors
    bad = tmp_path / "rank"
    shutil.copytree(ad, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 16
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="rank 16"):
        fx_engine.load_adapter(model, bad)
    # a module the base does not have
    bad = tmp_path / "module"
    shutil.copytree(ad, bad)
    t = mx.load(str(bad / "adapters.safetensors"))
    t = {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"): v for k, v in t.items()}
    mx.save_safetensors(str(bad / "adapters.safetensors"), t)
    with pytest.raises(AdapterError, match="qq_proj' is not a linear of this model"):
        fx_engine.load_adapter(model, bad)
    # an adapter for another base (another hidden size)
    other = tiny_folder("llama", num_hidden_layers=3, hidden_size=96)
    with pytest.raises(AdapterError, match="another base"):
        fx_engine.load_adapter(model, write_mlx_lm_adapter(other, tmp_path / "oa", keys=KEYS[:2]))
    # a missing weights file, a full fine-tune, a PEFT pickle
    bad = tmp_path / "nofile"
    shutil.copytree(ad, bad)
    (bad / "adapters.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapters.safetensors"):
        fx_engine.load_adapter(model, bad)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "fine_tune_type": "full"}))
    with pytest.raises(AdapterError, match="full fine-tune"):
        fx_engine.load_adapter(model, bad)
    peft = peft_from_mlx_lm(ad, tmp_path / "peft")
    (peft / "adapter_model.safetensors").rename(peft / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        fx_engine.load_adapter(model, peft)
    # names: unknown at request time, duplicate at load time
    fx_engine.load_adapter(model, ad, name="a")
    with pytest.raises(ValueError, match="already loaded"):
        fx_engine.load_adapter(model, ad, name="a")
    with pytest.raises(ValueError, match="adapter: unknown adapter 'b'"):
        fx_engine.generate(model, "hi", max_tokens=2, adapter="b")
    assert model.adapters.names() == ["a"]  # the failed loads left nothing behind


@pytest.mark.server
def test_server_selects_adapters_by_model_name(tiny, tmp_path):
    """`fx-engine serve --adapter NAME=PATH`'s server: /v1/models lists BASE and BASE:NAME;
    the OpenAI `model` field picks the adapter per request (rows of different adapters in
    one batch); an unknown one is a 404; embeddings refuse adapters."""
    import httpx
    from openai import NotFoundError, OpenAI

    from fx_engine.server.app import create_app

    from tests.conftest import serve

    model = fx_engine.load(tiny)
    for n in ("x", "y"):
        fx_engine.load_adapter(model, write_mlx_lm_adapter(tiny, tmp_path / n, keys=KEYS, seed=ord(n),
                                                           init_scale=0.1), name=n)
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=32)
    app = create_app(engine, "tiny", defaults={"max_tokens": 8})
    kw = dict(max_tokens=8, temperature=1.0, seed=11)
    with serve(app, engine) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        ids = [m.id for m in client.models.list().data]
        assert ids == ["tiny", "tiny:x", "tiny:y"]
        import concurrent.futures

        names = ["tiny", "tiny:x", "y", "tiny:y"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda m: client.completions.create(model=m, prompt="The capital", logprobs=1,
                                                                    **kw), names))
        for name, r in zip(names, got):
            adapter = None if name == "tiny" else name.split(":")[-1]
            want = reference_generate(model, "The capital", adapter=adapter, logprobs=1, **kw)
            assert r.choices[0].text == want.text
            assert r.choices[0].logprobs.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
            assert r.model == ("tiny" if adapter is None else f"tiny:{adapter}")
        assert len({tuple(r.choices[0].logprobs.token_logprobs) for r in got[:3]}) == 3
        with pytest.raises(NotFoundError, match="tiny:z"):
            client.chat.completions.create(model="tiny:z", messages=[{"role": "user", "content": "hi"}])
        r = httpx.post(url + "/v1/embeddings", json={"model": "tiny:x", "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_cli_generate_and_serve_options(tiny, tmp_path, capsys):
    from fx_engine.cli import build_parser, main

    ad = write_mlx_lm_adapter(tiny, tmp_path / "a", keys=KEYS, init_scale=0.1)
    args = ["generate", "The capital", "--raw", "--model", str(tiny), "--max-tokens", "6", "--temp", "1",
            "--seed", "3"]
    assert main(args + ["--adapter", str(ad)]) == 0
    with_adapter = capsys.readouterr().out
    model = fx_engine.load(tiny)
    fx_engine.load_adapter(model, ad)
    want = fx_engine.generate(model, "The capital", max_tokens=6, temperature=1.0, seed=3, adapter="a")
    assert with_adapter.strip() == want.text.strip()
    assert main(args + ["--adapter", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    a = build_parser().parse_args(["serve", "--adapter", f"one={ad}", "--adapter", str(ad)])
    assert a.adapter == [f"one={ad}", str(ad)]


MODEL_TYPES = [mt for fam in __import__("fx_engine.core.models", fromlist=["FAMILIES"]).FAMILIES
               for mt in fam.model_types]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.slow
def test_every_adaptable_linear_of_every_family_applies_its_rows_adapter(model_type, tiny_folder):
    """For every family, every linear an adapter may target (those with an origin) really
    applies the low-rank update, per row: with a random adapter on that one linear in slot
    1, a batch of [base row, adapted row] gives the base logits exactly on row 0 and other
    logits on row 1. (A family that read such a weight outside `nn.linear`, or ran a linear
    over tokens not ordered by row, would fail here.)"""
    from fx_engine.core.adapters import Adapters, Segment, bank_from
    from fx_engine.core.nn import linears
    from fx_engine.core.steps import score_step

    model = fx_engine.load(tiny_folder(model_type))
    lins = linears(model.params)
    targets = [i for i, lin in enumerate(lins) if lin.origin and lin.weight.ndim == 2]
    assert targets, "no adaptable linear"
    tokens = mx.array([list(range(5, 17))] * 2, mx.int32)
    n = mx.array([12, 12], mx.int32)
    base, _ = score_step(model.params, model.new_cache(2, 64), tokens, n)
    keys = iter(mx.random.split(mx.random.key(0), 2 * len(lins)))
    for i in targets:
        k, out = lins[i].in_features, lins[i].out_features
        seg = Segment(start=0, a=0.5 * mx.random.normal((k, 4), key=next(keys)),
                      b=0.5 * mx.random.normal((4, out), key=next(keys)))
        bank = bank_from(len(lins), {i: (k, out)}, {i: {1: [seg]}}, 4)
        got, _ = score_step(model.params, model.new_cache(2, 64), tokens, n,
                            adapters=Adapters(bank, mx.array([0, 1], mx.int32)))
        name = lins[i].origin[0][0]
        assert mx.array_equal(got[0], base[0]).item(), f"{name}: row 0 (no adapter) changed"
        assert mx.abs(got[1] - base[1]).max().item() > 1e-4, f"{name}: the adapter had no effect"


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "phi3", "qwen2", "starcoder2", "olmo2", "phi",
                                        "stablelm"])
def test_other_families_match_mlx_lm_with_its_default_keys(tmp_path, model_type, tiny_folder):
    """mlx-lm's default targets (every linear of the last num_layers layers, whatever the
    family names them: phi3's fused qkv_proj / gate_up_proj, starcoder2's c_fc / c_proj,
    phi's dense / fc1 / fc2)."""
    path = tiny_folder(model_type)
    ad = write_mlx_lm_adapter(path, tmp_path / "ad", rank=4, scale=2.0, num_layers=2, seed=3, init_scale=0.1)
    model = fx_engine.load(path)
    fx_engine.load_adapter(model, ad, name="a")
    ids = list(range(3, 40))
    ref = mlx_lm_with_adapter(path, ad)(mx.array([ids]))[0]
    _close(fx_engine.logits(model, ids, adapter="a"), ref)
    assert mx.abs(fx_engine.logits(model, ids) - ref).max().item() > 50 * TOL
