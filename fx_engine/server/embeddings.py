"""OpenAI's embeddings: POST /v1/embeddings (the base model's pooled hidden states)."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from fx_engine.engine.engine import EngineClosed
from fx_engine.engine.request import ContextLengthExceeded, prompt_ids
from fx_engine.server.context import Ctx
from fx_engine.server.protocol import _Body, _error, unless_gone

router = APIRouter()


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=256)


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest, ctx: Ctx):
    """Pooled, normalized final hidden states (engine/embeddings.py: the checkpoint's
    pooling), batched, computed on the engine's thread one bounded call per engine
    step (at most its step_token_budget tokens), beside generation; a client that
    disconnects cancels the rest."""
    from fx_engine.engine.embeddings import embed_steps

    engine, model = ctx.engine, ctx.model
    bad = ctx.unknown_model(body.model, adapters=False)
    if bad is not None:
        return bad
    x = body.input
    inputs = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
    if not inputs or any(not i for i in inputs):
        return _error(400, "input: must not be empty (nor hold an empty input)", "input")
    if len(inputs) > 2048:
        return _error(400, f"input: at most 2048 inputs, got {len(inputs)}", "input")
    hidden = model.config.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        return _error(400, f"dimensions: this model's embeddings have {hidden} dimensions "
                      "(it does not declare shorter ones)", "dimensions")
    try:
        ids = await run_in_threadpool(lambda: [prompt_ids(model, i) for i in inputs])
        steps = await run_in_threadpool(
            lambda: embed_steps(model, ids, step_tokens=engine.step_token_budget))
        # None once the client leaves: cancelling the wrapper cancels the job, which
        # the engine drops at its next step
        vecs = await unless_gone(request, asyncio.wrap_future(engine.call_steps(steps)))
    except EngineClosed as e:
        return _error(503, str(e), kind="server_error")
    except ValueError as e:
        code = "context_length_exceeded" if isinstance(e, ContextLengthExceeded) else None
        return _error(400, f"input: {e}".replace("input: input", "input"), "input", code=code)
    if vecs is None:
        return _error(499, "client disconnected", kind="cancelled")
    import base64

    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
             if body.encoding_format == "base64" else v.tolist()}
            for i, v in enumerate(vecs)]
    n = sum(len(i) for i in ids)
    return {"object": "list", "data": data, "model": ctx.model_id,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
