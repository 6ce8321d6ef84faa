"""Tiny target folders whose checkpoint ships MTP modules in the layouts fx_engine.testing.mtp's
`write_mtp_target` does not write: MiMo (model_type "mimo": a Qwen2 trunk, modules under
model.mtp_layers.{k}.*) and the Qwen3.5 multimodal wrappers (model_type "qwen3_5" /
"qwen3_5_moe" with text_config; the text model under model.language_model.*, the modules
under mtp.* at the top level, as Hugging Face ships Qwen/Qwen3.5-*).

`agree=True` builds a target and module that agree on every draft, chained ones included
(so acceptance is exact, not luck): the embedding table pairs tokens 2i and 2i + 1 through
R (a sign flip of the second half of the features, an orthogonal involution: e(pi(x)) =
R e(x) with pi swapping 2i and 2i + 1); the trunk's layers add nothing (every output
projection zero), its final norm is the identity and its head maps x to pi(x), so greedy
output alternates x, pi(x), x, ... The module's layer adds nothing either, its norms are
the identity and its projection reads the hidden half alone through R: over the target's
state of x_t it drafts x_t = x_{t+2}; over its own (normed, R-rotated) output it drafts
pi(x_t) = x_{t+3}, and so on: every chained draft is right too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from fx_engine.testing import write_tiny_model
from fx_engine.testing.mtp import tiny_mtp_tensors

# output projections of the trunk's and the module's layers: zero, the layer adds nothing
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def _agreeing(w: dict[str, mx.array], h: int, v: int, *, one_plus: bool, seed: int, proj: str,
              hidden_first: bool, norms: tuple[str, ...]) -> dict[str, mx.array]:
    """`w` (trunk and module tensors) made to agree (module docstring). one_plus: RMSNorms
    stored as w of 1 + w (Qwen3.5); proj: the module's [2H -> H] projection; norms: the
    norms set to the identity (the trunk's final norm, the module's)."""
    rng = np.random.default_rng(seed)
    flip = np.concatenate([np.ones(h // 2), -np.ones(h - h // 2)])
    base = rng.normal(0.0, 1.0, (v // 2, h))
    table = np.empty((v, h))
    table[0::2], table[1::2] = base, base * flip
    swap = np.arange(v).reshape(-1, 2)[:, ::-1].reshape(-1)
    out = dict(w)
    out["model.embed_tokens.weight"] = mx.array(table.astype(np.float32))
    out["lm_head.weight"] = mx.array(table[swap].astype(np.float32))
    for name in norms:
        out[name] = mx.zeros((h,)) if one_plus else mx.ones((h,))
    r = np.diag(flip)
    halves = [r, np.zeros((h, h))] if hidden_first else [np.zeros((h, h)), r]
    out[proj] = mx.array(np.concatenate(halves, axis=1).astype(np.float32))
    for name in list(out):
        if name.endswith(_OUTPUTS):
            out[name] = mx.zeros_like(out[name])
    return out


def write_mimo_target(folder: Any, *, seed: int = 0, module_seed: int | None = None, modules: int = 1,
                      agree: bool = False, **config: Any) -> Path:
    """A tiny MiMo folder (config.json model_type "mimo", architectures MiMoForCausalLM,
    num_nextn_predict_layers = modules) whose model.safetensors holds the trunk and the
    modules under model.mtp_layers.{k}.*, as XiaomiMiMo/MiMo-7B-* ship them."""
    cfg = {"tie_word_embeddings": False, "rope_theta": 640000.0, "num_nextn_predict_layers": modules, **config}
    folder = write_tiny_model(Path(folder), "mimo", seed=seed, **cfg)
    d = json.loads((folder / "config.json").read_text())
    trunk = dict(mx.load(str(folder / "model.safetensors")))
    mseed = seed + 1 if module_seed is None else module_seed
    module = {n: a for n, a in tiny_mtp_tensors("mimo", d, seed=mseed).items() if n.startswith("model.mtp_layers.")}
    w = {**trunk, **module}
    if agree:
        w = _agreeing(w, d["hidden_size"], d["vocab_size"], one_plus=False, seed=seed,
                      proj="model.mtp_layers.0.input_proj.weight", hidden_first=True,
                      norms=("model.norm.weight", *(f"model.mtp_layers.{k}.{n}" for k in range(modules)
                                                   for n in ("hidden_layernorm.weight", "token_layernorm.weight",
                                                             "final_layernorm.weight"))))
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "mlx"})
    return folder


def write_qwen3_5_wrapper_target(folder: Any, wrapper: str = "qwen3_5", *, seed: int = 0,
                                 module_seed: int | None = None, agree: bool = False, tied: bool = False,
                                 **config: Any) -> Path:
    """A tiny Qwen3.5 checkpoint as Hugging Face ships it: config.json {"model_type":
    wrapper, "text_config": {... mtp_num_hidden_layers: 1}}, the text model's tensors under
    model.language_model.*, lm_head.weight (unless tied), and its MTP module under mtp.*.
    `config` overrides the text config's fields."""
    text_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}[wrapper]
    if agree and tied:
        raise ValueError("write_qwen3_5_wrapper_target: an agreeing target has its own output head (tied=False)")
    folder = write_tiny_model(Path(folder), text_type, seed=seed, mtp_num_hidden_layers=1, tie_word_embeddings=tied,
                              **config)
    d = json.loads((folder / "config.json").read_text())
    trunk = dict(mx.load(str(folder / "model.safetensors")))
    mseed = seed + 1 if module_seed is None else module_seed
    module = {n: a for n, a in tiny_mtp_tensors(text_type, d, seed=mseed).items() if n.startswith("mtp.")}
    w = {**trunk, **module}
    if agree:
        w = _agreeing(w, d["hidden_size"], d["vocab_size"], one_plus=True, seed=seed, proj="mtp.fc.weight",
                      hidden_first=False, norms=("model.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                                                 "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"))
    wrapped = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: a
               for k, a in w.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), wrapped, metadata={"format": "mlx"})
    text = {k: v for k, v in d.items() if k not in ("model_type", "tie_word_embeddings")}
    (folder / "config.json").write_text(json.dumps({
        "model_type": wrapper, "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": tied, "text_config": {"model_type": text_type, **text}}, indent=1))
    return folder
