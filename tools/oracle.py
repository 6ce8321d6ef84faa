"""mlx-lm as an independent oracle (test/tool code only; fx_engine never imports mlx-lm).

`mlx_lm_model(model)` builds mlx-lm's own model class holding exactly the tensors fx-engine
loaded: for HF folders mlx-lm loads the folder itself (its own loader); for GGUF files it
receives fx-engine's dequantized tensors (fused projections split back), since mlx-lm has
no GGUF reader for these quantization types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx


def _mlx_lm_config(cfg: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta,
        "rope_traditional": cfg.rope_traditional,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": bool(cfg.qkv_bias and cfg.o_bias), "mlp_bias": cfg.mlp_bias,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v
                             for k, v in dict(cfg.rope_scaling).items()}
    return d


def _mlx_lm_skeleton(cfg: Any) -> Any:
    from mlx_lm.utils import _get_classes

    d = _mlx_lm_config(cfg)
    model_cls, args_cls = _get_classes(d)
    return model_cls(args_cls.from_dict(d))


def _dense(lin: Any) -> mx.array:
    """A linear's weight as dense [out, in]: quantized ones dequantized with MLX's own
    mx.dequantize from float32 scales and biases (the values the native kernels compute
    with, bit for bit, whatever form the scales are stored in: nn.group_params)."""
    if lin.quantized:
        from fx_engine.core.nn import group_params

        q = lin.quant
        s, b = (a.astype(mx.float32) for a in group_params(q.scales, q.biases))
        return mx.dequantize(lin.weight, s, b, group_size=q.group_size, bits=q.bits)
    return lin.dense_out_in


def dense_hf_weights(model: Any) -> dict[str, mx.array]:
    """fx-engine's own weights under Hugging Face / mlx-lm names (fused matrices split), as
    dense arrays: exactly the values fx-engine computes with."""
    cfg, p = model.config, model.params
    hq, hk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    ff = cfg.intermediate_size
    w: dict[str, mx.array] = {"model.embed_tokens.weight": _dense(p.embed),
                              "model.norm.weight": p.norm}
    if p.lm_head is not None:
        w["lm_head.weight"] = _dense(p.lm_head)
    for i, lp in enumerate(p.layers):
        pre = f"model.layers.{i}."
        qkv = _dense(lp.qkv)
        w[pre + "self_attn.q_proj.weight"] = qkv[:hq]
        w[pre + "self_attn.k_proj.weight"] = qkv[hq : hq + hk]
        w[pre + "self_attn.v_proj.weight"] = qkv[hq + hk :]
        if lp.qkv.bias is not None:
            b = lp.qkv.bias
            w[pre + "self_attn.q_proj.bias"] = b[:hq]
            w[pre + "self_attn.k_proj.bias"] = b[hq : hq + hk]
            w[pre + "self_attn.v_proj.bias"] = b[hq + hk :]
        w[pre + "self_attn.o_proj.weight"] = _dense(lp.o)
        if lp.o.bias is not None:
            w[pre + "self_attn.o_proj.bias"] = lp.o.bias
        w[pre + "mlp.gate_proj.weight"] = _dense(lp.gate_up)[:ff]
        w[pre + "mlp.up_proj.weight"] = _dense(lp.gate_up)[ff:]
        if lp.gate_up.bias is not None:
            w[pre + "mlp.gate_proj.bias"] = lp.gate_up.bias[:ff]
            w[pre + "mlp.up_proj.bias"] = lp.gate_up.bias[ff:]
        w[pre + "mlp.down_proj.weight"] = _dense(lp.down)
        if lp.down.bias is not None:
            w[pre + "mlp.down_proj.bias"] = lp.down.bias
        w[pre + "input_layernorm.weight"] = lp.attn_norm
        w[pre + "post_attention_layernorm.weight"] = lp.mlp_norm
        if lp.q_norm is not None:
            w[pre + "self_attn.q_norm.weight"] = lp.q_norm
            w[pre + "self_attn.k_norm.weight"] = lp.k_norm
    return w


def mlx_lm_dense_from_fx(model: Any) -> Any:
    """mlx-lm Model holding fx-engine's own dense arrays (fused matrices split back)."""
    m = _mlx_lm_skeleton(model.config)
    m.load_weights(list(dense_hf_weights(model).items()), strict=True)
    mx.eval(m.parameters())
    return m


def write_hf_folder(model: Any, out: Path) -> Path:
    """Write `model` (e.g. the default GGUF) as a Hugging Face style folder in float32.

    config.json, model.safetensors, tokenizer.json and tokenizer_config.json (chat template,
    bos/eos): a folder that mlx-lm's loader (and so `mlx_lm.server`) and fx-engine both load,
    so that two servers can be compared on exactly the same weights and tokenizer.
    """
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _mlx_lm_config(model.config)
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="float32",
               bos_token_id=model.tokenizer.bos_id, eos_token_id=list(model.tokenizer.eos_ids))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.float32) for k, v in dense_hf_weights(model).items()},
                        metadata={"format": "mlx"})
    tok = model.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    name = tok.backend.id_to_token
    tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                          "add_bos_token": tok.add_bos, "clean_up_tokenization_spaces": False,
                          "model_max_length": model.config.max_position_embeddings}
    if tok.bos_id is not None:
        tc["bos_token"] = name(tok.bos_id)
    if tok.eos_ids:
        tc["eos_token"] = name(tok.eos_ids[0])
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return out


