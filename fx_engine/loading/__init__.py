"""Shell-side loading: weights (GGUF, safetensors, MLX-quantized), tokenizer, chat template."""
