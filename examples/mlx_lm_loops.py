"""The five loops of examples/ written with mlx-lm (0.32) for comparison (docs/loops.md).

mlx-lm's model is its own class (`mlx_lm.models.llama.Model`) holding the default model's
weights: mlx-lm cannot read the default GGUF (Q4_1), so `models()` hands it fx-engine's
tensors dequantized to float32 (tools/oracle.py, the suite's mlx-lm oracle). Its cache is
a list of mutable `KVCache` objects, one per layer, updated in place by `model(...)`.

    python -m examples.mlx_lm_loops
"""

from __future__ import annotations

import copy

import fx_engine

fx_engine.setup()  # before mlx is imported: MLX's CPU matmuls then use the optimized BLAS
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache  # noqa: E402


def models(model, draft_layers: int | None = None):
    """(mlx-lm model, mlx-lm draft of the first `draft_layers` layers or None) holding the
    fx-engine model's own weights."""
    from tools.oracle import mlx_lm_dense_from_fx

    ref = mlx_lm_dense_from_fx(model)
    if draft_layers is None:
        return ref, None
    return ref, mlx_lm_dense_from_fx(fx_engine.self_draft_model(model, draft_layers))


def _logp(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _prefill(ref, ids):
    cache = make_prompt_cache(ref)
    return ref(mx.array([ids]), cache=cache)[:, -1], cache


def _take(cache, idx):
    """Reorder / repeat the rows of every layer's KVCache (in place, by attributes)."""
    for c in cache:
        c.keys, c.values = c.keys[idx], c.values[idx]


def beam_search(ref, ids, width=4, max_tokens=16, eos=-1):
    logits, cache = _prefill(ref, ids)
    logp = _logp(logits[0])
    tokens = mx.argsort(-logp)[:width]
    scores, seqs = logp[tokens], [[t] for t in tokens.tolist()]
    _take(cache, mx.zeros((width,), mx.int32))
    for _ in range(max_tokens - 1):
        logp = _logp(ref(tokens[:, None], cache=cache)[:, -1])
        done = mx.array([s[-1] == eos for s in seqs])
        logp = mx.where(done[:, None], mx.where(mx.arange(logp.shape[-1]) == eos, 0.0, -mx.inf), logp)
        total = (scores[:, None] + logp).reshape(-1)
        best = mx.argsort(-total)[:width]
        parent, tokens = best // logp.shape[-1], best % logp.shape[-1]
        _take(cache, parent)
        scores = total[best]
        seqs = [seqs[p] + [t] for p, t in zip(parent.tolist(), tokens.tolist())]
        if all(s[-1] == eos for s in seqs):
            break
    out = seqs[0][: seqs[0].index(eos) + 1] if eos in seqs[0] else seqs[0]
    return out, scores[0].item()


def best_of_n(ref, ids, n=8, max_tokens=16, temperature=1.0, seed=0, eos_ids=(2,)):
    mx.random.seed(seed)
    logits, cache = _prefill(ref, ids)
    _take(cache, mx.zeros((n,), mx.int32))
    logp = _logp(mx.repeat(logits, n, axis=0) / temperature)
    toks, lps, alive = [], [], mx.ones((n,), mx.bool_)
    for _ in range(max_tokens):
        tok = mx.random.categorical(logp)
        toks.append(tok), lps.append(mx.take_along_axis(logp, tok[:, None], axis=-1)[:, 0] * alive)
        alive = alive & ~mx.array([t in eos_ids for t in tok.tolist()])
        if not alive.any().item():
            break
        logp = _logp(ref(tok[:, None], cache=cache)[:, -1] / temperature)
    toks, lps = mx.stack(toks, 1).tolist(), mx.stack(lps, 1).tolist()
    out = []
    for t, lp in zip(toks, lps):
        k = next((i + 1 for i, x in enumerate(t) if x in eos_ids), len(t))
        out.append({"tokens": t[:k], "logprobs": lp[:k], "mean": sum(lp[:k]) / k})
    return sorted(out, key=lambda c: -c["mean"])


def cfg_generate(ref, cond, uncond, scale=1.5, max_tokens=16, eos_ids=(2,)):
    (lc, cc), (lu, cu) = _prefill(ref, cond), _prefill(ref, uncond)
    cache = [BatchKVCache.merge([a, b]) for a, b in zip(cc, cu)]  # left-padded batch of 2
    out = []
    logits = mx.concatenate([lc, lu])
    while True:
        mixed = logits[1] + scale * (logits[0] - logits[1])
        out.append(mx.argmax(mixed).item())
        if out[-1] in eos_ids or len(out) == max_tokens:
            return out
        logits = ref(mx.array([[out[-1]], [out[-1]]]), cache=cache)[:, -1]


def speculative(ref, draft, prompts, k=3, max_tokens=16, eos_ids=(2,)):
    outs = []
    for ids in prompts:  # one prompt at a time: mlx-lm's speculative loop has one row
        out = []
        for tok, _, _ in speculative_generate_step(mx.array(ids), ref, draft, num_draft_tokens=k,
                                                   max_tokens=max_tokens):
            out.append(int(tok))
            if out[-1] in eos_ids:
                break
        outs.append(out)
    return outs


def entropy_fork(ref, ids, probe=12, branches=3, n=8):
    cache = make_prompt_cache(ref)
    tokens, ents, tops = [], [], []
    for tok, logp in generate_step(mx.array(ids), ref, max_tokens=probe, prompt_cache=cache):
        tokens.append(int(tok))
        ents.append(-(mx.exp(logp) * logp).sum().item())
        tops.append(mx.argsort(-logp)[:branches].tolist())
    at = max(range(probe), key=lambda i: ents[i])
    out = []
    for alt in tops[at]:  # fork: a deep copy of the whole cache per branch, rolled back
        c = copy.deepcopy(cache)
        trim_prompt_cache(c, c[0].offset - (len(ids) + at))
        rest = []
        for tok, _ in generate_step(mx.array([alt]), ref, max_tokens=n, prompt_cache=c):
            rest.append(int(tok))
        out.append(tokens[:at] + [alt] + rest)
    return {"tokens": tokens, "entropy": ents, "at": at, "alternatives": tops[at], "branches": out}


def main() -> None:
    model = fx_engine.load()
    ref, draft = models(model, model.config.num_layers - 2)
    chat = lambda q: model.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], add_generation_prompt=True)
    dec, eos = model.tokenizer.decode, tuple(model.eos_ids)
    print("beam:", repr(dec(beam_search(ref, chat("What is the capital of France?"), eos=eos[0])[0])))
    print("best-of-8:", repr(dec(best_of_n(ref, chat("Write a haiku about the sea."), eos_ids=eos)[0]["tokens"])))
    print("cfg:", repr(dec(cfg_generate(ref, chat("Describe the sea in the style of a pirate."),
                                        chat("Describe the sea."), 2.0, 32, eos))))
    print("speculative:", [dec(o) for o in speculative(ref, draft, [chat("Count from one to twenty.")],
                                                       eos_ids=eos)])
    res = entropy_fork(ref, chat("Tell me a story about a cat."))
    print("fork at", res["at"], [dec(b) for b in res["branches"]])


if __name__ == "__main__":
    main()
