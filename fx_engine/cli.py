"""fx-engine command line: generate | chat | cache-prompt | serve | info | trace | golden.

  fx-engine generate "Why is the sky blue?"             # the default model, streamed
  fx-engine chat -m org/name:Q4_K_M                     # a Hugging Face GGUF repo, by name
  fx-engine serve --port 8080                           # OpenAI / Anthropic compatible API

`fx-engine COMMAND --help` lists each command's options by task, with their defaults."""

from __future__ import annotations

import argparse
import contextlib
import os
import json
import logging
import platform
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import fx_engine  # noqa: E402
from fx_engine.progress import working

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported


def _layer_counts(text: str) -> list[int]:
    """--pipeline-layers: comma-separated positive layer counts."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive layer counts such as 20,10, got {text!r}")
    return counts


def _int_at_least(low: int) -> Any:
    """An argparse type: an integer >= low (errors name the flag, exit 2, before any load)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _check_serve(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """serve's flags that depend on each other or on the file system, checked before the
    model loads (argparse's errors: usage, the flag, exit 2)."""
    if a.prompt_cache_disk_bytes is not None and not a.prompt_cache:
        p.error("argument --prompt-cache-disk-bytes: needs --prompt-cache-dir (the disk tier)")
    if a.prompt_cache:
        try:  # the disk tier creates it (and its parents) anyway
            os.makedirs(a.prompt_cache, exist_ok=True)
            usable = os.access(a.prompt_cache, os.W_OK | os.X_OK)
        except OSError as e:
            p.error(f"argument --prompt-cache-dir: cannot use {a.prompt_cache!r} as a directory "
                    f"({e.strerror or e})")
        if not usable:
            p.error(f"argument --prompt-cache-dir: {a.prompt_cache!r} is not writable")


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and each option's default shown ("(default: ...)") where it
    has one (not for switches and unset options, whose help says what "none" means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # (by identity: 0 and 0.0 equal False, and their defaults are worth showing)
        if any(action.default is x for x in (None, False, argparse.SUPPRESS)) or action.option_strings == []:
            return action.help or ""
        return super()._get_help_string(action)


def _model_args(p: argparse.ArgumentParser, several: bool = False, mmproj: bool = False) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None, action="append" if several else "store",
                   metavar="[NAME=]MODEL" if several else None,
                   help="GGUF file (a split file's first shard), HF folder, or Hugging Face repo "
                        "id org/name or org/name:QUANT (the local HF cache first, then a download "
                        "unless HF_HUB_OFFLINE=1); none: SmolLM2-135M-Instruct" + (
                            ". Repeatable: several models, requests choose by `model` (NAME=: the "
                            "id it is served as; the first: when a request names none)" if several else ""))
    g.add_argument("--revision", default=None, help="branch, tag or commit of a repo id --model")
    if mmproj:
        g.add_argument("--mmproj", default=None, metavar="FILE",
                       help="llama.cpp's mmproj GGUF for a GGUF --model (the vision tower and projector of "
                            "Gemma 3, Gemma 4, Idefics3 / SmolVLM, Mistral 3, Qwen2(.5)-VL, Qwen3-VL): images "
                            "with a GGUF text model" + (" (the first model)" if several else ""))
    g.add_argument("--threads", "-t", type=_int_at_least(1), default=None,
                   help="CPU threads for the native kernels and BLAS (FX_ENGINE_THREADS); none: "
                        "the CPUs this process may use")


def _numerics_args(g: Any) -> None:
    g.add_argument("--batch-invariant", action="store_true",
                   help="fixed-tile matmuls: bitwise-identical results across batch/chunk sizes")
    g.add_argument("--numerics", default="auto", choices=("auto", "exact", "int8"),
                   help="how activations meet quantized weights: int8 rounds them to 8 bits per "
                        "group (int8 dot products, as llama.cpp does: 1.5-2.5x faster), exact "
                        "keeps float32 (mlx-lm's numerics); auto (default): int8 for quantized "
                        "models on CPUs with int8 dot products, else exact (docs/numerics.md)")
    g.add_argument("--activation-bits", type=int, default=None, choices=(8,),
                   help="8: the older spelling of --numerics int8")
    g.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="quantize the KV cache (full-attention layers) to 4 or 8 bits")
    g.add_argument("--kv-group-size", type=int, default=64, help="KV quantization group size")
    g.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="positions below this stay in float when --kv-bits is set (mlx-lm's default)")


# chat's sampling flags default to None: the model's stored settings, else llama.cpp's
# (fx_engine/loading/sampling_defaults.py); generate and serve stay greedy by default
_CHAT_SAMPLING = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}


