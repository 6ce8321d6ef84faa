"""The web chat page at `/` (fx_engine/server/webchat.py, server/static/chat.html), driven in
the system's headless Chromium (Debian's `chromium` and `chromium-driver`, through selenium
from the test extra: no browser download) against a live server of the default model (SmolLM2-135M-Instruct).

What a user does on the page, checked on both sides: the model and LoRA adapter list, a
streamed reply (the same text as the same greedy request through the API), the system
prompt and the earlier turns reaching the server's prompt, reasoning shown apart from the
answer, a stop in the middle of a long reply (the stream ends, the server frees the row,
the page takes the next message), and `--api-key` (the page loads without a key, shows
the 401, and works once the key is entered).

Without Chromium these tests skip, saying why; under CI (`CI` set) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import time

import httpx
import mlx.core as mx
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import serve

pytestmark = pytest.mark.browser

# A ChatML template that can think (so the server splits `<think>` replies into
# `reasoning_content`), whose generation prompt does not open the thinking block.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}")
THINK, THOUGHT = "THINK-FIRST", "<think>The user asks for a sum.</think>\n\nIt is 4."
LONG = "KEEP-TALKING"  # a reply that never ends by itself (no end token, slowed down)
KEY = "sekrit-key"
SAMPLING = {"temperature": 0.0, "max_tokens": 16}


class ChatEngine(fx_engine.Engine):
    """The real Engine, recording each prompt as text (what the server made of the page's
    request), and for prompts naming a scenario forcing the reply with a logits processor:
    THINK: a scripted reply that thinks first; LONG: no end token and 20 ms a token (a
    reply to stop in the middle of)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.prompts: list[str] = []
        tok = self.model.tokenizer
        self.thought = tok.encode(THOUGHT, add_special_tokens=False)
        assert tok.decode(self.thought) == THOUGHT

    def submit_many(self, prompt, kwargs_list):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            text = self.model.tokenizer.decode(prompt)
            self.prompts.append(text)
            last = text.rsplit("<|im_start|>user", 1)[-1]  # the scenario: the last turn's
            force = self._script(len(prompt)) if THINK in last else self._endless() if LONG in last else None
            if force is not None:
                kwargs_list = [dict(kw, logits_processors=[force]) for kw in kwargs_list]
        return super().submit_many(prompt, kwargs_list)

    def _script(self, n_prompt):
        script, eos = self.thought, self.model.eos_ids[0]

        def force(tokens, logits):
            k = tokens.shape[0] - n_prompt
            want = script[k] if k < len(script) else eos
            return mx.where(mx.arange(logits.shape[-1]) == want, 0.0, -1e9).reshape(logits.shape)
        return force

    def _endless(self):
        eos = mx.array(list(self.model.eos_ids))

        def force(tokens, logits):
            time.sleep(0.02)
            banned = (mx.arange(logits.shape[-1])[:, None] == eos[None, :]).any(axis=1)
            return mx.where(banned, -1e9, logits.reshape(-1)).reshape(logits.shape)
        return force


