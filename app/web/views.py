"""The pages' contexts as models: what a template renders, what the JSON twin sends
(`model_dump(mode="json")`), and the twins' schemas in /openapi.json (app/web/api/openapi.py).

Field order is the JSON's key order. Records read from the database or the engine (a run's
fields, a step) are typed as far as the pages rely on them and keep their other keys as extras
(`Record`): the declared fields are the first keys of such a record, so the order holds.
Numbers that may be whole or fractional are `int | float`, so 3 stays 3 and 3.0 stays 3.0.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from app.json_safe import json_safe
from app.lab.divergence.record import Writer

Number = int | float


class View(BaseModel):
    """A page's context. As JSON, NaN and infinities are null (app/json_safe.py)."""

    # Every field is in every dump, so the schemas require them all.
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    @model_serializer(mode="wrap")
    def _finite(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo):
        # No return annotation: the schema stays the model's own.
        data = handler(self)
        return json_safe(data) if info.mode_is_json() else data


class Record(View):
    """A record from the database or the engine: its other keys kept, after these."""

    model_config = ConfigDict(extra="allow")


# ---- runs list -----------------------------------------------------------------------------
class RunSummary(View):
    id: str
    created_at: float
    source: str
    endpoint: str
    model: str
    weights: str
    kernel_policy: str
    status: str
    finish_reason: str | None
    prompt_preview: str | None
    output_preview: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft: float | None
    e2e_latency: float | None


class FilterOptions(View):
    """What the filter dropdowns offer: the values the runs have."""

    models: list[str]
    kernel_policies: list[str]
    finish_reasons: list[str]


class PageLink(View):
    page: int = Field(ge=1)
    url: str


class RunListLinks(View):
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True)

    prev: str | None
    next: str | None
    pages: list[PageLink]
    json_: str = Field(alias="json")


class RunList(View):
    runs: list[RunSummary]
    total: int = Field(ge=0)
    page: int = Field(ge=1)
    per_page: int = Field(ge=1)
    pages: int = Field(ge=1)
    filters: dict[str, str]
    options: FilterOptions
    links: RunListLinks


# ---- one run -------------------------------------------------------------------------------
class Alternative(View):
    token_id: int
    text: str | None
    logprob: float | None


class TokenView(View):
    """One output token (render.token_view)."""

    idx: int = Field(ge=0)
    token_id: int
    text: str | None
    logprob: float | None
    offset: float | None = Field(description="seconds since the run was queued")
    step: int | None
    drafted: bool = Field(description="proposed by speculative decoding, accepted by the "
                                      "target model")
    alternatives: list[Alternative]


class RunToken(TokenView):
    gap: float | None = Field(description="seconds since the previous token")


class RunStep(Record):
    """A step the run took part in (its entry, its batch mates, `offset` from queueing)."""

    step: int = Field(ge=1)


class RunMetrics(Record):
    ttft: float | None
    tpot: float | None


class Speculation(Record):
    """What speculative decoding did for the run (drafted_tokens: among its output)."""

    verify_steps: int = Field(ge=0)
    drafted: int = Field(ge=0)
    accepted: int = Field(ge=0)
    rate: float | None


class Run(Record):
    """A saved run: its row, decoded tokens, the steps it shared, metrics."""

    id: str
    session_id: int | None
    created_at: float
    source: str
    endpoint: str
    model: str
    weights: str
    kernel_policy: str
    prompt_text: str | None
    messages: list[dict[str, Any]] | None
    prompt_token_ids: list[int]
    params: dict[str, Any] | None
    status: str
    finish_reason: str | None
    error: str | None
    output_text: str | None
    output_token_ids: list[int] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_prompt_tokens: int | None
    preemptions: int | None
    queued_at: float | None
    first_scheduled_at: float | None
    first_token_at: float | None
    finished_at: float | None
    tokens: list[RunToken]
    steps: list[RunStep]
    metrics: RunMetrics
    speculation: Speculation
    text_tail: str = Field(description="output released only with the finish (held back for "
                                       "a stop string, or a partial character)")
    tool_calls: list[dict[str, str]] | None = Field(
        None, description="a run given tools (params.tools): the calls its output holds, read "
                          "by the recorded params.tool_parser; null: no tools recorded")


class RunPending(View):
    id: str
    status: Literal["running", "saving"]
    message: str


# ---- compare -------------------------------------------------------------------------------
class RunSide(View):
    id: str
    created_at: float
    model: str
    status: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    output_text: str | None
    text_tail: str
    metrics: RunMetrics
    speculation: Speculation


class ParamRow(View):
    name: str
    a: Any
    b: Any
    differs: bool


class TokenPair(View):
    idx: int = Field(ge=0)
    a: RunToken | None
    b: RunToken | None
    same: bool
    logprob_diff: float | None


