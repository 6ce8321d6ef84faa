"""GGUF files of the families added by the model-breadth step (granite, smollm3, olmo2):
tiny Hugging Face folders converted as llama.cpp's converter does, with the tensor names
from llama.cpp's own `gguf` package (its TensorNameMap: an independent oracle for the
names), its metadata keys, and the q/k row permutation of its LlamaModel conversions; some
tensors quantized by the package's reference quantizer. fx-engine's logits from the file
equal mlx-lm's on the folder holding the same (dequantized) weights."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.testing import write_tiny_model

from tests.conftest import LONG_TEXT
from tests.gguf_tokenizer import add_tokenizer, llama_cpp_logits, write_oracle
from tests.models.test_parity import _compare

pytestmark = pytest.mark.oracle

gguf = pytest.importorskip("gguf")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (interleaved RoPE pairs from half-split ones)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(folder: Path, out: Path, arch: str, metadata: dict, permute: bool, q8_mlp: bool = True,
            prepare=None) -> Path:
    """Write `folder` as a GGUF of `arch`; returns an HF folder with the weights the file
    holds (Q8_0 ones dequantized by the package's reference), for the mlx-lm oracle.
    prepare(weights, config) -> the tensors as the converter's modify_tensors writes them
    (Hugging Face names; the oracle keeps the folder's own)."""
    import json

    from gguf.quants import dequantize, quantize

    cfg = json.loads((folder / "config.json").read_text())
    n_layers, heads = cfg.get("num_hidden_layers", cfg.get("num_layers")), cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    kind = getattr(gguf.MODEL_ARCH, arch.upper().replace("-", "_"))
    names = gguf.get_tensor_name_map(kind, n_layers)
    arch = gguf.MODEL_ARCH_NAMES[kind]  # (the name llama.cpp writes: command-r, ernie4_5, seed_oss)
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in metadata.items():
        add = (w.add_array if isinstance(value, list) else w.add_string if isinstance(value, str)
               else w.add_bool if isinstance(value, bool)
               else w.add_float32 if isinstance(value, float) else w.add_uint32)
        add(f"{arch}.{key}", value)
    add_tokenizer(w, folder, cfg["eos_token_id"])
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    oracle = dict(weights)
    for name, x in sorted((prepare(weights, cfg) if prepare else weights).items()):
        stored = x
        if permute and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            stored = _permute(x, heads if "q_proj" in name else kv)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if q8_mlp and x.ndim == 2 and x.shape[1] % 32 == 0 and ".mlp." in name:  # the MLP as Q8_0
            q = quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(target, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
            oracle[name] = deq
        else:
            w.add_tensor(target, stored)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return write_oracle(folder, out.parent / "oracle", oracle)


def _neox_qkv(weights: dict, cfg: dict) -> dict:
    """llama.cpp's GPTNeoXModel.modify_tensors: query_key_value's rows per head [q_h; k_h;
    v_h] written as q | k | v."""
    heads = cfg["num_attention_heads"]
    return {n: (x.reshape(heads, 3, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
                if ".attention.query_key_value." in n else x) for n, x in weights.items()}


def _stablelm_norms(weights: dict, cfg: dict) -> dict:
    """llama.cpp's StableLMModel.modify_tensors: each layer's per-head q / k LayerNorm
    weights stacked into one [heads, head_dim] tensor."""
    import re

    out, stacks = {}, {}
    for n, x in weights.items():
        m = re.match(r"(.*_layernorm)\.norms\.(\d+)\.weight$", n)
        if m:
            stacks.setdefault(m.group(1) + ".weight", {})[int(m.group(2))] = x
        else:
            out[n] = x
    return {**out, **{n: np.stack([h[i] for i in range(len(h))]) for n, h in stacks.items()}}


#: the GPT-NeoX-style architectures' keys beyond `_common` (llama.cpp's Phi2Model,
#: StableLMModel, GPTNeoXModel set_gguf_parameters)
def _neox_keys(model_type: str, cfg: dict, md: dict) -> dict:
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    frac = cfg.get("partial_rotary_factor", cfg.get("rotary_pct"))
    md["attention.layer_norm_epsilon"] = md.pop("attention.layer_norm_rms_epsilon")
    md["rope.dimension_count"] = int(frac * hd)
    if model_type != "phi":
        md["use_parallel_residual"] = bool(cfg["use_parallel_residual"])
    if model_type == "gpt_neox":
        del md["attention.head_count_kv"], md["rope.freq_base"]
    return md


def _neox_cfg(cfg: dict) -> dict:
    """The tiny config with `_common`'s keys where GPT-NeoX's own names hold them."""
    return {**cfg, "rms_norm_eps": cfg["layer_norm_eps"],
            "num_key_value_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "rope_theta": cfg.get("rope_theta", cfg.get("rotary_emb_base"))}


_NEOX_PREPARE = {"gpt_neox": _neox_qkv, "stablelm": _stablelm_norms}
_NEOX_FAMILY = ("phi", "stablelm", "gpt_neox")


def _minicpm_keys(cfg: dict) -> dict:
    """llama.cpp's MiniCPMModel.set_gguf_parameters: the muP scales as granite's keys."""
    return {"embedding_scale": float(cfg["scale_emb"]),
            "residual_scale": float(cfg["scale_depth"] / cfg["num_hidden_layers"] ** 0.5),
            "logit_scale": float(cfg["hidden_size"] / cfg["dim_model_base"])}


def _common(cfg: dict) -> dict:
    return {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "rope.freq_base": float(cfg["rope_theta"])}


@pytest.mark.parametrize("model_type,arch,permute,overrides", [
    ("granite", "granite", True, {}),
    ("granite", "granite", True, {"tie_word_embeddings": False, "logits_scaling": 1.5}),
    ("smollm3", "smollm3", True, {}),
    # Ministral 3 as llama.cpp's Ministral3Model writes it (mistral3): YaRN from its keys,
    # Llama 4's query temperature (attention.temperature_scale) past the original context
    ("ministral3", "mistral3", True, {}),
    ("olmo2", "olmo2", False, {}),
    ("olmo2", "olmo2", False, {"tie_word_embeddings": True}),
    # OLMo 3 as llama.cpp's converter writes it: architecture olmo2 with a sliding window and
    # its per-layer pattern; with YaRN on the global layers (its attention factor kept)
    ("olmo3", "olmo2", False, {}),
    ("olmo3", "olmo2", False, {"layer_types": ["sliding_attention", "full_attention"] * 2,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25,
                                                "original_max_position_embeddings": 32}}),
    ("starcoder2", "starcoder2", False, {"hidden_act": "gelu_pytorch_tanh"}),
    ("cohere", "command_r", False, {}),
    ("cohere", "command_r", False, {"use_qk_norm": True}),
    ("cohere2", "cohere2", False, {}),
    ("exaone4", "exaone4", False, {}),  # LLLG: sliding local layers, NoPE global ones
    ("exaone4", "exaone4", False, {"sliding_window_pattern": None, "tie_word_embeddings": False}),
    ("glm4", "glm4", False, {}),  # sandwich norms, fused ffn_up, half of each head rotated
    ("glm4", "glm4", False, {"attention_bias": False, "partial_rotary_factor": 1.0}),
    # Llama-shaped types under their own architectures, nothing permuted (ERNIE 4.5 rotates
    # interleaved pairs, wider heads than hidden / heads; EXAONE 3 from its own tensor
    # names; Seed-OSS with q/k/v biases)
    ("ernie4_5", "ernie4_5", False, {}),
    ("exaone", "exaone", False, {}),
    ("exaone", "exaone", False, {"tie_word_embeddings": False}),
    ("seed_oss", "seed_oss", False, {}),
    # the GPT-NeoX-style blocks (LayerNorms, partial rotary, parallel blocks): Phi 2 with its
    # head's bias; StableLM 2 1.6B (sequential, q/k/v biases) and 12B (parallel, per-head
    # q/k LayerNorms stacked as llama.cpp's converter does); Pythia (query_key_value's rows
    # reordered by the converter; its exact GELU)
    ("phi", "phi2", False, {}),
    ("stablelm", "stablelm", False, {}),
    ("stablelm", "stablelm", False, {"qk_layernorm": True, "use_parallel_residual": True, "use_qkv_bias": False}),
    ("gpt_neox", "gptneox", False, {"hidden_act": "gelu"}),
    ("gpt_neox", "gptneox", False, {"hidden_act": "gelu", "use_parallel_residual": False}),
    # MiniCPM: its muP scales under llama.cpp's granite-style keys, q/k permuted as Llama's
    ("minicpm", "minicpm", True, {}),
])
def test_family_gguf_matches_mlx_lm(tmp_path, model_type, arch, permute, overrides):
    import json

    from mlx_lm.utils import load_model

    folder = write_tiny_model(tmp_path / "m", model_type, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    if model_type == "starcoder2":
        cfg["rms_norm_eps"] = cfg["norm_epsilon"]
    if model_type.startswith("cohere"):
        cfg["rms_norm_eps"] = cfg["layer_norm_eps"]
    if model_type == "ministral3":
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    if model_type == "exaone":  # (its config's own names)
        cfg.update(num_hidden_layers=cfg["num_layers"], rms_norm_eps=cfg["layer_norm_epsilon"])
    if model_type in _NEOX_FAMILY:
        cfg = _neox_cfg(cfg)
    md = _common(cfg)
    if model_type in _NEOX_FAMILY:
        md = _neox_keys(model_type, cfg, md)
    if model_type in ("ernie4_5", "seed_oss"):  # TextModel's head width keys
        md["attention.key_length"] = md["attention.value_length"] = cfg["head_dim"]
    if model_type == "ministral3":  # TextModel's YaRN keys + Ministral3Model's two
        rp = cfg["rope_parameters"]
        md.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rp["factor"]),
                   "rope.scaling.original_context_length": rp["original_max_position_embeddings"],
                   "rope.scaling.yarn_log_multiplier": float(rp["mscale_all_dim"]),
                   "attention.temperature_scale": float(rp["llama_4_scaling_beta"]),
                   "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"]})
    if model_type in ("starcoder2", "cohere", "cohere2"):  # LayerNorm models
        md["attention.layer_norm_epsilon"] = md.pop("attention.layer_norm_rms_epsilon")
    if model_type.startswith("cohere"):
        md["logit_scale"] = float(cfg["logit_scale"])
        md["attention.key_length"] = md["attention.value_length"] = cfg.get("head_dim") or (
            cfg["hidden_size"] // cfg["num_attention_heads"])
    if model_type == "cohere2":
        md["attention.sliding_window"] = cfg["sliding_window"]
    if model_type == "glm4":
        md["attention.key_length"] = md["attention.value_length"] = cfg["head_dim"]
        md["rope.dimension_count"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    if model_type == "exaone4":
        md["attention.key_length"] = md["attention.value_length"] = cfg["head_dim"]
        if cfg.get("sliding_window_pattern"):
            md["attention.sliding_window"] = cfg["sliding_window"]
            md["attention.sliding_window_pattern"] = len(cfg["sliding_window_pattern"])
    if model_type == "olmo3":  # llama.cpp's Olmo2Model.set_gguf_parameters
        md["attention.sliding_window"] = cfg["sliding_window"]
        md["attention.sliding_window_pattern"] = ([t == "sliding_attention" for t in cfg["layer_types"]]
                                                  if "layer_types" in cfg else
                                                  [(i + 1) % 4 != 0 for i in range(cfg["num_hidden_layers"])])
        if cfg.get("rope_scaling"):
            rs = cfg["rope_scaling"]
            md.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rs["factor"]),
                       "rope.scaling.attn_factor": float(rs["attention_factor"]),
                       "rope.scaling.original_context_length": rs["original_max_position_embeddings"]})
            # the oracle: mlx-lm's YaRN takes the attention factor as its mscale
            rs["mscale"] = (rs["attention_factor"] - 1) / (0.1 * np.log(rs["factor"]))
            (folder / "config.json").write_text(json.dumps(cfg))
    if model_type == "granite":
        md.update({"embedding_scale": float(cfg["embedding_multiplier"]),
                   "attention.scale": float(cfg["attention_multiplier"]),
                   "residual_scale": float(cfg["residual_multiplier"]),
                   "logit_scale": float(cfg["logits_scaling"])})
    if model_type == "minicpm":
        md.update(_minicpm_keys(cfg))
    oracle = convert(folder, tmp_path / "m.gguf", arch, md, permute, prepare=_NEOX_PREPARE.get(model_type))
    model = fx_engine.load(tmp_path / "m.gguf")
    assert model.config.model_type == model_type
    if hasattr(model.params, "lm_head"):
        assert (model.params.lm_head is None) == bool(cfg.get("tie_word_embeddings", True))
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    if model_type == "gpt_neox":  # (the file's model with its exact GELU, as Hugging Face's class)
        want = fx_engine.load(oracle)
        assert want.config.gelu == model.config.gelu == "erf"
        _compare(fx_engine.logits(model, ids, chunk=32), fx_engine.logits(want, ids))
        return
    if model_type == "starcoder2":
        # llama.cpp runs the tanh GELU (as the released configs say); mlx-lm always the erf
        # one: the oracle is the same folder through fx-engine's Hugging Face path (itself
        # checked against mlx-lm with hidden_act "gelu" in test_family_configs)
        _compare(fx_engine.logits(model, ids, chunk=32), fx_engine.logits(fx_engine.load(oracle), ids))
        return
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=32), ref(mx.array([ids]))[0])


