#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a target model on the CPU with MLX (issue 45, item 3).

    python tools/drafter_data.py --out data.npz                 # the target's own answers
    python tools/train_drafter.py --data data.npz --out DIR     # DIR: config.json, model.safetensors, recipe.json

The head is written in EAGLE-3's published format (fx_engine/core/drafters/eagle3.py loads
it, as it loads SafeAILab's, SpecForge's and vLLM's heads): an fc over three of the target's
hidden states (the residual stream entering layers 2, N // 2 and N - 3), one Llama decoder
layer over [embedding; hidden], a norm and an lm_head over a draft vocabulary (the
`--draft-vocab` most frequent tokens of the data; d2t / t2d map it to the target's ids).
The head uses the target's embedding table (not saved), as EAGLE-3 does.

Training follows EAGLE-3's "training-time test": the head is unrolled `--steps` times.
Step 0 at position t takes the target's states a_t and the token x_{t+1} and predicts
x_{t+2}; step k at position t + k takes the head's own output hidden of step k - 1 and the
token x_{t+1+k} and predicts x_{t+2+k}, attending to step 0's keys at positions <= t and
its own chain's keys of steps 1..k: exactly what a drafting chain started at t sees in the
head's KV cache (tests/tools/test_train_drafter.py checks the unrolled logits against
chained `eagle3_forward` calls). Loss: cross-entropy over the draft vocabulary on the
answers' tokens, step k weighted 0.8^k. Labels are the target's greedy tokens (the data
is its own greedy output), so the head learns what greedy decoding accepts.

recipe.json records the data (its meta: model, fingerprint, prompt set), every setting,
the loss and per-step accuracy of each epoch and the time taken.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import fx_engine  # noqa: E402

fx_engine.setup()

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

LAYER = "midlayer."
STEP_WEIGHT = 0.8  # EAGLE-3's decay of the unrolled steps' losses


# ---------------------------------------------------------------- the head's shape and vocabulary


def draft_vocab(tokens: np.ndarray, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent target ids of `tokens` (ties: the smaller id), ascending; ids
    never seen fill up the rest in id order when the data has fewer distinct tokens."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then by id
    return np.sort(order[:size])


def head_config(model: Any, draft_vocab_size: int) -> dict[str, Any]:
    """config.json of a head for `model` (EAGLE-3's flat Llama config), its width and
    attention shape the target's, one layer."""
    c = model.config
    if getattr(c, "rope_scaling", None):
        raise SystemExit(f"train_drafter: targets with rope_scaling ({c.rope_scaling}) are not supported")
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": c.hidden_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def target_tables(model: Any) -> tuple[mx.array, mx.array, mx.array]:
    """The target's embedding table [V, H], output head [V, H] and final norm weight, as
    float32 arrays (dequantized when stored quantized)."""
    from fx_engine.core.nn import embed as lookup
    from fx_engine.core.nn import linear

    p = model.params
    table = lookup(mx.arange(model.config.vocab_size), p.embed).astype(mx.float32)
    if getattr(p, "lm_head", None) is None:  # tied
        return table, table, p.norm.astype(mx.float32)
    head = linear(mx.eye(model.config.hidden_size), p.lm_head, p.numerics).T  # its rows, dequantized
    return table, head.astype(mx.float32), p.norm.astype(mx.float32)


def init_head(cfg: dict[str, Any], vocab_ids: np.ndarray, head: mx.array, norm: mx.array,
              seed: int = 0) -> dict[str, mx.array]:
    """The head's trainable weights under their published names: Llama's normal(0, 0.02)
    for the projections, ones for the norms, and the target's own output head rows (and
    final norm) for the draft vocabulary: the head starts out predicting what the target's
    head would from its hidden state."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    keys = mx.random.split(mx.random.key(seed), 8)
    shapes = {"fc.weight": (h, 3 * cfg["target_hidden_size"]),
              LAYER + "self_attn.q_proj.weight": (q, 2 * h), LAYER + "self_attn.k_proj.weight": (kv, 2 * h),
              LAYER + "self_attn.v_proj.weight": (kv, 2 * h), LAYER + "self_attn.o_proj.weight": (h, q),
              LAYER + "mlp.gate_proj.weight": (f, h), LAYER + "mlp.up_proj.weight": (f, h),
              LAYER + "mlp.down_proj.weight": (h, f)}
    w: dict[str, mx.array] = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        w[name] = 0.02 * mx.random.normal(shape, key=keys[i])
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{LAYER}{name}.weight"] = mx.ones((h,))
    w["norm.weight"] = mx.array(norm)
    w["lm_head.weight"] = mx.take(head, mx.array(vocab_ids.astype(np.int32)), axis=0)
    return w


# ---------------------------------------------------------------- the unrolled forward


def _rope(x: mx.array, offset: int, cfg: dict[str, Any]) -> mx.array:
    return mx.fast.rope(x, cfg["head_dim"], traditional=False, base=float(cfg["rope_theta"]), scale=1.0,
                        offset=offset)


def _heads(x: mx.array, n: int, d: int) -> mx.array:
    b, t, _ = x.shape
    return x.reshape(b, t, n, d).transpose(0, 2, 1, 3)


def unrolled_logits(w: dict[str, mx.array], cfg: dict[str, Any], embed_table: mx.array,
                    feats: mx.array, tokens: mx.array, steps: int) -> list[mx.array]:
    """Draft-vocab logits of each unrolled step, [B, T, Vd] each: step k's row t predicts
    token t + 2 + k (see the module's docstring). feats [B, T, 3 H_t] (the target's states
    at each position), tokens [B, T] (token t + 1 + k is step k's input at row t; rows past
    the end read padding, whose outputs the loss masks)."""
    b, t = tokens.shape
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, rep, scale = cfg["rms_norm_eps"], nh // nkv, 1.0 / math.sqrt(d)
    causal = mx.triu(mx.full((t, t), -mx.inf), k=1)
    g = feats @ w["fc.weight"].T
    k0 = v0 = None
    chain: list[tuple[mx.array, mx.array]] = []
    out = []
    for k in range(steps):
        nxt = mx.concatenate([tokens[:, 1 + k:], mx.zeros((b, 1 + k), tokens.dtype)], axis=1)
        e = mx.take(embed_table, nxt, axis=0)
        n = mx.fast.rms_norm(g, w[LAYER + "hidden_norm.weight"], eps)
        x = mx.concatenate([mx.fast.rms_norm(e, w[LAYER + "input_layernorm.weight"], eps), n], axis=-1)
        q = _rope(_heads(x @ w[LAYER + "self_attn.q_proj.weight"].T, nh, d), k, cfg)
        kk = mx.repeat(_rope(_heads(x @ w[LAYER + "self_attn.k_proj.weight"].T, nkv, d), k, cfg), rep, axis=1)
        vv = mx.repeat(_heads(x @ w[LAYER + "self_attn.v_proj.weight"].T, nkv, d), rep, axis=1)
        if k == 0:
            k0, v0 = kk, vv
        else:
            chain.append((kk, vv))
        s0 = (q @ k0.transpose(0, 1, 3, 2)) * scale + causal  # step 0's keys at positions <= t
        diag = [(q * ck).sum(-1, keepdims=True) * scale for ck, _ in chain]  # this chain's own
        pr = mx.softmax(mx.concatenate([s0, *diag], axis=-1), axis=-1, precise=True)
        a = pr[..., :t] @ v0
        for j, (_, cv) in enumerate(chain):
            a = a + pr[..., t + j:t + j + 1] * cv
        a = a.transpose(0, 2, 1, 3).reshape(b, t, nh * d) @ w[LAYER + "self_attn.o_proj.weight"].T
        h = g + a
        m = mx.fast.rms_norm(h, w[LAYER + "post_attention_layernorm.weight"], eps)
        gate = m @ w[LAYER + "mlp.gate_proj.weight"].T
        h = h + (gate * mx.sigmoid(gate) * (m @ w[LAYER + "mlp.up_proj.weight"].T)) @ w[LAYER + "mlp.down_proj.weight"].T
        out.append(mx.fast.rms_norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T)
        g = h
    return out


def step_labels(tokens: mx.array, first_label: mx.array, lengths: mx.array, t2d_index: mx.array,
                steps: int) -> tuple[list[mx.array], list[mx.array]]:
    """Per unrolled step: draft-vocab labels [B, T] (token t + 2 + k through t2d_index, the
    target id's draft id or -1) and the mask of rows t whose label is an answer token
    (position >= first_label), inside the conversation and in the draft vocabulary."""
    b, t = tokens.shape
    pos = mx.arange(t)[None, :]
    labels, masks = [], []
    for k in range(steps):
        shift = 2 + k
        lab = mx.concatenate([tokens[:, shift:], mx.zeros((b, shift), tokens.dtype)], axis=1)
        dl = mx.take(t2d_index, lab)
        ok = (pos + shift < lengths[:, None]) & (pos + shift >= first_label[:, None]) & (dl >= 0)
        labels.append(mx.maximum(dl, 0))
        masks.append(ok)
    return labels, masks


def loss_and_acc(w: dict[str, mx.array], cfg: dict[str, Any], embed_table: mx.array, feats: mx.array,
                 tokens: mx.array, labels: list[mx.array], masks: list[mx.array],
                 steps: int) -> tuple[mx.array, mx.array]:
    """The weighted mean cross-entropy over the steps, and each step's top-1 accuracy [steps]."""
    total, accs = mx.array(0.0), []
    for k, lg in enumerate(unrolled_logits(w, cfg, embed_table, feats, tokens, steps)):
        m = masks[k].astype(mx.float32)
        n = mx.maximum(m.sum(), 1.0)
        ce = mx.logsumexp(lg, axis=-1) - mx.take_along_axis(lg, labels[k][..., None], axis=-1)[..., 0]
        total = total + (STEP_WEIGHT ** k) * (ce * m).sum() / n
        accs.append(((mx.argmax(lg, axis=-1) == labels[k]).astype(mx.float32) * m).sum() / n)
    return total, mx.stack(accs)


# ---------------------------------------------------------------- the target's hidden states


def target_features(model: Any, ids: list[int], layers: tuple[int, ...]) -> np.ndarray:
    """The residual stream entering `layers` at every position of `ids` [T, 3 H] (float16),
    captured inside the target's compiled prefill steps."""
    from fx_engine.engine.scoring import hidden_states

    return np.asarray(hidden_states(model, ids, layers).astype(mx.float16))


def conversations(model: Any, path: Path, data: Any, layers: tuple[int, ...], T: int,
                  log: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One data file's conversations cut / padded to T: token ids [N, T], lengths [N], where
    the answers start [N] and the target's states [N, T, 3 H] (float16). The states depend
    on the data, the target and the layers only: kept beside the data for the next run
    (~0.9 GB for 1024 conversations of 256 tokens)."""
    tokens, starts, answers = data["tokens"], data["starts"], data["answer_starts"]
    n = len(answers)
    toks, lens = np.zeros((n, T), np.int32), np.zeros(n, np.int32)
    for i in range(n):
        ids = tokens[starts[i]:starts[i + 1]][:T]
        toks[i, :len(ids)], lens[i] = ids, len(ids)
    first = np.minimum(answers - starts[:-1], T).astype(np.int32)
    shape = (n, T, 3 * model.config.hidden_size)
    cached = path.with_suffix(f".features-{model.fingerprint}-{'-'.join(map(str, layers))}-{T}.npy")
    if cached.exists() and np.load(cached, mmap_mode="r").shape == shape:
        log(f"features from {cached}")
        return toks, lens, first, np.load(cached)
    feats = np.zeros(shape, np.float16)
    for i in range(n):
        feats[i, :lens[i]] = target_features(model, toks[i, :lens[i]].tolist(), layers)
        if (i + 1) % max(1, n // 10) == 0:
            log(f"features {i + 1}/{n} ({path.name})")
    np.save(cached, feats)
    return toks, lens, first, feats


# ---------------------------------------------------------------- training


def batches(n: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i:i + size] for i in range(0, n - size + 1, size)]


def save_head(out: Path, w: dict[str, mx.array], cfg: dict[str, Any], vocab_ids: np.ndarray,
              recipe: dict[str, Any]) -> None:
    """config.json, model.safetensors (float16, the published names, d2t / t2d) and recipe.json."""
    out.mkdir(parents=True, exist_ok=True)
    d2t = vocab_ids.astype(np.int64) - np.arange(len(vocab_ids), dtype=np.int64)
    t2d = np.zeros(cfg["vocab_size"], dtype=bool)
    t2d[vocab_ids] = True
    tensors = {k: v.astype(mx.float16) for k, v in w.items()}
    tensors["d2t"], tensors["t2d"] = mx.array(d2t), mx.array(t2d)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, nargs="+", help="tools/drafter_data.py's .npz files")
    ap.add_argument("--out", required=True, help="the head's folder")
    ap.add_argument("--model", default=None, help="the target (default: the data's model)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="unrolled steps (training-time test)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="conversations per step")
    ap.add_argument("--seq", type=int, default=256, help="conversations cut / padded to this")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout", type=float, default=0.05, help="share of conversations kept for validation")
    ap.add_argument("--init", default=None, help="a head folder of this tool to continue training from "
                    "(its draft vocabulary is kept)")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    files = [Path(d).expanduser() for d in a.data]
    datas = [np.load(f) for f in files]
    metas = [json.loads(str(d["meta"])) for d in datas]
    model = fx_engine.load(a.model or metas[0]["model"], numerics="exact")
    from fx_engine.core.drafters.eagle3 import aux_layers, config_from_hf

    tokens = np.concatenate([d["tokens"] for d in datas])
    cfg = head_config(model, min(a.draft_vocab, model.config.vocab_size))
    config_from_hf(cfg)  # the loader's checks, before any work
    layers = aux_layers(config_from_hf(cfg), model.config.num_layers)
    init = None
    if a.init:
        init = mx.load(str(Path(a.init).expanduser() / "model.safetensors"))
        cfg["draft_vocab_size"] = int(init["lm_head.weight"].shape[0])
        vocab_ids = np.asarray(init["d2t"]).astype(np.int64) + np.arange(cfg["draft_vocab_size"])
    else:
        vocab_ids = draft_vocab(tokens, model.config.vocab_size, cfg["draft_vocab_size"])
    t2d_index = np.full(model.config.vocab_size, -1, np.int32)
    t2d_index[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)

    t0 = time.perf_counter()
    T = a.seq
    parts = [conversations(model, f, d, layers, T, log) for f, d in zip(files, datas)]
    toks, lens, first, feats = (np.concatenate([p[i] for p in parts]) for i in range(4))
    convs = len(lens)
    answer_tokens = np.concatenate([toks[i, first[i]:lens[i]] for i in range(convs)])
    coverage = float(np.isin(answer_tokens, vocab_ids).mean())
    log(f"{convs} conversations, {tokens.size} tokens; draft vocab {len(vocab_ids)} covers {coverage:.3f} "
        f"of the answer tokens; aux layers {layers}")
    feature_seconds = time.perf_counter() - t0

    embed_table, head, norm = target_tables(model)
    w = init_head(cfg, vocab_ids, head, norm, a.seed)
    if init is not None:  # (the same names and shapes: an error here names the first that differs)
        for k in w:
            if tuple(init[k].shape) != tuple(w[k].shape):
                raise SystemExit(f"--init: tensor {k} is {tuple(init[k].shape)}, this head's is {tuple(w[k].shape)}")
        w = {k: init[k].astype(mx.float32) for k in w}
    rng = np.random.default_rng(a.seed)
    order = rng.permutation(convs)
    n_hold = max(1, int(round(convs * a.holdout)))
    hold, train = order[:n_hold], order[n_hold:]
    per_epoch = len(train) // a.batch
    total_steps = max(1, per_epoch * a.epochs)
    sched = optim.join_schedules([optim.linear_schedule(1e-7, a.lr, min(100, total_steps // 10 + 1)),
                                  optim.cosine_decay(a.lr, total_steps)], [min(100, total_steps // 10 + 1)])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    t2d_mx = mx.array(t2d_index)

    def batch_arrays(idx: np.ndarray) -> tuple[mx.array, ...]:
        tk = mx.array(toks[idx])
        labels, masks = step_labels(tk, mx.array(first[idx]), mx.array(lens[idx]), t2d_mx, a.steps)
        return mx.array(feats[idx]).astype(mx.float32), tk, labels, masks

    def loss_fn(w_, f_, tk_, labels_, masks_):
        return loss_and_acc(w_, cfg, embed_table, f_, tk_, labels_, masks_, a.steps)

    grad_fn = mx.value_and_grad(lambda *args: loss_fn(*args)[0])

    def train_step(w_, f_, tk_, labels_, masks_):
        loss, grads = grad_fn(w_, f_, tk_, labels_, masks_)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        return loss, grads

    def evaluate() -> dict[str, Any]:
        losses, accs = [], []
        for i in range(0, len(hold), a.batch):
            idx = hold[i:i + a.batch]
            f_, tk_, labels_, masks_ = batch_arrays(idx)
            loss, acc = loss_fn(w, f_, tk_, labels_, masks_)
            losses.append(loss.item())
            accs.append(np.asarray(acc))
        return {"loss": round(float(np.mean(losses)), 4),
                "accuracy_per_step": [round(float(x), 4) for x in np.mean(accs, axis=0)]}

    history = [{"epoch": 0, **evaluate()}]
    log(f"before training: {history[-1]}")
    t1 = time.perf_counter()
    step = 0
    for epoch in range(1, a.epochs + 1):
        run = []
        for idx in batches(len(train), a.batch, rng):
            f_, tk_, labels_, masks_ = batch_arrays(train[idx])
            loss, grads = train_step(w, f_, tk_, labels_, masks_)
            w = opt.apply_gradients(grads, w)
            mx.eval(w, opt.state, loss)
            run.append(loss.item())
            step += 1
            if step % 20 == 0:
                log(f"epoch {epoch} step {step}/{total_steps} loss {np.mean(run[-20:]):.3f} "
                    f"({(time.perf_counter() - t1) / step:.2f} s/step)")
        history.append({"epoch": epoch, "train_loss": round(float(np.mean(run)), 4), **evaluate()})
        log(f"epoch {epoch}: {history[-1]}")
    recipe = {"tool": "tools/train_drafter.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "data": metas if len(metas) > 1 else metas[0], "target": {"path": model.path, "fingerprint": model.fingerprint,
                                       "numerics": model.numerics, "aux_layers": list(layers)},
              "draft_vocab_size": len(vocab_ids), "draft_vocab_coverage": round(coverage, 4),
              "conversations": {"train": len(train), "holdout": len(hold)}, "steps_unrolled": a.steps,
              "step_weight": STEP_WEIGHT, "epochs": a.epochs, "batch": a.batch, "seq": T, "lr": a.lr,
              "optimizer": "AdamW (no weight decay), warm-up then cosine decay, gradient norm clipped at 1",
              "seed": a.seed, "init": a.init,
              "init_recipe": (json.loads((Path(a.init).expanduser() / "recipe.json").read_text())
                              if a.init and (Path(a.init).expanduser() / "recipe.json").exists() else None),
              "history": history, "seconds": {"features": round(feature_seconds, 1),
                                                               "training": round(time.perf_counter() - t1, 1),
                                                               "total": round(time.perf_counter() - t_start, 1)},
              "mlx": mx.__version__}
    save_head(Path(a.out).expanduser(), w, cfg, vocab_ids, recipe)
    log(f"wrote {a.out}")
    return recipe


if __name__ == "__main__":
    main()
