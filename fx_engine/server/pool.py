"""Several models in one server: a `ModelPool` of named models, each an Engine loaded on
demand, within a memory budget.

    pool = ModelPool([ModelSpec("a", load=lambda: Engine(fx_engine.load("a.gguf"))),
                      ModelSpec("b", load=lambda: Engine(fx_engine.load("b/")))],
                     memory_budget=8 << 30, idle_unload=600)
    app = create_app(pool)                          # the pool's engines: started by it

What it does:
* Routing: a request's `model` (its JSON body's) names one model: its id, path, file name
  (with or without the extension), `ID:ADAPTER` or an adapter's own name; no `model`: the
  first model. An unknown name is a 404 (`model_not_found`), except on Anthropic's route,
  whose clients send Claude names they cannot change (the first model answers them).
* Loading on demand: a model not in memory is loaded (on a worker thread; requests for it
  wait for the one load) when it fits the budget with the models already resident; idle
  ones (no request in flight) are unloaded to make room, the least recently used first.
  When the resident models in use leave no room, the request is answered 503 with a
  Retry-After header (`insufficient_memory`): the pool never loads past its budget, nor a
  model larger than what the system reports available (/proc/meminfo, cgroup limits).
* What a model costs: its weights (before its first load: its weight files' size; after:
  the arrays it holds, measured), its in-memory prefix-cache budget, and its KV caches (what
  they hold now, at least KV_RESERVE_TOKENS positions' worth).
* `idle_unload`: a model with no request in flight for that many seconds is unloaded (a
  background thread); the next request for it loads it again.
* Unloading closes the engine, drops every reference to its model and returns MLX's cached
  buffers to the system (`mx.clear_cache()`).
* A request holds its model from the time its context is resolved until its response has
  been sent (streams included): the ASGI middleware `Leases` (create_app installs it)
  releases it.

`create_app(engine, model_id)` (one model, nothing to unload) uses no pool: the server is
exactly the one-model server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fastapi import Request

log = logging.getLogger("fx_engine.server")

RETRY_AFTER = 5  # seconds a client asked to wait for memory is told to wait
KV_RESERVE_TOKENS = 4096  # KV positions counted for a loaded model at least
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


class ModelUnavailable(Exception):
    """A request's model cannot serve it now: 404 (unknown name), 503 (memory short: with
    Retry-After), 500 (its load failed). Answered in the route's API shape (create_app)."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 retry_after: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after
        self.kind = kind or ("not_found_error" if status == 404 else "server_error")


@dataclasses.dataclass
class ModelSpec:
    """One model of a pool. name: the id /v1/models lists. load: builds its Engine (not
    started: the pool starts it), or (Engine, request defaults over the app's); None: it
    cannot be (re)loaded, so it is never unloaded (then `engine` must be given). path: where
    it is read from (other names requests may use; its weight files estimate its size
    before its first load). engine: already loaded (and started by the caller). aliases:
    more names for it. adapters: its LoRA adapters' names (routing before it is loaded).
    reserve: bytes it holds beyond weights and KV (its prefix-cache budget) before it has
    been loaded once. defaults: its own request defaults over the app's."""

    name: str
    load: Callable[[], Any] | None = None
    path: str | None = None
    engine: Any = None
    aliases: Sequence[str] = ()
    adapters: Sequence[str] = ()
    reserve: int = 0
    defaults: Mapping[str, Any] | None = None


def weight_files_bytes(path: str | Path | None) -> int:
    """The bytes of a model's weight files (a GGUF file with its shards, or a folder's
    safetensors/GGUF files); 0 when not found."""
    if path is None:
        return 0
    p = Path(path).expanduser()
    try:
        if p.is_file():
            if p.suffix.lower() == ".gguf":
                from fx_engine.loading.gguf import gguf_files

                return sum(f.stat().st_size for f in gguf_files(p))
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir()
                       if f.suffix.lower() in _WEIGHT_SUFFIXES and f.is_file())
    except (OSError, ValueError):
        pass
    return 0