def _sampling_args(p: argparse.ArgumentParser, serve: bool = False, chat: bool = False) -> None:
    _model_args(p, several=serve, mmproj=not chat)
    g = p.add_argument_group(
        "sampling" + (" (request defaults)" if serve else ""),
        "Each one not given comes from the model's generation_config.json or GGUF\n"
        "general.sampling.* keys, else llama.cpp's defaults (temp 0.8, top-k 40,\n"
        "top-p 0.95, min-p 0.05); the chat's first line says which." if chat else
        None if serve else "Greedy unless these say otherwise (chat samples with the model's settings).")
    g.add_argument("--max-tokens", type=int, default=256,
                   help="most tokens to generate" + (" when a request gives no max_tokens (trimmed "
                                                     "to the room its prompt leaves)" if serve else ""))
    g.add_argument("--temp", type=float, default=None if chat else 0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=None if chat else 1.0,
                   help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=None if chat else 0,
                   help="keep the k likeliest tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=None if chat else 0.0,
                   help="drop tokens below this fraction of the likeliest's probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="1.1-1.3 discourages repeats (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (none: a fresh one)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    if not serve:  # the server takes these per request (response_format, ...)
        c = p.add_argument_group("structured output (one of)")
        c.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="a JSON Schema (JSON text or @FILE) the output must match")
        c.add_argument("--json", action="store_true", help="any JSON object")
        c.add_argument("--regex", default=None, help="a regular expression the output must match")
        c.add_argument("--grammar", default=None,
                       help="a Lark or GBNF grammar (text or @FILE) the output must match")
    n = p.add_argument_group("numerics and memory")
    n.add_argument("--max-kv-size", "--ctx-size", "-c", type=_int_at_least(1), default=None,
                   metavar="N", dest="max_kv_size",
                   help="context size per request: prompt + max_tokens at most N tokens (a "
                        "request beyond it is a 400 naming the limit; without max_tokens a "
                        "reply stops when the context is full); none: the model's own context "
                        "length" if serve else
                        "context size: prompt + reply at most N tokens (a longer prompt is "
                        "an error, a reply stops when the context is full); none: the "
                        "model's own context length")
    n.add_argument("--no-warmup", action="store_true",
                   help="start serving without the warm-up request that compiles the steps "
                        "first (then the first request pays for it)" if serve else
                        "skip the warm-up run that compiles the steps before the prompt "
                        "(its time is shown apart in the stats, not as prompt time)")
    _numerics_args(n)
    n.add_argument("--kv-dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="the KV cache's element type (none: the activations' dtype)")
    d = p.add_argument_group("speculative decoding")
    d.add_argument("--draft-model", default=None,
                   help="speculative decoding with this smaller model (same tokenizer), an "
                        "EAGLE-3 head's folder (config.json with draft_vocab_size), mtp: "
                        "the MTP module the model's checkpoint ships (DeepSeek-V3, GLM-4.5, "
                        "Qwen3-Next), or an MTP module published alone (SGLang's NextN "
                        "folder, an MTP-only GGUF; docs/cli.md#speculative-decoding)")
    d.add_argument("--self-draft-layers", type=int, default=None,
                   help="speculative decoding with the model's own first N layers as the draft")
    d.add_argument("--num-draft-tokens", type=int, default=None,
                   help="most draft tokens per step (none: 4, adapted per request)")
    d.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding with n-gram drafts from the prompt and output")
    t = p.add_argument_group("several processes")
    t.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="shard the model over the N processes started by `mlx.launch -n N` "
                        "(each runs this same command; rank 0 prints)")
    t.add_argument("--pipeline-parallel", type=int, default=None, metavar="N",
                   help="split the model's layers over the N processes started by `mlx.launch -n N` "
                        "(with --tensor-parallel T: T x N processes, N stages of T ranks; needs "
                        "MPI: `mpirun -np T*N`)")
    t.add_argument("--pipeline-layers", type=_layer_counts, default=None, metavar="N,N,...",
                   help="each pipeline stage's number of layers (e.g. 20,10 for hosts of unequal "
                        "memory; implies --pipeline-parallel with one stage per count); none: "
                        "as even as possible")
    a = p.add_argument_group("adapters and prompt cache")
    a.add_argument("--adapter", action="append", default=None, metavar="[NAME=]PATH",
                   help="a LoRA/DoRA adapter folder (mlx-lm or PEFT). generate/chat: the one to "
                        "use; serve: repeatable, chosen per request by model 'BASE:NAME'")
    # serve's name is --prompt-cache-dir (with this one as an alias): one option, one dest
    a.add_argument(*(("--prompt-cache-dir",) if serve else ()), "--prompt-cache", default=None,
                   metavar="DIR", dest="prompt_cache",
                   help="prefix-cache directory: restore the prompt's cached prefix, save new ones")


def _text_arg(value: str) -> str:
    """A flag's text, or a file's with @FILE."""
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def _constraint(a: argparse.Namespace) -> dict[str, Any]:
    """generate/chat's structured-output flags as fx_engine.stream's arguments."""
    given = {k: v for k, v in (("json_schema", getattr(a, "json_schema", None)),
                               ("regex", getattr(a, "regex", None)),
                               ("grammar", getattr(a, "grammar", None))) if v is not None}
    if getattr(a, "json", False):
        given["response_format"] = {"type": "json_object"}
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --json, --regex, --grammar")
    if "json_schema" in given:
        text = _text_arg(given["json_schema"])
        try:
            given["json_schema"] = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: not valid JSON ({e})") from e
    if "grammar" in given:
        given["grammar"] = _text_arg(given["grammar"])
    return given


def _kwargs(a: argparse.Namespace, model: Any = None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_tokens=a.max_tokens, temperature=a.temp, top_p=a.top_p, top_k=a.top_k,
        min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop,
    )
    for key in ("temperature", "top_p", "top_k", "min_p"):  # chat's unset flags (see cmd_chat)
        if kw[key] is None:
            del kw[key]
    if a.prompt_lookup:
        kw["prompt_lookup"] = True
    if a.draft_model is not None or a.self_draft_layers is not None:
        kw["draft_model"] = _draft(a, model)
    if a.num_draft_tokens is not None:
        kw["num_draft_tokens"] = a.num_draft_tokens
    if getattr(a, "prompt_cache", None):
        kw["prompt_cache_dir"] = a.prompt_cache
    kw.update(_constraint(a))
    if model is not None and getattr(a, "adapter", None):
        names = model.adapters.names()
        if len(names) != 1:
            raise ValueError("--adapter: generate and chat use one adapter")
        kw["adapter"] = names[0]
    return kw


_DRAFTS: dict[Any, Any] = {}


def _draft(a: argparse.Namespace, model: Any) -> Any:
    """The draft model, loaded once per process (chat reuses it across turns)."""
    key = (a.draft_model, a.self_draft_layers)
    if a.draft_model == "mtp" and a.self_draft_layers is None:
        # the MTP module the model's own checkpoint ships (kept per model by mtp_drafter_for)
        from fx_engine.engine.mtp_drafter import mtp_drafter_for

        return mtp_drafter_for(model)
    if key not in _DRAFTS:
        if a.draft_model is not None and a.self_draft_layers is not None:
            raise ValueError("give --draft-model or --self-draft-layers, not both")
        if a.self_draft_layers is not None:
            from fx_engine.engine.drafters import self_draft_model

            _DRAFTS[key] = self_draft_model(model, a.self_draft_layers)
        elif _is_head(a.draft_model):
            from fx_engine.engine.eagle3_drafter import Eagle3Drafter

            # (its matrices in 8 bits on the native kernels: the drafts' cost, not the output)
            _DRAFTS[key] = Eagle3Drafter.load(a.draft_model, model, bits=8)
        elif _is_mtp(a.draft_model):
            # an MTP module published apart from its target (SGLang's NextN export, an MTP-only
            # GGUF) for a target whose own checkpoint dropped it
            from fx_engine.engine.mtp_drafter import MtpDrafter

            _DRAFTS[key] = MtpDrafter.load(a.draft_model, model)
        else:
            # (the target's numerics: a draft only proposes, the target's verify decides)
            _DRAFTS[key] = fx_engine.load(a.draft_model, numerics=getattr(a, "numerics", "auto"),
                                          activation_bits=getattr(a, "activation_bits", None))
    return _DRAFTS[key]