def mlx_lm_model(model: Any) -> Any:
    path = Path(model.path)
    if path.is_dir():
        from mlx_lm.utils import load_model

        ref, _ = load_model(path)
        ref.set_dtype(mx.float32)
        return ref
    return mlx_lm_dense_from_fx(model)


def mlx_lm_generate(ref: Any, prompt_ids: list[int], *, max_tokens: int, eos_ids: set[int],
                    sampling: dict[str, Any]) -> tuple[list[int], list[float], float]:
    """Run mlx-lm's own generate_step; returns (tokens, chosen logprobs, min greedy margin)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    s = dict(sampling)
    seed = s.pop("seed", None)
    sampler = make_sampler(
        temp=s.get("temperature", 0.0), top_p=s.get("top_p", 0.0) if s.get("top_p", 1.0) < 1 else 0.0,
        min_p=s.get("min_p", 0.0), top_k=s.get("top_k", 0),
        xtc_probability=s.get("xtc_probability", 0.0), xtc_threshold=s.get("xtc_threshold", 0.1),
        xtc_special_tokens=sorted(eos_ids),
    )
    processors = make_logits_processors(
        logit_bias={int(k): v for k, v in (s.get("logit_bias") or {}).items()} or None,
        repetition_penalty=s.get("repetition_penalty"),
        repetition_context_size=s.get("repetition_context_size", 20),
        presence_penalty=s.get("presence_penalty") or None,
        frequency_penalty=s.get("frequency_penalty") or None,
    )
    if seed is not None:
        mx.random.seed(seed)
    tokens, lps, margin = [], [], float("inf")
    for (tok, logprobs), _ in zip(
        generate_step(mx.array(prompt_ids), ref, max_tokens=max_tokens, sampler=sampler,
                      logits_processors=processors), range(max_tokens)
    ):
        tok = int(tok)
        top2 = mx.topk(logprobs, 2)
        margin = min(margin, abs(top2[1].item() - top2[0].item()))
        if tok in eos_ids:
            break
        tokens.append(tok)
        lps.append(float(logprobs[tok].item()))
    return tokens, lps, margin


def write_mlx_lm_adapter(model_path: str | Path, out: str | Path, *, rank: int = 4, scale: float = 2.0,
                         keys: list[str] | None = None, num_layers: int = -1, dora: bool = False,
                         seed: int = 0, init_scale: float = 0.05) -> Path:
    """An adapter folder exactly as `mlx_lm.lora` saves one (adapters.safetensors of the
    trainable parameters + adapter_config.json), made by mlx-lm's own `linear_to_lora_layers`
    on the model at `model_path`, with random non-zero lora_a / lora_b (and DoRA's m
    perturbed from its initial norm) instead of training steps."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(Path(model_path))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    mx.random.seed(seed)
    weights = {}
    for name, w in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_a") or name.endswith("lora_b"):
            w = init_scale * mx.random.normal(w.shape).astype(w.dtype)
        elif name.endswith(".m"):
            w = w * (1.0 + 0.1 * mx.random.uniform(shape=w.shape)).astype(w.dtype)
        weights[name] = w
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers,
        "lora_parameters": params, "model": str(model_path)}, indent=1))
    return out


def mlx_lm_with_adapter(model_path: str | Path, adapter: str | Path) -> Any:
    """mlx-lm's model with an adapter loaded by its own `load_adapters` (float32)."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(model_path))
    ref.set_dtype(mx.float32)
    load_adapters(ref, str(adapter))
    ref.set_dtype(mx.float32)
    return ref


def peft_from_mlx_lm(adapter: str | Path, out: str | Path, base: str = "base") -> Path:
    """The same adapter in PEFT's layout (adapter_model.safetensors with
    base_model.model.<module>.lora_A.weight [r, in] / lora_B.weight [out, r] /
    lora_magnitude_vector, and a LoraConfig adapter_config.json with lora_alpha = scale * r)."""
    import json

    adapter, out = Path(adapter), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    lp = cfg["lora_parameters"]
    tensors = mx.load(str(adapter / "adapters.safetensors"))
    peft, targets = {}, set()
    for name, w in tensors.items():
        mod, _, leaf = name.rpartition(".")
        targets.add(mod.rsplit(".", 1)[-1])
        key = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight", "m": "lora_magnitude_vector"}[leaf]
        peft[f"base_model.model.{mod}.{key}"] = w.T if leaf != "m" else w
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": lp["rank"], "lora_alpha": lp["scale"] * lp["rank"],
        "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none",
        "use_dora": cfg["fine_tune_type"] == "dora", "use_rslora": False, "fan_in_fan_out": False,
        "base_model_name_or_path": base, "task_type": "CAUSAL_LM"}, indent=1))
    return out
