"""Per-token output of one request (pure host logic, no MLX): a sampled token (and its
logprob values) becomes a `TextDelta` event through incremental detokenizing, stop-string
matching (`stops.py`), logprob records and the length limit; at the end, the held-back
tail, the finish reason and the `Completion`.

Used by the Engine (one `TokenOutput` per request) and by `generate.py`'s reference loop,
so both report tokens exactly the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

from fx_engine.engine.request import Completion, TextDelta, TokenLogprob, Usage
from fx_engine.engine.stops import StopMatcher

__all__ = ["TokenOutput"]


#: The logprob reported for a token a constraint (or a -inf bias) rules out: JSON has no
#: -Infinity, and vLLM reports the same floor.
LOGPROB_FLOOR = -9999.0


def _finite(v: float) -> float:
    v = float(v)
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenOutput:
    """The output of one request so far: generated token ids, text pieces, logprobs.

    tokenizer: its `decode` names logprob tokens, its `vocab_size` is the first id that
    decodes to "" (models may pad their vocabulary past the tokenizer's); the incremental
    detokenizer (`detok`) is set by the caller when generation starts (None: nothing was
    decoded, e.g. cancelled while queued). eos: ids that end the request unreported.
    n_logprobs: how many top alternatives a logprob record keeps.
    """

    __slots__ = ("detok", "stops", "eos", "max_tokens", "want_logprobs", "n_logprobs",
                 "generated", "text", "lps", "_decode", "_known", "prompt_lps", "end_lp")

    def __init__(self, tokenizer: Any, eos: frozenset[int] | set[int], stops: StopMatcher,
                 max_tokens: int, want_logprobs: bool, n_logprobs: int = 0) -> None:
        self.detok = None
        self.stops = stops
        self.eos = eos
        self.max_tokens = max_tokens
        self.want_logprobs = want_logprobs
        self.n_logprobs = n_logprobs
        self.generated: list[int] = []
        self.text: list[str] = []
        self.lps: list[TokenLogprob] = []
        self._decode = tokenizer.decode
        self._known = tokenizer.vocab_size
        self.prompt_lps: list[TokenLogprob | None] | None = None  # set when asked (scoring)
        self.end_lp: TokenLogprob | None = None  # the record of the EOS that ended it

    def logprob(self, token: int, value: float, ids: Sequence[int],
                vals: Sequence[float]) -> tuple[TokenLogprob, ...]:
        """The logprob record of a sampled token: its logprob and the top n_logprobs
        alternatives (ids past the tokenizer's vocabulary have text "")."""
        known, decode = self._known, self._decode
        dec = lambda ids: decode(ids) if ids[0] < known else ""  # noqa: E731
        top = tuple((int(i), dec([int(i)]), _finite(v))
                    for i, v in list(zip(ids, vals))[: self.n_logprobs])
        return (TokenLogprob(token, dec([token]), _finite(value), top),)

    def add(self, token: int, lp: Any) -> tuple[TextDelta | None, str | None]:
        """One sampled token: (its delta, or None for EOS, which is not reported; the
        finish reason if it ends the request: "stop" (EOS or a stop string) or "length").
        Every other token gets one delta, even when its text is held back (a possible
        stop-string prefix, an incomplete UTF-8 sequence): token ids are never lost."""
        if token in self.eos:
            if lp:
                self.end_lp = lp[0]
            return None, "stop"
        self.generated.append(token)
        stops = self.stops
        text = stops.feed(self.detok.add(token) if token < self._known else "")
        if lp:
            self.lps.extend(lp)
        self.text.append(text)
        delta = TextDelta(text, (token,), lp)
        if stops.stopped:
            return delta, "stop"
        if len(self.generated) >= self.max_tokens:
            return delta, "length"
        return delta, None

    def finish(self, reason: str) -> str:
        """The held-back tail at the end (the detokenizer's rest and held stop-string
        prefixes; nothing after a matched stop string)."""
        if reason == "stop" and self.stops.stopped:
            tail = ""
        else:
            tail = self.stops.feed(self.detok.finalize()) if self.detok is not None else ""
        tail += self.stops.flush()
        self.text.append(tail)
        return tail

    def final_delta(self, tail: str, reason: str, usage: Usage) -> TextDelta:
        return TextDelta(tail, (), None, reason, usage, self.end_lp, self.stops.matched)

    def completion(self, reason: str, usage: Usage, prompt_ids: Sequence[int]) -> Completion:
        return Completion(
            text="".join(self.text), token_ids=tuple(self.generated), finish_reason=reason,
            logprobs=tuple(self.lps) if self.want_logprobs else None, usage=usage,
            prompt_token_ids=tuple(prompt_ids),
            prompt_logprobs=None if self.prompt_lps is None else tuple(self.prompt_lps),
            end_logprob=self.end_lp, stop_string=self.stops.matched,
        )

    def prompt_logprob(self, token: int, value: float, ids: Sequence[int], vals: Sequence[float],
                       n: int) -> TokenLogprob:
        """The record of one prompt token (its logprob and the n best alternatives)."""
        known, decode = self._known, self._decode
        dec = lambda i: decode([i]) if i < known else ""  # noqa: E731
        top = tuple((int(i), dec(int(i)), _finite(v)) for i, v in list(zip(ids, vals))[:n])
        return TokenLogprob(token, dec(token), _finite(value), top)
