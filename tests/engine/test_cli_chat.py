"""The command line as a newcomer meets it (issue 44, item 5): chat's Ctrl-C and sampling
defaults, the context-size flag, compile time kept out of the prompt's stats."""

from __future__ import annotations

import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

import fx_engine
from fx_engine.cli import main
from fx_engine.loading.sampling_defaults import CHAT_DEFAULTS, chat_sampling, model_sampling


# ---- sampling defaults: the model's settings, else llama.cpp's ----

def _with_generation_config(tiny_dir, tmp_path, config):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_generation_config_settings_then_llama_cpp_defaults_key_by_key(tiny_dir, tmp_path):
    folder = _with_generation_config(tiny_dir, tmp_path, {
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "bos_token_id": 1})
    assert model_sampling(folder) == ({"temperature": 0.6, "top_p": 0.9},
                                      "the model's generation_config.json")
    chosen, sources = chat_sampling(folder, {"temperature": None, "top_p": None, "top_k": 7,
                                             "min_p": None, "repetition_penalty": None})
    assert chosen == {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.05}
    assert sources["temperature"] == sources["top_p"] == "the model's generation_config.json"
    assert sources["top_k"] == "flags" and sources["min_p"] == "llama.cpp's defaults"


def test_do_sample_false_is_greedy_and_no_file_means_llama_cpp_defaults(tiny_dir, tmp_path):
    folder = _with_generation_config(tiny_dir, tmp_path, {"do_sample": False, "temperature": 0.7})
    assert model_sampling(folder)[0] == {"temperature": 0.0}
    chosen, sources = chat_sampling(tiny_dir, {"temperature": None})  # no generation_config.json
    assert chosen == CHAT_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert set(sources.values()) == {"llama.cpp's defaults"}


def test_gguf_sampling_keys_are_read(tmp_path):
    """llama.cpp's key names, written by gguf-py's own writer (what convert_hf_to_gguf.py
    stores from a generation_config.json)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_sampling_temp(0.6)
    w.add_sampling_top_k(20)
    w.add_sampling_top_p(0.95)
    w.add_sampling_min_p(0.0)
    w.add_sampling_penalty_repeat(1.1)
    w.add_sampling_penalty_last_n(64)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    settings, source = model_sampling(path)
    assert settings == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                        "repetition_penalty": 1.1, "repetition_context_size": 64}
    assert "general.sampling" in source
    chosen, _ = chat_sampling(path, {"temperature": 0.2})
    assert chosen["temperature"] == 0.2 and chosen["top_k"] == 20  # the flag wins


class _Delta(str):
    def __new__(cls, text, usage=None):
        d = super().__new__(cls, text)
        d.text, d.usage = text, usage
        return d


def _recording_stream(monkeypatch, script=None):
    """fx_engine.stream replaced: records (prompt, kwargs) of each call; `script(call_no)`
    gives the deltas of that call (default: one word)."""
    calls = []

    def stream(model, prompt, **kw):
        calls.append((json.loads(json.dumps(prompt)), kw))
        return iter(script(len(calls)) if script else [_Delta("ok")])

    monkeypatch.setattr(fx_engine, "stream", stream)
    return calls


def test_chat_banner_says_where_each_setting_came_from_and_they_reach_generation(
        tiny_dir, tmp_path, monkeypatch, capsys):
    folder = _with_generation_config(tiny_dir, tmp_path, {"temperature": 0.6, "top_p": 0.9})
    calls = _recording_stream(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(folder), "--top-k", "7", "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "temp 0.6, top-p 0.9 (the model's generation_config.json)" in err, err
    assert "top-k 7 (flags)" in err and "min-p 0.05 (llama.cpp's defaults)" in err, err
    [(_, kw)] = calls
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (0.6, 0.9, 7, 0.05)


def test_generate_stays_greedy_by_default(tiny_dir, monkeypatch, capsys):
    calls = _recording_stream(monkeypatch)
    assert main(["generate", "hi", "--model", str(tiny_dir), "--no-warmup"]) == 0
    [(_, kw)] = calls
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["min_p"]) == (0.0, 1.0, 0, 0.0)


# ---- chat: Ctrl-C stops the reply, not the session ----

def test_ctrl_c_during_a_reply_keeps_the_conversation_and_its_partial_reply(tiny_dir, monkeypatch, capsys):
    def script(call):
        if call == 1:  # a long reply, interrupted after its second word
            def words():
                for i in range(1000):
                    if i == 2:
                        os.kill(os.getpid(), signal.SIGINT)
                    yield _Delta(f"w{i} ")
            return words()
        return [_Delta("fine")]

    calls = _recording_stream(monkeypatch, script)
    monkeypatch.setattr(sys, "stdin", io.StringIO("tell me a story\nshorter please\n"))
    assert main(["chat", "--model", str(tiny_dir), "--no-warmup"]) == 0
    out = capsys.readouterr()
    assert "reply stopped" in out.err and "w999" not in out.out
    assert len(calls) == 2, "the session ended at Ctrl-C"
    history = calls[1][0]
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[1]["content"].startswith("w0 w1 w2") and len(history[1]["content"]) < 40
    assert history[2]["content"] == "shorter please"


def test_ctrl_c_at_the_prompt_ends_the_chat(tiny_dir, monkeypatch, capsys):
    import builtins

    def interrupted(prompt=""):
        raise KeyboardInterrupt

    calls = _recording_stream(monkeypatch)
    monkeypatch.setattr(builtins, "input", interrupted)
    assert main(["chat", "--model", str(tiny_dir), "--no-warmup"]) == 0
    assert calls == []


def _read_until(fd, pattern, timeout, buf=b""):
    """Read `fd` until `pattern` (bytes regex) matches what was read, or fail."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, buf):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {pattern!r}; got {buf[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"EOF before {pattern!r}; got {buf[-2000:]!r}"
            buf += chunk
    return buf


