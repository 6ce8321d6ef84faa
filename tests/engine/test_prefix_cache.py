"""The in-memory prefix cache: hits give the same outputs as cold runs, for any shared prefix
length; LRU eviction under a byte budget; decode keeps updating the cache in place."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.engine.kv_rows import snapshot_row
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.prefix_cache import PrefixStore
from fx_engine.core.steps import prefill_step
from fx_engine.testing import write_tiny_model

from tests.conftest import LONG_TEXT


@pytest.fixture(scope="module")
def bi(tiny_folder):
    return fx_engine.load(tiny_folder(), batch_invariant=True)


@pytest.fixture(scope="module")
def gemma_bi(tiny_folder):
    path = tiny_folder("gemma3_text", sliding_window=16)
    return fx_engine.load(path, batch_invariant=True)


def _text(model, n, offset=0):
    return model.tokenizer.encode(LONG_TEXT * 4)[offset : offset + n]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hits_give_cold_outputs(bi, gemma_bi, data):
    """Families of prompts sharing a random prefix (shorter than a block, at block
    boundaries, long), greedy and seeded, through one engine: every output equals its cold
    run, and later members of a family hit the cache."""
    model = data.draw(st.sampled_from([bi, gemma_bi]), label="model")
    engine = fx_engine.Engine(model, max_rows=3, prefill_chunk=32, prefix_block_size=16)
    shared = data.draw(st.sampled_from([3, 15, 16, 17, 32, 47, 90]), label="shared prefix")
    base = _text(model, shared)
    hits = 0
    for i in range(data.draw(st.integers(2, 4), label="members")):
        tail = _text(model, data.draw(st.integers(1, 40)), offset=100 + 7 * i)
        prompt = base + tail
        kw = data.draw(st.sampled_from([{"temperature": 0.0}, {"temperature": 0.9, "seed": 3}]))
        mt = data.draw(st.integers(1, 20))
        got = engine.submit(prompt, max_tokens=mt, **kw).result()
        ref = reference_generate(model, prompt, max_tokens=mt, **kw)
        assert got.token_ids == ref.token_ids
        assert got.usage.cached_tokens <= len(prompt) - 1
        hits += got.usage.cached_tokens > 0
    assert hits >= 1  # the second member shares at least the prefix


def test_multi_turn_chat_reuses_the_conversation(bi):
    engine = fx_engine.Engine(bi, max_rows=2, prefill_chunk=32)
    msgs = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    first = engine.submit(msgs, max_tokens=12).result()
    msgs += [{"role": "assistant", "content": first.text},
             {"role": "user", "content": "And the lazy dog?"}]
    second = engine.submit(msgs, max_tokens=12).result()
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    cold = reference_generate(bi, msgs, max_tokens=12)
    assert second.token_ids == cold.token_ids


def test_a_prefix_shorter_than_a_block_is_reused(bi):
    engine = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_block_size=64)
    a = _text(bi, 20)
    engine.submit(a + _text(bi, 5, offset=200), max_tokens=2).result()
    out = engine.submit(a + _text(bi, 9, offset=300), max_tokens=2).result()
    assert out.usage.cached_tokens >= 20


def test_lru_eviction_under_the_budget_and_pins(bi):
    p = bi.params
    snaps = []
    for i in range(4):
        ids = _text(bi, 40, offset=60 * i)
        cache = bi.new_cache(1, 64)
        _, cache = prefill_step(p, cache, mx.array([ids]), mx.array([40]))
        snaps.append((ids, snapshot_row(cache, 0, 40)))
    one = snaps[0][1].nbytes
    store = PrefixStore(budget_bytes=int(2.5 * one), block_size=16)
    store.add(*snaps[0])
    store.add(*snaps[1])
    entry, m = store.lookup(snaps[0][0] + [1])  # touch 0: 1 is now least recent
    assert m == 40
    entry.pins += 1  # in use
    store.add(*snaps[2])  # over budget: evicts 1, the LRU unpinned entry
    assert store.lookup(snaps[1][0] + [1])[0] is None
    store.add(*snaps[3])  # over budget again: 0 is pinned, so 2 goes
    assert store.lookup(snaps[0][0] + [1])[1] == 40
    assert store.lookup(snaps[2][0] + [1])[0] is None
    assert store.nbytes <= store.budget + one  # a pinned entry may hold it over, never more
    entry.pins -= 1


def test_decode_updates_the_cache_in_place_with_prefix_caching(tmp_path):
    """With prefix caching on, a decode step's peak memory stays far below a copy of the
    cache: the snapshots hold no reference to the batch cache. The control holds one extra
    reference to the cache and shows the test would see a copy."""
    bi = fx_engine.load(write_tiny_model(tmp_path / "m", num_hidden_layers=8, num_key_value_heads=4,
                                         head_dim=64))  # 16 KB of K/V per token

    def extra_peak(hold: bool) -> tuple[int, int]:
        engine = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32)
        h = engine.submit(_text(bi, 50), max_tokens=150)  # a 256-slot cache: 4 MB
        for _ in range(6):
            engine.step()
        held = []
        mx.eval(engine._cache.layers[0].keys)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        for _ in range(5):
            if hold:
                held.append(engine._cache)
            engine.step()
        peak = mx.get_peak_memory() - base
        size = engine.stats()["cache_bytes"]
        h.cancel()
        engine.step()
        return peak, size

    peak, size = extra_peak(False)
    assert size > 2_000_000 and peak < size / 4
    peak_held, _ = extra_peak(True)
    assert peak_held > size / 2  # holding a reference forces copies: detected


def test_prefix_cache_can_be_turned_off(bi):
    engine = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_bytes=0)
    a = _text(bi, 40)
    engine.submit(a, max_tokens=2).result()
    assert engine.submit(a + [5], max_tokens=2).result().usage.cached_tokens == 0
    assert engine.stats()["prefix_cache"] is None
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        fx_engine.Engine(bi, prefix_cache_bytes=-1)


# ------------------------------------------------------------------------------ disk tier

_CHILD = r"""
import sys, json, fx_engine
model = fx_engine.load(sys.argv[1], batch_invariant=True)
engine = fx_engine.Engine(model, max_rows=1, prefill_chunk=32, prefix_cache_dir=sys.argv[2])
ids = json.loads(sys.argv[3])
out = engine.submit(ids, max_tokens=int(sys.argv[4])).result()
print(json.dumps({"tokens": list(out.token_ids), "cached": out.usage.cached_tokens}))
"""


def _child(model_dir, cache_dir, ids, max_tokens=8):
    import json
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _CHILD, str(model_dir), str(cache_dir),
                             json.dumps(ids), str(max_tokens)], stdout=subprocess.PIPE, text=True)


def _result(proc):
    import json

    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_disk_tier_restores_in_a_later_process_and_concurrent_writers(tmp_path, bi):
    model_dir = tmp_path / "m"
    write_tiny_model(model_dir)
    cache_dir = tmp_path / "cache"
    prefix = _text(bi, 70)
    # two processes write the same entries at once: both complete, the files stay valid
    a, b = _child(model_dir, cache_dir, prefix + [5]), _child(model_dir, cache_dir, prefix + [5])
    ra, rb = _result(a), _result(b)
    assert ra["tokens"] == rb["tokens"]  # (one may already read the other's entry)
    assert not list(cache_dir.glob(".*"))  # no temporary files left
    # a later process restores the prefix from disk
    later = _result(_child(model_dir, cache_dir, prefix + [9, 10]))
    assert later["cached"] >= 70
    cold = reference_generate(fx_engine.load(model_dir, batch_invariant=True), prefix + [9, 10],
                              max_tokens=8)
    assert later["tokens"] == list(cold.token_ids)


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-model", "other-version", "json"])
def test_damaged_disk_entries_are_misses_with_a_warning(tmp_path, bi, damage):
    import json

    cache_dir = tmp_path / "cache"
    prefix = _text(bi, 60)
    e1 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir))
    e1.submit(prefix + [5], max_tokens=4).result()
    files = sorted(cache_dir.glob("*.safetensors"))
    assert files
    for f in files:
        meta_path = f.with_suffix(".json")
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        elif damage == "flip":
            data = bytearray(f.read_bytes())
            data[-100] ^= 0xFF  # inside the last tensor's bytes: caught by the checksum
            f.write_bytes(bytes(data))
        elif damage in ("other-model", "other-version"):
            arrs, meta = mx.load(str(f), return_metadata=True)
            key = "model" if damage == "other-model" else "layout_version"
            meta[key] = "something-else"
            mx.save_safetensors(str(f), arrs, metadata=meta)
        elif damage == "json":
            meta_path.write_text("{ not json")
    e2 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir),
                          prefix_cache_bytes=1 << 20)
    prompt = prefix + [9, 10]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = e2.submit(prompt, max_tokens=6).result()
    assert out.usage.cached_tokens == 0
    assert out.token_ids == reference_generate(bi, prompt, max_tokens=6).token_ids
    if damage in ("truncate", "flip"):  # indexed by its metadata, rejected on load: warned
        assert any("prefix cache: ignoring" in str(w.message) for w in caught)
    del json


def test_disk_budget_evicts_oldest_files(tmp_path, bi):
    cache_dir = tmp_path / "cache"
    e = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir),
                         prefix_cache_disk_bytes=200_000)
    for i in range(8):
        e.submit(_text(bi, 50, offset=40 * i), max_tokens=2).result()
    total = _folder_bytes(cache_dir)
    assert total <= 200_000  # (the newest entry too is evicted if it does not fit)
    assert e.prefix_cache.disk.stats()["bytes"] == total
    assert len(list(cache_dir.glob("*.safetensors"))) == len(list(cache_dir.glob("*.json")))


def test_entry_count_limit(bi):
    """prefix_cache_entries (mlx_lm.server's --prompt-cache-size): at most that many
    entries, least recently used dropped first."""
    engine = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_entries=2)
    for i in range(5):
        engine.submit(_text(bi, 30, offset=50 * i), max_tokens=2).result()
        assert engine.stats()["prefix_cache"]["entries"] <= 2
    with pytest.raises(ValueError, match="prefix_cache_entries"):
        fx_engine.Engine(bi, prefix_cache_entries=0)


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def test_disk_tier_open_removes_dead_writers_temporaries_and_counts_live_ones(tmp_path, bi):
    """A writer killed mid-save (kill -9) leaves `.<id>.<pid>.<uuid>.tmp.*` files: at the
    next open those of a dead pid, or too old, are removed; a live writer's are kept and
    count against the budget, as the entries do."""
    import os
    import time

    from fx_engine.engine.prefix_cache import STALE_TMP_SECONDS

    cache_dir = tmp_path / "cache"
    e1 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir))
    e1.submit(_text(bi, 60) + [5], max_tokens=4).result()
    entries = sorted(cache_dir.glob("*.safetensors"))
    assert entries
    entry_bytes = _folder_bytes(cache_dir)
    dead = cache_dir / f".{'a' * 32}.{_dead_pid()}.{'b' * 32}.tmp.safetensors"
    dead.write_bytes(b"\0" * 50_000)
    old = cache_dir / f".{'c' * 32}.{os.getpid()}.{'d' * 32}.tmp.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 2 * STALE_TMP_SECONDS,) * 2)
    live = cache_dir / f".{'e' * 32}.{os.getpid()}.{'f' * 32}.tmp.safetensors"
    live.write_bytes(b"\0" * 70_000)
    e2 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir))
    disk = e2.prefix_cache.disk
    assert not dead.exists() and not old.exists()
    assert live.exists()  # (a live process is still writing it)
    assert disk.stats()["bytes"] == _folder_bytes(cache_dir) == entry_bytes + 70_000
    # the live writer's file counts against the budget: the entries make room for it
    e3 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir),
                          prefix_cache_disk_bytes=70_000 + entry_bytes // 2)
    assert live.exists() and not all(f.exists() for f in entries)
    assert e3.prefix_cache.disk.stats()["bytes"] == _folder_bytes(cache_dir) <= 70_000 + entry_bytes // 2


@pytest.mark.parametrize("damage", ["flip", "json"])
def test_rejected_disk_entries_are_deleted_not_rejected_at_every_start(tmp_path, bi, damage):
    import warnings

    cache_dir = tmp_path / "cache"
    prefix = _text(bi, 60)
    e1 = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir))
    e1.submit(prefix + [5], max_tokens=4).result()
    damaged = {}
    for f in sorted(cache_dir.glob("*.safetensors")):
        if damage == "flip":
            data = bytearray(f.read_bytes())
            data[-100] ^= 0xFF
            f.write_bytes(bytes(data))
            damaged[f] = bytes(data)
        else:
            f.with_suffix(".json").write_text("{ not json")
            damaged[f.with_suffix(".json")] = b"{ not json"

    def restart_and_ask() -> tuple[list[str], int]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir),
                                 prefix_cache_bytes=1 << 20)
            cached = e.submit(prefix + [9, 10], max_tokens=2).result().usage.cached_tokens
        return [str(w.message) for w in caught if "prefix cache: ignoring" in str(w.message)], cached

    first, cached = restart_and_ask()
    assert first and all("deleted" in m for m in first) and cached == 0
    # deleted (or written again, valid, by this run's own saves of the same prefix)
    assert not any(f.exists() and f.read_bytes() == data for f, data in damaged.items())
    assert restart_and_ask()[0] == []  # gone: not rejected again


def _cache_files(folder) -> list:
    """The files the disk tier names: `<32 hex>.json|.safetensors` and its temporaries."""
    import re

    entry = re.compile(r"[0-9a-f]{32}\.(json|safetensors)")
    tmp = re.compile(r"\.[0-9a-f]{32}\.[0-9]+\.[0-9a-f]{32}\.tmp\.(json|safetensors)")
    return [f for f in folder.iterdir() if entry.fullmatch(f.name) or tmp.fullmatch(f.name)]


def test_disk_tier_never_counts_or_touches_files_it_did_not_name(tmp_path, bi):
    """--prompt-cache-dir pointed at a folder with other files in it (a model's folder):
    opening, saving, rejecting and evicting under a tiny budget leave every file the cache
    did not name as it was, and they are not counted in the budget or the stats."""
    import warnings

    cache_dir = tmp_path / "shared"
    cache_dir.mkdir()
    foreign = {
        "config.json": b'{"a": 1}',
        "notes.json": b"// notes",  # a .json that is not JSON: not a damaged entry of ours
        "tokenizer.json": b"[1, 2, 3]",
        "model.safetensors": b"\1" * (3 << 20),  # bigger than any budget below
        "data.bin": b"\2" * 300_000,
        "ABCDEF0123456789ABCDEF0123456789.json": b"{",  # upper case: not a name we write
        f".backup.{_dead_pid()}.x.tmp.json": b"{}",  # a dead pid, but not our temporary
    }
    for name, data in foreign.items():
        (cache_dir / name).write_bytes(data)

    def engine(budget):
        return fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(cache_dir),
                                prefix_cache_disk_bytes=budget)

    def check(e, budget):
        for name, data in foreign.items():
            assert (cache_dir / name).read_bytes() == data, name
        ours = _cache_files(cache_dir)
        assert e.prefix_cache.disk.stats()["bytes"] == sum(f.stat().st_size for f in ours) <= budget
        return ours

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = engine(40_000)  # room for one small entry at a time
        check(e, 40_000)
        for i in range(3):
            e.submit(_text(bi, 60, offset=40 * i) + [5], max_tokens=4).result()
            ours = check(e, 40_000)
        assert e.prefix_cache.disk.saves > 0 and ours  # it did save (and evict)
        e1 = engine(40_000)  # a later process: opens, may load from disk, saves
        check(e1, 40_000)
        e1.submit(_text(bi, 60, offset=80) + [9], max_tokens=2).result()
        check(e1, 40_000)
        e2 = engine(1_000)  # eviction at open: every entry of ours goes, nothing else
        assert check(e2, 1_000) == []
    assert not [w for w in caught if "prefix cache" in str(w.message)]
    assert e2.prefix_cache.disk.stats()["bytes"] == 0


def _three_entries(tmp_path, bi):
    """Three (key, cache, entry bytes) from one request's saves, for a DiskTier built here."""
    e = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(tmp_path / "src"))
    e.submit(_text(bi, 60) + [5], max_tokens=4).result()
    disk = e.prefix_cache.disk
    out = []
    for key in sorted(disk.index):
        size = sum((tmp_path / "src" / f"{disk.index[key]}{x}").stat().st_size
                   for x in (".json", ".safetensors"))
        out.append((key, disk.load(key), size))
    assert len(out) >= 3
    return disk, out[:3]


def _tier(disk, path, budget):
    from fx_engine.engine.prefix_cache import DiskTier

    return DiskTier(path, budget, disk.expect["model"], disk.expect["tokenizer"], disk.layout,
                    disk.expect["dtype"])


def test_disk_entry_larger_than_the_budget_is_not_kept(tmp_path, bi):
    from fx_engine.engine.prefix_cache import _arrays

    disk, [(key, cache, size), *_] = _three_entries(tmp_path, bi)
    # its arrays alone exceed the budget: never written
    e = fx_engine.Engine(bi, max_rows=1, prefill_chunk=32, prefix_cache_dir=str(tmp_path / "a"),
                         prefix_cache_disk_bytes=10_000)
    e.submit(_text(bi, 60) + [5], max_tokens=4).result()
    assert list((tmp_path / "a").iterdir()) == []
    assert e.prefix_cache.disk.stats()["bytes"] == 0 and e.prefix_cache.disk.stats()["entries"] == 0
    # its arrays fit, its files (header, metadata, tokens) do not: written, then evicted
    nbytes = sum(a.nbytes for a in _arrays(cache).values())
    assert nbytes < size
    small = _tier(disk, tmp_path / "b", nbytes)
    small.save(key, cache)
    assert list((tmp_path / "b").iterdir()) == []
    assert small.stats()["bytes"] == 0 and small.stats()["entries"] == 0
    assert small.load(key) is None


def test_disk_eviction_is_least_recently_used(tmp_path, bi):
    """A loaded entry is recently used: the one saved after it but not read since goes first;
    the entry just saved stays when older ones make room for it."""
    import os
    import time

    disk, [(ka, ca, sa), (kb, cb, sb), (kc, cc, sc)] = _three_entries(tmp_path, bi)
    folder = tmp_path / "lru"
    tier = _tier(disk, folder, sa + sb + sc - 1)
    tier.save(ka, ca)
    tier.save(kb, cb)
    now = time.time()
    for key, age in ((ka, 200), (kb, 100)):  # A saved before B
        for x in (".json", ".safetensors"):
            os.utime(folder / f"{tier.index[key]}{x}", (now - age, now - age))
    assert tier.load(ka) is not None  # A used after B was saved
    tier.save(kc, cc)  # one byte over: B (least recently used) goes
    assert set(tier.index) == {ka, kc}
    assert tier.stats()["bytes"] == sa + sc == _folder_bytes(folder)
