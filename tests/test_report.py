"""The benchmark's report step (benchmarks/report.py) on CPU: which ceilings a results table says its floors use."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report():
    spec = importlib.util.spec_from_file_location("kdtree_report", os.path.join(ROOT, "benchmarks", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(ceilings=None):
    env = dict(gpu="NVIDIA H100 80GB HBM3", driver="580", cuda="13.0", torch="2.11", triton="3.6", sglang="0.5.23",
               kdtree="0.1.0", date="2026-12-06")
    if ceilings:
        env["ceilings"] = ceilings
    rec = dict(name="H16 N1 tree P131072", prefixes=[131072], kdtree_us=60.0, kdtree_graph_us=50.0,
               kv_bytes=131073 * 576, flops=2176 * 16 * 131073, floor_us=25.0, kv="e4m3")
    return dict(env=env, results=[rec])


def test_floor_note_names_the_measured_ceilings():
    r = _report()
    d = _run(dict(copy_tbps=2.91, matmul_tflops=702.4, gather_e4m3_tbps=2.05, gather_bf16_tbps=2.44))
    text = r.table(d)
    assert "2.91 TB/s" in text and "702 TFLOP/s" in text and "measured at the start of the run" in text
    assert "2.05 TB/s with 576-byte rows and 2.44 with 1,152" in text
    assert "4.23" not in text
    assert r.floor_label(d["env"]) == "floor (2.91 TB/s, 702 TFLOP/s)"
    # % of floor is the floor over the graph-replay time
    assert "| 50.0 | 1510 |" in text and "| 25.0 | 50.0 |" in text


def test_floor_note_without_ceilings_is_the_h200s():
    r = _report()
    d = _run()
    assert "4.23 TB/s" in r.table(d) and "the H200's" in r.table(d)
    assert r.floor_label(d["env"]) == "floor (4.23 TB/s, 773 TFLOP/s)"


def test_gpu_slug():
    r = _report()
    assert r.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert r.gpu_slug("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtx-pro-6000-blackwell-server-edition"