def _browser_or_skip():
    """(chromium, chromedriver) paths; a skip saying what is missing (a failure under CI)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        why = "selenium is not installed (pip install -e '.[test]')"
    else:
        browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
        driver = shutil.which("chromedriver") or next(
            (p for p in ("/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver") if os.path.exists(p)), None)
        if browser and driver:
            return browser, driver
        why = "no system Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)"
    if os.environ.get("CI"):
        pytest.fail(f"the web chat tests need a headless browser under CI: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, chromedriver = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium manager: never download a browser or driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1200,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def write_adapter(cfg, out, layers=16, rank=8, seed=0):
    """An mlx-lm LoRA adapter folder (adapters.safetensors + adapter_config.json) with random
    factors on the last `layers` layers' q and v projections of a model with config `cfg`."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    shapes = {"self_attn.q_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "self_attn.v_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)}
    key, weights = mx.random.key(seed), {}
    for i in range(cfg.num_layers - layers, cfg.num_layers):
        for name, (d_in, d_out) in shapes.items():
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.{name}.lora_a"] = 0.15 * mx.random.normal((d_in, rank), key=ka)
            weights[f"model.layers.{i}.{name}.lora_b"] = 0.15 * mx.random.normal((rank, d_out), key=kb)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": layers,
        "lora_parameters": {"rank": rank, "scale": 4.0, "dropout": 0.0, "keys": sorted(shapes)}}))
    return out


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    """A live server of the default model (SmolLM2-135M-Instruct) with a LoRA adapter:
    "smollm2" and "smollm2:x"."""
    import attrs

    from fx_engine.loading.adapters import AdapterSet

    model = attrs.evolve(default_model, adapters=AdapterSet())  # (the session's model stays as it is)
    fx_engine.load_adapter(model, write_adapter(model.config, tmp_path_factory.mktemp("adapter") / "x"), name="x")
    engine = ChatEngine(model, max_rows=4)
    app = create_app(engine, "smollm2", defaults={"max_tokens": 32}, chat_template=TEMPLATE)
    with serve(app, engine) as (url, _):
        yield {"url": url, "engine": engine}


@pytest.fixture
def page(browser, server):
    """The page, freshly opened with nothing stored (settings live in localStorage)."""
    return open_page(browser, server["url"])


def open_page(driver, url, models=True):
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")
    if models:
        wait(driver, lambda: driver.execute_script("return document.getElementById('model').options.length") > 0)
    return driver


def wait(driver, cond, timeout=30.0, what="the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    html = driver.execute_script("return document.body.innerHTML")
    raise AssertionError(f"timed out waiting for {what}: {html[-3000:]}")


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def set_field(driver, id_, value):
    """Type into a settings field as a user would (the page saves it on `change`)."""
    js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
               "e.dispatchEvent(new Event('change'))", id_, str(value))


def send(driver, text, done=True):
    """Type `text` and press Enter; when `done`, wait for the reply to end. Returns the
    reply's parts as the page shows them."""
    n = js(driver, "return document.querySelectorAll('.msg.assistant').length")
    box = driver.find_element("id", "input")
    js(driver, "arguments[0].value = arguments[1]", box, text)
    from selenium.webdriver.common.keys import Keys
    box.send_keys(Keys.ENTER)
    wait(driver, lambda: js(driver, "return document.querySelectorAll('.msg.assistant').length") == n + 1,
         what="the reply's bubble")
    if done:
        wait(driver, lambda: js(driver, "return document.body.dataset.state") == "idle", what="the reply's end")
    return last_reply(driver)


def last_reply(driver):
    return js(driver, """
        const m = [...document.querySelectorAll('.msg.assistant')].pop();
        const r = m.querySelector('.reasoning');
        return {content: m.querySelector('.content').textContent,
                reasoning: r.hidden ? null : r.querySelector('.text').textContent,
                error: [...m.querySelectorAll('.error')].map(e => e.textContent).join('\\n') || null,
                finish: m.dataset.finish, meta: m.querySelector('.meta').textContent};""")


def api_chat(url, messages, **kw):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def console_errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def running_rows(url):
    text = httpx.get(url + "/metrics").text
    return int(float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith("fx_running_rows "))))


# ---------------------------------------------------------------------------------------


