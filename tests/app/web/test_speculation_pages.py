"""Speculative decoding on the pages: the playground's toggle, drafted tokens on the run and
compare pages, the run's acceptance; on the tiny model with scripted drafts (speculation.py)
and a real SQLite database. Every number on a page is checked against its JSON twin."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup
from speculation import SPEC, ScriptedDrafts
from starlette.testclient import TestClient
from test_pages import JSON, SAME_ORIGIN, finish, play, soup, sse_events

from app.db import Recorder, open_database
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.playground import parse_playground
from app.web.render import fmt_pct
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

PROMPT = "repeat after me: one two three"


@pytest.fixture(scope="module")
def drafts() -> ScriptedDrafts:
    return ScriptedDrafts()


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    database = open_database(tmp_path_factory.mktemp("spec") / "runs.db")
    rec = Recorder(database, flush_interval=0.01)
    rec.start()
    yield rec  # closed by the app's lifespan
    database.close()


@pytest.fixture(scope="module")
def client(drafts, recorder):
    settings = Settings(engine=EngineConfig(num_kv_blocks=128, **SPEC))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model,
                                                                    proposer=drafts),
                     recorder_factory=lambda s: recorder)
    with TestClient(app, headers=SAME_ORIGIN) as c:
        yield c


@pytest.fixture(scope="module")
def runs(client, recorder, drafts) -> dict[str, dict]:
    """The same greedy prompt without speculation (the playground's toggle off), then with it."""
    [plain] = play(client, prompt=PROMPT, max_tokens="24", ignore_eos="1", speculative="0")
    finish(client, recorder, [plain])
    saved = client.get(f"/runs/{plain}.json").json()
    drafts.learn(saved["prompt_token_ids"], saved["output_token_ids"])
    [spec] = play(client, prompt=PROMPT, max_tokens="24", ignore_eos="1", speculative="1")
    events = finish(client, recorder, [spec])
    return {"plain": saved, "spec": client.get(f"/runs/{spec}.json").json(), "events": events}


def test_the_toggle_reaches_the_request(runs):
    assert runs["plain"]["params"]["speculative"] is False
    assert runs["spec"]["params"]["speculative"] is True
    assert [t["token_id"] for t in runs["spec"]["tokens"]] == \
        [t["token_id"] for t in runs["plain"]["tokens"]]  # greedy: the same text either way


def test_run_json_counts_drafted_tokens_from_the_step_entries(client, runs):
    spec = runs["spec"]
    verify = [s["entry"] for s in spec["steps"] if s["entry"]["phase"] == "verify"]
    drafted = sum(e["drafted"] for e in verify)
    accepted = sum(e["accepted"] for e in verify)
    assert 0 < accepted < drafted  # the script's wrong drafts were rejected, the rest kept
    assert spec["speculation"] == {"verify_steps": len(verify), "drafted": drafted,
                                   "accepted": accepted, "rate": accepted / drafted,
                                   "drafted_tokens": accepted}
    # Each accepted draft is one output token marked drafted; the steps say how many.
    assert sum(t["drafted"] for t in spec["tokens"]) == accepted
    for s in spec["steps"]:
        if s["entry"]["phase"] == "verify":
            assert s["entry"]["drafted"] == s["entry"]["rows"] - 1
            assert s["verify_rows"] >= s["entry"]["rows"] and s["speculation"] == "on"
            assert s["draft_tokens"] >= s["entry"]["drafted"]
            assert s["accepted_tokens"] >= s["entry"]["accepted"]
    # The tokens a verify step emitted: its accepted drafts, then the model's own.
    by_step: dict[int, list[bool]] = {}
    for t in spec["tokens"]:
        by_step.setdefault(t["step"], []).append(t["drafted"])
    for s in spec["steps"]:
        if s["entry"]["phase"] == "verify":
            assert by_step[s["step"]] == [True] * s["entry"]["accepted"] + [False]
    plain = runs["plain"]
    assert plain["speculation"]["drafted"] == 0 and plain["speculation"]["rate"] is None
    assert not any(t["drafted"] for t in plain["tokens"])
    assert {s["entry"]["phase"] for s in plain["steps"]} == {"prefill", "decode"}


def test_run_page_marks_drafted_tokens_and_shows_the_acceptance(client, runs):
    spec = runs["spec"]
    page = soup(client.get(f"/runs/{spec['id']}"))
    strip = page.select("pre.tokens-strip > span.tok")
    assert [("drafted" in s["class"]) for s in strip] == [t["drafted"] for t in spec["tokens"]]
    for span in page.select("pre.tokens-strip > span.tok.drafted"):
        assert "drafted (speculative decoding)" in span["title"]
    assert page.select_one(".legend .tok.drafted") is not None
    rows = page.select("table.timeline tbody tr")
    assert [r.find(attrs={"data-col": "drafted"}).get_text(strip=True) == "drafted"
            for r in rows] == [t["drafted"] for t in spec["tokens"]]
    shown = {dd["data-spec"]: dd.get_text() for dd in page.select("#speculation dd")}
    s = spec["speculation"]
    assert shown == {"verify_steps": str(s["verify_steps"]), "drafted": str(s["drafted"]),
                     "accepted": str(s["accepted"]), "rate": fmt_pct(s["rate"]),
                     "drafted_tokens": f"{s['drafted_tokens']} of {len(spec['tokens'])}"}
    steps = page.select("table.steps tbody tr")
    for tr, step in zip(steps, spec["steps"], strict=True):
        phase = tr.find(attrs={"data-col": "phase"}).get_text(" ", strip=True)
        entry = step["entry"]
        assert phase.split()[0] == entry["phase"]
        if entry["phase"] == "verify":
            assert f"{entry['accepted']}/{entry['drafted']}" in phase
        assert tr.find(attrs={"data-col": "phase_rows"}).get_text() == \
            f"{step['prefill_rows']} / {step['decode_rows']} / {step['verify_rows']}"


def test_run_page_of_an_opted_out_run_says_so(client, runs):
    page = soup(client.get(f"/runs/{runs['plain']['id']}"))
    assert "opted out" in page.select_one("[data-spec=none]").get_text()
    assert not page.select("span.tok.drafted") and page.select_one(".legend") is None


def test_compare_keeps_working_and_shows_both_acceptances(client, runs):
    a, b = runs["plain"]["id"], runs["spec"]["id"]
    body = client.get(f"/compare.json?a={a}&b={b}").json()
    assert body["first_difference"] is None and body["params_differing"] == ["speculative"]
    assert [r["b"]["drafted"] for r in body["tokens"]] == \
        [t["drafted"] for t in runs["spec"]["tokens"]]
    page = soup(client.get(f"/compare?a={a}&b={b}"))
    cells = {td["data-side"]: td.get_text() for td in page.select("td[data-col=speculation]")}
    s = body["b"]["speculation"]
    assert cells == {"a": "none",
                     "b": f"{s['accepted']} of {s['drafted']} ({fmt_pct(s['rate'])})"}
    marked = page.select("table.compare-tokens span.tok.drafted")
    assert len(marked) == s["drafted_tokens"] > 0


def test_playground_streams_drafted_tokens_marked(client, runs):
    """As the run streamed, and as a later stream replays it."""
    name = f"token-{runs['spec']['id']}"
    later = sse_events(client.get(f"/runs/{runs['spec']['id']}/stream"))
    for events in (runs["events"], later):
        html = "".join(d for n, d in events if n == name)
        spans = BeautifulSoup(html, "html.parser").select("span.tok[data-idx]")
        assert [("drafted" in s["class"]) for s in spans] == [t["drafted"] for t in
                                                             runs["spec"]["tokens"]]


def test_playground_toggle_says_what_the_engine_does(client):
    page = soup(client.get("/"))
    [hidden] = page.select('input[type=hidden][name=speculative]')
    assert hidden["value"] == "0"
    box = page.select_one('input[type=checkbox][name=speculative]')
    assert box["value"] == "1" and box.has_attr("checked")
    engine = client.app.state.engine
    assert engine.speculation.describe() in box.parent["title"]
    body = client.get("/", headers=JSON).json()
    assert body["speculation"] == {"enabled": True, "describe": engine.speculation.describe()}


def test_playground_toggle_without_speculation_explains_why():
    settings = Settings(engine=EngineConfig(num_kv_blocks=32))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model))
    with TestClient(app) as c:
        box = soup(c.get("/")).select_one('input[type=checkbox][name=speculative]')
        assert "does not speculate" in box.parent["title"]
        assert c.get("/", headers=JSON).json()["speculation"] == {"enabled": False,
                                                                  "describe": "off"}


def test_playground_form_speculative_values():
    for raw, expected in ((None, True), ("1", True), ("on", True), ("0", False),
                          ("off", False)):
        form = {"prompt": "hi"} | ({} if raw is None else {"speculative": raw})
        data, errors = parse_playground(form, 512)
        assert errors == {} and data.params.speculative is expected, raw
    data, errors = parse_playground({"prompt": "hi", "speculative": "maybe"}, 512)
    assert data is None and "speculative" in errors and "on or off" in errors["speculative"]


def test_playground_bad_speculative_is_a_400_naming_it(client):
    r = client.post("/playground", data={"prompt": "hi", "speculative": "maybe"},
                    headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
