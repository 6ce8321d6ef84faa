"""Write tiny Hugging Face folders (fx_engine.testing.tiny, .vision) as llama.cpp's converter
writes GGUF files, for tests that read GGUF against the folder they came from (needs the
`gguf` package, llama.cpp's gguf-py).

`add_bpe_tokenizer`: a folder's byte-level BPE tokenizer as GGUF metadata ("gpt2" model:
tokens by id, merges, control tokens = tokenizer.json's added tokens; the tiny folders'
GPT-2 split as the converter names it, "gpt-2"). `write_gemma_gguf`:
a Gemma 2 / Gemma 3 text model (a text-only folder, or a Gemma 3 multimodal folder's
text_config and language_model.* tensors) as llama.cpp's Gemma2Model / Gemma3Model writes
it: its gemma2.* / gemma3.* keys (Gemma 2's soft-capping values), tensor names, every norm
weight + 1 (stored as the scale itself), q/k/v and gate/up/down unfused and unpermuted
(Gemma rotates halves), with the folder's vocabulary and chat template.
`write_gemma4_gguf`: a Gemma 4 text folder as its Gemma4Model writes it (see there).
`write_llama_gguf`: a Llama text model (a text-only folder, or an Idefics3 / SmolVLM or
Mistral 3 folder's text_config and text model tensors) as llama.cpp's LlamaModel writes it:
llama.* keys, gguf-py's tensor names, the q/k rows permuted for interleaved RoPE.
`write_qwen2vl_gguf` / `write_qwen3vl_gguf`: a Qwen2(.5)-VL / Qwen3-VL folder's text model
as its Qwen2VLModel / Qwen3VLTextModel writes it (architecture qwen2vl / qwen3vl,
rope.dimension_sections; fx-engine does not read those architectures yet: the tests that
need them skip until it does).
`write_qwen3_next_gguf`: a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE folder (the text model, or a
Qwen3.5 multimodal wrapper's; its MTP module) as convert_hf_to_gguf.py's Qwen3NextModel /
Qwen3_5TextModel / Qwen3_5MoeTextModel write it (see its docstring). `write_lfm2_gguf`: an
LFM2 folder as its LFM2Model writes it; `write_granite_hybrid_gguf`: a Granite 4.0 hybrid
folder as its GraniteHybridModel writes it (the Mamba-2 mixers as its Mamba2Model does);
`write_nemotron_h_gguf`: a Nemotron-H folder as its NemotronHModel writes it;
`write_mamba2_gguf` / `write_falcon_h1_gguf`: a Mamba-2 / Falcon-H1 folder as its
Mamba2Model / FalconH1Model writes it (Falcon-H1's multipliers folded into the tensors).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["add_bpe_tokenizer", "write_falcon_h1_gguf", "write_gemma4_gguf", "write_gemma_gguf", "write_granite_hybrid_gguf", "write_lfm2_gguf",
           "write_llama_gguf", "write_mamba2_gguf", "write_nemotron_h_gguf", "write_qwen2vl_gguf", "write_qwen3_next_gguf",
           "write_qwen3vl_gguf"]

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
    writer.add_string("tokenizer.ggml.pre", "gpt-2")
    writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    writer.add_array("tokenizer.ggml.token_type", [3 if t in specials else 1 for t, _ in vocab])
    writer.add_array("tokenizer.ggml.merges",
                     [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", eos_id)


def write_gemma_gguf(folder: str | Path, out: str | Path, arch: str = "gemma3") -> Path:
    """The folder's Gemma 1 / 2 / 3 text model as one GGUF file at `out` (module docstring;
    Gemma 1's post_attention_layernorm, its MLP's input norm, as ffn_norm)."""
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
                           ("attention.sliding_window", w.add_uint32, cfg.get("sliding_window"))):
        if value is not None:
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
        for pat, rep in ((r"post_attention_layernorm", "ffn_norm"),) * (arch == "gemma") + _GEMMA_NAMES:
            name = re.sub(pat, rep, name)
        w.add_tensor(name, x)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_gemma4_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """A Gemma 4 text folder (its config listing layer_types) as convert_hf_to_gguf.py's
    Gemma4Model writes it (architecture gemma4): the global layers' head size as
    key_length / value_length and the sliding ones' as *_swa, the KV heads per layer where
    the global layers have their own count, feed_forward_length per layer with the
    double-wide MLP, the layer kinds as sliding_window_pattern (true: sliding), the RoPE
    bases per kind, the proportional RoPE as a rope_freqs tensor (1 on the rotated pairs,
    1e30 on the others), shared_kv_layers, embedding_length_per_layer_input; the norms as
    stored (Gemma 4 keeps the scale itself), gguf-py's tensor names, layer_scalar as
    layer_output_scale, the router's scale as ffn_gate_inp.scale and per-expert scale as
    ffn_down_exps.scale, the experts' fused gate_up stack as ffn_gate_up_exps. Tokenizer:
    the folder's byte-level BPE (`_add_tokenizer`). q8(hf_name, array) -> True: Q8_0."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    shared = cfg.get("num_kv_shared_layers") or 0
    rp = cfg["rope_parameters"]
    gd, hd = cfg["global_head_dim"], cfg["head_dim"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    w = gguf.GGUFWriter(str(out), "gemma4")
    a = "gemma4."
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", n), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.key_length", gd), ("attention.value_length", gd),
                       ("attention.key_length_swa", hd), ("attention.value_length_swa", hd),
                       ("attention.sliding_window", cfg["sliding_window"]), ("attention.shared_kv_layers", shared),
                       ("embedding_length_per_layer_input", cfg.get("hidden_size_per_layer_input") or 0),
                       ("rope.dimension_count", gd),
                       ("rope.dimension_count_swa", int(hd * rp["sliding_attention"].get("partial_rotary_factor", 1.0)))):
        w.add_uint32(a + key, value)
    ff = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        w.add_array(a + "feed_forward_length", [ff if i < n - shared else 2 * ff for i in range(n)])
    else:
        w.add_uint32(a + "feed_forward_length", ff)
    kv, gkv = cfg["num_key_value_heads"], cfg.get("num_global_key_value_heads")
    if gkv is not None:
        w.add_array(a + "attention.head_count_kv", [kv if t == "sliding_attention" else gkv for t in types])
    else:
        w.add_uint32(a + "attention.head_count_kv", kv)
    w.add_array(a + "attention.sliding_window_pattern", [t == "sliding_attention" for t in types])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", rp["full_attention"]["rope_theta"])
    w.add_float32(a + "rope.freq_base_swa", rp["sliding_attention"]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_float32(a + "final_logit_softcapping", cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        for key, value in (("expert_count", cfg["num_experts"]), ("expert_used_count", cfg["top_k_experts"]),
                           ("expert_feed_forward_length", cfg["moe_intermediate_size"])):
            w.add_uint32(a + key, value)
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))
    rotated = int(gd * rp["full_attention"].get("partial_rotary_factor", 1.0) / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (gd // 2 - rotated), np.float32))
    special = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
               "layer_scalar": "layer_output_scale.weight", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
               "experts.down_proj": "ffn_down_exps.weight"}
    for name, x in sorted(_folder_tensors(folder).items()):
        hit = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if hit and hit[2] in special:
            target = f"blk.{hit[1]}.{special[hit[2]]}"
        else:
            target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        _add_tensor(w, target, x, q8 is not None and x.ndim >= 2 and q8(name, x))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from half-split to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tensor(w: Any, target: str, x: np.ndarray, q8: bool) -> None:
    """`x` as tensor `target`: Q8_0 (gguf-py's reference quantizer) where asked and its rows
    are whole blocks of 32 (matrices and expert stacks), else as it is."""
    import gguf
    from gguf.quants import quantize

    if q8 and x.ndim in (2, 3) and x.shape[-1] % 32 == 0:
        w.add_tensor(target, quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(target, np.ascontiguousarray(x))


def _add_expert_stacks(add: Any, experts: dict[str, dict[int, np.ndarray]], hf_name: str, kind: Any) -> None:
    """The per-expert matrices gathered under "layer.proj" keys as llama.cpp's stacked
    blk.{i}.ffn_{kind(proj)}_exps tensors (experts in index order), through the writer's
    `add(hf_name, target, array)`."""
    for key, stack in sorted(experts.items()):
        i, proj = key.split(".")
        add(hf_name.format(i=i, proj=proj), f"blk.{i}.ffn_{kind(proj)}_exps.weight",
            np.stack([stack[j] for j in sorted(stack)]))


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


_QWEN3_NEXT_ARCHS = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe",
                     "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def _tiled_value_heads(x: np.ndarray, axis: int, nk: int, r: int, width: int) -> np.ndarray:
    """`x`'s value heads (`width` entries each along `axis`) from grouped order (key head i's
    j-th at i * r + j) to llama.cpp's tiled order (at j * nk + i)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(nk, r, width, *rest).swapaxes(0, 1).reshape(nk * r * width, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def write_qwen3_next_gguf(folder: str | Path, out: str | Path, *, q8: Any = None, mtp: str = "with") -> Path:
    """A Qwen3-Next / Qwen3.5 / Qwen3.5-MoE folder as llama.cpp's converter writes it
    (convert_hf_to_gguf.py's Qwen3NextModel, Qwen3_5TextModel, Qwen3_5MoeTextModel: architecture
    qwen3next / qwen35 / qwen35moe). Its keys: the ssm.* sizes (conv_kernel, state_size = the
    key head width, group_count = key heads, time_step_rank = value heads, inner_size = all
    value channels), full_attention_interval, rope.dimension_count (the rotated share of a
    head), qwen2moe's expert keys; qwen35*: rope.dimension_sections and, with an MTP module,
    nextn_predict_layers with block_count counting it. Its tensors, under gguf-py's names:
    every RMSNorm but the DeltaNet's + 1, A_log as -exp(A_log), dt_bias as ssm_dt.bias, the
    conv weight squeezed, Qwen3-Next's in_proj_qkvz split into attn_qkv (q | k | v) and
    attn_gate (z), experts stacked (Qwen3.5-MoE's gate_up_proj split); qwen35* with fewer key
    than value heads: the value heads in tiled order (in_proj_qkv's v rows, z, b, a, A, dt,
    the conv's v channels, out_proj's columns); the MTP module (qwen35* only: the qwen3next
    converter drops it) at blk.{N}: nextn.{eh_proj, enorm, hnorm, shared_head_norm} and its
    layer's usual names. mtp: "with" (the default), "none" (its --no-mtp) or "only" (its
    --mtp-only: the module with the tables and final norm, no trunk layer). q8(hf_name,
    array) -> True: that matrix (or expert stack, by its stacked name) as Q8_0 (gguf-py's
    reference quantizer; row transforms commute with it). Returns `out`."""
    import gguf

    folder, out = Path(folder), Path(out)
    raw = json.loads((folder / "config.json").read_text())
    cfg = {**raw, **raw.get("text_config", {})}
    arch = _QWEN3_NEXT_ARCHS[raw["model_type"]]
    v35 = arch != "qwen3next"
    n, hid = cfg["num_hidden_layers"], cfg["hidden_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or hid // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, x in mx.load(str(f)).items():
            for old, new in (("model.language_model.", "model."), ("model.mtp.", "mtp.")):
                if name.startswith(old):
                    name = new + name[len(old):]
            if name.startswith("mtp.") and (not v35 or mtp == "none"):
                continue
            if name.startswith("mtp."):  # _Qwen35MtpMixin.filter_tensors: as layer n's
                part = name.split(".")
                name = (f"model.layers.{n + int(part[2])}." + ".".join(part[3:]) if part[1] == "layers"
                        else f"model.layers.{n}.{nextn[part[1]]}.{part[2]}")
            elif mtp == "only" and name not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                continue
            if name.startswith(("model.", "lm_head.")):
                tensors[name] = np.asarray(x.astype(mx.float32))
    n_mtp = len({k.split(".")[2] for k in tensors if k.startswith("model.layers.") and int(k.split(".")[2]) >= n})
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n + n_mtp)
    w = gguf.GGUFWriter(str(out), arch)
    ints = {"context_length": cfg["max_position_embeddings"], "embedding_length": hid, "block_count": n + n_mtp,
            "feed_forward_length": cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            "attention.head_count": heads,
            "attention.head_count_kv": cfg["num_key_value_heads"], "attention.key_length": hd,
            "attention.value_length": hd, "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": dk,
            "ssm.group_count": nk, "ssm.time_step_rank": nv, "ssm.inner_size": dv * nv,
            "full_attention_interval": cfg.get("full_attention_interval", 4),
            "rope.dimension_count": int(hd * prf), "vocab_size": cfg["vocab_size"]}
    if cfg.get("num_experts"):
        ints.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "expert_shared_feed_forward_length": cfg.get("shared_expert_intermediate_size", 0)})
    if n_mtp:
        ints["nextn_predict_layers"] = n_mtp
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_float32(f"{arch}.rope.freq_base", float(theta))
    if v35:
        sections = list(rope.get("mrope_section", [11, 11, 10]))
        w.add_array(f"{arch}.rope.dimension_sections", sections + [0] * (4 - len(sections)))
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))

    def add(name: str, target: str, x: np.ndarray) -> None:
        _add_tensor(w, target, x, q8 is not None and q8(name, x))

    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in sorted(tensors.items()):
        if v35 and nk != nv and ".linear_attn." in name:  # _LinearAttentionVReorderBase
            if "in_proj_qkv." in name:
                x = np.concatenate([x[: 2 * nk * dk], _tiled_value_heads(x[2 * nk * dk :], 0, nk, r, dv)])
            elif "in_proj_z." in name:
                x = _tiled_value_heads(x, 0, nk, r, dv)
            elif "in_proj_b." in name or "in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                x = _tiled_value_heads(x, 0, nk, r, 1)
            elif "conv1d." in name:
                x = x.reshape(x.shape[0], -1)
                x = np.concatenate([x[: 2 * nk * dk], _tiled_value_heads(x[2 * nk * dk :], 0, nk, r, dv)])
            elif "out_proj." in name:
                x = _tiled_value_heads(x, 1, nk, r, dv)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors
            x = -np.exp(x)
        elif name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        elif "conv1d" in name:
            x = x.reshape(x.shape[0], -1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        m = re.match(r"model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm)\.weight$", name)
        if m:  # (gguf-py's NEXTN_* names, which its map may not list for the architecture)
            add(name, f"blk.{m[1]}.nextn.{m[2].replace('.', '_')}.weight", x)
            continue
        if name.endswith("in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> q | k | v, and z
            g = x.reshape(nk, 2 * dk + 2 * r * dv, hid)
            q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            blk = "blk." + name.split(".")[2]
            add(name, f"{blk}.attn_qkv.weight", np.concatenate([a.reshape(-1, hid) for a in (q, k, v)]))
            add(name, f"{blk}.attn_gate.weight", z.reshape(-1, hid))
            continue
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # (Qwen3.5-MoE: stacked)
            blk = "blk." + name.split(".")[2]
            if name.endswith("down_proj"):
                add(name, f"{blk}.ffn_down_exps.weight", x)
            else:
                f = x.shape[1] // 2
                add(name, f"{blk}.ffn_gate_exps.weight", x[:, :f])
                add(name, f"{blk}.ffn_up_exps.weight", x[:, f:])
            continue
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:  # Qwen2MoeModel: one stack per projection
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = x
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        add(name, target, x)
    _add_expert_stacks(add, experts, "model.layers.{i}.mlp.experts.{proj}", lambda proj: proj.split("_")[0])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_lfm2_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """An LFM2 folder as convert_hf_to_gguf.py's LFM2Model writes it (architecture lfm2):
    attention.head_count_kv per layer (0 on the convolution layers), shortconv.l_cache,
    feed_forward_length as the MLP's real width, gguf-py's tensor names (its map calls the
    final norm token_embd_norm), the conv weight squeezed to [C, K], nothing permuted.
    An LFM2-MoE folder as its LFM2MoeModel writes it (architecture lfm2moe): the same, plus
    expert_count, expert_used_count, expert_feed_forward_length, leading_dense_block_count
    and expert_gating_func (2: sigmoid), each routed layer's experts stacked as
    ffn_{gate,up,down}_exps (w1, w3, w2) and its expert_bias as exp_probs_b.bias.
    q8(hf_name, array) -> True: that matrix as Q8_0 (gguf-py's reference quantizer)."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    moe = cfg["model_type"] == "lfm2_moe"
    arch = "lfm2moe" if moe else "lfm2"
    n, hid = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = _folder_tensors(folder)
    attn = cfg.get("full_attn_idxs") or [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE if moe else gguf.MODEL_ARCH.LFM2, n)
    w = gguf.GGUFWriter(str(out), arch)
    ff = cfg["intermediate_size"] if moe else tensors["model.layers.0.feed_forward.w1.weight"].shape[0]
    ints = {"context_length": cfg["max_position_embeddings"], "embedding_length": hid, "block_count": n,
            "feed_forward_length": ff, "attention.head_count": cfg["num_attention_heads"],
            "vocab_size": cfg["vocab_size"], "shortconv.l_cache": cfg["conv_L_cache"]}
    if moe:
        ints.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "leading_dense_block_count": cfg["num_dense_layers"], "expert_gating_func": 2})
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv", [cfg["num_key_value_heads"] if i in attn else 0 for i in range(n)])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["norm_eps"]))
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.get("rope_theta", 1_000_000.0)))
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in sorted(tensors.items()):
        hit = re.match(r"model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$", name)
        if hit:  # (LFM2MoeModel.modify_tensors: stacked per layer and projection)
            experts.setdefault(f"{hit[1]}.{hit[3]}", {})[int(hit[2])] = x
            continue
        if name.endswith("conv.conv.weight"):
            x = x.reshape(x.shape[0], -1)  # LFM2Model.modify_tensors: squeeze(1)
        if name.endswith(".expert_bias"):
            name += ".bias"  # (LFM2MoeModel: the bias's gguf-py name is exp_probs_b.bias)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        _add_tensor(w, target, x, q8 is not None and q8(name, x))

    def add(hf: str, target: str, x: np.ndarray) -> None:
        _add_tensor(w, target, x, q8 is not None and q8(hf, x))

    _add_expert_stacks(add, experts, "model.layers.{i}.feed_forward.experts.{proj}",
                       lambda proj: {"w1": "gate", "w3": "up", "w2": "down"}[proj])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def _mamba2_tensor(name: str, x: np.ndarray, groups: int) -> tuple[str, np.ndarray]:
    """A Mamba-2 mixer tensor as Mamba2Model.modify_tensors writes it (its HF name for the
    name map): dt_bias as dt_proj.bias, -exp(A_log) and D as [H, 1], the conv weight
    squeezed, the gated norm's weight as [groups, inner / groups]."""
    if name.endswith(".dt_bias"):
        return name[: -len("dt_bias")] + "dt_proj.bias", x
    if name.endswith(".A_log"):
        return name, -np.exp(x).reshape(-1, 1)
    if name.endswith(".D"):
        return name, x.reshape(-1, 1)
    if name.endswith("conv1d.weight"):
        return name, x.reshape(x.shape[0], -1)
    if name.endswith("norm.weight") and (".mamba." in name or ".mixer." in name):
        return name, x.reshape(groups, -1)
    return name, x


