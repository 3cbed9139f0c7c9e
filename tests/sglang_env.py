"""Make the real SGLang (0.5.23, installed with ``--no-deps``) importable inside the tests.

SGLang is never vendored: this module only prepares the interpreter so that the installed
package's Triton attention backend, MLA KV pool and forward-batch types import on a machine
without the full serving stack.

* CPU (CI): PyPI's ``torchvision`` is a CUDA build that fails beside CPU torch, and SGLang imports
  it from modules the attention backend pulls in (multimodal configs). A meta-path finder returns
  ``MagicMock`` modules for ``torchvision`` and its submodules. It is installed *after*
  ``import transformers.utils.import_utils`` so that transformers computes its
  "is torchvision available" flags from the real environment, not from the stub.
  With ``TRITON_INTERPRET=1`` (tests/conftest.py sets it before anything imports triton)
  SGLang's Triton kernels run interpreted on CPU tensors.
* GPU machine: ``source .carry/sglang/activate`` (see /work/shared/SGLANG.md); the bundle's
  ``sitecustomize`` stubs ``sgl_kernel``, nothing else is needed here.

Usage::

    from sglang_env import import_sglang
    sg = import_sglang()            # pytest.skip()s with a reason when sglang is not installed
    sg.extend_attention_fwd(...)
    sg.triton_backend.TritonAttnBackend
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from unittest import mock

import pytest

#: The SGLang release the contract (SGLANG.md) was read from.
SGLANG_VERSION = "0.5.23"

_STUB_ROOTS = ("torchvision",)


class _MockModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder returning MagicMock modules for the given top-level package names."""

    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []
        module.__spec__ = spec
        module.__name__ = spec.name
        module.__loader__ = self
        return module

    def exec_module(self, module):
        pass


def _stubs_installed() -> bool:
    return any(isinstance(f, _MockModuleFinder) for f in sys.meta_path)


def _torchvision_usable() -> bool:
    """True when a real torchvision can be used: installed, and torch has CUDA (the PyPI wheel
    is a CUDA build that fails to load its ops beside a CPU-only torch)."""
    import torch

    if "torchvision" in sys.modules and not isinstance(sys.modules["torchvision"], mock.MagicMock):
        return True
    return importlib.util.find_spec("torchvision") is not None and torch.cuda.is_available()


def _install_stubs() -> None:
    # transformers first: it records which optional packages exist when this module loads.
    importlib.import_module("transformers.utils.import_utils")
    if _stubs_installed() or _torchvision_usable():
        return
    for name in [m for m in sys.modules if m.split(".")[0] in _STUB_ROOTS]:
        del sys.modules[name]  # a half-imported real torchvision must not shadow the stub
    sys.meta_path.insert(0, _MockModuleFinder(_STUB_ROOTS))


@functools.lru_cache(maxsize=None)
def _load() -> types.SimpleNamespace:
    import torch

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23 + SGLANG.md's list)")
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (needed to import sglang)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET!=1: SGLang's Triton kernels cannot run "
                    "(tests/conftest.py sets it before triton is imported)")
    _install_stubs()

    import sglang

    ext = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
    ns = types.SimpleNamespace(
        version=sglang.__version__,
        extend_attention_fwd=ext.extend_attention_fwd,
        extend_attention=ext,
        triton_backend=importlib.import_module("sglang.srt.layers.attention.triton_backend"),
        memory_pool=importlib.import_module("sglang.srt.mem_cache.memory_pool"),
        forward_batch_info=importlib.import_module("sglang.srt.model_executor.forward_batch_info"),
        radix_attention=importlib.import_module("sglang.srt.layers.radix_attention"),
        runtime_context=importlib.import_module("sglang.srt.runtime_context"),
    )
    return ns


def import_sglang() -> types.SimpleNamespace:
    """Import the real SGLang and return its pieces the tests use.

    Returns a namespace with ``version``, ``extend_attention_fwd`` (the Triton extend kernel
    entry), and the modules ``extend_attention``, ``triton_backend`` (``TritonAttnBackend``,
    ``ForwardMetadata``), ``memory_pool`` (``MLATokenToKVPool``), ``forward_batch_info``
    (``ForwardMode``), ``radix_attention`` (``RadixAttention``) and ``runtime_context``
    (``get_parallel``). Calls ``pytest.skip`` with the reason when SGLang cannot be imported
    here; any other import error propagates (a broken environment must fail, not skip).
    """
    return _load()
