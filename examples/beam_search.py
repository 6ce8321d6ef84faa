"""Beam search (width 4) over the pure steps: one compiled step forwards every beam, adds
the log-probabilities, keeps the best `width` continuations and reorders the cache rows by
parent with `fx_engine.take_rows`, all in one graph (no host sync inside a step).

    python -m examples.beam_search
"""

from __future__ import annotations

import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402


@fx_engine.jit
def beam_step(params, cache, tokens, scores, done, eos):
    """Forward each beam's last token, extend by every vocabulary token, keep the top
    `width`. A finished beam (done) has one continuation: `eos` again at no cost."""
    width = tokens.shape[0]
    logits, cache = fx_engine.logits_step(params, cache, tokens)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    vocab = mx.arange(logp.shape[-1])
    logp = mx.where(done[:, None], mx.where(vocab == eos, 0.0, -mx.inf), logp)
    total = (scores[:, None] + logp).reshape(-1)
    best = mx.argpartition(-total, width - 1)[:width]  # the `width` best, any order
    best = best[mx.argsort(-total[best])]
    parent, token = (best // logp.shape[-1]).astype(mx.int32), (best % logp.shape[-1]).astype(mx.int32)
    cache = fx_engine.take_rows(cache, parent)  # reorder the beams' caches by parent
    return cache, parent, token, total[best], done[parent] | (token == eos)


def beam_search(model, ids: list[int], width: int = 4, max_tokens: int = 16,
                eos: int | None = None) -> tuple[list[int], float]:
    """The best sequence of up to `max_tokens` tokens after `ids` by beam search, and its
    score (the sum of its tokens' log-probabilities). eos: the token that ends a beam
    (None: the model's first EOS id; -1: none, every beam runs max_tokens)."""
    eos = model.eos_ids[0] if eos is None else eos
    logits, cache, _ = fx_engine.prefill(model, [ids], room=max_tokens)
    logp = logits[0] - mx.logsumexp(logits[0])
    first = mx.argsort(-logp)[:width].astype(mx.int32)
    tokens, scores = first, logp[first]
    cache = fx_engine.repeat_rows(cache, width)  # one prefill, `width` rows
    done = tokens == eos
    seqs = [tokens]  # the tokens of each step; beams are reordered by `parents`
    parents = []
    for _ in range(max_tokens - 1):
        if done.all().item():
            break
        cache, parent, tokens, scores, done = beam_step(model.params, cache, tokens, scores, done, eos)
        mx.eval(fx_engine.tree_leaves(cache), tokens, scores, done)
        parents.append(parent)
        seqs.append(tokens)
    # backtrack the best beam (row 0: beam_step keeps the rows sorted by score)
    row, out = 0, []
    for t in range(len(seqs) - 1, -1, -1):
        out.append(seqs[t][row].item())
        if t:
            row = parents[t - 1][row].item()
    out.reverse()
    if eos in out:
        out = out[: out.index(eos) + 1]
    return out, scores[0].item()


def main() -> None:
    model = fx_engine.load()
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    out, score = beam_search(model, ids)
    print(f"{model.tokenizer.decode(out)!r}  (log-probability {score:.3f})")


if __name__ == "__main__":
    main()
