"""Custom decoding loops over fx-engine's public API (issue 42, item 3), each a small
function runnable as a script on the default model (`python -m examples.beam_search`) and
checked against an independent oracle in tests/core/test_examples.py. docs/loops.md sets them
beside the same loops written with mlx-lm (examples/mlx_lm_loops.py)."""
