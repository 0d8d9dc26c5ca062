"""The error of poly_exp2 (csrc/cuda/utils.h), the softcap forward's FMA-pipe
2^x, emulated in float32 with NumPy against exp2 in float64.

  python3 tools/poly_exp2_error.py [--stride N]

Walks every float32 x in [-127, 127] (the range that exp_stale feeds it; with
--stride N every N-th one) and prints the largest relative error among normal
results, checks that results below 2^-126 stay below 2^-125, and prints a few
special inputs. The fused multiply-adds are emulated by a float64 product and
sum rounded once to float32 (exact but for rare double roundings of the last
bit). Keep the coefficients equal to utils.h's.
"""

from __future__ import annotations

import argparse

import numpy as np

COEFFS = np.array([1.3202982e-3, 9.6749524e-3, 5.5510473e-2, 2.4022166e-1, 6.9314659e-1],
                  np.float32)  # degree 5 down to degree 1; the constant term is 1


def fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def poly_exp2(x):
    x = np.maximum(x, np.float32(-127))
    k = np.float32(12582912.0)
    t = (x + k).astype(np.float32)
    f = (x - (t - k).astype(np.float32)).astype(np.float32)
    p = np.full_like(f, COEFFS[0])
    for c in COEFFS[1:]:
        p = fma(p, f, np.full_like(f, c))
    p = fma(p, f, np.ones_like(f))
    return (p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))).view(np.float32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stride", type=int, default=1)
    args = parser.parse_args()
    worst, worst_x = 0.0, None
    chunk = 1 << 24
    neg = (0x80000000, int(np.float32(-127).view(np.uint32)))
    pos = (0, int(np.float32(127).view(np.uint32)))
    for lo, hi in (neg, pos):
        for start in range(lo, hi + 1, chunk * args.stride):
            stop = min(start + chunk * args.stride, hi + 1)
            x = np.arange(start, stop, args.stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
            y = poly_exp2(x).astype(np.float64)
            ref = np.exp2(x.astype(np.float64))
            normal = ref >= 2.0**-126
            rel = np.abs(y[normal] / ref[normal] - 1)
            if rel.size and rel.max() > worst:
                worst, worst_x = float(rel.max()), float(x[normal][rel.argmax()])
            assert not (y[~normal] >= 2.0**-125).any(), "a tiny 2^x came out large"
    print(f"max relative error {worst:.3g} (2^{np.log2(worst):.2f}) at x = {worst_x!r}")
    for x in (-np.inf, -1000.0, -127.0, -126.9, 0.0, 1.0, 125.0):
        print(f"poly_exp2({x}) = {poly_exp2(np.array([x], np.float32))[0]!r}")


if __name__ == "__main__":
    main()
