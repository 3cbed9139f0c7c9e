"""The plan kernel's split rule (src/cuda/verify_split_rule.h), compiled for the host (CPU only, no GPU).

The rule is checked against its Python mirror in tools/sim_schedule.py over a grid of shapes, and that mirror's
plans are played through the model of the persistent grid (claim at end, an item costing its tiles plus the rule's
item cost): the balanced plan is never slower in that model, is faster on the benchmark's uneven shapes, is the base
rule where the row tiles divide the grid, and stays inside the workspace's partial-row bounds (verify_launch.cu).
"""

import importlib.util
import itertools
import random
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sim_schedule", ROOT / "tools" / "sim_schedule.py")
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

ITEM_TILES = sim.ITEM_TILES   # KDTREE_PLAN_ITEM_TILES's default (the header test below fails if the two disagree)

_DRIVER = r"""
#include <cstdio>
#include "verify_split_rule.h"
int main() {
  int len, mtiles, blocks, tile_n, min_chunk;
  while (std::scanf("%d %d %d %d %d", &len, &mtiles, &blocks, &tile_n, &min_chunk) == 5) {
    const kdtree::SplitShape s = kdtree::split_shape(len, mtiles, blocks, tile_n, min_chunk);
    std::printf("%d %d\n", s.nsplit, s.chunk);
  }
  return 0;
}
"""


def _cases():
    rng = random.Random(36)
    cases = set()
    # the benchmark's shapes and every row-tile count a 64-row kernel sees up to H128 N65
    for length in [1, 31, 32, 33, 255, 256, 257, 1000, 3200, 8201, 32777, 131081, 131105, 131137, 185009]:
        for mtiles in [1, 2, 3, 4, 5, 7, 9, 17, 18, 33, 66, 130, 131, 132, 133, 200]:
            cases.add((length, mtiles, 132, 32, 256))
    for _ in range(3000):
        cases.add((rng.randint(1, 300_000), rng.randint(1, 140), rng.choice([132, 188, 84, 70]),
                   rng.choice([32, 64]), rng.choice([64, 256])))
    return sorted(cases)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("split_rule")
    (d / "driver.cpp").write_text(_DRIVER)
    exes = {}
    for balance in (0, 1):
        exe = d / f"rule{balance}"
        subprocess.run([cxx, "-std=c++17", "-O1", f"-I{ROOT / 'src' / 'cuda'}", f"-DKDTREE_PLAN_BALANCE={balance}",
                        str(d / "driver.cpp"), "-o", str(exe)], check=True, capture_output=True, text=True)
        exes[balance] = exe
    return exes


def _run(exe, cases):
    out = subprocess.run([str(exe)], input="".join(f"{' '.join(map(str, c))}\n" for c in cases),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [tuple(map(int, line.split())) for line in out if line]


@pytest.mark.parametrize("balance", [0, 1])
def test_header_matches_the_python_mirror(compiled, balance):
    cases = _cases()
    got = _run(compiled[balance], cases)
    assert len(got) == len(cases)
    for case, plan in zip(cases, got):
        assert plan == sim.split_shape(*case, balance=bool(balance), item_tiles=ITEM_TILES), case


def _items(length, mtiles, plan, tile_n):
    nsplit, chunk = plan
    assert (nsplit - 1) * chunk < length <= nsplit * chunk or (length == 0 and nsplit == 1)
    tiles = [sim.ceil_div(min(length, (s + 1) * chunk) - s * chunk, tile_n) for s in range(nsplit)]
    return [t for t in tiles for _ in range(mtiles)]   # split-major, as item_ctx numbers them


def test_balance_never_slower_in_the_model_and_stays_in_bounds():
    changed = 0
    for length, mtiles, blocks, tile_n, min_chunk in _cases():
        base = sim.split_shape(length, mtiles, blocks, tile_n, min_chunk, balance=False)
        bal = sim.split_shape(length, mtiles, blocks, tile_n, min_chunk, balance=True, item_tiles=ITEM_TILES)
        if bal == base:
            continue
        changed += 1
        assert blocks % mtiles != 0 and mtiles >= 2
        assert bal[0] == base[0] + 1 and bal[1] % tile_n == 0 and bal[1] >= min_chunk
        t_base = sim.claim_at_end(_items(length, mtiles, base, tile_n), blocks, 1.0, ITEM_TILES)
        t_bal = sim.claim_at_end(_items(length, mtiles, bal, tile_n), blocks, 1.0, ITEM_TILES)
        assert t_bal < t_base, (length, mtiles, blocks, base, bal, t_base, t_bal)
        # workspace_layout: a row's partials <= blocks; a request's <= blocks x block_m + its rows (block_m 64)
        assert bal[0] <= blocks
        assert bal[0] * mtiles * 64 <= blocks * 64 + mtiles * 64
    assert changed > 100   # the balance is exercised by the grid (a mirror that never balances would pass the rest)


def test_unchanged_where_the_row_tiles_divide_the_grid():
    # every H16 N9 request (3 row tiles on 132 SMs): the benchmark's long and ragged shapes keep their plan
    for length, mtiles in itertools.product(range(1, 300_000, 977), [1, 2, 3, 4, 6, 12, 33, 44, 66, 132]):
        base = sim.split_shape(length, mtiles, 132, balance=False)
        assert sim.split_shape(length, mtiles, 132, balance=True) == base


@pytest.mark.parametrize("heads, n, prefix, splits, makespan", [
    (128, 9, 32768, (7, 8), (151, 145)),
    (32, 9, 131072, (26, 27), (162, 160)),
    (16, 33, 131072, (14, 15), (297, 287)),
    (16, 65, 131072, (7, 8), (590, 551)),
])
def test_uneven_benchmark_shapes(heads, n, prefix, splits, makespan):
    mtiles = sim.ceil_div(heads * n, 64)
    got_splits, got_span = [], []
    for bal in (False, True):
        plan = sim.split_shape(prefix + n, mtiles, 132, balance=bal)
        got_splits.append(plan[0])
        got_span.append(round(sim.claim_at_end(_items(prefix + n, mtiles, plan, 32), 132, 1.0, ITEM_TILES)))
    assert tuple(got_splits) == splits and tuple(got_span) == makespan


@pytest.mark.parametrize("prefixes, heads, n", [([6000, 6100], 128, 9), ([2000], 16, 65), ([10000], 16, 33),
                                                ([20000], 32, 9)])
def test_the_gpu_tests_balanced_shapes_are_balanced(prefixes, heads, n):
    # tests/test_kernel_gpu.py's test_balanced_splits runs these to exercise the added split on a 132-SM GPU
    mtiles = sim.ceil_div(heads * n, 64)
    for p in prefixes:
        base = sim.split_shape(p + n, mtiles, 132, balance=False)
        assert sim.split_shape(p + n, mtiles, 132, balance=True)[0] == base[0] + 1
    if heads == 128:   # more partial rows than 132 x 64: the workspace bound counts each request's own rows too
        assert (sim.split_shape(prefixes[0] + n, mtiles, 132)[0]) * heads * n > 132 * 64