def test_page_is_served_as_one_static_file_and_lists_models(page, server):
    r = httpx.get(server["url"] + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert httpx.head(server["url"] + "/").status_code == 200
    assert "/" not in httpx.get(server["url"] + "/openapi.json").json()["paths"]
    options = js(page, "return [...document.getElementById('model').options].map(o => [o.value, o.textContent])")
    assert options == [["smollm2", "smollm2"], ["smollm2:x", "smollm2:x (adapter)"]]
    assert js(page, "return document.getElementById('banner').hidden")
    assert console_errors(page) == []  # nothing blocked by the page's CSP, nothing missing


def test_a_streamed_reply_is_the_api_reply(page, server):
    for k, v in SAMPLING.items():
        set_field(page, k, v)
    msg = "What is the capital of France?"
    got = send(page, msg)
    want = api_chat(server["url"], [{"role": "user", "content": msg}], **SAMPLING)
    assert got["content"] == want["content"] and got["content"].strip()
    assert got["error"] is None and got["reasoning"] is None
    assert got["finish"] in ("length", "stop") and "tokens" in got["meta"]
    sent = js(page, "return fxChat.lastRequest")
    assert sent["stream"] is True and sent["model"] == "smollm2"
    assert sent["messages"] == [{"role": "user", "content": msg}]
    assert {k: sent[k] for k in SAMPLING} == SAMPLING
    assert "top_p" not in sent and "seed" not in sent  # empty fields: the server's defaults
    assert js(page, "return document.getElementById('input').value") == ""
    assert console_errors(page) == []


def test_system_prompt_turns_and_new_chat_reach_the_server(page, server):
    prompts = server["engine"].prompts
    for k, v in SAMPLING.items():
        set_field(page, k, v)
    set_field(page, "system", "You are terse. SYSTEM-MARK")
    first = send(page, "Hello there")
    assert "<|im_start|>system\nYou are terse. SYSTEM-MARK<|im_end|>" in prompts[-1]
    msgs = [{"role": "system", "content": "You are terse. SYSTEM-MARK"}, {"role": "user", "content": "Hello there"}]
    assert first["content"] == api_chat(server["url"], msgs, **SAMPLING)["content"]
    assert first["content"] != api_chat(server["url"], msgs[1:], **SAMPLING)["content"]  # the system prompt counts
    second = send(page, "And then?")
    page_prompt = prompts[-1]
    msgs += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "And then?"}]
    assert second["content"] == api_chat(server["url"], msgs, **SAMPLING)["content"]
    assert page_prompt == prompts[-1]  # the same conversation as the API's, turn for turn
    # the settings are kept across a reload; "New chat" starts over with the system prompt
    page.refresh()
    wait(page, lambda: js(page, "return document.getElementById('system').value") == "You are terse. SYSTEM-MARK")
    js(page, "document.getElementById('new-chat').click()")
    assert js(page, "return document.querySelectorAll('.msg').length") == 0
    send(page, "Fresh start")
    assert "Hello there" not in prompts[-1] and "SYSTEM-MARK" in prompts[-1] and "Fresh start" in prompts[-1]


def test_reasoning_is_shown_apart_from_the_answer(page, server):
    set_field(page, "max_tokens", 200)
    got = send(page, f"{THINK} 2 + 2?")
    want = api_chat(server["url"], [{"role": "user", "content": f"{THINK} 2 + 2?"}], max_tokens=200)
    assert want["reasoning_content"] == "The user asks for a sum." and want["content"] == "It is 4."
    assert (got["reasoning"], got["content"]) == (want["reasoning_content"], want["content"])
    assert js(page, "return [...document.querySelectorAll('.msg.assistant .reasoning')].pop().open") is False
    # the conversation holds the answer alone, as the API's clients send it back
    assert js(page, "return fxChat.messages") == [{"role": "user", "content": f"{THINK} 2 + 2?"},
                                                  {"role": "assistant", "content": "It is 4."}]


def test_the_adapter_chosen_serves_the_reply(page, server):
    for k, v in SAMPLING.items():
        set_field(page, k, v)
    js(page, "const s = document.getElementById('model'); s.value = 'smollm2:x'; s.dispatchEvent(new Event('change'))")
    got = send(page, "The capital")
    assert js(page, "return fxChat.lastRequest.model") == "smollm2:x"
    msgs = [{"role": "user", "content": "The capital"}]
    want = api_chat(server["url"], msgs, model="smollm2:x", **SAMPLING)
    base = api_chat(server["url"], msgs, model="smollm2", **SAMPLING)
    assert got["content"] == want["content"] != base["content"]
    page.refresh()  # the choice is remembered
    wait(page, lambda: js(page, "return document.getElementById('model').value") == "smollm2:x")


