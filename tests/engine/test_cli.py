"""The command line's generation options (speculative decoding, KV cache kinds)."""

from __future__ import annotations

import pytest

from fx_engine.cli import main
from tests.conftest import LONG_TEXT


@pytest.mark.parametrize("extra", [
    ["--prompt-lookup", "--num-draft-tokens", "8"],
    ["--self-draft-layers", "1"],
    ["--draft-model", "{tiny}"],
    ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0", "--model", "{tiny32}"],
])
def test_generate_options(tiny_dir, capsys, extra, tiny_folder):
    if "{tiny32}" in extra:  # group size 32 needs head_dim 32 (the tiny default is 16)
        extra = [x.replace("{tiny32}", str(tiny_folder(head_dim=32))) for x in extra]
    extra = [x.replace("{tiny}", str(tiny_dir)) for x in extra]
    code = main(["generate", LONG_TEXT, "--raw", "--model", str(tiny_dir), "--max-tokens", "12", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "generation:" in out.err
    if "--prompt-lookup" in extra:  # LONG_TEXT repeats itself: lookup drafts are accepted
        assert "drafts accepted" in out.err
    if "--kv-bits" in extra:
        assert "KV cache" in out.err


def test_conflicting_draft_options_are_a_clear_error(tiny_dir, capsys):
    code = main(["generate", "hi", "--model", str(tiny_dir), "--self-draft-layers", "1",
                 "--draft-model", str(tiny_dir)])
    assert code == 2 and "not both" in capsys.readouterr().err


def test_cache_prompt_then_generate_with_the_prompt_cache(tiny_dir, tmp_path, capsys):
    system = "You are a helpful assistant. " * 8
    cache = tmp_path / "pc"
    assert main(["cache-prompt", system, "--system", "--prompt-cache", str(cache),
                 "--model", str(tiny_dir)]) == 0
    assert "cached" in capsys.readouterr().err
    assert list(cache.glob("*.safetensors"))
    import fx_engine

    model = fx_engine.load(tiny_dir)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    out = fx_engine.generate(model, msgs, max_tokens=4, prompt_cache_dir=str(cache))
    assert out.usage.cached_tokens > 40
    assert out.token_ids == fx_engine.generate(model, msgs, max_tokens=4).token_ids
    code = main(["generate", "hi", "--system", system, "--model", str(tiny_dir), "--max-tokens", "4",
                 "--prompt-cache", str(cache)])
    assert code == 0


def _served(monkeypatch, argv):
    """Run `fx-engine serve ARGV` up to the HTTP server, which returns at once: the Engine's
    arguments and the uvicorn Config it would have served with."""
    import uvicorn

    import fx_engine

    seen = {}

    class Recording(fx_engine.Engine):
        def __init__(self, *args, **kwargs):
            seen["engine"] = kwargs
            super().__init__(*args, **kwargs)

    def run(self, sockets=None):
        seen["config"] = self.config
        self.started = True

    monkeypatch.setattr(fx_engine, "Engine", Recording)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    return main(["serve", *argv]), seen


@pytest.mark.parametrize("flag", ["--prompt-cache", "--prompt-cache-dir"])
def test_serve_prompt_cache_names_and_disk_budget_reach_the_engine(tiny_dir, tmp_path, monkeypatch, flag):
    """`--prompt-cache DIR` (listed in serve --help) was parsed and then ignored."""
    code, seen = _served(monkeypatch, ["--model", str(tiny_dir), flag, str(tmp_path / "pc"),
                                       "--prompt-cache-disk-bytes", str(1 << 20)])
    assert code == 0
    assert seen["engine"]["prefix_cache_dir"] == str(tmp_path / "pc")
    assert seen["engine"]["prefix_cache_disk_bytes"] == 1 << 20


def test_serve_disk_budget_without_a_directory_is_an_error(tiny_dir, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _served(monkeypatch, ["--model", str(tiny_dir), "--prompt-cache-disk-bytes", "1000"])
    assert e.value.code == 2 and "--prompt-cache-dir" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--prompt-cache", "/dev/null/x"], "argument --prompt-cache-dir: cannot use '/dev/null/x'"),
    (["--prompt-cache-dir", "{tmp}/pc", "--prompt-cache-disk-bytes", "0"],
     "argument --prompt-cache-disk-bytes: expected an integer >= 1, got '0'"),
    (["--prompt-cache-bytes", "-1"], "argument --prompt-cache-bytes: expected an integer >= 0"),
    (["--prompt-cache-size", "0"], "argument --prompt-cache-size: expected an integer >= 1"),
    (["--decode-concurrency", "0"], "argument --decode-concurrency: expected an integer >= 1"),
    (["--max-queue", "-2"], "argument --max-queue: expected an integer >= 0"),
])
def test_bad_serve_flags_are_named_before_the_model_loads(tmp_path, monkeypatch, capsys, argv, says):
    import fx_engine.cli as cli

    def no_load(a):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "_load", no_load)
    with pytest.raises(SystemExit) as e:
        main(["serve", *(x.replace("{tmp}", str(tmp_path)) for x in argv)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "fx-engine serve: error: " + says in err, err
    assert "Traceback" not in err and "prefix_cache" not in err


def test_serve_connection_limits_reach_the_server(tiny_dir, monkeypatch):
    from fx_engine.server.connections import LimitedH11Protocol

    code, seen = _served(monkeypatch, ["--model", str(tiny_dir), "--header-timeout", "3",
                                       "--timeout-keep-alive", "2", "--max-connections", "7",
                                       "--body-timeout", "4"])
    config = seen["config"]
    assert code == 0 and config.http is LimitedH11Protocol
    assert (config.fx_header_timeout, config.timeout_keep_alive, config.fx_max_connections) == (3, 2, 7)
    [gate] = [m for m in config.app.user_middleware if m.cls.__name__ == "_Gate"]
    assert gate.kwargs["body_timeout"] == 4


def test_draft_model_takes_an_eagle3_head_folder(tmp_path, capsys):
    """--draft-model DIR with an EAGLE-3 head's folder drafts with the head (the echo pair's
    first drafts are always right): the same text as without it, drafts accepted."""
    from fx_engine.testing.eagle3 import write_echo_pair

    target, head = write_echo_pair(tmp_path / "pair")
    base = ["generate", "hello there", "--raw", "--model", str(target), "--max-tokens", "16"]
    assert main(base) == 0
    plain = capsys.readouterr()
    assert main([*base, "--draft-model", str(head)]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    assert "drafts accepted" in drafted.err and "drafts accepted 0/" not in drafted.err


def test_generate_takes_images(tmp_path, capsys):
    """--image PATH (repeatable) on a model with an image path: the same text as
    fx_engine.generate with those image parts; clear errors for a missing file, --raw, and a
    text-only model."""
    import numpy as np
    from PIL import Image

    import fx_engine
    from fx_engine.testing.vision import write_tiny_gemma3_vlm

    folder = write_tiny_gemma3_vlm(tmp_path / "vlm")
    pic = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(pic)
    assert main(["generate", "What is this?", "--model", str(folder), "--image", str(pic), "--max-tokens", "6",
                 "--no-warmup"]) == 0
    out = capsys.readouterr()
    model = fx_engine.load(folder)
    want = fx_engine.generate(model, [{"role": "user", "content": [
        {"type": "image", "image": pic}, {"type": "text", "text": "What is this?"}]}], max_tokens=6, temperature=0.0)
    assert out.out == want.text + "\n"
    assert main(["generate", "x", "--model", str(folder), "--image", str(tmp_path / "none.png")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(folder), "--image", str(pic), "--raw"]) == 2
    assert "--raw" in capsys.readouterr().err
