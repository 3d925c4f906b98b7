"""The web playground in a real browser: Debian's headless Chromium driven by selenium, against the
server on tiny members (uvicorn in a thread, on a free loopback port).

Every run in the page is compared with the same greedy request sent to the API directly: the
pieces' texts concatenate to the API's answer, each piece's kind (agreed / ensembled / gated /
single) and underline member follow the API's trace, the step's top-k tables list every member's
token ids, and the stats show the API's ensembled share. Without /usr/bin/chromium,
/usr/bin/chromedriver or selenium the tests skip, except under ``CI=true`` where they fail
(``.ci/run`` installs the browser first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
from contextlib import contextmanager

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[server]')")

from tokenfuse.engine import Ensemble  # noqa: E402
from tokenfuse.server import ServerSettings, create_app  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PROMPT = "The capital of France is"
MAX_TOKENS = 12


def _browser_or_skip() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        why = f"no headless browser: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(why + "; under CI=true this test must run")
        pytest.skip(why)


@pytest.fixture(scope="module")
def driver():
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-proxy-server",
                "--window-size=1200,900", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(30)
    yield d
    d.quit()


@contextmanager
def serving(app):
    """``app`` on uvicorn in a background thread, on a free loopback port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started or not thread.is_alive():
                break
            threading.Event().wait(0.05)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def url(ens):
    with serving(create_app(ens, settings=ServerSettings(max_tokens=256))) as u:
        yield u


