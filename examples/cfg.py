"""Classifier-free guidance: the conditional and the unconditional prompt are two rows of
one batch, forwarded together by one compiled step; the sampled row mixes their logits,
uncond + scale * (cond - uncond), and both rows are fed the chosen token. The scale is a
Python float traced as an array (`fx_engine.jit`): one compile serves every scale.

    python -m examples.cfg
"""

from __future__ import annotations

import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402


def _guide(state, logits, scale):
    """Sample the (1-row) state from the guided mixture of logits[0] (cond), logits[1]."""
    mixed = logits[1:] + scale * (logits[:1] - logits[1:])
    return fx_engine.sample_step(state, mixed), mixed


guide = fx_engine.jit(_guide)


@fx_engine.jit
def guided_step(params, cache, state, scale):
    """Both rows forward the last sampled token, then `guide`."""
    logits, cache = fx_engine.logits_step(params, cache, mx.repeat(state.tokens, 2))
    state, mixed = _guide(state, logits, scale)
    return state, cache, mixed


def cfg_generate(model, cond: list[int], uncond: list[int], scale: float = 1.5,
                 max_tokens: int = 16, config=None) -> tuple[list[int], list[mx.array]]:
    """Tokens generated under guidance (until EOS or max_tokens) and the guided logits
    [1, V] each was sampled from. config: the SamplingConfig (None: greedy)."""
    logits, cache, _ = fx_engine.prefill(model, [cond, uncond], room=max_tokens)
    state = fx_engine.init_state(config or fx_engine.SamplingConfig(), [cond], model.config.vocab_size)
    state, mixed = guide(state, logits, scale)
    out, seen = [state.tokens.item()], [mixed]
    while out[-1] not in model.eos_ids and len(out) < max_tokens:
        state, cache, mixed = guided_step(model.params, cache, state, scale)
        mx.eval(fx_engine.tree_leaves(state), fx_engine.tree_leaves(cache), mixed)
        out.append(state.tokens.item())
        seen.append(mixed)
    return out, seen


def main() -> None:
    model = fx_engine.load()
    chat = lambda q: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], add_generation_prompt=True)
    cond, uncond = chat("Describe the sea in the style of a pirate."), chat("Describe the sea.")
    for scale in (1.0, 2.0):
        out, _ = cfg_generate(model, cond, uncond, scale, max_tokens=32)
        print(f"scale {scale}: {model.tokenizer.decode(out)!r}")


if __name__ == "__main__":
    main()
