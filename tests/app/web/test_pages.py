"""The HTML pages and their JSON twins, on the tiny random model with a real SQLite database.

Pages are read with BeautifulSoup; every number checked on a page is compared with the JSON twin
through the same formatting functions the templates use.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

import pytest
from bs4 import BeautifulSoup
from starlette.testclient import TestClient

from app.db import Recorder, open_database
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.playground import parse_playground
from app.web.render import fmt_lp, fmt_ms, fmt_rate, visible
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.testing import tiny_model

SCRIPT = "<script>alert(1)</script>"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}]
JSON = {"accept": "application/json"}
# Form posts come from the page itself, as a browser's would (app/web/security.py's CSRF rule).
SAME_ORIGIN = {"origin": "http://testserver"}


def make_app(recorder_factory=None):
    return create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                      engine_factory=lambda config: Engine(config, loader=tiny_model),
                      recorder_factory=recorder_factory)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    database = open_database(tmp_path_factory.mktemp("pages") / "runs.db")
    yield database
    database.close()


@pytest.fixture(scope="module")
def recorder(db):
    rec = Recorder(db, flush_interval=0.01)
    rec.start()
    return rec  # closed by the app's lifespan


@pytest.fixture(scope="module")
def client(recorder):
    with TestClient(make_app(lambda settings: recorder), headers=SAME_ORIGIN) as c:
        yield c


# ---- helpers -------------------------------------------------------------------------------
def soup(response) -> BeautifulSoup:
    assert response.headers["content-type"].startswith("text/html"), response.text[:200]
    return BeautifulSoup(response.text, "html.parser")


def sse_events(response) -> list[tuple[str, str]]:
    """(event, data) pairs, checking the framing: blocks of `event:` then `data:` lines."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert "\r" not in body and body.endswith("\n\n")
    events = []
    for block in body[:-2].split("\n\n"):
        if block.startswith(":"):  # keep-alive ping
            continue
        first, *rest = block.split("\n")
        assert first.startswith("event: "), block
        assert rest and all(line.startswith("data: ") or line == "data:" for line in rest), block
        events.append((first[len("event: "):], "\n".join(line[6:] for line in rest)))
    assert events[-1][0] == "done"
    assert [name for name, _ in events].count("done") == 1
    return events


def play(client, **fields) -> list[str]:
    """Start playground run(s) and return their ids (JSON twin of the POST)."""
    form = {"mode": "raw", "prompt": "hello", "max_tokens": "8", **fields}
    r = client.post("/playground", data=form, headers=JSON)
    assert r.status_code == 200, r.text
    return [run["id"] for run in r.json()["runs"]]


def finish(client, recorder, run_ids: list[str]) -> list[tuple[str, str]]:
    """Follow the runs' stream to its end, then wait until the recorder has written them."""
    url = f"/runs/{run_ids[0]}/stream" + "".join(f"{'&' if i else '?'}with={r}"
                                                 for i, r in enumerate(run_ids[1:]))
    events = sse_events(client.get(url))
    assert recorder.flush()
    return events


def streamed_text(events, run_id: str) -> str:
    return "".join(BeautifulSoup(data, "html.parser").get_text()
                   for name, data in events if name == f"token-{run_id}")


def last_stats(events, run_id: str) -> dict[str, str]:
    data = [d for name, d in events if name == f"stats-{run_id}"][-1]
    return {dd["data-stat"]: dd.get_text() for dd in BeautifulSoup(data, "html.parser")("dd")}


# ---- playground ----------------------------------------------------------------------------
def test_playground_page_has_the_form(client):
    page = soup(client.get("/"))
    form = page.find("form", id="playground")
    assert form["hx-post"] == "/playground" and form["hx-target"] == "#results"
    names = {el["name"] for el in form.find_all(["input", "textarea", "select"])}
    assert {"mode", "system", "prompt", "temperature", "top_p", "max_tokens", "seed", "stop",
            "copies", "ignore_eos", "speculative", "frequency_penalty",
            "presence_penalty", "json_schema", "tools", "tool_choice"} <= names
    assert [o.get_text() for o in form.find("select", attrs={"name": "tool_choice"})("option")] \
        == ["auto", "required", "none"]
    for box in ("json_schema", "tools"):  # where the page's script shows a box's bad JSON
        assert page.find(id=f"{box}-error") is not None
    assert page.find(id="results") is not None
    assert "tiny-llama" in page.get_text()
    srcs = [s["src"] for s in page.find_all("script")]
    assert srcs == ["/static/vendor/htmx-2.0.11.min.js", "/static/vendor/htmx-ext-sse-2.2.4.js",
                    "/static/playground.js"]
    for src in srcs + ["/static/app.css"]:
        assert client.get(src).status_code == 200


