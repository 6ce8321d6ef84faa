"""Write tiny Hugging Face folders (fx_engine.testing.tiny, .vision) as llama.cpp's converter
writes GGUF files, for tests that read GGUF against the folder they came from (needs the
`gguf` package, llama.cpp's gguf-py).

`add_bpe_tokenizer`: a folder's byte-level BPE tokenizer as GGUF metadata ("gpt2" model:
tokens by id, merges, control tokens = tokenizer.json's added tokens). `write_gemma_gguf`:
a Gemma 2 / Gemma 3 text model (a text-only folder, or a Gemma 3 multimodal folder's
text_config and language_model.* tensors) as llama.cpp's Gemma2Model / Gemma3Model writes
it: its gemma2.* / gemma3.* keys (Gemma 2's soft-capping values), tensor names, every norm
weight + 1 (stored as the scale itself), q/k/v and gate/up/down unfused and unpermuted
(Gemma rotates halves), with the folder's vocabulary and chat template.
`write_llama_gguf`: a Llama text model (a text-only folder, or an Idefics3 / SmolVLM or
Mistral 3 folder's text_config and text model tensors) as llama.cpp's LlamaModel writes it:
llama.* keys, gguf-py's tensor names, the q/k rows permuted for interleaved RoPE.
`write_qwen2vl_gguf` / `write_qwen3vl_gguf`: a Qwen2(.5)-VL / Qwen3-VL folder's text model
as its Qwen2VLModel / Qwen3VLTextModel writes it (architecture qwen2vl / qwen3vl,
rope.dimension_sections; fx-engine does not read those architectures yet: the tests that
need them skip until it does).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["add_bpe_tokenizer", "write_gemma_gguf", "write_llama_gguf", "write_qwen2vl_gguf", "write_qwen3vl_gguf"]

_GEMMA_NAMES = (
    (r"^(language_model\.)?model\.embed_tokens\.", "token_embd."), (r"^(language_model\.)?model\.norm\.", "output_norm."),
    (r"^(language_model\.)?lm_head\.", "output."), (r"^(language_model\.)?model\.layers\.(\d+)\.", r"blk.\2."),
    (r"input_layernorm", "attn_norm"), (r"self_attn\.q_norm", "attn_q_norm"), (r"self_attn\.k_norm", "attn_k_norm"),
    (r"self_attn\.q_proj", "attn_q"), (r"self_attn\.k_proj", "attn_k"), (r"self_attn\.v_proj", "attn_v"),
    (r"self_attn\.o_proj", "attn_output"), (r"post_attention_layernorm", "post_attention_norm"),
    (r"pre_feedforward_layernorm", "ffn_norm"), (r"post_feedforward_layernorm", "post_ffw_norm"),
    (r"mlp\.gate_proj", "ffn_gate"), (r"mlp\.up_proj", "ffn_up"), (r"mlp\.down_proj", "ffn_down"),
)


def add_bpe_tokenizer(writer: Any, folder: str | Path, eos_id: int) -> None:
    """`folder`'s tokenizer.json as GGUF tokenizer metadata (see the module docstring)."""
    tok = json.loads((Path(folder) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    writer.add_array("tokenizer.ggml.token_type", [3 if t in specials else 1 for t, _ in vocab])
    writer.add_array("tokenizer.ggml.merges",
                     [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", eos_id)


def write_gemma_gguf(folder: str | Path, out: str | Path, arch: str = "gemma3") -> Path:
    """The folder's Gemma 2 / 3 text model as one GGUF file at `out` (module docstring)."""
    import gguf

    folder, out = Path(folder), Path(out)
    raw = json.loads((folder / "config.json").read_text())
    cfg = raw.get("text_config", raw)  # (a multimodal folder: its text model)
    w = gguf.GGUFWriter(str(out), arch)
    for key, fn, value in (("context_length", w.add_uint32, cfg["max_position_embeddings"]),
                           ("embedding_length", w.add_uint32, cfg["hidden_size"]),
                           ("block_count", w.add_uint32, cfg["num_hidden_layers"]),
                           ("feed_forward_length", w.add_uint32, cfg["intermediate_size"]),
                           ("attention.head_count", w.add_uint32, cfg["num_attention_heads"]),
                           ("attention.head_count_kv", w.add_uint32, cfg["num_key_value_heads"]),
                           ("attention.layer_norm_rms_epsilon", w.add_float32, cfg["rms_norm_eps"]),
                           ("attention.key_length", w.add_uint32, cfg["head_dim"]),
                           ("attention.value_length", w.add_uint32, cfg["head_dim"]),
                           ("rope.freq_base", w.add_float32, cfg["rope_theta"]),
                           ("attention.sliding_window", w.add_uint32, cfg["sliding_window"])):
        fn(f"{arch}.{key}", value)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))
    for name, x in sorted(mx.load(str(folder / "model.safetensors")).items()):
        if "text_config" in raw and not name.startswith("language_model."):
            continue  # (the vision tower and projector: the mmproj file's)
        x = np.asarray(x.astype(mx.float32))
        if name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        for pat, rep in _GEMMA_NAMES:
            name = re.sub(pat, rep, name)
        w.add_tensor(name, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from half-split to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(w: Any, folder: Path, eos: Any, bos: int | None) -> None:
    """The folder's byte-level BPE vocabulary, its BOS / EOS ids, add_bos_token and chat
    template as the GGUF tokenizer.* keys llama.cpp's converters write."""
    add_bpe_tokenizer(w, folder, eos)
    if bos is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", bos)
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    w.add_bool("tokenizer.ggml.add_bos_token", bool(tc.get("add_bos_token", False)))
    if tc.get("chat_template"):
        w.add_string("tokenizer.chat_template", tc["chat_template"])


def write_llama_gguf(folder: str | Path, out: str | Path) -> Path:
    """The folder's Llama text model as one GGUF file at `out` (module docstring); an
    Idefics3 / SmolVLM folder's vision tower and connector are left to its mmproj."""
    return _write_text_gguf(folder, out, "llama")


def write_qwen2vl_gguf(folder: str | Path, out: str | Path) -> Path:
    """A Qwen2-VL / Qwen2.5-VL folder's text model as llama.cpp's Qwen2VLModel writes it:
    architecture qwen2vl, the qwen2vl.* keys with M-RoPE's rope.dimension_sections (the
    folder's mrope_section padded with zeros to 4), q / k unpermuted (Qwen rotates halves);
    the vision tower is left to its mmproj."""
    return _write_text_gguf(folder, out, "qwen2vl")


def write_qwen3vl_gguf(folder: str | Path, out: str | Path) -> Path:
    """A Qwen3-VL folder's text model as llama.cpp's Qwen3VLTextModel writes it: architecture
    qwen3vl (Qwen3's q / k norms), rope.dimension_sections and n_deepstack_layers; a
    Qwen3-VL-MoE folder's as its Qwen3VLMoeTextModel: architecture qwen3vlmoe, the expert
    keys, the fused experts split into ffn_gate_exps / ffn_up_exps / ffn_down_exps stacks."""
    mt = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    return _write_text_gguf(folder, out, "qwen3vlmoe" if mt == "qwen3_vl_moe" else "qwen3vl")


def _write_text_gguf(folder: str | Path, out: str | Path, arch: str) -> Path:
    import gguf

    folder, out = Path(folder), Path(out)
    raw = json.loads((folder / "config.json").read_text())
    cfg = raw.get("text_config", raw)
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    for key, fn, value in (("context_length", w.add_uint32, cfg["max_position_embeddings"]),
                           ("embedding_length", w.add_uint32, cfg["hidden_size"]),
                           ("block_count", w.add_uint32, cfg["num_hidden_layers"]),
                           ("feed_forward_length", w.add_uint32, cfg["intermediate_size"]),
                           ("rope.dimension_count", w.add_uint32, head_dim),
                           ("attention.key_length", w.add_uint32, head_dim),
                           ("attention.value_length", w.add_uint32, head_dim),
                           ("attention.head_count", w.add_uint32, heads),
                           ("attention.head_count_kv", w.add_uint32, kv),
                           ("attention.layer_norm_rms_epsilon", w.add_float32, cfg["rms_norm_eps"]),
                           ("rope.freq_base", w.add_float32, cfg.get("rope_theta", 10000.0)),
                           ("vocab_size", w.add_uint32, raw.get("vocab_size", cfg["vocab_size"]))):
        fn(f"{arch}.{key}", value)
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        sections = list(rope["mrope_section"])
        w.add_array(f"{arch}.rope.dimension_sections", sections + [0] * max(0, 4 - len(sections)))
    if arch in ("qwen3vl", "qwen3vlmoe"):
        w.add_uint32(f"{arch}.n_deepstack_layers", len(raw["vision_config"].get("deepstack_visual_indexes", [])))
    if arch == "qwen3vlmoe":
        for key, value in (("expert_count", cfg["num_experts"]), ("expert_used_count", cfg["num_experts_per_tok"]),
                           ("expert_feed_forward_length", cfg["moe_intermediate_size"])):
            w.add_uint32(f"{arch}.{key}", value)
    _add_tokenizer(w, folder, raw.get("eos_token_id", cfg["eos_token_id"]), cfg.get("bos_token_id"))
    for name, x in sorted(mx.load(str(folder / "model.safetensors")).items()):
        # (a multimodal folder's text model: Idefics3's, transformers >= 4.52's, earlier ones')
        for old, new in (("model.text_model.", "model."), ("model.language_model.", "model."),
                         ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                name = new + name[len(old):]
        if not name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
            continue  # (a vision tower and connector: the mmproj file's)
        x = np.asarray(x.astype(mx.float32))
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # (Qwen3-VL-MoE: x @ W)
            blk = "blk." + name[len("model.layers."):].split(".", 1)[0]
            if name.endswith("down_proj"):
                w.add_tensor(f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(x.transpose(0, 2, 1)))
            else:
                f = x.shape[2] // 2
                w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(x[..., :f].transpose(0, 2, 1)))
                w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(x[..., f:].transpose(0, 2, 1)))
            continue
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            x = _llama_permute(x, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            x = _llama_permute(x, kv)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        w.add_tensor(target, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out