def _stacks(p: subprocess.Popen) -> str:
    """A hung child's threads: native (gdb, where installed) and Python (PYTHONFAULTHANDLER
    dumps every thread on SIGABRT), with the end of what it wrote to stderr."""
    native = ""
    if shutil.which("gdb"):
        native = subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 30"],
                                capture_output=True, text=True, timeout=120).stdout
    p.send_signal(signal.SIGABRT)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
    err = p.stderr.read().decode(errors="replace")
    return f"--- native threads ---\n{native[-20000:]}\n--- stderr ---\n{err[-8000:]}"


@pytest.mark.real_model
def test_chat_process_survives_ctrl_c_mid_reply_and_exits_on_ctrl_c_at_the_prompt():
    """The real thing: `python -m fx_engine chat` on the default model, SIGINT while it
    streams a long greedy reply, then another message, then SIGINT at the prompt."""
    env = {**os.environ, "FX_ENGINE_PROGRESS": "0", "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen([sys.executable, "-m", "fx_engine", "chat", "--temp", "0", "--max-tokens",
                          "2000", "-v"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        p.stdin.write(b"List every country in the world.\n")  # greedy: runs to max-tokens
        p.stdin.flush()
        out = _read_until(p.stdout.fileno(), rb"[\s\S]{40}", 180)  # the reply is streaming
        p.send_signal(signal.SIGINT)
        err = _read_until(p.stderr.fileno(), rb"reply stopped", 60)
        p.stdin.write(b"Say hello.\n")
        p.stdin.flush()
        err = _read_until(p.stderr.fileno(), rb"generation: \d+ tokens", 120, err)  # -v's stats
        time.sleep(0.5)  # back at the prompt (reading stdin)
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the chat did not exit after Ctrl-C at the prompt:\n" + _stacks(p))
        rest_out, rest_err = p.stdout.read(), p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err += rest_err
    assert rc == 0, err.decode(errors="replace")[-3000:]
    assert b"Traceback" not in err
    assert b"sampling" in err.split(b"\n", 1)[0]  # the banner's first line
    # the interrupted reply stopped far short of its 2000 tokens
    assert b"generation: 2000 tokens" not in err
    assert len(out + rest_out) < 6000


# ---- --max-kv-size / -c / --ctx-size ----

def test_context_size_caps_the_requests(tiny_model):
    capped = tiny_model.with_max_context(16)
    assert capped.context_length == 16 and tiny_model.context_length == 2048
    assert fx_engine.Engine(capped, max_rows=1).context_length == 16
    with pytest.raises(ValueError, match=r"alone exceeds the context size of 16 tokens \(max_context"):
        fx_engine.generate(capped, list(range(3, 23)), max_tokens=1)
    with pytest.raises(ValueError, match="exceeds the context size of 16"):
        fx_engine.generate(capped, [3, 4, 5], max_tokens=15)
    out = fx_engine.generate(capped, [3, 4, 5], max_tokens=14)
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= 17
    with pytest.raises(ValueError, match="max_context"):
        tiny_model.with_max_context(0)


@pytest.mark.parametrize("flag", ["--max-kv-size", "-c", "--ctx-size"])
def test_cli_context_size_flag(tiny_dir, capsys, flag):
    prompt = " ".join(["word"] * 40)
    code = main(["generate", prompt, "--raw", "--model", str(tiny_dir), flag, "16", "--no-warmup"])
    err = capsys.readouterr().err
    assert code == 2 and "exceeds the context size of 16 tokens" in err, err
    # a prompt that fits: the reply stops where the context is full (not an error)
    code = main(["generate", "word word", "--raw", "--model", str(tiny_dir), flag, "16",
                 "--max-tokens", "100", "--temp", "0", "--no-warmup"])
    err = capsys.readouterr().err
    m = re.search(r"prompt: (\d+) tokens.*generation: (\d+) tokens", err)
    assert code == 0 and m, err
    assert int(m[1]) + int(m[2]) <= 17


def test_bad_context_size_is_refused_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "-c", "0"])
    assert e.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err


# ---- compile time apart from prompt time ----

def test_stats_show_the_warm_up_apart_from_the_prompt(tiny_dir, capsys):
    assert main(["generate", "hi", "--model", str(tiny_dir), "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"\[warm-up and compile: [\d.]+ s \| prompt: \d+ tokens, [\d.]+ tok/s", err), err
    assert main(["generate", "hi", "--model", str(tiny_dir), "--max-tokens", "4", "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "warm-up" not in err and "prompt:" in err


def test_python_dash_m_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "fx_engine", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: fx-engine" in r.stdout, r.stderr
