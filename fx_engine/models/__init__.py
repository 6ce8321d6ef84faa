"""Pure model forward functions, one module per architecture family."""

from .llama import LayerParams, Params, forward, hidden_to_logits

__all__ = ["LayerParams", "Params", "forward", "hidden_to_logits"]
