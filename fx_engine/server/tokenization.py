"""The tokenizer's routes (vLLM's; lm-evaluation-harness's "remote" tokenizer uses them):
GET /tokenizer_info, POST /tokenize (a prompt, or chat messages rendered with the chat
template as the chat route renders them), POST /detokenize."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from fx_engine.engine.image_prompt import has_images
from fx_engine.engine.request import check_prompt_size, context_limit, text_bytes
from fx_engine.server.chat import ChatMessage, _openai_messages
from fx_engine.server.context import Ctx
from fx_engine.server.protocol import _Body, _error
from fx_engine.server.tools import template_messages

router = APIRouter()


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


@router.get("/tokenizer_info")
async def tokenizer_info(ctx: Ctx) -> dict[str, Any]:
    tok = ctx.tokenizer
    names = tok.template_tokens
    name = lambda i: None if i is None else tok.decode([i])  # noqa: E731
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": names.get("eos_token") or (name(tok.eos_ids[0]) if tok.eos_ids else None),
            "bos_token": names.get("bos_token") or name(tok.bos_id),
            "pad_token": names.get("pad_token") or name(tok.pad_id),
            "unk_token": names.get("unk_token") or name(tok.unk_id),
            "add_bos_token": tok.add_bos, "chat_template": ctx.chat_template or tok.chat_template,
            # what a request may reach: the model's context, or serve's --max-kv-size
            "model_max_length": context_limit(ctx.model)[0],
            "vocab_size": tok.vocab_size}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: Ctx):
    if (body.prompt is None) == (body.messages is None):
        return _error(400, "prompt: give either prompt or messages", "prompt")
    model, tok = ctx.model, ctx.tokenizer

    def work() -> dict[str, Any]:  # on a worker thread: a long prompt's work included
        if body.prompt is not None:
            check_prompt_size(model, text_bytes(body.prompt))
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:  # the chat route's messages and template rules
            ctx.check_template_kwargs(body.chat_template_kwargs)
            messages = _openai_messages(body.messages, model.vision is not None)
            if has_images(messages):  # the image prompt's ids (its images' tokens included)
                if body.add_generation_prompt is False:
                    raise ValueError("add_generation_prompt: false is not supported with images")
                ids = ctx.chat_prompt(messages, None, None, None, body.chat_template_kwargs, {}).ids
            else:
                messages = template_messages(messages)
                check_prompt_size(model, text_bytes(messages), "messages")
                targs = {**(ctx.chat_template_args or {}), **(body.chat_template_kwargs or {})}
                ids = list(tok.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                    chat_template=ctx.chat_template, **targs))
        out: dict[str, Any] = {"count": len(ids), "tokens": ids,
                               "max_model_len": context_limit(model)[0]}
        if body.return_token_strs:  # vLLM's: the vocabulary's tokens (convert_ids_to_tokens)
            table = ctx.token_table()
            out["token_strs"] = [table[i] for i in ids]
        return out

    field = "messages" if body.messages is not None else "prompt"
    try:
        # encoded on the worker thread too: FastAPI would walk and encode a long prompt's
        # hundreds of thousands of ids and strings on the event loop
        encoded = await run_in_threadpool(lambda: json.dumps(work()).encode())
        return Response(encoded, media_type="application/json")
    except TemplateError as e:  # the template rejects these messages (raise_exception)
        return _error(400, f"messages: the chat template failed: {e}", "messages")
    except ValueError as e:
        msg = str(e)
        param = msg.split(":")[0] if msg.startswith("chat_template_kwargs.") else field
        return _error(400, msg, param)
    except Exception as e:  # a template that fails to render these messages
        if body.messages is None:
            raise
        return _error(400, f"messages: the chat template failed: {e}", "messages")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Ctx):
    vocab_size = ctx.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        return _error(400, f"tokens: {bad[0]} is not a token id in [0, "
                      f"{vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}
