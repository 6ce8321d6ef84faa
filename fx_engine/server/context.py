"""The typed context every API surface of the server works over: one `ServerContext` per
app (create_app builds it; a route gets it as the `Ctx` dependency; serving several models,
one per model, the request's: server/pool.py), holding the engine
(its model and tokenizer), the served model's names, the sampling defaults, the metrics,
the server's settings and what the chat template implies (its tool-call and thinking
formats), with the helpers the surfaces share: which model (or LoRA adapter) a request
names, and a chat's prompt built the same way on every route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Mapping, Sequence

from fastapi import Depends, Request

from fx_engine.engine.engine import Engine
from fx_engine.engine.grammar_guard import check_schema
from fx_engine.engine.image_prompt import (ImagePrompt, has_images, image_placeholder, image_prompt_from_text,
                                           render_with_images, split_messages)
from fx_engine.engine.request import check_prompt_size, prompt_ids, text_bytes
from fx_engine.server.metrics import Metrics
from fx_engine.server.protocol import _error
from fx_engine.server.media import fetch_image_urls
from fx_engine.server.reasoning import reasoning_format, starts_in_reasoning
from fx_engine.server.tools import render_tools_in_prompt, template_messages, tool_call_grammar, tool_format

MAX_REQUEST_BYTES = 4 << 20  # request bodies beyond this are refused (413) unread
STREAM_BUFFER = 256  # events per choice a streaming client may fall behind before cut-off
SEND_TIMEOUT = 30.0  # seconds a client's socket may accept nothing before it is closed
BODY_TIMEOUT = 30.0  # seconds a request body may take to arrive whole (408 beyond)
STREAM_UNREAD_BYTES = 64 << 10  # bytes a stream's client may leave unread while not reading
IMAGE_URL_BYTES = 20 << 20  # the largest image the server fetches from an http(s) URL
IMAGE_URL_TIMEOUT = 10.0  # seconds one image URL's fetch may take

# Arguments of the chat template the server passes itself (the request's own fields): a
# chat_template_kwargs entry of the same name is a 400 on every route.
_SERVER_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "chat_template",
                                   "template", "special_tokens"})


@dataclass(frozen=True)
class ServerSettings:
    """The server's limits (create_app's arguments; see its docstring), checked."""

    api_keys: tuple[str, ...] = ()
    max_request_bytes: int = MAX_REQUEST_BYTES
    stream_buffer: int = STREAM_BUFFER
    send_timeout: float = SEND_TIMEOUT
    stream_unread_bytes: int = STREAM_UNREAD_BYTES
    body_timeout: float = BODY_TIMEOUT
    image_urls: bool = True  # fetch images named by http(s) URLs (server/media.py)
    image_url_bytes: int = IMAGE_URL_BYTES
    image_url_timeout: float = IMAGE_URL_TIMEOUT

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_key: keys must be non-empty strings")
        if not isinstance(self.image_urls, bool):
            raise ValueError(f"image_urls must be true or false, got {self.image_urls!r}")
        for name in ("max_request_bytes", "stream_buffer", "stream_unread_bytes", "image_url_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("send_timeout", "body_timeout", "image_url_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))


@dataclass(frozen=True, eq=False)
class ServerContext:
    """What the routes of one app share (see the module docstring); `build` makes one."""

    engine: Engine
    model_id: str  # the id /v1/models lists
    settings: ServerSettings
    defaults: Mapping[str, Any]  # server-wide sampling defaults and speculation settings
    metrics: Metrics
    chat_template: str | None  # the template replacing the model's (None: the model's)
    chat_template_args: Mapping[str, Any] | None  # extra variables for it
    template: str | None  # the chat template in use
    tool_fmt: str  # its tool-call format (server/tools.py)
    renders_tools: bool  # whether it renders a tools section itself
    think_fmt: str | None  # its thinking format (server/reasoning.py), None: none
    template_vars: frozenset[str] | None  # the variables it reads (None: unknown)
    names: frozenset[str]  # the names a request's `model` may give for the base model
    # every id the server lists, for error messages (several models, server/pool.py;
    # None: this model and its adapters)
    catalog: Callable[[], list[str]] | None = None
    _token_strs: list[str | None] = field(default_factory=list, repr=False)  # token_table's

    @classmethod
    def build(cls, engine: Engine, model_id: str, settings: ServerSettings,
              defaults: Mapping[str, Any] | None = None, chat_template: str | None = None,
              chat_template_args: Mapping[str, Any] | None = None, metrics: Metrics | None = None,
              aliases: Iterable[str] = (), catalog: Callable[[], list[str]] | None = None) -> ServerContext:
        """`metrics`: the model's (kept across its loads by a pool; None: new ones);
        `aliases`: more names a request may give for it; `catalog`: see the field."""
        model = engine.model
        # The names a request's `model` may give: the id /v1/models lists, or the path it was
        # loaded from, its file name with or without the extension (vLLM answers other names
        # with a 404, as OpenAI does; so does this server, except on Anthropic's route, whose
        # clients send Claude model names they cannot change)
        names = ({model_id, str(model.path), Path(str(model.path)).name, Path(str(model.path)).stem}
                 if model.path else {model_id}) | set(aliases)
        if metrics is None:
            metrics = Metrics(engine)
        template = chat_template or model.tokenizer.chat_template
        fmt, renders_tools = tool_format(template)
        return cls(engine=engine, model_id=model_id, settings=settings, defaults=dict(defaults or {}),
                   metrics=metrics, chat_template=chat_template,
                   chat_template_args=chat_template_args, template=template, tool_fmt=fmt,
                   renders_tools=renders_tools, think_fmt=reasoning_format(template),
                   template_vars=_template_vars(template), names=frozenset(names), catalog=catalog)

    @property
    def model(self) -> Any:
        return self.engine.model

    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

    # ---- which model a request names

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter a `model` name selects: `BASE:ADAPTER` (BASE one of the base's
        names) or the adapter's own name (as vLLM names LoRA modules); None: the base."""
        if name is None or name in self.names:
            return None
        base, sep, rest = name.partition(":")
        loaded = self.model.adapters.names()
        if sep and base in self.names and rest in loaded:
            return rest
        return name if name in loaded else None

    def unknown_model(self, name: str | None, adapters: bool = True) -> Any:
        """None when `name` is served (on a route taking adapters, when `adapters`); else
        the error response (404, or 400 naming an adapter a base-only route was given)."""
        if name is None or name in self.names or (adapters and self.adapter_of(name) is not None):
            return None
        model_id = self.model_id
        if not adapters and self.adapter_of(name) is not None:
            return _error(400, f"model: {name!r} is a LoRA adapter; this route serves the base "
                          f"model {model_id!r} only", "model")
        listed = (self.catalog() if self.catalog is not None else
                  [model_id] + [f"{model_id}:{a}" for a in self.model.adapters.names()])
        return _error(404, f"model: the model {name!r} does not exist (this server serves "
                      f"{', '.join(map(repr, listed))}; see /v1/models)", "model", kind="not_found_error",
                      code="model_not_found")

    def shown_model(self, name: str | None) -> str:
        """The `model` a response reports: the base's id, or BASE:ADAPTER."""
        a = self.adapter_of(name)
        return self.model_id if a is None else f"{self.model_id}:{a}"

    # ---- the chat template

    def in_reasoning(self, prompt: Sequence[int]) -> bool:
        """Whether a reply to this prompt starts inside a thinking block it opened."""
        return self.think_fmt is not None and starts_in_reasoning(
            self.think_fmt, self.tokenizer.decode(list(prompt[-8:])))

    def check_template_kwargs(self, kwargs: Mapping[str, Any] | None) -> None:
        """A variable the chat template never reads would change nothing, and one the
        server passes itself (the messages, ...) cannot be set twice: a 400 naming it."""
        template_vars = self.template_vars
        for k in kwargs or {}:
            if k in _SERVER_TEMPLATE_ARGS:
                raise ValueError(f"chat_template_kwargs.{k}: the server sets this argument of the "
                                 "chat template itself (from the request's own fields)")
            if template_vars is not None and k not in template_vars:
                raise ValueError(f"chat_template_kwargs.{k}: this model's chat template does not "
                                 f"use it (it reads: {', '.join(sorted(template_vars)) or 'nothing'})")

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    choice: Any, parallel: bool | None, template_kwargs: Mapping[str, Any] | None,
                    kw: dict[str, Any]) -> list[int] | ImagePrompt:
        """Prompt ids of chat messages (OpenAI's shapes) with their tools (None: no tools
        in the prompt); adds the tool-call constraint to `kw` when `choice` demands calls.
        On a worker thread (templating and tokenizing release the GIL). Every route that
        takes a chat (OpenAI's, Anthropic's, Responses) builds its prompt here.

        Messages with image parts give an `ImagePrompt` (its ids and the images' encoder
        rows; `prompt_length` counts it): http(s) images fetched (server/media.py), the
        template rendered with one placeholder per image (`_image_prompt`)."""
        model = self.model
        images: list[Any] | None = None
        if has_images(messages):
            s = self.settings
            messages, images = split_messages(fetch_image_urls(
                messages, enabled=s.image_urls, max_bytes=s.image_url_bytes, timeout=s.image_url_timeout))
            image_placeholder(model)  # (a text-only model: its 400 before any templating)
            if kw.get("draft_model") == "mtp" or getattr(kw.get("draft_model"), "capture", None) is not None:
                kw.pop("draft_model")  # (the server's learned drafter: the same output without it;
                # one fed the target's hidden states does not draft image rows yet)
        messages = template_messages(messages)
        check_prompt_size(model, text_bytes(messages), "messages")  # before templating
        targs = {**(self.chat_template_args or {}), **(template_kwargs or {})}
        if tools:
            for i, t in enumerate(tools):  # what a schema may cost, before any walk of it
                check_schema(f"tools.{i}.function.parameters", t["function"].get("parameters"))
            # tool_choice "required" / a named function: the output is constrained to
            # valid calls (schema-checked arguments) in the model's call format
            g = tool_call_grammar(tools, choice, parallel, self.tool_fmt, model.tokenizer)
            if g is not None:
                if "constraint" in kw:
                    raise ValueError(f"tool_choice: cannot be combined with "
                                     f"{kw['constraint'].field} (give one output constraint)")
                from fx_engine.engine.constraints import parse_constraint

                kw["constraint"] = parse_constraint(grammar=g, names={"grammar": "tools"})
            if not self.renders_tools and self.template is not None:
                # the template has no tools section: the default one, in the system
                # prompt (server/tools.py DEFAULT_TOOLS_PROMPT), read back by the parser
                messages, tools = render_tools_in_prompt(messages, tools), None
            else:
                targs.setdefault("tools", tools)
        if images is not None:
            return self._image_prompt(messages, images, targs)
        if self.chat_template is not None or targs:
            return list(model.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                chat_template=self.chat_template, **targs))
        return prompt_ids(model, messages)

    def _image_prompt(self, messages: list[dict[str, Any]], images: list[Any],
                      targs: Mapping[str, Any]) -> ImagePrompt:
        """The prompt of messages whose image parts are {"type": "image"}: rendered with one
        placeholder per image (`render_with_images`), each expanded into its image's tokens,
        the images encoded (the engine's encoder cache: an image sent again is not encoded
        again)."""
        text = render_with_images(self.model, messages, len(images), chat_template=self.chat_template, **targs)
        return image_prompt_from_text(self.model, text, images, cache=self.engine.encoder_cache)

    # ---- the tokenizer

    def token_table(self) -> list[str | None]:
        """Each id's token in the vocabulary (built once: a list index per token then)."""
        if not self._token_strs:
            vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
            table: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
            for t, i in vocab.items():
                table[i] = t
            self._token_strs[:] = table
        return self._token_strs


def _template_vars(template: str | None) -> frozenset[str] | None:
    """The variables a chat template reads (None: no template, or one that does not parse;
    rendering reports that)."""
    if template is None:
        return None
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def prompt_length(prompt: list[int] | ImagePrompt) -> int:
    """The tokens of a prompt `chat_prompt` built (an image prompt's ids included)."""
    return len(prompt.ids) if isinstance(prompt, ImagePrompt) else len(prompt)


async def server_context(request: Request) -> ServerContext:
    """The app's context (create_app keeps it in `app.state.context`); serving several
    models (or unloading an idle one), the context of the model the request's `model` names,
    loaded if need be (server/pool.py: a 404 for an unknown name, a 503 when memory is short)."""
    pool = request.app.state.pool
    if pool is None:
        return request.app.state.context
    return await pool.context_for(request)


#: A route's context parameter: `async def route(request: Request, body: ..., ctx: Ctx)`.
Ctx = Annotated[ServerContext, Depends(server_context)]
