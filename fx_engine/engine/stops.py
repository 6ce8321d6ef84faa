"""Stop-string matching on streamed text with hold-back (pure host logic, no MLX).

Text that could still be the beginning of a stop string is held back, so a stop string
never leaks partially into streamed output.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add decoded text; return what is safe to emit now."""
        if self.stopped:
            return ""
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop
            hold = max(hold, _prefix_suffix(buf, s))
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold] if hold else buf

    def flush(self) -> str:
        """End of generation without a stop: release the held-back text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


def _prefix_suffix(buf: str, stop: str) -> int:
    """The length of the longest suffix of `buf` that is a proper prefix of `stop`.

    Only suffixes starting with stop[0] can match, so candidate starts are found with
    str.find (C speed) and each is checked once with startswith: cost ~len(stop) per
    candidate, not the quadratic scan of every length."""
    m = min(len(stop) - 1, len(buf))
    if m <= 0:
        return 0
    base = len(buf) - m
    i = buf.find(stop[0], base)
    while i >= 0:
        if stop.startswith(buf[i:]):
            return len(buf) - i  # the earliest start is the longest suffix
        i = buf.find(stop[0], i + 1)
    return 0
