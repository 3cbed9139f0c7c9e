#!/usr/bin/env bash
# A/B of compile-time variants against the default build, on a GPU machine (no network), logs under $OUT.
#   KDTREE_AB_VARIANTS="KDTREE_DUAL_LAZY_RESCALE=0 KDTREE_MIN_CHUNK=192" bash tools/ab_variants.sh
# Each variant is one or more macro definitions joined by "+" (e.g. "KDTREE_A=1+KDTREE_B=2"); a part ENV:NAME=VALUE is
# an environment variable set for that variant's tests and runs only, not a macro (e.g.
# "KDTREE_X=1+ENV:KDTREE_SPLIT_STAGES=2"); a part SRC:PATH builds that variant from another source tree, a directory
# or a tar archive of one (the device machine gets no .git: e.g. `git archive -o .carry/main.tar main` here, then
# "SRC:.carry/main.tar" there, against the working tree's code). The script
# - builds the default (ci/build_gpu.sh, installed) and every variant (pip --target /tmp/kd_ab<i>, its own build tree)
#   side by side;
# - runs the kernel's GPU tests on every variant (KDTREE_AB_TESTS=0 skips them), in parallel;
# - times the shapes of KDTREE_AB_ONLY (bench.py --only substrings) for the default and each variant in turn,
#   KDTREE_AB_ROUNDS times (default 2; the order reversed every other round, so that drift shows), and prints one
#   line per run and a table of each variant's mean against the default's (KDTREE_AB_BENCH_ARGS: more bench.py
#   arguments, e.g. "--kv e4m3 --small-rows").
# Compare variants only within one run of this script: on the H200 the same build moves 1-3% between machines and
# runs (docs/performance.md, "How the numbers are taken").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT"
T0=$SECONDS
step() { echo "== [$((SECONDS - T0))s] $*"; }
if [ -f .carry/sglang/activate ]; then source .carry/sglang/activate; fi
arch=${KDTREE_CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')}
read -r -a variants <<< "${KDTREE_AB_VARIANTS:?set KDTREE_AB_VARIANTS to one or more macro sets, e.g. KDTREE_X=1}"
ONLY=${KDTREE_AB_ONLY:-P8192,H16 N9 tree P32768,H16 N9 tree P131072,B8,H8 N9,H128 N9}

step "builds: default and ${#variants[@]} variant(s), side by side"
( KDTREE_CUDA_ARCHS=$arch bash ci/build_gpu.sh > "$OUT/ab_build_default.log" 2>&1; echo "default build rc=$?" ) &
for i in "${!variants[@]}"; do
  flags="" src=.
  for d in ${variants[$i]//+/ }; do
    case "$d" in ENV:*) ;; SRC:*) src=${d#SRC:} ;; *) flags="$flags -D$d" ;; esac
  done
  if [ -f "$src" ]; then   # a tar archive of a source tree
    rm -rf "/tmp/kd_ab_src$i" && mkdir -p "/tmp/kd_ab_src$i" && tar -xf "$src" -C "/tmp/kd_ab_src$i" &&
      src=/tmp/kd_ab_src$i
  fi
  [ -f "$src/pyproject.toml" ] || { echo "variant $i (${variants[$i]}): no source tree at $src"; exit 1; }
  rm -rf "/tmp/kd_ab$i" "/tmp/build_ab$i"
  ( cd "$src" && python3 -m pip install --no-build-isolation --no-deps --no-index --target "/tmp/kd_ab$i" . \
      -C "build-dir=/tmp/build_ab$i" -C "cmake.define.KDTREE_CUDA_ARCHS=$arch" \
      -C "cmake.define.CMAKE_CUDA_FLAGS=$flags" \
      > "$OUT/ab_build_$i.log" 2>&1
    echo "variant $i (${variants[$i]}) build rc=$?" ) &
  # (a variant whose wgmma ptxas serialises is timed all the same, but says so: tools/wgmma_check.sh of its tree)
  if [ "$arch" = 90 ]; then ( bash "$src/tools/wgmma_check.sh" $flags | sed "s/^/variant $i: /" ) & fi
done
wait
grep -q "built and installed" "$OUT/ab_build_default.log" || { echo "the default build failed:"; tail -20 "$OUT/ab_build_default.log"; exit 1; }
# a variant whose build failed would import the default's installed kdtree from its PYTHONPATH: check where each
# variant's import comes from, and stop rather than time the default twice under another name
for i in "${!variants[@]}"; do
  where=$(cd /tmp && PYTHONPATH=/tmp/kd_ab$i python3 -c "import kdtree._verify as v; print(v.__file__)" 2>&1 | tail -1)
  case "$where" in
    /tmp/kd_ab$i/*) ;;
    *) echo "variant $i (${variants[$i]}) did not build into /tmp/kd_ab$i (import: $where); see $OUT/ab_build_$i.log"
       tail -20 "$OUT/ab_build_$i.log"; exit 1 ;;
  esac
done

# the ENV: parts of variant i (or nothing for the default)
venv() {
  local e=""
  [ "$1" != default ] && for d in ${variants[$1]//+/ }; do [[ "$d" == ENV:* ]] && e="$e ${d#ENV:}"; done
  echo $e
}

if [ "${KDTREE_AB_TESTS:-1}" = 1 ]; then
  step "kernel tests of every variant (in parallel)"
  for i in "${!variants[@]}"; do
    ( env $(venv $i) PYTHONPATH=/tmp/kd_ab$i timeout 200 \
        python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernel_gpu.py \
        > "$OUT/ab_tests_$i.log" 2>&1
      echo "variant $i (${variants[$i]}) tests rc=$? $(tail -1 "$OUT/ab_tests_$i.log" | cut -c1-120)"
      grep -E "^FAILED" "$OUT/ab_tests_$i.log" | head -3 | cut -c1-250 ) &
  done
  wait
fi

order=(default "${!variants[@]}")
for ((r = 0; r < ${KDTREE_AB_ROUNDS:-2}; r++)); do
  runs=("${order[@]}")
  if ((r % 2)); then runs=(); for ((j = ${#order[@]} - 1; j >= 0; j--)); do runs+=("${order[$j]}"); done; fi
  for v in "${runs[@]}"; do
    step "round $r: $v"
    pp=""; [ "$v" != default ] && pp=/tmp/kd_ab$v
    env $(venv $v) PYTHONPATH=$pp timeout 150 \
      python3 benchmarks/bench.py --no-sglang --only "$ONLY" ${KDTREE_AB_BENCH_ARGS:-} --out "$OUT/ab_${v}_r$r.json" \
      > "$OUT/ab_${v}_r$r.log" 2>&1 || echo "bench rc=$? (see ab_${v}_r$r.log)"
  done
done

KDTREE_AB_LABELS="default ${KDTREE_AB_VARIANTS}" python3 - <<'PY'
import glob, json, os, re
out = os.environ.get("OUT", "/tmp/kdtree-out")
labels = os.environ["KDTREE_AB_LABELS"].split()
runs = {}   # variant key -> list of {shape: us}
for f in sorted(glob.glob(f"{out}/ab_*_r*.json")):
    key = re.match(r"ab_(.+)_r\d+\.json", os.path.basename(f)).group(1)
    res = {r["name"]: r["kdtree_graph_us"] for r in json.load(open(f))["results"]}
    runs.setdefault(key, []).append(res)
    print(os.path.basename(f), " | ".join(f"{k}={v:.1f}" for k, v in res.items()))
if "default" not in runs:
    raise SystemExit("no default runs")
shapes = list(runs["default"][0])
mean = lambda key, s: sum(r[s] for r in runs[key]) / len(runs[key])
print("\n| shape | default us | " + " | ".join(labels[1 + int(k)] for k in runs if k != "default") + " |")
print("|---|---|" + "---|" * (len(runs) - 1))
for s in shapes:
    d = mean("default", s)
    cells = [f"{mean(k, s):.1f} ({100 * (mean(k, s) / d - 1):+.1f}%)" for k in runs if k != "default"]
    print(f"| {s} | {d:.1f} | " + " | ".join(cells) + " |")
PY
# the device tool brings back only a handful of files: the runs' JSON and logs travel as one archive
(cd "$OUT" && tar czf ab_logs.tgz ab_*.json ab_*.log && rm -f ab_*.json ab_*.log)
step done
