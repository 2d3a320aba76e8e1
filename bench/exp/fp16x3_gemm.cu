// Issue 20 experiment, outside the pipeline: the relay GEMM's shape,
// C[R x N] = A[R x K] @ B[K x N] (K = N = M1 = 192 or M0 = 128 at the seed,
// R = F * E = 1,292,000 rows), on the fp16 tensor cores with the split of
// docs/PRECISION.md: each row of A and all of B scaled by a power of two so
// that their largest magnitude lies in [2^10, 2^11), each operand split
// into an fp16 head and an fp16 tail scaled by 2^11, and
// C = (Ah Bh + (Ah Bl + Al Bh) 2^-11) / (sA sB), head and tail accumulated
// in fp32 apart (mma.sync m16n8k16, 3 products per tile).
//
// It answers two questions before the mode's design is fixed:
//   1. accuracy on the GPU's own accumulation order, against fp64 on
//      sampled rows, beside fp32 FFMA (k ascending) on the same rows, with
//      activations scaled over 1e-6 .. 1e7 (the range contract);
//   2. time of a plain mma.sync kernel (no ldmatrix, no TMA, no wgmma; one
//      shared-memory stage with the next chunk staged in registers) against
//      the relay's FFMA bwd_gemm on the same shape (mixstack bench per-kernel
//      times: m1 2.32 ms, m0 1.08 ms per launch at the seed on an H100,
//      BENCH.md run 91).
// Not built by cargo. On the GPU machine:
//   nvcc -O3 -arch=sm_90a -Xptxas -v -I templates -I generated-tests/cuda -o /tmp/fp16x3 bench/exp/fp16x3_gemm.cu -ldl
//   /tmp/fp16x3 [R] [reps]      (EXP_ALL=1: also the variants run 95 set aside)
// Variants: v1 (a row pre-pass), v2 (B split per block), v3 (the product's
// core), v4 and v5 (each operand split once; run 100): v4 and v5 are checked
// bit for bit against v3, whose arithmetic they keep; v6 (wgmma, sm_90a;
// run 119: v3's bits) and v7 (v6 with the next chunk's split overlapped with
// the products, the A registers kept live to the wait; not yet run), and
// cuBLAS's ceilings at the same shape.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <type_traits>
#include <vector>

// Variant 3 is the product core itself (templates/core.cuh: gemm_x3), so
// the build needs -I templates -I generated-tests/cuda (ops.cuh).
#include "stages.cuh"

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

constexpr int BM = 128, BN = 64, BK = 32, THREADS = 256;  // 8 warps: 4 (rows) x 2 (cols), 32 x 32 each
constexpr int PAD = 8;                                      // halves: rows 80 B apart, fragment loads conflict-free
constexpr int AS = BK + PAD;                                // A chunk row stride (halves)
constexpr float TAIL = 2048.f, INV_TAIL = 1.f / 2048.f;

// 2^(11 - x) for max = m * 2^x, m in [0.5, 1): max * scale in [2^10, 2^11).
__host__ __device__ inline float pow2_scale(float mx) {
  if (!(mx > 0.f) || !isfinite(mx)) return 1.f;
  int x;
  frexpf(mx, &x);
  return ldexpf(1.f, 11 - x);
}

// fp16 values as their bits (no cuda_fp16.h: the build's toolchain wheels
// have no CCCL headers); cvt rounds to nearest even.
typedef uint16_t half_t;
__device__ inline half_t f2h(float v) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
__device__ inline float h2f(half_t h) {
  float v;
  asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
  return v;
}
__device__ inline void split(float v, half_t& h, half_t& l) {
  h = f2h(v);
  l = f2h((v - h2f(h)) * TAIL);
}
// Two halves as one 32-bit word, the first (lower address) in the low bits.
__device__ inline uint32_t pack(half_t a, half_t b) { return (uint32_t)a | ((uint32_t)b << 16); }

// One warp per row: the row's largest magnitude, its scale.
__global__ void row_scales(const float* __restrict__ A, float* __restrict__ sA, long long R, int K) {
  const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= R) return;
  float mx = 0.f;
  for (int k = threadIdx.x % 32; k < K; k += 32) mx = fmaxf(mx, fabsf(A[row * K + k]));
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (threadIdx.x % 32 == 0) sA[row] = pow2_scale(mx);
}

// B (K x N, row-major) -> transposed fp16 head and tail (N x K), scaled by sB.
__global__ void split_b(const float* __restrict__ B, half_t* __restrict__ bh, half_t* __restrict__ bl, int K, int N,
                        float sB) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= K * N) return;
  const int k = i / N, n = i % N;
  half_t h, l;
  split(B[i] * sB, h, l);
  bh[n * K + k] = h;
  bl[n * K + k] = l;
}

__device__ inline void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ inline uint32_t ld32(const half_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// C = A @ B, the compensated product. Block: BM rows x BN columns; K in BK
// chunks, each A chunk split into head / tail halves in shared memory as it
// lands (the next chunk's floats already in registers).
__global__ void __launch_bounds__(THREADS, 1)
    gemm_fp16x3(const float* __restrict__ A, const float* __restrict__ sA, const half_t* __restrict__ bh,
                const half_t* __restrict__ bl, float invB, float* __restrict__ C, long long R, int K, int N) {
  __shared__ __align__(16) half_t ah_s[BM * AS], al_s[BM * AS], bh_s[BN * AS], bl_s[BN * AS];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp / 2, wn = warp % 2;
  const int g = lane / 4, t = lane % 4;
  const long long r0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;
  float acc_h[2][4][4] = {}, acc_t[2][4][4] = {};

  // A chunk: BM x BK floats = 1024 float4, 4 per thread; B chunk: BN x BK
  // halves per part = 256 16-byte pieces, one per thread per part.
  float4 va[4];
  float sc[4];
  auto load_a = [&](int k0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * THREADS, m = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
      const long long row = r0 + m;
      va[i] = row < R ? *reinterpret_cast<const float4*>(A + row * K + k0 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      sc[i] = row < R ? sA[row] : 1.f;
    }
  };
  auto store_a = [&]() {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * THREADS, m = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
      const float v[4] = {va[i].x * sc[i], va[i].y * sc[i], va[i].z * sc[i], va[i].w * sc[i]};
      half_t h[4], l[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) split(v[j], h[j], l[j]);
      *reinterpret_cast<uint2*>(ah_s + m * AS + c) = make_uint2(pack(h[0], h[1]), pack(h[2], h[3]));
      *reinterpret_cast<uint2*>(al_s + m * AS + c) = make_uint2(pack(l[0], l[1]), pack(l[2], l[3]));
    }
  };
  auto copy_b = [&](int k0) {
    const int n = tid / (BK / 8), c = (tid % (BK / 8)) * 8;  // 64 rows x 4 pieces of 8 halves
    const bool in = n0 + n < N;
    const uint4 z = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(bh_s + n * AS + c) = in ? *reinterpret_cast<const uint4*>(bh + (n0 + n) * K + k0 + c) : z;
    *reinterpret_cast<uint4*>(bl_s + n * AS + c) = in ? *reinterpret_cast<const uint4*>(bl + (n0 + n) * K + k0 + c) : z;
  };

  load_a(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
    __syncthreads();  // the previous chunk's fragments are read
    store_a();
    copy_b(k0);
    if (k0 + BK < K) load_a(k0 + BK);  // in flight under this chunk's mma
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t ahf[2][4], alf[2][4], bhf[4][2], blf[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = wm * 32 + i * 16 + g;
        const half_t* ph = ah_s + m * AS + kk + 2 * t;
        const half_t* pl = al_s + m * AS + kk + 2 * t;
        ahf[i][0] = ld32(ph), ahf[i][1] = ld32(ph + 8 * AS), ahf[i][2] = ld32(ph + 8), ahf[i][3] = ld32(ph + 8 * AS + 8);
        alf[i][0] = ld32(pl), alf[i][1] = ld32(pl + 8 * AS), alf[i][2] = ld32(pl + 8), alf[i][3] = ld32(pl + 8 * AS + 8);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = wn * 32 + j * 8 + g;
        const half_t* ph = bh_s + n * AS + kk + 2 * t;
        const half_t* pl = bl_s + n * AS + kk + 2 * t;
        bhf[j][0] = ld32(ph), bhf[j][1] = ld32(ph + 8);
        blf[j][0] = ld32(pl), blf[j][1] = ld32(pl + 8);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mma16816(acc_h[i][j], ahf[i], bhf[j]);
          mma16816(acc_t[i][j], ahf[i], blf[j]);
          mma16816(acc_t[i][j], alf[i], bhf[j]);
        }
    }
  }
  // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8.
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long row = r0 + wm * 32 + i * 16 + g + 8 * h;
      if (row >= R) continue;
      const float inv = invB / sA[row];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = n0 + wn * 32 + j * 8 + 2 * t;
        if (n >= N) continue;
        float2 o;
        o.x = (acc_h[i][j][2 * h] + acc_t[i][j][2 * h] * INV_TAIL) * inv;
        o.y = (acc_h[i][j][2 * h + 1] + acc_t[i][j][2 * h + 1] * INV_TAIL) * inv;
        *reinterpret_cast<float2*>(C + row * N + n) = o;
      }
    }
}

