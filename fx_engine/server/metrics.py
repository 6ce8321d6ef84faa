"""Prometheus text-format metrics for the server (no client library needed for these few)."""

from __future__ import annotations

import threading
from typing import Any

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            i = next((k for k, b in enumerate(_BUCKETS) if v <= b), len(_BUCKETS))
            self.counts[i] += 1
            self.total += v
            self.n += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(_BUCKETS, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{self.name}_sum {self.total}", f"{self.name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self, engine: Any):
        self.engine = engine
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram("fx_time_to_first_token_seconds", "Time to first token (streamed requests).")
        self.itl = Histogram("fx_inter_token_latency_seconds", "Time between tokens of a streamed request.")

    def count_tokens(self, usage: Any) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens

    def observe(self, completion: Any) -> None:
        self.count_tokens(completion.usage)
        self.ttft.observe(completion.usage.prompt_seconds)

    def render(self) -> str:
        st = self.engine.stats()
        pc = st.get("prefix_cache") or {}
        lines = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])

        metric("fx_requests_total", "counter", "Completions requested (n counts each).", self.requests)
        metric("fx_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens)
        metric("fx_generation_tokens_total", "counter", "Generated tokens of finished requests.",
               self.completion_tokens)
        metric("fx_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
               self.cached_tokens)
        metric("fx_running_rows", "gauge", "Requests prefilling or decoding.",
               st["prefilling"] + st["decoding"])
        metric("fx_queued_requests", "gauge", "Requests waiting for admission.", st["queued"])
        metric("fx_kv_cache_bytes", "gauge", "KV cache bytes (decode batch + prefill caches).",
               st["cache_bytes"] + st["prefill_cache_bytes"])
        metric("fx_prefix_cache_hit_rate", "gauge", "Prefix cache lookups that hit.",
               pc.get("hit_rate", 0.0))
        metric("fx_prefix_cache_bytes", "gauge", "Bytes held by the in-memory prefix cache.",
               pc.get("bytes", 0))
        lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"