@pytest.mark.parametrize("model_type,arch,permute,overrides", [
    ("granite", "granite", True, {}), ("smollm3", "smollm3", True, {}), ("olmo2", "olmo2", False, {}),
    ("starcoder2", "starcoder2", False, {"hidden_act": "gelu_pytorch_tanh"}),
    ("cohere", "command-r", False, {}), ("cohere2", "cohere2", False, {}),
    # EXAONE 4 without local layers (llama.cpp 0.3.36 differs from Hugging Face and mlx-lm on
    # the hybrid pattern's NoPE global layers: not compared here)
    ("exaone4", "exaone4", False, {"sliding_window_pattern": None}), ("glm4", "glm4", False, {}),
    ("ernie4_5", "ernie4_5", False, {}), ("exaone", "exaone", False, {}), ("seed_oss", "seed_oss", False, {}),
    ("phi", "phi2", False, {}), ("stablelm", "stablelm", False, {}),
    ("stablelm", "stablelm", False, {"qk_layernorm": True, "use_parallel_residual": True}),
    ("gpt_neox", "gptneox", False, {"hidden_act": "gelu"}), ("minicpm", "minicpm", True, {}),
    ("minicpm", "minicpm", True, {"tie_word_embeddings": True}),
])
def test_family_gguf_matches_llama_cpp(tmp_path, model_type, arch, permute, overrides, tiny_folder):
    """The same files (float32 throughout: llama.cpp's Q8_0 products round the activations
    to 8 bits) through llama.cpp itself, where llama-cpp-python is installed (an optional
    peer, in its own process): its logits equal fx-engine's up to float32 summation order.
    Measured with llama-cpp-python 0.3.36: max |diff| 9e-6 (granite) to 6e-3 (smollm3, of
    logits up to 29)."""
    import importlib.util
    import json

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (an optional peer) is not installed")
    folder = tiny_folder(model_type, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.setdefault("rms_norm_eps", cfg.get("norm_epsilon", cfg.get("layer_norm_eps", cfg.get("layer_norm_epsilon"))))
    cfg.setdefault("num_hidden_layers", cfg.get("num_layers"))  # (EXAONE 3's own name)
    if model_type in _NEOX_FAMILY:
        cfg = _neox_cfg(cfg)
    md = _common(cfg)
    if model_type in _NEOX_FAMILY:
        md = _neox_keys(model_type, cfg, md)
    if model_type in ("starcoder2", "cohere", "cohere2"):
        md["attention.layer_norm_epsilon"] = md.pop("attention.layer_norm_rms_epsilon")
    if model_type.startswith("cohere"):
        md["logit_scale"] = float(cfg["logit_scale"])
    if model_type == "cohere2":
        md.update({"attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
                   "attention.sliding_window": cfg["sliding_window"]})
    if model_type in ("exaone4", "glm4", "ernie4_5", "seed_oss"):
        md.update({"attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"]})
    if model_type == "glm4":
        md["rope.dimension_count"] = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    if model_type == "granite":
        md.update({"embedding_scale": float(cfg["embedding_multiplier"]),
                   "attention.scale": float(cfg["attention_multiplier"]),
                   "residual_scale": float(cfg["residual_multiplier"]), "logit_scale": float(cfg["logits_scaling"])})
    if model_type == "minicpm":
        md.update(_minicpm_keys(cfg))
    convert(folder, tmp_path / "m.gguf", arch, md, permute, q8_mlp=False, prepare=_NEOX_PREPARE.get(model_type))
    model = fx_engine.load(tmp_path / "m.gguf")
    ids = model.tokenizer.encode(LONG_TEXT)[:48]
    theirs, ours = llama_cpp_logits(tmp_path / "m.gguf", ids, tmp_path / "l.npy"), np.asarray(fx_engine.logits(model, ids))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3 * np.abs(theirs).max())