def _is_mtp(path: str) -> bool:
    """Whether --draft-model names MTP modules alone (`loading.drafter.is_mtp_checkpoint`)."""
    from fx_engine.loading.drafter import is_mtp_checkpoint

    return is_mtp_checkpoint(path)


def _is_head(path: str) -> bool:
    """Whether --draft-model names an EAGLE-3 head (a folder or a Hub repo id) rather than a model."""
    from fx_engine.loading.drafter import is_eagle3_head

    return is_eagle3_head(path)


def _load(a: argparse.Namespace):
    model = fx_engine.load(a.model, revision=getattr(a, "revision", None),
                           batch_invariant=a.batch_invariant, kv_bits=a.kv_bits,
                           kv_group_size=a.kv_group_size, quantized_kv_start=a.quantized_kv_start,
                           numerics=getattr(a, "numerics", "auto"),
                           activation_bits=getattr(a, "activation_bits", None),
                           kv_dtype=getattr(a, "kv_dtype", None),
                           tensor_parallel=getattr(a, "tensor_parallel", None),
                           pipeline_parallel=getattr(a, "pipeline_parallel", None),
                           pipeline_layers=getattr(a, "pipeline_layers", None),
                           **({"mmproj": a.mmproj} if getattr(a, "mmproj", None) else {}))
    for spec in getattr(a, "adapter", None) or ():
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = None, spec
        fx_engine.load_adapter(model, path, name=name)
    if getattr(a, "max_kv_size", None) is not None:  # --max-kv-size / --ctx-size / -c
        model = model.with_max_context(a.max_kv_size)
    return model


