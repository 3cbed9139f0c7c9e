#!/usr/bin/env bash
# Builds and runs the microbenchmarks on the GPU machine; output on stdout.
#   bash benchmarks/micro/run.sh [wgmma] [gather] [contention] [cluster] [ingest] [intake] [flight] [pipe] [exchange]   (all when none is named)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
which=${*:-wgmma gather contention cluster ingest intake flight pipe exchange}
for m in $which; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128 "micro_$m.cu" -o "/tmp/micro_$m"
  echo "== micro_$m"
  timeout 120 "/tmp/micro_$m" || echo "micro_$m: failed or timed out (rc=$?)"   # a hang costs device time
done