def _gpt_oss_gguf(folder: Path, out: Path, mxfp4: bool, kind: str = "MXFP4", matrices: bool = False) -> Path:
    """A tiny gpt_oss folder (mlx-lm's sanitized layout) as llama.cpp's converter writes
    it: the names from its TensorNameMap (sinks get ".weight", as the converter adds), its
    gpt-oss.* keys with YaRN, the expert stacks (and only them) in MXFP4 by the package's
    reference quantizer (matrices: the attention projections too, 2-D). Returns the oracle
    folder (the dequantized values)."""
    import json

    from gguf.quants import dequantize, quantize

    cfg = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    for key, value in {**_common(cfg), "expert_count": cfg["num_local_experts"],
                       "expert_used_count": cfg["num_experts_per_tok"],
                       "expert_feed_forward_length": cfg["intermediate_size"],
                       "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
                       "attention.sliding_window": cfg["sliding_window"],
                       "rope.scaling.factor": float(cfg["rope_scaling"]["factor"]),
                       "rope.scaling.original_context_length": cfg["rope_scaling"]["original_max_position_embeddings"]
                       }.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"gpt-oss.{key}", value)
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    add_tokenizer(w, folder, cfg["eos_token_id"])
    oracle = {}
    for name, x in sorted(mx.load(str(folder / "model.safetensors")).items()):
        x = np.asarray(x.astype(mx.float32))
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if name.endswith(".sinks"):
            target += ".weight"
        if mxfp4 and name.endswith(".weight") and (".experts." in name or (matrices and "_proj." in name
                                                                            and ".self_attn." in name)):
            qtype = gguf.GGMLQuantizationType[kind]
            q = quantize(x, qtype)
            w.add_tensor(target, q, raw_dtype=qtype)
            x = dequantize(q, qtype).reshape(x.shape)
        else:
            w.add_tensor(target, x)
        oracle[name] = x
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return write_oracle(folder, out.parent / "oracle", oracle)


