"""The playground page at `/`, in a real headless browser (Debian's Chromium, driven by Selenium), against a real
`nbexec serve` process on a loopback port and real sandboxes.

Set NBEXEC_PLAYGROUND_SCREENSHOT=docs/playground.png to refresh the screenshot in docs/http-service.md from this
run.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .browser import chromium
from .conftest import wait_until
from .security.test_service import TOKEN_A, Served, assert_nothing_left, start_serve, stop

FINISHED = ("done", "error", "failed", "stopped")
MAIN = """import matplotlib.pyplot as plt

print("hello from the sandbox")
plt.plot([1, 4, 2, 5])
plt.title("a chart")
plt.show()
with open("/mnt/data/hello.txt", "w") as f:
    f.write("made in the sandbox")"""
FAILING = "def ratio(a, b):\n    return a / b\n\nratio(1, 0)"


@pytest.fixture(scope="module")
def served(docker_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = start_serve(tmp_path_factory.mktemp("playground"), env={"NBEXEC_TIMEOUT": "60"})
    try:
        yield server
    finally:
        stop(server)
    assert_nothing_left(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium("--window-size=1100,1250") as driver:
        yield driver


def _text(driver: Any, selector: str) -> str:
    found = driver.find_elements("css selector", selector)
    return "\n".join(element.text for element in found)


def _status(driver: Any) -> str:
    return str(driver.find_element("id", "status").get_attribute("data-state"))


def _run(driver: Any, code: str) -> Any:
    """Put ``code`` in the editor, press Run, wait for the run to finish; return its output block."""
    before = len(driver.find_elements("css selector", "article.run"))
    driver.execute_script("document.getElementById('code').value = arguments[0];", code)
    driver.find_element("id", "run").click()
    wait_until(lambda: len(driver.find_elements("css selector", "article.run")) > before, 30, "the run never began")
    wait_until(lambda: _status(driver) in FINISHED, 120, "the run never finished")
    return driver.find_elements("css selector", "article.run")[0]


def _connect(driver: Any, token: str) -> None:
    field = driver.find_element("id", "token")
    field.clear()
    field.send_keys(token)
    driver.find_element("id", "connect").click()
    wait_until(lambda: _status(driver) in ("idle", "failed"), 60, "connecting never finished")


def test_the_page_is_public_and_locked_down(served: Served) -> None:
    page = httpx.get(f"{served.url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self';" in policy and "unsafe" not in policy
    assert "frame-ancestors 'none'" in policy and page.headers["x-content-type-options"] == "nosniff"
    assert '<script src="/playground.js" defer></script>' in page.text
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), "an inline script"
    script = httpx.get(f"{served.url}/playground.js", timeout=30)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text and "localStorage" not in script.text
    assert httpx.post(f"{served.url}/v1/sessions", timeout=30).status_code == 401  # the API still needs a token


def test_the_playground_runs_code_in_a_browser(served: Served, browser: Any, tmp_path: Path) -> None:
    browser.get(f"{served.url}/")
    assert browser.title == "nbexec playground"
    _connect(browser, "not-the-token-" + "x" * 20)
    assert _status(browser) == "failed" and "401" in _text(browser, "#status")
    _connect(browser, TOKEN_A)
    assert _status(browser) == "idle", _text(browser, "#status")
    session = _text(browser, "#session").removeprefix("session ")

    block = _run(browser, MAIN)
    assert _status(browser) == "done", _text(browser, "#status") + _text(browser, "article.run")
    assert "hello from the sandbox" in _text(block, "pre.stdout")
    image = block.find_element("css selector", "img")
    assert image.get_attribute("src").startswith("blob:")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) > 100
    link = block.find_element("css selector", "a.file")
    assert link.text == "hello.txt"
    href = link.get_attribute("href")
    assert href == f"{served.url}/v1/sessions/{session}/files/hello.txt"
    with served.client() as client:
        assert client.get(href).text == "made in the sandbox"
    shot = tmp_path / "playground.png"
    browser.save_screenshot(str(shot))
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("NBEXEC_PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["NBEXEC_PLAYGROUND_SCREENSHOT"])

    failed = _run(browser, FAILING)
    assert _status(browser) == "error"
    traceback = _text(failed, "pre.error")
    assert "ZeroDivisionError" in traceback and "ratio(1, 0)" in traceback and "return a / b" in traceback
    assert "\x1b[" not in traceback  # colour codes are stripped

    urls = browser.execute_script("return [location.href, ...performance.getEntries().map(e => e.name)]")
    assert urls and not any(TOKEN_A in url for url in urls), "the token appeared in a URL"
    problems = [entry["message"] for entry in browser.get_log("browser")
                if "Content Security Policy" in entry["message"]
                or (entry["level"] == "SEVERE" and "401" not in entry["message"])]
    assert problems == []


def test_stop_interrupts_a_streamed_run(served: Served, browser: Any) -> None:
    browser.get(f"{served.url}/")
    _connect(browser, TOKEN_A)
    session = _text(browser, "#session").removeprefix("session ")
    code = "import time\nprint('first', flush=True)\ntime.sleep(60)\nprint('never')"
    browser.execute_script("document.getElementById('code').value = arguments[0];", code)
    browser.find_element("id", "run").click()
    wait_until(lambda: "first" in _text(browser, "article.run:first-child pre.stdout"), 60,
               "the first line never streamed in")
    assert _status(browser) == "busy"  # shown while the cell still runs
    browser.find_element("id", "stop").click()
    wait_until(lambda: _status(browser) == "stopped", 30, "Stop did not end the stream")
    with served.client() as client:
        wait_until(lambda: client.get(f"/v1/sessions/{session}").json()["status"] == "ready", 30,
                   "the run went on after the page stopped it")
    block = _run(browser, "print('after')")
    assert _status(browser) == "done" and _text(block, "pre.stdout") == "after"
