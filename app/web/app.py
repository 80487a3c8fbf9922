"""create_app: the Starlette app, with the engine and recorder living in its lifespan.

Everything long-lived is created in the lifespan and put on `app.state` (never module globals),
so every test gets its own engine and two apps can share a process:

    app.state.settings    Settings
    app.state.engine      the started Engine
    app.state.recorder    the recorder, or None
    app.state.session_id  the recorder's session for this engine run, or None
    app.state.runs        RunService (routes submit through it)
    app.state.started_at  epoch seconds
    app.state.templates   the pages' Jinja environment (made with the app, not the lifespan)
    app.state.live_runs   the playground's runs in flight (app/web/pages/playground.py)
    app.state.step_feed   the dashboard's live step feed (app/web/feeds.py)
    app.state.divergence_lab  the divergence page's experiments and worker (closed at shutdown)
    app.state.metrics     the Prometheus collectors (app/web/metrics.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, ExitStack, asynccontextmanager
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from app.runs import Recorder, RunService, kernel_policy, session_config
from app.settings import Settings
from app.web import divergence_lab, feeds, metrics, security
from app.web import render as pages
from app.web.api import messages, openapi
from app.web.api import routes as api
from app.web.pages import benchmarks as benchmarks_page
from app.web.pages import calibration as calibration_page
from app.web.pages import dashboard
from app.web.pages import divergence as divergence_page
from app.web.pages import playground as streams
from app.web.pages import runs as runs_pages
from engine.config import EngineConfig

log = logging.getLogger("batchscope.app")

EngineFactory = Callable[[EngineConfig], Any]  # returns an Engine (started or not)
# Returns a ready recorder (closed with its close() at shutdown), or a context manager that
# yields one (exited at shutdown: lets the factory own a database and close it after).
RecorderFactory = Callable[[Settings], "Recorder | AbstractContextManager[Recorder]"]


def _default_engine(config: EngineConfig) -> Any:
    from app.lab.calibration import saved_thresholds
    from engine.engine import Engine

    # The thresholds `batchscope calibrate` saved: --kernel-policy auto runs with them.
    return Engine(config, thresholds=saved_thresholds())


def _open_recorder(factory: RecorderFactory, settings: Settings, stack: ExitStack) -> Recorder:
    made = factory(settings)
    if isinstance(made, AbstractContextManager):
        return stack.enter_context(made)
    closer = getattr(made, "close", None)
    if closer is not None:
        stack.callback(closer)
    return made


def create_app(settings: Settings, *, engine_factory: EngineFactory | None = None,
               recorder_factory: RecorderFactory | None = None,
               divergence_loader: Any = None) -> Starlette:
    """divergence_loader: weights -> LoadedModel for the divergence page's engines (tests give
    a tiny model); None: the configured model."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = (engine_factory or _default_engine)(settings.engine)
        # Loading the model takes seconds: keep the event loop free meanwhile.
        await anyio.to_thread.run_sync(engine.start)
        recorder = session_id = unsubscribe = None
        stack = ExitStack()  # closes the recorder (and whatever its factory opened)
        try:
            if recorder_factory is not None:
                recorder = await anyio.to_thread.run_sync(
                    _open_recorder, recorder_factory, settings, stack)
                # Blocking (it returns the new row's id), so off the loop.
                session_id = await anyio.to_thread.run_sync(lambda: recorder.start_session(
                    model=engine.loaded.name, weights=engine.loaded.weights,
                    kernel_policy=kernel_policy(engine), config=session_config(engine)))
                # Called on the engine thread; the recorder only enqueues.
                unsubscribe = engine.subscribe(lambda record: recorder.step(session_id, record))
            runs = RunService(engine, recorder, session_id,
                              max_waiting=settings.max_waiting_requests)
            app.state.settings = settings
            app.state.engine = engine
            app.state.recorder = recorder
            app.state.session_id = session_id
            app.state.runs = runs
            app.state.started_at = time.time()
            app.state.live_runs = streams.LiveRuns()
            app.state.step_feed = feeds.StepFeed(engine)
            lab = app.state.divergence_lab = divergence_lab.Lab(
                settings.engine.model, divergence_loader, getattr(recorder, "database", None))
            stack.callback(lab.close)
            stack.callback(metrics.install(app.state).close)
            log.info("serving %s (%s weights, context %d) with the OpenAI API at /v1",
                     engine.loaded.name, engine.loaded.weights, engine.max_model_len)
            yield
            # Stopping the engine finishes every open request ("cancelled"); let their
            # finishes reach the recorder before it closes.
            await anyio.to_thread.run_sync(engine.stop)
            await runs.drain()
        finally:
            if unsubscribe is not None:
                unsubscribe()
            await anyio.to_thread.run_sync(engine.stop)  # idempotent
            await anyio.to_thread.run_sync(stack.close)

    app = Starlette(routes=list(api.routes) + messages.routes + dashboard.routes + metrics.routes
                    + runs_pages.routes + streams.routes + calibration_page.routes
                    + divergence_page.routes + benchmarks_page.routes + openapi.routes
                    + [Mount("/static", app=StaticFiles(directory=pages.STATIC_DIR),
                             name="static")],
                    exception_handlers=api.exception_handlers, lifespan=lifespan)
    app.state.settings = settings  # routes read limits from here even before startup ends
    # Before startup too: the security middleware renders its login and 403 pages with it.
    app.state.templates = pages.make_templates()
    # API key, login, CSRF, the Host check and security headers.
    security.install(app, settings.api_key, settings.allowed_hosts)
    return app
