"""The pure core: frozen attrs pytrees in, new ones out.

    tree.py        pytrees (frozen attrs classes) and the compile wrapper keyed on the full
                   static structure
    buckets.py     the one power-of-two rule behind every static shape
    nn.py          building blocks: linear (dense, affine-quantized), norms, RoPE,
                   attention, MLP activations, Numerics (part of every compile key)
    kernels.py     fx-engine's native CPU kernels as pure MLX ops
    models/        one module per model family, and the registry
    cache.py       cache kinds as data (dense, ring, quantized) and their write/attend rules
    sampling.py    per-row sampling parameters as arrays; filters, penalties, distributions
    state.py       DecodeState, sample_step, init_state
    steps.py       prefill_step, logits_step, decode_step, sample_step, score_step, verify_step
    speculative.py verify_step: row-wise acceptance and rollback; draft_sync (the drafter's side)
    rows.py        row operations on caches and states: take, reorder, repeat, concatenate
    checks.py      the steps' argument checks (ranks, rows, dtypes), run at trace time

Rules (checked by tests/core/test_boundary.py): a core module imports only the core (plus mlx,
numpy, attrs, jaxtyping and the standard library's pure parts), reads no files,
environment or clock, and draws randomness only from the PRNG keys it is given. Importing
it sets nothing up: process set-up is fx_engine.runtime's, run by the shell.
"""
