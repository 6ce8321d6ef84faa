"""Write tiny random-weight models as Hugging Face style folders (no hub needed).

Used by fx-engine's tests and usable in users' own: config.json, model.safetensors (random
weights, optionally split in shards), tokenizer.json (a byte-level BPE trained on a few
sentences), tokenizer_config.json with a ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and symbols !@#$%^&*() are tokens too.",
    "Ünïcödé text, emoji 🙂 and 中文 also appear.",
]


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


_GEMMA = {
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 3,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma4_text": {
        "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 6, "head_dim": 16,
        "global_head_dim": 32, "sliding_window": 16, "sliding_window_pattern": 3,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 384, "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True, "attention_k_eq_v": False, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "enable_moe_block": False,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    },
}


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 384,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg.update(_GEMMA.get(model_type, {}))
    cfg.update(overrides)
    if model_type == "qwen3":  # Qwen3 configs always state head_dim
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def _gemma_weights(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    """Random Gemma 3 / Gemma 4 text weights under mlx-lm's names, shapes from its config
    rules (global head_dim and KV heads, k_eq_v, KV-shared layers, double-wide MLPs)."""
    from fx_engine.core.config import gemma_config_from_hf

    c = gemma_config_from_hf(cfg, "tiny")
    keys = iter(mx.random.split(mx.random.key(seed), 10_000))

    def rand(*shape: int, scale: float = 0.08, center: float = 0.0) -> mx.array:
        return (center + scale * mx.random.normal(shape, key=next(keys))).astype(dtype)

    # Gemma 3 stores norms as (1 + w): small w; Gemma 4 stores the scale itself: near 1.
    ncenter = 1.0 if c.is_gemma4 else 0.0

    def norm(n: int) -> mx.array:
        return rand(n, scale=0.1, center=ncenter)

    h, v = c.hidden_size, c.vocab_size
    out: dict[str, mx.array] = {"model.embed_tokens.weight": rand(v, h, scale=0.5)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        d, hk, hq, ff = c.layer_head_dim(i), c.layer_kv_heads(i), c.num_heads, c.layer_intermediate(i)
        out[p + "self_attn.q_proj.weight"] = rand(hq * d, h)
        out[p + "self_attn.o_proj.weight"] = rand(h, hq * d)
        out[p + "self_attn.q_norm.weight"] = norm(d)
        if c.kv_source(i) == i:
            out[p + "self_attn.k_proj.weight"] = rand(hk * d, h)
            out[p + "self_attn.k_norm.weight"] = norm(d)
            if not c.k_eq_v(i):
                out[p + "self_attn.v_proj.weight"] = rand(hk * d, h)
        out[p + "mlp.gate_proj.weight"] = rand(ff, h)
        out[p + "mlp.up_proj.weight"] = rand(ff, h)
        out[p + "mlp.down_proj.weight"] = rand(h, ff)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            out[p + n + ".weight"] = norm(h)
        if c.hidden_size_per_layer_input:
            hpl = c.hidden_size_per_layer_input
            out[p + "per_layer_input_gate.weight"] = rand(hpl, h, scale=0.3)
            out[p + "per_layer_projection.weight"] = rand(h, hpl, scale=0.3)
            out[p + "post_per_layer_input_norm.weight"] = norm(h)
        if c.is_gemma4:
            out[p + "layer_scalar"] = rand(1, scale=0.1, center=1.0)
        if c.num_experts:  # Hugging Face's layout: fused gate|up stacks
            e, fm = c.num_experts, c.moe_intermediate_size
            out[p + "router.proj.weight"] = rand(e, h, scale=0.5)
            out[p + "router.scale"] = norm(h)
            out[p + "router.per_expert_scale"] = rand(e, scale=0.1, center=1.0)
            out[p + "experts.gate_up_proj"] = rand(e, 2 * fm, h)
            out[p + "experts.down_proj"] = rand(e, h, fm)
            for n in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                      "pre_feedforward_layernorm_2"):
                out[p + n + ".weight"] = norm(h)
    if c.hidden_size_per_layer_input:
        width = c.num_layers * c.hidden_size_per_layer_input
        out["model.embed_tokens_per_layer.weight"] = rand(v, width, scale=0.5)
        out["model.per_layer_model_projection.weight"] = rand(width, h, scale=0.3)
        out["model.per_layer_projection_norm.weight"] = norm(c.hidden_size_per_layer_input)
    out["model.norm.weight"] = norm(h)
    if not cfg.get("tie_word_embeddings", True):
        out["lm_head.weight"] = rand(v, h, scale=0.2)
    return out


def _weights(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    if cfg["model_type"] in _GEMMA:
        return _gemma_weights(cfg, dtype, seed)
    keys = iter(mx.random.split(mx.random.key(seed), 10_000))
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    ff, v = cfg["intermediate_size"], cfg["vocab_size"]
    mt = cfg["model_type"]
    qkv_bias = mt == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg.get("attention_bias", False) and mt != "qwen2"
    out: dict[str, mx.array] = {}

    def rand(*shape: int, scale: float = 0.08) -> mx.array:
        return (scale * mx.random.normal(shape, key=next(keys))).astype(dtype)

    out["model.embed_tokens.weight"] = rand(v, h, scale=0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = rand(heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = rand(kv * hd, h)
        out[p + "self_attn.v_proj.weight"] = rand(kv * hd, h)
        out[p + "self_attn.o_proj.weight"] = rand(h, heads * hd)
        if qkv_bias:
            out[p + "self_attn.q_proj.bias"] = rand(heads * hd)
            out[p + "self_attn.k_proj.bias"] = rand(kv * hd)
            out[p + "self_attn.v_proj.bias"] = rand(kv * hd)
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = rand(h)
        if mt == "qwen3":
            out[p + "self_attn.q_norm.weight"] = (1 + rand(hd)).astype(dtype)
            out[p + "self_attn.k_norm.weight"] = (1 + rand(hd)).astype(dtype)
        out[p + "mlp.gate_proj.weight"] = rand(ff, h)
        out[p + "mlp.up_proj.weight"] = rand(ff, h)
        out[p + "mlp.down_proj.weight"] = rand(h, ff)
        if cfg.get("mlp_bias", False):
            out[p + "mlp.gate_proj.bias"] = rand(ff)
            out[p + "mlp.up_proj.bias"] = rand(ff)
            out[p + "mlp.down_proj.bias"] = rand(h)
        out[p + "input_layernorm.weight"] = (1 + rand(h)).astype(dtype)
        out[p + "post_attention_layernorm.weight"] = (1 + rand(h)).astype(dtype)
    out["model.norm.weight"] = (1 + rand(h)).astype(dtype)
    if not cfg.get("tie_word_embeddings", True):
        out["lm_head.weight"] = rand(v, h, scale=0.2)
    return out


def write_tiny_model(
    folder: str | Path, model_type: str = "llama", *, dtype: str = "float32", seed: int = 0,
    shards: int = 1, quantize: dict[str, int] | None = None, **config: Any,
) -> Path:
    """Write a random-weight model folder; returns its path.

    quantize={"group_size": 32, "bits": 4} stores MLX affine-quantized linear and embedding
    weights with `.scales`/`.biases` and a `quantization` entry, as mlx-community does.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(model_type, **config)
    weights = _weights(cfg, getattr(mx, dtype), seed)
    if quantize:
        gs, bits = quantize["group_size"], quantize["bits"]
        for name in list(weights):
            w = weights[name]
            if name.endswith(".weight") and w.ndim == 2 and w.shape[1] % gs == 0:
                qw, s, b = mx.quantize(w, group_size=gs, bits=bits)
                weights[name] = qw
                base = name[: -len(".weight")]
                weights[base + ".scales"], weights[base + ".biases"] = s, b
        cfg["quantization"] = {"group_size": gs, "bits": bits}
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    else:
        index: dict[str, str] = {}
        for s in range(shards):
            part = {n: weights[n] for n in names[s::shards]}
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(folder / fname), part, metadata={"format": "mlx"})
            index.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index}, indent=1)
        )
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "tokenizer.json").write_text(_tokenizer_json(cfg["vocab_size"]))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))
    return folder