class Comparison(View):
    a: RunSide
    b: RunSide
    params: list[ParamRow]
    params_differing: list[str]
    tokens: list[TokenPair]
    first_difference: int | None
    same_tokens: int = Field(ge=0)


# ---- dashboard -----------------------------------------------------------------------------
class EngineLimits(View):
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int


class SpeculationSetting(View):
    """The engine's speculative decoding as configured; each step says whether it ran."""

    enabled: bool
    describe: str
    method: str
    num_tokens: int | None
    max_batch: int | None


class StatePool(View):
    """Models with recurrent layers (Gated DeltaNet): the pool of per-sequence states beside
    the KV pool, now (engine.telemetry.StepRecord's state_* fields without the prefix)."""

    slots_total: int = Field(ge=1, description="live-sequence slots")
    slots_used: int = Field(ge=0, description="slots held by running sequences")
    checkpoints: int = Field(ge=0, description="prefix checkpoints held")
    checkpoint_capacity: int = Field(ge=0, description="checkpoints the memory budget allows")
    checkpoint_hits: int = Field(ge=0, description="cumulative: admissions that resumed from "
                                                   "a checkpoint")
    slot_bytes: int = Field(ge=0, description="one slot: conv + recurrent state of every "
                                              "recurrent layer")


class EngineState(Record):
    time: float
    step: int = Field(ge=0)
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    idle: bool
    tokens_per_s: float = Field(ge=0, description="decode tokens per second over the last "
                                                  "second, now: 0 once no step ran in it")
    batch: dict[str, Any] | None = Field(description="the latest step's batch")
    kv: dict[str, Any] = Field(description="every KV block: free, cached or its holders")
    state_pool: StatePool | None = Field(description="the recurrent-state pool (null: the "
                                                     "model has no recurrent layers)")
    experts: dict[str, Any] | None = Field(description="the expert load (null: a dense model)")


class Dashboard(View):
    model: str
    config: EngineLimits
    speculation: SpeculationSetting
    ranks: list[dict[str, Any]] = Field(
        default_factory=list, description="tensor parallelism: each rank, its loopback port "
        "and its seconds in the latest step (wall_s, model_s, broadcast_s, all_sum_s); empty for "
        "one rank")
    frames_per_s: int
    chart_steps: int
    acceptance_steps: int = Field(ge=1)
    expert_steps: int
    state: EngineState
    steps: list[dict[str, Any]] = Field(description="the recent steps the charts draw")


class StepSummary(Record):
    """A step record (engine.telemetry.StepRecord.to_dict)."""

    step: int = Field(ge=1)
    started_at: float


class Steps(View):
    since: int = Field(ge=0)
    last_step: int = Field(ge=0)
    oldest_step: int | None
    missed: int = Field(ge=0, description="steps after `since` that fell out of the ring "
                                          "buffer before this call")
    next_since: int = Field(ge=0)
    more: bool
    steps: list[StepSummary]


# ---- calibration ---------------------------------------------------------------------------
class CalibrationFile(View):
    """The saved calibration, as its file has it (a hand-edited file may hold anything)."""

    threshold: Any
    threshold_from_rows: Any = Field(description="recomputed from the rows: whether the "
                                                 "file's threshold still follows from its data")
    threshold_basis: Any
    decode_paths: str | None = Field(description="the kernel paths each policy's decode steps "
                                     "were recorded on, in words (None: not in the file)")
    date: Any
    host: Any
    cpu_count: Any
    mlx_version: Any
    backend_info: Any
    max_tokens: Any
    repeats: Any
    elapsed_s: Any
    path: Any
    plot_path: Any
    rows: list[dict[str, Any]]


class Calibration(View):
    """The calibration for the served model, weights and backend, if one was measured."""

    model: str
    weights: str
    backend: str
    kernel_policy: str | None
    threshold_source: str | None = Field(description="where the engine's threshold came from "
                                                     "(flag, calibration, default)")
    command: str = Field(description="the command that calibrates what this server runs")
    expected_path: str
    calibration: CalibrationFile | None


# ---- divergence ----------------------------------------------------------------------------
ExperimentStatus = Literal["queued", "running", "done", "error"]
VerdictKind = Literal["identical", "same_tokens", "forked"]


class ExperimentRuns(View):
    """An experiment's two sides as recorded runs (/runs/{id})."""

    a: str | None
    b: str | None


class ExperimentSummary(View):
    """An experiment in the list (without its record)."""

    id: str
    status: ExperimentStatus
    created: float
    source: str = Field(description="web, or cli (batchscope diverge --db)")
    prompt: str = Field(description="the prompt's first characters")
    a: str | None = Field(description="side A's set-up")
    b: str | None = Field(description="side B's set-up")
    verdict: str | None = Field(description="the verdict, or the error")
    verdict_kind: VerdictKind | None
    fork_token_index: int | None
    runs: ExperimentRuns | None
    saved: bool = Field(description="saved in the runs database (false: held in memory)")


