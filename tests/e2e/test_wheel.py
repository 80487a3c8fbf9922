"""The built wheel works without the checkout: templates, static files, migrations and the
native kernel sources ship inside it, and an installed `batchscope serve` finds them.

Slow: builds the wheel, installs it in a fresh virtual environment and starts
`batchscope serve` (the embedded model) from there, in a directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ("templates", "static", "migrations")  # shipped as app/_assets/<name>/
CODE = ("app", "engine")


def checkout_files() -> list[str]:
    """The files a clean checkout has: tracked ones and new ones not yet added, never ignored
    build outputs (engine/native/build/, the built kernel module, *.egg-info)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    return sorted(f for f in listed.stdout.decode().split("\0") if f and (ROOT / f).is_file())


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from app.db.database import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def clean_env() -> dict[str, str]:
    """This environment minus what could point the installed copy back at the checkout (or
    change what it serves); the calibration directory the suite sets stays."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
            and (not k.startswith("BATCHSCOPE_") or k == "BATCHSCOPE_CALIBRATION_DIR")}


def run(args: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    return done


def test_every_package_is_listed_in_pyproject():
    """pyproject.toml lists packages by hand (see its comment): a new one must be added."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(Path(f).parent.parts) for f in checkout_files()
             if f.endswith("/__init__.py") and f.split("/")[0] in CODE}
    assert found - listed == set(), "packages missing from pyproject.toml's packages list"
    mapped = {config["package-dir"][f"app._assets.{name}"] for name in ASSETS}
    assert mapped == set(ASSETS)


@pytest.mark.slow
def test_the_installed_wheel_serves_pages_static_files_and_migrations(tmp_path):
    files = checkout_files()
    # Build from a copy of the checkout: an in-tree build would leave build/ and *.egg-info
    # behind, and stray ignored files (a built kernel module) must not reach the wheel.
    src = tmp_path / "src"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    # No isolation and no index: the build uses this environment's setuptools (test extras).
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--check-build-dependencies", "--no-index", "-q", "-w", dist, src], cwd=tmp_path)
    (wheel,) = dist.glob("batchscope-*.whl")

    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    wanted = {f"app/_assets/{f}" for f in files if f.split("/")[0] in ASSETS}
    wanted |= {f for f in files if f.split("/")[0] in CODE and f.endswith(".py")}
    wanted |= {f for f in files if f.startswith("engine/native/")}  # kernel sources, CMake
    assert sorted(wanted - shipped) == [], "files missing from the wheel"
    assert not [n for n in shipped if n.endswith((".so", ".pyd", ".dylib"))]

    # A fresh environment that sees the checkout nowhere: the dependencies come from this
    # one's site-packages through a .pth line (whose own .pth files, the editable install's
    # finder among them, Python does not run), batchscope from the wheel alone.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_batchscope_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "-q", wheel], cwd=tmp_path)

    work = tmp_path / "work"  # outside the checkout
    work.mkdir()
    where = json.loads(run([python, "-c", (
        "import json, app, engine, engine.native.build as b, app.assets as a; "
        "print(json.dumps([app.__file__, engine.__file__, str(b.HERE), "
        "*(str(a.asset_dir(n)) for n in a.NAMES)]))")], cwd=work).stdout)
    for path in where:
        assert Path(path).is_relative_to(site), f"{path} is not the installed copy"
    assert (site / "engine" / "native" / "CMakeLists.txt").is_file()

    head = head_revision()
    batchscope = venv / "bin" / "batchscope"
    upgraded = work / "upgraded.db"
    out = run([batchscope, "db", "upgrade", "--db", upgraded], cwd=work).stdout
    assert f"at schema revision {head}" in out
    assert db_revision(upgraded) == head

    served = work / "served.db"
    log_path = work / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(batchscope), "serve", "--host", "127.0.0.1", "--port", "0",
                                 "--db", str(served), "--num-kv-blocks", "64"],
                                cwd=work, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            url = wait_for_url(proc, log_path, timeout=90)
            with httpx.Client(base_url=url, timeout=60) as client:
                check_pages(client)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert db_revision(served) == head
    conn = sqlite3.connect(served)
    try:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    finally:
        conn.close()


def check_pages(client: httpx.Client) -> None:
    """The playground and the dashboard render (templates), what they link under /static/
    is served (static files), and a completion is recorded (the migrated schema)."""
    page = client.get("/")
    assert page.status_code == 200, page.text[:500]
    assert "<title>Playground" in page.text
    linked = set(re.findall(r'(?:src|href)="(/static/[^"?#]+)', page.text))
    assert {"/static/app.css"} < linked and any("/vendor/htmx" in u for u in linked), linked
    for path in sorted(linked):
        r = client.get(path)
        assert r.status_code == 200 and r.content, path
    dashboard = client.get("/dashboard")
    assert dashboard.status_code == 200, dashboard.text[:500]
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                             "temperature": 0})
    assert r.status_code == 200, r.text


def wait_for_url(proc: subprocess.Popen, log_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = log_path.read_bytes().decode(errors="replace")
        match = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", text)
        if match:
            return match.group(1)
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"server did not start:\n{text[-4000:]}"
        time.sleep(0.1)


def db_revision(path: Path) -> str | None:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    finally:
        conn.close()
    return row[0] if row else None