@pytest.mark.parametrize("keep", [None, True], ids=["cpu-default", "kept"])
def test_mxfp4_matrices_kept_or_dequantized_match_mlx_lm(tmp_path, keep, tiny_folder):
    """2-D MXFP4 tensors (here gpt-oss's attention projections): kept packed in MLX's mxfp4
    mode where quantized weights are kept (keep_quantized=True, the GPU form:
    quantized_matmul), dequantized to float32 by the CPU default (no native kernel runs
    them); either way mlx-lm's logits on the file's dequantized values."""
    from mlx_lm.utils import load_model

    folder = tiny_folder("gpt_oss")
    oracle = _gpt_oss_gguf(folder, tmp_path / "m.gguf", True, matrices=True)
    model = fx_engine.load(tmp_path / "m.gguf", keep_quantized=keep)
    o = model.params.layers[0].o
    assert (o.quant.mode if o.quantized else "affine", o.quantized) == (("mxfp4", True) if keep else ("affine", False))
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])


@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4-experts", "float"])
def test_gpt_oss_gguf_matches_mlx_lm(tmp_path, mxfp4, tiny_folder):
    """gpt-oss as llama.cpp writes it: MXFP4 expert stacks kept packed (MLX's mxfp4 mode,
    gather_qmm; exact: the same codes and scales), attention sinks, biases, YaRN, sliding
    layers. mlx-lm's logits on the folder with the file's (dequantized) weights."""
    from mlx_lm.utils import load_model

    folder = tiny_folder("gpt_oss")
    oracle = _gpt_oss_gguf(folder, tmp_path / "m.gguf", mxfp4)
    model = fx_engine.load(tmp_path / "m.gguf")
    want = fx_engine.load(folder).config
    for field in ("layer_types", "sliding_window", "num_experts", "top_k", "head_dim", "num_kv_heads",
                  "rope_theta", "swiglu_limit"):
        assert getattr(model.config, field) == getattr(want, field), field
    assert model.config.rope_type == "yarn"
    down = model.params.layers[0].down
    assert (down.quant.mode if down.quantized else "affine") == ("mxfp4" if mxfp4 else "affine")
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])


