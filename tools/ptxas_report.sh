#!/usr/bin/env bash
# Writes docs/ptxas_resources.txt: registers, spills and shared memory of every kernel, for the
# default architectures (sm_90a, sm_120), from the compiler alone (no GPU needed). Split kernels are named with their
# kdtree_split_kernel_id (kdtree_verify.h); the dynamic shared memory comes from the kernels' headers (verify_mma.cuh,
# verify_dual.cuh, verify_skinny.cuh).
#   bash tools/ptxas_report.sh > docs/ptxas_resources.txt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in 90a 120; do
  defs=""; [ "$arch" = 90a ] && defs="-DKDTREE_HAVE_SM90A=1"
  echo "=== sm_$arch: $(nvcc --version | tail -1 | sed 's/Build //'), -O3 -Xptxas -v (src/cuda/verify_launch.cu, $rev)"
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr $defs -gencode "arch=compute_$arch,code=sm_$arch" -Isrc/cuda \
       -c src/cuda/verify_launch.cu -o "$tmp/x.o" -Xptxas -v 2>&1 \
    | grep -E "Compiling entry|registers|spill|C75" | sed -E "s/^ptxas info +: //" \
    | sed -E "s/_ZN6kdtree26kdtree_verify_split_kernelILi([0-9])ENS_8MmaShapeILi([0-9]+)ELi([0-9])EEEEEvNS_6ParamsE/kdtree_verify_split_kernel<\1 stages, \2 rows x \3 key halves>/; \
              s/(<2 stages, 48 rows x 1 key halves>)/\1 (KDTREE_KERNEL_MMA_2STAGE)/; \
              s/(<3 stages, 48 rows x 1 key halves>)/\1 (KDTREE_KERNEL_MMA_3STAGE)/; \
              s/(<2 stages, 32 rows x 2 key halves>)/\1 (KDTREE_KERNEL_MMA_32ROW)/; \
              s/_ZN6kdtree2sk33kdtree_verify_split_skinny_kernelENS_6ParamsE/kdtree_verify_split_skinny_kernel (KDTREE_KERNEL_SKINNY)/; \
              s/_ZN6kdtree4dual31kdtree_verify_split_dual_kernelENS_6ParamsE/kdtree_verify_split_dual_kernel (KDTREE_KERNEL_DUAL)/; \
              s/_ZN6kdtree28kdtree_pack_tree_mask_kernel[A-Za-z0-9_]*/kdtree_pack_tree_mask_kernel/; \
              s/_ZN6kdtree28kdtree_verify_combine_kernelENS_6ParamsE/kdtree_verify_combine_kernel/; \
              s/_ZN6kdtree25kdtree_verify_plan_kernelENS_6ParamsE/kdtree_verify_plan_kernel/"
  echo
done
cat > "$tmp/sz.cu" <<'CU'
#include <cstdio>
#include "verify_dual.cuh"
#include "verify_mma.cuh"
#include "verify_skinny.cuh"
int main() {
  printf("dynamic shared memory per block: mma.sync 2 stages %zu B, its 32-row shape %zu B (sm_120 limit 101376), "
         "3 stages %zu B, dual %zu B, skinny %zu B (sm_90 limit 232448)\n",
         sizeof(kdtree::SharedStorage<2>),
         sizeof(kdtree::SharedStorage<2, kdtree::MmaHalves::kBlockM, kdtree::MmaHalves::kKeyHalves>),
         sizeof(kdtree::SharedStorage<3>), kdtree::dual::kSmemBytes, kdtree::sk::kSmemBytes);
}
CU
nvcc -std=c++17 --expt-relaxed-constexpr -Isrc/cuda "$tmp/sz.cu" -o "$tmp/sz" && "$tmp/sz"
echo "On sm_120 only the 2-stage kdtree_verify_split_kernel runs (48 rows; 32 rows x 2 key halves for calls of <= 32-row"
echo "requests); the sm_90a kernels (dual, skinny) and the 3-stage mma.sync kernel are __trap() stubs there. On sm_90a the skinny"
echo "kernel runs calls of <= 16-row requests; the mma.sync kernels only when KDTREE_SPLIT_KERNEL=mma or"
echo "KDTREE_SPLIT_STAGES=2 ask for them (to test the sm_120 code path on an H100/H200), or in a build without sm_90a."
echo "kdtree_verify_split_dual_kernel's 96 registers are its launch allocation (640 threads: a producer warpgroup beside the"
echo "two score and two value ones); setmaxnreg then gives its producer 48, its score warpgroups 56 and its value"
echo "warpgroups 160 (verify_dual.cuh; ptxas checks each region: no spills)."