// ---------------------------------------------------------------------------
// Variant 2, the candidate core for the mode: persistent blocks, each with
// its column tile of B split once into fp16 head / tail in shared memory
// (n-major, read with ldmatrix), A streamed in fp32 through a cp.async ring
// of BK-wide chunks across the block's row tiles, each warp splitting its
// own A fragments in registers. The scale is per (row, K chunk): a power of
// two from the chunk's row max (a quad's shuffles), so no pre-pass and no
// per-row state; each chunk's head and tail products land in zeroed
// fragments and fold into the fp32 result as (h + t 2^-11) * 2^-x, the same
// instruction sequence wherever the core runs (relay or fused: bitwise).
namespace v2 {
constexpr int BN = 64, WM = 32, WN = 32;  // warp tile: 2 m16 x 4 n8
constexpr int APAD = 8;                    // floats: float2 fragment loads conflict-free

__device__ inline uint32_t f2h2(float lo, float hi) {  // two floats -> f16x2, lo in the low half
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ inline float2 h22f(uint32_t h) {
  float2 v;
  asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h; }" : "=f"(v.x), "=f"(v.y) : "r"(h));
  return v;
}
// x * s split into head and tail (tail scaled by 2^11), two at a time.
__device__ inline void split2(float2 x, float s, uint32_t& h, uint32_t& l) {
  x.x *= s, x.y *= s;
  h = f2h2(x.x, x.y);
  const float2 hb = h22f(h);
  l = f2h2((x.x - hb.x) * TAIL, (x.y - hb.y) * TAIL);
}
// 2^(11 - x) for mx = m 2^x (m in [0.5, 1)), and its inverse, from the bits:
// exact powers of two; a zero or non-finite max gives 1 (the row's values
// then pass unscaled: zeros stay zero, inf / NaN stay non-finite).
__device__ inline void scale_of(float mx, float& s, float& inv) {
  const int ex = (int)((__float_as_uint(mx) >> 23) & 0xff);  // x = ex - 126 for normal mx
  if (ex == 0 || ex == 255) {
    s = 1.f, inv = 1.f;
    return;
  }
  const int x = ex - 126;
  const int es = min(max(127 + 11 - x, 1), 254), ei = min(max(127 - 11 + x, 1), 254);
  s = __uint_as_float((uint32_t)es << 23), inv = __uint_as_float((uint32_t)ei << 23);
}
__device__ inline void ldsm4(uint32_t (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ inline void mma_z(float* c, const uint32_t* a, const uint32_t* b) {  // c = a b (fresh)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.f));
}
__device__ inline unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ inline void cp16(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

template <int BM, int BK, int ST>
struct Cfg {
  static constexpr int WARPS = (BM / WM) * (BN / WN), THREADS = WARPS * 32;
  static constexpr int AK = BK + APAD;
  static int smem(int K) { return 2 * BN * (K + 8) * 2 + ST * BM * AK * 4; }
};

template <int BM, int BK, int ST>
__global__ void __launch_bounds__(Cfg<BM, BK, ST>::THREADS)
    gemm_x3(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, long long R, int K, int N) {
  typedef Cfg<BM, BK, ST> CF;
  extern __shared__ __align__(16) unsigned char sm[];
  const int BP = K + 8;  // halves per panel row (n-major): 4 words of skew per row
  uint16_t* bph = reinterpret_cast<uint16_t*>(sm);
  uint16_t* bpl = bph + BN * BP;
  float* As = reinterpret_cast<float*>(sm + 2 * BN * BP * 2);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / (BN / WN), wn = warp % (BN / WN), g = lane / 4, t = lane % 4;
  const int NT = N / BN, KT = K / BK;
  const long long RT = (R + BM - 1) / BM, tiles = RT * NT;
  const long long my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const long long chunks = my_tiles * KT;

  auto load = [&](long long q) {  // chunk q of this block's walk -> stage q % ST
    const long long tile = blockIdx.x + (q / KT) * gridDim.x;
    const long long r0 = (tile / NT) * BM;
    const int k0 = (int)(q % KT) * BK;
    float* as = As + (int)(q % ST) * BM * CF::AK;
    for (int v = tid; v < BM * BK / 4; v += CF::THREADS) {
      const int m = v / (BK / 4), c = (v % (BK / 4)) * 4;
      const bool ok = r0 + m < R;
      cp16(saddr(as + m * CF::AK + c), ok ? A + (r0 + m) * K + k0 + c : A, ok ? 16 : 0);
    }
  };
  int panel_col = -1;
  float acc[2][4][4];
  for (long long q = 0; q < ST - 1; ++q) {
    if (q < chunks) load(q);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (long long q = 0; q < chunks; ++q) {
    const long long tile = blockIdx.x + (q / KT) * gridDim.x;
    const int kc = (int)(q % KT), n0 = (int)(tile % NT) * BN;
    if (kc == 0 && n0 != panel_col) {  // this tile's column of B, split (once per block when gridDim % NT == 0)
      __syncthreads();
      for (int i = tid; i < K * BN; i += CF::THREADS) {
        const int k = i / BN, n = i % BN;
        const float b = B[(long long)k * N + n0 + n];
        const uint16_t h = f2h(b);
        bph[n * BP + k] = h, bpl[n * BP + k] = f2h((b - h2f(h)) * TAIL);
      }
      panel_col = n0;
    }
    if (kc == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
    }
    asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2) : "memory");
    __syncthreads();  // chunk q landed (and the panel is split); stage (q - 1) % ST is free
    if (q + ST - 1 < chunks) load(q + ST - 1);
    asm volatile("cp.async.commit_group;\n" ::);
    const float* as = As + (int)(q % ST) * BM * CF::AK;
    // One m16 tile at a time (fewer live fragments): its rows' scales for
    // this chunk (rows g and g + 8, max over the quad), then the chunk's
    // products into fresh fragments, folded into acc.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float s[2], inv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* row = as + (wm * WM + i * 16 + g + 8 * h) * CF::AK + 2 * t;
        float mx = 0.f;
#pragma unroll
        for (int k = 0; k < BK; k += 8) {
          const float2 v = *reinterpret_cast<const float2*>(row + k);
          mx = fmaxf(mx, fmaxf(fabsf(v.x), fabsf(v.y)));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        scale_of(mx, s[h], inv[h]);
      }
      float ch[4][4], ct[4][4];
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        uint32_t ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // a0a1: (g, 2t), a2a3: (g+8, 2t), a4a5: (g, 2t+8), a6a7: (g+8, 2t+8)
          const int h = r % 2, m = wm * WM + i * 16 + g + 8 * h, k = kk + 2 * t + 8 * (r / 2);
          split2(*reinterpret_cast<const float2*>(as + m * CF::AK + k), s[h], ah[r], al[r]);
        }
        uint32_t bh[4][2], bl[4][2];
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
          const int mi = lane / 8, n = wn * WN + (j + mi / 2) * 8 + lane % 8, k = kc * BK + kk + (mi % 2) * 8;
          uint32_t r[4];
          ldsm4(r, saddr(bph + n * BP + k));
          bh[j][0] = r[0], bh[j][1] = r[1], bh[j + 1][0] = r[2], bh[j + 1][1] = r[3];
          ldsm4(r, saddr(bpl + n * BP + k));
          bl[j][0] = r[0], bl[j][1] = r[1], bl[j + 1][0] = r[2], bl[j + 1][1] = r[3];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (kk == 0) {
            mma_z(ch[j], ah, bh[j]);
            mma_z(ct[j], ah, bl[j]);
          } else {
            mma16816(ch[j], ah, bh[j]);
            mma16816(ct[j], ah, bl[j]);
          }
          mma16816(ct[j], al, bh[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = fmaf(fmaf(ct[j][c], INV_TAIL, ch[j][c]), inv[c / 2], acc[i][j][c]);
    }
    if (kc == KT - 1) {  // the tile's epilogue, straight from the fragments
      const long long r0 = (tile / NT) * BM;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long row = r0 + wm * WM + i * 16 + g + 8 * h;
          if (row >= R) continue;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = n0 + wn * WN + j * 8 + 2 * t;
            *reinterpret_cast<float2*>(C + row * N + n) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
          }
        }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Launch with as many blocks as fit, rounded down to a multiple of the
// column tiles (each block then splits one panel).
template <int BM, int BK, int ST>
float run(const float* dA, const float* dB, float* dC, long long R, int K, int N, int reps_unused) {
  (void)reps_unused;
  typedef Cfg<BM, BK, ST> CF;
  const int smem = CF::smem(K);
  CK(cudaFuncSetAttribute(gemm_x3<BM, BK, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemm_x3<BM, BK, ST>, CF::THREADS, smem));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int NT = N / BN;
  int grid = std::max(NT, per_sm * sms / NT * NT);
  gemm_x3<BM, BK, ST><<<grid, CF::THREADS, smem>>>(dA, dB, dC, R, K, N);
  return (float)per_sm;
}
}  // namespace v2

// ---------------------------------------------------------------------------
// Variant 3: the product's fp16x3 core (ms::gemm_x3, as the relay's GEMM
// stages run it from tiles.yaml's precision: fp16x3 tiles), C = A @ B with a
// plain store epilogue, launched as the runtime launches a streaming tile:
// as many blocks as are resident.
namespace v3 {
// The ring as crates/gen/src/layout.rs places an fp16x3 tile's (the
// instance's Smem): A rows of BK + 8 floats, then B rows of BN + 4.
template <int TBM, int TBK, int TST>
struct Cfg {
  static constexpr int THREADS = TBM * 64 / 32;
  static constexpr int a_pitch = TBK + 8, b_pitch = 64 + 4;
  static constexpr int a_tile = 0, b_tile = TST * TBM * a_pitch * 4;
  static constexpr int SMEM = b_tile + TST * TBK * b_pitch * 4;
};
template <int TBM, int TBK, int TST, int MINB>
__global__ void __launch_bounds__(Cfg<TBM, TBK, TST>::THREADS, MINB)
    core(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, long long R, int K, int N) {
  ms::SurfaceA<float> a{A, K};
  ms::gemm_x3<TBM, 64, TBK, TST, Cfg<TBM, TBK, TST>>(
      R, K, N, B, a, [&](ms::i64 e, int n, const float* v) { ms::Vec<float>::store(C + e * N + n, v); });
}
template <int TBM, int TBK, int TST, int MINB>
void run(const float* dA, const float* dB, float* dC, long long R, int K, int N) {
  typedef Cfg<TBM, TBK, TST> CF;
  auto k = core<TBM, TBK, TST, MINB>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, CF::SMEM));
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, CF::THREADS, CF::SMEM));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  k<<<std::max(1, per_sm * sms), CF::THREADS, CF::SMEM>>>(dA, dB, dC, R, K, N);
}
}  // namespace v3