# ---------------------------------------------------------------------------------------------- helpers
def api(url: str, body: dict, key: str | None = None) -> dict:
    """The same request, not streamed, with the trace (what the page must show)."""
    path = "v1/chat/completions" if "messages" in body else "v1/completions"
    tf = {**body.get("tokenfuse", {}), "trace": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(trust_env=False, timeout=120) as c:
        r = c.post(url + path, json={**body, "tokenfuse": tf}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def expected_kind(step: dict) -> str:
    if step["gated"]:
        return "gated"
    if step["ensembled"]:
        return "agreed" if step["skipped"] else "ensembled"
    return "single"


def expected_best(step: dict) -> str:
    best = None
    for m in step["members"]:
        if m["computed"] and m["piece_prob"] is not None and (best is None or m["piece_prob"] > best["piece_prob"]):
            best = m
    return best["name"] if best else ""


def wait_for(d, script: str, timeout: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, timeout, poll_frequency=0.1).until(lambda drv: drv.execute_script(script))


def fill(d, element_id: str, value) -> None:
    """Set an input, select or checkbox the way a user would leave it (and fire ``change``)."""
    d.execute_script("""
        const e = document.getElementById(arguments[0]);
        if (e.type === 'checkbox') e.checked = arguments[1]; else e.value = arguments[1];
        e.dispatchEvent(new Event('change', {bubbles: true}));""", element_id, value)


def run_in_page(d, *, prompt: str, controls: dict) -> str:
    """Type the prompt, set the controls, press Run, wait for the stream to finish; the run's state."""
    from selenium.webdriver.common.by import By

    box = d.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    for element_id, value in controls.items():
        fill(d, element_id, value)
    d.find_element(By.ID, "run").click()
    return wait_for(d, "const s = document.body.dataset.run; return s !== 'running' && s !== 'idle' && s;")


def pieces(d) -> list[dict]:
    return d.execute_script("""
        return [...document.querySelectorAll('#output [data-step]')].map(e => ({
            text: e.textContent, piece: e.classList.contains('piece'), end: e.classList.contains('end-mark'),
            kind: e.dataset.kind, best: e.dataset.best, step: Number(e.dataset.step),
            background: getComputedStyle(e).backgroundColor, underline: getComputedStyle(e).borderBottomColor}));""")


def legend_colours(d) -> dict:
    return d.execute_script("""
        const out = {};
        for (const e of document.querySelectorAll('#legend .piece')) out[e.textContent] = getComputedStyle(e).backgroundColor;
        for (const e of document.querySelectorAll('#member-legend .member-swatch'))
            out['member:' + e.textContent] = getComputedStyle(e).borderBottomColor;
        return out;""")


def check_run(d, ref: dict, names: list[str]) -> None:
    """The page's pieces, colours and stats against the API's answer ``ref`` for the same request."""
    choice = ref["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    steps = ref["tokenfuse"]["trace"][0]["steps"]
    shown = pieces(d)
    assert len(shown) == len(steps) > 0
    assert "".join(p["text"] for p in shown if p["piece"]) == text
    assert [p["end"] for p in shown] == [s["end"] for s in steps]
    assert [p["text"] for p in shown if p["piece"]] == [s["text"] for s in steps if not s["end"]]
    assert [p["kind"] for p in shown] == [expected_kind(s) for s in steps]
    assert [p["best"] for p in shown] == [expected_best(s) for s in steps]
    colours = legend_colours(d)
    kinds = {colours[k] for k in ("agreed", "ensembled", "gated", "single")}
    assert len(kinds) == 4 and "rgba(0, 0, 0, 0)" not in kinds  # four distinct, visible backgrounds
    for p in shown:
        assert p["background"] == colours[p["kind"]], p
        if p["best"]:
            assert p["underline"] == colours["member:" + p["best"]], p
    assert sorted(k for k in colours if k.startswith("member:")) == sorted("member:" + n for n in names)
    stats = d.execute_script("""
        const v = id => document.getElementById(id).dataset.value;
        return {steps: v('stat-steps'), ms: v('stat-ms'), ensembled: v('stat-ensembled'),
                source: document.getElementById('stats').dataset.source};""")
    n = ref["usage"]["completion_tokens"]
    assert stats["source"] == "server" and int(stats["steps"]) == n
    assert float(stats["ensembled"]) == pytest.approx(ref["tokenfuse"]["ensembled_steps"] / n, abs=1e-12)
    assert float(stats["ms"]) > 0


def check_topk(d, ref: dict, index: int, names: list[str]) -> None:
    """Click piece ``index``: a table per member with exactly its top-k token ids of that step."""
    from selenium.webdriver.common.by import By

    step = ref["tokenfuse"]["trace"][0]["steps"][index]
    d.find_element(By.CSS_SELECTOR, f'#output [data-step="{index}"]').click()
    wait_for(d, f"const p = document.getElementById('topk'); return !p.hidden && p.dataset.step === '{index}';", 10)
    tables = d.execute_script("""
        return [...document.querySelectorAll('#topk table.topk')].map(t => ({
            member: t.dataset.member, role: t.classList.contains('member') ? 'member' : 'combined',
            ids: [...t.querySelectorAll('tr[data-token-id]')].map(r => Number(r.dataset.tokenId)),
            rows: t.querySelectorAll('tr[data-text]').length,
            chosen: [...t.querySelectorAll('tr.chosen')].map(r => r.dataset.text),
            visible: t.getBoundingClientRect().height > 0}));""")
    assert [t["member"] for t in tables if t["role"] == "member"] == names
    assert all(t["visible"] for t in tables)
    def chosen(top):  # the entries that are the chosen piece: highlighted
        return [e["text"] for e in top or []
                if (e["end"] if step["end"] else not e["end"] and step["bytes"] and e["bytes"] == step["bytes"])]

    combined = tables[0]
    assert combined["role"] == "combined" and combined["rows"] == len(step["top"])
    assert combined["chosen"] == chosen(step["top"])
    for t, m in zip(tables[1:], step["members"], strict=True):
        assert t["ids"] == [e["id"] for e in m["top"] or []], (t, m)
        assert t["chosen"] == chosen(m["top"]), (t, m)


# ---------------------------------------------------------------------------------------------- tests
# (page controls, the request options they must become): the defaults, a chat run with a gate, UniTE
# with a silent member; with the pieces' kinds each case must show.
CASES = {
    "completion": ({}, {}, set()),
    "chat-gated": ({"chat": True, "gate": "A", "threshold": "0.3"}, {"gate": "A", "threshold": 0.3}, {"gated"}),
    "unite-weights": ({"method": "unite", "params": "k=5", "weight-2": "0"},
                      {"method": "unite", "params": {"k": 5}, "weights": {"A": 1, "B": 1, "C": 0}}, set()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_playground_streams_the_traced_answer(driver, url, ens, case, tmp_path):
    controls, options, kinds = CASES[case]
    names = [m.name for m in ens.members]
    driver.get(url)
    wait_for(driver, "return document.body.dataset.connected === 'true';", 30)
    assert driver.title == "tokenfuse playground"
    chat = controls.get("chat", False)
    state = run_in_page(driver, prompt=PROMPT, controls={"max-tokens": str(MAX_TOKENS), "temperature": "0",
                                                         "chat": chat, **controls})
    assert state == "done", driver.find_element("id", "status").text
    body = {"max_tokens": MAX_TOKENS, "temperature": 0,
            **({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})}
    sent = driver.execute_script("return document.getElementById('request-json').textContent;")
    line, _, sent_body = sent.partition("\n")
    assert line == "POST " + ("v1/chat/completions" if chat else "v1/completions")
    assert json.loads(sent_body) == {**body, "stream": True, "stream_options": {"include_usage": True},
                                     "tokenfuse": {**options, "trace": True, "trace_k": 5}}
    ref = api(url, {**body, "tokenfuse": options})
    check_run(driver, ref, names)
    steps = ref["tokenfuse"]["trace"][0]["steps"]
    assert kinds <= {expected_kind(s) for s in steps}
    check_topk(driver, ref, 0, names)
    check_topk(driver, ref, len(steps) - 1, names)
    if case == "unite-weights":  # C is silent: it does not run, and its table says so
        assert not steps[0]["members"][2]["computed"]
        assert "did not run" in driver.find_element("css selector", '#topk table[data-member="C"] caption').text
    # nothing loaded from anywhere but this server (no CDN)
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(r => r.name);")
    assert resources and all(r.startswith(url) for r in resources), resources
    shot = tmp_path / f"playground-{case}.png"
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_playground_with_api_key(driver, make_tiny, align_cache, tmp_path):
    # a model with itself: every step agreed (the page shows the "agreed" kind)
    twins = Ensemble([make_tiny("smollm2", seed=0, name="A"), make_tiny("smollm2", seed=0, name="A2")],
                     align_cache=align_cache)
    app = create_app(twins, settings=ServerSettings(api_key="sekrit", max_tokens=256))
    with serving(app) as url:
        with httpx.Client(trust_env=False) as c:
            assert c.get(url).status_code == 200  # the page loads without the key
            assert c.get(url + "playground/playground.js").status_code == 200
            assert c.get(url + "v1/models").status_code == 401
        driver.get(url)
        wait_for(driver, "return document.getElementById('status').classList.contains('error');", 30)
        assert "API key" in driver.find_element("id", "status").text
        assert driver.execute_script("return document.body.dataset.connected;") == "false"
        fill(driver, "api-key", "wrong")
        driver.find_element("id", "connect").click()
        wait_for(driver, "return document.getElementById('status').textContent.includes('incorrect API key');", 30)
        assert driver.execute_script("return document.body.dataset.connected;") == "false"
        fill(driver, "api-key", "sekrit")
        driver.find_element("id", "connect").click()
        wait_for(driver, "return document.body.dataset.connected === 'true';", 30)
        state = run_in_page(driver, prompt=PROMPT, controls={"max-tokens": str(MAX_TOKENS), "temperature": "0",
                                                             "chat": False})
        assert state == "done", driver.find_element("id", "status").text
        ref = api(url, {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}, key="sekrit")
        check_run(driver, ref, ["A", "A2"])
        assert {p["kind"] for p in pieces(driver)} == {"agreed"}
        assert driver.save_screenshot(str(tmp_path / "playground-key.png"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_playground_command_opens_the_page(driver, ens, monkeypatch, capsys):
    """``tokenfuse playground``: serves, then prints the URL and opens it (here: in the test's Chromium)."""
    import webbrowser

    import uvicorn

    import tokenfuse.load
    import tokenfuse.server
    from tokenfuse.cli import main

    servers, opened = [], []

    def serve(ensemble, *, config, settings, host, port):  # the real app on uvicorn, with a handle to stop it
        app = create_app(ensemble, config=config, settings=settings)
        servers.append(uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")))
        servers[0].run()

    def open_page(page_url):  # the browser: load the page, see it connect, then stop the server
        try:
            driver.get(page_url)
            wait_for(driver, "return document.body.dataset.connected === 'true';", 30)
            opened.append((page_url, driver.find_element("id", "model-info").text))
        finally:
            servers[0].should_exit = True
        return True

    monkeypatch.setattr(tokenfuse.load, "load_ensemble", lambda cfg, progress=True: ens)
    monkeypatch.setattr(tokenfuse.server, "serve", serve)
    monkeypatch.setattr(webbrowser, "open", open_page)
    port = free_port()
    assert main(["playground", "--models", "A,B,C", "--port", str(port), "--quiet"]) == 0
    url = f"http://127.0.0.1:{port}/"
    assert opened == [(url, "tokenfuse: A + B + C · gac")]
    assert capsys.readouterr().out.splitlines() == [f"tokenfuse playground: {url}"]


def test_playground_command_port_in_use(capsys):
    from tokenfuse.cli import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["playground", "--models", "A,B,C", "--port", str(port), "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tokenfuse: error: --port: cannot listen on 127.0.0.1:{port} (") and "\n" not in err
    assert err.endswith("choose another --port")
