"""The native ops' worker pool (engine/native/workers.cpp) across a fork: the child has none of
its parent's threads, so it starts a pool of its own, and never inherits the pool's guard
locked."""

from __future__ import annotations

import os
import subprocess
import sys

from native_ops import native_op

FORK_SCRIPT = """
import os, signal
from engine import native
read_bandwidth, _ = native.kernel_timing()
read_bandwidth(1 << 20, 1)  # the parent's pool starts
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a deadlocked child dies instead of hanging the test
    read_bandwidth(1 << 20, 1)
    os._exit(len(os.listdir("/proc/self/task")))  # its threads: this one and the workers
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_starts_workers_of_its_own():
    native_op("decode_quantized_linear")  # skips (fails on CI) where nothing is built
    env = {**os.environ, "BATCHSCOPE_NATIVE_THREADS": "3"}
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT], env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "3", done.stdout + done.stderr  # the caller and 2 workers