def _deepseek_gguf(folder: Path, out: Path, split_kv_b: bool, gating: int | None = 2) -> Path:
    """A tiny deepseek_v3 folder as llama.cpp's converter writes deepseek2: names from its
    TensorNameMap; experts stacked; the correction bias as exp_probs_b.bias; kv_b_proj
    split into k_b [H, r, dn] and v_b [H, dv, r] with the MLA key/value lengths (newer
    converters), or kept whole (older ones); the MLP experts as Q8_0. gating: the
    expert_gating_func key (DeepSeek-V2's softmax 1; None: left out, as older V2 files).
    Returns the oracle."""
    import json

    from gguf.quants import dequantize, quantize

    cfg = json.loads((folder / "config.json").read_text())
    n, h, e = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["n_routed_experts"]
    dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n)
    w = gguf.GGUFWriter(str(out), "deepseek2")
    ys = cfg["rope_scaling"]
    md = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
          "block_count": n, "feed_forward_length": cfg["intermediate_size"], "attention.head_count": h,
          "attention.head_count_kv": h, "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
          "rope.freq_base": float(cfg["rope_theta"]), "attention.kv_lora_rank": r, "rope.dimension_count": dr,
          "expert_count": e,
          "expert_used_count": cfg["num_experts_per_tok"], "expert_shared_count": cfg["n_shared_experts"],
          "expert_feed_forward_length": cfg["moe_intermediate_size"],
          "leading_dense_block_count": cfg["first_k_dense_replace"],
          "expert_weights_scale": float(cfg["routed_scaling_factor"]),
          "rope.scaling.factor": float(ys["factor"]),
          "rope.scaling.original_context_length": ys["original_max_position_embeddings"],
          "rope.scaling.yarn_log_multiplier": 0.1 * float(ys["mscale_all_dim"])}
    if cfg["q_lora_rank"]:
        md["attention.q_lora_rank"] = cfg["q_lora_rank"]
    if gating is not None:
        md["expert_gating_func"] = gating
    if cfg.get("n_group") and gating == 2:  # (the grouped routing's keys: V3's converter writes them)
        md.update({"expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"]})
    if split_kv_b:  # MLA as one shared KV head over the latent
        md.update({"attention.head_count_kv": 1, "attention.key_length": r + dr, "attention.value_length": r,
                   "attention.key_length_mla": dn + dr, "attention.value_length_mla": dv})
    else:
        md.update({"attention.key_length": dn + dr, "attention.value_length": dv})
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"deepseek2.{key}", value)
    w.add_bool("deepseek2.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    w.add_string("deepseek2.rope.scaling.type", "yarn")
    add_tokenizer(w, folder, cfg["eos_token_id"])
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    oracle = dict(weights)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(n):
        m = f"model.layers.{i}.mlp."
        for proj, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            keys = [f"{m}experts.{j}.{proj}.weight" for j in range(e)]
            if keys[0] not in weights:
                continue
            packed = quantize(np.stack([weights.pop(k) for k in keys]), q8)
            w.add_tensor(f"blk.{i}.{gg}.weight", packed, raw_dtype=q8)
            deq = dequantize(packed, q8).reshape(e, *oracle[keys[0]].shape)
            for j, k in enumerate(keys):
                oracle[k] = deq[j]
        bias = weights.pop(m + "gate.e_score_correction_bias", None)
        if bias is not None:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", bias)
        kv_b = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        if split_kv_b:
            x = weights.pop(kv_b).reshape(h, dn + dv, r)
            w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(x[:, :dn].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(x[:, dn:]))
    for name, x in sorted(weights.items()):
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return write_oracle(folder, out.parent / "oracle", oracle)


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek2_gguf_matches_mlx_lm(tmp_path, split_kv_b, tiny_folder):
    """DeepSeek-V3-shaped MLA from llama.cpp's deepseek2 files (both kv_b layouts), grouped
    sigmoid routing with its bias, shared experts, a dense first layer, YaRN."""
    from mlx_lm.utils import load_model

    folder = tiny_folder("deepseek_v3")
    oracle = _deepseek_gguf(folder, tmp_path / "m.gguf", split_kv_b)
    model = fx_engine.load(tmp_path / "m.gguf")
    want = fx_engine.load(folder).config
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "num_experts", "top_k", "n_group", "topk_group", "moe_layers", "num_shared_experts"):
        assert getattr(model.config, field) == getattr(want, field), field
    assert abs(model.config.attn_scale - want.attn_scale) < 1e-6
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])


