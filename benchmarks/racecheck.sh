#!/usr/bin/env bash
# Build for this GPU, then compute-sanitizer racecheck + memcheck on the split-K case, with details.
set -uo pipefail
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
python3 -m pip install -q --no-build-isolation --no-deps . -C cmake.define.KDTREE_CUDA_ARCHS="$arch" > /tmp/b.log 2>&1 || { tail -20 /tmp/b.log; exit 1; }
for tool in racecheck memcheck; do
  for c in split small; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitize_case.py $c > /tmp/san.log 2>&1
    echo "$tool $c rc=$? $(grep -E 'SUMMARY|rel err' /tmp/san.log | tr '\n' ' ')"
    grep -E "Error|hazard|Race|at 0x|kdtree_verify" /tmp/san.log | head -6
  done
done
