"""The patch is active in processes SGLang spawns, with no edit to SGLang.

``python -m sglang.launch_server`` starts its scheduler / TP workers with multiprocessing *spawn*
(``mp.set_start_method("spawn")`` + ``mp.Process``): fresh interpreters. kdtree reaches them
through ``kdtree-autopatch.pth``, which ``site`` executes at every interpreter start. These tests
build a throw-away virtual environment whose site-packages holds the repository's real
``python/kdtree-autopatch.pth`` (plus a path file making this environment's packages and kdtree
importable), point multiprocessing's spawn at that interpreter, and check inside the children:

* ``KDTREE_VERIFY`` unset: the interpreter starts without importing kdtree or torch, and SGLang's
  backend stays unpatched;
* ``KDTREE_VERIFY=on``: nothing of SGLang is imported at start; importing the backend module
  patches it, and a real verify call in the child is served by kdtree;
* a launch script that calls ``kdtree.sglang_patch.install("validate")`` (no variable set) gets
  its spawned children patched in validate mode;
* an unknown value makes the backend import fail loudly in the child.

This module imports nothing heavy at top level: the children unpickle their target from it, and
one of them checks that torch was not imported at interpreter start.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import os
import site
import subprocess
import sys
import textwrap
import traceback

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PTH = os.path.join(REPO, "python", "kdtree-autopatch.pth")
CHILD_TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------------
# the environment
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def autopatch_python(tmp_path_factory):
    """An interpreter whose site-packages holds kdtree-autopatch.pth; returns its path."""
    import kdtree  # the kdtree the tests import (source tree or installed)

    root = tmp_path_factory.mktemp("autopatch-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    kdtree_parent = os.path.dirname(os.path.dirname(os.path.abspath(kdtree.__file__)))
    # sorted before kdtree-autopatch.pth, so its paths exist when the autopatch line runs
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages() if os.path.isdir(p)]
    lines.append(kdtree_parent)
    with open(os.path.join(purelib, "00-kdtree-test-paths.pth"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(PTH) as src, open(os.path.join(purelib, "kdtree-autopatch.pth"), "w") as dst:
        dst.write(src.read())
    return python


def _run_spawned(python, env, target, *args):
    """Run ``target(queue, *args)`` in a process started like SGLang starts its workers (spawn),
    with ``python`` as the interpreter and ``env`` changes in the inherited environment."""
    ctx = multiprocessing.get_context("spawn")
    saved_exe = multiprocessing.spawn.get_executable()
    saved_env = {k: os.environ.get(k) for k in env}
    try:
        ctx.set_executable(python)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        queue = ctx.Queue()
        proc = ctx.Process(target=target, args=(queue, *args))
        proc.start()
    finally:
        multiprocessing.spawn.set_executable(saved_exe)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        result = queue.get(timeout=CHILD_TIMEOUT_S)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}: {result}"
    assert "error" not in result, result["error"]
    return result


# ------------------------------------------------------------------------------------------------
# child-side functions (run in the spawned interpreter)
# ------------------------------------------------------------------------------------------------


def _child(queue, action):
    try:
        result = {"executable": sys.executable,
                  "at_start": sorted(m for m in ("kdtree", "kdtree._autopatch", "torch", "sglang") if m in sys.modules),
                  "meta_path_hook": any(getattr(f, "_kdtree_autopatch", False) for f in sys.meta_path),
                  "env": os.environ.get("KDTREE_VERIFY")}
        result.update(action())
    except BaseException as exc:  # report, do not hang the parent
        result = {"error": "".join(traceback.format_exception(exc))}
    queue.put(result)


def _backend_state():
    sys.path.insert(0, HERE)
    from sglang_env import import_sglang

    sg = import_sglang()
    fn = sg.triton_backend.TritonAttnBackend.forward_extend
    state = {"patched": getattr(fn, "_kdtree_wrapper", False) is True}
    if state["patched"]:
        from kdtree import sglang_patch

        state["mode"] = sglang_patch.mode()
    return state


def _served_call():
    """A real TARGET_VERIFY call through the (auto)patched backend in this process."""
    import torch

    state = _backend_state()
    from kdtree import sglang_patch
    from sglang_harness import assert_close_bf16, build_case, reference_output

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = build_case(seed=7, batch=2, n=3, prefix_lens=[4, 6], device=device)
    out = case.call()
    assert_close_bf16(out, reference_output(case))
    state["stats"] = {k: sglang_patch.stats()[k] for k in ("calls", "served", "compared", "mismatched")}
    return state


def _import_backend_expecting_error():
    sys.path.insert(0, HERE)
    from sglang_env import import_sglang

    try:
        import_sglang()
    except ValueError as exc:
        return {"import_error": str(exc)}
    return {"import_error": None}


def child_unset(queue):
    _child(queue, _backend_state)


def child_start_only(queue):
    _child(queue, dict)


def child_served(queue):
    _child(queue, _served_call)


def child_invalid(queue):
    _child(queue, _import_backend_expecting_error)


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


def test_pth_is_one_guarded_import_line():
    with open(PTH) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os;")   # site exec()s lines starting "import"
    assert "KDTREE_VERIFY" in lines[0] and "kdtree._autopatch" in lines[0]


def test_unset_costs_nothing_and_leaves_sglang_alone(autopatch_python):
    r = _run_spawned(autopatch_python, {"KDTREE_VERIFY": None}, child_unset)
    assert r["executable"] == autopatch_python
    assert r["at_start"] == [] and not r["meta_path_hook"], r
    assert r["patched"] is False


def test_off_costs_nothing(autopatch_python):
    r = _run_spawned(autopatch_python, {"KDTREE_VERIFY": " OFF "}, child_start_only)
    assert r["at_start"] == [] and not r["meta_path_hook"], r


def test_spawned_child_is_patched_on_import_and_serves(autopatch_python):
    r = _run_spawned(autopatch_python, {"KDTREE_VERIFY": "on"}, child_served)
    assert "kdtree._autopatch" in r["at_start"] and "sglang" not in r["at_start"], r
    assert r["meta_path_hook"]
    assert r["patched"] and r["mode"] == "on"
    assert r["stats"]["served"] == 1 and r["stats"]["calls"] == 1


def test_launch_script_install_reaches_spawned_children(autopatch_python, tmp_path):
    """A launch script that imports kdtree and installs it, then starts workers the SGLang way."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, sys
        sys.path.insert(0, {HERE!r})
        import test_spawn
        from sglang_env import import_sglang

        if __name__ == "__main__":
            assert "KDTREE_VERIFY" not in os.environ
            import_sglang()
            from kdtree import sglang_patch
            sglang_patch.install("validate")
            assert sglang_patch.is_installed()
            mp.set_start_method("spawn", force=True)
            q = mp.Queue()
            p = mp.Process(target=test_spawn.child_served, args=(q,))
            p.start()
            r = q.get(timeout={CHILD_TIMEOUT_S})
            p.join()
            assert "error" not in r, r["error"]
            assert r["env"] == "validate" and r["patched"] and r["mode"] == "validate", r
            assert r["stats"]["compared"] == 1 and r["stats"]["mismatched"] == 0, r
            print("CHILD-PATCHED", r["mode"], r["stats"])
    """))
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_VERIFY"}
    proc = subprocess.run([autopatch_python, str(script)], env=env, capture_output=True, text=True,
                          timeout=2 * CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "CHILD-PATCHED validate" in proc.stdout


def test_unknown_value_fails_the_backend_import(autopatch_python):
    r = _run_spawned(autopatch_python, {"KDTREE_VERIFY": "onn"}, child_invalid)
    assert r["import_error"] is not None and "onn" in r["import_error"], r