class Experiment(View):
    id: str
    status: ExperimentStatus
    created: float
    started: float | None
    finished: float | None


ExperimentRecord = Annotated[dict[str, Any] | None, Field(
    description="the finished experiment's record (app/lab/divergence/record.py: "
                "DivergenceRecord.to_dict())")]


class HeldExperiment(Experiment):
    """An experiment the server holds in memory: queued or running, or finished without a
    database (or when saving it failed: save_error)."""

    params: dict[str, Any]
    progress: list[str]
    record: ExperimentRecord
    error: str | None
    source: str
    runs: None
    saved: Literal[False]
    save_error: str | None


class SavedExperiment(Experiment):
    """An experiment read back from the runs database, its two sides recorded as runs."""

    source: str
    params: dict[str, Any]
    progress: list[str]
    record: ExperimentRecord
    error: str | None
    verdict_kind: VerdictKind | None
    fork_token_index: int | None
    runs: ExperimentRuns | None
    saved: Literal[True]
    save_error: None


class KvTimelineRow(View):
    """Positions first..last of the contamination timeline, written alike on each side."""

    first: int = Field(ge=0)
    last: int = Field(ge=0)
    a: Writer | None  # the lab's record type: its schema is generated from the dataclass
    b: Writer | None
    max_abs_delta: Number
    first_difference: int | None
    count: int = Field(ge=1, description="the segments merged into this row")
    steps_a: list[int | None] = Field(description="the first and last writing step on A")
    steps_b: list[int | None] = Field(description="the first and last writing step on B")
    has_first: bool = Field(description="holds the first position whose keys/values differ")
    what: str


class SideText(View):
    shared: str = Field(description="the text both sides produced (all of it, without a fork)")
    rest: str = Field(description="this side's continuation after the fork")


class DivergenceResult(View):
    """What the page shows of a finished record (app/lab/divergence/report.py)."""

    texts: dict[str, SideText]
    timeline: list[KvTimelineRow]
    fork_token: int | None


class Divergence(View):
    """The divergence page: its form, the experiments, and with ?id= one of them."""

    form: dict[str, str] = Field(description="the form's fields: the defaults, or the shown "
                                             "experiment's parameters")
    errors: dict[str, str] = Field(description="a refused form's messages, by field")
    weights_choices: list[str]
    policies: list[str]
    matmul_choices: list[str]
    max_tokens_limit: int
    persisted: bool = Field(description="whether finished experiments are saved in the runs "
                                        "database (false: kept in memory only)")
    saved_total: int | None = Field(ge=0)
    max_keep: int = Field(description="finished experiments kept in memory without a database")
    experiments: list[ExperimentSummary] = Field(description="newest first: queued and "
                                                             "running ones, then the saved ones")
    experiment: SavedExperiment | HeldExperiment | None = Field(description="with ?id=: that "
                                                                            "experiment")
    view: DivergenceResult | None = Field(description="with ?id= and a finished experiment")


# ---- benchmarks ----------------------------------------------------------------------------
class BenchmarkFields(View):
    """A recorded `batchscope bench serve` run (app/db/benchmarks.py)."""

    id: int
    created_at: float
    url: str
    model: str
    label: str | None
    endpoint: str = Field(description="completions or chat")
    dataset: str
    num_prompts: int
    request_rate: float | None = Field(description="requests per second (null: all at once)")
    max_concurrency: int | None = Field(description="null: unlimited")
    seed: int
    duration_s: float
    completed: int
    failed: int
    config: dict[str, Any]
    summary: dict[str, Any] = Field(description="the report's numbers: counts, tokens, "
                                                "throughputs, latency statistics (ms) per "
                                                "metric, goodput")


RunName = Annotated[str, Field(description="the name the plots' legends give the run")]
MetricTitles = Annotated[dict[str, tuple[str, str]],
                         Field(description="metric -> [abbreviation, title]")]


class BenchmarkRow(BenchmarkFields):
    name: RunName


class Benchmarks(View):
    """The recorded benchmark runs, newest first."""

    total: int = Field(ge=0)
    runs: list[BenchmarkRow]
    plotted: list[int] = Field(description="the runs in the latency plots")
    metrics: list[str]
    metric_titles: MetricTitles


class Benchmark(BenchmarkFields):
    """One benchmark run: its report and every request."""

    requests: list[dict[str, Any]] = Field(description="one per request: lengths, timings "
                                                       "(s), ITLs, error")
    name: RunName
    metrics: list[str]
    metric_titles: MetricTitles


# The twins /openapi.json describes, by schema name.
TWINS: tuple[type[View], ...] = (RunList, Run, RunPending, Comparison, Dashboard, Steps,
                                 Calibration, Divergence, Benchmarks, Benchmark)
