"""Test-session setup. Registers nothing that hides failures (no warning filters, no xfail).

Without CUDA, SGLang's Triton kernels can only run in Triton's interpreter, and that is chosen when
a kernel is decorated, i.e. when the module defining it is imported: so TRITON_INTERPRET=1 is set
here, before any test module (or sglang) imports triton.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    # torch does not import triton on a CPU build; triton reads the knob lazily, at decoration.
    os.environ["TRITON_INTERPRET"] = "1"

# tests/ on sys.path so that `from sglang_env import import_sglang` works under any rootdir.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)

import pytest  # noqa: E402

# the markers (gpu, slow) are registered in pyproject.toml [tool.pytest.ini_options]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def sg_patch(monkeypatch):
    """kdtree.sglang_patch with SGLang imported and unpatched, $KDTREE_VERIFY unset; afterwards
    uninstalled again, and SGLang's own forward_extend back on the class."""
    from kdtree import sglang_patch
    from sglang_env import import_sglang

    monkeypatch.delenv("KDTREE_VERIFY", raising=False)
    cls = import_sglang().triton_backend.TritonAttnBackend
    sglang_patch.uninstall()
    sglang_patch.reset_stats()
    original = cls.__dict__["forward_extend"]
    assert not getattr(original, "_kdtree_wrapper", False)
    yield sglang_patch
    sglang_patch.uninstall()
    sglang_patch.reset_stats()
    assert cls.__dict__["forward_extend"] is original
