"""Security: the API key (Bearer for the API, a login for the pages), the CSRF rule, escaping.

The app runs on the tiny random model. For the escaping tests its tokenizer decodes every
output token to an HTML payload, so the model's *output* is hostile too, on every path it takes
(SSE fragments, the recorder, the database, the pages).
"""

from __future__ import annotations

import logging
import time

import pytest
from bs4 import BeautifulSoup
from starlette.routing import Route
from starlette.testclient import TestClient

from app.cli.serve import settings_from_args
from app.db import Recorder
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.divergence import lab_for
from app.web.security import COOKIE, csrf_problem, exposure_warning, safe_next
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model, tiny_model_saying

KEY = "k3y-for-tests-only"
ORIGIN = "http://testserver"  # TestClient's own origin
SAME = {"origin": ORIGIN}
EVIL = {"origin": "http://evil.example"}
BEARER = {"authorization": f"Bearer {KEY}"}
HTML = {"accept": "text/html,application/xhtml+xml"}
JSON = {"accept": "application/json"}
PAYLOADS = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>"]
PROMPT = PAYLOADS[0] + " and " + PAYLOADS[1]
OUTPUT = "<img src=x onerror=alert(1)><script>alert(1)</script>"  # every output token's text


# Each token decodes to OUTPUT: whatever the model picks, its text is an XSS payload.
payload_model = tiny_model_saying(OUTPUT)


def make_app(api_key: str | None = None, recorder=None, loader=tiny_model,
             divergence_loader=None):
    return create_app(Settings(engine=EngineConfig(num_kv_blocks=128), api_key=api_key),
                      engine_factory=lambda config: Engine(config, loader=loader),
                      recorder_factory=(lambda settings: recorder) if recorder else None,
                      divergence_loader=divergence_loader)


@pytest.fixture(scope="module")
def open_client():
    with TestClient(make_app()) as c:
        yield c


@pytest.fixture(scope="module")
def keyed():
    with TestClient(make_app(KEY)) as c:
        yield c


def assert_openai_401(r, code: str) -> None:
    assert r.status_code == 401, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code
    assert r.headers["www-authenticate"] == "Bearer"


def login(client, key: str = KEY, next_url: str = "/"):
    return client.post("/login", data={"key": key, "next": next_url}, headers=SAME,
                       follow_redirects=False)


# ---- settings and the command line -----------------------------------------------------------
def test_serve_binds_loopback_and_has_no_key_by_default():
    from app.cli import build_parser

    args = build_parser().parse_args(["serve"])
    settings = settings_from_args(args, environ={})
    assert settings.host == "127.0.0.1" and settings.api_key is None


def test_api_key_from_flag_or_environment_and_never_in_repr():
    from app.cli import build_parser

    parse = build_parser().parse_args
    env = {"BATCHSCOPE_API_KEY": "from-env"}
    assert settings_from_args(parse(["serve"]), environ=env).api_key == "from-env"
    flagged = settings_from_args(parse(["serve", "--api-key", "from-flag"]), environ=env)
    assert flagged.api_key == "from-flag"
    assert "from-flag" not in repr(flagged)
    with pytest.raises(ValueError):
        Settings(api_key="  ")


@pytest.mark.parametrize("host,key,warns", [
    ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False),
    ("127.0.0.2", None, False), ("0.0.0.0", None, True), ("::", None, True),
    ("192.168.1.5", None, True), ("myhost.example", None, True), ("0.0.0.0", "k", False),
])
def test_exposure_warning(host, key, warns):
    assert (exposure_warning(host, key) is not None) == warns


def test_serve_logs_the_warning_when_exposed_without_a_key(monkeypatch, caplog, tmp_path):
    import uvicorn

    from app.cli import main

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append(kw))
    monkeypatch.delenv("BATCHSCOPE_API_KEY", raising=False)
    db = str(tmp_path / "runs.db")
    with caplog.at_level(logging.WARNING, logger="batchscope"):
        assert main(["serve", "--host", "0.0.0.0", "--db", db]) == 0
    assert ran and ran[0]["host"] == "0.0.0.0"
    assert any("without an API key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchscope"):
        assert main(["serve", "--host", "0.0.0.0", "--db", db, "--api-key", "k"]) == 0
        assert main(["serve", "--db", db]) == 0
    assert not any("without an API key" in r.getMessage() for r in caplog.records)


