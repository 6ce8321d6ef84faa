"""Models by name (issue 44, item 1): `org/name` and `org/name:QUANT` resolved through
huggingface_hub's real code paths, offline: a local HTTP endpoint (`HF_ENDPOINT`) speaks the
Hub's API (repo info, file tree, resolve with X-Repo-Commit / ETag) and serves a tiny model
folder and a split GGUF; huggingface_hub downloads them into a fresh `HF_HOME`, which is then
the cache a second, offline resolution (`HF_HUB_OFFLINE=1`, server gone) reads. Split GGUF
files are written by the `gguf` package's own writer (`split_max_tensors`, as
convert_hf_to_gguf / gguf-split shard) and must load to the same logits as the whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.loading.default_model import ModelNotFound, default_model_path
from fx_engine.loading.gguf import gguf_files
from fx_engine.loading.hub import choose_gguf, parse_model_id, resolve_model

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- pure choices
def test_parse_model_id():
    assert parse_model_id("org/name") == ("org/name", None)
    assert parse_model_id("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == (
        "bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert parse_model_id("org/na.me_x-1") == ("org/na.me_x-1", None)
    for path in ("./org/name", "/abs/path", "~/m", "a/b/c", "model.gguf", "dir/model.gguf",
                 "dir/config.json", "org/name:Q4:K"):
        assert parse_model_id(path) is None, path


FILES = ["README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf", "mmproj-model-f16.gguf",
         "IQ4_XS/model-IQ4_XS-00001-of-00002.gguf", "IQ4_XS/model-IQ4_XS-00002-of-00002.gguf",
         "model-Q4_K.gguf"]


def test_choose_gguf():
    assert choose_gguf(FILES, "Q8_0") == ["model-Q8_0.gguf"]
    assert choose_gguf(FILES, "q4_k_m") == ["model-Q4_K_M.gguf"]  # case-insensitive
    assert choose_gguf(FILES, "Q4_K") == ["model-Q4_K.gguf"]  # not Q4_K_M
    assert choose_gguf(FILES, "IQ4_XS") == ["IQ4_XS/model-IQ4_XS-00001-of-00002.gguf",
                                            "IQ4_XS/model-IQ4_XS-00002-of-00002.gguf"]
    assert choose_gguf(FILES, None) == ["model-Q4_K_M.gguf"]  # llama.cpp's default
    assert choose_gguf(["a-Q8_0.gguf", "mmproj-f16.gguf"], None) == ["a-Q8_0.gguf"]
    with pytest.raises(ModelNotFound, match=r"org/x:Q2_K: no file .*model-Q8_0.gguf"):
        choose_gguf(FILES, "Q2_K", "org/x")
    with pytest.raises(ModelNotFound, match="choose one with org/x:QUANT"):
        choose_gguf(["a-Q8_0.gguf", "a-Q6_K.gguf"], None, "org/x")
    with pytest.raises(ModelNotFound, match="no .gguf model file"):
        choose_gguf(["config.json", "mmproj-f16.gguf"], None, "org/x")


def test_missing_local_path_is_not_a_repo(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        resolve_model(tmp_path / "nothing.gguf")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face repo id"):
        fx_engine.load("dir/missing.gguf")
    with pytest.raises(ValueError, match="revision"):
        resolve_model(default_model_path(), revision="main")


# ---------------------------------------------------------------------------- split GGUF
def split_gguf(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """`src` rewritten as a split GGUF by the gguf package's writer; the shards in order."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out / "model.gguf", arch, split_max_tensors=max_tensors)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.glob("model-*-of-*.gguf"))


def _logits(model, ids=(1, 2, 3, 4, 5)):
    from fx_engine.core.steps import logits_step

    cache = model.new_cache(1, 16)
    out = logits_step(model.params, cache, mx.array([list(ids)]))
    return np.array(out[0] if isinstance(out, tuple) else out)


@pytest.fixture(scope="module")
def split_default(tmp_path_factory):
    return split_gguf(default_model_path(), tmp_path_factory.mktemp("split"), max_tensors=100)


def test_split_gguf_loads_as_the_whole_file(split_default, default_model):
    shards = split_default
    assert len(shards) >= 2 and shards[0].name.endswith("-00001-of-%05d.gguf" % len(shards))
    assert gguf_files(shards[0]) == shards
    model = fx_engine.load(shards[0])
    np.testing.assert_array_equal(_logits(model), _logits(default_model))
    assert model.tokenizer.encode("Hello world") == default_model.tokenizer.encode("Hello world")