// ---------------------------------------------------------------------------
// Variant 4, each operand split once (docs/PRECISION.md, "the core's next
// form"), with v3's arithmetic so that its output is v3's bit for bit at
// the same BK (checked below):
//   - B split once per call (split_bt: n-major fp16 head and unscaled tail
//     x 2^11, as x3::split2 splits it) and held whole in shared memory by
//     each persistent block (N x (K + 8) halves per half, ldmatrix);
//   - a block owns BM rows x all N columns, so each A chunk is read once and
//     split once, by the whole block: the f32 chunk lands through a cp.async
//     ring, each quad of threads takes one row's BK values, forms the (row,
//     chunk) scale (x3::scale_of of the quad's max), and writes head / tail
//     halves and the row's inverse scale into one of two buffers; warps read
//     their fragments with ldmatrix. One barrier per chunk: the split of
//     chunk q + 1 runs beside the products of chunk q.
// Warps: WR (rows) x WC (columns); a warp owns 16 * MI rows x N / WC columns.
namespace v4 {
__global__ void split_bt(const float* __restrict__ B, uint16_t* __restrict__ bh, uint16_t* __restrict__ bl, int K,
                         int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over N x K/2, pairs along k
  if (i >= N * K / 2) return;
  const int n = i / (K / 2), k = 2 * (i % (K / 2));
  unsigned h, l;
  ms::x3::split2(B[(size_t)k * N + n], B[(size_t)(k + 1) * N + n], h, l);
  reinterpret_cast<unsigned*>(bh)[(size_t)n * (K / 2) + k / 2] = h;
  reinterpret_cast<unsigned*>(bl)[(size_t)n * (K / 2) + k / 2] = l;
}
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Eight consecutive values of one chunk row (a quad of lanes holds the
// row's BK = 32): the (row, chunk) scale from the quad's max, the values
// scaled and split into 16 bytes of head and 16 of tail; returns the
// inverse scale.
__device__ __forceinline__ float split8(const float* src, uint16_t* head, uint16_t* tail) {
  const float4 x = *reinterpret_cast<const float4*>(src);
  const float4 y = *reinterpret_cast<const float4*>(src + 4);
  float mx = fmaxf(fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))),
                   fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w))));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float sc, inv;
  ms::x3::scale_of(mx, sc, inv);
  uint4 h, l;
  ms::x3::split2(x.x * sc, x.y * sc, h.x, l.x);
  ms::x3::split2(x.z * sc, x.w * sc, h.y, l.y);
  ms::x3::split2(y.x * sc, y.y * sc, h.z, l.z);
  ms::x3::split2(y.z * sc, y.w * sc, h.w, l.w);
  *reinterpret_cast<uint4*>(head) = h;
  *reinterpret_cast<uint4*>(tail) = l;
  return inv;
}
template <int BM, int BK, int ST, int N, int WR, int WC>
struct Cfg {
  static constexpr int K = N, THREADS = WR * WC * 32, MI = BM / WR / 16, NJ = N / WC / 8;
  static constexpr int AP = BK + 4;  // f32 ring pitch (floats): the split's float4 reads conflict-free
  static constexpr int HP = BK + 8;  // halves pitch: 16-byte row steps odd, ldmatrix conflict-free
  static constexpr int PP = K + 8;   // B panel pitch (halves)
  static constexpr int PANEL = 2 * N * PP * 2, RING = ST * BM * AP * 4, HALVES = 2 * 2 * BM * HP * 2, INV = 2 * BM * 4;
  static constexpr int SMEM = PANEL + RING + HALVES + INV;
  static_assert(BM * BK / 8 == THREADS, "the split: one thread per 8 values of a chunk (a quad per row)");
  static_assert(NJ % 2 == 0, "ldmatrix.x4 loads two n8 tiles");
};
template <int BM, int BK, int ST, int N, int WR, int WC, int MINB>
__global__ void __launch_bounds__(Cfg<BM, BK, ST, N, WR, WC>::THREADS, MINB)
    gemm(const float* __restrict__ A, const uint16_t* __restrict__ Bth, const uint16_t* __restrict__ Btl,
         float* __restrict__ C, long long R) {
  typedef Cfg<BM, BK, ST, N, WR, WC> CF;
  constexpr int K = CF::K, KT = K / BK, MI = CF::MI, NJ = CF::NJ;
  extern __shared__ __align__(16) unsigned char sm[];
  uint16_t* panel = reinterpret_cast<uint16_t*>(sm);  // head rows 0..N-1, tail rows N..2N-1
  float* ring = reinterpret_cast<float*>(sm + CF::PANEL);
  uint16_t* halves = reinterpret_cast<uint16_t*>(sm + CF::PANEL + CF::RING);  // [buf][head|tail][BM][HP]
  float* sinv = reinterpret_cast<float*>(sm + CF::PANEL + CF::RING + CF::HALVES);  // [buf][BM]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wr = warp / WC, wc = warp % WC;
  const long long RB = (R + BM - 1) / BM;
  const long long mine = blockIdx.x < RB ? (RB - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const long long chunks = mine * KT;

  // the panel: both halves of B, one group ahead of the ring's
  for (int v = tid; v < 2 * N * (K / 8); v += CF::THREADS) {
    const int row = v / (K / 8), c = (v % (K / 8)) * 8;
    const uint16_t* src = row < N ? Bth + (size_t)row * K + c : Btl + (size_t)(row - N) * K + c;
    ms::cp_async16(panel + row * CF::PP + c, src, 16);
  }
  ms::cp_async_commit();
  auto load = [&](long long q) {  // chunk q of the walk -> ring slot q % ST
    const long long r0 = (blockIdx.x + (q / KT) * gridDim.x) * BM;
    const int k0 = (int)(q % KT) * BK;
    float* slot = ring + (int)(q % ST) * BM * CF::AP;
    for (int v = tid; v < BM * BK / 4; v += CF::THREADS) {
      const int m = v / (BK / 4), c = (v % (BK / 4)) * 4;
      const bool ok = r0 + m < R;
      ms::cp_async16(slot + m * CF::AP + c, ok ? A + (r0 + m) * K + k0 + c : A, ok ? 16 : 0);
    }
  };
  // chunk q's f32 values -> halves buffer q % 2 and its rows' inverse scales
  auto split = [&](long long q) {
    const float* slot = ring + (int)(q % ST) * BM * CF::AP;
    const int m = tid / 4, c = (tid % 4) * 8;
    uint16_t* hb = halves + (int)(q % 2) * 2 * BM * CF::HP;
    const float inv = split8(slot + m * CF::AP + c, hb + m * CF::HP + c, hb + (BM + m) * CF::HP + c);
    if (tid % 4 == 0) sinv[(int)(q % 2) * BM + m] = inv;
  };
  float acc[MI][NJ][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  for (int q = 0; q < ST - 1; ++q) {
    if (q < chunks) load(q);
    ms::cp_async_commit();
  }
  if (chunks > 0) {  // chunk 0 split before the loop (its ring slot waited for)
    ms::cp_async_wait<ST - 2>();
    __syncthreads();
    split(0);
  }
  const int g = lane / 4, t = lane % 4, mi = lane / 8;
  for (long long q = 0; q < chunks; ++q) {
    // chunk q + 1 landed; halves q % 2 written; every read of halves (q + 1) % 2 done
    ms::cp_async_wait<ST - 3 < 0 ? 0 : ST - 3>();
    __syncthreads();
    if (q + ST - 1 < chunks) load(q + ST - 1);
    ms::cp_async_commit();
    if (q + 1 < chunks) split(q + 1);
    const int kc = (int)(q % KT);
    const uint16_t* hb = halves + (int)(q % 2) * 2 * BM * CF::HP;
    // B fragments of the chunk, for every n8 tile of this warp's columns
    unsigned bh[BK / 16][NJ][2], bl[BK / 16][NJ][2];
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        const int n = wc * (N / WC) + (j + mi / 2) * 8 + lane % 8, k = kc * BK + ks * 16 + (mi % 2) * 8;
        unsigned r[4];
        ldsm4(r, ms::smem_addr(panel + n * CF::PP + k));
        bh[ks][j][0] = r[0], bh[ks][j][1] = r[1], bh[ks][j + 1][0] = r[2], bh[ks][j + 1][1] = r[3];
        ldsm4(r, ms::smem_addr(panel + (N + n) * CF::PP + k));
        bl[ks][j][0] = r[0], bl[ks][j][1] = r[1], bl[ks][j + 1][0] = r[2], bl[ks][j + 1][1] = r[3];
      }
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const int m0 = wr * (BM / WR) + i * 16;
      float ph[NJ][4], pt[NJ][4];
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        unsigned ah[4], al[4];
        const int row = m0 + (mi % 2) * 8 + lane % 8, k = ks * 16 + (mi / 2) * 8;
        ldsm4(ah, ms::smem_addr(hb + row * CF::HP + k));
        ldsm4(al, ms::smem_addr(hb + (BM + row) * CF::HP + k));
        ms::x3::products(ph, pt, ah, al, bh[ks], bl[ks], ks == 0);
      }
      const float* inv = sinv + (int)(q % 2) * BM + m0 + g;
      const float inv0 = inv[0], inv1 = inv[8];
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          acc[i][j][c] = fmaf(fmaf(pt[j][c], ms::x3::INV_TAIL, ph[j][c]), c < 2 ? inv0 : inv1, acc[i][j][c]);
    }
    if (kc == KT - 1) {  // the row block's epilogue, straight from the fragments
      const long long r0 = (blockIdx.x + (q / KT) * gridDim.x) * BM;
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long row = r0 + wr * (BM / WR) + i * 16 + g + 8 * h;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            const int n = wc * (N / WC) + j * 8 + 2 * t;
            if (row < R) *reinterpret_cast<float2*>(C + row * N + n) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            acc[i][j][2 * h] = acc[i][j][2 * h + 1] = 0.f;
          }
        }
    }
  }
  ms::cp_async_wait<0>();
}
// B split per call (as the runtime would for borrowed weights), then the GEMM
// on as many blocks as are resident.
template <int BM, int BK, int ST, int N, int WR, int WC, int MINB>
void run(const float* dA, const float* dB, uint16_t* bth, uint16_t* btl, float* dC, long long R) {
  typedef Cfg<BM, BK, ST, N, WR, WC> CF;
  auto k = gemm<BM, BK, ST, N, WR, WC, MINB>;
  static int per_sm = -1, sms = 0;
  if (per_sm < 0) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, CF::SMEM));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, CF::THREADS, CF::SMEM));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("# v4 m%d k%d s%d %dx%d warps, N %d: %d B shared, %d block(s) per SM\n", BM, BK, ST, WR, WC, N, CF::SMEM,
                per_sm);
  }
  split_bt<<<(N * N / 2 + 255) / 256, 256>>>(dB, bth, btl, N, N);
  const long long RB = (R + BM - 1) / BM;
  k<<<(unsigned)std::min<long long>(RB, std::max(1, per_sm * sms)), CF::THREADS, CF::SMEM>>>(dA, bth, btl, dC, R);
}
}  // namespace v4

