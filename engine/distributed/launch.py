"""Ranks on this machine over MLX's ring backend: ports, hostfile, start-up and shutdown.

`start_ranks` is rank 0's side: it picks free loopback ports, writes the ring hostfile (one
`["127.0.0.1:port"]` entry per rank), starts ranks 1..N-1 as child processes with
MLX_RANK/MLX_HOSTFILE set before they initialise MLX's distributed group, and joins as rank 0.
`join` is a child's side, and `join_from_env` that of a process started by `mlx.launch`, which
sets those two variables itself (`launched_rank` tells whether it did).

The ring backend never gives up on a peer that does not connect (the accepting side waits in
accept forever, holding the interpreter lock), so start-up is bounded twice: rank 0 joins only
once every child has marked in the run folder that it started (a DistributedError names the
ranks that did not within the timeout, or exited), and the join itself is bounded by a
watchdog that ends the process (`_init`). Children die with their parent (Linux:
PR_SET_PDEATHSIG) and are stopped by `RankProcesses.stop`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


def _init(timeout: float, rank: int) -> mx.distributed.Group:
    """mx.distributed.init(ring) for at most `timeout` seconds. init holds the interpreter
    lock while it waits for peers (no Python thread runs meanwhile), so the limit is
    faulthandler's watchdog, which runs without it: past the limit it prints every thread's
    stack and ends the process with status 1, after the line below says why."""
    print(f"rank {rank}: joining the ring; past {timeout:g} s without every peer this process "
          "exits", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: joining the ring failed: {e}") from e
    finally:
        faulthandler.cancel_dump_traceback_later()


def _set_rank_env(rank: int, hostfile: Path | str) -> None:
    # Read by the ring backend at its first init, so they are set before it.
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)


def join(rank: int, hostfile: Path | str, run_dir: Path | str | None = None,
         timeout: float = DEFAULT_START_TIMEOUT) -> mx.distributed.Group:
    """Join the ring as `rank` (a child started by start_ranks marks in run_dir that it
    started, just before)."""
    if run_dir is not None:
        (Path(run_dir) / f"rank{rank}.started").touch()
    _set_rank_env(rank, hostfile)
    group = _init(timeout, rank)
    if group.rank() != rank:
        raise DistributedError(f"joined as rank {group.rank()}, expected {rank}")
    return group


def launched_rank() -> int | None:
    """This process's rank where a launcher (mlx.launch --backend ring, or by hand) set
    MLX_RANK and MLX_HOSTFILE; None where it did not."""
    rank, hostfile = os.environ.get("MLX_RANK"), os.environ.get("MLX_HOSTFILE")
    if not rank:
        return None
    if not hostfile:  # JACCL, NCCL and MPI launches set a rank but no ring hostfile
        raise DistributedError("MLX_RANK is set without MLX_HOSTFILE: ranks join over MLX's "
                               "ring backend only (mlx.launch --backend ring); JACCL, NCCL "
                               "and MPI launches are not supported")
    try:
        return int(rank)
    except ValueError:
        raise DistributedError(f"MLX_RANK must be an integer, got {rank!r}") from None


def hostfile_ports(path: Path | str) -> list[int]:
    """Each rank's port in a ring hostfile (its first address's; 0 where it names none)."""
    ports = []
    for entry in json.loads(Path(path).read_text(encoding="utf-8")):
        first = entry[0] if isinstance(entry, list) and entry else entry
        port = str(first).rsplit(":", 1)[-1] if isinstance(first, str) else ""
        ports.append(int(port) if port.isdigit() else 0)
    return ports


def join_from_env(timeout: float = DEFAULT_START_TIMEOUT) -> mx.distributed.Group:
    """Join as the rank mlx.launch (or a hand-written launch) set in MLX_RANK / MLX_HOSTFILE."""
    rank = launched_rank()
    if rank is None:
        raise DistributedError("MLX_RANK not set: start the ranks with mlx.launch --backend "
                               "ring, or set MLX_RANK and MLX_HOSTFILE before starting")
    return _init(timeout, rank)


def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM when the parent dies, so no rank outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@dataclass
class RankProcesses:
    """Ranks 1..N-1 as child processes of rank 0, and the run folder of their marks."""

    run_dir: Path
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)
    # rank -> the write end of its doorbell: a pipe the child blocks on before each plan
    # broadcast (worker.py), since the ring's sockets busy-poll while a collective waits.
    doorbells: dict[int, int] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    def ring(self) -> None:
        """Wake every child for the plan broadcast that follows (one byte each). A child that
        is gone is left to the caller's watch on exits."""
        for fd in self.doorbells.values():
            try:
                os.write(fd, b"\x01")
            except OSError:  # BrokenPipeError: the child exited
                pass

    def exited(self) -> dict[int, int]:
        """rank -> exit status (negative: the signal) of the children that have exited."""
        return {r: p.returncode for r, p in self.processes.items() if p.poll() is not None}

    def describe_exits(self) -> str | None:
        """The exited ranks in words (None: all alive)."""
        exited = self.exited()
        if not exited:
            return None
        return "; ".join(f"rank {r} exited ({_status(code)})" for r, code in sorted(exited.items()))

    def not_started(self) -> list[int]:
        """The children that have not marked that they started."""
        return [r for r in sorted(self.processes)
                if not (self.run_dir / f"rank{r}.started").exists()]

    def wait_started(self, timeout: float) -> None:
        """Until every child has started: DistributedError naming those that exited first,
        or those that did not start within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.not_started():
            exits = self.describe_exits()
            if exits is not None:
                raise DistributedError(f"{exits} before the ring formed")
            if time.monotonic() > deadline:
                names = ", ".join(f"rank {r}" for r in self.not_started())
                raise DistributedError(f"{names} did not start within {timeout:g} s")
            time.sleep(0.05)

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
        for fd in self.doorbells.values():
            os.close(fd)
        self.doorbells.clear()
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
    """Start ranks 1..size-1 as `command` + ["--rank", r, "--hostfile", h, "--run-dir", d,
    "--doorbell", fd] (engine/distributed/worker.py's arguments; fd: the read end of the
    child's doorbell pipe, RankProcesses.ring) and join as rank 0. Within `timeout` seconds
    every child must start, else DistributedError naming those that did not (and every child
    is stopped); a child that exits first is named at once. Then the join (`_init`)."""
    if size < 2:
        raise ValueError(f"tensor parallelism needs at least 2 ranks, got {size}")
    tmp = tempfile.TemporaryDirectory(prefix="batchscope-ranks-")
    run_dir = Path(tmp.name)
    hostfile = write_hostfile(run_dir / "hostfile.json", free_ports(size))
    ranks = RankProcesses(run_dir, _tmp=tmp)
    child_env = {**os.environ, **(env or {})}
    try:
        for r in range(1, size):
            bell, ranks.doorbells[r] = os.pipe()
            try:
                ranks.processes[r] = subprocess.Popen(
                    [*command, "--rank", str(r), "--hostfile", str(hostfile), "--run-dir",
                     str(run_dir), "--doorbell", str(bell)], env=child_env, pass_fds=(bell,),
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            finally:
                os.close(bell)  # the child's end
        t0 = time.monotonic()
        ranks.wait_started(timeout)
        _set_rank_env(0, hostfile)
        group = _init(max(1.0, timeout - (time.monotonic() - t0)), 0)
    except BaseException:
        for p in ranks.processes.values():
            p.kill()
        ranks.stop()
        raise
    return group, ranks
