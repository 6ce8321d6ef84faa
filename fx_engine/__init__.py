"""fx-engine: an LLM inference engine on MLX, JAX-style.

    fx_engine/core/     the pure core: frozen pytrees in, new ones out (tree, nn, models,
                        cache, sampling, state, steps, speculative, kernels); a test checks
                        that it imports nothing else of fx_engine and touches no files,
                        environment, clock or unkeyed randomness
    fx_engine/runtime/  process set-up the shell runs: BLAS preload, malloc tuning, the
                        native kernels' build and the measured matmul plan
    fx_engine/loading/, engine/, server/, testing/, tracing/, cli.py: the shell

Public API (importing this package is cheap: nothing is set up and mlx is not imported
until a public name is used; `setup()` runs first then):

    model = fx_engine.load(path=None)                 # None: the default model
    out = fx_engine.generate(model, "Hello", max_tokens=32, temperature=0.0)
    for delta in fx_engine.stream(model, messages): print(delta, end="")
    fx_engine.logits(model, token_ids)                # teacher-forced [T, V]
    fx_engine.load_adapter(model, "adapters/", name="a")  # LoRA/DoRA: generate(..., adapter="a")
    with fx_engine.Engine(model, max_rows=8) as engine:  # continuous batching
        handle = engine.submit("Hello", max_tokens=32); print(handle.result().text)

Your own decoding loop over the pure steps (specs/steps.md; the README's example):

    logits, cache, state = fx_engine.prefill(model, [ids_a, ids_b], room=64)  # bucketed
    state, cache = fx_engine.decode_step_compiled(model.params, cache, state)
    logits, cache = fx_engine.logits_step_compiled(model.params, cache, state.tokens)
    fx_engine.take_rows((state, cache), idx), repeat_rows(...), concat_rows([...])
    fx_engine.verify_step(...), draft_sync(...); fx_engine.jit (Python scalars traced)

`fx_engine.setup()` (= `fx_engine.runtime.setup`) loads the optimized BLAS and tunes malloc;
it must run before anything imports `mlx.core` for MLX's CPU matmuls to use that BLAS, so
programs that import mlx themselves call it first (see fx_engine/runtime/__init__.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from .runtime import setup

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use, after setup())
_PUBLIC = {
    "embed": "engine.embeddings",
    "Engine": "engine.engine", "EngineClosed": "engine.engine", "QueueFull": "engine.engine",
    "EngineForked": "engine.engine", "LogitsProcessorError": "engine.engine",
    "RequestHandle": "engine.engine",
    "Completion": "engine.generate", "TextDelta": "engine.generate",
    "TokenLogprob": "engine.generate", "Usage": "engine.generate", "generate": "engine.generate",
    "stream": "engine.generate",
    "Model": "loading.model", "load": "loading.model", "load_adapter": "loading.model",
    "fuse_adapter": "loading.model",
    "SamplingConfig": "core.sampling",
    "logits": "engine.scoring",
    "decode_step": "core.steps", "prefill_step": "core.steps", "sample_step": "core.steps",
    "score_step": "core.steps",
    # your own loop over the pure steps (specs/steps.md)
    "logits_step": "core.steps", "verify_step": "core.steps", "VerifyResult": "core.steps",
    "prefill_step_compiled": "core.steps", "decode_step_compiled": "core.steps",
    "sample_step_compiled": "core.steps", "score_step_compiled": "core.steps",
    "logits_step_compiled": "core.steps", "verify_step_compiled": "core.steps",
    "DecodeState": "core.state", "init_state": "core.state", "stop_rows": "core.state",
    "KVCache": "core.cache", "with_lengths": "core.cache",
    "take_rows": "core.rows", "repeat_rows": "core.rows", "concat_rows": "core.rows",
    "num_rows": "core.rows",
    "jit": "core.tree", "tree_map": "core.tree", "tree_leaves": "core.tree",
    "draft_sync": "core.speculative", "DraftSync": "core.speculative",
    "prefill": "engine.prefill", "Prefilled": "engine.prefill",
    "self_draft_model": "engine.drafters", "PromptLookup": "engine.drafters",
    "Eagle3Drafter": "engine.eagle3_drafter", "MtpDrafter": "engine.mtp_drafter",
}
_SUBPACKAGES = ("cli", "core", "engine", "loading", "runtime", "server", "testing", "tracing")

__all__ = sorted([*_PUBLIC, "setup"])


# Modules that moved in the core/shell split keep their old import paths (the same module
# objects, not copies): `from fx_engine.steps import decode_step_compiled` still works.
_MOVED = {
    **{f"fx_engine.{m}": f"fx_engine.core.{m}" for m in (
        "tree", "buckets", "nn", "cache", "sampling", "state", "steps", "speculative", "config",
        "models")},
    "fx_engine.native": "fx_engine.runtime.native", "fx_engine.blas": "fx_engine.runtime.blas",
    "fx_engine.malloc": "fx_engine.runtime.malloc", "fx_engine.model": "fx_engine.loading.model",
    "fx_engine.scoring": "fx_engine.engine.scoring",
}


def _moved(name: str) -> str | None:
    """The new name of a moved module, or of a module inside a moved package
    (fx_engine.models.phi3 -> fx_engine.core.models.phi3); None if it did not move."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        new = _MOVED.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if _moved(name) else None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(_moved(spec.name))
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _OldPaths())  # first: the default finder would load a copy


def __getattr__(name: str) -> Any:  # PEP 562: the public API, loaded on first use
    if name in _PUBLIC:
        setup()
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    elif f"{__name__}.{name}" in _MOVED:  # fx_engine.blas, fx_engine.steps, ... (old paths)
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _SUBPACKAGES:
        if name != "core":
            setup()
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'fx_engine' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC, *_SUBPACKAGES])
