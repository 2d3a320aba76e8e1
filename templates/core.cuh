// Hand-written kernel bodies of the mixing stack. Generated instance files
// only instantiate these (one extern "C" entry per instance); the pointwise
// math comes from ops.cuh, rendered from specs/ops.yaml.
//
// Bit-for-bit contract between the relay and the fused backward:
//   * every pointwise value goes through the same ms_* element function
//     below (gate_sig, gate_logit, gz_elem), which call the same op_*;
//   * every GEMM output element accumulates op_dot_step over k = 0..K-1 in
//     ascending order starting from zero (mma_chunk), then one op_residual.
// Tile shapes change the schedule, never a result.
#pragma once
#include "ops.cuh"

namespace ms {

typedef long long i64;

// Sizes derived from (Cf, L); L is a runtime argument, Cf a template one.
struct Dims {
  int L, M0, M1, ROW, LG;
};
template <int CF>
__device__ __forceinline__ Dims dims(int L) {
  return Dims{L, (L + 1) * CF, 2 * L * CF, (3 * L + 1) * CF, L * CF};
}

// Gate group of gated subtile r (1 <= r <= 3L).
__device__ __forceinline__ int group_of(int r, int L) {
  return r <= L ? r - 1 : (r - L - 1) % L;
}

template <typename T>
__device__ __forceinline__ T* smem_at(int byte_offset) {
  extern __shared__ __align__(16) unsigned char ms_smem[];
  return reinterpret_cast<T*>(ms_smem + byte_offset);
}

// ---------------------------------------------------------------------------
// Element functions shared by relay and fused kernels.

// sigmoid(s . GW[:, c]), j ascending. s: CF values (shared memory).
template <typename T, int CF>
__device__ __forceinline__ T gate_sig(const T* s, const T* __restrict__ gw,
                                      int LG, int c) {
  T acc = T(0);
#pragma unroll 8
  for (int j = 0; j < CF; ++j) acc = op_dot_step<T>(s[j], __ldg(gw + (i64)j * LG + c), acc);
  return op_sigmoid<T>(acc);
}

// g_logit of gate channel c (group c / CF) from the group's three subtiles.
template <typename T, int CF>
__device__ __forceinline__ T gate_logit(const T* __restrict__ g_row,
                                        const T* __restrict__ z_row, T sig,
                                        int L, int c) {
  const int gr = c / CF, ch = c - gr * CF;
  const int ca = (1 + gr) * CF + ch;
  const int cb = (L + 1 + gr) * CF + ch;
  const int cc = (2 * L + 1 + gr) * CF + ch;
  const T gs = op_gsig3<T>(g_row[ca], z_row[ca], g_row[cb], z_row[cb], g_row[cc], z_row[cc]);
  return op_glogit<T>(gs, sig);
}

// gz at column col of one row. sig_row / glog_row: LG values (shared).
// col < CF: the scalar chain, silu' plus the gate path, c ascending.
template <typename T, int CF>
__device__ __forceinline__ T gz_elem(const T* __restrict__ g_row,
                                     const T* __restrict__ z_row,
                                     const T* sig_row, const T* glog_row,
                                     const T* __restrict__ gw, int L, int LG,
                                     int col) {
  if (col < CF) {
    T acc = T(0);
#pragma unroll 8
    for (int c = 0; c < LG; ++c)
      acc = op_dot_step<T>(glog_row[c], __ldg(gw + (i64)col * LG + c), acc);
    return op_residual<T>(op_dsilu_mul<T>(g_row[col], z_row[col]), acc);
  }
  const int r = col / CF, ch = col - r * CF;
  return op_gate<T>(g_row[col], sig_row[group_of(r, L) * CF + ch]);
}

// ---------------------------------------------------------------------------
// Row-tile helpers (rows e0 .. e0+ROWS of focus f).

// s_sh[m][j] = z[e][j] (the scalar slice), zero past E.
template <typename T, int CF, int ROWS, int THREADS>
__device__ __forceinline__ void load_scalar_rows(T* s_sh, const T* __restrict__ zf,
                                                 i64 e0, i64 E, int ROW) {
  for (int idx = threadIdx.x; idx < ROWS * CF; idx += THREADS) {
    const int m = idx / CF, j = idx - m * CF;
    const i64 e = e0 + m;
    s_sh[idx] = e < E ? zf[e * ROW + j] : T(0);
  }
}

// sig_sh[m][c] = gate_sig(s_sh[m], c) for every gate channel.
template <typename T, int CF, int ROWS, int THREADS>
__device__ __forceinline__ void compute_sig_rows(T* sig_sh, const T* s_sh,
                                                 const T* __restrict__ gwf, int LG) {
  for (int idx = threadIdx.x; idx < ROWS * LG; idx += THREADS) {
    const int m = idx / LG, c = idx - m * LG;
    sig_sh[idx] = gate_sig<T, CF>(s_sh + m * CF, gwf, LG, c);
  }
}

// glog_sh[m][c] = gate_logit(row m, c); zero past E.
template <typename T, int CF, int ROWS, int THREADS>
__device__ __forceinline__ void compute_glogit_rows(T* glog_sh, const T* sig_sh,
                                                    const T* __restrict__ gf,
                                                    const T* __restrict__ zf,
                                                    i64 e0, i64 E, int L, int LG, int ROW) {
  for (int idx = threadIdx.x; idx < ROWS * LG; idx += THREADS) {
    const int m = idx / LG, c = idx - m * LG;
    const i64 e = e0 + m;
    glog_sh[idx] = e < E ? gate_logit<T, CF>(gf + e * ROW, zf + e * ROW, sig_sh[idx], L, c) : T(0);
  }
}

// ---------------------------------------------------------------------------
// Block GEMM: one BM x BN tile of C = epi(A @ B), A given element-wise by
// a_at(m, e, k), B row-major K x N in global memory, K a multiple of BK.

// 16-byte shared-memory loads: float4 / double2.
template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int W = 4;
  static __device__ __forceinline__ void load(const float* p, float* d) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
  }
};
template <> struct Vec<double> {
  static constexpr int W = 2;
  static __device__ __forceinline__ void load(const double* p, double* d) {
    const double2 v = *reinterpret_cast<const double2*>(p);
    d[0] = v.x; d[1] = v.y;
  }
};

