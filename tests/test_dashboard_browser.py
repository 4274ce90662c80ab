"""The live page in a real headless browser (Debian's chromium driven by Playwright) over a real server.

It loads, its lanes appear and move while requests run, a click on a request shows its timeline,
and it survives the server restarting on the same port (EventSource reconnects). Skipped only where
chromium is not installed (`make install` installs it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("Debian's chromium is not installed (make install: apt-get install chromium)",
                allow_module_level=True)
from playwright import sync_api  # noqa: E402 - a test extra: missing, it is an install error

pytestmark = pytest.mark.timeout(120)
SERVER_FLAGS = ("--max-num-seqs", "4")  # fewer seats than clients: some wait, for max_num_seqs
WAIT_MS = 20_000


def start_server(model_dir: Path, log_path: Path, port: int) -> ServerProcess:
    """A ready server on `port` (the last --port wins, so a restart can take the same one)."""
    server = ServerProcess(model_dir, log_path, *SERVER_FLAGS, "--port", str(port))
    server.port, server.base_url = port, f"http://127.0.0.1:{port}"
    server.wait_ready()
    return server


class Load:
    """Completions from a few client threads until stopped, so lanes fill and move."""

    def __init__(self, base_url: str, num_clients: int = 6) -> None:
        self.base_url = base_url
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(num_clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                body = {"prompt": "tell me a story " * (2 + index * 5), "max_tokens": 24 + 8 * index,
                        "ignore_eos": True}
                try:
                    client.post(f"{self.base_url}/v1/completions", json=body)
                except httpx.HTTPError:
                    time.sleep(0.2)  # the server is restarting


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A server, a browser page on its dashboard, and how to restart the server."""
    from cobatch.testing.server import free_port

    logs = tmp_path_factory.mktemp("dashboard")
    state = {"port": free_port(), "logs": logs, "model": tiny_model_dir, "restarts": 0}
    state["server"] = start_server(tiny_model_dir, logs / "server-0.log", state["port"])
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{state['server'].base_url}/dashboard")
        state.update(page=page, errors=errors)
        try:
            yield state
        finally:
            browser.close()
            state["server"].stop()


def js(page, expression: str):
    return page.evaluate(f"() => {{ const d = window.cobatchDashboard; "
                         f"const r = d.view.replicas.get(d.view.current); return {expression}; }}")


def wait_js(page, expression: str) -> None:
    page.wait_for_function(f"() => {{ const d = window.cobatchDashboard; "
                           f"const r = d.view.replicas.get(d.view.current); return {expression}; }}",
                           timeout=WAIT_MS)


def wait_until_still(page, still_s: float = 0.6) -> None:
    """Until the page's newest step stays the same for `still_s`."""
    deadline = time.monotonic() + WAIT_MS / 1e3
    last = js(page, "r.steps[r.steps.length - 1].step")
    while time.monotonic() < deadline:
        time.sleep(still_s)
        step = js(page, "r.steps[r.steps.length - 1].step")
        if step == last:
            return
        last = step
    raise TimeoutError("the engine kept stepping")


def test_the_page_loads_and_goes_live(served: dict) -> None:
    page = served["page"]
    assert page.title().startswith("cobatch")
    wait_js(page, "d.view.connection === 'live' && d.view.boot !== null")
    assert "engine ready" in page.inner_text("#engine-state")
    assert not served["errors"]


def test_lanes_appear_and_move_while_requests_run(served: dict) -> None:
    page = served["page"]
    with Load(served["server"].base_url):
        wait_js(page, "r && r.steps.length > 5 && r.steps.some((s) => s.cells.filter(Boolean).length > 1)")
        first = js(page, "r.steps[r.steps.length - 1].step")
        wait_js(page, f"r.steps[r.steps.length - 1].step > {first} + 5")
        kinds = js(page, "[...new Set(r.steps.flatMap((s) => s.cells.filter(Boolean).map((c) => c.kind)))]")
        wait_js(page, "document.getElementById('t-why').textContent.includes('max_num_seqs')")
        painted = page.evaluate("""() => { const c = document.getElementById('metro');
            const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 0; i < data.length; i += 4) if (data[i + 1] < 200) n++; return n; }""")
    assert {"p", "d"} <= set(kinds), "prefill chunks and decode steps both reach the page"
    assert painted > 500, "the metro canvas is drawn"
    assert int(page.inner_text("#t-last")) > first
    assert not served["errors"]


def test_a_click_on_a_request_shows_its_timeline(served: dict) -> None:
    page = served["page"]
    with Load(served["server"].base_url):
        wait_js(page, "r && [...r.finished.keys()].some((id) => d.locate(id))")
    wait_until_still(page)  # an idle engine adds no steps: the lanes stay where the click lands
    request_id = js(page, "[...r.finished.keys()].reverse().find((id) => d.locate(id))")
    point = js(page, f"d.locate({request_id!r})")
    box = page.locator("#metro").bounding_box()
    page.mouse.click(box["x"] + point["x"], box["y"] + point["y"])
    page.wait_for_selector(f"#detail-body .seq[data-seq-id='{request_id}']", timeout=WAIT_MS)
    detail = page.inner_text("#detail-body")
    assert request_id in detail and "finished: length" in detail
    assert "prefill" in detail and "decode" in detail and "waiting" in detail
    assert "steps without a row" in detail
    assert not served["errors"]


def test_the_page_survives_the_server_restarting(served: dict) -> None:
    page = served["page"]
    old_boot = js(page, "d.view.boot")
    served["server"].stop()
    wait_js(page, "d.view.connection !== 'live'")
    served["server"] = start_server(served["model"], served["logs"] / "server-1.log", served["port"])
    wait_js(page, f"d.view.boot !== {old_boot!r} && d.view.connection === 'live'")
    with Load(served["server"].base_url, num_clients=2):
        wait_js(page, "r && r.steps.length > 3")
    assert js(page, "d.view.numHellos") >= 2
    assert not served["errors"]
