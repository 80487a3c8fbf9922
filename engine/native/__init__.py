"""Native kernels: C++ MLX primitives built on this machine against the installed MLX.

`python -m engine.native.build` (run by scripts/setup.sh) compiles `_paged_attention`, the
CPU decode attention that reads keys and values straight from the paged pool. When it is not
built (no compiler, a build failure, or an MLX it was not built against), the engine falls
back to attention in MLX ops and says so at start; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

_kernel: Callable | None = None
_why_not: str | None = None
_tried = False


def paged_decode_attention() -> Callable | None:
    """The native op, or None when it cannot be loaded here (see why_not())."""
    global _kernel, _why_not, _tried
    if not _tried:
        _tried = True
        try:
            import mlx.core  # noqa: F401  (the extension links against MLX's library)

            from engine.native._paged_attention import paged_decode_attention as kernel
        except ImportError as error:
            _why_not = f"not built ({error}); run: python -m engine.native.build"
        else:
            _kernel = kernel
    return _kernel


def why_not() -> str | None:
    """Why the native op is unavailable, or None when it loaded."""
    paged_decode_attention()
    return _why_not
