"""Debian's headless Chromium for the tests that judge pages (the playground, reports, saved notebooks).

Each browser gets its own temporary folder, removed when it quits: Chromium puts its singleton socket in a folder of
TMPDIR and, quit by its driver, does not always remove it (every report test run left two in /tmp). The folder's
name is short, as a socket address must be (the mutation runner's scratch TMPDIR is too long for one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
HEADLESS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-proxy-server")


@contextlib.contextmanager
def chromium(*arguments: str, logs: tuple[str, ...] = ("browser",)) -> Iterator[Any]:
    """A headless Chromium driven by Selenium, with ``arguments`` after the headless ones and ``logs`` recorded."""
    missing = [path for path in (CHROMIUM, DRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"these tests need Debian's Chromium and its driver ({', '.join(missing)} missing): run "
                    "scripts/setup.sh --test, or apt-get install chromium chromium-driver", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in HEADLESS + arguments:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", dict.fromkeys(logs, "ALL"))
    folder = tempfile.mkdtemp(prefix="nbexec-chromium-", dir="/tmp")
    try:
        driver = webdriver.Chrome(options=options, service=Service(DRIVER, env={**os.environ, "TMPDIR": folder}))
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
