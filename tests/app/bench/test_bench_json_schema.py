"""`batchscope bench serve --json-schema FILE`: every request carries the schema, and the report
says how many outputs parsed as JSON (a scripted server, then a live one on the tiny model)."""

from __future__ import annotations

import asyncio
import json

import httpx
from live_server import serving

from app.bench.client import run_load
from app.bench.dataset import BenchRequest
from app.bench.metrics import format_report, summarize
from app.cli import main
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
ITEMS = [BenchRequest("a b c", max_tokens=20, input_len=3) for _ in range(3)]


def test_the_schema_is_sent_and_the_outputs_are_parsed():
    bodies = []
    outputs = iter([['{"n":', '4}'], ['{"n":', '5'], ['{"n":7}']])  # the second is cut short

    def handler(request):
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]}
                  for t in next(outputs)]
        chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        return httpx.Response(200, content="".join(f"data: {json.dumps(c)}\n\n"
                                                   for c in chunks) + "data: [DONE]\n\n")

    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}
    results, duration = asyncio.run(run_load(
        "http://server", ITEMS, max_concurrency=1, response_format=fmt,
        transport=httpx.MockTransport(handler)))
    assert all(b["response_format"] == fmt and "ignore_eos" not in b for b in bodies)
    assert [r.parsed for r in results] == [True, False, True]
    summary = summarize(results, duration)
    assert summary["json_parsed"] == {"parsed": 2, "of": 3}
    assert "Outputs parsed as JSON:                 2 of 3" in format_report(
        summary, request_rate=None, max_concurrency=1)
    # Without a schema: nothing parsed, nothing said.
    plain = summarize([r.__class__(**{**r.__dict__, "parsed": None}) for r in results], 1.0)
    assert plain["json_parsed"] is None
    assert "parsed as JSON" not in format_report(plain, request_rate=None, max_concurrency=1)


def test_bench_serve_against_a_live_server(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": 12}) + "\n"
                               for p in ("one", "two words", "three more words")))
    result = tmp_path / "result.json"
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    with serving(app) as url:
        rc = main(["bench", "serve", "--url", url, "--dataset", str(dataset), "--no-record",
                   "--num-prompts", "3", "--json-schema", str(schema),
                   "--save-result", str(result)])
    assert rc == 0
    assert "Outputs parsed as JSON:                 3 of 3" in capsys.readouterr().out
    saved = json.loads(result.read_text())
    assert saved["summary"]["json_parsed"] == {"parsed": 3, "of": 3}
    assert saved["config"]["ignore_eos"] is False and saved["config"]["json_schema"] == SCHEMA
    assert all(r["parsed"] and r["finish_reason"] == "stop" for r in saved["requests"])


def test_a_bad_schema_file_is_refused_before_the_run(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    rc = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--no-record",
               "--json-schema", str(bad)])
    assert rc == 2 and "not a JSON object" in capsys.readouterr().err
