"""Mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral, olmoe): parity with mlx-lm's
own model classes on tiny random models (Hugging Face per-expert checkpoints, and
mlx-community stacked 4-bit folders written by mlx-lm itself), greedy generation against
mlx-lm's generate_step, the engine's features on them, and qwen3moe / qwen2moe GGUF files
against mlx-lm on the reference dequantization of the same tensors."""

import json
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf, model_types
from fx_engine.engine.generate import reference_generate
from fx_engine.testing.tiny import tiny_config

from tests.conftest import LONG_TEXT
from tests.models.test_parity import _compare, assert_batch_equals_solo, assert_greedy_matches_mlx_lm, mlx_community

pytestmark = pytest.mark.oracle

CASES = [
    ("qwen3_moe", {}),
    ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts_per_tok": 1,
                   "tie_word_embeddings": False}),
    ("qwen3_moe", {"norm_topk_prob": False, "num_experts_per_tok": 3, "num_key_value_heads": 4}),
    ("qwen2_moe", {}),
    ("mixtral", {}),
    ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3, "num_key_value_heads": 1,
                 "rope_theta": 1e6}),
    ("olmoe", {}),
    ("olmoe", {"norm_topk_prob": True, "num_key_value_heads": 4}),
    # GLM-4.5: DeepSeek's grouped sigmoid routing with the correction bias, a shared expert,
    # a dense first layer, partial RoPE, q/k norms and q/k/v biases
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": False, "n_group": 1, "attention_bias": False, "n_shared_experts": None,
                  "first_k_dense_replace": 0, "num_experts_per_tok": 3}),
]


def _mlx_lm(path: Path):
    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(path))
    ref.set_dtype(mx.float32)
    return ref


def _ids(model, n: int = 96) -> list[int]:
    return model.tokenizer.encode(LONG_TEXT)[:n]


@pytest.mark.parametrize("model_type,overrides", CASES, ids=lambda x: str(x)[:60])
def test_teacher_forced_logits_match_mlx_lm(model_type, overrides, tiny_folder):
    """Chunks of 8 tokens (16 routed pairs: per-token expert matmuls) and of 48 (96 pairs:
    grouped by expert first) both give mlx-lm's logits."""
    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    assert type(model.params).__name__ == "MoEParams"
    ids = _ids(model)
    want = _mlx_lm(path)(mx.array([ids]))[0]
    for chunk in (8, 48):
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"])
def test_mlx_community_quantized_folders_match_mlx_lm(tmp_path, model_type, tiny_folder):
    """Stacked 4-bit experts (and 4-bit router, attention, head): dequantized at load by
    default, kept packed (mx.gather_qmm) with keep_quantized=True; both give mlx-lm's
    logits on the same folder."""
    q = mlx_community(tiny_folder(model_type), tmp_path / "q")
    assert any(".switch_mlp." in k and k.endswith(".scales")
               for k in mx.load(str(q / "model.safetensors")))
    ref = _mlx_lm(q)
    model = fx_engine.load(q)
    ids = _ids(model, 72)
    want = ref(mx.array([ids]))[0]
    _compare(fx_engine.logits(model, ids, chunk=36), want)
    kept = fx_engine.load(q, keep_quantized=True)
    moe_layer = next(lp for lp in kept.params.layers if lp.experts is not None)
    assert moe_layer.experts.down.quantized
    _compare(fx_engine.logits(kept, ids, chunk=36), want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_greedy_generation_matches_mlx_lm_generate_step(model_type, tiny_folder):
    path = tiny_folder(model_type)
    model = fx_engine.load(path)
    prompt = _ids(model, 40)
    assert_greedy_matches_mlx_lm(path, model, prompt)


def test_batch_equals_solo_bitwise_and_speculation_is_exact(tiny_folder):
    """Batch-invariant mode: rows joining at different steps, in one batch, give each
    request's tokens alone (bitwise: per-token expert products, no grouping); prompt-lookup
    and self-draft speculation (verify with row-wise rollback) keep greedy output exact."""
    from fx_engine.engine.drafters import self_draft_model

    path = tiny_folder("qwen2_moe", num_hidden_layers=3)
    model = fx_engine.load(path, batch_invariant=True)
    prompts = [_ids(model, n) for n in (5, 40, 17, 70)]
    assert_batch_equals_solo(model, prompts, max_tokens=20, chunk=16)
    fast = fx_engine.load(path)
    refs = [reference_generate(fast, p, max_tokens=30, temperature=0.0).token_ids for p in prompts[:2]]
    with fx_engine.Engine(fast, max_rows=4, prefill_chunk=8) as eng:
        spec = [eng.submit(p, max_tokens=30, prompt_lookup=True) for p in prompts[:2]]
        draft = [eng.submit(p, max_tokens=30, draft_model=self_draft_model(fast, 1)) for p in prompts[:2]]
        assert [h.result().token_ids for h in spec] == refs
        assert [h.result().token_ids for h in draft] == refs


def test_prefix_cache_and_quantized_kv(tiny_folder):
    """A shared prefix restored from the prefix cache gives the cold run's tokens; an 8-bit
    KV cache runs the family too (its own reference loop)."""
    path = tiny_folder("olmoe", head_dim=32)
    model = fx_engine.load(path)
    head = _ids(model, 48)
    prompts = [head + [5, 6, 7], head + [9, 10]]
    cold = [reference_generate(model, p, max_tokens=12, temperature=0.0).token_ids for p in prompts]
    with fx_engine.Engine(model, max_rows=2, prefill_chunk=16) as engine:
        first = engine.submit(prompts[0], max_tokens=12).result()
        second = engine.submit(prompts[1], max_tokens=12).result()
        assert [first.token_ids, second.token_ids] == cold
        assert second.usage.cached_tokens >= 32
    q8 = fx_engine.load(path, kv_bits=8, kv_group_size=32)
    ref8 = reference_generate(q8, prompts[0], max_tokens=12, temperature=0.0).token_ids
    assert fx_engine.generate(q8, prompts[0], max_tokens=12, temperature=0.0).token_ids == ref8


def test_config_refusals_and_listing():
    for mt in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe"):
        assert model_types()[mt] == "moe"
    cases = [
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
        ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen2_moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
        ("olmoe", {"mlp_bias": True}, "mlp_bias"),
        ("glm4_moe", {"n_group": 3}, "n_group"),
        ("glm4_moe", {"scoring_func": "softmax"}, "scoring_func"),
        ("glm4_moe", {"partial_rotary_factor": 0.1875}, "partial_rotary_factor"),
    ]
    for mt, overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**tiny_config(mt), **overrides}, "config.json")


