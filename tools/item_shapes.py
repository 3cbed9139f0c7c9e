"""Shared-memory and tensor-core work per key of the split pass's item shapes at one request shape, from arithmetic
alone (no GPU): the count behind docs/performance.md's "What would move the rest".

On the H200 the dual kernel's split pass is bound by shared memory, not by a saturated unit elsewhere: ncu puts shared
memory at ~75-83% of its peak on the long H16 N9 shapes and the tensor pipe at ~57%. wgmma reads its B operand (and an
SS A operand) from shared memory on every instruction, the gathered keys are written there, and P goes through it. This
script counts those bytes per key for each item shape, turns them into SM clocks at 128 B per clock, compares that with
the tensor clocks of the same work (dense bf16 wgmma: 4,096 FLOP per clock per SM), and calibrates the fraction of the
shared-memory peak that the default kernel reaches from its measured split-pass cycles, so that the other shapes' times
are projections at the same efficiency.

    python tools/item_shapes.py [--heads 16] [--tokens 9] [--prefix 131072]

Shapes (the rows of one request are H x N; "crossings": how many SMs receive each key):
- dual:  the default (verify_dual.cuh): 64-row items with the rows as the wgmma M, 32-key tiles, q from shared
         memory (S = Q K^T, m64n32k16 SS), P V as m64n128k16 halves with P from shared memory; one item per 64 rows,
         the last padded.
- trans72: rows as the wgmma N, keys as M (S^T = K Q^T and O^T = V^T P^T, m64n72k16), 72-row items, 64-key tiles
         (does not fit 227 KB of shared memory with a useful key ring).
- pairdim: a cluster of two CTAs per key range, each with every row of the request (rows as N, no padding), split by
         dims: CTA 0 computes the partial S over dims [0, 288) and O for values [0, 256), CTA 1 S over [288, 576) and
         values [256, 512); each gathers only the dims it reads and sends its fp32 partial S^T to the other through
         distributed shared memory (counted, not built).
"fits one SM": shared memory within 227 KB (1 KB kept for barriers) and accumulators within REG_SHARE of the register
file, a first check only: how the accumulators split into whole warpgroups under setmaxnreg decides
(docs/performance.md). None of these numbers is a measurement except the calibration row (ncu of the default's split
kernel at H16 N9 P131072 on the H200: 181,657 cycles).
"""

import argparse
import math

SMEM_BYTES_PER_CLK = 128          # shared memory per SM per clock (Hopper)
TENSOR_FLOP_PER_CLK = 4096        # dense bf16 wgmma per SM per clock (989 TFLOP/s at 1.83 GHz x 132 SMs)
SMS = 132
SMEM_LIMIT = 232448               # bytes a block may take on sm_90
REGS = 65536                      # 32-bit registers per SM
MEASURED_SPLIT_CYCLES = 181657    # the dual kernel's split pass, H16 N9 P131072 (ncu --set full, H200)
MEASURED_CLOCK_GHZ = 1.70         # SM clock under that load (ncu: 1.68-1.70, under the power cap)
FIXED_US = 8.0                    # plan + combine + launches around the split pass (timeline of the call, H200)
COPY_TBS = 4.23                   # the H200's measured copy rate (docs/performance.md): each key read once from DRAM
REG_SHARE = 0.75                  # accumulators may take at most this share of the register file (the rest: addresses,
                                  # softmax, the producer; the dual kernel's O takes 50%)

D_QK, D_V = 576, 512


def dual(rows):
    """64-row items, 32-key tiles: bytes per 32-key tile per item (docs/design.md, "The key ring")."""
    items = math.ceil(rows / 64)
    s_a = 64 * D_QK * 2           # q, A of S (SS), read once per tile: 72 KB
    s_b = 32 * D_QK * 2           # the tile's keys, B of S: 36 KB
    pv_b = 32 * D_V * 2           # the tile's values, B of P V: 32 KB
    pv_a = 64 * 32 * 2 * 4        # P, A of each of 2 warpgroups x 2 m64n128k16 halves: 16 KB
    land = 32 * D_QK * 2          # the gathered keys written: 36 KB
    p_w = 64 * 32 * 2             # P written: 4 KB
    per_tile = s_a + s_b + pv_b + pv_a + land + p_w
    return dict(items=items, crossings=items, smem_per_key=items * per_tile / 32, rows_computed=64 * items,
                capacity=None, fits=True)


