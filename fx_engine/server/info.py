"""What the server serves and how it is doing: GET /health (and HEAD, for load balancers),
GET /v1/models, GET /v1/models/{name} (the openai SDK's `models.retrieve`), GET /metrics
(Prometheus text)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from fx_engine.server.context import Ctx, ServerContext

router = APIRouter()


@router.head("/health", include_in_schema=False)  # load balancers' probe
@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _models(ctx: ServerContext) -> dict[str, Any]:
    model_id, model = ctx.model_id, ctx.model
    now = int(time.time())
    data = [{"id": model_id, "object": "model", "created": now, "owned_by": "fx-engine",
             "root": str(model.path), "parent": None}]
    data += [{"id": f"{model_id}:{a}", "object": "model", "created": now, "owned_by": "fx-engine",
              "root": model.adapters.get(a).raw.path, "parent": model_id}  # vLLM's LoRA entries
             for a in model.adapters.names()]
    return {"object": "list", "data": data}


@router.get("/v1/models")
async def models(ctx: Ctx) -> dict[str, Any]:
    return _models(ctx)


@router.get("/v1/models/{name:path}")
async def model_info(name: str, ctx: Ctx):
    """One model (the openai SDK's `models.retrieve`): any name a request may give,
    reported under its listed id; 404 for the others."""
    bad = ctx.unknown_model(name)
    if bad is not None:
        return bad
    shown = ctx.shown_model(name)
    return next(m for m in _models(ctx)["data"] if m["id"] == shown)


@router.get("/metrics")
async def prom(ctx: Ctx) -> PlainTextResponse:
    return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")
