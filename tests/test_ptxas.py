"""ptxas must not serialise the wgmma of any sm_90a kernel, nor spill registers in any kernel (CPU only: nvcc, no GPU).

ptxas reports serialised wgmma as an info line, not a warning ("(C7510) Potential Performance Loss: wgmma.mma_async
instructions are serialized due to ..."; C7515 / C7518 / C7520 for other causes), so --warning-as-error does not catch
it. A printf inside a kernel is a function call and does just that, so a TRACE build that printed from the kernels
would time S with its wgmma serialised, not the real kernel. tools/wgmma_check.sh compiles the CUDA source as CMake
does for sm_90a and fails on any such line; this runs it on the default build and on the TRACE build. (Spills in the
default build are checked below, per kernel and architecture.)
"""

import os
import re
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


# The one allowed spill: the FP8 kernel compiled for sm_90a, the stand-in that runs the sm_120 code path on an H100/H200
# (ptxas emulates its e4m3 mma.sync with f16 operands in registers, which a 168-register thread cannot hold at every
# point). The same kernel on sm_120a, what RTX PRO 6000 runs, must not spill; nor may any other.
SPILL_ALLOWANCE = {("sm_90a", "_ZN6kdtree30kdtree_verify_split_fp8_kernelENS_6ParamsE"): 64}


def _nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin)")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_no_kernel_spills(arch, tmp_path):
    """Registers and spills of every kernel, as the default build compiles them (CMake's flags for that architecture)."""
    defs = ["-DKDTREE_HAVE_SM90A=1"] if arch == "sm_90a" else []
    cmd = [_nvcc(), "-std=c++17", "-O3", "--expt-relaxed-constexpr", *defs,
           f"--generate-code=arch=compute_{arch[3:]},code={arch}", f"-I{ROOT / 'src' / 'cuda'}", "-Xptxas", "-v",
           "-c", str(ROOT / "src" / "cuda" / "verify_launch.cu"), "-o", str(tmp_path / "v.o")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    spills, kernel = {}, None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            kernel = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and kernel:
            spills[kernel] = max(int(m.group(1)), int(m.group(2)))
    assert any("split_fp8_kernel" in k for k in spills) and any("combine_kernel" in k for k in spills), spills
    bad = {k: v for k, v in spills.items() if v > SPILL_ALLOWANCE.get((arch, k), 0)}
    assert not bad, f"{arch}: kernels that spill (bytes): {bad}"
