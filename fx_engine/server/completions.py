"""OpenAI's (legacy) completions: POST /v1/completions (JSON, or SSE chunks ending in
`data: [DONE]`): one prompt (text or token ids) or a list of them, n choices each; `echo`
with `logprobs` and max_tokens 0 scores a prompt (lm-evaluation-harness's loglikelihood)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from fx_engine.engine.request import prompt_ids
from fx_engine.server.context import Ctx
from fx_engine.server.generation import _sampling_kwargs, _Sampling, run
from fx_engine.server.protocol import _error

router = APIRouter()


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, ctx: Ctx):
    # one prompt (a string or token ids) or a list of them: one choice per prompt (and
    # per n), index = prompt * n + choice, as OpenAI numbers them
    engine, model = ctx.engine, ctx.model
    p = body.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts or any(not x for x in prompts):
        return _error(400, "prompt: must not be empty", "prompt")
    if len(prompts) * body.n > max(1, engine.max_queue):
        return _error(400, f"prompt: {len(prompts)} prompts x n={body.n} exceed the "
                      f"server's queue of {engine.max_queue}", "prompt")
    if body.max_tokens == 0 and not body.echo:
        return _error(400, "max_tokens: 0 generates nothing; it needs echo: true "
                      "(scoring the prompt)", "max_tokens")
    echoes: list[str] = []

    def build() -> list[tuple[Any, dict[str, Any]]]:  # on a worker thread
        kw = _sampling_kwargs(body, ctx.defaults)
        if body.logprobs is not None:  # 0: the chosen token's logprob, no alternatives
            kw["logprobs"] = max(1, body.logprobs)
            if body.echo:
                kw["prompt_logprobs"] = body.logprobs
        jobs = []
        for x in prompts:
            ids = prompt_ids(model, x)
            if body.echo:
                echoes.append(x if isinstance(x, str) else model.tokenizer.decode(ids))
            jobs.append((ids, dict(kw)))
        return jobs

    return await run(ctx, request, body, build, chat=False, echoes=echoes if body.echo else None)
