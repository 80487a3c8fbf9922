"""Security in a real browser: the login, hostile prompts and model output, a cross-site post.

Debian's headless Chromium against a live uvicorn server with an API key. The tiny model's
tokenizer decodes every output token to an HTML payload, so both the prompt and the output
try to run script; the test checks that none ran and that they made no element, on the
playground (htmx + SSE swaps), the run page, the runs list and compare. A page on another
origin then posts the playground form to the server with the browser's session cookie.
Needs chromium + chromium-driver (tests/headless_chromium.py: skipped without, failed in CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from headless_chromium import chromium, require_chromium
from live_server import runs_recorder, serving
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from app.settings import Settings
from app.web.app import create_app
from app.web.security import COOKIE
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model_saying

pytestmark = pytest.mark.slow

require_chromium()

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT = 30  # seconds
KEY = "browser-test-key"
PROMPT = ("<script>window.__xss = 1; document.title = 'pwned'</script>"
          "<img src=x onerror=\"window.__xss = 2\">")
OUTPUT = "<img src=x onerror=\"window.__xss = 3\"><script>window.__xss = 4</script>"
TOKENS = 4


payload_model = tiny_model_saying(OUTPUT)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[str, Any]]:
    db_dir = tmp_path_factory.mktemp("browser-security")

    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128), api_key=KEY),
                     engine_factory=lambda config: Engine(config, loader=payload_model),
                     recorder_factory=runs_recorder(db_dir / "runs.db"))
    with serving(app, WAIT) as url:
        yield url, app


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def wait(driver, condition, timeout: float = WAIT):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


# What a payload would have left behind had it become markup or run.
TRACES = """
return {
  xss: window.__xss === undefined ? null : window.__xss,
  pwned: document.title === 'pwned',
  imgs: document.querySelectorAll('img').length,
  inline_scripts: [...document.scripts].filter(
      s => !s.src && s.type !== 'application/json').length,
  handlers: [...document.querySelectorAll('*')].filter(
      el => [...el.attributes].some(a => a.name.startsWith('on'))).length,
};
"""
CLEAN = {"xss": None, "pwned": False, "imgs": 0, "inline_scripts": 0, "handlers": 0}


def assert_clean(driver) -> None:
    assert driver.execute_script(TRACES) == CLEAN, driver.current_url


def text_of(driver, selector: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, selector).get_attribute("textContent")


def log_in(driver, server: str) -> None:
    driver.get(server + "/")
    wait(driver, lambda d: "/login" in d.current_url)
    driver.find_element(By.NAME, "key").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "form.login button[type=submit]").click()
    wait(driver, lambda d: d.current_url == server + "/")


def test_login_then_hostile_prompt_and_output_stay_text(live, browser):
    server, app = live
    log_in(browser, server)
    cookie = browser.get_cookie(COOKIE)
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Lax"
    assert browser.execute_script("return document.cookie") == ""  # not readable by script
    assert browser.find_elements(By.CSS_SELECTOR, "form.logout")

    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=raw]").click()
    browser.find_element(By.NAME, "prompt").send_keys(PROMPT)
    field = browser.find_element(By.NAME, "max_tokens")
    field.clear()
    field.send_keys(str(TOKENS))
    browser.find_element(By.NAME, "ignore_eos").click()
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()
    reason = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR,
                                                     "[data-stat=finish_reason]"))
    assert reason[0].text == "length"
    # The output arrived through htmx's SSE swaps, which would run a <script> in markup.
    assert text_of(browser, "section.panel pre.output") == OUTPUT * TOKENS
    assert_clean(browser)
    run_id = browser.find_element(By.CSS_SELECTOR, "section.panel").get_attribute("data-run-id")

    browser.find_element(By.LINK_TEXT, "saved run →").click()
    wait(browser, lambda d: d.current_url.endswith(f"/runs/{run_id}"))
    wait(browser, lambda d: d.find_elements(By.ID, "output"))
    assert text_of(browser, "#output") == OUTPUT * TOKENS
    assert text_of(browser, "pre.prompt") == PROMPT
    assert_clean(browser)

    for path in ["/runs", f"/runs?q={run_id}", f"/compare?a={run_id}&b={run_id}"]:
        browser.get(server + path)
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "main h1"))
        assert_clean(browser)
    assert PROMPT in text_of(browser, "table.compare-params")


def test_a_cross_site_form_post_is_refused_with_the_cookie_in_place(live, browser):
    server, app = live
    if browser.get_cookie(COOKIE) is None:
        log_in(browser, server)
    # Another origin (another port) whose page posts the playground form to the server. Same
    # site for the browser, so even a SameSite cookie goes along: the Origin check must stop it.
    evil_page = (f'<form id="f" method="post" action="{server}/playground">'
                 '<input name="mode" value="raw"><input name="prompt" value="forged">'
                 '<input name="max_tokens" value="2"><button type="submit">go</button></form>')
    evil = Starlette(routes=[Route("/", lambda request: HTMLResponse(evil_page))])
    before = len(app.state.live_runs)
    with serving(evil, WAIT) as evil_url:
        browser.get(evil_url + "/")
        browser.find_element(By.CSS_SELECTOR, "#f button").click()
        wait(browser, lambda d: d.current_url.startswith(server))
        message = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".error-message"))
        assert "cross-origin" in message[0].text
    assert len(app.state.live_runs) == before  # nothing started

    # The same form on the server's own page works (the browser sends the right Origin).
    browser.get(server + "/")
    browser.find_element(By.NAME, "prompt").send_keys("fine")
    browser.find_element(By.CSS_SELECTOR, "#playground button[type=submit]").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "section.panel"))
    assert len(app.state.live_runs) == before + 1


def test_logout_ends_the_session(live, browser):
    server, _ = live
    if browser.get_cookie(COOKIE) is None:
        log_in(browser, server)
    browser.get(server + "/")
    browser.find_element(By.CSS_SELECTOR, "form.logout button").click()
    wait(browser, lambda d: "/login" in d.current_url)
    assert browser.get_cookie(COOKIE) is None
    browser.get(server + "/runs")
    wait(browser, lambda d: "/login" in d.current_url)


def test_dashboard_shows_a_hostile_request_id_as_text(live, browser):
    """dashboard.js redraws the batch table from SSE frames: ids go in as text, not markup."""
    server, app = live
    if browser.get_cookie(COOKIE) is None:
        log_in(browser, server)
    from engine.sampling import SamplingParams

    engine = app.state.engine
    hostile_id = "<img src=x onerror=\"window.__xss = 5\">"
    engine.before_forward = lambda scheduled: __import__("time").sleep(0.02)
    handle = engine.submit("hi", SamplingParams(max_tokens=400, ignore_eos=True),
                           request_id=hostile_id)
    try:
        browser.get(server + "/dashboard")
        first = text_of(browser, "#sum-step")
        # Frames have come in and the table was redrawn by the script with the request in it.
        # (Read in one script call: the rows are replaced at every frame.)
        cell = wait(browser, lambda d: text_of(d, "#sum-step") != first and d.execute_script(
            "const td = document.querySelector('#batch-table tbody tr[data-request] td');"
            "return td && [td.title, td.textContent];"))
        assert cell == [hostile_id, hostile_id[:13] + "…"]
        assert_clean(browser)
    finally:
        handle.cancel()
        engine.before_forward = None
