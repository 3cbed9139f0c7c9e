"""Lazy access to the compiled extension ``kdtree._verify`` (Cython over the CUDA library).

Nothing imports the extension at ``import kdtree`` time: CPU tensors never need it, and a
source checkout without a build must still import. The first CUDA call (or ``python -m kdtree
info``) loads it through :func:`load`, which turns a missing build into an ImportError that says
what is missing and what still works.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

_module = None
_error = None  # the ImportError of the first failed attempt; later calls re-raise it

_MISSING_MESSAGE = (
    "kdtree._verify, the compiled CUDA extension of kdtree, could not be imported ({cause}). "
    "It is built by `pip install .` (scikit-build-core; needs nvcc and a CUDA toolkit). "
    "CUDA tensors need it; CPU tensors work without it (they go to kdtree.reference)."
)


def load():
    """Return the ``kdtree._verify`` module, importing it on first use.

    Raises ImportError with an explanatory message when the extension is not built (or fails to
    load, e.g. a missing libcudart); the original error is chained as ``__cause__``.
    """
    global _module, _error
    if _module is None:
        if _error is not None:
            raise ImportError(str(_error)) from _error.__cause__
        try:
            _module = importlib.import_module("kdtree._verify")
        except ImportError as exc:
            _error = ImportError(_MISSING_MESSAGE.format(cause=f"{type(exc).__name__}: {exc}"))
            _error.__cause__ = exc
            raise _error from exc
        logger.debug("loaded %s", getattr(_module, "__file__", "kdtree._verify"))
    return _module


def available() -> bool:
    """True when the compiled extension imports."""
    try:
        load()
    except ImportError:
        return False
    return True


class KdtreeErrorUnavailable(RuntimeError):
    """Stands in for ``kdtree._verify.KdtreeError`` when the extension is not built.

    Only there so that ``except kdtree.KdtreeError:`` works in code that runs without the
    extension; nothing raises it (without the extension no kernel status can exist).
    """

    status = 0


def kdtree_error_class():
    """``kdtree._verify.KdtreeError`` when the extension imports, else :class:`KdtreeErrorUnavailable`."""
    try:
        return load().KdtreeError
    except ImportError:
        return KdtreeErrorUnavailable
