"""Two `batchscope serve` processes recording into one PostgreSQL runs database: each serves a
request, and each one's runs page (its JSON twin) lists both. Slow: starts the server twice."""

from __future__ import annotations

import time

import httpx
import pytest
from server_process import ServerProcess

from tests.postgres import cluster

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-kv-blocks", "64"]
MARK = "sharedhistory"


def listed(url: str) -> int:
    return httpx.get(f"{url}/runs.json", params={"q": MARK}, timeout=30).json()["total"]


def test_two_servers_record_into_one_history_and_each_lists_both(tmp_path):
    with cluster() as postgres:
        db = postgres.create_database()
        servers = [ServerProcess(db, tmp_path / f"serve{i}.log", SERVER_ARGS) for i in range(2)]
        try:
            for server in servers:
                server.start()
            for i, server in enumerate(servers):
                r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                    "prompt": f"{MARK} {i}: once upon a time", "max_tokens": 4,
                    "temperature": 0})
                assert r.status_code == 200, r.text
            # The recorder writes behind the response: wait for both runs on both servers.
            deadline = time.monotonic() + 30
            while [listed(s.url) for s in servers] != [2, 2]:
                assert time.monotonic() < deadline, [listed(s.url) for s in servers]
                time.sleep(0.2)
        finally:
            logs = [s.log() for s in servers]
            codes = [s.stop() for s in servers]
        assert codes == [0, 0], logs
