"""Prometheus text-format metrics for the server (no client library needed for these few).

One model: each sample unlabelled (`fx_requests_total 3`). Several models (server/pool.py):
every sample of a model carries its `model` label (`fx_requests_total{model="a"} 3`), each
metric's HELP and TYPE written once, its samples together (the text format's rule)."""

from __future__ import annotations

import threading
from typing import Any, Sequence

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def label(name: str) -> str:
    """A label value escaped as the text format wants it."""
    return name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


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

    def samples(self, labels: str = "") -> list[str]:
        """The sample lines; labels: `model="a",` (with its comma) or empty."""
        out = []
        acc = 0
        for b, c in zip(_BUCKETS, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{{labels}le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{{labels}le="+Inf"}} {self.n}')
        tail = f"{{{labels.rstrip(',')}}}" if labels else ""
        out += [f"{self.name}_sum{tail} {self.total}", f"{self.name}_count{tail} {self.n}"]
        return out

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"] + self.samples()


class Metrics:
    """One model's counters and histograms. `engine`: its engine, or None while the model
    is not loaded (its gauges are then 0; the counters carry on across loads)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # speculative decoding per drafter kind: [verify rounds, drafted tokens, accepted tokens]
        self.spec: dict[str, list[int]] = {}
        self._spec_lock = threading.Lock()
        self.ttft = Histogram("fx_time_to_first_token_seconds", "Time to first token (streamed requests).")
        self.itl = Histogram("fx_inter_token_latency_seconds", "Time between tokens of a streamed request.")

    def count_tokens(self, usage: Any) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens
        if getattr(usage, "draft_rounds", 0) and usage.drafter:
            with self._spec_lock:
                c = self.spec.setdefault(usage.drafter, [0, 0, 0])
                c[0] += usage.draft_rounds
                c[1] += usage.drafted_tokens
                c[2] += usage.accepted_tokens

    def labelled(self) -> list[tuple[str, str, str, list[tuple[str, float]]]]:
        """(name, kind, help, [(labels, value)]) of the metrics with a `drafter` label (vLLM's
        spec_decode counters, and the two figures people read off them)."""
        with self._spec_lock:
            spec = {k: list(v) for k, v in sorted(self.spec.items())}

        def each(f: Any) -> list[tuple[str, float]]:
            return [(f'drafter="{label(k)}"', f(*v)) for k, v in spec.items()]

        return [
            ("fx_spec_decode_num_drafts_total", "counter", "Verify steps that checked a row's drafts.",
             each(lambda r, d, a: r)),
            ("fx_spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified by the target.",
             each(lambda r, d, a: d)),
            ("fx_spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens the target accepted.",
             each(lambda r, d, a: a)),
            ("fx_spec_decode_acceptance_rate", "gauge", "Accepted / drafted tokens.",
             each(lambda r, d, a: a / d if d else 0.0)),
            ("fx_spec_decode_mean_accepted_length", "gauge",
             "Tokens per verify step of a drafting row: 1 + accepted drafts / verify steps (vLLM's mean "
             "acceptance length).", each(lambda r, d, a: 1 + a / r if r else 0.0)),
        ]

    def observe(self, completion: Any) -> None:
        self.count_tokens(completion.usage)
        self.ttft.observe(completion.usage.prompt_seconds)

    def values(self) -> list[tuple[str, str, str, float]]:
        """(name, kind, help, value) of each scalar metric, in the order they are written."""
        engine = self.engine
        st = engine.stats() if engine is not None else {
            "prefilling": 0, "decoding": 0, "queued": 0, "cache_bytes": 0, "prefill_cache_bytes": 0}
        pc = st.get("prefix_cache") or {}
        return [
            ("fx_requests_total", "counter", "Completions requested (n counts each).", self.requests),
            ("fx_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("fx_generation_tokens_total", "counter", "Generated tokens of finished requests.",
             self.completion_tokens),
            ("fx_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
             self.cached_tokens),
            ("fx_running_rows", "gauge", "Requests prefilling or decoding.", st["prefilling"] + st["decoding"]),
            ("fx_queued_requests", "gauge", "Requests waiting for admission.", st["queued"]),
            ("fx_kv_cache_bytes", "gauge", "KV cache bytes (decode batch + prefill caches).",
             st["cache_bytes"] + st["prefill_cache_bytes"]),
            ("fx_prefix_cache_hit_rate", "gauge", "Prefix cache lookups that hit.", pc.get("hit_rate", 0.0)),
            ("fx_prefix_cache_bytes", "gauge", "Bytes held by the in-memory prefix cache.", pc.get("bytes", 0)),
        ]

    def render(self) -> str:
        lines = []
        for name, kind, help_text, value in self.values():
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"])
        for name, kind, help_text, samples in self.labelled():
            if samples:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                          *(f"{name}{{{lab}}} {v}" for lab, v in samples)]
        lines += self.ttft.render() + self.itl.render()
        return "\n".join(lines) + "\n"


def render_models(models: Sequence[tuple[str, Metrics]],
                  extra: Sequence[tuple[str, str, str, Sequence[tuple[str, float]]]] = ()) -> str:
    """Several models' metrics, each sample labelled with its model; `extra`: more metrics
    as (name, kind, help, [(labels, value)]) (labels: `model="a"` or empty)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for model, m in models:
        lab = f'model="{label(model)}"'
        for name, kind, help_text, value in m.values():
            families.setdefault(name, (kind, help_text, []))[2].append(f"{name}{{{lab}}} {value}")
        for name, kind, help_text, samples in m.labelled():
            if samples:
                families.setdefault(name, (kind, help_text, []))[2].extend(
                    f"{name}{{{lab},{dl}}} {v}" for dl, v in samples)
    for name, kind, help_text, samples in extra:
        families.setdefault(name, (kind, help_text, []))[2].extend(
            f"{name}{{{lab}}} {v}" if lab else f"{name} {v}" for lab, v in samples)
    lines = []
    for name, (kind, help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    for attr in ("ttft", "itl"):
        hs = [(model, getattr(m, attr)) for model, m in models]
        if hs:
            h0 = hs[0][1]
            lines += [f"# HELP {h0.name} {h0.help}", f"# TYPE {h0.name} histogram"]
            for model, h in hs:
                lines += h.samples(f'model="{label(model)}",')
    return "\n".join(lines) + "\n"