// A thread owns TM x TN outputs in 16-byte groups spread over the tile
// (row i: group i/W at stride TY*W), so one warp's vector loads from
// shared memory touch consecutive addresses.
template <typename T, int BM, int BN, int BK, int TM, int TN, int APAD>
struct Tile {
  static constexpr int W = Vec<T>::W;
  static constexpr int TX = BN / TN;
  static constexpr int TY = BM / TM;
  static constexpr int THREADS = TX * TY;
  static constexpr int AS = BM + APAD;  // padded row of the k-major A tile
  static_assert(TM % W == 0 && TN % W == 0, "tm and tn must be multiples of the 16-byte vector width");
  static __device__ __forceinline__ int row(int ty, int i) { return (i / W) * (TY * W) + ty * W + (i % W); }
  static __device__ __forceinline__ int col(int tx, int j) { return (j / W) * (TX * W) + tx * W + (j % W); }
};

// acc[i][j] += A[row i][kk] * B[kk][col j], kk ascending.
template <typename T, int BM, int BN, int BK, int TM, int TN, int APAD>
__device__ __forceinline__ void mma_chunk(T (&acc)[TM][TN], const T* As, const T* Bs,
                                          int ty, int tx) {
  typedef Tile<T, BM, BN, BK, TM, TN, APAD> TL;
  constexpr int W = TL::W;
#pragma unroll
  for (int kk = 0; kk < BK; ++kk) {
    T a[TM], b[TN];
#pragma unroll
    for (int i = 0; i < TM; i += W) Vec<T>::load(As + kk * TL::AS + TL::row(ty, i), a + i);
#pragma unroll
    for (int j = 0; j < TN; j += W) Vec<T>::load(Bs + kk * BN + TL::col(tx, j), b + j);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = op_dot_step<T>(a[i], b[j], acc[i][j]);
  }
}

template <typename T, int BM, int BN, int BK, int TM, int TN, int APAD, int SMEM_A,
          int SMEM_B, typename AAt, typename Epi>
__device__ __forceinline__ void gemm_block(i64 E, int K, int N,
                                           const T* __restrict__ B, AAt a_at, Epi epi) {
  typedef Tile<T, BM, BN, BK, TM, TN, APAD> TL;
  T* As = smem_at<T>(SMEM_A);
  T* Bs = smem_at<T>(SMEM_B);
  const int tid = threadIdx.x;
  const int tx = tid % TL::TX, ty = tid / TL::TX;
  const i64 e0 = (i64)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN;

  T acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = T(0);

  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int idx = tid; idx < BM * BK; idx += TL::THREADS) {
      const int m = idx / BK, kk = idx - m * BK;
      const i64 e = e0 + m;
      As[kk * TL::AS + m] = e < E ? a_at(m, e, k0 + kk) : T(0);
    }
    for (int idx = tid; idx < BK * BN; idx += TL::THREADS) {
      const int kk = idx / BN, n = idx - kk * BN;
      Bs[idx] = n0 + n < N ? __ldg(B + (i64)(k0 + kk) * N + n0 + n) : T(0);
    }
    __syncthreads();
    mma_chunk<T, BM, BN, BK, TM, TN, APAD>(acc, As, Bs, ty, tx);
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i64 e = e0 + TL::row(ty, i);
    if (e >= E) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int n = n0 + TL::col(tx, j);
      if (n < N) epi(e, n, acc[i][j]);
    }
  }
}

}  // namespace ms
