"""Patch SGLang in every Python process that ``KDTREE_VERIFY`` asks for, with no edit to SGLang.

``python -m sglang.launch_server`` runs the model in scheduler / TP-worker processes it starts
with multiprocessing *spawn*: fresh interpreters that never see a patch applied in the launching
process. Every such interpreter does run ``site``, which executes the one line of
``kdtree-autopatch.pth`` (installed at the site-packages root with the package)::

    import os; os.environ.get("KDTREE_VERIFY", "").strip().lower() not in ("", "off") and __import__("kdtree._autopatch")

so this module is imported only when ``KDTREE_VERIFY`` is set to something other than off (the
interpreter start costs nothing otherwise). Importing it does not import SGLang or torch: it puts
a meta-path finder in front of ``sys.meta_path`` that lets the normal finders locate
``sglang.srt.layers.attention.triton_backend`` and wraps only that module's loader, so right
after the module has executed, :func:`kdtree.sglang_patch.install` patches its
``TritonAttnBackend`` with the mode from ``KDTREE_VERIFY``. When the module is already imported,
the patch is applied at once. An unknown ``KDTREE_VERIFY`` value makes that import fail with the
ValueError from :func:`kdtree.sglang_patch.parse_mode` (never a silent off).
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV_VAR = "KDTREE_VERIFY"
TARGET = "sglang.srt.layers.attention.triton_backend"


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "off")


def _patch(module) -> None:
    from kdtree import sglang_patch  # imports torch, which SGLang has imported by now

    sglang_patch.install(None, propagate=False, backend_module=module)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader and patches the module once it has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # hand the module its real loader back before it runs (get_source, resources, reloads)
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        if _wanted():
            _patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of :data:`TARGET` found by the other finders."""

    _kdtree_autopatch = True

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_kdtree_autopatch", False):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def activate() -> bool:
    """Register the import hook (or patch now if SGLang's backend is already imported) when
    ``KDTREE_VERIFY`` is set and not off. Idempotent; returns whether it is active."""
    if not _wanted():
        return False
    module = sys.modules.get(TARGET)
    if module is not None:
        _patch(module)
    if not any(getattr(f, "_kdtree_autopatch", False) for f in sys.meta_path):
        # also for an already-imported module: a later re-import (reload, a test clearing
        # sys.modules) gets patched again
        sys.meta_path.insert(0, PatchOnImport())
    return True


activate()