# ------------------------------------------------------------------ GGUF

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# the expert stacks' GGUF names
_EXPS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _moe_gguf(folder: Path, out: Path, arch: str, types: tuple[str, str, str]) -> Path:
    """Convert a tiny qwen3_moe / qwen2_moe folder as llama.cpp's converter does (its names,
    the experts stacked into [E, out, in] tensors, no q/k permutation), the expert stacks
    quantized by the gguf package's reference quantizer; returns an HF folder holding the
    reference dequantization of every tensor the file has (the oracle's weights)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from tests.gguf_tokenizer import add_tokenizer, write_oracle

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    ints = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"], "expert_count": cfg["num_experts"],
            "expert_used_count": cfg["num_experts_per_tok"],
            "expert_feed_forward_length": cfg.get("moe_intermediate_size", cfg["intermediate_size"]),
            "feed_forward_length": cfg["intermediate_size"]}
    if arch == "qwen3moe":
        ints["attention.key_length"] = ints["attention.value_length"] = cfg["head_dim"]
    if arch == "qwen2moe":
        ints["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    for k, v in ints.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    add_tokenizer(w, folder, cfg["eos_token_id"])
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    oracle = dict(weights)
    e = cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp."
        for (proj, gname), kind in zip(_EXPS.items(), types):
            names = [f"{pre}experts.{j}.{proj}.weight" for j in range(e)]
            stack = np.stack([weights.pop(n) for n in names])
            qtype = gguf.GGMLQuantizationType[kind]
            if kind.endswith("_K"):  # (the gguf package has no K-quant quantizer: random valid blocks)
                from tests.models.test_gguf_kquant import _blocks

                packed = _blocks(kind, stack.shape[0] * stack.shape[1], stack.shape[2],
                                 np.random.default_rng(i)).reshape(*stack.shape[:2], -1)
            else:
                packed = quantize(stack, qtype)
            w.add_tensor(f"blk.{i}.{gname}.weight", packed, raw_dtype=qtype)
            deq = dequantize(packed, qtype).reshape(stack.shape)
            for j, n in enumerate(names):
                oracle[n] = deq[j]
    for name, x in sorted(weights.items()):
        g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}.get(name)
        if g is None:
            i, rest = name[len("model.layers."):].split(".", 1)
            base, suffix = rest.rsplit(".", 1)
            g = f"blk.{i}.{_GGUF_NAMES[base]}.{suffix}"
        w.add_tensor(g, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return write_oracle(folder, out.parent / "oracle", oracle)


@pytest.mark.parametrize("arch,model_type,types", [
    # gate/up/down stacks: 4-bit (two formats: fused packed), 8-bit
    ("qwen3moe", "qwen3_moe", ("Q4_0", "Q4_1", "Q8_0")),
    # 5-bit and 8-bit gate/up: fused as exact 8-bit; a 5-bit down stack
    ("qwen2moe", "qwen2_moe", ("Q5_1", "Q8_0", "Q5_0")),
    # OLMoE: q/k norms over whole projections, no renormalization
    ("olmoe", "olmoe", ("Q8_0", "Q8_0", "Q4_0")),
    # a Q4_K_M file's experts: Q4_K gate/up (two-level scales, fused), a Q6_K down stack
    # (groups of 16, which MLX's gather_qmm does not run: the native product does)
    ("olmoe", "olmoe", ("Q4_K", "Q4_K", "Q6_K")),
])
def test_moe_gguf_matches_mlx_lm(tmp_path, arch, model_type, types, tiny_folder):
    """The experts' stacks quantized (3-D GGUF tensors), kept packed with keep_quantized;
    by default on the CPU packed as stored too where the native experts' product runs the
    format (the K-quants' two-level scales included)."""
    pytest.importorskip("gguf")
    k_quants = types[0].endswith("_K")  # (K-quant rows: multiples of 256)
    folder = tiny_folder(model_type, **({"hidden_size": 256, "intermediate_size": 256} if k_quants else {}))
    oracle = _moe_gguf(folder, tmp_path / "m.gguf", arch, types)
    model = fx_engine.load(tmp_path / "m.gguf")
    assert model.config.num_experts == 8 and model.config.model_type == model_type
    assert model.config.norm_topk_prob == (arch == "qwen3moe")
    ids = _ids(model, 80)
    _compare(fx_engine.logits(model, ids, chunk=40), _mlx_lm(oracle)(mx.array([ids]))[0])
    if k_quants and model.params.numerics.native:  # packed, the file's scale forms
        ex = model.params.layers[0].experts
        assert (ex.gate_up.quant.bits, ex.gate_up.quant.scales.dtype, ex.down.quant.bits, ex.down.quant.group_size,
                ex.down.quant.scales.dtype) == (4, mx.int16, 6, 16, mx.int16)
        # 8-bit activations (the experts through qmm_a8): other numerics, close to the oracle
        a8 = fx_engine.logits(fx_engine.load(tmp_path / "m.gguf", activation_bits=8), ids, chunk=40)
        ref = _mlx_lm(oracle)(mx.array([ids]))[0]
        rel = (mx.abs(a8 - ref).max() / mx.abs(ref).max()).item()
        agree = (a8.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
        assert rel < 0.05 and agree >= 0.9, (rel, agree)  # (measured: 0.026, 1.0)
    if model.params.numerics.native:
        # the 8-bit mode interleaves each expert's matrix (a decode step reads each 16-row
        # block as one stream): the logits of the same stacks in rows, bit for bit
        from fx_engine.core.adapters import map_linears
        from fx_engine.core.nn import row_major

        a8m = fx_engine.load(tmp_path / "m.gguf", activation_bits=8)
        ex = a8m.params.layers[0].experts
        stacks = [lin for lin in (ex.gate_up, ex.down) if lin.quantized]  # (Q5_1's float gate_up: dense)
        assert stacks and all(lin.interleaved and lin.weight.ndim == 3 for lin in stacks)
        rows = attrs.evolve(a8m, params=map_linears(a8m.params, lambda _, lin: row_major(lin)))
        assert not any(lin.interleaved for lin in (rows.params.layers[0].experts.gate_up,
                                                   rows.params.layers[0].experts.down))
        for chunk in (1, 40):
            assert mx.array_equal(fx_engine.logits(a8m, ids[:48], chunk=chunk),
                                  fx_engine.logits(rows, ids[:48], chunk=chunk)).item()
    kept = fx_engine.load(tmp_path / "m.gguf", keep_quantized=True)
    assert kept.params.layers[0].experts.gate_up.quantized
    _compare(fx_engine.logits(kept, ids, chunk=40), _mlx_lm(oracle)(mx.array([ids]))[0])


# ------------------------------------------------------------------ routing property

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, database=None)
@given(n=st.integers(1, 70), k=st.integers(1, 4), e=st.sampled_from([4, 8]), seed=st.integers(0, 10_000),
       batch_invariant=st.booleans(), quantized=st.booleans(), native_experts=st.booleans())
def test_batched_experts_equal_each_token_through_its_experts(n, k, e, seed, batch_invariant, quantized, native_experts):
    """nn.routed_glu (per-token gathers below 64 routed pairs; pairs grouped by expert from
    64 on, except in the batch-invariant mode), dense or 4-bit expert stacks, equals each
    token run alone through each of its chosen experts (numpy, float64)."""
    import numpy as np

    from fx_engine.core import kernels
    from fx_engine.core.checkpoint import finish_experts
    from fx_engine.core.nn import Linear, Numerics, Quant, routed_glu, swiglu
    from fx_engine.runtime import native as fx_native

    fx_native.ensure(quiet=True)

    h, f = 64, 32
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    gu = (rng.standard_normal((e, 2 * f, h)) * 0.2).astype(np.float32)
    dn = (rng.standard_normal((e, h, f)) * 0.2).astype(np.float32)
    idx = np.argsort(rng.random((n, e)), axis=-1)[:, :k].astype(np.int32)  # k distinct experts
    stacks = []
    for w in (gu, dn):
        lin = Linear(weight=mx.array(w))
        if quantized:
            q, s, b = mx.quantize(mx.array(w), group_size=32, bits=4)
            lin = Linear(weight=q, quant=Quant(scales=s, biases=b, group_size=32, bits=4))
            w[...] = np.asarray(mx.dequantize(q, s, b, group_size=32, bits=4))  # the reference's weights
        stacks.append(finish_experts(lin, mx.float32, True))
    # native: the packed stacks through the native experts' product (kernels.gather_qmm)
    native = native_experts and quantized and kernels.installed() is not None
    got = routed_glu(mx.array(x), stacks[0], stacks[1], mx.array(idx),
                     lambda a: swiglu(a[..., :f], a[..., f:]), Numerics(batch_invariant=batch_invariant, native=native))
    ref = np.zeros((n, k, h))
    for t in range(n):
        for j in range(k):
            a = gu[idx[t, j]].astype(np.float64) @ x[t]
            g, u = a[:f], a[f:]
            ref[t, j] = dn[idx[t, j]].astype(np.float64) @ (g / (1 + np.exp(-g)) * u)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("stacked", [True, False], ids=["ffn_exps", "per-expert"])
def test_mixtral_gguf_as_llama_with_experts(tmp_path, stacked, tiny_folder):
    """llama.cpp writes Mixtral as the "llama" architecture with expert_count: its q/k rows
    permuted (LlamaModel), the experts stacked (ffn_gate_exps, ...) or, in older files, one
    tensor per expert (ffn_gate.{e}); the router ffn_gate_inp. Names of the other tensors
    from llama.cpp's own TensorNameMap; the file gives mlx-lm's logits on the folder."""
    import json

    import gguf
    from gguf.quants import dequantize, quantize

    from tests.gguf_tokenizer import add_tokenizer, write_oracle
    from tests.models.test_gguf_conversion import _common, _permute

    folder = tiny_folder("mixtral")
    cfg = json.loads((folder / "config.json").read_text())
    n, heads, kv, e = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in {**_common(cfg), "expert_count": e, "expert_used_count": cfg["num_experts_per_tok"]}.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"llama.{key}", value)
    add_tokenizer(w, folder, cfg["eos_token_id"])
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(n):
        pre = f"model.layers.{i}.block_sparse_moe."
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weights.pop(pre + "gate.weight"))
        for hf, gg in (("w1", "ffn_gate"), ("w3", "ffn_up"), ("w2", "ffn_down")):
            parts = [weights[f"{pre}experts.{j}.{hf}.weight"] for j in range(e)]
            if stacked:  # as Q8_0 (3-D): the oracle gets the reference dequantization
                packed = quantize(np.stack(parts), q8)
                w.add_tensor(f"blk.{i}.{gg}_exps.weight", packed, raw_dtype=q8)
                deq = dequantize(packed, q8).reshape(len(parts), *parts[0].shape)
                for j in range(e):
                    weights[f"{pre}experts.{j}.{hf}.weight"] = deq[j]
            else:
                for j in range(e):
                    w.add_tensor(f"blk.{i}.{gg}.{j}.weight", parts[j])
    for name, x in sorted(weights.items()):
        if ".block_sparse_moe." in name:
            continue
        stored = _permute(x, heads if "q_proj" in name else kv) if name.endswith(
            ("q_proj.weight", "k_proj.weight")) else x
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), stored)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    full = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    full.update({k: v for k, v in weights.items() if ".experts." in k})
    oracle = write_oracle(folder, tmp_path / "oracle", full)
    model = fx_engine.load(tmp_path / "m.gguf")
    assert model.config.model_type == "mixtral" and model.config.num_experts == e
    ids = _ids(model, 80)
    _compare(fx_engine.logits(model, ids, chunk=40), _mlx_lm(oracle)(mx.array([ids]))[0])


