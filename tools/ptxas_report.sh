#!/usr/bin/env bash
# Writes docs/ptxas_resources.txt: registers, spills and shared memory of every kernel, for the
# default architectures (sm_90a, sm_120a, as CMakeLists.txt builds them), from the compiler alone (no GPU needed). Split
# kernels are named with their kdtree_split_kernel_id (kdtree_verify.h); the dynamic shared memory comes from the
# kernels' headers (verify_mma.cuh, verify_mma_fp8.cuh, verify_dual.cuh, verify_skinny.cuh).
#   bash tools/ptxas_report.sh > docs/ptxas_resources.txt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in 90a 120a; do
  defs=""; [ "$arch" = 90a ] && defs="-DKDTREE_HAVE_SM90A=1"
  echo "=== sm_$arch: $(nvcc --version | tail -1 | sed 's/Build //'), -O3 -Xptxas -v (src/cuda/verify_launch.cu, $rev)"
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr $defs -gencode "arch=compute_$arch,code=sm_$arch" -Isrc/cuda \
       -c src/cuda/verify_launch.cu -o "$tmp/x.o" -Xptxas -v 2>&1 \
    | grep -E "Compiling entry|registers|spill|C75" | sed -E "s/^ptxas info +: //" \
    | sed -E "s/_ZN6kdtree26kdtree_verify_split_kernelILi([0-9])ENS_8MmaShapeILi([0-9]+)ELi([0-9])EEELb1EEEvNS_6ParamsE/kdtree_verify_split_kernel<\1 stages, \2 rows x \3 key halves, drafts apart> (KDTREE_KERNEL_MMA_SCALED)/; \
              s/_ZN6kdtree26kdtree_verify_split_kernelILi([0-9])ENS_8MmaShapeILi([0-9]+)ELi([0-9])EEELb0EEEvNS_6ParamsE/kdtree_verify_split_kernel<\1 stages, \2 rows x \3 key halves>/; \
              s/(<2 stages, 48 rows x 1 key halves>)/\1 (KDTREE_KERNEL_MMA_2STAGE)/; \
              s/(<3 stages, 48 rows x 1 key halves>)/\1 (KDTREE_KERNEL_MMA_3STAGE)/; \
              s/(<2 stages, 32 rows x 2 key halves>)/\1 (KDTREE_KERNEL_MMA_32ROW)/; \
              s/_ZN6kdtree30kdtree_verify_split_fp8_kernelENS_6ParamsE/kdtree_verify_split_fp8_kernel (KDTREE_KERNEL_MMA_FP8)/; \
              s/_ZN6kdtree2sk33kdtree_verify_split_skinny_kernelENS_6ParamsE/kdtree_verify_split_skinny_kernel (KDTREE_KERNEL_SKINNY)/; \
              s/_ZN6kdtree3sk837kdtree_verify_split_skinny_fp8_kernelILi1EEEvNS_6ParamsE/kdtree_verify_split_skinny_fp8_kernel<1 consumer> (KDTREE_KERNEL_SKINNY_FP8)/; \
              s/_ZN6kdtree3sk837kdtree_verify_split_skinny_fp8_kernelILi2EEEvNS_6ParamsE/kdtree_verify_split_skinny_fp8_kernel<2 consumers> (KDTREE_KERNEL_SKINNY_FP8_32ROW)/; \
              s/_ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb0EEEvNS_6ParamsE/kdtree_verify_split_dual_kernel<bf16> (KDTREE_KERNEL_DUAL)/; \
              s/_ZN6kdtree4dual31kdtree_verify_split_dual_kernelILb1EEEvNS_6ParamsE/kdtree_verify_split_dual_kernel<e4m3> (KDTREE_KERNEL_DUAL_FP8)/; \
              s/_ZN6kdtree28kdtree_pack_tree_mask_kernel[A-Za-z0-9_]*/kdtree_pack_tree_mask_kernel/; \
              s/_ZN6kdtree28kdtree_verify_combine_kernelENS_6ParamsE/kdtree_verify_combine_kernel/; \
              s/_ZN6kdtree25kdtree_verify_plan_kernelENS_6ParamsE/kdtree_verify_plan_kernel/"
  echo
