"""fx-engine: an LLM inference engine on MLX, JAX-style.

Pure core (fx_engine.models, .cache, .sampling, .state, .steps, .tree, .nn) and an
imperative shell (fx_engine.engine, .loading, .cli). Public API:

    model = fx_engine.load(path=None)                 # None: the default model
    out = fx_engine.generate(model, "Hello", max_tokens=32, temperature=0.0)
    for delta in fx_engine.stream(model, messages): print(delta, end="")
    fx_engine.logits(model, token_ids)                # teacher-forced [T, V]
    with fx_engine.Engine(model, max_rows=8) as engine:  # continuous batching
        handle = engine.submit("Hello", max_tokens=32); print(handle.result().text)
"""

from . import blas as _blas
from . import malloc as _malloc

_blas.preload()  # must run before mlx is imported anywhere (see fx_engine/blas.py)
_malloc.tune()  # keep freed intermediates mapped (see fx_engine/malloc.py)

from .engine.engine import Engine, EngineClosed, QueueFull, RequestHandle  # noqa: E402
from .engine.generate import Completion, TextDelta, TokenLogprob, Usage, generate, stream  # noqa: E402
from .model import Model, load  # noqa: E402
from .sampling import SamplingConfig  # noqa: E402
from .scoring import logits  # noqa: E402
from .steps import decode_step, prefill_step, sample_step, score_step  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Completion", "Engine", "EngineClosed", "Model", "QueueFull", "RequestHandle", "SamplingConfig", "TextDelta", "TokenLogprob", "Usage",
    "decode_step", "generate", "load", "logits", "prefill_step", "sample_step",
    "score_step", "stream",
]
