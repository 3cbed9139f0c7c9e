"""The built package: the extension imports, carries SASS for the architectures it claims, and fails
cleanly (KdtreeError, never a crash) where no GPU is usable. CPU only; runs everywhere.

KDTREE_EXPECTED_ARCHS (default "90,120") names the architectures the build under test was made for;
set it when testing a build made with `-C cmake.define.KDTREE_CUDA_ARCHS=...`.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_tools import find_cuobjdump

_verify = pytest.importorskip("kdtree._verify", reason="kdtree is not installed (run: pip install .)")

HEADER = Path(__file__).resolve().parents[1] / "src" / "cuda" / "kdtree_verify.h"
EXPECTED_ARCHS = sorted(int(a) for a in os.environ.get("KDTREE_EXPECTED_ARCHS", "90,120").split(",") if a.strip())


def _header_status_codes():
    codes = {}
    for name, value in re.findall(r"#define\s+(KDTREE_(?:OK|ERR_\w+))\s+\(?\s*(-?\d+)\s*\)?", HEADER.read_text()):
        codes[name] = int(value)
    return codes


def test_extension_is_inside_the_package():
    assert Path(_verify.__file__).parent.name == "kdtree"
    assert _verify.__name__ == "kdtree._verify"
    assert issubclass(_verify.KdtreeError, RuntimeError)


def test_autopatch_pth_lands_at_site_packages_root():
    # .pth files only run from a site directory's root, never from inside a package.
    source = HEADER.parents[2] / "python" / "kdtree-autopatch.pth"
    if not source.exists():
        pytest.skip("python/kdtree-autopatch.pth is not in this checkout")
    installed = Path(_verify.__file__).parents[1] / source.name
    assert installed.is_file(), f"{installed} missing: the wheel must install {source.name} at the site-packages root"
    assert installed.read_text() == source.read_text()


def test_constants_match_header():
    text = HEADER.read_text()
    for py_name, c_name in [("HEAD_DIM_QK", "KDTREE_HEAD_DIM_QK"), ("HEAD_DIM_V", "KDTREE_HEAD_DIM_V"),
                            ("MAX_HEADS", "KDTREE_MAX_HEADS"), ("MAX_MASK_WORDS", "KDTREE_MAX_MASK_WORDS"),
                            ("INDEX_INT32", "KDTREE_INDEX_INT32"), ("INDEX_INT64", "KDTREE_INDEX_INT64")]:
        value = int(re.search(rf"#define\s+{c_name}\s+(-?\d+)", text).group(1))
        assert getattr(_verify, py_name) == value, py_name
    assert (_verify.HEAD_DIM_QK, _verify.HEAD_DIM_V, _verify.INDEX_INT32, _verify.INDEX_INT64) == (576, 512, 0, 1)


def test_compiled_archs_reports_the_build():
    archs = _verify.compiled_archs()
    assert re.fullmatch(r"\d+(,\d+)*", archs), f"compiled_archs() = {archs!r}"
    assert [int(a) for a in archs.split(",")] == EXPECTED_ARCHS


def test_extension_carries_sass_for_each_arch():
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found: not on PATH, not in CUDA_HOME/bin, and the nvidia-cuda-cuobjdump "
                    "wheel is not installed (pip install -r requirements/test.txt)")
    so = _verify.__file__
    listing = subprocess.run([tool, "--list-elf", so], capture_output=True, text=True, check=True).stdout
    elf_archs = sorted({int(m) for m in re.findall(r"\.sm_(\d+)[a-z]?\.cubin", listing)})
    assert elf_archs == EXPECTED_ARCHS, f"{tool} --list-elf {so}:\n{listing}"
    # compiled_archs() must describe what is really inside, not just what CMake was told.
    assert [int(a) for a in _verify.compiled_archs().split(",")] == elf_archs


def test_status_strings_are_distinct_and_non_empty():
    codes = _header_status_codes()
    assert len(codes) >= 15 and codes["KDTREE_OK"] == 0, codes
    assert len(set(codes.values())) == len(codes), "two status macros share a value"
    messages = {name: _verify.status_string(code) for name, code in codes.items()}
    for name, message in messages.items():
        assert isinstance(message, str) and message.strip(), name
    assert len(set(messages.values())) == len(messages), messages
    # cudaError_t values and unknown codes still get a message, never NULL/empty.
    for code in (2, 100, 209, -1000, 2**31 - 1):
        assert _verify.status_string(code).strip(), code


def test_kdtree_error_carries_status_and_message():
    err = _verify.KdtreeError(-4, "ctx")
    assert err.status == -4
    assert str(err).startswith("ctx: ") and _verify.status_string(-4) in str(err)


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="batch_size"):
        _verify.workspace_size("1", 1, 16)
    with pytest.raises(OverflowError, match="num_heads"):
        _verify.workspace_size(1, 1, 2**40)
    args = _fake_launch_args()
    with pytest.raises(OverflowError, match="q_nope"):
        _verify.launch(**dict(args, q_nope=-1))
    with pytest.raises(TypeError, match="sm_scale"):
        _verify.launch(**dict(args, sm_scale=None))
    with pytest.raises(TypeError, match="stream"):
        _verify.launch(**dict(args, stream=1.5))
    with pytest.raises(TypeError):  # keyword-only, all required
        _verify.launch(*args.values())


def _fake_launch_args():
    """Sizes and strides that pass validation; device addresses that are 256-aligned but never real."""
    T, H = 1, 16
    base = 1 << 32
    ptr = iter(range(base, base + (1 << 24), 1 << 20))
    return dict(
        q_nope=next(ptr), q_nope_stride_t=H * 512, q_nope_stride_h=512,
        q_pe=next(ptr), q_pe_stride_t=H * 64, q_pe_stride_h=64,
        kv_cache=next(ptr), kv_stride_s=576, num_slots=8,
        kv_indices=next(ptr), kv_indices_dtype=_verify.INDEX_INT64, kv_indptr=next(ptr),
        k_new=next(ptr), k_new_stride_t=576, qo_indptr=next(ptr), qo_indptr_dtype=_verify.INDEX_INT32,
        tree_mask=0, tree_mask_words=1,
        out=next(ptr), out_stride_t=H * 512, out_stride_h=512,
        batch_size=1, num_tokens=T, num_heads=H, sm_scale=0.0625,
        workspace=next(ptr), workspace_bytes=1 << 30, stream=0,
    )


_NO_GPU_PROBE = r"""
import json, sys
import kdtree._verify as v
args = json.loads(sys.argv[1])
out = {}
def attempt(key, fn, *a, **kw):
    try:
        out[key] = ["returned", repr(fn(*a, **kw))]
    except v.KdtreeError as e:
        out[key] = ["KdtreeError", e.status, str(e)]
    except Exception as e:
        out[key] = [type(e).__name__, str(e)]
