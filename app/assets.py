"""Where the app's non-Python files are: templates/, static/ and migrations/.

In the repository they are top-level folders (a checkout, or its editable install). A built
wheel carries them as package data inside this package, in app/_assets/ (pyproject.toml maps
the folders there), so an installed server needs no checkout. Callers get real directory
paths: Jinja's FileSystemLoader, Starlette's StaticFiles and Alembic's script_location all
read the file system.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

NAMES = ("templates", "static", "migrations")


def asset_dir(name: str) -> Path:
    """The folder `name` (one of NAMES): the wheel's copy if installed, else the checkout's."""
    if name not in NAMES:
        raise ValueError(f"unknown asset folder {name!r}; expected one of {NAMES}")
    package = Path(str(files("app")))
    packaged = package / "_assets" / name
    if packaged.is_dir():
        return packaged
    # A checkout: the folder sits next to app/, at the root that has pyproject.toml. Checking
    # for the root keeps an installed copy from picking up an unrelated site-packages/static.
    root = package.parent
    if (root / "pyproject.toml").is_file() and (root / name).is_dir():
        return root / name
    raise FileNotFoundError(f"batchscope's {name}/ folder is missing: not in {packaged} (an "
                            f"installed wheel) nor in {root / name} (a checkout); reinstall "
                            "batchscope")


def templates_dir() -> Path:
    return asset_dir("templates")


def static_dir() -> Path:
    return asset_dir("static")


def migrations_dir() -> Path:
    return asset_dir("migrations")