# ---- without a key: open, as before -----------------------------------------------------------
def test_without_a_key_nothing_asks_for_one(open_client):
    assert open_client.get("/v1/models").status_code == 200
    assert open_client.get("/", headers=HTML).status_code == 200
    assert open_client.get("/metrics").status_code == 200
    r = open_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert open_client.get("/login", follow_redirects=False).headers["location"] == "/"


# ---- with a key: the API ----------------------------------------------------------------------
@pytest.mark.parametrize("headers,code", [
    ({}, "missing_api_key"),
    ({"authorization": "Bearer wrong"}, "invalid_api_key"),
    ({"authorization": f"Bearer {KEY}x"}, "invalid_api_key"),
    ({"authorization": f"Basic {KEY}"}, "invalid_api_key"),
    ({"authorization": "Bearer "}, "invalid_api_key"),
])
def test_api_needs_the_bearer_key(keyed, headers, code):
    assert_openai_401(keyed.get("/v1/models", headers=headers), code)
    assert_openai_401(keyed.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                 headers=headers), code)


def test_api_with_the_key_works_even_from_a_foreign_origin(keyed):
    assert keyed.get("/v1/models", headers=BEARER).status_code == 200
    # Bearer-authenticated: not a cookie a forged request could borrow, so no origin check.
    r = keyed.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={**BEARER, **EVIL})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_api_does_not_take_the_session_cookie(keyed):
    cookie = login(keyed).cookies[COOKIE]
    try:
        r = keyed.get("/v1/models", cookies={COOKIE: cookie})
        assert_openai_401(r, "missing_api_key")
    finally:
        keyed.cookies.clear()


@pytest.mark.parametrize("path", ["/runs.json", "/dashboard.json", "/steps.json", "/metrics",
                                  "/divergence.json", "/calibration.json", "/dashboard/stream",
                                  "/runs/x/stream", "/"])
def test_json_twins_metrics_and_streams_need_the_key(keyed, path):
    assert_openai_401(keyed.get(path, headers=JSON), "missing_api_key")
    if not path.endswith("stream"):  # a stream would not end
        assert keyed.get(path, headers={**BEARER, **JSON}).status_code in (200, 503)


def test_static_assets_and_the_login_form_stay_public(keyed):
    assert keyed.get("/static/app.css").status_code == 200
    form = BeautifulSoup(keyed.get("/login").text, "html.parser").find("form")
    assert form["method"] == "post" and form["action"] == "/login"
    assert form.find("input", attrs={"name": "key"})["type"] == "password"


