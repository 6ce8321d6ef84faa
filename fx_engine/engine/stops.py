"""Stop-string matching on streamed text with hold-back (pure host logic, no MLX).

Text that could still be the beginning of a stop string is held back, so a stop string
never leaks partially into streamed output.

Each stop string keeps a Knuth-Morris-Pratt match state (how many of its leading
characters the text seen so far ends with), advanced one new character at a time: the
cost of a token is its new characters times the stops they can touch, amortized O(1)
each, whatever the stop strings are (a hostile stop list cannot slow the engine thread,
which runs this for every token of every row).
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1] that
    is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self._by_first: dict[str, list[int]] = {}
        for i, s in enumerate(self.stops):
            self._by_first.setdefault(s[0], []).append(i)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def _advance(self, i: int, ch: str) -> int:
        s, f, k = self.stops[i], self._fail[i], self._state[i]
        while k and s[k] != ch:
            k = f[k - 1]
        if s[k] == ch:
            k += 1
        return k

    def feed(self, text: str) -> str:
        """Add decoded text; return what is safe to emit now. When this text completes
        stop strings, the output ends where the earliest-starting of them starts (among
        those complete by the end of this text); nothing of it, or after it, is emitted."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._pending + text
        base = len(self._pending)
        state = self._state
        live = [i for i, k in enumerate(state) if k]  # stops partly matched so far
        cut = -1  # the earliest start of a stop completed in this text
        for j, ch in enumerate(text):
            touched = set(live)
            touched.update(self._by_first.get(ch, ()))
            live = []
            for i in touched:
                k = self._advance(i, ch)
                if k == len(self.stops[i]):
                    start = base + j + 1 - k
                    if cut < 0 or start < cut:
                        cut, self.matched = start, self.stops[i]
                    k = self._fail[i][k - 1]  # overlapping occurrences go on matching
                state[i] = k
                if k:
                    live.append(i)
            # (a stop this character did not touch had state 0 and keeps it)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = max(state)  # the longest text end that is a proper prefix of a stop
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold] if hold else buf

    def flush(self) -> str:
        """End of generation without a stop: release the held-back text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
