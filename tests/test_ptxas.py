"""ptxas must not serialise the wgmma of any sm_90a kernel, nor spill registers in any kernel, and the sm_120a FP8 kernel
must run the block-scaled e4m3 MMA (CPU only: nvcc and cuobjdump, no GPU).

ptxas reports serialised wgmma as an info line, not a warning ("(C7510) Potential Performance Loss: wgmma.mma_async
instructions are serialized due to ..."; C7515 / C7518 / C7520 for other causes), so --warning-as-error does not catch
it. A printf inside a kernel is a function call and does just that, so a TRACE build that printed from the kernels
would time S with its wgmma serialised, not the real kernel. tools/wgmma_check.sh compiles the CUDA source as CMake
does for sm_90a and fails on any such line; this runs it on the default build and on the TRACE build. (Spills in the
default build are checked below, per kernel and architecture.)
"""

import re
import subprocess
from pathlib import Path

import pytest
from cuda_tools import nvcc_or_skip, sass_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags", [[], ["-DKDTREE_EXP_TRACE"]], ids=["default", "trace"])
def test_no_kernel_serialises_its_wgmma(flags):
    nvcc_or_skip()
    out = subprocess.run(["bash", str(ROOT / "tools" / "wgmma_check.sh"), *flags], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.startswith("wgmma not serialised"), out.stdout


# The allowed spills: the FP8 kernel compiled for sm_90a, the stand-in that runs the sm_120 code path on an H100/H200
# (ptxas emulates its e4m3 mma.sync with f16 operands in registers, which a 168-register thread cannot hold at every
# point). The same FP8 kernel on sm_120a, what RTX PRO 6000 runs, must not spill; nor may any other.
SPILL_ALLOWANCE = {("sm_90a", "_ZN6kdtree30kdtree_verify_split_fp8_kernelENS_6ParamsE"): 64}

# Kernels whose warpgroups trade registers by setmaxnreg: the registers a thread that ptxas gives the launch, which the
# kernel's pool arithmetic assumes (verify_dual.cuh and verify_skinny_fp8.cuh, kLaunchRegs). With fewer,
# setmaxnreg.inc waits forever for registers the block never had (ptxas gives 96, not 120, to 544 threads: it counts
# whole warpgroups).
LAUNCH_REGISTERS = {"_ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb0EEEvNS_6ParamsE": 96,
                    "_ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb1EEEvNS_6ParamsE": 128,
                    "_ZN6kdtree3sk837kdtree_verify_split_skinny_fp8_kernelILi2EEEvNS_6ParamsE": 168}


_COMPILED = {}


def _compiled(arch, tmp_path_factory):
    """verify_launch.cu compiled for one architecture as the default build compiles it (CMake's flags for it): the
    object file and ptxas's -v report. Once per architecture and test session (~1 min each)."""
    if arch not in _COMPILED:
        obj = tmp_path_factory.mktemp(arch) / "v.o"
        defs = ["-DKDTREE_HAVE_SM90A=1"] if arch == "sm_90a" else []
        cmd = [nvcc_or_skip(), "-std=c++17", "-O3", "--expt-relaxed-constexpr", *defs,
               f"--generate-code=arch=compute_{arch[3:]},code={arch}", f"-I{ROOT / 'src' / 'cuda'}", "-Xptxas", "-v",
               "-c", str(ROOT / "src" / "cuda" / "verify_launch.cu"), "-o", str(obj)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-4000:]
        _COMPILED[arch] = (obj, out.stderr)
    return _COMPILED[arch]


def _per_kernel(report, pattern):
    """{mangled kernel name: the last match of `pattern` in its part of ptxas's -v report}."""
    found, kernel = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            kernel = m.group(1)
            continue
        m = re.search(pattern, line)
        if m and kernel:
            found[kernel] = m
    return found


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
def test_no_kernel_spills(arch, tmp_path_factory):
    """Registers and spills of every kernel, as the default build compiles them."""
    _, report = _compiled(arch, tmp_path_factory)
    spills = {k: max(int(m.group(1)), int(m.group(2)))
              for k, m in _per_kernel(report, r"(\d+) bytes spill stores, (\d+) bytes spill loads").items()}
    assert any("split_fp8_kernel" in k for k in spills) and any("combine_kernel" in k for k in spills), spills
    bad = {k: v for k, v in spills.items() if v > SPILL_ALLOWANCE.get((arch, k), 0)}
    assert not bad, f"{arch}: kernels that spill (bytes): {bad}"


def test_setmaxnreg_kernels_launch_with_the_registers_they_share(tmp_path_factory):
    """Would the block's warpgroups deadlock in setmaxnreg.inc? (sm_90a, as the default build compiles it.)"""
    _, report = _compiled("sm_90a", tmp_path_factory)
    used = {k: int(m.group(1)) for k, m in _per_kernel(report, r"Used (\d+) registers").items()}
    assert {k: used.get(k) for k in LAUNCH_REGISTERS} == LAUNCH_REGISTERS


def _sass_of_kernels(obj):
    """{mangled kernel name: its SASS opcodes, one string per instruction} of an object file."""
    sass = sass_command()
    if sass is None:
        pytest.skip("cuobjdump or nvdisasm not found (pip install -r requirements/test.txt; triton carries nvdisasm)")
    argv, env = sass
    text = subprocess.run([*argv, str(obj)], capture_output=True, text=True, check=True, env=env).stdout
    kernels, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            kernels[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m and name:
            kernels[name].append(m.group(1))
    return kernels


def test_fp8_kernel_runs_block_scaled_mma_on_sm120a(tmp_path_factory):
    """RTX PRO 6000 runs the FP8 kernel's products on the block-scaled e4m3 MMA (QMMA.SF, twice the plain e4m3 rate on
    consumer Blackwell); on sm_90a the same source compiles to the stand-in, which ptxas emulates with f16 HMMAs."""
    fp8 = "_ZN6kdtree30kdtree_verify_split_fp8_kernelENS_6ParamsE"
    sm120 = _sass_of_kernels(_compiled("sm_120a", tmp_path_factory)[0])[fp8]
    qmma = [op for op in sm120 if op.startswith("QMMA")]
    assert qmma and set(qmma) == {"QMMA.SF.16832.F32.E4M3.E4M3.E8"}, sorted(set(qmma))
    # unrolled: a score warp's S of a tile (4 key groups x 18 k32 steps x hi(q) and lo(q)) and a value warp's P V (24)
    assert len(qmma) >= 4 * 18 * 2 + 24, len(qmma)
    assert any(op.startswith("HMMA.16816.F32.BF16") for op in sm120)   # the draft items: bf16, as exact as bf16 pools
    sm90 = _sass_of_kernels(_compiled("sm_90a", tmp_path_factory)[0])[fp8]
    assert not any(op.startswith("QMMA") for op in sm90) and "HMMA.16816.F32" in sm90


@pytest.mark.parametrize("tool", sorted(p.name for p in (ROOT / "tools").glob("*.cu")))
def test_measurement_tools_compile(tool, tmp_path):
    # the standalone microbenchmarks in tools/ include the kernels' headers: they must build as their first lines say
    out = subprocess.run([nvcc_or_skip(), "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
                          f"-I{ROOT / 'src' / 'cuda'}", str(ROOT / "tools" / tool), "-o", str(tmp_path / "tool")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
