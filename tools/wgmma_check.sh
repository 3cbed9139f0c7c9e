#!/usr/bin/env bash
# Does ptxas serialise the wgmma of any sm_90a kernel under these compile flags? (CPU only, ~20 s)
#   bash tools/wgmma_check.sh -DKDTREE_EXP_TRACE
# Prints one line: "wgmma not serialised" or the kernels' count and the first reason, and exits 1 in the second case;
# either line also names the spills of the wgmma kernels (dual, dual-fp8: verify_dual.cuh; skinny, skinny-fp8:
# verify_skinny*.cuh) if they have any (a profiling build that spills in the tile loop runs its tiles long, so its
# trace is not the real kernel's; not an exit code). The KDTREE_EXP_* switches are listed in
# src/cuda/verify_profiling.cuh. ptxas reports serialised wgmma as an info line (C7510 / C7511 / C7512 / C7515 /
# C7518 / C7520), which pip's quiet builds and --warning-as-error do not show; a printf in a kernel (a function call)
# is enough to cause it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
out=$(mktemp -d)
"$nvcc" -std=c++17 -O3 --expt-relaxed-constexpr -DKDTREE_HAVE_SM90A=1 -gencode arch=compute_90a,code=sm_90a \
  -Isrc/cuda -Xptxas -v "$@" -c src/cuda/verify_launch.cu -o "$out/v.o" > "$out/log" 2>&1 || { tail -20 "$out/log"; rm -rf "$out"; exit 2; }
n=$(grep -c "(C75[0-9][0-9])" "$out/log")
spills() {   # $1: the kernel's short name, $2: its mangled name
  local s
  s=$(grep -A3 "Compiling entry function '$2'" "$out/log" | grep -o "[0-9]* bytes spill stores" | head -1)
  [ -n "$s" ] && [ "${s%% *}" != 0 ] && printf "; the %s kernel SPILLS: %s" "$1" "$s"
}
note=$(spills dual _ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb0EEEvNS_6ParamsE)$(spills dual-fp8 \
  _ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb1EEEvNS_6ParamsE)$(spills skinny \
  _ZN6kdtree2sk33kdtree_verify_split_skinny_kernelENS_6ParamsE)$(spills skinny-fp8 \
  _ZN6kdtree3sk837kdtree_verify_split_skinny_fp8_kernelILi1EEEvNS_6ParamsE)$(spills skinny-fp8-32row \
  _ZN6kdtree3sk837kdtree_verify_split_skinny_fp8_kernelILi2EEEvNS_6ParamsE)
if [ "$n" -gt 0 ]; then
  echo "wgmma SERIALISED ($* ): $n line(s), e.g. $(grep -m1 "(C75[0-9][0-9])" "$out/log" | cut -c1-220)$note"
  rm -rf "$out"; exit 1
fi
echo "wgmma not serialised ($* )$note"
rm -rf "$out"