attempt("workspace_size", v.workspace_size, 1, 9, 16)
attempt("launch", v.launch, **args)
attempt("launch_null", v.launch, **dict(args, q_nope=0))
# rows x the combine's 8 column slices must stay below 2^30 (its 32-bit work indices): 2^23 tokens x 16 heads is the
# first size refused, one token fewer passes validation (and then finds no GPU)
attempt("launch_rows_limit", v.launch, **dict(args, num_tokens=1 << 23))
attempt("launch_rows_below", v.launch, **dict(args, num_tokens=(1 << 23) - 1))
attempt("pack", v.pack_tree_mask, custom_mask=args["q_nope"], mask_indptr=args["kv_indptr"],
        qo_indptr=args["qo_indptr"], qo_indptr_dtype=0, kv_indptr=args["kv_indptr"], batch_size=1,
        num_tokens=1, out=args["out"], out_words=1, stream=0)
attempt("split_kernel", v.split_kernel)
attempt("call_kernel", v.split_kernel, 1, 1, 16)
attempt("call_kernel_bad_batch", v.split_kernel, 0, 1, 16)
attempt("call_kernel_partial", v.split_kernel, 1)
print(json.dumps(out))
"""


def test_without_a_gpu_calls_raise_kdtree_error():
    # A child process with every GPU hidden: the same answer on a CPU runner and on a GPU machine,
    # and a crash shows up as a failed test with its exit code instead of killing the session.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _NO_GPU_PROBE, json.dumps(_fake_launch_args())],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"probe exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    no_device = _header_status_codes()["KDTREE_ERR_NO_DEVICE"]
    null_pointer = _header_status_codes()["KDTREE_ERR_NULL_POINTER"]
    assert result["workspace_size"][:2] == ["KdtreeError", no_device], result
    assert result["launch"][:2] == ["KdtreeError", no_device], result
    assert result["launch_null"][0] == "KdtreeError" and result["launch_null"][1] in (null_pointer, no_device), result
    assert result["pack"][:2] == ["KdtreeError", no_device], result
    assert result["launch_rows_limit"][:2] == ["KdtreeError", _header_status_codes()["KDTREE_ERR_OVERFLOW"]], result
    assert result["launch_rows_below"][:2] == ["KdtreeError", no_device], result
    assert result["split_kernel"][:2] == ["KdtreeError", no_device], result
    assert result["call_kernel"][:2] == ["KdtreeError", no_device], result
    # the sizes are checked before the device is looked at, as kdtree_verify_launch checks them
    assert result["call_kernel_bad_batch"][:2] == ["KdtreeError", _header_status_codes()["KDTREE_ERR_BATCH"]], result
    assert result["call_kernel_partial"][0] == "ValueError" and "together" in result["call_kernel_partial"][1], result
    assert _verify.status_string(no_device) in result["launch"][2]


_ENV_PROBE = r"""
import json
import kdtree._verify as v
out = {}
for key, fn, a in (("workspace_size", v.workspace_size, (1, 9, 16)), ("split_kernel", v.split_kernel, ()),
                   ("call_kernel", v.split_kernel, (1, 9, 16))):
    try:
        out[key] = ["returned", repr(fn(*a))]
    except v.KdtreeError as e:
        out[key] = ["KdtreeError", e.status, str(e)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name, value, ok", [
    ("KDTREE_SPLIT_KERNEL", "pingpong", False),   # a kernel this build does not have: an error, never the default
    ("KDTREE_SPLIT_KERNEL", "mma", True),
    ("KDTREE_SPLIT_KERNEL", "", True),
    ("KDTREE_SPLIT_STAGES", "3", False),
    ("KDTREE_MIXED", "1", False),                 # a switch builds no longer have: refused by name
    ("KDTREE_PDL", "off", False),
    ("KDTREE_MIXED_SMS", "40", False),
    ("KDTREE_SKINNY", "0", True),
])
def test_environment_switches_take_only_their_values(name, value, ok):
    # every GPU hidden: a valid switch reaches the device query (no device), an invalid one is refused before it, by name
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env.update(CUDA_VISIBLE_DEVICES="", **{name: value})
    proc = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"probe exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    codes = _header_status_codes()
    for key, got in result.items():
        if ok:
            assert got[:2] == ["KdtreeError", codes["KDTREE_ERR_NO_DEVICE"]], (key, got)
        else:
            assert got[:2] == ["KdtreeError", codes["KDTREE_ERR_ENV"]], (key, got)
            why = "not a switch this build has" if name.startswith("KDTREE_MIXED") else "not a value this build takes"
            assert f"{name}={value}" in got[2] and why in got[2], (key, got)
