"""An entropy-tracking loop that forks: decode greedily while recording each token's
entropy and top alternatives, then go back to the most uncertain token and fork the row
there into one row per alternative. The fork is a rollback by length
(`fx_engine.with_lengths`: exact, nothing copied) and a gather of rows
(`fx_engine.take_rows`); the branches then decode together as one batch.

    python -m examples.fork
"""

from __future__ import annotations

import attrs
import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402


@fx_engine.jit
def tracked_step(params, cache, state):
    """One decode step that also returns the entropy of the distribution the new token
    came from and its top-4 tokens."""
    logits, cache = fx_engine.logits_step(params, cache, state.tokens, state.active)
    return (fx_engine.sample_step(state, logits), cache) + _uncertainty(logits)


def _uncertainty(logits):
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(mx.exp(logp) * logp).sum(axis=-1), mx.argsort(-logits, axis=-1)[:, :4]


def track(model, ids: list[int], n: int, room: int):
    """n greedy tokens after `ids` (one row), with each token's entropy and top-4
    alternatives, the state after each token, and the final cache."""
    logits, cache, state = fx_engine.prefill(model, [ids], room=room)
    ent, top = _uncertainty(logits)
    tokens, ents, tops, states = [state.tokens.item()], [ent.item()], [top[0].tolist()], [state]
    for _ in range(n - 1):
        state, cache, ent, top = tracked_step(model.params, cache, state)
        mx.eval(fx_engine.tree_leaves((state, cache)), ent, top)
        tokens.append(state.tokens.item()), ents.append(ent.item()), tops.append(top[0].tolist())
        states.append(state)
    return tokens, ents, tops, states, cache


def fork(states, cache, prompt_len: int, at: int, alternatives: list[int]):
    """The row rolled back to just before token `at` was fed, as len(alternatives) rows,
    row j continuing from alternatives[j] (in place of the token chosen there)."""
    cache = fx_engine.with_lengths(cache, mx.array([prompt_len + at], mx.int32))
    rows = [0] * len(alternatives)
    cache, state = fx_engine.take_rows((cache, states[at]), rows)
    return attrs.evolve(state, tokens=mx.array(alternatives, mx.int32)), cache


def decode(model, state, cache, n: int) -> list[list[int]]:
    """n greedy tokens per row."""
    out = []
    for _ in range(n):
        state, cache = fx_engine.decode_step_compiled(model.params, cache, state)
        mx.eval(fx_engine.tree_leaves((state, cache)))
        out.append(state.tokens.tolist())
    return [list(r) for r in zip(*out)]


def entropy_fork(model, ids: list[int], probe: int = 12, branches: int = 3, n: int = 8) -> dict:
    """Decode `probe` tokens, fork at the most uncertain one into its top `branches`
    alternatives, decode n more tokens on every branch (one batch)."""
    room = probe + n + 1
    tokens, ents, tops, states, cache = track(model, ids, probe, room)
    at = max(range(probe), key=lambda i: ents[i])
    alts = tops[at][:branches]
    state, fcache = fork(states, cache, len(ids), at, alts)
    rest = decode(model, state, fcache, n)
    return {"tokens": tokens, "entropy": ents, "at": at, "alternatives": alts,
            "branches": [tokens[:at] + [a] + r for a, r in zip(alts, rest)],
            "states": states, "cache": cache}


def main() -> None:
    model = fx_engine.load()
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a cat."}], add_generation_prompt=True)
    res = entropy_fork(model, ids, probe=16, n=16)
    print(f"greedy: {model.tokenizer.decode(res['tokens'])!r}")
    print(f"most uncertain: token {res['at']} (entropy {res['entropy'][res['at']]:.2f} nats)")
    for b in res["branches"]:
        print(f"  branch: {model.tokenizer.decode(b)!r}")


if __name__ == "__main__":
    main()