def tree_nbytes(obj: Any) -> int:
    """Bytes of the arrays (MLX's and numpy's) in a tree of attrs classes, dataclasses,
    dicts, lists and tuples, each array counted once (a model's params)."""
    import attrs
    import mlx.core as mx
    import numpy as np

    total, seen, stack = 0, set(), [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen or x is None or isinstance(x, (str, int, float, bool)):
            continue
        seen.add(id(x))
        if isinstance(x, (mx.array, np.ndarray)):
            total += x.nbytes
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif attrs.has(type(x)):
            stack.extend(getattr(x, a.name, None) for a in attrs.fields(type(x)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
    return total


def available_memory() -> int | None:
    """Bytes the system can still give this process (Linux: /proc/meminfo's MemAvailable,
    bounded by a cgroup v2 memory limit); None where unknown."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            room = max(0, int(limit) - used)
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def default_budget(resident: int = 0, fraction: float = 0.8) -> int | None:
    """The budget when none is given: what is resident now plus `fraction` of what the
    system has available (Apple silicon: of Metal's recommended working set; elsewhere
    without /proc/meminfo: of the physical memory); None where nothing is known."""
    avail = available_memory()
    if avail is not None:
        return resident + int(fraction * avail)
    try:
        import mlx.core as mx

        info = mx.metal.device_info() if mx.metal.is_available() else None
        if info and info.get("max_recommended_working_set_size"):
            return int(fraction * info["max_recommended_working_set_size"])
    except Exception:  # noqa: BLE001 - no Metal: the physical memory below
        pass
    try:
        return int(fraction * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class _Entry:
    """A model of the pool and its state: "unloaded", "loading" or "loaded"."""

    def __init__(self, spec: ModelSpec, metrics: Any):
        self.spec, self.name, self.metrics = spec, spec.name, metrics
        names = {spec.name, *spec.aliases}
        if spec.path:
            p = Path(str(spec.path))
            names |= {str(spec.path), p.name, p.stem}
        self.names = names
        self.engine: Any = None
        self.ctx: Any = None
        self.state = "unloaded"
        self.leases = 0  # requests in flight on it
        self.waiting = 0  # requests waiting for its load
        self.last_used = time.monotonic()
        self.loading: concurrent.futures.Future | None = None
        self.weights = weight_files_bytes(spec.path)  # measured once loaded
        self.extra = spec.reserve  # prefix cache + KV, as last seen
        self.loads = self.unloads = self.rejected = 0
        self.load_seconds = 0.0

    def adapters(self) -> list[str]:
        engine = self.engine  # (another thread may unload it meanwhile)
        if engine is not None:
            return list(engine.model.adapters.names())
        return list(self.spec.adapters)

    def busy(self) -> bool:
        engine = self.engine
        return self.leases > 0 or self.waiting > 0 or (engine is not None and engine.has_work())


class ModelPool:
    """Named models loaded on demand within `memory_budget` bytes (None: unbounded),
    unloading the least recently used idle ones; `idle_unload`: seconds after which a model
    with no request in flight is unloaded (None: never). See the module docstring."""

    def __init__(self, specs: Sequence[ModelSpec], memory_budget: int | None = None,
                 idle_unload: float | None = None, retry_after: int = RETRY_AFTER):
        from fx_engine.server.metrics import Metrics

        if not specs:
            raise ValueError("a model pool needs at least one model")
        ids = [s.name for s in specs]
        dup = sorted({n for n in ids if ids.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be unique: {', '.join(map(repr, dup))} given twice")
        for s in specs:
            if s.load is None and s.engine is None:
                raise ValueError(f"model {s.name!r}: give a loader or a loaded engine")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
        if idle_unload is not None and not idle_unload > 0:
            raise ValueError(f"idle_unload must be a positive number of seconds, got {idle_unload!r}")
        # (the specs kept without their engines: an unloaded model must be referenced by nothing)
        self.entries = [_Entry(dataclasses.replace(s, engine=None), Metrics(s.engine)) for s in specs]
        # a name several models answer to (a shared file stem) names none of them
        counts: dict[str, int] = {}
        for e in self.entries:
            for n in e.names:
                counts[n] = counts.get(n, 0) + 1
        for e in self.entries:
            e.names = frozenset(n for n in e.names if counts[n] == 1 or n == e.name)
        self.default = self.entries[0]
        self.budget = memory_budget
        self.idle_unload = idle_unload
        self.retry_after = retry_after
        self._lock = threading.Lock()  # the entries' state
        self._load_lock = threading.Lock()  # one load (or unload) at a time
        self._detached: list[Any] = []  # engines unloaded, to close before the next load
        self._factory: Callable[[Any, ModelSpec, Any, Mapping[str, Any] | None], Any] | None = None
        self._closed = False
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        for e, s in zip(self.entries, specs):
            if s.engine is not None:
                e.engine, e.state = s.engine, "loaded"
                e.weights, e.extra = self._measure(e.engine)

    # ---- set-up

    def attach(self, factory: Callable[[Any, ModelSpec, Any, Mapping[str, Any] | None], Any]) -> None:
        """The app's context factory: factory(engine, spec, metrics, defaults) -> ServerContext
        (create_app's); builds the loaded models' contexts and starts the idle timer."""
        self._factory = factory
        for e in self.entries:
            if e.engine is not None and e.ctx is None:
                e.ctx = factory(e.engine, e.spec, e.metrics, e.spec.defaults)
        if self.idle_unload is not None and self._timer is None:
            self._timer = threading.Thread(target=self._idle_loop, name="fx-engine-idle-unload",
                                           daemon=True)
            self._timer.start()

    def catalog(self) -> list[str]:
        """Every id the server lists (models, then each one's adapters as ID:ADAPTER)."""
        return [x["id"] for x in self.listing()]

    # ---- which model a request names

    def entry_of(self, name: str | None) -> _Entry | None:
        """The model `name` denotes (None: the first), or None when no model has it."""
        if name is None:
            return self.default
        for e in self.entries:
            if name in e.names:
                return e
        base, sep, rest = name.partition(":")
        for e in self.entries:
            if (sep and base in e.names and rest in e.adapters()) or name in e.adapters():
                return e
        return None

    async def context_for(self, request: Request) -> Any:
        """The context of the model `request` names (its JSON body's `model`), held for the
        request (released by `Leases` once the response is sent); loads it if need be."""
        name = await _requested_model(request)
        entry = self.entry_of(name)
        if entry is None:
            if not request.url.path.startswith("/v1/messages"):
                raise ModelUnavailable(404, f"model: the model {name!r} does not exist (this "
                                       f"server serves {', '.join(map(repr, self.catalog()))}; "
                                       "see /v1/models)", code="model_not_found")
            entry = self.default  # Anthropic's clients: Claude names, the first model answers
        ctx = await self.acquire(entry)
        held = request.scope.get("fx_leases")
        if held is None:  # not behind `Leases`: nothing would release it later
            self.release(entry)
        else:
            held.append(entry)
        return ctx

    # ---- holding a model

    async def acquire(self, entry: _Entry) -> Any:
        """`entry`'s context with one lease taken (give it back with `release`), loaded first
        if need be; ModelUnavailable when it cannot be (memory short: 503)."""
        for _ in range(3):  # (a model loaded for us and unloaded again before we held it)
            start = False
            with self._lock:
                if self._closed:
                    raise ModelUnavailable(503, "the server is shutting down", retry_after=self.retry_after)
                if entry.state == "loaded":
                    entry.leases += 1
                    entry.last_used = time.monotonic()
                    return entry.ctx
                if entry.state == "unloaded":
                    self._plan(entry)  # ModelUnavailable when it does not fit
                    entry.state, entry.loading, start = "loading", concurrent.futures.Future(), True
                entry.waiting += 1
                fut = entry.loading
            if start:
                asyncio.get_running_loop().run_in_executor(None, self._load, entry)
            try:  # (a client that leaves stops waiting; the load goes on for the others)
                await asyncio.shield(asyncio.wrap_future(fut))
            except BaseException:
                with self._lock:
                    entry.waiting -= 1
                raise
            with self._lock:
                entry.waiting -= 1
                if entry.state == "loaded":
                    entry.leases += 1
                    entry.last_used = time.monotonic()
                    return entry.ctx
        raise ModelUnavailable(503, f"model {entry.name!r}: memory is contended, try again",
                               code="insufficient_memory", retry_after=self.retry_after)

    def release(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases = max(0, entry.leases - 1)
            entry.last_used = time.monotonic()

    # ---- memory

    def _measure(self, engine: Any) -> tuple[int, int]:
        """(weights, extra) bytes of a loaded engine: the arrays its model holds (and its
        draft models'); its prefix-cache budget and KV caches (at least KV_RESERVE_TOKENS)."""
        weights = tree_nbytes(engine.model.params) + sum(
            tree_nbytes(getattr(d, "params", None)) for d in getattr(engine, "_drafts", ()))
        return weights, self._extra(engine)

    @staticmethod
    def _extra(engine: Any) -> int:
        pc = getattr(engine, "prefix_cache", None)
        prefix = getattr(pc, "budget", 0) or 0
        kv = int(getattr(engine, "bytes_per_token", 0) * KV_RESERVE_TOKENS)
        try:
            st = engine.stats()
            kv = max(kv, st["cache_bytes"] + st["prefill_cache_bytes"])
        except Exception:  # noqa: BLE001 - a closing engine: the reserve
            pass
        return prefix + kv

    def _bytes(self, e: _Entry) -> int:
        """What `e` costs (or will, loaded): see the module docstring."""
        return e.weights + (self._extra(e.engine) if e.engine is not None else e.extra)

    def model_bytes(self, name: str) -> int:
        """What the model `name` costs (or will, once loaded: estimated until it has been)."""
        entry = self.entry_of(name)
        if entry is None:
            raise KeyError(name)
        with self._lock:
            return self._bytes(entry)

    def resident_bytes(self) -> int:
        return sum(self._bytes(e) for e in self.entries if e.state != "unloaded")

    def _plan(self, entry: _Entry) -> None:
        """Under the lock: make room for `entry` (unload idle models, least recently used
        first) or raise ModelUnavailable (503) leaving everything as it was."""
        if self.budget is None:
            return
        need = self._bytes(entry)
        if need > self.budget:
            entry.rejected += 1
            raise ModelUnavailable(503, f"model {entry.name!r} needs about {_gib(need)}, more than "
                                   f"the server's memory budget of {_gib(self.budget)}",
                                   code="insufficient_memory")
        resident = self.resident_bytes()
        victims = []
        for e in sorted((e for e in self.entries if e.state == "loaded" and e is not entry
                         and e.spec.load is not None and not e.busy()), key=lambda e: e.last_used):
            if resident + need <= self.budget:
                break
            victims.append(e)
            resident -= self._bytes(e)
        if resident + need > self.budget:
            entry.rejected += 1
            held = [e.name for e in self.entries if e.state != "unloaded" and e not in victims]
            raise ModelUnavailable(
                503, f"model {entry.name!r} is not loaded and the memory budget "
                f"({_gib(self.budget)}) is held by models serving requests "
                f"({', '.join(map(repr, held))}); retry in a few seconds",
                code="insufficient_memory", retry_after=self.retry_after)
        for v in victims:
            self._detach(v, "to make room for " + repr(entry.name))

    def _detach(self, e: _Entry, why: str) -> None:
        """Under the lock: `e` unloaded (its engine closed by the next load or unload)."""
        log.info("unloading model %s (%s)", e.name, why)
        self._detached.append(e.engine)
        e.weights, e.extra = e.weights, self._extra(e.engine)
        e.engine = e.ctx = None
        e.metrics.engine = None
        e.state = "unloaded"
        e.unloads += 1

    def _close_detached(self) -> None:
        """Under the load lock: close the unloaded engines, free their memory."""
        with self._lock:
            engines, self._detached = self._detached, []
        if not engines:
            return
        for engine in engines:
            engine.close(wait=False, timeout=30.0)
        del engines, engine
        gc.collect()
        import mlx.core as mx

        mx.clear_cache()

    def _load(self, entry: _Entry) -> None:
        """On a worker thread: load `entry` (planned by `acquire`), then settle its futures."""
        engine = None
        fut = entry.loading
        try:
            with self._load_lock:
                self._close_detached()
                need = self._bytes(entry)
                avail = available_memory()
                if avail is not None and need > avail:
                    with self._lock:
                        entry.rejected += 1
                    raise ModelUnavailable(
                        503, f"model {entry.name!r} needs about {_gib(need)} and the system has "
                        f"{_gib(avail)} available; retry later", code="insufficient_memory",
                        retry_after=self.retry_after)
                log.info("loading model %s", entry.name)
                t0 = time.perf_counter()
                out = entry.spec.load()
                engine, defaults = out if isinstance(out, tuple) else (out, entry.spec.defaults)
                engine.start()
                weights, extra = self._measure(engine)
                seconds = time.perf_counter() - t0
                assert self._factory is not None, "attach() the pool to an app first"
                ctx = self._factory(engine, entry.spec, entry.metrics, defaults)
            with self._lock:
                if self._closed:
                    raise ModelUnavailable(503, "the server is shutting down", retry_after=self.retry_after)
                entry.weights, entry.extra = weights, extra
                entry.engine, entry.ctx, entry.state = engine, ctx, "loaded"
                entry.metrics.engine = engine
                entry.loads += 1
                entry.load_seconds += seconds
                entry.last_used = time.monotonic()
                engine = None  # the entry's now
                log.info("loaded model %s in %.1f s (%s)", entry.name, seconds, _gib(weights + extra))
                over = self.budget is not None and self.resident_bytes() > self.budget
                if over:  # larger than its files said: room from idle models, or unload it again
                    for e in sorted((e for e in self.entries if e.state == "loaded" and e is not entry
                                     and e.spec.load is not None and not e.busy()),
                                    key=lambda e: e.last_used):
                        self._detach(e, f"{entry.name!r} is larger than estimated")
                        if self.resident_bytes() <= self.budget:
                            break
                    if self.resident_bytes() > self.budget:
                        entry.rejected += 1
                        self._detach(entry, "larger than the memory budget leaves room for")
                        raise ModelUnavailable(
                            503, f"model {entry.name!r} needs {_gib(weights + extra)}: more than the "
                            "memory budget leaves beside the models serving requests; retry in a "
                            "few seconds", code="insufficient_memory", retry_after=self.retry_after)
            if over:
                with self._load_lock:
                    self._close_detached()
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - every waiter gets the failure
            with self._lock:
                if entry.state == "loading":
                    entry.state, entry.engine, entry.ctx = "unloaded", None, None
                    entry.metrics.engine = None
            if engine is not None:
                engine.close(wait=False, timeout=30.0)
                engine = None
            with self._load_lock:
                self._close_detached()
            if not isinstance(e, ModelUnavailable):
                log.exception("loading model %s failed", entry.name, exc_info=e)
                e = ModelUnavailable(500, f"model {entry.name!r} failed to load: {type(e).__name__}: {e}",
                                     code="model_load_failed")
            fut.set_exception(e)

    def unload(self, name: str) -> bool:
        """Unload a model now if it is idle (True when it was unloaded)."""
        entry = self.entry_of(name)
        with self._lock:
            if entry is None or entry.state != "loaded" or entry.busy() or entry.spec.load is None:
                return False
            self._detach(entry, "asked")
        with self._load_lock:
            self._close_detached()
        return True

    def _idle_loop(self) -> None:
        assert self.idle_unload is not None
        period = min(1.0, self.idle_unload / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                for e in self.entries:
                    if (e.state == "loaded" and e.spec.load is not None and not e.busy()
                            and now - e.last_used >= self.idle_unload):
                        self._detach(e, f"idle for {now - e.last_used:.0f} s")
                due = bool(self._detached)
            if due:
                with self._load_lock:
                    self._close_detached()

    def close(self) -> None:
        """Stop the idle timer and close every engine (the server has stopped)."""
        self._stop.set()
        with self._lock:
            self._closed = True
            engines = [e.engine for e in self.entries if e.engine is not None] + self._detached
            self._detached = []
            for e in self.entries:
                if e.state == "loaded":
                    e.engine = e.ctx = None
                    e.metrics.engine = None
                    e.state = "unloaded"
        for engine in engines:
            engine.close(wait=False, timeout=30.0)
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=5)

    # ---- what it serves

    def listing(self) -> list[dict[str, Any]]:
        """/v1/models's entries: every model (its `status`: loaded, loading or unloaded),
        each followed by its adapters (as vLLM lists LoRA modules)."""
        from fx_engine.engine.request import context_limit

        now = int(time.time())
        data = []
        with self._lock:
            entries = [(e, e.engine, e.state) for e in self.entries]
        for e, engine, state in entries:
            model = engine.model if engine is not None else None
            data.append({"id": e.name, "object": "model", "created": now, "owned_by": "fx-engine",
                         "root": str(model.path) if model is not None else e.spec.path,
                         "parent": None, "status": state,
                         # vLLM's field (the context a request may reach); known once loaded
                         **({"max_model_len": context_limit(model)[0], "numerics": model.numerics}
                            if model is not None else {})})
            for a in (model.adapters.names() if model is not None else e.spec.adapters):
                data.append({"id": f"{e.name}:{a}", "object": "model", "created": now,
                             "owned_by": "fx-engine", "parent": e.name, "status": state,
                             "root": model.adapters.get(a).raw.path if model is not None else None})
        return data

    def render_metrics(self) -> str:
        """/metrics: each model's metrics labelled with its name, and the pool's own."""
        from fx_engine.server.metrics import label, render_models

        with self._lock:
            rows = [(f'model="{label(e.name)}"', e, e.state, self._bytes(e)) for e in self.entries]
            resident = self.resident_bytes()
        extra = [
            ("fx_model_loaded", "gauge", "1 while the model is in memory (loading counts 0).",
             [(lab, int(state == "loaded")) for lab, _, state, _ in rows]),
            ("fx_model_bytes", "gauge", "What the model costs in memory (estimated until loaded).",
             [(lab, n) for lab, _, _, n in rows]),
            ("fx_model_loads_total", "counter", "Times the model was loaded by the pool.",
             [(lab, e.loads) for lab, e, _, _ in rows]),
            ("fx_model_unloads_total", "counter", "Times the model was unloaded (idle or least "
             "recently used).", [(lab, e.unloads) for lab, e, _, _ in rows]),
            ("fx_model_load_seconds_total", "counter", "Seconds spent loading the model.",
             [(lab, round(e.load_seconds, 3)) for lab, e, _, _ in rows]),
            ("fx_model_rejected_total", "counter", "Requests answered 503: memory too short to "
             "load the model.", [(lab, e.rejected) for lab, e, _, _ in rows]),
            ("fx_memory_resident_bytes", "gauge", "What the resident models cost together.",
             [("", resident)]),
        ]
        if self.budget is not None:
            extra.append(("fx_memory_budget_bytes", "gauge", "The models' memory budget.",
                          [("", self.budget)]))
        return render_models([(e.name, e.metrics) for _, e, _, _ in rows], extra)


async def _requested_model(request: Request) -> str | None:
    """The `model` of a request's JSON body (FastAPI has parsed it already: cached), if a
    string; None for bodiless requests (the first model answers them)."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return None
    if not await request.body():
        return None
    try:
        data = await request.json()
    except ValueError:
        return None
    name = data.get("model") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


class Leases:
    """Pure ASGI middleware: gives back the models a request held (`ModelPool.context_for`)
    once its response has been sent, a stream's last event included."""

    def __init__(self, app: Any, pool: ModelPool):
        self.app, self.pool = app, pool

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: list[_Entry] = []
        scope["fx_leases"] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for e in held:
                self.pool.release(e)
