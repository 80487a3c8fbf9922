"""`batchscope serve --tensor-parallel-size 2` under MLX's own launcher, `mlx.launch --backend
ring` on loopback (how several machines run it, one host entry each): the launcher runs the
same command as both ranks; rank 0 serves, rank 1 runs its plans. One process's greedy tokens
through the API, both ranks on the dashboard, rank 1 napping while the server idles, and a
clean stop of both."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.testing import FAMILY_CONFIGS, make_family_folder
from tests.distributed_engine import idle_cpu

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
PROMPTS = [[(7 * j) % 300 + 5 for j in range(37)], [(5 * j) % 200 + 9 for j in range(5)]]
MAX_TOKENS = 8


def _two_free_ports() -> int:
    """A port P with P + 1 free too (mlx.launch -p P gives rank r the port P + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pids(root: int) -> dict[int, int]:
    """MLX_RANK -> pid of the launcher's descendants that are ranks (Linux /proc)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(root)], capture_output=True,
                         text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((e[9:] for e in env if e.startswith(b"MLX_RANK=")), None)
        if rank is not None and b"batchscope" in Path(f"/proc/{pid}/cmdline").read_bytes():
            ranks[int(rank)] = pid
        ranks.update(_rank_pids(pid))
    return ranks


@pytest.mark.skipif(sys.platform != "linux", reason="finds the ranks through /proc")
def test_serve_under_mlx_launch_gives_one_process_tokens_and_stops_cleanly(tmp_path):
    module_name, cfg = FAMILY_CONFIGS["llama"]
    folder = make_family_folder(tmp_path / "llama", importlib.import_module(
        f"mlx_lm.models.{module_name}"),
        {**cfg, "hidden_size": 128, "head_dim": 32, "intermediate_size": 256}, scale=3.0)
    ring, http = _two_free_ports(), _free_port()
    log = (tmp_path / "launch.log").open("w")
    launcher = subprocess.Popen(
        ["timeout", "300", str(BIN / "mlx.launch"), "--backend", "ring", "--hosts",
         "127.0.0.1", "-n", "2", "-p", str(ring), "--", str(BIN / "batchscope"), "serve",
         "--model", str(folder), "--weights", "f32", "--tensor-parallel-size", "2", "--port",
         str(http), "--db", str(tmp_path / "runs.db"), "--num-kv-blocks", "64"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60) as client:
            deadline = time.monotonic() + 180
            while True:
                assert launcher.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
                try:
                    if client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the launched server never answered"
                time.sleep(0.5)
            got = []
            for prompt in PROMPTS:
                answer = client.post("/v1/completions", json={
                    "model": folder.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "logprobs": 1,
                    "return_tokens_as_token_ids": True})
                assert answer.status_code == 200, answer.text
                got.append([int(t.removeprefix("token_id:"))
                            for t in answer.json()["choices"][0]["logprobs"]["tokens"]])
            ranks = client.get("/dashboard.json").json()["ranks"]
            pids = _rank_pids(launcher.pid)
            assert sorted(pids) == [0, 1]
            # Idle, rank 1 naps between meetings with rank 0 instead of busy-polling in a
            # broadcast; the next request wakes it.
            time.sleep(0.5)
            idle = idle_cpu(pids[1])
            again = client.post("/v1/completions", json={
                "model": folder.name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert again.status_code == 200, again.text
        assert [(r["rank"], r["port"]) for r in ranks] == [(0, ring), (1, ring + 1)]
        assert all(r["wall_s"] > 0 for r in ranks)
        assert idle < 0.2, f"rank 1 used {idle:.0%} of a core while the server idled"
        os.kill(pids[0], signal.SIGTERM)  # the server's shutdown sends rank 1 the stop plan
        launcher.wait(60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
    text = (tmp_path / "launch.log").read_text()
    assert "rank 1: stopped after" in text, text[-3000:]
    assert "Application shutdown complete" in text

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(EngineConfig(model=str(folder), weights="f32", num_kv_blocks=64)) as engine:
        want = [engine.generate(p, params).token_ids for p in PROMPTS]
    assert got == want
