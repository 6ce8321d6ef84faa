"""Shell-side loading: weights (GGUF, safetensors, MLX-quantized), tokenizer, chat template."""

from fx_engine.runtime import setup

setup()  # a shell entry point: process set-up (BLAS, malloc) before mlx is imported
