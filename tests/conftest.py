import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported

os.environ.setdefault("FX_ENGINE_OFFLINE", "1")  # tests never download

# The golden kit's fixture (`golden`), enabled as a user's suite would; pytester runs an
# inner pytest in the kit's own tests.
pytest_plugins = ["fx_engine.testing.pytest_plugin", "pytester"]


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct GGUF), float32 on CPU."""
    return fx_engine.load()


@pytest.fixture(scope="session")
def default_model_bi():
    """The default model in batch-invariant mode."""
    return fx_engine.load(batch_invariant=True)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """`tiny_folder(model_type="llama", **kw)`: `fx_engine.testing.write_tiny_model(folder,
    model_type, **kw)`, written once per session for each distinct argument set and shared
    (random weights from a fixed seed: the same arguments give the same folder). The folder
    is read-only: a test that changes files in it writes its own with write_tiny_model."""
    from fx_engine.testing import write_tiny_model

    made: dict[str, Path] = {}

    def tiny(model_type: str = "llama", **kw) -> Path:
        key = json.dumps([model_type, kw], sort_keys=True, default=repr)
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{model_type}") / model_type, model_type, **kw)
        return made[key]

    return tiny


@pytest.fixture(scope="session")
def family_folders(tiny_folder):
    """Every registered model_type's tiny example folder (its registry defaults), shared."""
    from fx_engine.core.models import FAMILIES

    return {mt: tiny_folder(mt) for fam in FAMILIES for mt in fam.model_types}


@pytest.fixture(scope="session")
def tiny_dir(tiny_folder):
    """The default tiny model's folder (llama, seed 0)."""
    return tiny_folder("llama")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return fx_engine.load(tiny_dir)


LONG_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? "
    "The capital of France is Paris. def add(a, b): return a + b. Numbers 0123456789. "
) * 4


def wait_healthy(url: str, procs=(), timeout: float = 120.0) -> None:
    """Wait until a server started in another process answers GET /health with 200; fail
    at once if one of `procs` (Popen) exits first, or after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
        for p in procs:
            assert p.poll() is None, f"the server process exited ({p.returncode}): {p.stderr.read()[-3000:]}"
    pytest.fail(f"{url} did not become healthy in {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, engine, **limits):
    """A live uvicorn server for `app` on a free port of 127.0.0.1, with `engine` started;
    yields (url, port). Shut down fully afterwards (no thread may still be inside the
    server or the engine during interpreter finalisation), and the engine closed.
    `limits`: serve with server/connections.py's connection limits (as `fx-engine serve`)."""
    import uvicorn

    port = free_port()
    if limits:
        from fx_engine.server.connections import server_config

        config = server_config(app, host="127.0.0.1", port=port, log_level="warning", **limits)
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    engine.start()
    t = threading.Thread(target=srv.run)
    t.start()
    for _ in range(400):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        srv.should_exit = True
        t.join(timeout=30)
        if t.is_alive():
            srv.force_exit = True
            t.join(timeout=10)
        engine.close(wait=False)


@pytest.fixture(scope="session")
def served_default(default_model):
    """One live server for the default model with the default app settings
    (`create_app(engine, "smollm2")` over `Engine(default_model, max_rows=4)`), shared by the
    modules that serve exactly that: {"url", "app", "engine", "model"}. Closed at the end
    of the session."""
    from fx_engine.server.app import create_app

    engine = fx_engine.Engine(default_model, max_rows=4)
    app = create_app(engine, "smollm2")
    with serve(app, engine) as (url, _):
        yield {"url": url, "app": app, "engine": engine, "model": default_model}


# ------------------------------------------------------------------ tiers (markers)
# Registered in pyproject.toml. By folder: every test in tests/server/ is `server`, every
# test in tests/distributed/ is `distributed`; by fixture: a test that uses the default
# model (directly or through a fixture) is `real_model`. `oracle`, `slow` and the rest are
# set in the modules themselves (pytestmark or per test).
_FOLDER_MARKS = {"server": "server", "distributed": "distributed"}
_REAL_MODEL_FIXTURES = {"default_model", "default_model_bi", "served_default"}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.parent.parent == _TESTS and path.parent.name in _FOLDER_MARKS:
            item.add_marker(_FOLDER_MARKS[path.parent.name])
        if _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("real_model")


@pytest.fixture
def steady_policy(monkeypatch):
    """The speculation policy's cost model weighs measured seconds (compiles, a machine shared
    with other work): a test that counts drafts fixes it to verify every step's drafts at the
    longest one's K bucket, so it sees the same steps on every run. The acceptance-aware
    per-row draft lengths (DraftState: adapt, back-off) stay the policy's."""
    from fx_engine.core.buckets import pow2_ceil
    from fx_engine.engine.speculation import SpeculationPolicy

    monkeypatch.setattr(SpeculationPolicy, "choose_k",
                        lambda self, rows, drafts, live, extra=0.0: pow2_ceil(max(n for _, n in drafts)))
