"""The in-memory prefix cache: KV snapshots of earlier prompts (and finished conversations),
reused when a new prompt starts with the same tokens.

Entries are 1-row cache snapshots (`fx_engine.engine.kv_rows.snapshot_row`: only the kept tokens are
copied, into new buffers) keyed by their token sequence. Lookup is by a chain of hashes
over token blocks (`block_size` tokens; h_i = H(h_{i-1}, block i)): every entry is indexed
under each full block of its tokens, so the deepest block hash a prompt shares with any
entry finds the candidates, and the exact common prefix is then measured token by token.

Shorter than a block, or the tail of the last partial block: not lost. The common prefix is
extended token by token into the partial block, and when no full block matches the entries
are scanned for a shared first block fragment. How much of a match is used:
* models whose cache is dense or quantized: any prefix of an entry (restoring m <= n of its
  n positions is a rollback by length, exact);
* models with sliding-window rings: a ring snapshot holds the last window of positions, so
  an entry serves a prompt only at its exact length or, if it never wrapped, any prefix.
At least one prompt token is always left to prefill (its logits give the first sample).

Scopes: every entry belongs to the scope of the `salt` it was added with (a request's
`cache_salt`; the server derives it from the API key and the request's own salt), and a
lookup only ever sees entries of its own scope, in memory and on disk: requests of
different scopes never share KV, so neither `usage.cached_tokens` nor the time to first
token can tell one tenant what another one's prompts were. Salts are stored only as
digests.

Budget: `budget_bytes` over the entries' arrays (all scopes together), least recently used
evicted first; an entry being restored is pinned (restoration copies it into the request's cache, so entries
are never in use by a running request afterwards). An entry whose tokens are a strict
prefix of a newer entry's is dropped when that newer entry can serve it (no rings).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerKV, QuantKV, RecState, prefix_in_cache
from fx_engine.engine.kv_rows import insert_row
from fx_engine.core.tree import tree_leaves

SCOPED_FORMAT = "fx-engine-prefix-scoped"  # the disk format of entries with a cache_salt
LAYOUT_VERSION = 1  # bump when the snapshot array layout changes: older files become misses

DEFAULT_BLOCK = 16
# A disk-tier temporary this old is a dead writer's even if its pid runs again (no save of
# an entry takes this long)
STALE_TMP_SECONDS = 600.0
# The disk tier's file names (see DiskTier.save): only these are ever counted, read, deleted
# or evicted; any other file in the folder (a model's config.json, someone's notes) is not
# the cache's and is left alone.
_ENTRY_RE = re.compile(r"([0-9a-f]{32})\.(?:json|safetensors)")
_TMP_RE = re.compile(r"\.([0-9a-f]{32})\.([0-9]+)\.([0-9a-f]{32})\.tmp\.(?:json|safetensors)")


def scope_of(salt: str | None) -> str:
    """The scope an entry with this cache_salt lives in ("" = unsalted, shared)."""
    if salt is None:
        return ""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def block_hashes(tokens: Sequence[int], block: int, scope: str = "") -> list[bytes]:
    """The hash chain over the full blocks of `tokens`, seeded with the scope."""
    out, h = [], scope.encode()
    for i in range(len(tokens) // block):
        piece = ",".join(str(t) for t in tokens[i * block : (i + 1) * block]).encode()
        h = hashlib.blake2b(h + piece, digest_size=16).digest()
        out.append(h)
    return out


def _pid_running(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without sending)."""
    if pid <= 0:  # (0 and negatives name process groups)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a pid we cannot judge): assume alive
    return True


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


Key = tuple  # (scope, tokens)


class _Entry:
    __slots__ = ("key", "tokens", "cache", "nbytes", "hashes", "pins")

    def __init__(self, key: Key, cache: KVCache, hashes: list[bytes]):
        self.key, self.tokens, self.cache, self.hashes, self.pins = key, key[1], cache, hashes, 0
        self.nbytes = cache.nbytes


