"""What the server does with a request field it does not implement: never accept it silently.

Every top-level field of a request body is one of:
* implemented (a field of the endpoint's pydantic model);
* documented by OpenAI (or vLLM / llama.cpp) but not implemented here: a 400 that names it
  and says why (`UNSUPPORTED`), unless its value is the one that asks for nothing
  (`NEUTRAL`: `"store": false`, `"modalities": ["text"]`, ...);
* unknown: a 400 `"temprature: unknown field (did you mean 'temperature'?)"`.

Rejecting unknown fields rather than logging them is a measured choice: the official
`openai` and `anthropic` SDKs send only the fields their caller sets, and the clients checked
(lm-evaluation-harness's local-completions / local-chat-completions, litellm's
openai-compatible provider) send only documented fields, so a field the server does not
know is a client's mistake (a misspelling, another server's extension) that would otherwise
change nothing without a word. Nested objects (messages, tools) stay lenient: clients echo
an assistant message back with the keys the API returned (`refusal`, `annotations`, ...).
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

#: Documented fields this server does not implement, and why (a 400 names them).
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported; use 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; use 'tool_choice'",
    "suffix": "suffix (fill-in-the-middle insertion) is not supported",
    "best_of": "best_of is not supported; use n and choose among the choices",
    "store": "stored completions and responses are not supported (nothing is kept)",
    "previous_response_id": "responses are not stored: send the whole conversation in input",
    "conversation": "conversations are not stored: send the whole conversation in input",
    "background": "background responses are not supported",
    "service_tier": "service tiers are not supported",
    "modalities": "only the text modality is supported",
    "verbosity": "verbosity is not supported",
    "guided_decoding_backend": "the grammar engine is fixed (llguidance)",
    "guided_whitespace_pattern": "a custom JSON whitespace pattern is not supported",
    "context_management": "context editing (clearing earlier tool results or thinking as the "
                          "context fills) is not supported: send the history to keep (earlier "
                          "turns' thinking is always left out of the prompt)",
}

#: Values of UNSUPPORTED fields that ask for nothing beyond what the server does.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (False, None),
    "background": (False, None),
    "previous_response_id": (None,),
    "conversation": (None,),
    "service_tier": ("auto", "default", None),
    "modalities": (["text"], None),
    "best_of": (1, None),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "context_management": (None, {}, {"edits": []}),
}


def check_fields(body: Any, known: Iterable[str], where: str = "") -> None:
    """Raise ValueError("field: why") for the first field of a decoded JSON body that is
    not in `known` and not a neutral value of a documented unsupported field."""
    if not isinstance(body, dict):
        return
    known = set(known)
    for name, value in body.items():
        if name in known:
            continue
        path = f"{where}{name}"
        if name in UNSUPPORTED:
            if value in NEUTRAL.get(name, ()):
                continue
            raise ValueError(f"{path}: {UNSUPPORTED[name]}")
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"{path}: unknown field{hint}")
