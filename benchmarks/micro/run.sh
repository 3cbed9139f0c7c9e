#!/usr/bin/env bash
# Builds and runs the microbenchmarks on the GPU machine; output on stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_wgmma.cu -o /tmp/micro_wgmma
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_gather.cu -o /tmp/micro_gather
[ "${1:-all}" = gather ] || { echo "== wgmma issue rates"; /tmp/micro_wgmma; }
echo "== key gather"; /tmp/micro_gather
