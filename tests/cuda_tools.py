"""Where the CUDA tools the CPU tests use are: nvcc (the toolkit), cuobjdump (the toolkit, or the nvidia-cuda-cuobjdump
wheel of requirements/test.txt, since the CI runners' toolkit carries nvcc but not cuobjdump) and nvdisasm, which
`cuobjdump -sass` runs (the toolkit, or the copy in triton's wheel, which torch installs on Linux)."""

import glob
import os
import shutil


def find_nvcc():
    """nvcc from PATH or /usr/local/cuda/bin; None if neither."""
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_or_skip():
    """find_nvcc(), or the calling test skipped when there is no nvcc."""
    import pytest

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin)")
    return nvcc


def _find_tool(name):
    """A CUDA binary from PATH, the toolkit, NVIDIA's pip wheels (nvidia/<cu13>/bin) or triton's; None if none."""
    found = shutil.which(name)
    if found:
        return found
    candidates = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(os.path.join(os.environ[env], "bin", name))
    candidates.append(f"/usr/local/cuda/bin/{name}")
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels

        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "bin", name)))
    except ImportError:
        pass
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                candidates.append(os.path.join(root, "backends", "nvidia", "bin", name))
    except (ImportError, ValueError):
        pass
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def find_cuobjdump():
    """cuobjdump (lists the machine code of a binary); None if none is found."""
    return _find_tool("cuobjdump")


def sass_command():
    """(argv prefix, environment) that disassemble a binary: cuobjdump -sass with the nvdisasm it needs on its search
    path; None if either tool is missing."""
    cuobjdump, nvdisasm = find_cuobjdump(), _find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        return None
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(nvdisasm))
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    return [cuobjdump, "-sass"], env