def test_stop_ends_a_long_reply_and_frees_the_row(page, server):
    url = server["url"]
    set_field(page, "max_tokens", 1500)
    send(page, f"{LONG} tell me everything", done=False)
    assert js(page, "return document.body.dataset.state") == "streaming"
    assert js(page, "return document.getElementById('send').disabled")
    # streamed: the reply grows in the page while it is being generated
    first = wait(page, lambda: len(last_reply(page)["content"]) > 0 and last_reply(page)["content"], what="text")
    wait(page, lambda: len(last_reply(page)["content"]) > len(first), what="more text")
    assert js(page, "return document.body.dataset.state") == "streaming"
    assert running_rows(url) == 1
    page.find_element("id", "stop").click()
    wait(page, lambda: js(page, "return document.body.dataset.state") == "idle", timeout=5, what="the stop")
    stopped = last_reply(page)
    assert stopped["finish"] == "stopped" and stopped["error"] is None and "stopped" in stopped["meta"]
    assert 0 < len(stopped["content"])
    time.sleep(0.5)
    assert last_reply(page)["content"] == stopped["content"]  # nothing more arrives
    deadline = time.monotonic() + 10
    while running_rows(url) and time.monotonic() < deadline:  # the server frees the row
        time.sleep(0.05)
    assert running_rows(url) == 0
    # the partial reply stays in the conversation; the page takes the next message
    assert js(page, "return fxChat.messages.map(m => m.role)") == ["user", "assistant"]
    set_field(page, "max_tokens", 8)
    nxt = send(page, "Short one now")
    assert nxt["finish"] in ("length", "stop") and nxt["error"] is None
    assert not js(page, "return document.getElementById('send').disabled")
    assert js(page, "return document.getElementById('stop').disabled")


def test_api_errors_are_shown(page, server):
    set_field(page, "max_tokens", 100000)  # beyond the model's context (8192): a 400
    got = send(page, "Hello")
    assert got["error"] and got["error"].startswith("Error 400:") and "max_tokens" in got["error"]
    assert got["finish"] == "error" and got["content"] == ""
    # the failed turn is not kept: the message is back in the box to retry
    assert js(page, "return fxChat.messages") == []
    assert js(page, "return document.getElementById('input').value") == "Hello"


@pytest.fixture(scope="module")
def keyed(default_model):
    engine = fx_engine.Engine(default_model, max_rows=2)
    app = create_app(engine, "smollm2", api_key=KEY, defaults={"max_tokens": 8})
    with serve(app, engine) as (url, _):
        yield url


def test_with_an_api_key(browser, keyed):
    url = keyed
    assert httpx.get(url + "/").status_code == 200  # the page itself: no key needed
    assert httpx.head(url + "/").status_code == 200
    assert httpx.post(url + "/").status_code == 401  # GET and HEAD only
    assert httpx.get(url + "/v1/models").status_code == 401
    page = open_page(browser, url, models=False)
    wait(page, lambda: not js(page, "return document.getElementById('banner').hidden"), what="the 401")
    banner = js(page, "return document.getElementById('banner').textContent")
    assert banner.startswith("Error 401: missing or invalid API key") and "API key in Settings" in banner
    got = send(page, "Hi")
    assert got["error"].startswith("Error 401:") and got["content"] == ""
    set_field(page, "api-key", KEY)  # models load at once
    wait(page, lambda: js(page, "return document.getElementById('model').value") == "smollm2", what="models")
    assert js(page, "return document.getElementById('banner').hidden")
    js(page, "document.getElementById('input').value = ''")
    got = send(page, "Hi")
    assert got["error"] is None and got["content"] and got["finish"] in ("length", "stop")
    page.refresh()  # the key is kept in this browser
    wait(page, lambda: js(page, "return document.getElementById('model').value") == "smollm2", what="models")
    assert js(page, "return localStorage.getItem('fx-chat.api-key')") == KEY
