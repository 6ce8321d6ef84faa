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


def _tokenizer_json(vocab_size: int, specials: list[str] | None = None) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials or ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny model of any registered model_type (its family's example
    sizes, then `overrides`)."""
    from ..core.models import hf_family

    family = hf_family({"model_type": model_type, "text_config": {}}, "tiny_config")
    if model_type in family.wrappers:
        raise ValueError(f"tiny_config: {model_type!r} is a multimodal wrapper; write its text "
                         f"model ({family.wrappers[model_type][0]!r}) instead")
    if family.tiny_config is None:
        raise ValueError(f"tiny_config: the {family.name} family has no tiny example")
    return family.tiny_config(model_type, overrides)


def _weights(cfg: dict[str, Any], dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    """Random weights for every tensor of the family's checkpoint layout (Hugging Face
    names and shapes): center + scale * N(0, 1), keys split from `seed`."""
    from ..core.config import ConfigError
    from ..core.models import config_from_hf, hf_family

    family = hf_family(cfg)
    try:
        parsed = config_from_hf(cfg, "tiny")
    except ConfigError:  # a config the engine refuses (tests of the refusal): default weights
        parsed = config_from_hf(family.tiny_config(cfg["model_type"], {}), "tiny")
    layout = family.checkpoint_layout(parsed)
    keys = iter(mx.random.split(mx.random.key(seed), max(10_000, len(layout))))
    return {name: (spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys))).astype(dtype)
            for name, spec in layout.items()}


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