def test_playground_json_twin(client):
    body = client.get("/", headers=JSON).json()
    assert body["model"] == "tiny-llama" and body["max_copies"] == 8
    assert body["database"] is True


def test_submit_swaps_in_one_panel_per_copy_sharing_one_stream(client, recorder):
    r = client.post("/playground", data={"mode": "chat", "system": "be brief", "prompt": "hi",
                                         "max_tokens": "6", "copies": "3", "ignore_eos": "1"})
    assert r.status_code == 200
    frag = BeautifulSoup(r.text, "html.parser")
    [group] = frag.select("[sse-connect]")
    assert group["hx-ext"] == "sse" and group["sse-close"] == "done"
    panels = frag.select("section.panel")
    ids = [p["data-run-id"] for p in panels]
    assert len(ids) == 3 and len(set(ids)) == 3
    url = urlsplit(group["sse-connect"])
    assert url.path == f"/runs/{ids[0]}/stream"
    assert parse_qs(url.query)["with"] == ids[1:]
    for run_id, panel in zip(ids, panels, strict=True):
        assert panel.find(attrs={"sse-swap": f"token-{run_id}"})["hx-swap"] == "beforeend"
        assert panel.find(attrs={"sse-swap": f"stats-{run_id}"}) is not None
        assert panel.find(attrs={"sse-swap": f"end-{run_id}"}) is not None
        assert panel.find("button", class_="stop")["hx-post"] == f"/runs/{run_id}/cancel"

    events = finish(client, recorder, ids)
    for run_id in ids:
        saved = client.get(f"/runs/{run_id}.json").json()
        assert saved["source"] == "playground" and saved["endpoint"] == "/playground"
        assert saved["messages"] == [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hi"}]
        assert saved["completion_tokens"] == 6 and saved["finish_reason"] == "length"
        assert streamed_text(events, run_id) == saved["output_text"]
    # The copies shared the engine's steps: the run page lists the others as batch-mates.
    page = soup(client.get(f"/runs/{ids[0]}"))
    mates = {a.code.get_text() for a in page.select("td.mates a")}
    assert mates == set(ids[1:])


def test_stream_framing_text_and_final_stats_match_the_saved_run(client, recorder):
    [run_id] = play(client, prompt="stream me", max_tokens="10", ignore_eos="1")
    events = finish(client, recorder, [run_id])
    names = [name for name, _ in events]
    assert names.count(f"token-{run_id}") == 10
    assert names[-2:] == [f"end-{run_id}", "done"]
    saved = client.get(f"/runs/{run_id}.json").json()
    assert streamed_text(events, run_id) == saved["output_text"]
    stats = last_stats(events, run_id)
    assert stats == {"tokens": "10", "ttft": fmt_ms(saved["metrics"]["ttft"]),
                     "tokens_per_s": fmt_rate(saved["metrics"]["tokens_per_s"]),
                     "e2e": fmt_ms(saved["metrics"]["e2e_latency"])}
    end = BeautifulSoup(events[-2][1], "html.parser")
    assert end.find(attrs={"data-stat": "finish_reason"}).get_text() == "length"
    assert end.find("a", class_="saved")["href"] == f"/runs/{run_id}"
    # The stop button goes away out of band.
    assert end.find(id=f"stop-{run_id}")["hx-swap-oob"] == "true"
    # Each token fragment carries its logprob and alternatives for the hover.
    first = BeautifulSoup(events[0][1], "html.parser").span
    assert first["data-idx"] == "0"
    assert f"logprob {fmt_lp(saved['tokens'][0]['logprob'])}" in first["title"]
    assert "alternatives:" in first["title"]


def test_stream_of_a_finished_run_sends_the_final_state_at_once(client, recorder):
    r = client.post("/v1/completions", json={"prompt": "api run", "max_tokens": 5,
                                             "ignore_eos": True})
    run_id = r.json()["id"]
    assert recorder.flush()
    events = sse_events(client.get(f"/runs/{run_id}/stream"))
    assert [name for name, _ in events] == [f"token-{run_id}", f"stats-{run_id}",
                                            f"end-{run_id}", "done"]
    saved = client.get(f"/runs/{run_id}.json").json()
    assert streamed_text(events, run_id) == saved["output_text"] == r.json()["choices"][0]["text"]
    assert last_stats(events, run_id)["tokens"] == "5"
    assert client.get("/runs/nope/stream").status_code == 404


def test_playground_penalties_reach_the_run(client, recorder):
    [run_id] = play(client, frequency_penalty="1.5", presence_penalty="-0.5", max_tokens="4")
    finish(client, recorder, [run_id])
    params = client.get(f"/runs/{run_id}.json").json()["params"]
    assert params["frequency_penalty"] == 1.5 and params["presence_penalty"] == -0.5


def test_playground_json_schema_holds_the_output_and_the_run_page_shows_it(client, recorder):
    [run_id] = play(client, json_schema=json.dumps(SCHEMA), max_tokens="40")
    finish(client, recorder, [run_id])
    saved = client.get(f"/runs/{run_id}.json").json()
    # As the API's response_format json_schema would hold it.
    assert saved["params"]["structured"] == {"kind": "json", "spec": json.dumps(SCHEMA)}
    assert 1 <= json.loads(saved["output_text"])["n"] <= 9
    section = soup(client.get(f"/runs/{run_id}")).find(id="constraints")
    assert section.find(attrs={"data-structured": "json"}) is not None
    assert json.loads(section.select_one("pre.spec").get_text()) == SCHEMA
    assert section.find("table", class_="tools") is None


@pytest.fixture
def long_context(tmp_path):
    """A playground whose model has room for the tools' fallback system prompt."""
    db = open_database(tmp_path / "runs.db")
    recorder = Recorder(db, flush_interval=0.01)
    recorder.start()
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=512)),
                     engine_factory=lambda config: Engine(
                         config, loader=lambda *a, **k: tiny_model(max_position_embeddings=2048)),
                     recorder_factory=lambda settings: recorder)
    with TestClient(app, headers=SAME_ORIGIN) as c:
        yield c, recorder
    db.close()


