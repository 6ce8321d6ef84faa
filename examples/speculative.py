"""A hand-written speculative loop: a drafter with its own cache (the model's first layers,
`fx_engine.self_draft_model`) proposes k tokens per row greedily, `verify_step` checks them
all in one target pass and accepts per row, and `draft_sync` says how far to roll the
drafter back, what to feed it next, and where a stop token cut an accepted run. Rows
(prompts) run together in one batch. Greedy output equals plain greedy decoding.

    python -m examples.speculative
"""

from __future__ import annotations

import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402


def speculative_generate(model, prompts: list[list[int]], draft=None, k: int = 3,
                         max_tokens: int = 16, stop_ids: list[int] | None = None) -> tuple[list[list[int]], dict]:
    """Greedy tokens per prompt (until a stop id, kept, or max_tokens) and counts
    (`accepted`, `proposed`, `verify_steps`). draft: a Model (None: the target's first
    layers but two). stop_ids: None, the model's EOS ids."""
    draft = draft or fx_engine.self_draft_model(model, model.config.num_layers - 2)
    room = max_tokens + 2 * k + 2
    _, cache, state = fx_engine.prefill(model, prompts, room=room)
    _, dcache, _ = fx_engine.prefill(draft, prompts, room=room)
    b, stop = len(prompts), list(model.eos_ids if stop_ids is None else stop_ids)
    out, done = [[t] for t in state.tokens.tolist()], [t in stop for t in state.tokens.tolist()]
    state = fx_engine.stop_rows(state, mx.array(done))
    feed, n_feed = state.tokens[:, None], mx.ones((b,), mx.int32)  # what the drafter lacks
    stats = {"accepted": 0, "proposed": 0, "verify_steps": 0}
    while not all(done[r] or len(out[r]) >= max_tokens for r in range(b)):
        # draft k tokens: first catch up on `feed` (1 or 2 tokens per row), then k - 1 more
        lg, dcache = fx_engine.logits_step_compiled(draft.params, dcache, feed, n_feed)
        lg = mx.take_along_axis(lg, (n_feed - 1).reshape(-1, 1, 1), axis=1)[:, 0]
        drafts = [mx.argmax(lg, axis=-1).astype(mx.int32)]
        for _ in range(k - 1):
            lg, dcache = fx_engine.logits_step_compiled(draft.params, dcache, drafts[-1])
            drafts.append(mx.argmax(lg, axis=-1).astype(mx.int32))
        last, n_draft = state.tokens, state.active.astype(mx.int32) * k
        state, cache, res = fx_engine.verify_step_compiled(model.params, cache, state,
                                                           mx.stack(drafts, axis=1), n_draft)
        sync = fx_engine.draft_sync(res, last, dcache.lengths, n_draft, stop_ids=stop)
        state = fx_engine.stop_rows(state, sync.stopped)
        dcache = fx_engine.with_lengths(dcache, sync.draft_lengths)  # roll the drafter back
        feed, n_feed = sync.feed, mx.maximum(sync.n_feed, 1)
        mx.eval(fx_engine.tree_leaves((state, cache, dcache)), feed, n_feed)
        for r, (toks, n, a, s) in enumerate(zip(res.tokens.tolist(), sync.count.tolist(),
                                                res.accepted.tolist(), sync.stopped.tolist())):
            if not done[r] and n:
                out[r] += toks[:n]
                stats["accepted"] += a
                stats["proposed"] += k
            done[r] = done[r] or s
        stats["verify_steps"] += 1
    return [o[:max_tokens] for o in out], stats


def main() -> None:
    model = fx_engine.load()
    chat = lambda q: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], add_generation_prompt=True)
    outs, stats = speculative_generate(model, [chat("Count from one to twenty."),
                                               chat("What is the capital of France?")], max_tokens=40)
    for o in outs:
        print(repr(model.tokenizer.decode(o)))
    print(stats)


if __name__ == "__main__":
    main()
