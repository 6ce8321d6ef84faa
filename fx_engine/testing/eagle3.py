"""Write tiny random EAGLE-3 heads in the published format (config.json + model.safetensors),
for tests of fx_engine.core.drafters.eagle3 (and users' own).

The layout is EAGLE's / SpecForge's: a flat Llama config with draft_vocab_size and
target_hidden_size; tensors fc, midlayer.* (q/k/v over 2H inputs), norm, lm_head
[draft_vocab, H], d2t (int64 offsets) and t2d (bool mask over the target vocabulary); with
norm_before_fc (top level or in eagle_config) input_norm [3 H_t], with fc_norm
fc_norm.{0,1,2} [H_t] (vLLM speculators' / NVIDIA's input norms).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

# where the layer's tensors live, per reference: EAGLE / SpecForge, vLLM (speculators), SGLang
NAME_STYLES = {"midlayer": "midlayer.", "layers.0": "layers.0.", "model.midlayer": "model.midlayer."}


def tiny_eagle3_config(target_hidden: int = 48, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny head for a target `target_hidden` wide (3 * target_hidden must
    differ from hidden_size: the references tell the two kinds of hidden input apart by width)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
           "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 2048, "vocab_size": 96, "draft_vocab_size": 40,
           "target_hidden_size": target_hidden, "tie_word_embeddings": False, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2}
    return {**cfg, **overrides}


def tiny_eagle3_tensors(cfg: dict[str, Any], *, seed: int = 0, style: str = "midlayer", embed: bool = False,
                        dtype: str = "float32") -> dict[str, mx.array]:
    """Random tensors of a head of config `cfg` under the `style`'s names: norms near 1,
    projections ~N(0, 0.15^2) (large enough that attention is not uniform), d2t / t2d a random
    sorted draft vocabulary. embed: also the head's own embed_tokens."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    ff, v, dv = cfg["intermediate_size"], cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    ht = cfg.get("target_hidden_size") or h
    pre = NAME_STYLES[style]
    top = "model." if style == "model.midlayer" else ""
    shapes = {top + "fc.weight": (h, 3 * ht), pre + "self_attn.q_proj.weight": (heads * hd, 2 * h),
              pre + "self_attn.k_proj.weight": (kv * hd, 2 * h), pre + "self_attn.v_proj.weight": (kv * hd, 2 * h),
              pre + "self_attn.o_proj.weight": (h, heads * hd), pre + "mlp.gate_proj.weight": (ff, h),
              pre + "mlp.up_proj.weight": (ff, h), pre + "mlp.down_proj.weight": (h, ff),
              "lm_head.weight": (dv, h)}
    norms = (pre + "input_layernorm.weight", pre + "hidden_norm.weight", pre + "post_attention_layernorm.weight",
             top + "norm.weight")
    if embed:
        shapes[top + "embed_tokens.weight"] = (v, h)
    rng = np.random.default_rng(seed)
    out = {n: rng.normal(0.0, 0.15, s) for n, s in shapes.items()}
    out.update({n: 1.0 + rng.normal(0.0, 0.1, (h,)) for n in norms})
    eagle = cfg.get("eagle_config") or {}
    if cfg.get("norm_before_fc") or eagle.get("norm_before_fc"):  # one norm over the 3 target states
        out[top + "input_norm.weight"] = 1.0 + rng.normal(0.0, 0.3, (3 * ht,))
    if cfg.get("fc_norm"):  # a norm on each target state
        out.update({f"{top}fc_norm.{i}.weight": 1.0 + rng.normal(0.0, 0.3, (ht,)) for i in range(3)})
    tensors = {n: mx.array(a.astype(np.float32)).astype(getattr(mx, dtype)) for n, a in out.items()}
    ids = np.sort(rng.choice(v, size=dv, replace=False))  # real heads: the most frequent target tokens, sorted
    mask = np.zeros(v, dtype=bool)
    mask[ids] = True
    tensors["d2t"] = mx.array((ids - np.arange(dv)).astype(np.int64))
    tensors["t2d"] = mx.array(mask)
    return tensors


