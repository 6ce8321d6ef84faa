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
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["add_bpe_tokenizer", "write_gemma_gguf"]

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
    add_bpe_tokenizer(w, folder, cfg["eos_token_id"])
    if cfg.get("bos_token_id") is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    w.add_bool("tokenizer.ggml.add_bos_token", bool(tc.get("add_bos_token", False)))
    if tc.get("chat_template"):
        w.add_string("tokenizer.chat_template", tc["chat_template"])
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
