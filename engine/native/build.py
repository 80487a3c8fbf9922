"""Build the native kernels in place: python -m engine.native.build [--quiet]

Configures and builds engine/native/CMakeLists.txt with CMake against the MLX and nanobind of
the running Python, then copies the module next to this file. Needs a C++20 compiler and
CMake (Debian: build-essential cmake). Exits non-zero with the compiler's output on failure.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
MODULE = "_kernels"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quiet", action="store_true", help="print only the result line")
    args = ap.parse_args()
    cmake = shutil.which("cmake")
    if cmake is None:
        print("native build: cmake not found (Debian: apt-get install cmake build-essential)",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    BUILD_DIR.mkdir(exist_ok=True)
    steps = [
        ("configuring", [cmake, "-S", str(HERE), "-B", str(BUILD_DIR),
                         f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]),
        ("compiling", [cmake, "--build", str(BUILD_DIR), "--parallel", "2"]),
    ]
    for what, command in steps:
        if not args.quiet:
            print(f"native build: {what}...", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
            print(f"native build: {what} failed (exit {done.returncode})", file=sys.stderr)
            return 1
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = glob.glob(str(BUILD_DIR / f"{MODULE}*{suffix}"))
    if not built:
        print(f"native build: no {MODULE}{suffix} in {BUILD_DIR}", file=sys.stderr)
        return 1
    target = HERE / Path(built[0]).name
    # Copy, then rename over the old one: a running process that has the old module mapped
    # keeps its file, instead of seeing it rewritten under it.
    partial = target.with_name(target.name + ".partial")
    shutil.copy2(built[0], partial)
    partial.replace(target)
    # Import it in a fresh interpreter: a module built against another MLX fails here, not
    # in the middle of a forward pass.
    check = subprocess.run([sys.executable, "-c", "import engine.native as n, sys; "
                            "sys.exit(0 if n.paged_attention() else n.why_not())"],
                           cwd=HERE.parent.parent, capture_output=True, text=True)
    if check.returncode != 0:
        print(f"native build: built, but it does not load: {check.stderr.strip()}",
              file=sys.stderr)
        return 1
    print(f"native build: {target.name} ready ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
