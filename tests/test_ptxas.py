"""ptxas must not serialise the wgmma of any sm_90a kernel (CPU only: nvcc, no GPU).

ptxas reports serialised wgmma as an info line, not a warning ("(C7510) Potential Performance Loss: wgmma.mma_async
instructions are serialized due to ..."; C7515 / C7518 / C7520 for other causes), so --warning-as-error does not catch
it. A printf inside a kernel is a function call and does just that, so a TRACE build that printed from the kernels
would time S with its wgmma serialised, not the real kernel. tools/wgmma_check.sh compiles the CUDA source as CMake
does for sm_90a and fails on any such line; this runs it on the default build and on the TRACE build. (Spills in the
default build fail the build itself: ci/install.sh builds with KDTREE_SPILLS_ARE_ERRORS=ON.)
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags", [[], ["-DKDTREE_EXP_TRACE"]], ids=["default", "trace"])
def test_no_kernel_serialises_its_wgmma(flags):
    if not (shutil.which("nvcc") or os.access("/usr/local/cuda/bin/nvcc", os.X_OK)):
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin)")
    out = subprocess.run(["bash", str(ROOT / "tools" / "wgmma_check.sh"), *flags], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.startswith("wgmma not serialised"), out.stdout
