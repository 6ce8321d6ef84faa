"""Re-quantize a GGUF with llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, an optional benchmark peer: not a dependency), e.g. the default
model's Q4_1 file into Q4_K_M for the K-quant benchmarks (docs/benchmarks.md, issue 22).

    python tools/requantize_gguf.py OUT.gguf --type Q4_K_M [--model IN.gguf]

`allow_requantize` is set: the source is already quantized, so this is a speed and format
test, not a quality one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--type", default="Q4_K_M", help="llama.cpp's file type name (Q4_K_M, Q5_K_M, Q6_K, ...)")
    ap.add_argument("--model", default=None, help="source GGUF (default: fx-engine's default model)")
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("needs llama-cpp-python (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    from fx_engine.loading.default_model import default_model_path

    src = Path(a.model) if a.model else default_model_path()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.type.upper()}", None)
    if ftype is None:
        print(f"unknown --type {a.type!r}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), a.out.encode(), params)
    print(f"{src} -> {a.out} ({a.type}): rc={rc}")
    return int(rc != 0)


if __name__ == "__main__":
    sys.exit(main())