# ---- with a key: the pages and the login ------------------------------------------------------
def test_pages_redirect_to_the_login_keeping_the_target(keyed):
    r = keyed.get("/runs?q=a b", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fruns%3Fq%3Da%2520b"
    page = BeautifulSoup(keyed.get(r.headers["location"]).text, "html.parser")
    assert page.find("input", attrs={"name": "next"})["value"] == "/runs?q=a%20b"


def test_htmx_post_without_login_is_sent_to_the_login(keyed):
    r = keyed.post("/playground", data={"prompt": "x"}, headers={**SAME, "hx-request": "true"})
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/login"


def test_login_sets_a_safe_session_cookie_and_logout_ends_it(keyed):
    keyed.cookies.clear()
    r = login(keyed, next_url="/runs")
    assert r.status_code == 303 and r.headers["location"] == "/runs"
    set_cookie = r.headers["set-cookie"]
    flags = [p.strip().lower() for p in set_cookie.split(";")]
    assert "httponly" in flags and "samesite=lax" in flags and "path=/" in flags
    assert any(f.startswith("max-age=") for f in flags)
    token = r.cookies[COOKIE]
    assert KEY not in set_cookie and len(token) >= 32
    try:
        page = keyed.get("/", headers=HTML)
        assert page.status_code == 200
        logout = BeautifulSoup(page.text, "html.parser").find("form", class_="logout")
        assert logout["action"] == "/logout" and logout["method"] == "post"
        assert keyed.get("/runs.json").status_code in (200, 503)  # the twin, by cookie
        r = keyed.post("/logout", headers=SAME, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/login"
        assert COOKIE in r.headers["set-cookie"] and "max-age=0" in r.headers["set-cookie"].lower()
    finally:
        keyed.cookies.clear()
    # The old token is dead on the server, not just deleted in this browser.
    r = keyed.get("/", headers=HTML, cookies={COOKIE: token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")


def test_wrong_key_or_forged_cookie_gets_no_session(keyed):
    keyed.cookies.clear()
    r = login(keyed, key="wrong")
    assert r.status_code == 401 and COOKIE not in r.cookies
    assert "wrong key" in r.text
    r = keyed.get("/", headers=HTML, cookies={COOKIE: "forged"}, follow_redirects=False)
    assert r.status_code == 303


def test_login_refuses_cross_site_posts_and_open_redirects(keyed):
    keyed.cookies.clear()
    r = keyed.post("/login", data={"key": KEY}, headers=EVIL, follow_redirects=False)
    assert r.status_code == 403 and COOKIE not in r.cookies
    r = login(keyed, next_url="//evil.example/x")
    assert r.headers["location"] == "/"
    keyed.cookies.clear()
    for target in ["https://evil.example", "/\\evil.example", "javascript:alert(1)", "", None,
                   "/ok\r\nSet-Cookie: x=1"]:
        assert safe_next(target) == "/"
    assert safe_next("/runs/abc?x=1") == "/runs/abc?x=1"


# ---- CSRF (the default, keyless server) -------------------------------------------------------
def state_changing_routes(app) -> list[tuple[str, str]]:
    """Every (method, path) of the app that is not GET/HEAD, path parameters filled in."""
    found = []
    for route in app.routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or set()) - {"GET", "HEAD"}):
            path = route.path
            for name in route.param_convertors:
                path = path.replace("{" + name + "}", "x").replace("{" + name + ":path}", "x")
            found.append((method, path))
    return found


def test_every_state_changing_route_refuses_a_cross_site_form(open_client):
    routes = state_changing_routes(open_client.app)
    paths = {p for _, p in routes}
    # The ones known today; anything added later is covered by the loop as well.
    assert {"/playground", "/runs/x/cancel", "/divergence", "/divergence.json", "/login",
            "/logout", "/v1/completions", "/v1/chat/completions"} <= paths, paths
    for method, path in routes:
        for headers in (EVIL, {"origin": "null"}, {"origin": "http://testserver:8001"},
                        {"referer": "http://evil.example/page"}, {}):
            r = open_client.request(method, path, data={"prompt": "x"}, headers=headers)
            assert r.status_code == 403, (method, path, headers, r.status_code)
            assert "cross-origin" in r.text, r.text


def test_cross_site_posts_change_nothing(open_client):
    app = open_client.app
    before = len(app.state.live_runs)
    r = open_client.post("/playground", data={"mode": "raw", "prompt": "x", "max_tokens": "2"},
                         headers={**EVIL, "accept": "text/html"})
    assert r.status_code == 403 and "cross-origin" in BeautifulSoup(r.text, "html.parser").text
    assert len(app.state.live_runs) == before
    r = open_client.post("/divergence.json", data={"prompt": "x"}, headers=EVIL)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    assert lab_for(app).recent() == []


def test_same_origin_posts_pass(open_client):
    form = {"mode": "raw", "prompt": "x", "max_tokens": "2"}
    for headers in (SAME, {"referer": ORIGIN + "/"}, {"origin": ORIGIN, "referer": ORIGIN + "/"}):
        r = open_client.post("/playground", data=form, headers={**headers, **JSON})
        assert r.status_code == 200, (headers, r.text)
        [run] = r.json()["runs"]
        r = open_client.post(f"/runs/{run['id']}/cancel", headers={**headers, **JSON})
        assert r.status_code == 200, r.text


def test_scripts_without_origin_pass_with_json_or_an_authorization_header(open_client):
    body = {"prompt": "hi", "max_tokens": 2}
    assert open_client.post("/v1/completions", json=body).status_code == 200
    # OpenAI clients send a Bearer header even to a keyless server.
    r = open_client.post("/v1/completions", json=body, headers={"authorization": "Bearer x",
                                                               **EVIL})
    assert r.status_code == 200
    # A browser page could send this text/plain body cross-site: its Origin gives it away.
    r = open_client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                         headers={"content-type": "text/plain", **EVIL})
    assert r.status_code == 403


def test_csrf_rule_unit():
    def check(scheme="http", **headers):
        from starlette.datastructures import Headers

        raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
        return csrf_problem({"scheme": scheme}, Headers(raw=raw))

    assert check(host="a:8000", origin="http://a:8000") is None
    assert check(host="A:8000", origin="http://a:8000") is None
    assert check(host="a", origin="http://a:80") is None
    assert check(scheme="https", host="a", origin="https://a") is None
    assert check(host="a:8000", origin="http://a:8001") is not None
    assert check(host="a:8000", origin="http://b:8000") is not None
    assert check(host="a:8000", origin="http://a:8000.evil") is not None
    assert check(host="[::1]:8000", origin="http://[::1]:8000") is None
    assert check(host="a:8000", referer="http://a:8000/x?y") is None
    assert check(host="a:8000", referer="http://a:8000@evil/") is not None
    assert check(origin="http://a:8000") is not None  # no Host: nothing to match
    assert check(host="a", content_type="multipart/form-data; boundary=x") is not None
    assert check(host="a", content_type="Text/Plain") is not None
    assert check(host="a", content_type="application/json") is None
    assert check(host="a") is None  # no body type: not a form


def test_security_headers(open_client):
    for path in ["/", "/v1/models", "/static/app.css"]:
        h = open_client.get(path).headers
        assert "script-src 'self'" in h["content-security-policy"], path
        assert "frame-ancestors 'none'" in h["content-security-policy"]
        assert h["x-content-type-options"] == "nosniff" and h["x-frame-options"] == "DENY"
    assert "content-security-policy" in open_client.post("/playground", headers=EVIL).headers


# ---- XSS: hostile prompts and hostile model output --------------------------------------------
@pytest.fixture(scope="module")
def hostile(db_module):
    recorder = Recorder(db_module, flush_interval=0.01)
    recorder.start()
    with TestClient(make_app(recorder=recorder, loader=payload_model,
                             divergence_loader=payload_model), headers=SAME) as c:
        yield c, recorder


@pytest.fixture(scope="module")
def db_module(tmp_path_factory):
    from app.db import open_database

    database = open_database(tmp_path_factory.mktemp("security") / "runs.db")
    yield database
    database.close()


def assert_escaped(response, *, shows=(PROMPT,)) -> BeautifulSoup:
    """No payload verbatim in the markup; the text shows it; no element it could have made."""
    assert response.status_code in (200, 202, 400, 404), response.text[:300]
    assert response.headers["content-type"].startswith("text/html")
    for payload in PAYLOADS + [OUTPUT]:
        assert payload not in response.text, payload
    page = BeautifulSoup(response.text, "html.parser")
    text = page.get_text()
    for shown in shows:
        assert shown in text, shown
    assert page.find("img") is None
    assert all(s.get("src") or s.get("type") == "application/json"
               for s in page.find_all("script"))
    assert not [el for el in page.find_all(True) if any(a.startswith("on") for a in el.attrs)]
    return page


def test_hostile_prompt_and_output_are_escaped_on_every_page(hostile):
    client, recorder = hostile
    r = client.post("/playground", data={"mode": "raw", "prompt": PROMPT, "max_tokens": "3",
                                         "copies": "2", "ignore_eos": "1"})
    assert r.status_code == 200
    ids = [p["data-run-id"] for p in BeautifulSoup(r.text, "html.parser")("section")]
    assert len(ids) == 2
    stream = client.get(f"/runs/{ids[0]}/stream?with={ids[1]}")
    assert stream.status_code == 200
    events = [block.split("\n", 1) for block in stream.text.split("\n\n")
              if block.startswith("event: ")]
    fragments = [data.replace("data: ", "") for _, data in events]
    for data in fragments:
        for payload in PAYLOADS + [OUTPUT]:
            assert payload not in data, data
        fragment = BeautifulSoup(data, "html.parser")
        assert fragment.find("img") is None and fragment.find("script") is None
    streamed = "".join(BeautifulSoup(data, "html.parser").get_text()
                       for name, data in events if name == f"event: token-{ids[0]}")
    assert streamed.replace("data: ", "") == OUTPUT * 3  # the output was streamed, as text
    assert recorder.flush()

    run_id = ids[0]
    both = (PROMPT, OUTPUT)
    assert_escaped(client.get(f"/runs/{run_id}"), shows=both)
    assert_escaped(client.get("/runs"), shows=[OUTPUT[:20]])  # previews are clipped
    assert_escaped(client.get("/runs", params={"q": PAYLOADS[0]}), shows=[PAYLOADS[0]])
    assert_escaped(client.get(f"/compare?a={ids[0]}&b={ids[1]}"), shows=both)
    # A finished run's stream is replayed from the database.
    replay = client.get(f"/runs/{run_id}/stream")
    for payload in PAYLOADS + [OUTPUT]:
        assert payload not in replay.text
    assert OUTPUT in BeautifulSoup(replay.text, "html.parser").get_text()


def test_hostile_input_in_errors_is_escaped(hostile):
    client, _ = hostile
    r = client.post("/playground", data={"prompt": "x", "temperature": PAYLOADS[1]})
    assert r.status_code == 400
    assert_escaped(r, shows=[PAYLOADS[1][:40]])
    assert_escaped(client.get("/runs/" + PAYLOADS[1]), shows=[PAYLOADS[1]])  # no "/" in it
    assert_escaped(client.get("/compare", params={"a": PAYLOADS[1], "b": "y"}),
                   shows=[PAYLOADS[1]])
    assert_escaped(client.get("/divergence", params={"id": PAYLOADS[0]}), shows=[PAYLOADS[0]])
    r = client.post("/divergence", data={"prompt": PROMPT, "max_tokens": "x"})
    assert_escaped(r, shows=[])
    assert PROMPT in BeautifulSoup(r.text, "html.parser").find("textarea").get_text()


def test_hostile_divergence_experiment_is_escaped(hostile):
    client, _ = hostile
    form = {"prompt": PROMPT, "max_tokens": "3", "top_k": "2", "a_weights": "q4",
            "b_weights": "q4", "a_policy": "gemm", "b_policy": "gemv"}
    r = client.post("/divergence.json", data=form)
    assert r.status_code == 202, r.text
    exp_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while client.get(f"/divergence.json?id={exp_id}").json()["experiment"]["status"] in (
            "queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    entry = client.get(f"/divergence.json?id={exp_id}").json()["experiment"]
    assert entry["status"] == "done", entry
    assert_escaped(client.get(f"/divergence?id={exp_id}"), shows=[PROMPT, OUTPUT])
    assert_escaped(client.get("/divergence"), shows=[PAYLOADS[0]])  # the recent list


# ---- the Host check (DNS rebinding) ----------------------------------------------------------
@pytest.mark.parametrize("argv,expected", [
    (["serve"], ()),  # keyless on loopback: loopback names only
    (["serve", "--api-key", "k"], None),  # the key protects it
    (["serve", "--host", "0.0.0.0"], None),  # exposed on purpose (and warned about)
    (["serve", "--allowed-host", "Box.Lan", "--allowed-host", "x"], ("box.lan", "x")),
])
def test_serve_turns_the_host_check_on_for_a_keyless_loopback_server(argv, expected):
    from app.cli import build_parser

    settings = settings_from_args(build_parser().parse_args(argv), environ={})
    assert settings.allowed_hosts == expected


def test_a_keyless_loopback_server_answers_to_loopback_names_only():
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=64), allowed_hosts=("box.lan",)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "box.lan:8000"):
            assert client.get("/runs.json", headers={"host": host}).status_code in (200, 503)
        # A domain its owner points at 127.0.0.1: the browser thinks it is same-origin.
        for path, headers in (("/runs.json", {}), ("/", HTML), ("/v1/models", {})):
            r = client.get(path, headers={"host": "rebind.evil.example:8000", **headers})
            assert r.status_code == 403, (path, r.text)
            assert "DNS rebinding" in r.text
        r = client.post("/v1/completions", headers={"host": "rebind.evil.example:8000",
                                                    "origin": "http://rebind.evil.example:8000"},
                        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