def test_playground_tools_stream_the_calls_and_the_run_records_them(long_context):
    client, recorder = long_context
    r = client.post("/playground", data={"mode": "chat", "prompt": "weather in Paris?",
                                         "max_tokens": "120", "tools": json.dumps(TOOLS),
                                         "tool_choice": "required"})
    assert r.status_code == 200, r.text
    [panel] = BeautifulSoup(r.text, "html.parser").select("section.panel")
    run_id = panel["data-run-id"]
    assert panel.find(id=f"calls-{run_id}")["sse-swap"] == f"calls-{run_id}"
    events = finish(client, recorder, [run_id])
    streamed = [BeautifulSoup(d, "html.parser") for n, d in events if n == f"calls-{run_id}"]
    calls = [c for frag in streamed for c in frag.select(".tool-call")]
    assert calls and all(c["data-tool-call"] == "get_weather" for c in calls)
    for call in calls:  # the forced call follows the tool's schema
        assert isinstance(json.loads(call.select_one(".args").get_text())["city"], str)
    saved = client.get(f"/runs/{run_id}.json").json()
    params = saved["params"]
    assert params["tools"] == TOOLS and params["tool_choice"] == "required"
    assert params["tool_parser"] == "hermes" and params["structured"]["kind"] == "grammar"
    assert [c["name"] for c in saved["tool_calls"]] == ["get_weather"] * len(calls)
    assert [c["arguments"] for c in saved["tool_calls"]] == \
        [c.select_one(".args").get_text() for c in calls]
    section = soup(client.get(f"/runs/{run_id}")).find(id="constraints")
    assert section.find("tr", attrs={"data-tool": "get_weather"}) is not None
    assert len(section.select(".tool-calls .tool-call")) == len(calls)


