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
    cfg.update(overrides)
    if model_type == "qwen3":  # Qwen3 configs always state head_dim
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def _weights(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
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