class PrefixStore:
    def __init__(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK,
                 disk: "DiskTier | None" = None, max_entries: int | None = None):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an integer >= 0, got {budget_bytes!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"prefix_block_size must be a positive integer, got {block_size!r}")
        if max_entries is not None and (not isinstance(max_entries, int) or max_entries < 1):
            raise ValueError(f"prefix_cache_entries must be a positive integer, got {max_entries!r}")
        self.budget = budget_bytes
        self.max_entries = max_entries  # mlx_lm.server's --prompt-cache-size
        self.block = block_size
        self._entries: collections.OrderedDict[Key, _Entry] = collections.OrderedDict()
        self._index: dict[bytes, set[Key]] = {}
        self.nbytes = 0
        self.hits = self.misses = self.hit_tokens = 0
        self.disk = disk
        # an entry's cost in the budget: its bytes * num // den (tensor / pipeline parallel
        # ranks count in rank 0's bytes, so they all evict alike; see Engine)
        self.cost_scale = (1, 1)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------------ lookup
    def _usable(self, entry: _Entry, common: int, prompt_len: int) -> int:
        return self._usable_len(entry.cache.layout, len(entry.tokens), common, prompt_len)

    @staticmethod
    def _usable_len(layout: Any, n: int, common: int, prompt_len: int) -> int:
        """How much of an n-token entry sharing `common` tokens a prompt can use."""
        m = min(common, prompt_len - 1)
        return max(0, m) if prefix_in_cache(layout, n, m) else 0

    def lookup(self, prompt: Sequence[int], salt: str | None = None) -> tuple[_Entry | None, int]:
        """The entry of salt's scope sharing the longest usable prefix with `prompt`, and
        that length."""
        if (not self._entries and self.disk is None) or len(prompt) < 2:
            self.misses += 1
            return None, 0
        scope = scope_of(salt)
        # Every entry sharing at least one full block (not only the deepest: with rings a
        # shorter entry may be usable where a longer one is not).
        cands: set[Key] = set()
        for h in block_hashes(prompt, self.block, scope):
            keys = self._index.get(h)
            if not keys:
                break
            cands |= {k for k in keys if k[0] == scope}  # (the seeded chain already is)
        if not cands:  # shorter than a block: scan for a shared fragment
            cands = {k for k in self._entries if k[0] == scope and k[1][:1] == tuple(prompt[:1])}
        best, best_m = None, 0
        for k in cands:
            e = self._entries[k]
            m = self._usable(e, _common(e.tokens, prompt), len(prompt))
            if m > best_m:
                best, best_m = e, m
        while self.disk is not None:  # a longer match on disk: load it into memory
            tokens, m = self.disk.best(prompt, self._usable_len, scope)
            if m <= best_m:
                break
            cache = self.disk.load((scope, tokens))
            if cache is None:  # rejected (and out of the disk index): the next best
                continue
            self.add(tokens, cache, to_disk=False, salt=salt)
            best = self._entries.get((scope, tokens)) or _Entry((scope, tokens), cache, [])
            best_m = m
            break
        if best is None:
            self.misses += 1
            return None, 0
        if best.key in self._entries:
            self._entries.move_to_end(best.key)
        self.hits += 1
        self.hit_tokens += best_m
        return best, best_m

    def restore(self, entry: _Entry, target: KVCache, m: int) -> KVCache:
        """Copy the entry's first m positions into row 0 of `target` (a fresh 1-row cache
        of the same layout); the entry is pinned while it is read."""
        entry.pins += 1
        try:
            out = insert_row(target, entry.cache, 0, m)
            mx.eval(tree_leaves(out))
            return out
        finally:
            entry.pins -= 1

    # ------------------------------------------------------------------------ insert
    def add(self, tokens: Sequence[int], snapshot: KVCache, to_disk: bool = True,
            salt: str | None = None) -> None:
        """Store a snapshot of `tokens` (its length == len(tokens)) in salt's scope.
        Evaluated now, so the snapshot's copies are made before the source cache is
        written again; written to the disk tier too when there is one."""
        toks = tuple(tokens)
        if len(toks) < 1:
            return
        scope = scope_of(salt)
        key = (scope, toks)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        mx.eval(tree_leaves(snapshot))
        if to_disk and self.disk is not None:
            self.disk.save(key, snapshot)
        if self.budget == 0:
            return
        # rings that wrap and recurrent states serve only their own length: keep shorter ones
        rings = any(s.ring or s.state for s in snapshot.layout)
        hashes = block_hashes(toks, self.block, scope)

        def shorter(k: Key) -> bool:  # a prefix of the new entry, same scope, not in use
            t = k[1]
            return (k[0] == scope and len(t) < len(toks) and toks[: len(t)] == t
                    and self._entries[k].pins == 0)

        if not rings:  # the new entry serves every prefix of itself: drop shorter ones
            for h in hashes[-1:]:
                for k in list(self._index.get(h, ())):
                    if shorter(k):
                        self._drop(k)
            for k in [k for k in self._entries if len(k[1]) < self.block and shorter(k)]:
                self._drop(k)
        e = _Entry(key, snapshot, hashes)
        e.nbytes = e.nbytes * self.cost_scale[0] // self.cost_scale[1]
        if e.nbytes > self.budget:
            return
        self._entries[key] = e
        for h in hashes:
            self._index.setdefault(h, set()).add(key)
        self.nbytes += e.nbytes
        self._evict()

    def _drop(self, key: Key) -> None:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes
        for h in e.hashes:
            s = self._index.get(h)
            if s is not None:
                s.discard(key)
                if not s:
                    del self._index[h]

    def _evict(self) -> None:
        for key in list(self._entries):
            over_n = self.max_entries is not None and len(self._entries) > self.max_entries
            if self.nbytes <= self.budget and not over_n:
                return
            if self._entries[key].pins == 0:
                self._drop(key)

    def stats(self) -> dict[str, Any]:
        total = self.hits + self.misses
        out = {"entries": len(self._entries), "bytes": self.nbytes, "budget": self.budget,
               "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
               "hit_rate": self.hits / total if total else 0.0}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out