// ---------------------------------------------------------------------------
// Variant 5, v4's split-once arithmetic in a form the stack's stages can
// take at any N (N = (L + 1) Cf or 2 L Cf is a runtime value there): a
// persistent block owns BM rows and walks their column tiles (BN) one after
// the other, like the fused backward's row-block walk. At the row block's
// first column tile each A chunk lands through a cp.async ring and is split
// once, by the whole block, into halves that stay resident for the row
// block (BM x K halves, head and tail, and a scale per (row, chunk)); every
// later column tile reads them again. B comes pre-split (split_bt) through
// a ring of BN x BK halves per step. One barrier per step; a step's split
// runs in the step before it. Same products and folds per output element as
// v3 and v4 (checked bitwise).
namespace v5 {
template <int BM, int BN, int BK, int ST, int K>
struct Cfg {
  static constexpr int THREADS = BM * BN / 32 / 32 * 32, KT = K / BK;  // a warp per 32 x 32
  static constexpr int AP = BK + 4, HP = K + 8, BP = BK + 8;
  static constexpr int HALVES = 2 * BM * HP * 2, INV = KT * BM * 4, ARING = ST * BM * AP * 4, BRING = ST * 2 * BN * BP * 2;
  static constexpr int SMEM = HALVES + INV + ARING + BRING;
  static_assert(BM * BK / 8 % THREADS == 0 && THREADS % 4 == 0, "the split: whole quads per row");
};
template <int BM, int BN, int BK, int ST, int K, int MINB>
__global__ void __launch_bounds__(Cfg<BM, BN, BK, ST, K>::THREADS, MINB)
    gemm(const float* __restrict__ A, const uint16_t* __restrict__ Bth, const uint16_t* __restrict__ Btl,
         float* __restrict__ C, long long R, int N) {
  typedef Cfg<BM, BN, BK, ST, K> CF;
  constexpr int KT = CF::KT, THREADS = CF::THREADS;
  extern __shared__ __align__(16) unsigned char sm[];
  uint16_t* halves = reinterpret_cast<uint16_t*>(sm);  // head rows 0..BM-1, tail rows BM..2BM-1, pitch HP
  float* sinv = reinterpret_cast<float*>(sm + CF::HALVES);  // [KT][BM]
  float* aring = reinterpret_cast<float*>(sm + CF::HALVES + CF::INV);
  uint16_t* bring = reinterpret_cast<uint16_t*>(sm + CF::HALVES + CF::INV + CF::ARING);  // [ST][head|tail][BN][BP]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp / (BN / 32), wn = warp % (BN / 32);
  const int NT = N / BN, SR = NT * KT;  // steps per row block
  const long long RB = (R + BM - 1) / BM;
  const long long mine = blockIdx.x < RB ? (RB - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const long long steps = mine * SR;
  auto r0_of = [&](long long s) { return (blockIdx.x + (s / SR) * gridDim.x) * (long long)BM; };
  auto load = [&](long long s) {
    const int in = (int)(s % SR), ct = in / KT, kc = in % KT;
    uint16_t* bs = bring + (int)(s % ST) * 2 * BN * CF::BP;
    for (int v = tid; v < 2 * BN * (BK / 8); v += THREADS) {
      const int row = v / (BK / 8), c = (v % (BK / 8)) * 8, n = ct * BN + row % BN;
      ms::cp_async16(bs + row * CF::BP + c, (row < BN ? Bth : Btl) + (size_t)n * K + kc * BK + c, 16);
    }
    if (ct == 0) {
      const long long r0 = r0_of(s);
      float* as = aring + (int)(s % ST) * BM * CF::AP;
      for (int v = tid; v < BM * BK / 4; v += THREADS) {
        const int m = v / (BK / 4), c = (v % (BK / 4)) * 4;
        const bool ok = r0 + m < R;
        ms::cp_async16(as + m * CF::AP + c, ok ? A + (r0 + m) * K + kc * BK + c : A, ok ? 16 : 0);
      }
    }
  };
  auto split = [&](long long s) {  // step s's A chunk (ct == 0) -> resident halves, chunk kc
    const int kc = (int)(s % SR) % KT;
    const float* as = aring + (int)(s % ST) * BM * CF::AP;
#pragma unroll
    for (int it = 0; it < BM * BK / 8 / THREADS; ++it) {
      const int i = it * THREADS + tid, m = i / (BK / 8), c = (i % (BK / 8)) * 8;
      const float inv = v4::split8(as + m * CF::AP + c, halves + m * CF::HP + kc * BK + c,
                                   halves + (BM + m) * CF::HP + kc * BK + c);
      if (tid % 4 == 0) sinv[kc * BM + m] = inv;
    }
  };
  static_assert(BK / 8 == 4, "a quad of threads per row of a chunk");
  float acc[2][4][4];
  ms::zero_acc(acc[0]);
  ms::zero_acc(acc[1]);
  for (int s = 0; s < ST - 1; ++s) {
    if (s < steps) load(s);
    ms::cp_async_commit();
  }
  if (steps > 0) {
    ms::cp_async_wait<ST - 2>();
    __syncthreads();
    split(0);
  }
  const int g = lane / 4, t = lane % 4, mi = lane / 8;
  for (long long s = 0; s < steps; ++s) {
    ms::cp_async_wait<ST - 3 < 0 ? 0 : ST - 3>();  // step s + 1's chunks landed
    __syncthreads();
    if (s + ST - 1 < steps) load(s + ST - 1);
    ms::cp_async_commit();
    if (s + 1 < steps && (s + 1) % SR < KT) split(s + 1);
    const int in = (int)(s % SR), ct = in / KT, kc = in % KT;
    const uint16_t* bs = bring + (int)(s % ST) * 2 * BN * CF::BP;
    unsigned bh[BK / 16][4][2], bl[BK / 16][4][2];
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        const int n = wn * 32 + (j + mi / 2) * 8 + lane % 8, k = ks * 16 + (mi % 2) * 8;
        unsigned r[4];
        v4::ldsm4(r, ms::smem_addr(bs + n * CF::BP + k));
        bh[ks][j][0] = r[0], bh[ks][j][1] = r[1], bh[ks][j + 1][0] = r[2], bh[ks][j + 1][1] = r[3];
        v4::ldsm4(r, ms::smem_addr(bs + (BN + n) * CF::BP + k));
        bl[ks][j][0] = r[0], bl[ks][j][1] = r[1], bl[ks][j + 1][0] = r[2], bl[ks][j + 1][1] = r[3];
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int m0 = wm * 32 + i * 16;
      float ph[4][4], pt[4][4];
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        unsigned ah[4], al[4];
        const int row = m0 + (mi % 2) * 8 + lane % 8, k = kc * BK + ks * 16 + (mi / 2) * 8;
        v4::ldsm4(ah, ms::smem_addr(halves + row * CF::HP + k));
        v4::ldsm4(al, ms::smem_addr(halves + (BM + row) * CF::HP + k));
        ms::x3::products(ph, pt, ah, al, bh[ks], bl[ks], ks == 0);
      }
      const float inv0 = sinv[kc * BM + m0 + g], inv1 = sinv[kc * BM + m0 + g + 8];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          acc[i][j][c] = fmaf(fmaf(pt[j][c], ms::x3::INV_TAIL, ph[j][c]), c < 2 ? inv0 : inv1, acc[i][j][c]);
    }
    if (kc == KT - 1) {
      const long long r0 = r0_of(s);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long row = r0 + wm * 32 + i * 16 + g + 8 * h;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int n = ct * BN + wn * 32 + j * 8 + 2 * t;
            if (row < R) *reinterpret_cast<float2*>(C + row * N + n) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            acc[i][j][2 * h] = acc[i][j][2 * h + 1] = 0.f;
          }
        }
    }
  }
  ms::cp_async_wait<0>();
}
template <int BM, int BN, int BK, int ST, int K, int MINB>
void run(const float* dB, uint16_t* bth, uint16_t* btl, const float* dA, float* dC, long long R) {
  typedef Cfg<BM, BN, BK, ST, K> CF;
  auto k = gemm<BM, BN, BK, ST, K, MINB>;
  static int per_sm = -1, sms = 0;
  if (per_sm < 0) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, CF::SMEM));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, CF::THREADS, CF::SMEM));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("# v5 m%d n%d k%d s%d, K %d: %d threads, %d B shared, %d block(s) per SM\n", BM, BN, BK, ST, K, CF::THREADS,
                CF::SMEM, per_sm);
  }
  v4::split_bt<<<(K * K / 2 + 255) / 256, 256>>>(dB, bth, btl, K, K);
  const long long RB = (R + BM - 1) / BM;
  k<<<(unsigned)std::min<long long>(RB, std::max(1, per_sm * sms)), CF::THREADS, CF::SMEM>>>(dA, bth, btl, dC, R, K);
}
}  // namespace v5