done
cat > "$tmp/sz.cu" <<'CU'
#include <cstdio>
#include "verify_dual.cuh"
#include "verify_mma.cuh"
#include "verify_mma_fp8.cuh"
#include "verify_skinny.cuh"
#include "verify_skinny_fp8.cuh"
int main() {
  printf("dynamic shared memory per block: mma.sync 2 stages %zu B, its 32-row shape %zu B, FP8 %zu B (sm_120 limit "
         "101376), 3 stages %zu B, dual %zu B, dual FP8 %zu B, skinny %zu B, skinny FP8 %zu B, its 32-row form %zu B "
         "(sm_90 limit 232448); the drafts-apart (scaled) kernels take their stages' storage\n",
         sizeof(kdtree::SharedStorage<2>),
         sizeof(kdtree::SharedStorage<2, kdtree::MmaHalves::kBlockM, kdtree::MmaHalves::kKeyHalves>),
         sizeof(kdtree::SharedStorageFp8), sizeof(kdtree::SharedStorage<3>), kdtree::dual::kSmemBytes,
         kdtree::dual::kSmemBytesFp8,
         kdtree::sk::kSmemBytes, kdtree::sk8::kSmemBytes<1>, kdtree::sk8::kSmemBytes<2>);
}
CU
# (sm_90a code for the headers' kernels, which this host program only sizes: compute_75, nvcc's default, lacks their PTX)
nvcc -std=c++17 --expt-relaxed-constexpr -DKDTREE_HAVE_SM90A=1 -gencode arch=compute_90a,code=sm_90a -Isrc/cuda \
     "$tmp/sz.cu" -o "$tmp/sz"
"$tmp/sz"
echo "On sm_120a the 2-stage kdtree_verify_split_kernel runs bf16 calls (48 rows; 32 rows x 2 key halves for calls of"
echo "<= 32-row requests; its drafts-apart instantiation for KV scales), the FP8 kernel e4m3 calls on the block-scaled"
echo "e4m3 mma.sync; the sm_90a kernels (dual, skinny and their FP8 forms) and the 3-stage mma.sync kernels are __trap()"
echo "stubs there. On sm_90a the dual kernel runs bf16 calls without KV scales, the skinny kernel calls of <= 16-row"
echo "requests, the 3-stage drafts-apart kernel calls with KV scales, the dual kernel's FP8 form e4m3 calls and the skinny"
echo "FP8 kernel e4m3 calls of <= 16-row requests (its 32-row form those of 17 to 32); the other mma.sync kernels"
echo "only when KDTREE_SPLIT_KERNEL=mma or KDTREE_SPLIT_STAGES=2 ask for them (to test the sm_120 code path on an"
echo "H100/H200), or in a build without sm_90a."
echo "The FP8 mma.sync kernel on sm_90a is a stand-in for the sm_120a one (e4m3 calls under those switches): ptxas emulates its plain"
echo "e4m3 mma.sync with f16 HMMA, whose operands a 168-register thread cannot hold at every point, so it spills a few"
echo "dozen bytes there (tests/test_ptxas.py allows them: SPILL_ALLOWANCE); no other kernel spills, on either architecture."
echo "kdtree_verify_split_dual_kernel<bf16>'s 96 registers are its launch allocation (640 threads: a producer warpgroup beside"
echo "the two score and two value ones); setmaxnreg then gives its producer 48, its score warpgroups 56 and its value"
echo "warpgroups 160. Its FP8 form has no producer warpgroup (512 threads: 128 at launch), score 80, value 176"
echo "(verify_dual.cuh). The skinny FP8 kernel's 32-row form launches 384 threads with 168 registers, then gives its"
echo "two consumer warpgroups 232 and its producer 40 (verify_skinny_fp8.cuh; tests/test_ptxas.py checks the launch"
echo "registers)."