def write_tiny_eagle3(folder: str | Path, target_hidden: int = 48, *, seed: int = 0, style: str = "midlayer",
                      embed: bool = False, dtype: str = "float32", **config: Any) -> Path:
    """Write a random EAGLE-3 head folder (config.json, model.safetensors); returns its path.
    `config` overrides config.json fields (tiny_eagle3_config's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_eagle3_config(target_hidden, **config)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        tiny_eagle3_tensors(cfg, seed=seed, style=style, embed=embed, dtype=dtype))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def read_eagle3_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """(config.json as a dict, every tensor of the folder's safetensors files)."""
    folder = Path(folder)
    tensors: dict[str, mx.array] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(mx.load(str(f)))
    return json.loads((folder / "config.json").read_text()), tensors


def write_echo_pair(folder: str | Path, *, layers: int = 6, seed: int = 0) -> tuple[Path, Path]:
    """A tiny Llama target and an EAGLE-3 head whose first draft is always right and whose
    chained drafts are wrong: for tests that need both accepted and rejected drafts.

    The target's layers add nothing (o_proj, down_proj zero) and its untied head maps token
    x to pi(x), pi swapping 2i and 2i + 1: greedy output alternates x, pi(x), x, ... The
    head's fc passes the first captured boundary through (the embedding of x_t), its layer
    adds nothing and its lm_head is the embedding table, so the draft after the pair
    (x_t, x_{t+1}) is x_t = x_{t+2} (right); a chained draft repeats it (x_{t+3} = pi(x_t):
    wrong). Returns (target folder, head folder)."""
    from fx_engine.testing.tiny import write_tiny_model

    folder = Path(folder)
    target = write_tiny_model(folder / "target", "llama", seed=seed, num_hidden_layers=layers,
                              tie_word_embeddings=False)
    w = dict(mx.load(str(target / "model.safetensors")))
    table = np.array(w["model.embed_tokens.weight"])
    v, h = table.shape
    swap = np.arange(v).reshape(-1, 2)[:, ::-1].reshape(-1)
    w["lm_head.weight"] = mx.array(table[swap])
    w["model.norm.weight"] = mx.ones((h,))
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = mx.zeros_like(w[name])
    mx.save_safetensors(str(target / "model.safetensors"), w, metadata={"format": "mlx"})

    head = folder / "head"
    head.mkdir(parents=True, exist_ok=True)
    cfg = tiny_eagle3_config(h, hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                             vocab_size=v, draft_vocab_size=v, intermediate_size=2 * h)
    t = {n: a for n, a in tiny_eagle3_tensors(cfg, seed=seed + 1).items() if n not in ("d2t", "t2d")}
    t["fc.weight"] = mx.array(np.concatenate([np.eye(h), np.zeros((h, 2 * h))], axis=1).astype(np.float32))
    t["midlayer.self_attn.o_proj.weight"] = mx.zeros_like(t["midlayer.self_attn.o_proj.weight"])
    t["midlayer.mlp.down_proj.weight"] = mx.zeros_like(t["midlayer.mlp.down_proj.weight"])
    t["lm_head.weight"] = mx.array(table)
    t["norm.weight"] = mx.ones((h,))
    mx.save_safetensors(str(head / "model.safetensors"), t)
    (head / "config.json").write_text(json.dumps(cfg, indent=1))
    return target, head


def write_eagle3_gguf(folder: str | Path, out: str | Path, target_layers: int, *, quant: str | None = None) -> Path:
    """The head folder as llama.cpp's converter writes it (`convert_hf_to_gguf.py HEAD
    --target-model-dir TARGET`: architecture eagle3): its Llama layer's hparams under eagle3.*,
    `eagle3.extract_layers` = (2, N // 2, N - 3) of the N-layer target (the converter derives
    them from the target, not the head's config), `eagle3.target_hidden_size`,
    `eagle3.norm_before_residual`; the layer as blk.0 (hidden_norm as attn_norm_2, q / k rows
    permuted as for any llama), fc.weight, output / output_norm / token_embd, d2t as the
    absolute target ids in I64 (t2d dropped), a llama3 RoPE's factors as rope_freqs.weight.
    quant: "Q8_0" for the matrices (else float32). Returns the path."""
    import gguf
    from gguf.quants import quantize

    cfg, tensors = read_eagle3_folder(folder)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), "eagle3")
    for key, value in {"block_count": 1, "context_length": cfg["max_position_embeddings"], "embedding_length": h,
                       "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
                       "attention.head_count_kv": kv, "vocab_size": cfg["vocab_size"], "rope.dimension_count": hd,
                       "attention.key_length": hd, "attention.value_length": hd,
                       "target_hidden_size": cfg.get("target_hidden_size") or h}.items():
        w.add_uint32(f"eagle3.{key}", value)
    w.add_float32("eagle3.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_float32("eagle3.rope.freq_base", float(cfg.get("rope_theta", 10000.0)))
    w.add_bool("eagle3.norm_before_residual", bool(cfg.get("norm_before_residual", False)))
    w.add_array("eagle3.extract_layers", [2, target_layers // 2, target_layers - 3])
    a = {n: np.asarray(t.astype(mx.float32)) if t.dtype != mx.int64 else np.asarray(t) for n, t in tensors.items()
         if n != "t2d"}

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"fc.weight": "fc.weight", "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight",
             "embed_tokens.weight": "token_embd.weight", "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
             "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
             "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
             "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
             "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
             "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight", "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
             "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight"}
    a["midlayer.self_attn.q_proj.weight"] = permute(a["midlayer.self_attn.q_proj.weight"], heads)
    a["midlayer.self_attn.k_proj.weight"] = permute(a["midlayer.self_attn.k_proj.weight"], kv)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, x in sorted(a.items()):
        if name == "d2t":
            w.add_tensor("d2t", (x + np.arange(x.size)).astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        elif quant == "Q8_0" and x.ndim == 2 and x.shape[1] % 32 == 0:
            w.add_tensor(names[name], quantize(x, q8), raw_dtype=q8)
        else:
            w.add_tensor(names[name], x)
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":  # the converter's generate_extra_tensors
        base, factor = float(cfg.get("rope_theta", 10000.0)), float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        factors = []
        for f in 1.0 / base ** (np.arange(0, hd, 2) / hd):
            wavelen = 2 * np.pi / f
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
