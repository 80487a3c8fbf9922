"""Native kernels: C++ MLX primitives built on this machine against the installed MLX.

`python -m engine.native.build` (run by scripts/setup.sh) compiles `_kernels`, which holds
two CPU ops for decode rows:

- `paged_decode_attention`: attention that reads keys and values straight from the paged pool;
- `decode_linear`: a float32 linear layer for a few rows that reads each weight row once for all
  of them, with a row's arithmetic independent of the others (batch-invariant).

When it is not built (no compiler, a build failure, or an MLX it was not built against), the
engine falls back to MLX ops and says so at start; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

_module = None
_why_not: str | None = None
_tried = False


def _load():
    global _module, _why_not, _tried
    if not _tried:
        _tried = True
        try:
            import mlx.core  # noqa: F401  (the extension links against MLX's library)

            from engine.native import _kernels
        except ImportError as error:
            _why_not = f"not built ({error}); run: python -m engine.native.build"
        else:
            _module = _kernels
    return _module


def paged_decode_attention() -> Callable | None:
    """The native attention op, or None when it cannot be loaded here (see why_not())."""
    module = _load()
    return module.paged_decode_attention if module else None


def decode_linear() -> Callable | None:
    """The native float32 decode linear op, or None when it cannot be loaded here."""
    module = _load()
    return module.decode_linear if module else None


def why_not() -> str | None:
    """Why the native ops are unavailable, or None when they loaded."""
    _load()
    return _why_not