@pytest.mark.parametrize("k,n_group,topk_group,norm", [(2, 4, 2, True), (1, 4, 2, True), (3, 8, 3, False),
                                                      (1, 1, 1, True)])
def test_grouped_route_matches_hugging_faces_router(k, n_group, topk_group, norm):
    """DeepSeek-V3's grouped sigmoid routing against Hugging Face's DeepseekV3TopkRouter
    written in float64 numpy: experts of dropped groups never chosen (-inf), even where the
    kept experts' biased scores are negative (mlx-lm filled them with 0, and chose them);
    the weights renormalized at top_k 1 too."""
    from fx_engine.core.models.blocks import grouped_route

    rng = np.random.default_rng(k * 100 + n_group)
    n, e, scale = 64, 32, 2.5
    logits = rng.normal(0, 2, (n, e))
    bias = rng.normal(-1.0, 0.5, e)  # mostly below -sigmoid: biased scores negative

    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    group = np.sort(choice.reshape(n, n_group, -1), axis=-1)[..., -2:].sum(-1) if n_group > 1 else np.zeros((n, 1))
    keep = np.argsort(-group, axis=-1)[:, :topk_group]
    mask = np.zeros((n, n_group), bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    choice = np.where(np.repeat(mask, e // n_group, axis=-1), choice, -np.inf)
    want_idx = np.argsort(-choice, axis=-1)[:, :k]
    want_w = np.take_along_axis(scores, want_idx, -1)
    if norm:
        want_w = want_w / (want_w.sum(-1, keepdims=True) + 1e-20)
    want_w *= scale

    idx, w = grouped_route(mx.array(logits, mx.float32), mx.array(bias, mx.float32), k, n_group, topk_group,
                           norm, scale)
    idx, w = np.asarray(idx), np.asarray(w, np.float64)
    order = np.argsort(idx, -1)
    want_order = np.argsort(want_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(idx, order, -1), np.take_along_axis(want_idx, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), np.take_along_axis(want_w, want_order, -1),
                               rtol=1e-5)


@pytest.mark.parametrize("use_bias,norm,k", [(True, True, 4), (False, True, 2), (True, False, 1), (False, False, 3)])
def test_lfm2_moe_route_matches_hugging_faces_router(use_bias, norm, k):
    """LFM2-MoE's routing (`grouped_route` with one group, as lfm2.py's config asks for it)
    against Hugging Face's Lfm2MoeTopKRouter written in float64 numpy: sigmoid scores, the
    expert_bias choosing the top-k only (the weights are the unbiased scores), renormalized
    with 1e-6 in the sum, times routed_scaling_factor; without use_expert_bias the scores
    alone choose."""
    from fx_engine.core.models.blocks import grouped_route

    rng = np.random.default_rng(k + 10 * use_bias)
    n, e, scale = 64, 16, 1.5
    logits = rng.normal(0, 1.5, (n, e)) - 4.0  # small scores: the 1e-6 moves the weights by ~1e-5 of themselves
    bias = rng.normal(0, 0.3, e)
    scores = 1 / (1 + np.exp(-logits))
    want_idx = np.argsort(-(scores + bias if use_bias else scores), axis=-1)[:, :k]
    want_w = np.take_along_axis(scores, want_idx, -1)
    if norm:
        want_w = want_w / (want_w.sum(-1, keepdims=True) + 1e-6)
    want_w *= scale

    idx, w = grouped_route(mx.array(logits, mx.float32), mx.array(bias, mx.float32) if use_bias else None, k, 1, 1,
                           norm, scale, norm_eps=1e-6)
    idx, w = np.asarray(idx), np.asarray(w, np.float64)
    order, want_order = np.argsort(idx, -1), np.argsort(want_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(idx, order, -1), np.take_along_axis(want_idx, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), np.take_along_axis(want_w, want_order, -1),
                               rtol=1e-6)
    if use_bias:  # (the bias does choose here: scores alone pick other experts for some tokens)
        assert (np.sort(np.argsort(-scores, -1)[:, :k], -1) != np.sort(want_idx, -1)).any()
