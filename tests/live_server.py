"""A real uvicorn server on a free loopback port, in a thread, for tests that need HTTP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from app.db import Recorder, open_database


@contextmanager
def serving(app, timeout: float = 20.0) -> Iterator[str]:
    """Run `app` until the block ends; yields its base URL (http://127.0.0.1:PORT)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held open so nobody can take it meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
        sock.close()
        assert not thread.is_alive(), "server did not stop"


def runs_recorder(path):
    """A recorder_factory for create_app: a Recorder on the SQLite file at `path`, closed (with
    its database) when the app shuts down."""

    @contextmanager
    def factory(settings) -> Iterator[Recorder]:
        with open_database(path) as database:
            recorder = Recorder(database, flush_interval=0.02)
            recorder.start()
            try:
                yield recorder
            finally:
                recorder.close()

    return factory
