import contextlib
import os
import socket
import threading
import time

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
def tiny_dir(tmp_path_factory):
    from fx_engine.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


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