# ------------------------------------------------------------------------------ disk tier


def _arrays(cache: KVCache) -> dict[str, mx.array]:
    out = {}
    for i, e in enumerate(cache.layers):
        if isinstance(e, RecState):
            for j, a in enumerate(e.arrays):
                out[f"{i}.s{j}"] = a
        elif isinstance(e, QuantKV):
            out[f"{i}.hk"], out[f"{i}.hv"] = e.head_keys, e.head_values
            for j in range(3):
                out[f"{i}.k{j}"], out[f"{i}.v{j}"] = e.keys[j], e.values[j]
        else:
            out[f"{i}.k"], out[f"{i}.v"] = e.keys, e.values
    return out


def _from_arrays(arrs: dict[str, mx.array], layout: tuple, length: int) -> KVCache:
    layers = []
    for i, s in enumerate(layout):
        if s.state:
            layers.append(RecState(tuple(arrs[f"{i}.s{j}"] for j in range(len(s.state)))))
        elif s.bits:
            layers.append(QuantKV(arrs[f"{i}.hk"], arrs[f"{i}.hv"],
                                  tuple(arrs[f"{i}.k{j}"] for j in range(3)),
                                  tuple(arrs[f"{i}.v{j}"] for j in range(3))))
        else:
            layers.append(LayerKV(arrs[f"{i}.k"], arrs[f"{i}.v"]))
    return KVCache(layers=tuple(layers), lengths=mx.array([length], mx.int32), layout=layout,
                   capacity=length)


def _checksum(arrs: dict[str, mx.array]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrs):
        a = arrs[name]
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        if a.size:
            h.update(memoryview(mx.view(mx.contiguous(a), mx.uint8)).tobytes())
    return h.hexdigest()