def _fit(model: Any, prompt: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """max_tokens trimmed to the room the context (the model's, or --max-kv-size) leaves
    after this prompt, so a long reply stops when the context is full (as llama.cpp's do);
    a prompt that alone fills it is refused by stream(), naming the limit."""
    from fx_engine.engine.request import prompt_ids

    room = model.context_length + 1 - len(prompt_ids(model, prompt))
    return {**kw, "max_tokens": room} if 1 <= room < kw["max_tokens"] else kw


def _warm_up(model: Any, kw: dict[str, Any]) -> float:
    """Run the request's compiled steps once on a one-token prompt before the real one (as
    llama.cpp warms up with an empty run): MLX traces them and JIT-compiles their fused CPU
    kernels with g++ (tens of seconds on a machine's first run, cached on disk after; the
    kernels do not depend on the shapes, so the prompt's own bucket reuses them). The
    seconds it took, which the stats show apart from the prompt's time."""
    import time

    skip = ("max_tokens", "stop", "prompt_cache_dir")
    first = list(model.tokenizer.encode("Hi"))[:1] or [0]
    t0 = time.perf_counter()
    with working("warm-up: compiling the steps (slow the first time)"):
        for _ in fx_engine.stream(model, first, max_tokens=2,
                                  **{k: v for k, v in kw.items() if k not in skip}):
            pass
    return time.perf_counter() - t0


def _report(usage: Any, model: Any = None, warmup: float | None = None) -> None:
    import mlx.core as mx

    kv_bytes = 0
    if model is not None:  # what this conversation's cache holds (float vs quantized)
        from fx_engine.core.cache import bytes_per_token

        per = bytes_per_token(model.cache_layout(), model.cache_dtype)
        kv_bytes = per * (usage.prompt_tokens + usage.completion_tokens)
    kv = f" | KV cache {kv_bytes / 1e6:.1f} MB" if kv_bytes else ""
    if usage.drafted_tokens:
        kv += (f" | drafts accepted {usage.accepted_tokens}/{usage.drafted_tokens} "
               f"({100 * usage.accepted_tokens / usage.drafted_tokens:.0f}%)")
    cached = getattr(usage, "cached_tokens", 0) or 0
    reuse = f" ({cached} from the prompt cache)" if cached else ""
    # the warm-up's compile time is its own field, never counted as prompt time
    warm = f"warm-up and compile: {warmup:.2f} s | " if warmup is not None else ""
    print(
        f"\n[{warm}prompt: {usage.prompt_tokens} tokens{reuse}, {usage.prompt_tps:.1f} tok/s | "
        f"generation: {usage.completion_tokens} tokens, {usage.generation_tps:.1f} tok/s | "
        f"peak memory {mx.get_peak_memory() / 1e9:.2f} GB{kv}]",
        file=sys.stderr,
    )


def _quiet_unless_rank0(a: argparse.Namespace) -> None:
    """Tensor-parallel ranks other than 0 run the same generation silently."""
    import mlx.core as mx

    if (getattr(a, "tensor_parallel", None) or getattr(a, "pipeline_parallel", None)
            or getattr(a, "pipeline_layers", None)) and \
            mx.distributed.init().rank() != 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")


def cmd_generate(a: argparse.Namespace) -> int:
    model = _load(a)
    _quiet_unless_rank0(a)
    prompt: Any = a.prompt
    images = [Path(p) for p in (a.image or ())]
    if images and a.raw:
        raise ValueError("--image needs the chat template: leave out --raw")
    missing = [str(p) for p in images if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--image: no such file: {missing[0]}")
    if not a.raw:
        content: Any = a.prompt
        if images:  # (the images first, then the question: as Gemma 3's examples put them)
            content = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": a.prompt}]
        prompt = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": content}
        ]
    kw = _kwargs(a, model) if images else _fit(model, prompt, _kwargs(a, model))
    warmup = None if a.no_warmup else _warm_up(model, kw)
    last = None
    for delta in fx_engine.stream(model, prompt, **kw):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        last = delta
    sys.stdout.write("\n")
    if last is not None and last.usage is not None:
        _report(last.usage, model, warmup)
    return 0


class _StopReply:
    """Ctrl-C while chat replies: the first SIGINT stops the reply at its next token (the
    engine is never interrupted mid-step); a second one raises KeyboardInterrupt at once,
    which the chat loop catches too. Only the reply ends: the session goes on. The previous
    handler (Ctrl-C at the prompt ends the chat) is back on exit."""

    def __init__(self) -> None:
        self.hit = False
        self._previous: Any = None

    def __enter__(self) -> "_StopReply":
        import threading

        if threading.current_thread() is threading.main_thread():  # (signal's rule)
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def cmd_chat(a: argparse.Namespace) -> int:
    model = _load(a)
    rank = None  # tensor / pipeline parallel: rank 0 reads the terminal and sends each line
    if model.ranks > 1:
        import mlx.core as mx

        from fx_engine.runtime.distributed import broadcast

        rank = mx.distributed.init().rank()
        _quiet_unless_rank0(a)
    from fx_engine.loading.sampling_defaults import chat_sampling, describe

    messages: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    interactive = sys.stdin.isatty() and not rank
    given = {arg: getattr(a, flag) for flag, arg in _CHAT_SAMPLING.items()}
    sampling, sources = chat_sampling(model.path, given)
    kw = {**_kwargs(a, model), **sampling}
    if not rank:
        print(f"fx-engine chat: sampling {describe(sampling, sources)}", file=sys.stderr)
    warmup = None if a.no_warmup else _warm_up(model, kw)
    if interactive:
        print("fx-engine chat: type a message; /reset clears the conversation, /exit, Ctrl-D "
              "or Ctrl-C at the prompt quits, Ctrl-C during a reply stops the reply.")
    while True:
        line: str | None = None
        if not rank:
            try:
                line = input(">>> " if interactive else "")
            except EOFError:
                line = None
            except KeyboardInterrupt:  # Ctrl-C at the prompt: the chat ends (as llama.cpp's)
                print(file=sys.stderr)
                line = None
        if rank is not None:  # every rank runs the same conversation (SPMD)
            line = broadcast(line, rank)
        if line is None:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply, last = [], None
        # Ctrl-C stops this reply only; what was printed stays in the conversation as the
        # assistant's turn (llama.cpp's interactive mode keeps it in its context; Ollama drops
        # it but keeps the question, leaving two user turns in a row, which some chat
        # templates refuse). Several ranks run the reply in lockstep: there Ctrl-C ends all.
        stop = _StopReply() if rank is None else contextlib.nullcontext(None)
        try:
            with stop:
                for delta in fx_engine.stream(model, messages, **_fit(model, messages, kw)):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    reply.append(delta.text)
                    last = delta
                    if getattr(stop, "hit", False):
                        break
        except ValueError as e:  # e.g. the conversation outgrew the context: keep the session
            messages.pop()
            print(f"\nfx-engine: error: {e} (try /reset)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler was set
            if rank is not None:
                raise
            stop.hit = True
        sys.stdout.write("\n")
        if getattr(stop, "hit", False):
            print("[reply stopped (Ctrl-C); the conversation goes on]", file=sys.stderr)
            if not "".join(reply):  # stopped before a word: as if never asked
                messages.pop()
                continue
        elif a.verbose and last is not None and last.usage is not None:
            _report(last.usage, model, warmup)
            warmup = None  # shown once, with the first reply
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_cache_prompt(a: argparse.Namespace) -> int:
    """Prefill a prompt (e.g. a long system prompt) into a prefix-cache directory, like
    mlx-lm's cache_prompt: later runs with --prompt-cache DIR start from it."""
    model = _load(a)
    text = sys.stdin.read() if a.prompt == "-" else a.prompt
    if a.prompt.startswith("@"):
        with open(a.prompt[1:], encoding="utf-8") as f:
            text = f.read()
    if a.system:  # rendered as the system message of a chat, without a generation prompt
        ids = list(model.tokenizer.apply_chat_template(
            [{"role": "system", "content": text}], add_generation_prompt=False, tokenize=True))
    else:
        ids = list(model.tokenizer.encode(text))
    engine = fx_engine.Engine(model, max_rows=1, prefix_cache_dir=a.prompt_cache)
    with working(f"prefilling {len(ids)} tokens into {a.prompt_cache}"):
        out = engine.submit(ids, max_tokens=1).result()  # the whole prompt is snapshotted
    disk = engine.stats()["prefix_cache"]["disk"]
    print(f"cached {len(ids)} tokens in {a.prompt_cache} ({disk['entries']} entries; "
          f"{out.usage.cached_tokens} were already cached)", file=sys.stderr)
    return 0


def _disk_budget(a: argparse.Namespace) -> dict[str, Any]:
    """The Engine's disk-tier budget argument, if --prompt-cache-disk-bytes was given (it
    needs the tier's directory: alone it would change nothing)."""
    if a.prompt_cache_disk_bytes is None:
        return {}
    if not a.prompt_cache:
        raise ValueError("--prompt-cache-disk-bytes: needs --prompt-cache-dir (the disk tier)")
    return {"prefix_cache_disk_bytes": a.prompt_cache_disk_bytes}


def cmd_serve(a: argparse.Namespace) -> int:
    """An OpenAI-compatible server (fx_engine/server/app.py) on one Engine; several --model
    (or --memory-budget, --idle-unload): a pool of them (fx_engine/server/pool.py)."""
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from fx_engine.server.app import create_app

    served = _served_models(a)
    pooled = len(served) > 1 or a.memory_budget is not None or a.idle_unload is not None
    if len(served) > 1 and a.model_id:
        raise ValueError("--model-id: with several --model, name each one --model NAME=PATH")
    defaults: dict[str, Any] = {"max_tokens": a.max_tokens, "temperature": a.temp, "top_p": a.top_p,
                                "top_k": a.top_k, "min_p": a.min_p}
    # (given only: a request's own value wins, and none means the engine's default)
    defaults.update({k: v for k, v in (("repetition_penalty", a.repetition_penalty),
                                       ("seed", a.seed), ("stop", a.stop)) if v is not None})
    model, engine, own = _serve_engine(a, served, 0)
    defaults.update(own)
    tp = model.ranks > 1
    if tp and pooled:
        raise ValueError("several models, --memory-budget and --idle-unload: not with "
                         "--tensor-parallel or --pipeline-parallel")
    if tp:
        import mlx.core as mx

        rank = mx.distributed.init().rank()
        if rank != 0:  # rank 0 serves HTTP and schedules; this rank runs the same steps
            logging.getLogger("fx_engine.server").info("rank %d following rank 0", rank)
            engine.follow()
            return 0
    template = a.chat_template
    if template and template.startswith("@"):
        with open(template[1:], encoding="utf-8") as f:
            template = f.read()
    try:
        template_args = json.loads(a.chat_template_args) if a.chat_template_args else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-args: not JSON ({e})") from None
    if template_args is not None and not isinstance(template_args, dict):
        raise ValueError("--chat-template-args: must be a JSON object")
    model_id = served[0][0] or a.model_id or _model_id(model, served[0][1])
    limits: dict[str, Any] = dict(api_key=a.api_key, chat_template=template,
                                  chat_template_args=template_args,
                                  max_request_bytes=a.max_request_bytes, stream_buffer=a.stream_buffer,
                                  stream_unread_bytes=a.stream_unread_bytes, body_timeout=a.body_timeout,
                                  image_urls=not a.no_image_urls, image_url_bytes=a.image_url_max_bytes,
                                  image_url_timeout=a.image_url_timeout)
    pool = None
    if not pooled:
        app = create_app(engine, model_id, defaults=defaults, **limits)
    else:
        pool = _serve_pool(a, served, model_id, engine, own)
        app = create_app(pool, defaults={k: v for k, v in defaults.items() if k not in own}, **limits)
    from fx_engine.server.connections import server_config

    config = server_config(app, host=a.host, port=a.port, header_timeout=a.header_timeout,
                           timeout_keep_alive=a.timeout_keep_alive,
                           max_connections=a.max_connections, log_level="warning",
                           timeout_graceful_shutdown=a.shutdown_timeout)
    log = logging.getLogger("fx_engine.server")
    own_context = int(model.config.max_position_embeddings)
    if a.max_kv_size is not None and a.max_kv_size > own_context:  # (llama.cpp warns too)
        log.warning("--max-kv-size %d exceeds the model's context of %d tokens: %d is used",
                    a.max_kv_size, own_context, own_context)
    log.info("fx-engine %s serving %s%s (%s, %s numerics, fingerprint %s) on http://%s:%d; context %d tokens%s, "
             "%d rows, prefill chunk %d, queue %d, prefix cache %d MiB%s, KV %s, speculation %s, "
             "%d API key(s)",
             fx_engine.__version__, model_id,
             "".join(f", {model_id}:{n}" for n in model.adapters.names()),
             model.config.model_type, model.numerics, model.fingerprint, a.host, a.port, model.context_length,
             " (--max-kv-size)" if model.context_length < own_context else "",
             engine.max_rows, engine.prefill_chunk, engine.max_queue,
             a.prompt_cache_bytes >> 20, f" + disk {a.prompt_cache} ({engine.prefix_cache.disk.budget >> 20} MiB)"
             if a.prompt_cache else "",
             f"{engine.bytes_per_token:.0f} B/token", "prompt lookup" if a.prompt_lookup else (
                 _drafter_name(defaults.get("draft_model")) if "draft_model" in defaults else "off"),
             len(a.api_key or ()))
    engine.start()
    if not a.no_warmup:
        _warm_up_engine(engine, own)
    served_ids = [model_id]
    if pool is not None:
        log.info("models: %s; memory budget %s, idle unload %s", ", ".join(
            f"{e.name} ({e.state})" for e in pool.entries),
            "none" if pool.budget is None else f"{pool.budget / (1 << 30):.2f} GiB",
            "off" if a.idle_unload is None else f"{a.idle_unload:g} s")
        served_ids = [e.name for e in pool.entries]
        del model, engine, own, defaults  # the pool's now: unloading it frees it
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the
    # handler that was installed before it: this one, so that a requested shutdown ends
    # the process normally (exit code 0, the engine closed) instead of by the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = _ready_server(config, lambda url: log.info(
            "fx-engine ready: serving %s at %s", ", ".join(served_ids), url))
        server.run()
        if not server.started:  # e.g. the port is taken (uvicorn.run's exit code)
            return 3
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pool is not None:
            pool.close()
        else:
            engine.close(wait=False)  # the server has stopped: nobody waits for these rows
    return 0