// ---------------------------------------------------------------------------
// Variant 6, the tensor cores' Hopper path (docs/PRECISION.md, "the next
// core"): wgmma.mma_async with A from registers (split per warp as v3 does,
// the same scale per (row, chunk)) and B pre-split (split_bt) held for the
// block's column tile in shared memory in wgmma's no-swizzle K-major layout
// (8 x 8 core matrices of 128 bytes: K-neighbours 128 B apart (LBO), N-
// neighbours K / 8 x 128 B apart (SBO)). Two consumer warpgroups per block,
// 64 rows each, each with its own cp.async ring and named barrier, so that
// one splits while the other's products run. Per chunk and warpgroup the
// products go out as one wgmma group (v3's order: ph = ah bh, pt = ah bl +
// al bh per k16 step), then the fold of v3. The accumulation order inside
// wgmma need not be mma.sync's: bits are compared with v3, not required.
// Needs sm_90a.
namespace v6 {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mma_n96(float (&d)[48], const unsigned (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void mma_n64(float (&d)[32], const unsigned (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

#endif
__device__ __forceinline__ uint64_t desc(const void* smem, unsigned lbo, unsigned sbo) {
  const unsigned a = ms::smem_addr(smem);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
template <int R>
__device__ __forceinline__ void keep(float (&d)[R]) {  // no access to d moves across a wgmma fence or wait
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A register operands stay live (and unmoved) to the wgmma wait: the
// instruction reads them asynchronously, which the compiler cannot see.
template <int S>
__device__ __forceinline__ void keep_a(unsigned (&a)[S][4]) {
#pragma unroll
  for (int i = 0; i < S; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
template <int BN, int K, int ST>
struct Cfg {
  static constexpr int THREADS = 256, BM = 128, BK = 32, KT = K / BK, AP = BK + 8, REGS = BN / 2;
  static constexpr int PANEL = 2 * BN * K * 2, RING = ST * 64 * AP * 4, SMEM = PANEL + 2 * RING;
};
template <int BN, int K, int ST, bool OV>
__global__ void __launch_bounds__(256, 1)
    gemm(const float* __restrict__ A, const uint16_t* __restrict__ Bth, const uint16_t* __restrict__ Btl,
         float* __restrict__ C, long long R, int N) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  typedef Cfg<BN, K, ST> CF;
  constexpr int KT = CF::KT, BK = CF::BK, AP = CF::AP, REGS = CF::REGS;
  extern __shared__ __align__(128) unsigned char sm[];
  uint16_t* panel = reinterpret_cast<uint16_t*>(sm);  // head: BN x K halves, then tail
  const int tid = threadIdx.x, wg = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  float* ring = reinterpret_cast<float*>(sm + CF::PANEL) + wg * ST * 64 * AP;
  const int NT = N / BN, ct = blockIdx.x % NT, G = gridDim.x / NT;
  const long long RB = (R + 127) / 128, rb0 = blockIdx.x / NT;
  const long long mine = rb0 < RB ? (RB - 1 - rb0) / G + 1 : 0;
  const long long chunks = mine * KT;
  // the column tile's B, both halves, into core matrices
  for (int v = tid; v < 2 * BN * (K / 8); v += 256) {
    const int which = v / (BN * (K / 8)), i = v % (BN * (K / 8)), n = i / (K / 8), kg = i % (K / 8);
    const uint16_t* src = (which ? Btl : Bth) + (size_t)(ct * BN + n) * K + kg * 8;
    ms::cp_async16(panel + which * BN * K + ((n / 8) * (K / 8) + kg) * 64 + (n % 8) * 8, src, 16);
  }
  ms::cp_async_commit();
  ms::cp_async_wait<0>();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes, then wgmma's reads
  __syncthreads();
  auto load = [&](long long q) {  // chunk q of this warpgroup's walk -> its ring slot q % ST
    const long long r0 = (rb0 + (q / KT) * G) * 128 + wg * 64;
    const int k0 = (int)(q % KT) * BK;
    float* slot = ring + (int)(q % ST) * 64 * AP;
    for (int v = wt; v < 64 * BK / 4; v += 128) {
      const int m = v / (BK / 4), c = (v % (BK / 4)) * 4;
      const bool ok = r0 + m < R;
      ms::cp_async16(slot + m * AP + c, ok ? A + (r0 + m) * K + k0 + c : A, ok ? 16 : 0);
    }
  };
  for (int q = 0; q < ST - 1; ++q) {
    if (q < chunks) load(q);
    ms::cp_async_commit();
  }
  float acc[REGS], ph[REGS], pt[REGS];
#pragma unroll
  for (int i = 0; i < REGS; ++i) acc[i] = 0.f;
  // Chunk q's A, scaled and split, for this warp's rows (v3's split).
  struct Split {
    unsigned ah[BK / 16][4], al[BK / 16][4];
    float inv[2];
  };
  auto split = [&](long long q, Split& sp) {
    ms::cp_async_wait<ST - 2>();
    ms::bar_sync(1 + wg, 128);  // chunk q landed for the warpgroup; slot (q - 1) % ST read by all of it
    if (q + ST - 1 < chunks) load(q + ST - 1);
    ms::cp_async_commit();
    const float* as = ring + (int)(q % ST) * 64 * AP + (warp * 16 + g) * AP + 2 * t;  // row g; g + 8 at + 8 AP
    float s[2];
    ms::x3::row_scales<BK, AP>(as, s, sp.inv);
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) ms::x3::split_a<AP>(as, ks, s, sp.ah[ks], sp.al[ks]);
  };
  Split cur, nxt;
  if (chunks > 0) split(0, cur);
  for (long long q = 0; q < chunks; ++q) {
    const int kc = (int)(q % KT);
    keep(ph);
    keep(pt);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      const int kg = (kc * BK + ks * 16) / 8;
      const uint64_t bh = desc(panel + kg * 64, 128, (K / 8) * 128);
      const uint64_t bl = desc(panel + BN * K + kg * 64, 128, (K / 8) * 128);
      if constexpr (BN == 96) {
        mma_n96(ph, cur.ah[ks], bh, ks);
        mma_n96(pt, cur.ah[ks], bl, ks);
        mma_n96(pt, cur.al[ks], bh, 1);
      } else {
        mma_n64(ph, cur.ah[ks], bh, ks);
        mma_n64(pt, cur.ah[ks], bl, ks);
        mma_n64(pt, cur.al[ks], bh, 1);
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // OV: split chunk q + 1 while chunk q's products run (their register A
    // operand stays live to the wait: keep_a below).
    if constexpr (OV) {
      if (q + 1 < chunks) split(q + 1, nxt);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    keep(ph);
    keep(pt);
    keep_a(cur.ah);
    keep_a(cur.al);
#pragma unroll
    for (int i = 0; i < REGS; ++i) acc[i] = fmaf(fmaf(pt[i], ms::x3::INV_TAIL, ph[i]), cur.inv[(i % 4) / 2], acc[i]);
    if (kc == KT - 1) {
      const long long row0 = (rb0 + (q / KT) * G) * 128 + wg * 64 + warp * 16 + g;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int n = ct * BN + j * 8 + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (row0 + 8 * h < R)
            *reinterpret_cast<float2*>(C + (row0 + 8 * h) * N + n) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
#pragma unroll
      for (int i = 0; i < REGS; ++i) acc[i] = 0.f;
    }
    if constexpr (OV) {
      cur = nxt;
    } else if (q + 1 < chunks) {
      split(q + 1, cur);
    }
  }
  ms::cp_async_wait<0>();
#endif
}
template <int BN, int K, int ST, bool OV = false>
void run(const float* dB, uint16_t* bth, uint16_t* btl, const float* dA, float* dC, long long R) {
  typedef Cfg<BN, K, ST> CF;
  auto k = gemm<BN, K, ST, OV>;
  static int per_sm = -1, sms = 0;
  if (per_sm < 0) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, CF::SMEM));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, CF::THREADS, CF::SMEM));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("# v6 wgmma n%d k32 s%d, K %d: %d B shared, %d block(s) per SM\n", BN, ST, K, CF::SMEM, per_sm);
  }
  v4::split_bt<<<(K * K / 2 + 255) / 256, 256>>>(dB, bth, btl, K, K);
  const int NT = K / BN;
  const int grid = std::max(NT, per_sm * sms / NT * NT);
  k<<<grid, CF::THREADS, CF::SMEM>>>(dA, bth, btl, dC, R, K);
}
}  // namespace v6

// Elements of x and y whose bits differ (n elements).
__global__ void count_diff(const unsigned* x, const unsigned* y, long long n, unsigned long long* out) {
  unsigned long long d = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    d += x[i] != y[i];
  atomicAdd(out, d);
}

// Median ms of `reps` calls of f() after two warm-ups, CUDA events around
// each (the default stream).
template <typename F>
double median_ms(int reps, F f) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < reps + 2; ++r) {
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 2) ts.push_back(ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// ---------------------------------------------------------------------------
// Ceilings from cuBLAS at the same shape (EXP_CUBLAS=path of libcublas.so,
// loaded at run time: the build's toolchain wheels carry no cuBLAS headers):
// its FFMA SGEMM (what the exact stack's GEMM could reach), one fp16 product
// with fp32 accumulation, and the three products as one fp16 GEMM of depth
// 3K ([Ah Ah Al] @ [Bh; Bl; Bh]: the tensor-core work of the mode, without
// the split, the scales or the separate tail accumulator). Time only.
namespace ceiling {
typedef int (*create_t)(void**);
typedef int (*sgemm_t)(void*, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*,
                       float*, int);
typedef int (*gemmex_t)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                        const void*, void*, int, int, int, int);
constexpr int OP_N = 0, R_32F = 0, R_16F = 2, COMPUTE_32F = 68, ALGO_DEFAULT = -1;

void run(long long R, int reps) {
  const char* path = std::getenv("EXP_CUBLAS");
  void* lib = path ? dlopen(path, RTLD_NOW) : nullptr;
  if (!lib) {
    std::printf("# cuBLAS ceilings skipped: EXP_CUBLAS=%s not loaded (%s)\n", path ? path : "(unset)",
                path ? dlerror() : "");
    return;
  }
  auto create = (create_t)dlsym(lib, "cublasCreate_v2");
  auto sgemm = (sgemm_t)dlsym(lib, "cublasSgemm_v2");
  auto gemmex = (gemmex_t)dlsym(lib, "cublasGemmEx");
  void* h = nullptr;
  if (!create || !sgemm || !gemmex || create(&h) != 0) {
    std::printf("# cuBLAS ceilings skipped: symbols or handle missing\n");
    return;
  }
  const float one = 1.f, zero = 0.f;
  for (int K : {192, 128}) {
    const int N = K;
    void *a, *b, *c;
    CK(cudaMalloc(&a, R * 3 * K * 4));  // big enough for every variant's A
    CK(cudaMalloc(&b, (size_t)3 * K * N * 4));
    CK(cudaMalloc(&c, R * N * 4));
    CK(cudaMemset(a, 0x3c, R * 3 * K * 4));  // fp16 0x3c3c ~ 1.06; fp32 ~ 0.0115
    CK(cudaMemset(b, 0x1c, (size_t)3 * K * N * 4));
    auto time = [&](const char* label, double flops, double bytes, auto call) {
      int st = 0;
      const double m = median_ms(reps, [&] { st = st ? st : call(); });
      if (st != 0) {
        std::printf("%-34s K=N=%d: cuBLAS status %d\n", label, K, st);
        return;
      }
      std::printf("%-34s K=N=%d: %.3f ms (%.0f GB/s of its operands and C, %.1f TFLOP/s)\n", label, K, m,
                  bytes / m / 1e6, flops / m / 1e9);
    };
    const double mn = (double)R * N;
    // row-major C (R x N) = A (R x k) @ B (k x N) is column-major C^T = B^T A^T
    time("cuBLAS SGEMM (FFMA)", 2 * mn * K, mn * 4 + (double)R * K * 4,
         [&] { return sgemm(h, OP_N, OP_N, N, (int)R, K, &one, (const float*)b, N, (const float*)a, K, &zero, (float*)c, N); });
    time("cuBLAS fp16 GEMM, one product", 2 * mn * K, mn * 4 + (double)R * K * 2, [&] {
      return gemmex(h, OP_N, OP_N, N, (int)R, K, &one, b, R_16F, N, a, R_16F, K, &zero, c, R_32F, N, COMPUTE_32F,
                    ALGO_DEFAULT);
    });
    time("cuBLAS fp16 GEMM, depth 3K", 2 * mn * 3 * K, mn * 4 + (double)R * 3 * K * 2, [&] {
      return gemmex(h, OP_N, OP_N, N, (int)R, 3 * K, &one, b, R_16F, N, a, R_16F, 3 * K, &zero, c, R_32F, N,
                    COMPUTE_32F, ALGO_DEFAULT);
    });
    for (void* p : {a, b, c}) CK(cudaFree(p));
  }
}
}  // namespace ceiling

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double uni() {  // [-1, 1)
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

// Median time of launch() over reps (after two warm-ups) and its accuracy
// on SAMPLE rows against fp64, beside fp32 FFMA (k ascending); C poisoned
// with NaN first so that an unwritten element shows.
template <typename Launch>
void measure(const char* label, Launch launch, const std::vector<float>& A, const std::vector<float>& B, float* dC,
             long long R, int K, int N, double scale, int reps) {
  CK(cudaMemset(dC, 0xff, R * N * sizeof(float)));
  const double gm = median_ms(reps, launch);
  CK(cudaGetLastError());
  const int SAMPLE = 2048;  // rows checked against fp64, spread over R (the last row among them)
  std::vector<float> Cs((size_t)N);
  double e3 = 0, ef = 0, ref = 0, max3 = 0, maxf = 0, maxref = 0;
  long long nonfinite = 0;
  for (int s = 0; s <= SAMPLE; ++s) {
    const long long row = s == SAMPLE ? R - 1 : (long long)((double)s / SAMPLE * R);
    CK(cudaMemcpy(Cs.data(), dC + row * N, N * sizeof(float), cudaMemcpyDeviceToHost));
    for (int n = 0; n < N; ++n) {
      double c64 = 0;
      float c32 = 0.f;
      for (int k = 0; k < K; ++k) {
        c64 += (double)A[row * K + k] * (double)B[(size_t)k * N + n];
        c32 = std::fmaf(A[row * K + k], B[(size_t)k * N + n], c32);
      }
      if (!std::isfinite(Cs[n])) ++nonfinite;
      e3 += (Cs[n] - c64) * (Cs[n] - c64), ef += (c32 - c64) * (c32 - c64), ref += c64 * c64;
      max3 = std::fmax(max3, std::fabs(Cs[n] - c64)), maxf = std::fmax(maxf, std::fabs(c32 - c64));
      maxref = std::fmax(maxref, std::fabs(c64));
    }
  }
  const double bytes = (double)R * (K + N) * sizeof(float);
  std::printf(
      "%-22s K=N=%d |A|<=%.0e: %.3f ms (%.0f GB/s of A+C, %.1f TFLOP/s of the 3 fp16 products); rel L2 %.2e "
      "(fp32 FFMA %.2e); max abs / max |C| %.2e (FFMA %.2e); non-finite %lld\n",
      label, K, scale, gm, bytes / gm / 1e6, 3 * 2.0 * R * K * N / gm / 1e9, std::sqrt(e3 / ref), std::sqrt(ef / ref),
      max3 / maxref, maxf / maxref, nonfinite);
}

int main(int argc, char** argv) {
  const long long R = argc > 1 ? std::atoll(argv[1]) : 1292000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# fp16x3 mma.sync GEMM on %s: R = %lld rows, median of %d\n", prop.name, R, reps);
  ceiling::run(R, reps);
  if (std::getenv("EXP_CEILING_ONLY")) return 0;
  for (int K : {192, 128}) {
    const int N = K;
    std::vector<float> B((size_t)K * N);
    for (auto& b : B) b = (float)(uni() / std::sqrt((double)K));
    float bmax = 0.f;
    for (float b : B) bmax = std::fmax(bmax, std::fabs(b));
    const float sB = pow2_scale(bmax);
    float *dA, *dB, *dC, *dsA;
    half_t *dbh, *dbl;
    CK(cudaMalloc(&dA, R * K * sizeof(float)));
    CK(cudaMalloc(&dC, R * N * sizeof(float)));
    CK(cudaMalloc(&dsA, R * sizeof(float)));
    CK(cudaMalloc(&dB, (size_t)K * N * sizeof(float)));
    CK(cudaMalloc(&dbh, (size_t)K * N * sizeof(half_t)));
    CK(cudaMalloc(&dbl, (size_t)K * N * sizeof(half_t)));
    float* dRef;
    uint16_t *dbth, *dbtl;
    unsigned long long* dDiff;
    CK(cudaMalloc(&dRef, R * N * sizeof(float)));
    CK(cudaMalloc(&dbth, (size_t)K * N * sizeof(uint16_t)));
    CK(cudaMalloc(&dbtl, (size_t)K * N * sizeof(uint16_t)));
    CK(cudaMalloc(&dDiff, sizeof(unsigned long long)));
    CK(cudaMemcpy(dB, B.data(), B.size() * sizeof(float), cudaMemcpyHostToDevice));
    split_b<<<(K * N + 255) / 256, 256>>>(dB, dbh, dbl, K, N, sB);
    std::vector<float> A((size_t)R * K);
    std::vector<double> scales = {1e-6, 1e-3, 1.0, 1e3, 1e7};
    if (const char* one = std::getenv("EXP_SCALE")) scales = {std::atof(one)};  // e.g. under Nsight Compute
    for (double scale : scales) {
      for (auto& a : A) a = (float)(uni() * scale);
      CK(cudaMemcpy(dA, A.data(), A.size() * sizeof(float), cudaMemcpyHostToDevice));
      const dim3 grid((unsigned)((R + BM - 1) / BM), (unsigned)((N + BN - 1) / BN));
      if (std::getenv("EXP_ALL")) {  // the variants run 95 measured and set aside
        measure("v1 (row pre-pass)", [&] {
          row_scales<<<(unsigned)((R + 7) / 8), 256>>>(dA, dsA, R, K);
          gemm_fp16x3<<<grid, THREADS>>>(dA, dsA, dbh, dbl, 1.f / sB, dC, R, K, N);
        }, A, B, dC, R, K, N, scale, reps);
        measure("v2 m128 k32 s3", [&] { v2::run<128, 32, 3>(dA, dB, dC, R, K, N, 0); }, A, B, dC, R, K, N, scale, reps);
        measure("v2 m64 k32 s4", [&] { v2::run<64, 32, 4>(dA, dB, dC, R, K, N, 0); }, A, B, dC, R, K, N, scale, reps);
        measure("v2 m128 k64 s2", [&] { v2::run<128, 64, 2>(dA, dB, dC, R, K, N, 0); }, A, B, dC, R, K, N, scale, reps);
        measure("v3 core m128 k16 s4 b2", [&] { v3::run<128, 16, 4, 2>(dA, dB, dC, R, K, N); }, A, B, dC, R, K, N, scale, reps);
        measure("v3 core m64 k32 s4 b2", [&] { v3::run<64, 32, 4, 2>(dA, dB, dC, R, K, N); }, A, B, dC, R, K, N, scale, reps);
      }
      measure("v2 m64 k64 s3", [&] { v2::run<64, 64, 3>(dA, dB, dC, R, K, N, 0); }, A, B, dC, R, K, N, scale, reps);
      measure("v3 core m128 k32 s3 b1", [&] { v3::run<128, 32, 3, 1>(dA, dB, dC, R, K, N); }, A, B, dC, R, K, N, scale, reps);
      CK(cudaMemcpy(dRef, dC, R * N * sizeof(float), cudaMemcpyDeviceToDevice));
      auto against_v3 = [&](const char* label) {
        CK(cudaMemset(dDiff, 0, sizeof(unsigned long long)));
        count_diff<<<1024, 256>>>(reinterpret_cast<const unsigned*>(dC), reinterpret_cast<const unsigned*>(dRef), R * N,
                                  dDiff);
        unsigned long long diff = 0;
        CK(cudaMemcpy(&diff, dDiff, sizeof diff, cudaMemcpyDeviceToHost));
        std::printf("  %s against v3 m128 k32 (same chunks): %llu of %lld elements differ in their bits%s\n", label, diff,
                    R * N, diff ? "" : " (BITWISE EQUAL)");
      };
      // the split-once and wgmma variants, K a template argument
      auto newer = [&](auto k_const) {
        constexpr int KK = decltype(k_const)::value, BN6 = KK == 192 ? 96 : 64;
        measure("v4 m64 k32 s4 2x4", [&] { v4::run<64, 32, 4, KK, 2, 4, 1>(dA, dB, dbth, dbtl, dC, R); }, A, B, dC, R, K,
                N, scale, reps);
        against_v3("v4");
        measure("v5 m64 n64 k32 s3 b2", [&] { v5::run<64, 64, 32, 3, KK, 2>(dB, dbth, dbtl, dA, dC, R); }, A, B, dC, R, K,
                N, scale, reps);
        against_v3("v5 s3");
        measure("v5 m64 n64 k32 s4 b1", [&] { v5::run<64, 64, 32, 4, KK, 1>(dB, dbth, dbtl, dA, dC, R); }, A, B, dC, R, K,
                N, scale, reps);
        against_v3("v5 s4");
        measure("v6 wgmma k32 s4", [&] { v6::run<BN6, KK, 4>(dB, dbth, dbtl, dA, dC, R); }, A, B, dC, R, K, N, scale, reps);
        against_v3("v6");
        measure("v7 wgmma k32 s4, split overlapped", [&] { v6::run<BN6, KK, 4, true>(dB, dbth, dbtl, dA, dC, R); }, A, B,
                dC, R, K, N, scale, reps);
        against_v3("v7");
      };
      if (K == 192)
        newer(std::integral_constant<int, 192>{});
      else
        newer(std::integral_constant<int, 128>{});
    }
    for (auto p : {(void*)dA, (void*)dC, (void*)dsA, (void*)dB, (void*)dbh, (void*)dbl, (void*)dRef, (void*)dbth,
                   (void*)dbtl, (void*)dDiff})
      CK(cudaFree(p));
  }
  // occupancy of each v2 configuration at K = 192 (blocks per SM)
  for (int k : {192, 128})
    std::printf("# v2 smem bytes at K=%d: m128k32s3 %d, m64k32s4 %d, m64k64s3 %d, m128k64s2 %d\n", k,
                v2::Cfg<128, 32, 3>::smem(k), v2::Cfg<64, 32, 4>::smem(k), v2::Cfg<64, 64, 3>::smem(k),
                v2::Cfg<128, 64, 2>::smem(k));
  return 0;
}