def test_split_gguf_errors(split_default, tmp_path):
    from fx_engine.core.checkpoint import WeightsError

    with pytest.raises(WeightsError, match=r"shard 2 of \d+ .*load the first shard \(model-00001-of-"):
        fx_engine.load(split_default[1])
    lone = tmp_path / split_default[0].name
    os.symlink(split_default[0], lone)
    with pytest.raises(WeightsError, match="missing: model-00002-of-"):
        fx_engine.load(lone)
    renamed = tmp_path / "first.gguf"
    os.symlink(split_default[0], renamed)
    with pytest.raises(WeightsError, match="must be named as llama.cpp's gguf-split names it"):
        fx_engine.load(renamed)


# ---------------------------------------------------------------------------- a local Hub
class FakeHub:
    """The Hub's HTTP surface that huggingface_hub's downloads use, over local files:
    repos {repo: {revision: (commit sha, {path: bytes})}}; `requests` records every path."""

    def __init__(self, repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]]):
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _send(self, code, data=b"", headers=None, body=True):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _missing(self, what, body):
                code = {"repo": "RepoNotFound", "rev": "RevisionNotFound", "file": "EntryNotFound"}[what]
                self._send(404, json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "Content-Type": "application/json"}, body)

            def _serve(self, body):
                url = urlparse(self.path)
                path = unquote(url.path)
                hub.requests.append(path)
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
                    if repo not in hub.repos:
                        return self._missing("repo", body)
                    if rev not in hub.repos[repo]:
                        return self._missing("rev", body)
                    sha, files = hub.repos[repo][rev]
                    if kind == "revision":
                        info = {"id": repo, "modelId": repo, "sha": sha, "private": False,
                                "siblings": [{"rfilename": f} for f in files]}
                        return self._send(200, json.dumps(info).encode(),
                                          {"Content-Type": "application/json"}, body)
                    if kind == "tree":
                        tree = [{"type": "file", "path": f, "size": len(b),
                                 "oid": hashlib.sha1(b).hexdigest()} for f, b in files.items()]
                        return self._send(200, json.dumps(tree).encode(),
                                          {"Content-Type": "application/json"}, body)
                    return self._missing("file", body)
                # /{org}/{name}/resolve/{rev}/{path...}
                if len(parts) < 5:
                    return self._missing("repo", body)
                repo, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if repo not in hub.repos or parts[2:3] != ["resolve"]:
                    return self._missing("repo", body)
                if rev not in hub.repos[repo]:
                    return self._missing("rev", body)
                sha, files = hub.repos[repo][rev]
                if file not in files:
                    return self._missing("file", body)
                data = files[file]
                self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                       "Content-Type": "application/octet-stream"}, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _resolve(spec: str, env: dict[str, str], revision: str | None = None,
             torch_bins: bool = False) -> subprocess.CompletedProcess:
    """resolve_model in a fresh process (huggingface_hub reads HF_ENDPOINT / HF_HOME /
    HF_HUB_OFFLINE when imported)."""
    code = ("import sys; from fx_engine.loading.hub import resolve_model\n"
            "try:\n print(resolve_model(sys.argv[1], revision=sys.argv[2] or None, progress=False, "
            f"torch_bins={torch_bins}))\n"
            "except FileNotFoundError as e:\n print('ERROR', e); sys.exit(3)\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code, spec, revision or ""], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


SHA_MAIN, SHA_V1, SHA_GGUF, SHA_HEAD, SHA_MTP = "a" * 40, "b" * 40, "c" * 40, "d" * 40, "e" * 40


@pytest.fixture(scope="module")
def hub(tiny_dir, split_default):
    files = _folder_files(tiny_dir)
    files["pytorch_model.bin"] = b"not read"  # never fetched: loading reads safetensors
    gguf_repo = {f"Q4_1/{p.name.replace('model-', 'model-Q4_1-')}": p.read_bytes() for p in split_default}
    gguf_repo["mmproj-model-f16.gguf"] = b"projector, never fetched"
    gguf_repo["model-Q8_0.gguf"] = b"another quantization, never fetched"
    gguf_repo["README.md"] = b"# a GGUF repo"
    from fx_engine.testing.eagle3 import tiny_eagle3_config, tiny_eagle3_tensors
    from tests.models.test_torch_pickle import _save_tensors

    head_dir = tiny_dir.parent / "torch-head"  # yuhuili's layout: config.json + pytorch_model.bin
    head_dir.mkdir(exist_ok=True)
    head_cfg = tiny_eagle3_config(24)
    _save_tensors(tiny_eagle3_tensors(head_cfg), head_dir / "pytorch_model.bin")
    head = {"config.json": json.dumps(head_cfg).encode(),
            "pytorch_model.bin": (head_dir / "pytorch_model.bin").read_bytes(), "training_state.bin": b"never fetched"}
    from fx_engine.testing.mtp import write_mtp_target

    # an original checkpoint that keeps its MTP layer, sharded: the trunk, then the module
    ds = write_mtp_target(tiny_dir.parent / "mtp-original", "deepseek_v3")
    n = json.loads((ds / "config.json").read_text())["num_hidden_layers"]
    weights = mx.load(str(ds / "model.safetensors"))
    module = {k for k in weights if k.startswith(f"model.layers.{n}.")}
    parts = {"model-00001-of-00002.safetensors": {k: v for k, v in weights.items() if k not in module},
             "model-00002-of-00002.safetensors": {k: v for k, v in weights.items() if k in module}}
    original = {"config.json": (ds / "config.json").read_bytes(), "README.md": b"# original"}
    for name, part in parts.items():
        mx.save_safetensors(str(ds / name), part)
        original[name] = (ds / name).read_bytes()
    original["model.safetensors.index.json"] = json.dumps(
        {"weight_map": {k: f for f, part in parts.items() for k in part}}).encode()
    server = FakeHub({
        "mtp-org/ds-original": {"main": (SHA_MTP, original), SHA_MTP: (SHA_MTP, original)},
        "eagle-org/EAGLE3-tiny": {"main": (SHA_HEAD, head), SHA_HEAD: (SHA_HEAD, head)},
        "tiny-org/tiny-llama": {"main": (SHA_MAIN, files), SHA_MAIN: (SHA_MAIN, files),
                                "v1": (SHA_V1, files), SHA_V1: (SHA_V1, files)},
        "gguf-org/smol-GGUF": {"main": (SHA_GGUF, gguf_repo), SHA_GGUF: (SHA_GGUF, gguf_repo)},
    })
    yield server
    server.close()


def test_hub_download_then_offline_cache(hub, tiny_dir, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    r = _resolve("tiny-org/tiny-llama", env)
    assert r.returncode == 0, r.stdout + r.stderr + repr(hub.requests)
    snap = Path(r.stdout.strip().splitlines()[-1])
    assert snap.parts[-2:] == ("snapshots", SHA_MAIN) and (tmp_path / "hf" / "hub") in snap.parents
    assert (snap / "config.json").is_file() and not (snap / "pytorch_model.bin").exists()
    assert any(p.endswith("/resolve/main/config.json") or "/resolve/" in p for p in hub.requests)
    # the same cache, offline, the server's requests unchanged: the cache alone answers
    before = len(hub.requests)
    r2 = _resolve("tiny-org/tiny-llama", {**env, "HF_HUB_OFFLINE": "1"})
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert Path(r2.stdout.strip().splitlines()[-1]) == snap and len(hub.requests) == before
    # what it resolved to loads as the original folder does
    a, b = fx_engine.load(snap), fx_engine.load(tiny_dir)
    np.testing.assert_array_equal(_logits(a), _logits(b))


def test_hub_head_with_only_pytorch_model_bin(hub, tmp_path):
    """A drafter head published as config.json + pytorch_model.bin resolves for a head
    (torch_bins: only pytorch_model*.bin fetched beside the JSON), from the Hub and then
    from the cache offline; a model's resolution still wants safetensors."""
    from fx_engine.loading.drafter import load_eagle3_head

    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    r = _resolve("eagle-org/EAGLE3-tiny", env)
    assert r.returncode == 3 and "neither a model folder" in r.stdout
    r = _resolve("eagle-org/EAGLE3-tiny", env, torch_bins=True)
    assert r.returncode == 0, r.stdout + r.stderr
    snap = Path(r.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "pytorch_model.bin"]
    r = _resolve("eagle-org/EAGLE3-tiny", {**env, "HF_HUB_OFFLINE": "1"}, torch_bins=True)
    assert r.returncode == 0 and Path(r.stdout.strip().splitlines()[-1]) == snap, r.stdout + r.stderr
    assert load_eagle3_head(snap).config.draft_vocab_size == 40
    # --draft-model ORG/HEAD: told apart from a model by its config.json alone, fetched or cached
    code = ("import sys; from fx_engine.loading.drafter import is_eagle3_head\n"
            "print(is_eagle3_head(sys.argv[1]), is_eagle3_head('tiny-org/tiny-llama'))\n")
    for home in (tmp_path / "fresh", tmp_path / "hf"):
        full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        full.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(home)})
        before = len(hub.requests)
        r = subprocess.run([sys.executable, "-c", code, "eagle-org/EAGLE3-tiny"], env=full, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.split() == ["True", "False"], r.stdout + r.stderr
        assert not any(p.endswith(".bin") for p in hub.requests[before:])


def test_hub_mtp_module_fetches_only_its_shards(hub, tmp_path):
    """MtpDrafter.load(ORG/ORIGINAL, model) on a sharded original: config.json, the index and
    the shard holding model.layers.{N}.* are fetched, not the trunk's shard (hundreds of GB
    for DeepSeek-V3); the module read equals the local folder's."""
    code = ("import sys; from fx_engine.loading.drafter import load_mtp_module\n"
            "p = load_mtp_module(sys.argv[1]); print(p.config.num_modules, p.config.first_layer)\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update({"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
    before = len(hub.requests)
    r = subprocess.run([sys.executable, "-c", code, "mtp-org/ds-original"], env=full, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    fetched = [p for p in hub.requests[before:] if "/resolve/" in p]
    assert any(p.endswith("model-00002-of-00002.safetensors") for p in fetched), fetched
    assert not any(p.endswith(("model-00001-of-00002.safetensors", "README.md")) for p in fetched), fetched
    # again, from the cache: nothing more fetched
    before = len(hub.requests)
    r2 = subprocess.run([sys.executable, "-c", code, "mtp-org/ds-original"], env={**full, "HF_HUB_OFFLINE": "1"},
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and r2.stdout == r.stdout and len(hub.requests) == before, r2.stdout + r2.stderr


def test_hub_revision_pin_and_errors(hub, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    r = _resolve("tiny-org/tiny-llama", env, revision="v1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert Path(r.stdout.strip().splitlines()[-1]).name == SHA_V1
    r = _resolve("tiny-org/tiny-llama", env, revision="nope")
    assert r.returncode == 3 and "cannot resolve model 'tiny-org/tiny-llama' at revision nope" in r.stdout
    assert "RevisionNotFound" in r.stdout
    r = _resolve("nobody/nothing", env)
    assert r.returncode == 3 and "RepositoryNotFound" in r.stdout and hub.url in r.stdout
    assert "no snapshot of nobody/nothing" in r.stdout
    r = _resolve("nobody/nothing", {**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 3 and "HF_HUB_OFFLINE is set" in r.stdout and "Hugging Face cache" in r.stdout


def test_hub_gguf_repo_with_quant_and_shards(hub, split_default, default_model, tmp_path):
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    r = _resolve("gguf-org/smol-GGUF:Q4_1", env)
    assert r.returncode == 0, r.stdout + r.stderr
    first = Path(r.stdout.strip().splitlines()[-1])
    snap = first.parent.parent
    assert first.name == "model-Q4_1-00001-of-%05d.gguf" % len(split_default)
    fetched = sorted(p.name for p in snap.rglob("*.gguf"))
    assert len(fetched) == len(split_default) and not any("mmproj" in n or "Q8_0" in n for n in fetched)
    np.testing.assert_array_equal(_logits(fx_engine.load(first)), _logits(default_model))
    # the quant missing from the repo: the choices are named
    r = _resolve("gguf-org/smol-GGUF:Q2_K", env)
    assert r.returncode == 3 and "model-Q8_0.gguf" in r.stdout and "Q2_K" in r.stdout
    # offline, the same spec comes from the cache
    r = _resolve("gguf-org/smol-GGUF:Q4_1", {**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and Path(r.stdout.strip().splitlines()[-1]) == first


def test_served_model_id_is_the_repo_id(tmp_path):
    from types import SimpleNamespace

    from fx_engine.cli import _model_id

    snap = SimpleNamespace(path=str(tmp_path / "snapshots" / SHA_MAIN))
    assert _model_id(snap, "tiny-org/tiny-llama") == "tiny-org/tiny-llama"
    assert _model_id(snap, "gguf-org/smol-GGUF:Q4_1") == "gguf-org/smol-GGUF:Q4_1"
    gguf = SimpleNamespace(path="/m/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert _model_id(gguf, "/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
