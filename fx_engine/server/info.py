"""What the server serves and how it is doing: GET /health (and HEAD, for load balancers),
GET /v1/models, GET /v1/models/{name} (the openai SDK's `models.retrieve`), GET /metrics
(Prometheus text). Serving several models (server/pool.py), these never load one: every
configured model is listed with its `status` (loaded, loading, unloaded), and each model's
metrics carry its `model` label."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from fx_engine.engine.request import context_limit
from fx_engine.server.context import ServerContext, server_context
from fx_engine.server.protocol import _error

router = APIRouter()


@router.head("/health", include_in_schema=False)  # load balancers' probe
@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _models(ctx: ServerContext) -> dict[str, Any]:
    model_id, model = ctx.model_id, ctx.model
    now = int(time.time())
    # max_model_len: vLLM's field, the context a request may reach (serve's --max-kv-size);
    # numerics: "int8" or "exact" (serve --numerics; docs/numerics.md)
    data = [{"id": model_id, "object": "model", "created": now, "owned_by": "fx-engine",
             "root": str(model.path), "parent": None, "max_model_len": context_limit(model)[0],
             "numerics": model.numerics}]
    data += [{"id": f"{model_id}:{a}", "object": "model", "created": now, "owned_by": "fx-engine",
              "root": model.adapters.get(a).raw.path, "parent": model_id}  # vLLM's LoRA entries
             for a in model.adapters.names()]
    return {"object": "list", "data": data}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    pool = request.app.state.pool
    if pool is not None:
        return {"object": "list", "data": pool.listing()}
    return _models(await server_context(request))


@router.get("/v1/models/{name:path}")
async def model_info(name: str, request: Request):
    """One model (the openai SDK's `models.retrieve`): any name a request may give,
    reported under its listed id; 404 for the others."""
    pool = request.app.state.pool
    if pool is not None:
        entry = pool.entry_of(name)
        data = pool.listing()
        if entry is not None:
            base, sep, rest = name.partition(":")
            adapter = (rest if sep and base in entry.names and rest in entry.adapters()
                       else name if name not in entry.names else None)
            shown = entry.name if adapter is None else f"{entry.name}:{adapter}"
            found = next((m for m in data if m["id"] == shown), None)
            if found is not None:
                return found
        return _error(404, f"model: the model {name!r} does not exist (this server serves "
                      f"{', '.join(repr(m['id']) for m in data)}; see /v1/models)", "model",
                      kind="not_found_error", code="model_not_found")
    ctx = await server_context(request)
    bad = ctx.unknown_model(name)
    if bad is not None:
        return bad
    shown = ctx.shown_model(name)
    return next(m for m in _models(ctx)["data"] if m["id"] == shown)


@router.get("/metrics")
async def prom(request: Request) -> PlainTextResponse:
    pool = request.app.state.pool
    text = pool.render_metrics() if pool is not None else (await server_context(request)).metrics.render()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
