"""Ranks on this machine over MLX's ring backend: ports, hostfile, start-up and shutdown.

`start_ranks` is rank 0's side: it picks free loopback ports, writes the ring hostfile (one
`["127.0.0.1:port"]` entry per rank), starts ranks 1..N-1 as child processes with
MLX_RANK/MLX_HOSTFILE set before they initialise MLX's distributed group, and joins as rank 0.
`join` is a child's side, and `join_from_env` that of a process started by `mlx.launch`, which
sets those two variables itself.

The ring backend never gives up on a peer that does not connect (the accepting side waits in
accept forever), so every join here runs under a timeout: the error names the ranks that did
not join and whether their process started at all. Each child marks in a run folder that it
started and that it joined; rank 0 reads the marks to name the ones missing. Children die with
their parent (Linux: PR_SET_PDEATHSIG) and are stopped by `RankProcesses.stop`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

DEFAULT_START_TIMEOUT = 60.0  # seconds for every rank to join the group
STOP_TIMEOUT = 10.0  # seconds a rank gets to exit after the stop plan before it is killed


class DistributedError(RuntimeError):
    """The ranks cannot go on: one did not start or join in time, exited, or was lost."""


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (held open together, so never the same one twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_hostfile(path: Path, ports: Sequence[int]) -> Path:
    """The ring backend's hostfile: rank r listens on 127.0.0.1:ports[r]."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]), encoding="utf-8")
    return path


def _init_within(timeout: float, why_not: Callable[[], str | None] = lambda: None,
                 late: Callable[[], str] = lambda: "") -> mx.distributed.Group:
    """mx.distributed.init(ring) in a thread, waited for at most `timeout` seconds;
    why_not() is asked every 50 ms for a reason to stop waiting (a child that exited), late()
    for who is missing when the time is up."""
    done: dict[str, object] = {}

    def init() -> None:
        try:
            done["group"] = mx.distributed.init(strict=True, backend="ring")
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            done["error"] = e

    # A daemon thread: a peer that never connects leaves it blocked in accept for good.
    thread = threading.Thread(target=init, name="ring-init", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.05)
        reason = why_not()
        if reason is not None and thread.is_alive():
            raise DistributedError(reason)
    if "error" in done:
        raise DistributedError(f"joining the ring failed: {done['error']}") from done["error"]
    if "group" not in done:
        raise DistributedError(f"the ring did not form within {timeout:g} s{late()}")
    return done["group"]


def _set_rank_env(rank: int, hostfile: Path | str) -> None:
    # Read by the ring backend at its first init, so they are set before it.
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)


def join(rank: int, hostfile: Path | str, run_dir: Path | str | None = None,
         timeout: float = DEFAULT_START_TIMEOUT) -> mx.distributed.Group:
    """Join the ring as `rank` (a child started by start_ranks: it marks in run_dir that it
    started, then that it joined)."""
    marks = Path(run_dir) if run_dir is not None else None
    if marks is not None:
        (marks / f"rank{rank}.started").touch()
    _set_rank_env(rank, hostfile)
    group = _init_within(timeout)
    if group.rank() != rank:
        raise DistributedError(f"joined as rank {group.rank()}, expected {rank}")
    if marks is not None:
        (marks / f"rank{rank}.joined").touch()
    return group


def join_from_env(timeout: float = DEFAULT_START_TIMEOUT) -> mx.distributed.Group:
    """Join as the rank mlx.launch (or a hand-written launch) set in MLX_RANK / MLX_HOSTFILE."""
    missing = [k for k in ("MLX_RANK", "MLX_HOSTFILE") if not os.environ.get(k)]
    if missing:
        raise DistributedError(f"{' and '.join(missing)} not set: start the ranks with "
                               "mlx.launch --backend ring, or set both before starting")
    try:
        return _init_within(timeout)
    except DistributedError as e:
        raise DistributedError(f"rank {os.environ['MLX_RANK']} "
                               f"(hostfile {os.environ['MLX_HOSTFILE']}): {e}") from e


def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM when the parent dies, so no rank outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@dataclass
class RankProcesses:
    """Ranks 1..N-1 as child processes of rank 0, and the run folder of their marks."""

    run_dir: Path
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    def exited(self) -> dict[int, int]:
        """rank -> exit status (negative: the signal) of the children that have exited."""
        return {r: p.returncode for r, p in self.processes.items() if p.poll() is not None}

    def describe_exits(self) -> str | None:
        """The exited ranks in words (None: all alive)."""
        exited = self.exited()
        if not exited:
            return None
        return "; ".join(f"rank {r} exited ({_status(code)})" for r, code in sorted(exited.items()))

    def not_joined(self) -> str:
        """The children that did not join, and whether their process started at all."""
        missing = []
        for r in sorted(self.processes):
            if not (self.run_dir / f"rank{r}.joined").exists():
                started = (self.run_dir / f"rank{r}.started").exists()
                how = "started, not connected" if started else "never started"
                missing.append(f"rank {r} ({how})")
        return ", ".join(missing) or "none"

    def stop(self, timeout: float = STOP_TIMEOUT) -> dict[int, int]:
        """Wait up to `timeout` s for every child to exit, then kill the rest; returns
        rank -> exit status."""
        deadline = time.monotonic() + timeout
        for p in self.processes.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return {r: p.returncode for r, p in self.processes.items()}


def _status(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def start_ranks(size: int, command: Sequence[str], timeout: float = DEFAULT_START_TIMEOUT,
                env: dict[str, str] | None = None) -> tuple[mx.distributed.Group, RankProcesses]:
    """Start ranks 1..size-1 as `command` + ["--rank", r, "--hostfile", h, "--run-dir", d]
    (engine/distributed/worker.py's arguments) and join as rank 0. Within `timeout` seconds
    every rank must join, else DistributedError naming the ranks that did not (and every child
    is stopped); a child that exits first is named at once."""
    if size < 2:
        raise ValueError(f"tensor parallelism needs at least 2 ranks, got {size}")
    tmp = tempfile.TemporaryDirectory(prefix="batchscope-ranks-")
    run_dir = Path(tmp.name)
    hostfile = write_hostfile(run_dir / "hostfile.json", free_ports(size))
    ranks = RankProcesses(run_dir, _tmp=tmp)
    child_env = {**os.environ, **(env or {})}
    try:
        for r in range(1, size):
            ranks.processes[r] = subprocess.Popen(
                [*command, "--rank", str(r), "--hostfile", str(hostfile), "--run-dir",
                 str(run_dir)], env=child_env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        _set_rank_env(0, hostfile)

        def why_not() -> str | None:
            exits = ranks.describe_exits()
            return None if exits is None else f"{exits} before the ring formed"

        group = _init_within(timeout, why_not, lambda: f"; not joined: {ranks.not_joined()}")
    except BaseException:
        for p in ranks.processes.values():
            p.kill()
        ranks.stop()
        raise
    return group, ranks