def _warm_up_engine(engine: Any, extra: dict[str, Any]) -> float:
    """serve's warm-up (as llama.cpp's server's; --no-warmup skips it): one short request
    through the started engine's compiled steps (and the request defaults' speculation)
    before the port opens, so that MLX's tracing and JIT compile (tens of seconds on a
    machine's first run) are not the first client's wait. The seconds it took."""
    import time

    first = list(engine.model.tokenizer.encode("Hi"))[:1] or [0]
    t0 = time.perf_counter()
    with working("warm-up: compiling the steps (slow the first time)"):
        engine.submit(first, max_tokens=2, **extra).result()
    took = time.perf_counter() - t0
    logging.getLogger("fx_engine.server").info("warm-up and compile: %.2f s", took)
    return took


def _ready_server(config: Any, ready: Any) -> Any:
    """A uvicorn.Server that calls ready(url) once its socket listens: the model is loaded
    and warmed by then, so this is when requests are answered at once (a supervisor or a
    script waits for the log line; uvicorn's own "running on" line is at a level serve
    keeps quiet). The URL has the port the system chose for --port 0."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)  # (a port in use: SystemExit, never ready)
            if not self.started or self.should_exit:
                return
            host, port = config.host, config.port
            for srv in getattr(self, "servers", ()):
                for sock in srv.sockets or ():
                    port = sock.getsockname()[1]
                    break
            ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")

    return Server(config)


def _served_models(a: argparse.Namespace) -> list[tuple[str | None, str | None]]:
    """serve's --model entries as (NAME or None, MODEL or None: the default model). NAME=MODEL
    unless the whole entry is an existing path."""
    from pathlib import Path

    out: list[tuple[str | None, str | None]] = []
    for spec in a.model or [None]:
        name, sep, path = (spec or "").partition("=")
        if spec and sep and name and path and not Path(spec).expanduser().exists():
            out.append((name, path))
        else:
            out.append((None, spec))
    return out


def _serve_engine(a: argparse.Namespace, served: list[tuple[str | None, str | None]],
                  i: int) -> tuple[Any, Any, dict[str, Any]]:
    """The i-th served model as serve loads it: (model, its Engine (not started), its request
    defaults: speculation). --adapter, --revision and --draft-model apply to the first
    model; serving several, each keeps its disk prefix cache in a folder of its own."""
    b = argparse.Namespace(**vars(a))
    b.model = served[i][1]
    if i:
        b.adapter = b.revision = b.mmproj = None
    if a.prompt_cache and len(served) > 1:
        import re

        name = served[i][0] or _model_id(None, served[i][1] or _default_path())
        b.prompt_cache = os.path.join(a.prompt_cache, re.sub(r"[^\w.-]", "_", name))
    model = _load(b)
    own: dict[str, Any] = {}
    if a.self_draft_layers is not None and a.draft_model is None:
        from fx_engine.engine.drafters import self_draft_model

        own["draft_model"] = self_draft_model(model, a.self_draft_layers)  # this model's own
    elif a.draft_model or a.self_draft_layers:
        if i == 0:
            own["draft_model"] = _draft(a, model)
    if a.prompt_lookup:
        own["prompt_lookup"] = True
    if a.num_draft_tokens is not None:
        own["num_draft_tokens"] = a.num_draft_tokens
    # (sharded: every rank loaded the same draft; requests name it by its place in drafts=)
    engine = fx_engine.Engine(model, max_rows=a.decode_concurrency, prefill_chunk=a.prefill_step_size,
                              max_queue=a.max_queue, prefix_cache_bytes=a.prompt_cache_bytes,
                              prefix_cache_dir=b.prompt_cache,
                              **_disk_budget(b),
                              prefix_cache_entries=a.prompt_cache_size, lockstep=model.ranks > 1,
                              # (models only: a head drafts beside one process's target)
                              drafts=[own["draft_model"]] if hasattr(own.get("draft_model"), "params") else [])
    return model, engine, own


def _drafter_name(d: Any) -> str:
    return {"eagle3": "EAGLE-3 head", "mtp": "MTP module"}.get(getattr(d, "kind", None), "draft model")


def _default_path() -> str:
    from fx_engine.loading.default_model import default_model_path

    return str(default_model_path())


def _serve_pool(a: argparse.Namespace, served: list[tuple[str | None, str | None]], first_id: str,
                engine: Any, own: dict[str, Any]) -> Any:
    """The ModelPool of serve's models (server/pool.py): the first loaded (`engine`), the
    others loaded on demand; each (re)loaded as the first was."""
    from fx_engine.loading.hub import resolve_model
    from fx_engine.server.pool import ModelPool, ModelSpec, default_budget

    def loader(i: int) -> Any:
        def load() -> tuple[Any, dict[str, Any]]:
            _, eng, extra = _serve_engine(a, served, i)
            return eng, extra
        return load

    specs = [ModelSpec(first_id, load=loader(0), path=str(engine.model.path or "") or None,
                       engine=engine, defaults=own, aliases=[served[0][1]] if served[0][1] else [],
                       reserve=a.prompt_cache_bytes)]
    for i, (name, spec) in enumerate(served[1:], 1):
        path = str(resolve_model(spec)) if spec else _default_path()  # (a missing one: an error now)
        specs.append(ModelSpec(name or _model_id(None, spec or path), load=loader(i), path=path,
                               aliases=[spec] if spec else [], reserve=a.prompt_cache_bytes))
    pool = ModelPool(specs, memory_budget=None if a.memory_budget is None else int(a.memory_budget * (1 << 30)),
                     idle_unload=a.idle_unload)
    resident = pool.resident_bytes()
    if pool.budget is None:
        pool.budget = default_budget(resident)
    elif pool.budget < resident:
        raise ValueError(f"--memory-budget: {a.memory_budget:g} GiB is less than the first model "
                         f"needs ({resident / (1 << 30):.2f} GiB)")
    return pool


def _model_id(model: Any, spec: str | None = None) -> str:
    """The id /v1/models lists: a Hugging Face repo id as given (org/name, org/name:QUANT:
    the cached snapshot's folder is a commit hash), else the file or folder name without its
    extension and without a GGUF quantization tag (SmolLM2-135M-Instruct.Q4_1.gguf:
    SmolLM2-135M-Instruct, the name the docs use); the server also accepts the file name,
    stem and path."""
    import re
    from pathlib import Path

    from fx_engine.loading.hub import parse_model_id

    if spec and not Path(spec).expanduser().exists() and parse_model_id(spec):
        return spec
    path = model.path if model is not None else spec  # (None: a model not loaded yet)
    if not path:
        return "fx-engine"
    p = Path(path)  # (a folder's name is kept whole: Mistral-7B-v0.1 has no extension)
    stem = p.stem if p.suffix.lower() == ".gguf" else p.name
    return re.sub(r"[.-](?:i?q\d\w*|f16|f32|bf16)$", "", stem, flags=re.IGNORECASE) or stem


def _native_line() -> str:
    from fx_engine.runtime import native

    if native.ensure(quiet=True) is None:
        err = (native.status()["error"] or "off (FX_ENGINE_NATIVE=0)").strip().splitlines()[0]
        return f"unavailable, MLX ops used instead: {err}"
    st = native.status()
    few = "a few-row path (vectors along the features) and " if native.few_gemm() else ""
    tiles = ("register tiles" if native.tiled_gemm() or not native.few_gemm()
             else "8-row passes of that path at every row count (the tiles would spill)")
    a8 = (f"int8 dot products ({native.int8_dot_isa()})" if native.int8_dot()
          else "a scalar int8 loop (no int8 dot-product path for this build)")
    if native.amx():
        a8 += "; AMX tile multiplies above 32 rows (FX_ENGINE_AMX=0 turns them off)"
    note = f"\n  fallback            {st['fallback']}" if st.get("fallback") else ""
    return (f"on, {st['threads']} threads, {native.isa()} build ({st['path']}){note}\n"
            f"  qgemm               {few}{tiles}\n"
            f"  8-bit activations   {a8}")


def _plan_lines(model_path: str | None) -> list[str]:
    """What fx_engine.load measured to choose the float32 matmul path for a model."""
    from fx_engine.runtime import native

    if native.ensure(quiet=True) is None:
        return ["  (no native kernels: MLX ops)"]
    try:
        model = fx_engine.load(model_path, numerics="exact")
    except Exception as e:  # noqa: BLE001 - info reports, never crashes
        return [f"  (could not load the model: {type(e).__name__}: {e})"]
    from fx_engine.loading.model import auto_numerics

    chosen = auto_numerics(model.params, model.params.numerics.native)
    lines = [f"  numerics by default: {chosen}" + (
        " (8-bit activations into the quantized matmuls; --numerics exact: float32)"
        if chosen == "int8" else " (float32 activations)")]
    report = model.matmul_report
    if report is None:
        return lines + ["  (not measured: no 4-/8-bit linears run on the native kernels here)"]
    return lines + ["  in exact numerics:"] + ["  " + line for line in report.lines()]


def _model_types_line() -> str:
    """The registry's model_types by family (config.json `model_type`, GGUF architecture)."""
    from fx_engine.core.models import FAMILIES

    parts = []
    for f in FAMILIES:
        types = ", ".join([*f.model_types, *(f"{w} (text)" for w in f.wrappers)])
        gguf = f"; GGUF: {', '.join(f.gguf_architectures)}" if f.gguf_architectures else ""
        parts.append(f"{f.name}: {types}{gguf}")
    return " | ".join(parts)


def _speculative_line(model_path: str) -> str:
    """What a checkpoint ships to draft with (its MTP modules), from its headers only."""
    from fx_engine.loading.drafter import mtp_summary
    from fx_engine.loading.hub import resolve_model

    try:
        if _is_head(model_path):
            return f"an EAGLE-3 head: --draft-model {model_path} drafts with it beside its target"
        return mtp_summary(resolve_model(model_path)) or "none (no MTP module in this checkpoint)"
    except Exception as e:  # noqa: BLE001 - info reports, never crashes
        return f"(could not read the checkpoint: {type(e).__name__}: {e})"


def cmd_info(a: argparse.Namespace) -> int:
    import mlx.core as mx

    from fx_engine.runtime.blas import active
    from fx_engine.runtime.malloc import active as malloc_active
    from fx_engine.loading.default_model import ModelNotFound, default_model_path

    blas = active()
    try:
        default = str(default_model_path(fetch=False))
    except ModelNotFound:
        default = "not installed (fetched on first use)"
    rows = [
        ("fx-engine", fx_engine.__version__),
        ("mlx", mx.__version__),
        ("python", platform.python_version()),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("device", str(mx.default_device())),
        ("BLAS", blas["name"] + (f" ({blas['path']})" if blas["path"] else "")),
        ("malloc tuning", "on (FX_ENGINE_MALLOC=default turns it off)" if malloc_active()
         else "off"),
        ("mx.compile JIT (g++)", shutil.which("g++") or "missing: mx.compile silently does nothing"),
        ("native CPU kernels", _native_line()),
        ("default model", default),
        ("model types", _model_types_line()),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if a.model is not None:
        print(f"speculative modules: {_speculative_line(a.model)}")
    if a.model is not None and (_is_mtp(a.model) or _is_head(a.model)):
        return 0  # (a drafter's checkpoint: no model to load and measure)
    if a.model is not None or not default.startswith("not installed"):
        print(f"matmul path chosen at load ({a.model or 'default model'}; measured once per "
              "machine, build and shape):")
        print("\n".join(_plan_lines(a.model)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fx-engine", description=__doc__, formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", formatter_class=_Help,
                       help="generate text from a prompt (streams tokens; greedy by default)")
    g.add_argument("prompt", help="the user message (with --raw: the text to continue)")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the raw text")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file for the user message (repeatable; models with an image "
                        "path, e.g. Gemma 3)")
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", formatter_class=_Help,
                       help="interactive multi-turn chat with the model's chat template (samples "
                            "with the model's settings; Ctrl-C stops a reply)",
                       description="Multi-turn chat: each line you type is a user message, rendered\n"
                                   "with the model's chat template. Ctrl-C during a reply stops that\n"
                                   "reply (what was printed stays in the conversation); Ctrl-C or\n"
                                   "Ctrl-D at the prompt, or /exit, quits; /reset clears the\n"
                                   "conversation.")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--verbose", "-v", action="store_true", help="print speed after each reply")
    _sampling_args(c, chat=True)
    c.set_defaults(func=cmd_chat)
    cp = sub.add_parser("cache-prompt", formatter_class=_Help, help="prefill a prompt into a prefix-cache directory")
    cp.add_argument("prompt", help="the text, @FILE, or - for stdin")
    cp.add_argument("--prompt-cache", required=True, metavar="DIR",
                    help="the prefix-cache directory (generate/chat/serve --prompt-cache)")
    cp.add_argument("--system", action="store_true",
                    help="cache it as a chat's system message (then use generate --system)")
    _model_args(cp)
    _numerics_args(cp.add_argument_group("numerics and memory (as the runs that reuse it)"))
    cp.set_defaults(func=cmd_cache_prompt)
    sv = sub.add_parser("serve", formatter_class=_Help, help="OpenAI-compatible HTTP server (drop-in for mlx_lm.server)")
    _sampling_args(sv, serve=True)
    sv.set_defaults(max_tokens=512)
    hs = sv.add_argument_group("HTTP server")
    hs.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    hs.add_argument("--port", type=int, default=8080,
                    help="port to listen on (0: a free one, named in the ready line)")
    hs.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every route but /health; "
                         "give it once per tenant: each key has its own prefix-cache scope")
    hs.add_argument("--model-id", default=None, help="the id /v1/models reports")
    hs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="server log level: info = a start-up line, \"fx-engine ready: serving "
                         "MODEL at URL\" once requests are answered, and one access line per "
                         "request; every 4xx/5xx is logged with its reason (warning/error)")
    hs.add_argument("--chat-template", default=None, help="a Jinja chat template (or @FILE)")
    hs.add_argument("--chat-template-args", default=None,
                    help='JSON variables for the template, e.g. \'{"enable_thinking": false}\'')
    bq = sv.add_argument_group("batching and prefix cache")
    bq.add_argument("--decode-concurrency", type=_int_at_least(1), default=32,
                    help="most requests in the batch")
    bq.add_argument("--prefill-step-size", type=_int_at_least(1), default=512, help="prefill chunk size")
    bq.add_argument("--max-queue", type=_int_at_least(0), default=256,
                    help="requests waiting beyond this: 429")
    bq.add_argument("--prompt-cache-bytes", type=_int_at_least(0), default=512 << 20,
                    help="in-memory prefix cache budget (0: off)")
    bq.add_argument("--prompt-cache-disk-bytes", type=_int_at_least(1), default=None,
                    help="the disk tier's byte budget (--prompt-cache-dir; none: 4 GiB; the "
                         "least recently used entries are deleted beyond it)")
    bq.add_argument("--prompt-cache-size", type=_int_at_least(1), default=None,
                    help="most prefix cache entries in memory (mlx_lm.server's flag)")
    cl = sv.add_argument_group("client limits (what one client may hold)")
    cl.add_argument("--max-request-bytes", type=int, default=4 << 20,
                    help="largest request body in bytes (413 beyond)")
    cl.add_argument("--no-image-urls", action="store_true",
                    help="do not fetch images that requests name by http(s) URL (a 400 asking for "
                         "a data URL): for a server open to clients it should not make requests for")
    cl.add_argument("--image-url-max-bytes", type=_int_at_least(1), default=20 << 20,
                    help="largest image fetched from an http(s) URL, in bytes (a 400 beyond)")
    cl.add_argument("--image-url-timeout", type=float, default=10.0,
                    help="seconds one image URL's fetch may take (a 400 beyond)")
    cl.add_argument("--max-connections", type=int, default=512,
                    help="open connections beyond this get a 503 and are closed")
    cl.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection may take to send a request head, from its "
                         "start or its previous response (slow-header clients are closed)")
    cl.add_argument("--body-timeout", type=float, default=30.0,
                    help="seconds a request body may take to arrive whole, once its head has "
                         "(a 408 beyond, and the connection is closed)")
    cl.add_argument("--timeout-keep-alive", type=int, default=5,
                    help="seconds an idle connection stays open between requests")
    cl.add_argument("--stream-buffer", type=int, default=256,
                    help="events per choice a streaming client may fall behind before it is "
                         "cut off and its rows freed")
    cl.add_argument("--stream-unread-bytes", type=int, default=64 << 10,
                    help="bytes a stream's client may leave unread (in the server's and the "
                         "kernel's send buffers) while it reads nothing before it is cut off "
                         "and its rows freed")
    cl.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds a graceful shutdown (SIGINT/SIGTERM) waits for open requests")
    mm = sv.add_argument_group("several models (repeat --model NAME=PATH)")
    mm.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                    help="GiB the resident models may use together: a model is loaded on demand "
                         "when it fits, unloading idle ones (least recently used first); a request "
                         "that cannot fit gets a 503 with Retry-After. none: the first model plus "
                         "80%% of the memory available once it is loaded")
    mm.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                    help="unload a model no request has used for this long (loaded again on the "
                         "next request for it); none: never")
    sv.set_defaults(func=cmd_serve, check=lambda a: _check_serve(sv, a))
    i = sub.add_parser("info", formatter_class=_Help, help="versions, device, BLAS, native kernels, default model")
    i.add_argument("--model", default=None,
                   help="also show the matmul path chosen for this model (default: the default "
                        "model) and the speculative (MTP) modules its checkpoint ships")
    i.set_defaults(func=cmd_info)
    for name, (_, text) in _DELEGATED.items():  # listed in --help; run by main() directly
        sub.add_parser(name, help=f"{text}; see fx-engine {name} --help", add_help=False)
    return parser


