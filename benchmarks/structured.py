"""Structured outputs and tool calls under load: what constraining every request costs, and
whether every constrained output is well-formed, in one run.

Starts `batchscope serve` (its default weights) and, in interleaved rounds, runs the same
`batchscope bench serve` load (--max-concurrency 8, natural stops) free and with a JSON schema
sent with every request (--json-schema): output tok/s of each and their ratio, and how many
constrained outputs parse as JSON. Then, 8 at a time with the official `openai` client,
constrained chat requests whose outputs are checked against the schema (`conforms`: the
schema's own rules), and named and `required` tool calls whose arguments are checked against
the tool's parameters.

    .venv/bin/python benchmarks/structured.py [--rounds 3] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peers import Log, free_port, running_server, server_commands  # noqa: E402

from app.bench.client import json_schema_format  # noqa: E402

STREAMS = 8
SCHEMA = {  # a record with free text, bounded fields and a bounded list
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "summary": {"type": "string", "maxLength": 400},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "minItems": 1, "maxItems": 4},
        "tone": {"enum": ["formal", "casual", "neutral"]},
    },
    "required": ["title", "summary", "rating", "tags", "tone"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 80},
        "results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "results"], "additionalProperties": False}}}
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Accra"]


def bench_serve(url: str, out: Path, args, schema: Path | None) -> dict:
    cmd = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())",
           "bench", "serve", "--url", url, "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(STREAMS), "--seed", "0", "--ignore-eos", "off",
           "--max-tokens-cap", str(args.max_tokens), "--endpoint", "chat", "--no-record",
           "--save-result", str(out)]
    if schema is not None:
        cmd += ["--json-schema", str(schema)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def conforms(value, schema: dict) -> bool:
    """Whether value follows the JSON Schema keywords this benchmark's schemas use: type,
    properties, required, additionalProperties false, enum, maxLength, minimum, maximum,
    items, minItems, maxItems."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(conforms(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value)
                <= schema.get("maxItems", len(value))
                and all(conforms(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    return True


def parsed_and_conforming(text: str, schema: dict) -> bool:
    try:
        return conforms(json.loads(text), schema)
    except ValueError:
        return False


def load_rounds(url: str, args, workdir: Path, log: Log) -> dict:
    schema_file = workdir / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    rounds: dict[str, list[dict]] = {"free": [], "schema": []}
    for rnd in range(args.rounds):
        order = ("free", "schema") if rnd % 2 == 0 else ("schema", "free")
        for mode in order:
            result = bench_serve(url, workdir / f"{mode}-{rnd}.json", args,
                                 schema_file if mode == "schema" else None)
            s = result["summary"]
            row = {"output_tps": s["output_throughput"], "output_tokens": s["total_output_tokens"],
                   "failed": s["failed"], "completed": s["completed"]}
            if mode == "schema":
                # A JSON cut off by the request's max_tokens cannot parse: count the outputs
                # that ended by themselves, and the cut ones apart.
                done = [r for r in result["requests"] if r["success"]]
                stopped = [r for r in done if r["finish_reason"] == "stop"]
                row["valid"], row["of"] = sum(bool(r["parsed"]) for r in stopped), len(stopped)
                row["cut"] = sum(r["finish_reason"] == "length" for r in done)
            rounds[mode].append(row)
            log(f"round {rnd + 1}, {mode}: {row['output_tps']:.1f} output tok/s"
                + (f", {row['valid']} of {row['of']} that stopped parsed, {row['cut']} cut "
                   "by max_tokens" if mode == "schema" else ""))
    ratio = statistics.median(b["output_tps"] / a["output_tps"]
                              for a, b in zip(rounds["free"], rounds["schema"], strict=True))
    return {"rounds": rounds, "ratio": ratio,
            "free_tps": statistics.median(r["output_tps"] for r in rounds["free"]),
            "schema_tps": statistics.median(r["output_tps"] for r in rounds["schema"]),
            "valid": sum(r["valid"] for r in rounds["schema"]),
            "of": sum(r["of"] for r in rounds["schema"]),
            "cut": sum(r["cut"] for r in rounds["schema"])}


def checked_requests(url: str, count: int) -> dict:
    """`count` constrained chat requests and `count` tool calls (named and `required`
    alternately), STREAMS at a time: how many are well-formed."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    fmt = json_schema_format(SCHEMA, "record")

    def record(i: int) -> tuple[str, bool]:
        out = client.chat.completions.create(
            model=model, max_tokens=256, temperature=0, response_format=fmt,
            messages=[{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as a "
                       "record."}])
        return "schema", parsed_and_conforming(out.choices[0].message.content or "", SCHEMA)

    def call(i: int) -> tuple[str, bool]:
        choice = ({"type": "function", "function": {"name": "get_weather"}} if i % 2 == 0
                  else "required")
        out = client.chat.completions.create(
            model=model, max_tokens=128, temperature=0, tools=[WEATHER, SEARCH],
            tool_choice=choice,
            messages=[{"role": "user", "content": f"What is the weather in "
                       f"{CITIES[i % len(CITIES)]}? Or find something about it."}])
        # Every call returned must be whole and follow its tool's parameters. A model may go
        # on to another (parallel) call and reach max_tokens: that one is not returned.
        calls = out.choices[0].message.tool_calls or []
        good = bool(calls) and all(
            c.function.name in schemas
            and parsed_and_conforming(c.function.arguments, schemas[c.function.name])
            for c in calls)
        return ("named" if i % 2 == 0 else "required"), good

    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(record, range(count))) + list(pool.map(call, range(count)))
    return {kind: {"well_formed": sum(g for k, g in results if k == kind),
                   "of": sum(1 for k, _ in results if k == kind)}
            for kind in ("schema", "named", "required")}


def render(data: dict, args) -> str:
    load, tools = data["load"], data["tools"]
    lines = [f"Structured outputs under load: `batchscope serve` (its default weights), "
             f"`batchscope bench serve --endpoint chat --max-concurrency {STREAMS} "
             f"--num-prompts {args.num_prompts} --max-tokens-cap {args.max_tokens} "
             f"--ignore-eos off`, free and with `--json-schema` (a 5-field record: free text, "
             f"an enum, a bounded integer and list), {args.rounds} interleaved rounds; run "
             f"{data['started']}.", "",
             "| load | output tok/s (median) | constrained outputs that parse |", "|---|---|---|",
             f"| free | {load['free_tps']:.1f} | - |",
             f"| every request constrained | {load['schema_tps']:.1f} | "
             f"{load['valid']} of the {load['of']} that ended by themselves ({load['cut']} more "
             "cut short by the dataset's max_tokens) |", "",
             f"Constrained / free, median of the per-round ratios: **{load['ratio']:.2f}x** "
             "(goal >= 0.9x).", "",
             f"Checked one by one ({STREAMS} at a time, greedy): outputs constrained by the "
             f"schema that parse and follow it: {tools['schema']['well_formed']} of "
             f"{tools['schema']['of']}; tool calls with two tools offered whose arguments parse "
             f"and follow the tool's parameters: named "
             f"{tools['named']['well_formed']} of {tools['named']['of']}, `required` "
             f"{tools['required']['well_formed']} of {tools['required']['of']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--checked", type=int, default=16,
                    help="constrained requests and tool calls checked one by one")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured.json"))
    args = ap.parse_args()
    log = Log("structured")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = free_port()
        cmd = server_commands("batchscope", port, "auto", workdir, workdir / "bench.db")
        with running_server("batchscope", cmd, port, workdir / "server.log", log) as (url, _):
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            data = {"started": started, "load": load_rounds(url, args, workdir, log),
                    "tools": checked_requests(url, args.checked)}
    text = render(data, args)
    print(text)
    out = Path(args.out)
    out.write_text(json.dumps(data, indent=2))
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