def test_playground_stop_strings_and_seed(client, recorder):
    [run_id] = play(client, temperature="1", seed="7", stop="zz, yy\nxx", max_tokens="4")
    finish(client, recorder, [run_id])
    params = client.get(f"/runs/{run_id}.json").json()["params"]
    assert params["stop"] == ["zz", "yy", "xx"] and params["seed"] == 7
    assert params["temperature"] == 1.0 and params["max_tokens"] == 4


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": "   \n"}, "prompt", "must not be empty"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": "nan"}, "temperature", "at most 2"),
    ({"temperature": "2.5"}, "temperature", "at most 2"),
    ({"top_p": "0"}, "top_p", "above 0"),
    ({"frequency_penalty": "3"}, "frequency_penalty", "at most 2"),
    ({"presence_penalty": "x"}, "presence_penalty", "must be a number"),
    ({"max_tokens": "1.5"}, "max_tokens", "whole number"),
    ({"max_tokens": "0"}, "max_tokens", "at least 1"),
    ({"max_tokens": "100000"}, "max_tokens", "at most 512"),
    ({"max_tokens": "510", "prompt": "x" * 20}, "max_tokens", "context window"),
    ({"seed": "-1"}, "seed", "at least 0"),
    ({"copies": "9"}, "copies", "at most 8"),
    ({"copies": "two"}, "copies", "whole number"),
    ({"stop": "a,b,c,d,e"}, "stop", "at most 4"),
    ({"mode": "poem"}, "mode", "chat or raw"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": "[1]"}, "json_schema", "must be an object"),
    ({"tools": "[{]"}, "tools", "not valid JSON"),
    ({"tools": json.dumps(TOOLS)}, "tools", "chat prompt mode"),
    ({"mode": "chat", "tools": '[{"type": "function"}]'}, "tools", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "maybe"}, "tool_choice", "one of auto"),
    ({"mode": "chat", "tools": json.dumps(TOOLS), "tool_choice": "required",
      "json_schema": "{}"}, "tool_choice", "JSON schema"),
])
def test_bad_form_input_is_a_400_fragment_naming_the_field(client, fields, field, words):
    form = {"mode": "raw", "prompt": "hello", "max_tokens": "8", **fields}
    r = client.post("/playground", data=form)
    assert r.status_code == 400
    items = BeautifulSoup(r.text, "html.parser").select(".form-errors li")
    messages = {li["data-field"]: li.get_text() for li in items}
    assert field in messages and words in messages[field], messages
    r = client.post("/playground", data=form, headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_form_errors_are_escaped(client):
    r = client.post("/playground", data={"prompt": "x", "temperature": "<b>hot</b>"})
    assert r.status_code == 400
    assert "<b>" not in r.text and "&lt;b&gt;" in r.text


def test_oversized_form_is_413(client):
    r = client.post("/playground", data={"prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and "larger than" in r.text


def test_parse_playground_defaults():
    data, errors = parse_playground({"prompt": "hi"}, 512)
    assert errors == {}
    assert data.mode == "chat" and data.copies == 1
    assert data.params.max_tokens == 64 and data.params.temperature == 0.0
    assert data.params.seed is None and data.params.stop == ()


def test_cancel_stops_a_run(client, recorder):
    [run_id] = play(client, max_tokens="400", ignore_eos="1")
    r = client.post(f"/runs/{run_id}/cancel")
    assert r.status_code == 200
    assert BeautifulSoup(r.text, "html.parser").span.get_text() == "stopping…"
    events = finish(client, recorder, [run_id])
    end = BeautifulSoup([d for n, d in events if n == f"end-{run_id}"][0], "html.parser")
    assert end.find(attrs={"data-stat": "finish_reason"}).get_text() == "cancelled"
    saved = client.get(f"/runs/{run_id}.json").json()
    assert saved["finish_reason"] == "cancelled" and saved["completion_tokens"] < 400
    again = client.post(f"/runs/{run_id}/cancel", headers=JSON).json()
    assert again == {"id": run_id, "cancelled": False, "finish_reason": "cancelled"}
    assert client.post("/runs/nope/cancel", headers=JSON).status_code == 404


# ---- escaping ------------------------------------------------------------------------------
def test_untrusted_prompt_and_output_are_escaped_everywhere(client, recorder):
    [run_id] = play(client, prompt=SCRIPT, max_tokens="4")
    finish(client, recorder, [run_id])
    for url in ["/runs", f"/runs/{run_id}", f"/compare?a={run_id}&b={run_id}",
                f"/runs?q={SCRIPT}"]:
        r = client.get(url)
        assert r.status_code == 200, url
        page = soup(r)
        assert all(s.get("src") for s in page.find_all("script")), url  # only ours, no inline
        assert SCRIPT in page.get_text(), url
        assert SCRIPT not in r.text, url


# ---- runs list -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def listed(client, recorder):
    """Five runs with a marker word: three of length, one cancelled, one stopped by a string."""
    ids = play(client, prompt="zebra one", max_tokens="3", ignore_eos="1", copies="3")
    [cancelled] = play(client, prompt="zebra cancelled", max_tokens="400", ignore_eos="1")
    client.post(f"/runs/{cancelled}/cancel")
    # Stop at the first character of the greedy output: a stop string that surely matches.
    first = client.app.state.engine.generate("zebra stop", SamplingParams(max_tokens=8)).text
    [stopped] = play(client, prompt="zebra stop", max_tokens="8", stop=first[:1] or "x")
    finish(client, recorder, ids + [cancelled, stopped])
    return {"length": ids, "cancelled": cancelled, "stopped": stopped}


def test_runs_page_lists_runs_with_numbers_from_the_json_twin(client, listed):
    page = soup(client.get("/runs?q=zebra"))
    body = client.get("/runs.json?q=zebra").json()
    assert body["total"] >= 5 and page.find(attrs={"data-total": True})["data-total"] == \
        str(body["total"])
    rows = page.select("table.runs tbody tr")
    assert [tr["data-run-id"] for tr in rows] == [r["id"] for r in body["runs"]]
    for tr, run in zip(rows, body["runs"], strict=True):
        cells = {td["data-col"]: td.get_text()
                 for td in tr.find_all("td", attrs={"data-col": True})}
        assert cells == {"finish_reason": run["finish_reason"],
                         "prompt_tokens": str(run["prompt_tokens"]),
                         "completion_tokens": str(run["completion_tokens"]),
                         "ttft": fmt_ms(run["ttft"]), "e2e_latency": fmt_ms(run["e2e_latency"])}
        assert tr.find("a")["href"] == f"/runs/{run['id']}"
    # Accept: application/json gives the same context as the .json twin.
    assert client.get("/runs?q=zebra", headers=JSON).json()["runs"] == body["runs"]


def test_runs_filters(client, listed):
    body = client.get("/runs.json", params={"q": "zebra", "finish_reason": "cancelled"}).json()
    assert [r["id"] for r in body["runs"]] == [listed["cancelled"]]
    body = client.get("/runs.json", params={"q": "zebra stop", "finish_reason": "stop"}).json()
    assert listed["stopped"] in [r["id"] for r in body["runs"]]
    assert client.get("/runs.json", params={"model": "other"}).json()["total"] == 0
    assert client.get("/runs.json", params={"kernel_policy": "gemm", "q": "zebra"}).json()[
        "total"] == 5
    page = soup(client.get("/runs", params={"finish_reason": "cancelled", "q": "zebra"}))
    assert [tr["data-run-id"] for tr in page.select("table.runs tbody tr")] == \
        [listed["cancelled"]]
    # The dropdowns offer what the database holds and keep the current choice.
    select = page.find("select", attrs={"name": "finish_reason"})
    options = [o["value"] for o in select.find_all("option")]
    assert "" in options and {"cancelled", "length", "stop"} <= set(options)
    assert select.find("option", selected=True)["value"] == "cancelled"
    assert page.find("input", attrs={"name": "q"})["value"] == "zebra"
    assert soup(client.get("/runs?q=no-such-text")).find("p", class_="empty") is not None


def test_runs_pagination_links_keep_the_filters(client, listed):
    page = soup(client.get("/runs", params={"q": "zebra", "per_page": 2}))
    body = client.get("/runs.json", params={"q": "zebra", "per_page": 2}).json()
    assert body["pages"] == 3 and body["page"] == 1
    assert page.find("a", rel="prev") is None
    next_url = page.find("a", rel="next")["href"]
    assert parse_qs(urlsplit(next_url).query) == {"q": ["zebra"], "page": ["2"],
                                                  "per_page": ["2"]}
    page2 = soup(client.get(next_url))
    ids2 = [tr["data-run-id"] for tr in page2.select("table.runs tbody tr")]
    assert len(ids2) == 2 and not set(ids2) & {r["id"] for r in body["runs"]}
    assert page2.find("a", rel="prev") and page2.find("a", rel="next")
    assert page2.select_one(".pagination [aria-current]").get_text() == "2"
    last = client.get("/runs.json", params={"q": "zebra", "per_page": 2, "page": 3}).json()
    assert len(last["runs"]) == 1 and last["links"]["next"] is None


@pytest.mark.parametrize("query", ["page=abc", "page=0", "per_page=0", "per_page=100000"])
def test_runs_bad_paging_is_400(client, query):
    r = client.get(f"/runs?{query}")
    assert r.status_code == 400 and soup(r).find(class_="error-message")
    r = client.get(f"/runs.json?{query}")
    assert r.status_code == 400 and r.json()["error"]["message"]


# ---- one run -------------------------------------------------------------------------------
def test_run_page_shows_output_timeline_steps_and_metrics(client, recorder):
    [run_id] = play(client, prompt="timeline please", max_tokens="12", ignore_eos="1")
    finish(client, recorder, [run_id])
    run = client.get(f"/runs/{run_id}.json").json()
    assert client.get(f"/runs/{run_id}", headers=JSON).json() == run
    page = soup(client.get(f"/runs/{run_id}"))
    assert page.find("pre", class_="prompt").get_text() == "timeline please"
    assert page.find("pre", id="output").get_text() == run["output_text"]
    assert run["completion_tokens"] == 12 and "12 tokens" in page.get_text()
    assert page.find(attrs={"data-field": "finish_reason"}).get_text() == "length"

    rows = page.select("table.timeline tbody tr")
    assert len(rows) == len(run["tokens"]) == 12
    for tr, token in zip(rows, run["tokens"], strict=True):
        assert tr["data-idx"] == str(token["idx"])
        assert tr.find(attrs={"data-col": "logprob"}).get_text() == fmt_lp(token["logprob"])
        assert tr.find(attrs={"data-col": "offset"}).get_text() == fmt_ms(token["offset"])
        assert tr.find("td", class_="tokcell").get_text() == visible(token["text"])
        assert len(tr.select("td.alts .alt")) == len(token["alternatives"]) == 5
    strip = page.select("pre.tokens-strip > span")
    assert "".join(s.get_text() for s in strip) == run["output_text"]
    assert "alternatives:" in strip[0]["title"]

    steps = page.select("table.steps tbody tr")
    assert len(steps) == len(run["steps"]) > 0
    for tr, step in zip(steps, run["steps"], strict=True):
        assert tr["data-step"] == str(step["step"])
        assert tr.find(attrs={"data-col": "rows"}).get_text() == str(step["entry"]["rows"])
        assert tr.find(attrs={"data-col": "total_rows"}).get_text() == str(step["total_rows"])
    assert run["steps"][0]["entry"]["phase"] == "prefill"

    shown = {dd["data-metric"]: dd.get_text() for dd in page.select("dd[data-metric]")}
    metrics = run["metrics"]
    assert shown == {**{k: fmt_ms(metrics[k]) for k in ("queue_time", "ttft", "tpot", "itl_p50",
                                                        "itl_p90", "itl_p99", "e2e_latency")},
                     "tokens_per_s": fmt_rate(metrics["tokens_per_s"])}
    assert None not in shown.values() and "—" not in shown.values()


def test_unknown_run_is_404_page_and_json(client):
    r = client.get("/runs/nope")
    assert r.status_code == 404 and "nope" in soup(r).find(class_="error-message").get_text()
    r = client.get("/runs/nope.json")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found" and r.json()["error"]["param"] == "run_id"


# ---- compare -------------------------------------------------------------------------------
def test_compare_highlights_the_first_differing_token(client, recorder):
    [a] = play(client, prompt="compare me", max_tokens="16", ignore_eos="1")
    [b] = play(client, prompt="compare me", max_tokens="16", ignore_eos="1", temperature="1.5",
               seed="3")
    finish(client, recorder, [a, b])
    ta = [t["token_id"] for t in client.get(f"/runs/{a}.json").json()["tokens"]]
    tb = [t["token_id"] for t in client.get(f"/runs/{b}.json").json()["tokens"]]
    expected = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)

    body = client.get(f"/compare.json?a={a}&b={b}").json()
    assert body["first_difference"] == expected and body["same_tokens"] < 16
    assert set(body["params_differing"]) == {"temperature", "seed"}
    page = soup(client.get(f"/compare?a={a}&b={b}"))
    assert page.find(attrs={"data-first-difference": True})["data-first-difference"] == \
        str(expected)
    marks = page.select("pre.output mark.first-diff")
    assert [m.get_text() for m in marks] == [body["tokens"][expected]["a"]["text"],
                                             body["tokens"][expected]["b"]["text"]]
    [row] = page.select("table.compare-tokens tr.first-diff")
    assert row["data-idx"] == str(expected)
    differing = {tr["data-param"] for tr in page.select("table.compare-params tr.differs")}
    assert differing == {"temperature", "seed"}
    for tr, t in zip(page.select("table.compare-tokens tbody tr"), body["tokens"], strict=True):
        assert tr.find(attrs={"data-col": "logprob_diff"}).get_text() == fmt_lp(t["logprob_diff"])
    for side in ("a", "b"):
        cell = page.find("td", attrs={"data-side": side, "data-col": "ttft"})
        assert cell.get_text() == fmt_ms(body[side]["metrics"]["ttft"])


def test_compare_identical_runs_has_no_difference(client, recorder):
    a, b = play(client, prompt="same same", max_tokens="6", ignore_eos="1", copies="2")
    finish(client, recorder, [a, b])
    body = client.get(f"/compare.json?a={a}&b={b}").json()
    assert body["first_difference"] is None and body["same_tokens"] == 6
    assert body["params_differing"] == []
    assert all(t["logprob_diff"] == 0.0 for t in body["tokens"])
    page = soup(client.get(f"/compare?a={a}&b={b}"))
    assert not page.select("mark.first-diff") and "identical" in page.find(class_="verdict").text


@pytest.mark.parametrize(("query", "param"), [("", "a"), ("a=x", "a"), ("b=x", "a")])
def test_compare_missing_or_unknown_is_400(client, listed, query, param):
    a = listed["cancelled"]
    for q, p in [(query, param), (f"a={a}", "b"), (f"a={a}&b=nope", "b")]:
        r = client.get(f"/compare.json?{q}")
        assert r.status_code == 400 and r.json()["error"]["param"] == p, q
        r = client.get(f"/compare?{q}")
        assert r.status_code == 400
        assert soup(r).find(class_="error-message").get_text().startswith(p), q


# ---- without a database --------------------------------------------------------------------
class SilentRecorder:
    """Records nothing; with `database` set, pages read a database the runs never reach."""

    def __init__(self, database=None):
        self.database = database

    def start_session(self, *args, **kwargs) -> int:
        return 1

    def run_started(self, *args, **kwargs) -> None: ...

    def token(self, event) -> None: ...

    def run_finished(self, event) -> None: ...

    def step(self, session_id, record) -> None: ...

    def close(self) -> None: ...


def test_without_a_database_runs_pages_say_so_and_playground_works():
    with TestClient(make_app(), headers=SAME_ORIGIN) as c:
        for url in ["/runs", "/runs/x", "/compare?a=x&b=y"]:
            r = c.get(url)
            assert r.status_code == 503 and "no database" in soup(r).get_text()
        for url in ["/runs.json", "/runs/x.json", "/compare.json?a=x&b=y"]:
            r = c.get(url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_database"
        assert "runs are not saved" in soup(c.get("/")).get_text()
        [run_id] = play(c, max_tokens="3", ignore_eos="1")
        events = sse_events(c.get(f"/runs/{run_id}/stream"))
        end = BeautifulSoup(events[-2][1], "html.parser")
        assert "not saved" in end.get_text() and end.find("a") is None
        assert last_stats(events, run_id)["tokens"] == "3"


def test_run_not_written_yet_gets_a_pending_page(db):
    with TestClient(make_app(lambda settings: SilentRecorder(db)), headers=SAME_ORIGIN) as c:
        [run_id] = play(c, max_tokens="2")
        r = c.get(f"/runs/{run_id}")
        assert r.status_code == 202
        assert soup(r).find("meta", attrs={"http-equiv": "refresh"}) is not None
        assert c.get(f"/runs/{run_id}.json").json()["id"] == run_id