# Tools with their own argument parsers: everything after the word goes to them.
_DELEGATED = {
    "trace": ("fx_engine.tracing.cli", "step graphs, recompiles and run timelines (tools/trace.py)"),
    "golden": ("fx_engine.testing.golden_cli", "record / check golden outputs (regression tests)"),
}


def _set_threads(n: int) -> None:
    """--threads: the native kernels' pool and MKL/OpenMP read these at their first parallel
    call, which comes after this (only the BLAS preload has run)."""
    for var in ("FX_ENGINE_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        try:
            return int(importlib.import_module(_DELEGATED[argv[0]][0]).main(argv[1:]) or 0)
        except (ValueError, FileNotFoundError) as e:
            print(f"fx-engine {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", None) is not None:
        args.check(args)  # flags checked before the model loads (argparse errors, exit 2)
    if getattr(args, "threads", None):
        _set_threads(args.threads)
    from fx_engine.runtime.distributed import finish

    try:
        return finish(int(args.func(args) or 0))  # (MPI subgroups: ends the process here)
    except (ValueError, FileNotFoundError) as e:
        print(f"fx-engine: error: {e}", file=sys.stderr)
        return finish(2)
    except KeyboardInterrupt:
        return finish(130)


if __name__ == "__main__":
    sys.exit(main())
