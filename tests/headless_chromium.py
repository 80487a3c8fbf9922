"""Debian's headless Chromium through selenium, for the browser tests (tests/e2e/).

Outside CI a missing browser skips the module; in CI (CI set) it fails it, since a skip there
would pass without checking anything.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = "selenium and Debian's chromium + chromium-driver are needed (scripts/setup.sh)"


def require_chromium() -> Any:
    """selenium.webdriver, or a module-level skip (a RuntimeError in CI). Call at import."""
    if os.environ.get("CI"):
        from selenium import webdriver

        if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
            raise RuntimeError(MISSING)
        return webdriver
    webdriver = pytest.importorskip("selenium.webdriver", reason=MISSING)
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(MISSING, allow_module_level=True)
    return webdriver


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A headless Chromium driver with its profile in `profile` (removed afterwards)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM  # Debian's browser: never downloaded
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1280,1000"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
