"""The playground in a real browser: Debian's headless Chromium against a live uvicorn server.

The tiny random model and a temporary database keep it quick; what is checked is the browser
side (htmx swaps, the SSE extension, out-of-band swaps, responseHandling for 400 fragments).
Needs the Debian packages chromium + chromium-driver and selenium from PyPI; skipped without
(failed in CI: tests/headless_chromium.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from headless_chromium import chromium, require_chromium
from live_server import runs_recorder, serving

from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

pytestmark = pytest.mark.slow

SCREENSHOT = Path(tempfile.gettempdir()) / "batchscope-playground.png"
WAIT = 30  # seconds

require_chromium()

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    """uvicorn on 127.0.0.1 with a free port, in a thread; yields the base URL and the app."""

    db_dir = tmp_path_factory.mktemp("browser")

    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model),
                     recorder_factory=runs_recorder(db_dir / "runs.db"))
    with serving(app, WAIT) as url:
        yield url, app


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


@pytest.fixture(scope="module")
def server(live) -> str:
    return live[0]


def wait(driver, condition, timeout: float = WAIT):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def fill(driver, name: str, value: str) -> None:
    field = driver.find_element(By.NAME, name)
    field.clear()
    field.send_keys(value)


# Record the first panel's text length at every DOM change, to see it grow token by token.
WATCH_GROWTH = """
window.__lengths = [];
new MutationObserver(() => {
  const out = document.querySelector('#results pre.output');
  if (out) window.__lengths.push(out.textContent.length);
}).observe(document.getElementById('results'), {childList: true, subtree: true,
                                                 characterData: true});
"""


def test_playground_streams_a_run_and_links_to_the_saved_run(server, browser):
    browser.get(server + "/")
    assert browser.title.startswith("Playground")
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=raw]").click()
    fill(browser, "prompt", "Once upon a time")
    fill(browser, "max_tokens", "300")
    browser.find_element(By.NAME, "ignore_eos").click()
    browser.execute_script(WATCH_GROWTH)
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()

    reason = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-stat=finish_reason]"))
    assert reason[0].text == "length"
    lengths = browser.execute_script("return window.__lengths")
    growth = sorted(set(lengths))
    # Tokens arrived over many swaps, not all at once.
    assert len(growth) >= 5 and growth[0] < growth[-1], growth
    panel = browser.find_element(By.CSS_SELECTOR, "section.panel")
    run_id = panel.get_attribute("data-run-id")
    stat = {dd.get_attribute("data-stat"): dd.text
            for dd in panel.find_elements(By.CSS_SELECTOR, "dd[data-stat]")}
    assert stat["tokens"] == "300" and stat["ttft"].endswith(" ms")
    assert float(stat["tokens_per_s"]) > 0
    # The stop button went away out of band with the finish.
    assert not panel.find_elements(By.CSS_SELECTOR, "button.stop")
    streamed = panel.find_element(By.CSS_SELECTOR, "pre.output").get_attribute("textContent")
    browser.save_screenshot(str(SCREENSHOT))

    panel.find_element(By.LINK_TEXT, "saved run →").click()
    wait(browser, lambda d: d.current_url.endswith(f"/runs/{run_id}"))
    wait(browser, lambda d: d.find_elements(By.ID, "output"))
    saved = browser.find_element(By.ID, "output").get_attribute("textContent")
    # The browser turns a carriage return in markup into a newline; nothing else may differ.
    assert saved.replace("\r", "\n") == streamed.replace("\r", "\n")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.timeline tbody tr")
    assert len(rows) == 300

    browser.get(server + "/runs")
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-run-id='{run_id}']")
    assert row.find_element(By.CSS_SELECTOR, "[data-col=completion_tokens]").text == "300"
    assert row.find_element(By.CSS_SELECTOR, "[data-col=finish_reason]").text == "length"


def test_copies_share_one_stream_and_all_finish(server, browser):
    browser.get(server + "/")
    fill(browser, "prompt", "three at once")
    fill(browser, "max_tokens", "40")
    fill(browser, "copies", "3")
    browser.find_element(By.NAME, "ignore_eos").click()
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR,
                                                "[data-stat=finish_reason]")) == 3)
    panels = browser.find_elements(By.CSS_SELECTOR, "section.panel")
    assert len(panels) == 3
    for panel in panels:
        assert panel.find_element(By.CSS_SELECTOR, "dd[data-stat=tokens]").text == "40"
        assert not panel.find_elements(By.CSS_SELECTOR, "button.stop")


def test_stop_button_cancels(live, browser):
    server, app = live
    engine = app.state.engine
    # Slow every step down so the run is surely still going when the button is clicked.
    engine.before_forward = lambda scheduled: time.sleep(0.01)
    try:
        stop_a_run(server, browser)
    finally:
        engine.before_forward = None


def stop_a_run(server: str, browser) -> None:
    browser.get(server + "/")
    fill(browser, "prompt", "stop me")
    fill(browser, "max_tokens", "480")
    browser.find_element(By.NAME, "ignore_eos").click()
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "button.stop"))
    browser.find_element(By.CSS_SELECTOR, "button.stop").click()
    reason = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-stat=finish_reason]"))
    assert reason[0].text == "cancelled"


def test_bad_input_shows_the_error_fragment(server, browser):
    browser.get(server + "/")
    fill(browser, "prompt", "fine")
    fill(browser, "temperature", "warm")
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()
    errors = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".form-errors li"))
    assert "temperature must be a number" in errors[0].text