@pytest.mark.parametrize("gating", [1, None], ids=["softmax", "unsaid"])
def test_deepseek2_gguf_of_deepseek_v2_lite(tmp_path, gating, tiny_folder):
    """DeepSeek-V2-Lite's shape from llama.cpp's deepseek2 files: softmax routing (the
    expert_gating_func key 1, or no key, as llama.cpp reads older V2 files), no correction
    bias, one q_proj; against mlx-lm's deepseek_v2 on the folder holding the same weights."""
    from mlx_lm.utils import load_model

    folder = tiny_folder("deepseek_v2")
    oracle = _deepseek_gguf(folder, tmp_path / "m.gguf", split_kv_b=True, gating=gating)
    model = fx_engine.load(tmp_path / "m.gguf")
    assert (model.config.model_type, model.config.topk_method, model.config.q_lora_rank) == (
        "deepseek_v2", "greedy", None)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])


def _with_nextn_block(src: Path, dst: Path, arch: str) -> None:
    """src's GGUF with a NextN (MTP) module appended as newer llama.cpp converters keep it
    (GLM-4.7-Flash's deepseek2 files): block_count + 1, `<arch>.nextn_predict_layers` 1, the
    last block a full decoder layer (a copy of the last trunk block's tensors, perturbed)
    plus its blk.N.nextn.* tensors."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch)
    n = int(r.fields[f"{arch}.block_count"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", f"{arch}.block_count"):
            continue
        t = f.types[0]
        w.add_key_value(f.name, f.contents(), t, sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
    w.add_uint32(f"{arch}.block_count", n + 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    hidden = int(r.fields[f"{arch}.embedding_length"].contents())
    rng = np.random.default_rng(1)
    for t in r.tensors:
        raw = None if t.tensor_type in plain else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
        if t.name.startswith(f"blk.{n - 1}."):
            data = np.array(t.data)
            if raw is None:
                data = data + rng.normal(scale=0.5, size=data.shape).astype(data.dtype)
            w.add_tensor(f"blk.{n}." + t.name[len(f"blk.{n - 1}."):], data, raw_dtype=raw)
    for name, shape in (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)),
                        ("hnorm.weight", (hidden,)), ("shared_head_norm.weight", (hidden,))):
        w.add_tensor(f"blk.{n}.nextn.{name}", rng.normal(size=shape).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_deepseek2_gguf_with_its_nextn_block_runs_the_trunk_alone(tmp_path, tiny_folder):
    """llama.cpp counts a kept NextN (MTP) module in deepseek2's block_count (GLM-4.7-Flash,
    DeepSeek V3.2): the trunk runs block_count - nextn_predict_layers layers, the same logits
    as the file without it (run as a layer, the module changed every output, silently);
    a count that leaves no trunk is refused by name."""
    from mlx_lm.utils import load_model

    folder = tiny_folder("deepseek_v3")
    oracle = _deepseek_gguf(folder, tmp_path / "m.gguf", True)
    _with_nextn_block(tmp_path / "m.gguf", tmp_path / "nextn.gguf", "deepseek2")
    model = fx_engine.load(tmp_path / "nextn.gguf")
    assert model.config.num_layers == fx_engine.load(folder).config.num_layers
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])
    from fx_engine.core.config import ConfigError, trunk_layers
    md = {"deepseek2.block_count": 3, "deepseek2.nextn_predict_layers": 3}
    with pytest.raises(ConfigError, match="nextn_predict_layers"):
        trunk_layers(md, "deepseek2", "f.gguf")


def _glm4moe_gguf(folder: Path, out: Path, q8: bool = True) -> Path:
    """A tiny glm4_moe folder as llama.cpp writes glm4moe: TensorNameMap names, experts
    stacked as Q8_0, the correction bias as exp_probs_b.bias, partial RoPE as
    rope.dimension_count. Returns the oracle folder."""
    import json

    from gguf.quants import dequantize, quantize

    cfg = json.loads((folder / "config.json").read_text())
    n, e, hd = cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["head_dim"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n)
    w = gguf.GGUFWriter(str(out), "glm4moe")
    md = {**_common(cfg), "attention.key_length": hd, "attention.value_length": hd,
          "rope.dimension_count": int(hd * cfg["partial_rotary_factor"]), "expert_count": e,
          "expert_used_count": cfg["num_experts_per_tok"], "expert_shared_count": cfg["n_shared_experts"],
          "expert_feed_forward_length": cfg["moe_intermediate_size"],
          "leading_dense_block_count": cfg["first_k_dense_replace"],
          "expert_weights_scale": float(cfg["routed_scaling_factor"]), "expert_gating_func": 2,
          "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
          "nextn_predict_layers": 0}
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"glm4moe.{key}", value)
    w.add_bool("glm4moe.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    add_tokenizer(w, folder, cfg["eos_token_id"])
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    oracle = dict(weights)
    for i in range(n):
        m = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"{m}experts.{j}.{proj}.weight" for j in range(e)]
            if keys[0] not in weights:
                continue
            stack = np.stack([weights.pop(k) for k in keys])
            if not q8:
                w.add_tensor(f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight", stack)
                continue
            packed = quantize(stack, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight", packed,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = dequantize(packed, gguf.GGMLQuantizationType.Q8_0).reshape(e, *oracle[keys[0]].shape)
            for j, k in enumerate(keys):
                oracle[k] = deq[j]
        bias = weights.pop(m + "gate.e_score_correction_bias", None)
        if bias is not None:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", bias)
    for name, x in sorted(weights.items()):
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return write_oracle(folder, out.parent / "oracle", oracle)


@pytest.mark.parametrize("overrides", [{}, {"use_qk_norm": False, "attention_bias": False, "n_group": 1}],
                         ids=["qk-norm-bias", "plain"])
def test_glm4moe_gguf_matches_mlx_lm(tmp_path, overrides, tiny_folder):
    from mlx_lm.utils import load_model

    folder = tiny_folder("glm4_moe", **overrides)
    oracle = _glm4moe_gguf(folder, tmp_path / "m.gguf")
    model = fx_engine.load(tmp_path / "m.gguf")
    want = fx_engine.load(folder).config
    for field in ("num_experts", "top_k", "n_group", "topk_group", "moe_layers", "rope_dims", "qk_norm",
                  "qkv_bias", "shared_expert_intermediate_size", "routed_scaling_factor"):
        assert getattr(model.config, field) == getattr(want, field), field
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ref, _ = load_model(oracle)
    ref.set_dtype(mx.float32)
    _compare(fx_engine.logits(model, ids, chunk=40), ref(mx.array([ids]))[0])