class DiskTier:
    """Prefix-cache entries as files: `<id>.safetensors` (the snapshot's arrays and the
    tokens) plus `<id>.json` (metadata and tokens, read to index the directory). Both are
    written to a temporary name and renamed (atomic; two processes writing the same entry
    both leave a complete one). The metadata records the model fingerprint, the tokenizer
    fingerprint, the cache layout (and its version), the dtype, the token hash chain's last
    link and a SHA-256 of the arrays; a file that is truncated, corrupt, or from another
    model, tokenizer or layout version is a miss with a warning, never an error or wrong
    output. An entry of ours that is rejected (corrupt, truncated, inconsistent with its
    metadata) is deleted then, so it is not read again at every start; entries of other
    models or versions are left alone (a folder may be shared).

    Only files named as the cache names them (`<id>` is 32 hex digits) are ever counted,
    read, deleted or evicted: anything else in the folder (a model's config.json, a
    tokenizer.json, weights) is not the cache's and is left alone. On open, temporaries a
    killed writer left (`.<id>.<pid>.<uuid>.tmp.*`: its pid is no longer running, or the
    file is older than STALE_TMP_SECONDS) are removed. The budget counts the cache's files
    (entries of any model, orphans, other processes' writes in progress); entries go least
    recently saved or loaded first until the total is within `budget_bytes`, at open and
    after every save. An entry larger than the whole budget is not kept."""

    def __init__(self, path: str | Path, budget_bytes: int, model_fingerprint: str,
                 tokenizer_fingerprint: str, layout: tuple, dtype: str, block: int = DEFAULT_BLOCK):
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"prefix_cache_disk_bytes must be a positive integer, got {budget_bytes!r}")
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.block = block
        self.expect = {"format": "fx-engine-prefix", "layout_version": str(LAYOUT_VERSION),
                       "model": model_fingerprint, "tokenizer": tokenizer_fingerprint,
                       "layout": repr(layout), "dtype": dtype}
        self.layout = layout
        self.index: dict[Key, str] = {}  # (scope, tokens) -> file stem
        self.loads = self.saves = self.rejected = 0
        self.used_bytes = 0  # the cache's files in the folder, as of the last eviction pass
        self._remove_stale_temporaries()
        self._scan()
        self._evict(keep=None)

    def _expect(self, scope: str) -> dict[str, str]:
        """The metadata a file of this scope must have. A salted entry has its own format
        name, so that versions which do not know scopes never serve it to anyone."""
        return {**self.expect, "format": SCOPED_FORMAT} if scope else self.expect

    def _name(self, key: Key) -> str:
        scope, tokens = key
        h = hashlib.sha256(repr((self.expect["model"], self.expect["layout"], tokens)
                                + ((scope,) if scope else ())).encode())
        return h.hexdigest()[:32]

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporaries of writers that died mid-save (kill -9): their pid (in
        the name, see `save`) is not running, or the file is older than any save takes
        (a reused pid; a writer on another machine sharing the folder)."""
        now = time.time()
        for f in self.dir.glob(".*.tmp.*"):
            m = _TMP_RE.fullmatch(f.name)
            if m is None:
                continue  # not one of ours
            try:
                pid = int(m.group(2))
                age = now - f.stat().st_mtime
            except (ValueError, OSError):
                continue
            if age > STALE_TMP_SECONDS or not _pid_running(pid):
                f.unlink(missing_ok=True)

    def _scan(self) -> None:
        for meta_path in self.dir.glob("*.json"):
            if not _ENTRY_RE.fullmatch(meta_path.name):
                continue  # a writer's temporary, or not the cache's file at all
            try:
                meta = json.loads(meta_path.read_text())
            except OSError:
                continue
            except ValueError:  # written by rename, so never partial: damaged
                self._reject(meta_path.stem, "unreadable metadata")
                continue
            try:
                scope = str(meta.get("scope", ""))
                if all(meta.get(k) == v for k, v in self._expect(scope).items()):
                    self.index[(scope, tuple(int(t) for t in meta["tokens"]))] = meta_path.stem
            except (AttributeError, KeyError, TypeError, ValueError):
                continue  # not an entry of this model and version: not ours to judge

    def _reject(self, name: str, why: str) -> None:
        """Warn about a damaged entry and delete its files (it would be rejected again at
        every start)."""
        self.rejected += 1
        self.index = {k: n for k, n in self.index.items() if n != name}
        warnings.warn(f"prefix cache: ignoring {self.dir / name}.safetensors ({why}); "
                      "deleted", stacklevel=3)
        for ext in (".safetensors", ".json"):
            try:
                (self.dir / f"{name}{ext}").unlink(missing_ok=True)
            except OSError:
                pass

    def best(self, prompt: Sequence[int], usable: Any, scope: str = "") -> tuple[tuple[int, ...], int]:
        best, best_m = (), 0
        for s, tokens in self.index:
            if s != scope:
                continue
            m = usable(self.layout, len(tokens), _common(tokens, prompt), len(prompt))
            if m > best_m:
                best, best_m = tokens, m
        return best, best_m

    def load(self, key: Key) -> KVCache | None:
        name = self.index.get(key)
        if name is None:
            return None
        scope, tokens = key
        path = self.dir / f"{name}.safetensors"
        try:
            arrs, meta = mx.load(str(path), return_metadata=True)
        except Exception as e:  # truncated, missing, not safetensors
            self._reject(name, f"unreadable: {e}")
            return None
        bad = [k for k, v in self._expect(scope).items() if meta.get(k) != v]
        stored = arrs.pop("tokens", None)
        if bad:
            why = f"different {', '.join(bad)}"
        elif meta.get("scope", "") != scope:
            why = "another cache scope"
        elif stored is None or tuple(stored.tolist()) != tokens:
            why = "tokens do not match"
        elif meta.get("checksum") != _checksum(arrs):
            why = "checksum mismatch"
        else:
            why = ""
        if why:  # its metadata file said it is ours: the pair is damaged
            self._reject(name, why)
            return None
        try:
            cache = _from_arrays(arrs, self.layout, len(tokens))
        except KeyError as e:
            self._reject(name, f"missing array {e}")
            return None
        self.loads += 1
        now = time.time()
        for ext in (".safetensors", ".json"):  # recently used: evicted last (LRU)
            try:
                os.utime(self.dir / f"{name}{ext}", (now, now))
            except OSError:
                pass
        return cache

    def save(self, key: Key, cache: KVCache) -> None:
        scope, tokens = key
        name = self._name(key)
        arrs = _arrays(cache)
        if sum(a.nbytes for a in arrs.values()) > self.budget:
            return  # could never stay within the budget: not written at all
        meta = {**self._expect(scope), "checksum": _checksum(arrs), "length": str(len(tokens)),
                "chain": (block_hashes(tokens, self.block, scope) or [b""])[-1].hex(),
                "scope": scope}
        tmp = f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            mx.save_safetensors(str(self.dir / f"{tmp}.safetensors"),
                                {**arrs, "tokens": mx.array(list(tokens), mx.int32)}, metadata=meta)
            os.replace(self.dir / f"{tmp}.safetensors", self.dir / f"{name}.safetensors")
            (self.dir / f"{tmp}.json").write_text(json.dumps({**meta, "tokens": list(tokens)}))
            os.replace(self.dir / f"{tmp}.json", self.dir / f"{name}.json")
        except OSError as e:
            warnings.warn(f"prefix cache: cannot write {self.dir / name} ({e})", stacklevel=3)
            for f in self.dir.glob(f"{tmp}.*"):
                f.unlink(missing_ok=True)
            return
        self.index[key] = name
        self.saves += 1
        self._evict(keep=name)

    def _evict(self, keep: str | None) -> None:
        """Bring the cache's files within the budget. Entries (`<id>.safetensors` with its
        `<id>.json`, or either alone) go least recently saved or loaded first, `keep` (the
        entry just saved) last; an entry larger than the whole budget goes first (keeping
        it would only push out everything else and still not fit). Writers' temporaries
        count but are not ours to delete; files the cache did not name are ignored."""
        total = 0
        entries: dict[str, list] = {}  # id -> [mtime, bytes]
        for f in self.dir.iterdir():
            entry = _ENTRY_RE.fullmatch(f.name)
            if entry is None and not _TMP_RE.fullmatch(f.name):
                continue  # not the cache's
            try:
                if not f.is_file():
                    continue
                st = f.stat()
            except OSError:
                continue
            total += st.st_size
            if entry is None:
                continue  # a write in progress
            e = entries.setdefault(entry.group(1), [st.st_mtime, 0])
            e[0], e[1] = max(e[0], st.st_mtime), e[1] + st.st_size
        order = sorted((size <= self.budget, stem == keep, mtime, stem)
                       for stem, (mtime, size) in entries.items())
        for *_, stem in order:
            if total <= self.budget and entries[stem][1] <= self.budget:
                continue  # (only an oversized entry is evicted once within the budget)
            (self.dir / f"{stem}.safetensors").unlink(missing_ok=True)
            (self.dir / f"{stem}.json").unlink(missing_ok=True)
            self.index = {t: n for t, n in self.index.items() if n != stem}
            total -= entries[stem][1]
        self.used_bytes = total

    def stats(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "entries": len(self.index), "loads": self.loads,
                "saves": self.saves, "rejected": self.rejected, "bytes": self.used_bytes}


def engine_store(model: Any, layout: Any, nbytes: int, block: int, folder: str | None,
                 disk_bytes: int, entries: int | None) -> PrefixStore | None:
    """An engine's prefix store for `model` (its cache `layout`): memory tier of `nbytes`
    (and at most `entries` entries), disk tier in `folder` (None: none); None when both
    are off. On a sharded model each rank keeps its own share of every entry, in its own
    subdirectory (its own byte budget evicts only its files); what a request restores is
    the length every rank holds (`lockstep.Ranks.agree_prefix`)."""
    if model.ranks > 1 and folder is not None:
        folder = str(Path(folder) / f"rank{mx.distributed.init().rank()}of{model.ranks}")
    if not (nbytes or folder):
        return None
    disk = None if folder is None else DiskTier(
        folder, disk_bytes, model.fingerprint, model.tokenizer.fingerprint(), layout,
        str(model.cache_dtype).split(".")[-1], block)
    return PrefixStore(nbytes, block, disk, entries)
