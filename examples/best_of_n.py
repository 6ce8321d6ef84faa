"""Best-of-n in one batch: prefill the prompt once, repeat its cache row n times, give
each row its own seed, decode all n together, keep the candidate with the best mean
log-probability.

    python -m examples.best_of_n
"""

from __future__ import annotations

import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402


def best_of_n(model, ids: list[int], n: int = 8, max_tokens: int = 16, temperature: float = 1.0,
              seed: int = 0, eos_ids=None) -> list[dict]:
    """n sampled completions of `ids` (one batch of n rows), best first: dicts with
    `tokens`, `logprobs` (each token's, as sampled) and `mean`. eos_ids: the tokens that
    end a row (None: the model's EOS ids; (): none)."""
    logits, cache, _ = fx_engine.prefill(model, [ids], room=max_tokens)
    cache = fx_engine.repeat_rows(cache, n)
    configs = [fx_engine.SamplingConfig(temperature=temperature, seed=seed + i) for i in range(n)]
    state = fx_engine.init_state(configs, [ids] * n, model.config.vocab_size)
    state = fx_engine.sample_step_compiled(state, fx_engine.repeat_rows(logits, n))
    stop = mx.array(list(model.eos_ids if eos_ids is None else eos_ids), mx.int32)
    tokens, logprobs, alive = [state.tokens], [state.logprob], [state.active]
    for _ in range(max_tokens - 1):
        state = fx_engine.stop_rows(state, (state.tokens[:, None] == stop).any(axis=1))
        if not state.active.any().item():
            break
        state, cache = fx_engine.decode_step_compiled(model.params, cache, state)
        mx.eval(fx_engine.tree_leaves(state), fx_engine.tree_leaves(cache))
        tokens.append(state.tokens), logprobs.append(state.logprob), alive.append(state.active)
    toks, lps, act = (mx.stack(x, axis=1).tolist() for x in (tokens, logprobs, alive))
    out = []
    for r in range(n):
        k = sum(act[r])  # the row's tokens: the first, then one per step while active
        out.append({"tokens": toks[r][:k], "logprobs": lps[r][:k], "mean": sum(lps[r][:k]) / k})
    return sorted(out, key=lambda c: -c["mean"])


def main() -> None:
    model = fx_engine.load()
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True)
    for c in best_of_n(model, ids, max_tokens=24)[:3]:
        print(f"{c['mean']:7.3f}  {model.tokenizer.decode(c['tokens'])!r}")


if __name__ == "__main__":
    main()