def _mamba2_named(names: Any, name: str, x: np.ndarray, groups: int) -> tuple[str, np.ndarray]:
    """(gguf-py's name, array) of a Hugging Face tensor as the Mamba-2 converters write it
    (`_mamba2_tensor`); a name gguf-py does not map is an error."""
    hf, x = _mamba2_tensor(name, x, groups)
    target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    if target is None:
        raise ValueError(f"no llama.cpp name for {hf}")
    return target, x


def write_granite_hybrid_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """A Granite 4.0 hybrid folder as convert_hf_to_gguf.py's GraniteHybridModel writes it
    (architecture granitehybrid): attention.head_count_kv per layer (0 on Mamba-2 layers),
    Granite's multipliers as attention.scale / embedding_scale / residual_scale /
    logit_scale, the mixers' ssm.* sizes (time_step_rank: the mixer's heads), the q/k rows
    permuted (LlamaModel.permute), the experts' fused input_linear split into gate / up
    stacks, the shared MLP's input split (ffn_*_shexp, or ffn_* without experts), the mixers'
    tensors as Mamba2Model writes them. rope.scaling.finetuned says whether attention
    rotates: the converter sets it for Bamba checkpoints (Granite 4.0's hybrids run without
    RoPE); here it follows the folder's position_embedding_type, which agrees for those.
    q8(hf_name, array) -> True: that matrix (or expert stack) as Q8_0."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    n, hid = cfg["num_hidden_layers"], cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = [i for i, t in enumerate(cfg["layer_types"]) if t == "attention"]
    experts = cfg.get("num_local_experts") or 0
    rope = cfg.get("position_embedding_type", "rope") == "rope"
    inner = cfg["mamba_n_heads"] * cfg["mamba_d_head"]
    tensors = _folder_tensors(folder)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    for key, value in (("context_length", cfg["max_position_embeddings"] if rope else 2**20),
                       ("embedding_length", hid), ("block_count", n), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("vocab_size", cfg["vocab_size"]),
                       ("expert_count", experts), ("expert_used_count", cfg.get("num_experts_per_tok", 0) if experts else 0),
                       ("expert_shared_feed_forward_length", cfg.get("shared_intermediate_size", 0)),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.state_size", cfg["mamba_d_state"]),
                       ("ssm.group_count", cfg["mamba_n_groups"]), ("ssm.inner_size", inner),
                       ("ssm.time_step_rank", cfg["mamba_n_heads"])):
        w.add_uint32(f"granitehybrid.{key}", value)
    w.add_array("granitehybrid.attention.head_count_kv", [kv if i in attn else 0 for i in range(n)])
    for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                       ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"),
                       ("attention.layer_norm_rms_epsilon", "rms_norm_eps"), ("rope.freq_base", "rope_theta")):
        w.add_float32(f"granitehybrid.{key}", float(cfg[field]))
    w.add_bool("granitehybrid.rope.scaling.finetuned", rope)
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))

    def add(name: str, target: str, x: np.ndarray) -> None:
        _add_tensor(w, target, x, q8 is not None and q8(name, x))

    for name, x in sorted(tensors.items()):
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        blk = f"blk.{bid}"
        if name.endswith("block_sparse_moe.input_linear.weight"):  # GraniteMoeModel: [E, 2F, H] -> gate, up
            f = x.shape[1] // 2
            add(name, f"{blk}.ffn_gate_exps.weight", x[:, :f])
            add(name, f"{blk}.ffn_up_exps.weight", x[:, f:])
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            f, kind = x.shape[0] // 2, "shexp" if experts else ""
            add(name, f"{blk}.ffn_gate{'_' + kind if kind else ''}.weight", x[:f])
            add(name, f"{blk}.ffn_up{'_' + kind if kind else ''}.weight", x[f:])
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            add(name, f"{blk}.ffn_down.weight", x)
            continue
        if name.endswith("self_attn.q_proj.weight"):
            x = _llama_permute(x, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            x = _llama_permute(x, kv)
        add(name, *_mamba2_named(names, name, x, cfg["mamba_n_groups"]))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_nemotron_h_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """A Nemotron-H folder as convert_hf_to_gguf.py's NemotronHModel writes it: architecture
    nemotron_h_moe where the pattern routes experts (E layers), else nemotron_h; per-layer
    attention.head_count_kv (the * layers') and feed_forward_length (the - or E layers'),
    key/value lengths, the mixers' ssm.* sizes and tensors as Mamba2Model writes them, the
    q/k rows permuted (LlamaModel.permute), the routed experts stacked (up / down), the
    router's correction bias as exp_probs_b, the experts' keys. q8(hf_name, array) -> True:
    that matrix (or expert stack) as Q8_0."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    pattern, hid = cfg["hybrid_override_pattern"], cfg["hidden_size"]
    n, heads, kv = len(pattern), cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    moe = "E" in pattern
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    tensors = _folder_tensors(folder)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n)
    w = gguf.GGUFWriter(str(out), arch)
    ff = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]
    ints = {"context_length": 2**20, "embedding_length": hid, "block_count": n, "attention.head_count": heads,
            "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
            "vocab_size": cfg["vocab_size"], "ssm.conv_kernel": cfg["conv_kernel"],
            "ssm.state_size": cfg["ssm_state_size"], "ssm.group_count": cfg["n_groups"],
            "ssm.inner_size": cfg["mamba_num_heads"] * cfg["mamba_head_dim"], "ssm.time_step_rank": cfg["mamba_num_heads"]}
    if moe:
        ints.update({"expert_used_count": cfg["num_experts_per_tok"], "expert_feed_forward_length": ff,
                     "expert_shared_feed_forward_length": cfg["moe_shared_expert_intermediate_size"],
                     "expert_count": cfg["n_routed_experts"], "expert_shared_count": cfg.get("n_shared_experts", 0),
                     "expert_group_count": cfg["n_group"]})
        w.add_bool(f"{arch}.expert_weights_norm", bool(cfg["norm_topk_prob"]))
        w.add_float32(f"{arch}.expert_weights_scale", float(cfg["routed_scaling_factor"]))
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.head_count_kv", [kv if c == "*" else 0 for c in pattern])
    w.add_array(f"{arch}.feed_forward_length", [ff if c in "-E" else 0 for c in pattern])
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", float(cfg["layer_norm_epsilon"]))  # (TextModel: its key)
    w.add_bool(f"{arch}.rope.scaling.finetuned", False)
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))

    def add(name: str, target: str, x: np.ndarray) -> None:
        _add_tensor(w, target, x, q8 is not None and q8(name, x))

    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, x in sorted(tensors.items()):
        m = re.match(r"backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = x
            continue
        if name.endswith("mixer.gate.e_score_correction_bias"):
            add(name, f"blk.{name.split('.')[2]}.exp_probs_b.bias", x)
            continue
        if name.endswith(("mixer.q_proj.weight", "mixer.q_proj.bias")):
            x = _llama_permute(x, heads)
        elif name.endswith(("mixer.k_proj.weight", "mixer.k_proj.bias")):
            x = _llama_permute(x, kv)
        add(name, *_mamba2_named(names, name, x, cfg["n_groups"]))
    _add_expert_stacks(add, experts, "backbone.layers.{i}.mixer.experts.{proj}", lambda proj: proj)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def _folder_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a folder's safetensors, as float32 numpy arrays."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update({k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return tensors


def _write_named(w: Any, names: Any, tensors: dict[str, np.ndarray], groups: int, q8: Any) -> None:
    """Each (Hugging Face name, array) as the Mamba-2 converters write it (`_mamba2_tensor`)
    under gguf-py's name for it; q8(hf_name, array) -> True: that matrix as Q8_0."""
    for name, x in sorted(tensors.items()):
        target, x = _mamba2_named(names, name, x, groups)
        _add_tensor(w, target, x, q8 is not None and q8(name, x))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def write_mamba2_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """A Mamba-2 folder as convert_hf_to_gguf.py's Mamba2Model writes it (architecture mamba2):
    the ssm.* sizes (time_step_rank: inner / head_dim, the heads), head_count and
    feed_forward_length 0, one RMS eps, the mixers' tensors (`_mamba2_tensor`), the head
    only where the folder has one. The vocabulary must be a multiple of 16 (the converter
    pads the token list to one)."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg["vocab_size"] % 16:
        raise ValueError("write_mamba2_gguf: a vocabulary that is a multiple of 16 (the converter pads to one)")
    n, inner = cfg["num_hidden_layers"], cfg["num_heads"] * cfg["head_dim"]
    w = gguf.GGUFWriter(str(out), "mamba2")
    for key, value in (("context_length", 2**20), ("embedding_length", cfg["hidden_size"]),
                       ("feed_forward_length", 0), ("attention.head_count", 0), ("block_count", n),
                       ("ssm.conv_kernel", cfg["conv_kernel"]), ("ssm.inner_size", inner),
                       ("ssm.state_size", cfg["state_size"]), ("ssm.time_step_rank", inner // cfg["head_dim"]),
                       ("ssm.group_count", cfg["n_groups"])):
        w.add_uint32(f"mamba2.{key}", value)
    w.add_float32("mamba2.attention.layer_norm_rms_epsilon", float(cfg["layer_norm_epsilon"]))
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))
    _write_named(w, gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, n), _folder_tensors(folder), cfg["n_groups"], q8)
    return out


def write_falcon_h1_gguf(folder: str | Path, out: str | Path, *, q8: Any = None) -> Path:
    """A Falcon-H1 folder as convert_hf_to_gguf.py's FalconH1Model writes it (architecture
    falcon-h1): the attention's sizes, the mixers' ssm.* sizes, the mixers' tensors as its
    Mamba2Model writes them, q/k unpermuted, and the muP multipliers folded into the tensors
    by the name they contain: embed_tokens and lm_head, q / v (attention_in_multiplier), k
    (times key_multiplier too), o_proj, the mixers' in_proj (ssm_in_multiplier, then the z,
    x, B, C, dt row blocks' ssm_multipliers) and out_proj, the MLP's gate and down. (The
    converter scales a bias as its weight, and cannot write an in_proj bias: refused.)"""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    n, arch = cfg["num_hidden_layers"], "falcon-h1"
    inner, gn = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
    ai, (gm, dm), zx = cfg["attention_in_multiplier"], cfg["mlp_multipliers"], cfg["ssm_multipliers"]
    tensors = _folder_tensors(folder)
    for name, x in tensors.items():
        if "in_proj" in name and x.ndim == 1:
            raise ValueError("write_falcon_h1_gguf: the converter cannot write an in_proj bias")
        scale = next((s for key, s in (("down_proj", dm), ("gate_proj", gm), ("k_proj", cfg["key_multiplier"] * ai),
                                       ("q_proj", ai), ("v_proj", ai), ("o_proj", cfg["attention_out_multiplier"]),
                                       ("out_proj", cfg["ssm_out_multiplier"]), ("in_proj", cfg["ssm_in_multiplier"]),
                                       ("lm_head", cfg["lm_head_multiplier"]),
                                       ("embed_tokens", cfg["embedding_multiplier"])) if key in name), 1.0)
        x = x * scale
        if "in_proj" in name:  # the z, x, B, C, dt row blocks
            bounds = (0, inner, 2 * inner, 2 * inner + gn, 2 * inner + 2 * gn, x.shape[0])
            x = np.concatenate([x[a:b] * m for a, b, m in zip(bounds, bounds[1:], zx)])
        tensors[name] = x
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", n), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("ssm.conv_kernel", cfg["mamba_d_conv"]), ("ssm.inner_size", inner),
                       ("ssm.state_size", cfg["mamba_d_state"]), ("ssm.time_step_rank", inner // cfg["mamba_d_head"]),
                       ("ssm.group_count", cfg["mamba_n_groups"]), ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_float32(f"{arch}.rope.freq_base", float(cfg["rope_theta"]))
    _add_tokenizer(w, folder, cfg["eos_token_id"], cfg.get("bos_token_id"))
    _write_named(w, gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, n), tensors, cfg["mamba_n_groups"], q8)
    return out