def trans(rows, r_item=72):
    """rows as N (r_item per item), keys as M, 64-key tiles; bytes per 64-key tile per item."""
    items = math.ceil(rows / r_item)
    s_a = 64 * D_QK * 2                               # keys, A of S^T
    s_b = (D_QK // 16) * r_item * 16 * 2              # q, B of S^T, every k-step
    o = (D_V // 64) * (64 // 16) * (64 * 16 * 2 + r_item * 16 * 2)   # V^T (A) and P^T (B) per m64 block and k-step
    land = 64 * D_QK * 2
    p_w = 64 * r_item * 2
    per_tile = s_a + s_b + o + land + p_w
    q = r_item * D_QK * 2
    stage = 64 * D_QK * 2
    fits = q + 2 * stage + p_w + 1024 <= SMEM_LIMIT and r_item * D_V + 64 * r_item <= REG_SHARE * REGS
    return dict(items=items, crossings=items, smem_per_key=items * per_tile / 64, rows_computed=r_item * items,
                fits=fits, capacity=f"q {q:,} + 2 x 64-key stages {2 * stage:,} + P^T {p_w:,} = {q + 2 * stage + p_w:,} B "
                         f"(limit {SMEM_LIMIT:,}); O^T {r_item * D_V * 4:,} B of registers")


def pairdim(rows):
    """two CTAs, every row in each (rows as N), dims split; bytes per key summed over the pair."""
    total = 0
    for s_dims, v_dims, gathered in ((288, 256, 288), (288, 256, 320)):
        land = gathered * 2
        s_a = s_dims * 2                              # the keys' own dims, A of S^T (one m64 block of keys)
        s_b = (s_dims // 16) * rows * 16 * 2 / 64     # q's dims, B of S^T, per 64 keys
        xchg = rows * 4 * 2                           # the partner's fp32 partial written here, then read
        p_w = rows * 2
        o = (v_dims // 64) * (64 * 2 + rows * 2)      # V^T (A) and P^T (B) per m64 block, per key
        total += land + s_a + s_b + xchg + p_w + o
    q = rows * 288 * 2                                # q's dims of the larger CTA
    stage = 64 * 320 * 2                              # a 64-key stage of the larger CTA's dims
    p_t = 64 * rows * 2                               # P^T of one tile, bf16
    xbuf = 64 * rows * 4                              # the partner's fp32 partial S^T of one tile
    regs_o = rows * 256                               # fp32 O^T per CTA
    regs_s = 64 * rows                                # fp32 S^T of one 64-key tile
    fits = q + 2 * stage + p_t + xbuf + 1024 <= SMEM_LIMIT and regs_o + regs_s <= REG_SHARE * REGS
    return dict(items=2, crossings=(288 + 320) / D_QK, smem_per_key=total, rows_computed=rows, fits=fits,
                capacity=f"q {q:,} + 2 stages {2 * stage:,} + P^T {p_t:,} + exchange {xbuf:,} = "
                         f"{q + 2 * stage + p_t + xbuf:,} B (limit {SMEM_LIMIT:,}); registers: O^T {regs_o:,} + S^T "
                         f"{regs_s:,} of {REGS:,} a CTA")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--prefix", type=int, default=131072)
    a = ap.parse_args()
    rows = a.heads * a.tokens
    keys = a.prefix + a.tokens
    flop_useful = 2 * (D_QK + D_V) * rows * keys
    shapes = {"dual": dual(rows), "trans72": trans(rows), "pairdim": pairdim(rows)}

    cal = dual(16 * 9)
    cal_floor = (131072 + 9) * cal["smem_per_key"] / SMS / SMEM_BYTES_PER_CLK
    eff = cal_floor / MEASURED_SPLIT_CYCLES
    print(f"calibration: the dual kernel's split pass at H16 N9 P131072 measured {MEASURED_SPLIT_CYCLES:,} cycles; its "
          f"shared-memory floor is {cal_floor:,.0f} cycles: {100 * eff:.0f}% of the peak reached\n")
    print(f"H={a.heads} N={a.tokens} prefix={a.prefix:,}: {rows} rows, useful {flop_useful / 1e9:.1f} GFLOP")
    dram_us = keys * D_QK * 2 / (COPY_TBS * 1e12) * 1e6
    print(f"DRAM floor (each key read once at {COPY_TBS} TB/s): {dram_us:.1f} us")
    print("| shape | fits one SM | crossings | rows computed | smem KB / key | smem floor us | tensor floor us | "
          "at the dual's efficiency, call us |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in shapes.items():
        smem_clk = keys * s["smem_per_key"] / SMS / SMEM_BYTES_PER_CLK
        tensor_clk = 2 * (D_QK + D_V) * s["rows_computed"] * keys / SMS / TENSOR_FLOP_PER_CLK
        to_us = 1e-3 / MEASURED_CLOCK_GHZ
        call = max(smem_clk / eff * to_us, tensor_clk * to_us, dram_us) + FIXED_US
        print(f"| {name} | {'yes' if s['fits'] else 'NO'} | {s['crossings']:.2f} | {s['rows_computed']} | "
              f"{s['smem_per_key'] / 1024:.1f} | {smem_clk * to_us:.1f} | {tensor_clk * to_us:.1f} | {call:.0f} |")
    print()
    for name, s in shapes.items():
        if s["capacity"]:
            print(f"{name}: {s['capacity']}")


if __name__ == "__main__":
    main()
