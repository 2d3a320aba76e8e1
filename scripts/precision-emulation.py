#!/usr/bin/env python3
"""Compensated tensor-core GEMMs emulated on the CPU (issue 20's design
question, docs/PRECISION.md): relative L2 error against fp64 of one skinny
GEMM of the stack's shape (256 x 192 @ 192 x 192, weights ~ 1/sqrt(K)) for
activations scaled 1e-6 .. 1e5, three ways:

- fp32 FFMA, k ascending (what the exact stack computes);
- fp16x3 as upstream's so2_stack_fp16x3: each operand split into an fp16
  head and an fp16 tail scaled by 2^11, the activation pre-scaled by 2^-4,
  head x head and the two cross terms in separate fp32 accumulators (fp16 x
  fp16 products are exact in fp32, as on the tensor cores);
- bf16x3, the same with bf16 parts (tails scaled by 2^8);
- fp16x3 with each activation row scaled by the power of two that brings
  its largest |a| into [2^10, 2^11) (exact; divided out after the GEMM), in
  place of the fixed 2^-4.

It emulates the arithmetic, not the tensor cores' accumulation order: the
numbers say which split can reach fp32 accuracy and over what range, not
what a kernel measures.

    python3 scripts/precision-emulation.py        (numpy)
"""
import numpy as np


def bf16(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # round to nearest even
    return u.astype(np.uint32).view(np.float32)


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def split(x, rnd, shift):
    hi = rnd(x)
    return hi, rnd((x - hi) * np.float32(2.0**shift))


def mm32(a, b):
    """fp32 accumulation, k ascending from zero."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        acc = (acc + np.outer(a[:, k], b[k, :]).astype(np.float32)).astype(np.float32)
    return acc


def compensated(a, b, rnd, shift, a_scale):
    ah, al = split(a * np.float32(a_scale), rnd, shift)
    bh, bl = split(b, rnd, shift)
    head, tail = mm32(ah, bh), (mm32(ah, bl) + mm32(al, bh)).astype(np.float32)
    return ((head + tail * np.float32(2.0**-shift)) / np.float32(a_scale)).astype(np.float32)


def compensated_rows(a, b):
    """fp16x3 with a per-row power-of-two scale of the activation operand."""
    _, e = np.frexp(np.abs(a).max(axis=1, keepdims=True))  # max |row| in [2^(e-1), 2^e)
    scale = np.ldexp(np.float32(1), (11 - e).astype(np.int32)).astype(np.float32)
    ah, al = split(a * scale, f16, 11)
    bh, bl = split(b, f16, 11)
    head, tail = mm32(ah, bh), (mm32(ah, bl) + mm32(al, bh)).astype(np.float32)
    return ((head + tail * np.float32(2.0**-11)) / scale).astype(np.float32)


def main():
    rng = np.random.default_rng(7)
    m, k, n = 256, 192, 192
    print("| activation scale | fp32 FFMA | fp16x3 (2^11 tails, A x 2^-4) | bf16x3 (2^8 tails) "
          "| fp16x3, rows scaled by a power of two |")
    print("| --- | --- | --- | --- | --- |")
    for scale in [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1, 10, 100, 1e3, 1e4, 1e5, 1e7]:
        a = (rng.standard_normal((m, k)) * scale).astype(np.float32)
        b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        ref = a.astype(np.float64) @ b.astype(np.float64)

        def rel(c):
            return np.linalg.norm(c - ref) / np.linalg.norm(ref)

        print(f"| {scale:g} | {rel(mm32(a, b)):.2e} | {rel(compensated(a, b, f16, 11, 2.0**-4)):.2e} "
              f"| {rel(compensated(a, b, bf16, 8, 1.0)):.2e} | {rel(compensated_rows(a, b)):.2e} |")


if __name__ == "__main__":
    main()
