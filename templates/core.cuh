// Hand-written kernel bodies of the mixing stack. Generated instance files
// only instantiate these (one extern "C" entry per instance); the pointwise
// math comes from ops.cuh, rendered from specs/ops.yaml.
//
// Bit-for-bit contract between the relay and the fused backward:
//   * every pointwise value goes through the same functions below
//     (compute_sig_rows, compute_glogit_rows, compute_gzs_rows, gz_of and
//     gate_at; the fused gemm_rowblock forms gz as gz_of does, W columns at
//     once, from GzRows::chunk),
//     which call the same op_* in the same order;
//   * every dot (rows_gemm, mma_chunk) accumulates op_dot_step over
//     k = 0..K-1 in ascending order starting from zero; a GEMM output then
//     takes one op_residual.
// Tile shapes change the schedule, never a result.
#pragma once
#include <type_traits>
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
  return r <= L ? r - 1 : (r <= 2 * L ? r - L - 1 : r - 2 * L - 1);
}

// n / d by one multiply-high, for a divisor known only at run time (row
// widths depend on the argument L): a plain int division is ~20
// instructions, and the row kernels divide once per 16-byte element (SASS
// of fwd_gate, BENCH.md run 53). magic = ceil(2^32 / d) = (2^32 + e) / d,
// 0 <= e < d, so n * magic / 2^32 = n / d + n * e / (d * 2^32) and the floor
// is exact while n * e < 2^32. Here n < 2^20 (ROWS <= 128 rows of at most
// ROW / W < 2^13 vectors) and 2 <= d < 2^12.
struct DivBy {
  int d;
  unsigned magic;
  __device__ __forceinline__ explicit DivBy(int d_) : d(d_), magic(0xffffffffu / (unsigned)d_ + 1u) {}
  __device__ __forceinline__ int div(int n) const { return (int)__umulhi((unsigned)n, magic); }
};

template <typename T>
__device__ __forceinline__ T* smem_at(int byte_offset) {
  extern __shared__ __align__(16) unsigned char ms_smem[];
  return reinterpret_cast<T*>(ms_smem + byte_offset);
}

// ---------------------------------------------------------------------------
// 16-byte vector loads and stores: float4 / double2.
template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int W = 4;
  static __device__ __forceinline__ void load(const float* p, float* d) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
  }
  static __device__ __forceinline__ void ldg(const float* p, float* d) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
  }
  static __device__ __forceinline__ void store(float* p, const float* s) {
    *reinterpret_cast<float4*>(p) = make_float4(s[0], s[1], s[2], s[3]);
  }
};
template <> struct Vec<double> {
  static constexpr int W = 2;
  static __device__ __forceinline__ void load(const double* p, double* d) {
    const double2 v = *reinterpret_cast<const double2*>(p);
    d[0] = v.x; d[1] = v.y;
  }
  static __device__ __forceinline__ void ldg(const double* p, double* d) {
    const double2 v = __ldg(reinterpret_cast<const double2*>(p));
    d[0] = v.x; d[1] = v.y;
  }
  static __device__ __forceinline__ void store(double* p, const double* s) {
    *reinterpret_cast<double2*>(p) = make_double2(s[0], s[1]);
  }
};

// ---------------------------------------------------------------------------
// Memory-level parallelism for the row kernels' element loops. Items
// threadIdx.x + j*THREADS go in batches of U per thread: the batch's loads
// are all issued before any result is used. A loop that loads, uses and
// stores one item at a time keeps one 16-byte load in flight per thread,
// about half of what it takes to keep HBM busy at these occupancies.
template <typename T, int N>
struct Regs {
  T v[N];
};
// A stage's epilogue in two steps: load(e, n) reads what the store of the
// W outputs at (e, n) needs (the residual, the gates, alpha) and store(e,
// n, v, x) writes them. Called as epi(e, n, v), it runs both in turn (so
// every core takes it as it takes a plain lambda); gemm_wg issues a tile's
// loads first (all of them, or a few fragments' at a time where registers
// are short), then their stores: one load latency per batch, not one per
// fragment (run 132 found fwd_m1 waiting on them; run 133 measured it).
template <typename Load, typename Store>
struct Staged {
  Load load;
  Store store;
  template <typename T>
  __device__ __forceinline__ void operator()(i64 e, int n, const T* v) const {
    store(e, n, v, load(e, n));
  }
};
template <typename Load, typename Store>
__device__ __forceinline__ Staged<Load, Store> staged(Load l, Store s) {
  return {l, s};
}
template <typename Epi>
struct IsStaged : std::false_type {};
template <typename Load, typename Store>
struct IsStaged<Staged<Load, Store>> : std::true_type {};
// Any epilogue as a staged one: a plain epi(e, n, v) loads nothing first.
template <typename Epi>
__device__ __forceinline__ auto as_staged(Epi& epi) {
  if constexpr (IsStaged<Epi>::value) {
    return epi;
  } else {
    return staged([](i64, int) { return 0; }, [&epi](i64 e, int n, const float* v, int) { epi(e, n, v); });
  }
}

template <int THREADS, int U, typename Load, typename Use>
__device__ __forceinline__ void batched(int n, Load load, Use use) {
  typedef decltype(load(0)) V;
  for (int i0 = threadIdx.x; i0 < n; i0 += THREADS * U) {
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * THREADS < n) v[u] = load(i0 + u * THREADS);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + u * THREADS < n) use(i0 + u * THREADS, v[u]);
  }
}

// ---------------------------------------------------------------------------
// Row-tile contractions shared by relay and fused kernels.
//
// rows_gemm: for m < ROWS, n < N: epi(m, n, sum_k A[m*lda + k] * B[k*N + n]),
// k ascending from zero. A in shared memory, B row-major in global memory
// (N a multiple of 4; B is small and stays in L1). A thread owns an RM-row x
// 4-column register tile, RM chosen so that the smallest of these contractions
// (N = Cf) still gives every thread a tile: one vector load of B and RM
// broadcast loads of A feed 4*RM FMAs.
template <typename T, int ROWS, int THREADS, int NMIN>
__host__ __device__ constexpr int rows_tile_m() {
  return ROWS * NMIN / 4 >= 4 * THREADS ? 4 : (ROWS * NMIN / 4 >= 2 * THREADS ? 2 : 1);
}
template <typename T, int ROWS, int THREADS, int NMIN, typename Epi>
__device__ __forceinline__ void rows_gemm(const T* A, int lda, const T* __restrict__ B,
                                          int K, int N, Epi epi) {
  constexpr int RM = rows_tile_m<T, ROWS, THREADS, NMIN>();
  static_assert(ROWS % RM == 0, "rows_gemm works on RM-row groups");
  constexpr int W = Vec<T>::W;
  const int ncol = N / 4;
  for (int it = threadIdx.x; it < (ROWS / RM) * ncol; it += THREADS) {
    const int m0 = (it / ncol) * RM, n0 = (it - (it / ncol) * ncol) * 4;
    T acc[RM][4];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = T(0);
    // Pointer bumps, not k * N per load (64-bit multiplies measured as a
    // third of this loop's instructions, run 77); 8 k per trip keeps 8
    // loads of B in flight for the short RM = 1 tiles (more on the RM = 4
    // ones spills the Cf 96 row tiles).
    const T* bk = B + n0;
    const T* ak = A + m0 * lda;
#pragma unroll(RM == 1 ? 8 : 4)
    for (int k = 0; k < K; ++k) {
      T a[RM], b[4];
#pragma unroll
      for (int j = 0; j < 4; j += W) Vec<T>::ldg(bk + j, b + j);
#pragma unroll
      for (int i = 0; i < RM; ++i) a[i] = ak[i * lda + k];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = op_dot_step<T>(a[i], b[j], acc[i][j]);
      bk += N;
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) epi(m0 + i, n0 + j, acc[i][j]);
  }
}

// s_sh[m][j] = z[e][j] (the scalar slice), zero past E.
template <typename T, int CF, int ROWS, int THREADS>
__device__ __forceinline__ void load_scalar_rows(T* s_sh, const T* __restrict__ zf,
                                                 i64 e0, i64 E, int ROW) {
  constexpr int W = Vec<T>::W;
  batched<THREADS, 4>(
      ROWS * CF / W,
      [&](int idx) {
        const int m = idx / (CF / W), j = (idx - m * (CF / W)) * W;
        Regs<T, W> x{};
        if (e0 + m < E) Vec<T>::ldg(zf + (e0 + m) * ROW + j, x.v);
        return x;
      },
      [&](int idx, const Regs<T, W>& x) {
#pragma unroll
        for (int w = 0; w < W; ++w) s_sh[idx * W + w] = x.v[w];
      });
}

// sig_sh[m][c] = sigmoid(s . GW[:, c]): the gate recompute of every kernel.
// Its width LG = L*Cf is a runtime value; the tile is sized for L = 4 (at
// the seed's L = 3, 4-row tiles measured faster than 1-row ones: 0.58 vs
// 0.70 ms per recompute launch, BENCH.md).
template <typename T, int CF, int ROWS, int THREADS>
__device__ __forceinline__ void compute_sig_rows(T* sig_sh, const T* s_sh,
                                                 const T* __restrict__ gwf, int LG) {
  rows_gemm<T, ROWS, THREADS, 4 * CF>(s_sh, CF, gwf, CF, LG,
                                  [&](int m, int c, T acc) { sig_sh[m * LG + c] = op_sigmoid<T>(acc); });
}

// glog_sh[m][c]: gradient of gate logit c from the group's three subtiles
// (W channels per step: 16-byte loads of g and z). gated(m, col, g) sees
// the W values of g it loaded at each of those subtiles (rows < E), so the
// relay forms gz there without reading g again; the fused path passes
// nothing (no_gated).
struct no_gated {
  template <typename T>
  __device__ __forceinline__ void operator()(int, int, const T*) const {}
};
template <typename T, int CF, int ROWS, int THREADS, typename Gated = no_gated>
__device__ __forceinline__ void compute_glogit_rows(T* glog_sh, const T* sig_sh,
                                                    const T* __restrict__ gf,
                                                    const T* __restrict__ zf,
                                                    i64 e0, i64 E, int L, int LG, int ROW,
                                                    Gated gated = Gated{}) {
  constexpr int W = Vec<T>::W;
  // x.v: g and z of subtiles (m=0, l), (m=-1, l), (m=+1, l), W channels each
  // (six 16-byte loads in flight per item already).
  batched<THREADS, 1>(
      ROWS * LG / W,
      [&](int idx) {
        const int m = idx / (LG / W), c = (idx - m * (LG / W)) * W;
        const i64 e = e0 + m;
        Regs<T, 6 * W> x{};
        if (e < E) {
          const int gr = c / CF, ch = c - gr * CF;
          const int col[3] = {(1 + gr) * CF + ch, (L + 1 + gr) * CF + ch, (2 * L + 1 + gr) * CF + ch};
#pragma unroll
          for (int s = 0; s < 3; ++s) {
            Vec<T>::ldg(gf + e * ROW + col[s], x.v + 2 * s * W);
            Vec<T>::ldg(zf + e * ROW + col[s], x.v + (2 * s + 1) * W);
          }
        }
        return x;
      },
      [&](int idx, const Regs<T, 6 * W>& x) {
        const int m = idx / (LG / W), c = (idx - m * (LG / W)) * W;
        T* out = glog_sh + idx * W;
#pragma unroll
        for (int w = 0; w < W; ++w)
          out[w] = e0 + m < E ? op_glogit<T>(op_gsig3<T>(x.v[w], x.v[W + w], x.v[2 * W + w], x.v[3 * W + w],
                                                         x.v[4 * W + w], x.v[5 * W + w]),
                                             sig_sh[idx * W + w])
                              : T(0);
        if (e0 + m < E) {
          const int gr = c / CF, ch = c - gr * CF;
          gated(m, (1 + gr) * CF + ch, x.v);
          gated(m, (L + 1 + gr) * CF + ch, x.v + 2 * W);
          gated(m, (2 * L + 1 + gr) * CF + ch, x.v + 4 * W);
        }
      });
}

// out(m, j, gzs[m][j]), gzs = g_s * silu'(s) + sum_c glog[m][c] * GW[j][c]
// (c ascending, GW read transposed): the scalar chain; zero past E. zs(m, e,
// j) gives s: z's scalar slice from memory in the relay, from the shared
// buffer the fused per-row work already holds (one L2 round trip fewer on
// its path).
template <typename T, int CF, int ROWS, int THREADS, typename Out, typename Zs>
__device__ __forceinline__ void compute_gzs_rows(Out out, Zs zs, const T* glog_sh,
                                                 const T* __restrict__ gwtf,
                                                 const T* __restrict__ gf,
                                                 i64 e0, i64 E, int LG, int ROW) {
  rows_gemm<T, ROWS, THREADS, CF>(glog_sh, LG, gwtf, LG, CF, [&](int m, int j, T acc) {
    const i64 e = e0 + m;
    out(m, j, e < E ? op_residual<T>(op_dsilu_mul<T>(gf[e * ROW + j], zs(m, e, j)), acc) : T(0));
  });
}

// The gate of gated column col (col >= Cf) in a row's sig: its group's
// channel; consecutive columns of one subtile have consecutive gates.
// gate_col: its index in the row; gate_at: its address (kept as two adds to
// the row pointer, the form the relay's measured PTX has).
template <int CF>
__device__ __forceinline__ int gate_col(int L, int col) {
  const int r = col / CF, ch = col - r * CF;
  return group_of(r, L) * CF + ch;
}
template <int CF, typename T>
__device__ __forceinline__ const T* gate_at(const T* sig_row, int L, int col) {
  const int r = col / CF, ch = col - r * CF;
  return sig_row + group_of(r, L) * CF + ch;
}

// gz at column col of a row whose g there is g_col: the scalar chain
// (precomputed; g_col unused) or a gated subtile.
template <typename T, int CF>
__device__ __forceinline__ T gz_of(T g_col, const T* sig_row, const T* gzs_row, int L, int col) {
  if (col < CF) return gzs_row[col];
  return op_gate<T>(g_col, *gate_at<CF>(sig_row, L, col));
}

// A thread owns TM x TN outputs in 16-byte groups spread over the tile
// (row i: group i/W at stride TY*W), so one warp's vector loads from
// shared memory touch consecutive addresses.
template <typename T, int BM, int BN, int BK, int TM, int TN>
struct Tile {
  static constexpr int W = Vec<T>::W;
  static constexpr int TX = BN / TN;
  static constexpr int TY = BM / TM;
  static constexpr int THREADS = TX * TY;
  static_assert(TM % W == 0 && TN % W == 0, "tm and tn must be multiples of the 16-byte vector width");
  static __device__ __forceinline__ int row(int ty, int i) { return (i / W) * (TY * W) + ty * W + (i % W); }
  static __device__ __forceinline__ int col(int tx, int j) { return (j / W) * (TX * W) + tx * W + (j % W); }
};

// acc[i][j] += A[row i][kk] * B[kk][col j], kk ascending; A k-major (rows AP
// apart), B rows BP apart.
template <typename T, int BM, int BN, int BK, int TM, int TN, int AP, int BP>
__device__ __forceinline__ void mma_chunk(T (&acc)[TM][TN], const T* As, const T* Bs,
                                          int ty, int tx) {
  typedef Tile<T, BM, BN, BK, TM, TN> TL;
  constexpr int W = TL::W;
#pragma unroll
  for (int kk = 0; kk < BK; ++kk) {
    T a[TM], b[TN];
#pragma unroll
    for (int i = 0; i < TM; i += W) Vec<T>::load(As + kk * AP + TL::row(ty, i), a + i);
#pragma unroll
    for (int j = 0; j < TN; j += W) Vec<T>::load(Bs + kk * BP + TL::col(tx, j), b + j);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = op_dot_step<T>(a[i], b[j], acc[i][j]);
  }
}

// A GEMM block's tile origin on the flat grid, column blocks fastest (the
// runtime's launch_config): first row and first column of blockIdx.x's tile.
template <int BM, int BN>
__device__ __forceinline__ i64 block_row(int N) {
  return (i64)(blockIdx.x / ((N + BN - 1) / BN)) * BM;
}
template <int BN>
__device__ __forceinline__ int block_col(int N) {
  return (int)(blockIdx.x % ((N + BN - 1) / BN)) * BN;
}

// The accumulator tile leaves through shared memory (the caller has synced
// past its last read of the A/B stages, which this aliases), so that epi's
// global accesses walk consecutive columns: coalesced. epi(e, n, v) takes the
// W accumulators of columns n..n+W-1 (every N is a multiple of W).
template <typename T, int BM, int BN, int BK, int TM, int TN, int CS, int SMEM_C, typename Epi>
__device__ __forceinline__ void store_tile(const T (&acc)[TM][TN], int ty, int tx, i64 e0, int n0,
                                           i64 E, int N, Epi epi) {
  typedef Tile<T, BM, BN, BK, TM, TN> TL;
  constexpr int W = TL::W;
  T* Cs = smem_at<T>(SMEM_C);
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; j += W) Vec<T>::store(Cs + TL::row(ty, i) * CS + TL::col(tx, j), &acc[i][j]);
  __syncthreads();
  for (int idx = threadIdx.x; idx < BM * BN / W; idx += TL::THREADS) {
    const int m = idx / (BN / W), n = (idx - m * (BN / W)) * W;
    const i64 e = e0 + m;
    if (e < E && n0 + n < N) epi(e, n0 + n, Cs + m * CS + n);
  }
}

// Block GEMM: one BM x BN tile of C = epi(A @ B), A given element-wise by
// a_at(m, e, k), B row-major K x N in global memory, K a multiple of BK.
// With STAGES == 2 the next K chunk is loaded into registers while this one
// computes, then stored to the other shared stage (more registers, fewer
// stalls); STAGES == 1 loads, syncs and computes in turn. The tile leaves through shared memory
// so that epi's global accesses are coalesced.
template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, typename S, typename AAt, typename Epi>
__device__ __forceinline__ void gemm_block(i64 E, int K, int N,
                                           const T* __restrict__ B, AAt a_at, Epi epi) {
  typedef Tile<T, BM, BN, BK, TM, TN> TL;
  constexpr int A_STAGE = BK * S::a_pitch, B_STAGE = BK * S::b_pitch;
  static_assert(S::b_pitch == BN, "the B chunk is stored by flat index: unpadded rows");
  constexpr int AL = BM * BK / TL::THREADS, BL = BK * BN / TL::THREADS;
  static_assert(BM * BK % TL::THREADS == 0 && BK * BN % TL::THREADS == 0, "uneven chunk loads");
  T* As = smem_at<T>(S::a_tile);
  T* Bs = smem_at<T>(S::b_tile);
  const int tid = threadIdx.x;
  const int tx = tid % TL::TX, ty = tid / TL::TX;
  const i64 e0 = block_row<BM, BN>(N);
  const int n0 = block_col<BN>(N);

  T ra[AL], rb[BL];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int r = 0; r < AL; ++r) {
      const int idx = tid + r * TL::THREADS, m = idx / BK, kk = idx - m * BK;
      const i64 e = e0 + m;
      ra[r] = e < E ? a_at(m, e, k0 + kk) : T(0);
    }
#pragma unroll
    for (int r = 0; r < BL; ++r) {
      const int idx = tid + r * TL::THREADS, kk = idx / BN, n = idx - kk * BN;
      rb[r] = n0 + n < N ? __ldg(B + (i64)(k0 + kk) * N + n0 + n) : T(0);
    }
  };
  auto stash = [&](int stage) {
#pragma unroll
    for (int r = 0; r < AL; ++r) {
      const int idx = tid + r * TL::THREADS, m = idx / BK, kk = idx - m * BK;
      As[stage * A_STAGE + kk * S::a_pitch + m] = ra[r];
    }
#pragma unroll
    for (int r = 0; r < BL; ++r) Bs[stage * B_STAGE + tid + r * TL::THREADS] = rb[r];
  };

  T acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = T(0);

  static_assert(STAGES == 1 || STAGES == 2, "one or two shared-memory stages");
  if constexpr (STAGES == 2) {
    fetch(0);
    stash(0);
    __syncthreads();
    int stage = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
      const bool more = k0 + BK < K;
      if (more) fetch(k0 + BK);
      mma_chunk<T, BM, BN, BK, TM, TN, S::a_pitch, S::b_pitch>(acc, As + stage * A_STAGE, Bs + stage * B_STAGE, ty, tx);
      if (more) stash(stage ^ 1);
      __syncthreads();
      stage ^= 1;
    }
  } else {
    for (int k0 = 0; k0 < K; k0 += BK) {
      fetch(k0);
      stash(0);
      __syncthreads();
      mma_chunk<T, BM, BN, BK, TM, TN, S::a_pitch, S::b_pitch>(acc, As, Bs, ty, tx);
      __syncthreads();
    }
  }

  // Out through shared memory (aliases the A/B stages: all reads are done).
  store_tile<T, BM, BN, BK, TM, TN, S::c_pitch, S::c_tile>(acc, ty, tx, e0, n0, E, N, epi);
}

// ---------------------------------------------------------------------------
// cp.async pipeline (PIPE == 1): STAGES chunks in flight, A row-major in
// shared memory, A and B async.

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared (dst a shared-window address); src_bytes 0
// writes zeros (rows past E).
__device__ __forceinline__ void cp_async16s(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  cp_async16s(smem_addr(dst), src, src_bytes);
}
// Bring `bytes` (a multiple of 16) at p (16-byte aligned) into L2, no wait:
// one instruction for a whole contiguous stretch (sm_90 bulk copy engine).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// acc[i][j] += A[row i][k] * B[k][col j] over one chunk, k ascending; A
// row-major (stride AK), read W k-values at a time; B rows BP apart.
template <typename T, int BM, int BN, int BK, int TM, int TN, int AK, int BP>
__device__ __forceinline__ void mma_chunk_rows(T (&acc)[TM][TN], const T* As, const T* Bs, int ty, int tx) {
  typedef Tile<T, BM, BN, BK, TM, TN> TL;
  constexpr int W = TL::W;
#pragma unroll
  for (int k4 = 0; k4 < BK; k4 += W) {
    T a[TM][W];
#pragma unroll
    for (int i = 0; i < TM; ++i) Vec<T>::load(As + TL::row(ty, i) * AK + k4, a[i]);
#pragma unroll
    for (int kk = 0; kk < W; ++kk) {
      T b[TN];
#pragma unroll
      for (int j = 0; j < TN; j += W) Vec<T>::load(Bs + (k4 + kk) * BP + TL::col(tx, j), b + j);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = op_dot_step<T>(a[i][kk], b[j], acc[i][j]);
    }
  }
}

template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, typename S, typename AOp, typename Epi>
__device__ __forceinline__ void gemm_pipe(i64 E, int K, int N, const T* __restrict__ B, const AOp& a, Epi epi) {
  typedef Tile<T, BM, BN, BK, TM, TN> TL;
  constexpr int W = TL::W;
  constexpr int AK = S::a_pitch;  // row-major A tile
  constexpr int A_STAGE = BM * AK, B_STAGE = BK * S::b_pitch;
  static_assert(BK % W == 0 && BN % W == 0, "chunks of whole 16-byte vectors");
  T* As = smem_at<T>(S::a_tile);
  T* Bs = smem_at<T>(S::b_tile);
  const int tid = threadIdx.x;
  const int tx = tid % TL::TX, ty = tid / TL::TX;
  const i64 e0 = block_row<BM, BN>(N);
  const int n0 = block_col<BN>(N);
  const int KT = K / BK;

  auto load = [&](int kt) {
    const int k0 = kt * BK, st = kt % STAGES;
    T* as = As + st * A_STAGE;
    T* bs = Bs + st * B_STAGE;
    for (int v = tid; v < BK * BN / W; v += TL::THREADS) {
      const int kk = v / (BN / W), n = (v - kk * (BN / W)) * W;
      const bool ok = n0 + n < N;
      cp_async16(bs + kk * S::b_pitch + n, B + (ok ? (i64)(k0 + kk) * N + n0 + n : 0), ok ? 16 : 0);
    }
    for (int v = tid; v < BM * BK / W; v += TL::THREADS) {
      const int m = v / (BK / W), k = (v - m * (BK / W)) * W;
      const i64 e = e0 + m;
      const bool ok = e < E;
      cp_async16(as + m * AK + k, ok ? a.row(e) + k0 + k : B, ok ? 16 : 0);
    }
  };

  T acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = T(0);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // chunk kt is in; everyone is done with chunk kt-1's stage
    if (kt + STAGES - 1 < KT) load(kt + STAGES - 1);
    cp_async_commit();
    mma_chunk_rows<T, BM, BN, BK, TM, TN, AK, S::b_pitch>(acc, As + (kt % STAGES) * A_STAGE,
                                                         Bs + (kt % STAGES) * B_STAGE, ty, tx);
  }
  cp_async_wait<0>();
  __syncthreads();

  store_tile<T, BM, BN, BK, TM, TN, S::c_pitch, S::c_tile>(acc, ty, tx, e0, n0, E, N, epi);
}

// ---------------------------------------------------------------------------
// Persistent streaming GEMM (PIPE == 2). A block walks the tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... (column blocks fastest) and streams their K
// chunks through one cp.async ring of STAGES chunks that never drains between
// tiles: the next tile's first chunks land while this one finishes and runs
// its epilogue. With K = 128..192 a tile has only four to six chunks of 32, so
// a per-tile fill/drain bubble (what PIPE 0 and 1 pay) costs a large share.
// Thread (ty, tx) owns rows ty + i*TY and column groups tx*W + jg*TX*W: a
// warp's A reads hit rows AK = BK + W apart (distinct banks), its B reads and
// its epilogue's accesses are contiguous 16-byte groups. The epilogue runs
// straight from registers: no shared-memory round trip, no barrier.

// One chunk copy of R rows x V 16-byte pieces into shared memory (row pitch
// SP elements) from global rows `gp` elements apart. A thread keeps one
// piece column c0 and walks rows r0, r0 + DR, ... (DR = THREADS / V; the
// last THREADS % V threads copy nothing), so its offsets are fixed and a
// chunk costs one base address, not a division and a 64-bit address per
// piece: in the bwd_gemm ring's SASS the loader went from ~130 to ~77
// instructions per chunk (BENCH.md, runs 32-35). each() deals the same
// pieces, so the fused walk forms gz in exactly what this thread copied
// (one barrier covers both).
template <typename T, int R, int V, int THREADS, int SP>
struct ChunkCopy {
  static_assert(THREADS >= V, "one thread per piece column at least");
  static constexpr int W = Vec<T>::W, DR = THREADS / V, IT = (R + DR - 1) / DR;
  static constexpr int DST_STEP = DR * SP * (int)sizeof(T);  // bytes between a thread's pieces
  int r0, c0;
  __device__ __forceinline__ explicit ChunkCopy(int tid) : r0(tid / V), c0((tid % V) * W) {}
  // f(it, r, c) for each of this thread's pieces.
  template <typename F>
  __device__ __forceinline__ void each(F f) const {
    if (THREADS % V != 0 && r0 >= DR) return;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int r = r0 + it * DR;
      if (R % DR == 0 || r < R) f(it, r, c0);
    }
  }
  // Where a chunk runs past the surface (`whole` false: the last row tile,
  // a ragged column tile), ok(r, c) says which pieces are in range; one that
  // is not copies nothing (source size 0: zero fill) and is given src, the
  // chunk's first element, so every copy's address lies inside the surface.
  template <typename Ok>
  __device__ __forceinline__ void copy(unsigned dst, const T* src, int gp, bool whole, Ok ok) const {
    const char* s = reinterpret_cast<const char*>(src + r0 * gp + c0);
    const unsigned d = dst + (r0 * SP + c0) * (int)sizeof(T);
    const int step = DR * gp * (int)sizeof(T);
    if (whole) {
      each([&](int it, int, int) { cp_async16s(d + it * DST_STEP, s + it * step, 16); });
    } else {
      each([&](int it, int r, int c) {
        const bool y = ok(r, c);
        cp_async16s(d + it * DST_STEP, y ? s + it * step : reinterpret_cast<const char*>(src), y ? 16 : 0);
      });
    }
  }
};

// The first STAGES - 1 slots of a persistent cp.async ring: one commit group
// each (empty past the walk's nq chunks), so the consumer's wait counts
// hold whatever the walk's length. load_next() advances lq.
template <int STAGES, typename Load>
__device__ __forceinline__ void prime_ring(const i64& lq, i64 nq, Load& load_next) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (lq < nq) load_next();
    cp_async_commit();
  }
}

// Tile (m, n) of a block's walk, advanced by gridDim.x tiles at a time
// without 64-bit divisions.
struct TileWalk {
  i64 m;
  int n;
  __device__ __forceinline__ void step(i64 dm, int dn, int ntn) {
    m += dm;
    n += dn;
    if (n >= ntn) {
      n -= ntn;
      ++m;
    }
  }
};

// acc[i][j] += A[ty + i*TY][k] * B[k][tx*W + (j/W)*TX*W + j%W] over one
// chunk, k ascending; A row-major (rows ak elements apart: a ring chunk's
// padded row, or the fused panel's), read W k-values at a time; B rows BP apart.
template <typename T, int BM, int BN, int BK, int TM, int TN, int BP>
__device__ __forceinline__ void mma_stream(T (&acc)[TM][TN], const T* As, int ak, const T* Bs, int ty, int tx,
                                           int live = BN) {
  constexpr int W = Vec<T>::W, TX = BN / TN, TY = BM / TM;
  // A thread's column groups lie TX * W apart: those at or past `live` (the
  // tile's columns inside N, block-uniform) are neither loaded nor summed.
  // Predicated, not branched: their FFMAs still take issue slots (run 113).
  auto on = [&](int j) { return j < W || j / W * TX * W < live; };
#pragma unroll
  for (int k4 = 0; k4 < BK; k4 += W) {
    T a[TM][W];
#pragma unroll
    for (int i = 0; i < TM; ++i) Vec<T>::load(As + (ty + i * TY) * ak + k4, a[i]);
#pragma unroll
    for (int kk = 0; kk < W; ++kk) {
      T b[TN];
#pragma unroll
      for (int j = 0; j < TN; j += W)
        if (on(j)) Vec<T>::load(Bs + (k4 + kk) * BP + tx * W + (j / W) * TX * W, b + j);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
          if (on(j)) acc[i][j] = op_dot_step<T>(a[i][kk], b[j], acc[i][j]);
    }
  }
}

template <typename T, int TM, int TN>
__device__ __forceinline__ void zero_acc(T (&acc)[TM][TN]) {
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = T(0);
}

// A streaming tile's epilogue, straight from registers: epi(e, off + n, v)
// for the W accumulators of row e, columns n..n+W-1 of the BM x BN tile at
// (e0, n0) of an E x N output; then the accumulators restart at zero.
// Interior tiles store without a test per group, so the compiler may issue
// the epilogue's loads together; edge tiles test each group.
template <typename T, int BM, int BN, int TM, int TN, typename Epi>
__device__ __forceinline__ void store_acc_regs(T (&acc)[TM][TN], int ty, int tx, i64 e0, int n0, i64 E, int N,
                                               int off, Epi& epi) {
  constexpr int W = Vec<T>::W, TX = BN / TN, TY = BM / TM;
  auto store = [&](auto guarded) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const i64 e = e0 + ty + i * TY;
#pragma unroll
      for (int j = 0; j < TN; j += W) {
        const int n = n0 + tx * W + (j / W) * TX * W;
        if (!decltype(guarded)::value || (e < E && n < N)) epi(e, off + n, &acc[i][j]);
      }
    }
  };
  if (e0 + BM <= E && n0 + BN <= N) store(std::false_type{});
  else store(std::true_type{});
  zero_acc(acc);
}

// The persistent walk and ring of the one-segment stages, for any core:
// tiles blockIdx.x, blockIdx.x + gridDim.x, ... (column blocks fastest),
// their K chunks through one cp.async ring of STAGES slots that never
// drains (the next tile's first chunks land while this one finishes), A
// row-major (rows AK apart) and B k-major (rows BP apart) in each slot.
// start() runs once the ring is primed, chunk(as, bs) on each chunk once it
// is in, store(e0, n0) at the end of each tile. The A operand (SurfaceA, stages.cuh) gives a.row(e), the cp.async
// source of row e at k = 0, rows a.stride() elements apart.
template <typename T, int BM, int BN, int BK, int STAGES, int THREADS, int AK, int BP, int SMEM_A, int SMEM_B,
          typename AOp, typename Start, typename Chunk, typename Store>
__device__ __forceinline__ void stream_walk(i64 E, int K, int N, const T* __restrict__ B, AOp& a, Start start,
                                            Chunk chunk, Store store) {
  constexpr int W = Vec<T>::W;
  constexpr int A_STAGE = BM * AK, B_STAGE = BK * BP;
  static_assert(STAGES >= 2, "a ring of at least two chunks");
  static_assert(BK % W == 0 && BN % W == 0, "whole 16-byte vectors");
  T* As = smem_at<T>(SMEM_A);
  T* Bs = smem_at<T>(SMEM_B);
  const int tid = threadIdx.x;
  const int ntn = (N + BN - 1) / BN;
  const i64 tiles = (E + BM - 1) / BM * ntn;
  if ((i64)blockIdx.x >= tiles) return;  // whole block: no barrier is skipped
  const int KT = K / BK;
  const i64 nq = ((tiles - 1 - blockIdx.x) / gridDim.x + 1) * KT;  // this block's chunks
  const i64 dm = gridDim.x / ntn;
  const int dn = gridDim.x % ntn;

  // Loader: chunk lq (tile lw, K chunk lkt) into ring slot lst; the
  // consumer follows the same walk STAGES - 1 chunks behind.
  const TileWalk first{(i64)(blockIdx.x / ntn), (int)(blockIdx.x % ntn)};
  TileWalk lw = first, cw = first;
  int lkt = 0, lst = 0;
  i64 lq = 0;
  // Offsets within a chunk are ints (a K x N weight block, BM rows of A):
  // one 64-bit address per chunk, not one per copy.
  const ChunkCopy<T, BK, BN / W, THREADS, BP> copy_b(tid);
  const ChunkCopy<T, BM, BK / W, THREADS, AK> copy_a(tid);
  const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
  const int stride = a.stride();
  auto load_next = [&]() {
    const i64 e0 = lw.m * BM;
    const int n0 = lw.n * BN, k0 = lkt * BK;
    copy_b.copy(bs0 + lst * B_STAGE * (int)sizeof(T), B + k0 * N + n0, N, n0 + BN <= N,
                [&](int, int n) { return n0 + n < N; });
    const int rows = E - e0 < BM ? (int)(E - e0) : BM;
    copy_a.copy(as0 + lst * A_STAGE * (int)sizeof(T), a.row(e0) + k0, stride, rows == BM,
                [&](int m, int) { return m < rows; });
    if (++lkt == KT) {
      lkt = 0;
      lw.step(dm, dn, ntn);
    }
    lst = lst + 1 == STAGES ? 0 : lst + 1;
    ++lq;
  };

  prime_ring<STAGES>(lq, nq, load_next);
  start();
  int ckt = 0, cst = 0;
  for (i64 q = 0; q < nq; ++q) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of chunk q have landed
    T* as = As + cst * A_STAGE;
    const i64 e0 = cw.m * BM;
    __syncthreads();  // chunk q is in; everyone is done with chunk q-1's slot
    if (lq < nq) load_next();
    cp_async_commit();
    chunk(as, Bs + cst * B_STAGE);
    cst = cst + 1 == STAGES ? 0 : cst + 1;
    if (++ckt == KT) {
      store(e0, cw.n * BN);
      ckt = 0;
      cw.step(dm, dn, ntn);
    }
  }
  cp_async_wait<0>();
}

// The exact core on stream_walk (PIPE == 2): thread (ty, tx) owns TM x TN
// outputs (mma_stream's layout); the epilogue leaves from registers.
template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, typename S, typename AOp, typename Epi>
__device__ __forceinline__ void gemm_stream(i64 E, int K, int N, const T* __restrict__ B, AOp& a,
                                            Epi epi) {
  constexpr int W = Vec<T>::W, TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
  static_assert(TN % W == 0, "whole 16-byte vectors");
  const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
  T acc[TM][TN];
  stream_walk<T, BM, BN, BK, STAGES, THREADS, S::a_pitch, S::b_pitch, S::a_tile, S::b_tile>(
      E, K, N, B, a, [&] { zero_acc(acc); },
      [&](const T* as, const T* bs) { mma_stream<T, BM, BN, BK, TM, TN, S::b_pitch>(acc, as, S::a_pitch, bs, ty, tx); },
      [&](i64 e0, int n0) { store_acc_regs<T, BM, BN, TM, TN>(acc, ty, tx, e0, n0, E, N, 0, epi); });
}

// ---------------------------------------------------------------------------
// The fp16x3 core (PREC 1): gemm_x3 below and the fused walk use it.
namespace x3 {
constexpr float TAIL = 2048.f, INV_TAIL = 1.f / 2048.f;

// Two floats as one f16x2 word (lo in the low half), rounded to nearest even.
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ void unpack_h2(unsigned h, float& lo, float& hi) {
  asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
}
// (x, y): head word h and tail word l.
__device__ __forceinline__ void split2(float x, float y, unsigned& h, unsigned& l) {
  h = pack_h2(x, y);
  float hx, hy;
  unpack_h2(h, hx, hy);
  l = pack_h2((x - hx) * TAIL, (y - hy) * TAIL);
}
// One float's head and tail halves, as split2 forms each of its two.
__device__ __forceinline__ void split1(float x, unsigned short& h, unsigned short& l) {
  float hx;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hx) : "h"(h));
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"((x - hx) * TAIL));
}
// s = 2^(11 - x) and inv = 2^(x - 11) for mx = m 2^x (m in [0.5, 1)), from
// the bits (exact powers of two), both from one clamped x so that s * inv
// is exactly 1: a max below 2^-115 (subnormal included) is scaled as 2^-115
// is, and keeps its values normal in fp16. A zero max gives 1 (the chunk
// row is zeros); a non-finite one 1 (inf and NaN stay non-finite).
__device__ __forceinline__ void scale_of(float mx, float& s, float& inv) {
  const int ex = (int)((__float_as_uint(mx) >> 23) & 0xff);
  const bool plain = mx == 0.f || ex == 255;
  const int x = max(ex - 126, -115);  // ex - 126 <= 128: both exponents stay in 1..254
  s = __uint_as_float((unsigned)(plain ? 127 : 138 - x) << 23);
  inv = __uint_as_float((unsigned)(plain ? 127 : 116 + x) << 23);
}
// c += a b, and c = a b (c's inputs zero).
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_fresh(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// The scales of rows g and g + 8 of an m16 A fragment for one chunk (a0:
// row g, column 2t of the chunk, rows AK apart): each row's max over the
// quad of lanes holding it, to its power of two (scale_of).
template <int BK, int AK>
__device__ __forceinline__ void row_scales(const float* a0, float (&s)[2], float (&inv)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = 0.f;
#pragma unroll
    for (int k = 0; k < BK; k += 8) {
      const float2 v = *reinterpret_cast<const float2*>(a0 + h * 8 * AK + k);
      mx = fmaxf(mx, fmaxf(fabsf(v.x), fabsf(v.y)));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    scale_of(mx, s[h], inv[h]);
  }
}
// The k16 step ks of that fragment, scaled and split:
// a0a1: (g, 2t), a2a3: (g + 8, 2t), a4a5: (g, 2t + 8), a6a7: (g + 8, 2t + 8).
template <int AK>
__device__ __forceinline__ void split_a(const float* a0, int ks, const float (&s)[2], unsigned (&ah)[4],
                                        unsigned (&al)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int h = r % 2;
    const float2 v = *reinterpret_cast<const float2*>(a0 + h * 8 * AK + ks * 16 + 8 * (r / 2));
    split2(v.x * s[h], v.y * s[h], ah[r], al[r]);
  }
}
// One k16 step of the three products into NJ n8 tiles: ph = ah bh,
// pt = ah bl + al bh, fresh at a chunk's first step.
template <int NJ>
__device__ __forceinline__ void products(float (&ph)[NJ][4], float (&pt)[NJ][4], const unsigned (&ah)[4],
                                         const unsigned (&al)[4], const unsigned (&bh)[NJ][2],
                                         const unsigned (&bl)[NJ][2], bool first) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (first) {
      mma_fresh(ph[j], ah, bh[j][0], bh[j][1]);
      mma_fresh(pt[j], ah, bl[j][0], bl[j][1]);
    } else {
      mma(ph[j], ah, bh[j][0], bh[j][1]);
      mma(pt[j], ah, bl[j][0], bl[j][1]);
    }
    mma(pt[j], al, bh[j][0], bh[j][1]);
  }
}

// One K chunk of a warp's 32 x 32 tile: acc += (A_chunk B_chunk), A rows
// wm*32.. of the ring's row-major chunk (pitch AK), B its k-major chunk
// (pitch BP), columns wn*32..
template <int BK, int AK, int BP>
__device__ __forceinline__ void chunk(float (&acc)[2][4][4], const float* As, const float* Bs, int wm, int wn,
                                      int lane) {
  const int g = lane / 4, t = lane % 4;
  // B fragments of the whole chunk: b0 = (k 2t, 2t+1; n g), b1 = k + 8.
  unsigned bh[BK / 16][4][2], bl[BK / 16][4][2];
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float* p = Bs + (ks * 16 + 2 * t + 8 * r) * BP + wn * 32 + j * 8 + g;
        split2(p[0], p[BP], bh[ks][j][r], bl[ks][j][r]);
      }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* a0 = As + (wm * 32 + i * 16 + g) * AK + 2 * t;  // row g; row g + 8 at a0 + 8 * AK
    float s[2], inv[2];
    row_scales<BK, AK>(a0, s, inv);
    float ph[4][4], pt[4][4];
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      unsigned ah[4], al[4];
      split_a<AK>(a0, ks, s, ah, al);
      products(ph, pt, ah, al, bh[ks], bl[ks], ks == 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = fmaf(fmaf(pt[j][c], INV_TAIL, ph[j][c]), inv[c / 2], acc[i][j][c]);
  }
}

// The epilogue of one m16n8 fragment c (rows e16 + g and e16 + g + 8,
// columns n8 + 2t, + 1): lanes t and t ^ 1 trade halves so that each holds
// 4 consecutive columns of one row (even t: row g, columns 2t..2t+3; odd t:
// row g + 8, columns 2t-2..2t+1), then epi(e, n, v) as the exact path calls
// it; the accumulators restart at zero. wgmma's m64 accumulators are laid
// out as four warps' m16 fragments, so gemm_wg stores through it too.
// frag_at: where store_frag hands this lane's 4 columns to epi (row e,
// column n; a staged epilogue's loads go there too).
__device__ __forceinline__ void frag_at(i64 e16, int n8, int lane, i64& e, int& n) {
  const int t = lane % 4;
  const bool odd = t & 1;
  e = e16 + lane / 4 + (odd ? 8 : 0);
  n = n8 + 2 * t - (odd ? 2 : 0);
}
template <typename Epi>
__device__ __forceinline__ void store_frag(float* c, i64 e16, int n8, int lane, i64 E, int N, Epi& epi) {
  const bool odd = lane & 1;
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? c[0] : c[2], 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? c[1] : c[3], 1);
  const float v[4] = {odd ? r0 : c[0], odd ? r1 : c[1], odd ? c[2] : r0, odd ? c[3] : r1};
  i64 e;
  int n;
  frag_at(e16, n8, lane, e, n);
  if (e < E && n < N) epi(e, n, v);
#pragma unroll
  for (int q = 0; q < 4; ++q) c[q] = 0.f;
}
// A warp's 32 x 32 tile of gemm_x3's core.
template <typename Epi>
__device__ __forceinline__ void store(float (&acc)[2][4][4], int wm, int wn, int lane, i64 e0, int n0, i64 E, int N,
                                      Epi& epi) {
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) store_frag(acc[i][j], e0 + wm * 32 + i * 16, n0 + wn * 32 + j * 8, lane, E, N, epi);
}
}  // namespace x3

// ---------------------------------------------------------------------------
// Hopper's warpgroup MMA (sm_90a) for the fp16x3 products: gemm_wg and the
// fused walks' warpgroups (pipe: wgmma and split_wgmma).
namespace wg {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mma_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long b,
                                        int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#endif
// Where B's (n, k) half sits among no-swizzle K-major core matrices of a
// K-deep operand: 8 x 8 halves of 128 bytes, k-neighbours 128 bytes apart,
// n-neighbours K / 8 x 128 (the descriptors' lbo and sbo below).
__device__ __forceinline__ int at(int n, int k, int K) { return ((n / 8) * (K / 8) + k / 8) * 64 + (n % 8) * 8 + k % 8; }
template <int K>
__device__ __forceinline__ int at(int n, int k) { return at(n, k, K); }
// A no-swizzle shared-memory matrix descriptor: start, leading and stride
// byte offsets.
__device__ __forceinline__ unsigned long long desc(const void* smem, unsigned lbo, unsigned sbo) {
  const unsigned a = smem_addr(smem);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}
// No access to d moves across a wgmma fence or wait.
template <int R>
__device__ __forceinline__ void keep(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// wgmma reads its register A operand asynchronously, until the wait: kept
// live (and unmoved) to there, or the compiler may reuse the registers
// (CUTLASS's warpgroup_fence_operand).
template <int S>
__device__ __forceinline__ void keep(unsigned (&a)[S][4]) {
#pragma unroll
  for (int i = 0; i < S; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// A warpgroup's A chunk, scaled and split in registers (x3::row_scales,
// x3::split_a): the ring's row-major chunk (pitch AK), warp w's rows 16 w..
// One split serves every 64-column tile the chunk multiplies.
template <int BK>
struct SplitA {
  float inv[2];
  unsigned ah[BK / 16][4], al[BK / 16][4];
};
template <int BK, int AK>
__device__ __forceinline__ void split(SplitA<BK>& sa, const float* As, int warp, int lane) {
  const float* a0 = As + (warp * 16 + lane / 4) * AK + 2 * (lane % 4);  // row g; g + 8 at + 8 AK
  float s[2];
  x3::row_scales<BK, AK>(a0, s, sa.inv);
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) x3::split_a<AK>(a0, ks, s, sa.ah[ks], sa.al[ks]);
}
// One 64-column tile's products of that chunk, issued (the caller fences,
// commits and waits): ph = ah bh, pt = ah bt + al bh over the chunk's k16
// steps, fresh at the first. B: fp16 head and tail core matrices in shared
// memory (bh, bt at the chunk's first k group; n groups sbo bytes apart, k
// groups 128). Sm_90a.
template <int BK>
__device__ __forceinline__ void issue(float (&ph)[32], float (&pt)[32], const SplitA<BK>& sa,
                                      const unsigned short* bh, const unsigned short* bt, unsigned sbo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) {
    const unsigned long long dh = desc(bh + ks * 128, 128, sbo), dt = desc(bt + ks * 128, 128, sbo);
    mma_n64(ph, sa.ah[ks], dh, ks);
    mma_n64(pt, sa.ah[ks], dt, ks);
    mma_n64(pt, sa.al[ks], dh, 1);
  }
#endif
}
// x3::chunk's fold: acc += (ph + pt 2^-11) inv.
__device__ __forceinline__ void fold(float (&acc)[32], const float (&ph)[32], const float (&pt)[32],
                                     const float (&inv)[2]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = fmaf(fmaf(pt[i], x3::INV_TAIL, ph[i]), inv[(i % 4) / 2], acc[i]);
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
#endif
// One 64-column tile of that chunk: acc += A_chunk B_chunk with x3::chunk's
// products and fold, so the same bits.
template <int BK>
__device__ __forceinline__ void tile(float (&acc)[32], SplitA<BK>& sa, const unsigned short* bh,
                                     const unsigned short* bt, unsigned sbo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  float ph[32], pt[32];
  keep(ph);
  keep(pt);
  fence();
  issue<BK>(ph, pt, sa, bh, bt, sbo);
  commit_wait();
  keep(ph);
  keep(pt);
  keep(sa.ah);
  keep(sa.al);
  fold(acc, ph, pt, sa.inv);
#else
  __trap();  // sm_90a only (the spec's archs and the instance's target)
#endif
}
// Two 64-column tiles of the chunk under one wait (gemm_wg at bn 128):
// both tiles' products in flight together, each folded as tile() folds it,
// so the same bits.
template <int BK>
__device__ __forceinline__ void tile2(float (&acc0)[32], float (&acc1)[32], SplitA<BK>& sa,
                                      const unsigned short* bh0, const unsigned short* bt0,
                                      const unsigned short* bh1, const unsigned short* bt1, unsigned sbo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  float ph0[32], pt0[32], ph1[32], pt1[32];
  keep(ph0);
  keep(pt0);
  keep(ph1);
  keep(pt1);
  fence();
  issue<BK>(ph0, pt0, sa, bh0, bt0, sbo);
  issue<BK>(ph1, pt1, sa, bh1, bt1, sbo);
  commit_wait();
  keep(ph0);
  keep(pt0);
  keep(ph1);
  keep(pt1);
  keep(sa.ah);
  keep(sa.al);
  fold(acc0, ph0, pt0, sa.inv);
  fold(acc1, ph1, pt1, sa.inv);
#else
  __trap();  // sm_90a only (the spec's archs and the instance's target)
#endif
}
// One K chunk of a warpgroup's 64 x 64 tile (the fused wgmma walks): the
// split, then the tile's products and fold.
template <int BK, int AK, int BN>
__device__ __forceinline__ void chunk(float (&acc)[BN / 2], const float* As, const unsigned short* bh,
                                      const unsigned short* bt, unsigned sbo, int warp, int lane) {
  static_assert(BN == 64, "m64n64k16");
  SplitA<BK> sa;
  split<BK, AK>(sa, As, warp, lane);
  tile<BK>(acc, sa, bh, bt, sbo);
}
}  // namespace wg

// ---------------------------------------------------------------------------
// Row-block streaming GEMM: the fused backward's core. A persistent block
// owns whole row blocks (rb = blockIdx.x, blockIdx.x + gridDim.x, ...) and,
// per row block, walks every column tile of both output segments (square
// blocks: K == N per segment) through one cp.async ring that never drains,
// exactly as gemm_stream does for one segment. So the per-row work the A
// operand needs (gate recompute, gate-logit, scalar chain) runs once per
// row block, not once per column tile, and its result stays in shared
// memory for all of that row block's tiles: a.tile(e0) on the whole block
// (pipe: stream; the ring keeps loading the row block's first chunks, their
// weights: subtile 0's gz is gz_s, never copied, while it runs), or on
// producer threads a row block ahead (pipe: split, P > 0: below). Each
// output element still accumulates k ascending from zero (chunk by chunk,
// mma_stream), then epi. PREC 1 (fp16x3): the same walk at the layout's fp16x3 pitches,
// each chunk through x3::chunk (gemm_x3's core, so the same products and
// folds per output element as the relay's fp16x3 GEMM), stored by x3::store;
// with WG (pipe: wgmma on the stream walk, split_wgmma on the split walk)
// through wg::chunk per warpgroup of 64 rows (gemm_wg's core, the same
// bits), stored by x3::store_frag.

// Named barriers (id 0 is __syncthreads'): sync waits, arrive goes on; both
// order this thread's earlier shared-memory accesses before the barrier
// completes, which is what a buffer handover needs.
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// FULL/EMPTY + segment (pipe: ws) or + per-row buffer slot (pipe: split).
enum WsBarrier { WS_PRODUCERS = 1, WS_CONSUMERS = 2, WS_FULL = 3, WS_EMPTY = 5 };

// tiles.yaml `regs` (pipe: split): the layout S's setmaxnreg counts, each
// side's registers per thread after the move; 0 where S has none (ptxas
// allocates alone). setmaxnreg is sm_90a's: only such instances use it.
template <typename S, typename = void>
struct RegSplit {
  static constexpr int producers = 0, consumers = 0;
};
template <typename S>
struct RegSplit<S, std::void_t<decltype(S::consumer_regs)>> {
  static constexpr int producers = S::producer_regs, consumers = S::consumer_regs;
};
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

// One output segment: columns [off, off + N) of each row, from A columns
// [off, off + N) times B (N x N, row-major).
template <typename T>
struct Seg {
  const T* B;
  int N, off;
};

// Position of a chunk in a block's walk: row block, segment, column tile, K
// chunk; advanced without divisions. Per-segment values are picked by
// selects, never by indexing an array with s (that puts the array in local
// memory).
struct RowWalk {
  i64 rb;
  int s, ct, kt;
  __device__ __forceinline__ void step(int kt0, int kt1, int ct0, int ct1) {
    if (++kt == (s ? kt1 : kt0)) {
      kt = 0;
      if (++ct == (s ? ct1 : ct0)) {
        ct = 0;
        if (++s == 2) {
          s = 0;
          rb += gridDim.x;
        }
      }
    }
  }
};

// Where a fused K chunk's gz comes from (AOp::chunk(c0)): a chunk lies in
// one subtile (Cf % BK == 0), so one uniform choice per chunk replaces a
// per-piece subtile test. replace: gz = the source (the scalar chain gz_s,
// and the chunk's g is never loaded); else gz = op_gate(g, source), the
// gates. The source is an element offset into shared memory, not a
// pointer: a pointer picked by a select loses its address space, and the
// loads became generic 64-bit ones (run 78 SASS).
template <typename T>
struct ChunkGz {
  int src;  // the chunk's row 0, column 0: smem_at<T>(0)[src]
  int ld;   // that buffer's row stride
  bool replace;
};

// With P > 0 producer threads (pipe: split; threads 0..P-1) the per-row work
// leaves the GEMM's warps: producers run it (a.produce(e0, slot)) for each
// row block into one of two per-row buffer slots, one row block ahead, and
// hand it over by named barriers (FULL(slot) when formed, EMPTY(slot) when
// the consumers' last chunk of that row block has read it); the consumer
// threads run the walk below, forming gz per chunk from the slot's buffers.
// With P == 0 the whole block runs a.tile(e0) at each row block's first
// chunk, between block barriers.

template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, typename S, int P, int PREC, bool WG,
          typename AOp, typename Epi>
__device__ __forceinline__ void gemm_rowblock(i64 E, const Seg<T> seg0, const Seg<T> seg1, AOp& a, Epi epi) {
  constexpr int W = Vec<T>::W, TX = BN / TN, TY = BM / TM, THREADS = TX * TY, ALL = P + THREADS;
  // rows of the row-major A chunk and the k-major B chunk (the layout's)
  constexpr int AK = S::a_pitch, BP = S::b_pitch;
  constexpr int A_STAGE = BM * AK, B_STAGE = BK * BP;
  static_assert(PREC == 0 || (TM == 8 && TN == 4 && BM % 32 == 0 && BN % 32 == 0 && BK % 16 == 0),
                "fp16x3: one warp per 32 x 32 tile, whole m16n8k16 steps (checked by the spec)");
  static_assert(STAGES >= 2, "a ring of at least two chunks");
  static_assert(TN % W == 0 && BK % W == 0 && BN % W == 0, "whole 16-byte vectors");
  static_assert(P % 32 == 0 && THREADS % 32 == 0, "whole warps on each side");
  static_assert(!WG || (PREC == 1 && P % 128 == 0 && BM % 64 == 0 && THREADS == 2 * BM && BN == 64),
                "wgmma walks: fp16x3, whole producer warpgroups (if any), a warpgroup per 64 x 64 (checked by the spec)");
  const i64 nrb = (E + BM - 1) / BM;
  if ((i64)blockIdx.x >= nrb) return;  // whole block: no barrier is skipped
  // This block's row blocks: blockIdx.x, blockIdx.x + gridDim.x, ...
  const i64 nlocal = (nrb - 1 - blockIdx.x) / gridDim.x + 1;
  if constexpr (P > 0) {
    if ((int)threadIdx.x < P) {
      if constexpr (RegSplit<S>::producers > 0) setmaxnreg_dec<RegSplit<S>::producers>();
      for (i64 i = 0; i < nlocal; ++i) {
        const int slot = (int)(i & 1);
        if (i >= 2) bar_sync(WS_EMPTY + slot, ALL);  // row block i - 2's chunks are formed
        a.produce(((i64)blockIdx.x + i * gridDim.x) * BM, slot, [] { bar_sync(WS_PRODUCERS, P); });
        bar_arrive(WS_FULL + slot, ALL);
      }
      return;
    }
  }
  // The GEMM's threads: all of the block, or the consumers (taking the
  // producers' registers where the tile moves them).
  if constexpr (P > 0 && RegSplit<S>::consumers > 0) setmaxnreg_inc<RegSplit<S>::consumers>();
  auto sync = [] {
    if constexpr (P > 0) {
      bar_sync(WS_CONSUMERS, THREADS);
    } else {
      __syncthreads();
    }
  };
  T* As = smem_at<T>(S::a_tile);
  T* Bs = smem_at<T>(S::b_tile);
  const int tid = threadIdx.x - P, tx = tid % TX, ty = tid / TX;
  const int kt0 = seg0.N / BK, kt1 = seg1.N / BK;
  const int ct0 = (seg0.N + BN - 1) / BN, ct1 = (seg1.N + BN - 1) / BN;
  const i64 nq = nlocal * (kt0 * ct0 + kt1 * ct1);
  const ChunkCopy<T, BK, BN / W, THREADS, BP> copy_b(tid);
  const ChunkCopy<T, BM, BK / W, THREADS, AK> copy_a(tid);
  const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
  const int stride = a.stride();

  // Loader walk, STAGES - 1 chunks ahead of the consumer: row block (la its
  // first row, lrows its rows in range), segment, column tile n0, K chunk
  // (lcol its A column, lb its first B element). Advanced by pointer bumps;
  // multiplies only where a column tile, segment or row block changes.
  i64 le0 = (i64)blockIdx.x * BM;
  const T* la = a.row(le0);
  int lrows = E - le0 < BM ? (int)(E - le0) : BM;
  int ls = 0, lkt = 0, ln0 = 0, lcol = seg0.off, lst = 0;
  const T* lb = seg0.B;
  i64 lq = 0;
  auto load_next = [&]() {
    const int N = ls ? seg1.N : seg0.N, n0 = ln0;
    copy_b.copy(bs0 + lst * B_STAGE * (int)sizeof(T), lb, N, n0 + BN <= N, [&](int, int n) { return n0 + n < N; });
    if (!a.computed(lcol)) {
      const int rows = lrows;
      copy_a.copy(as0 + lst * A_STAGE * (int)sizeof(T), la + lcol, stride, rows == BM,
                  [&](int m, int) { return m < rows; });
    }
    lcol += BK;
    lb += BK * N;
    if (++lkt == (ls ? kt1 : kt0)) {
      lkt = 0;
      ln0 += BN;
      if (ln0 >= N) {
        ln0 = 0;
        if (ls) {
          le0 += (i64)gridDim.x * BM;
          la = a.row(le0);
          lrows = E - le0 < BM ? (int)(E - le0) : BM;
        }
        ls ^= 1;
      }
      lcol = ls ? seg1.off : seg0.off;
      lb = (ls ? seg1.B : seg0.B) + ln0;
    }
    lst = lst + 1 == STAGES ? 0 : lst + 1;
    ++lq;
  };

  prime_ring<STAGES>(lq, nq, load_next);
  [[maybe_unused]] T acc[TM][TN];        // exact: thread (ty, tx)'s outputs
  [[maybe_unused]] float acc3[2][4][4];  // fp16x3: warp (wm, wn)'s 32 x 32 tile
  // the wgmma walks: the warpgroup's m64n64 accumulators (warp w: rows 16 w..)
  [[maybe_unused]] float accw[WG ? BN / 2 : 1];
  constexpr int WN = BN >= 32 ? BN / 32 : 1;  // warp tiles across (fp16x3: BN % 32 == 0)
  [[maybe_unused]] const int lane = tid % 32, wm = tid / 32 / WN, wn = tid / 32 % WN;
  if constexpr (PREC == 0) {
    zero_acc(acc);
  } else if constexpr (WG) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) accw[i] = 0.f;
  } else {
    zero_acc(acc3[0]);
    zero_acc(acc3[1]);
  }

  RowWalk cw{(i64)blockIdx.x, 0, 0, 0};
  int cst = 0;
  i64 crb = 0;  // the row block's index in this block's walk (its slot: crb & 1)
  for (i64 q = 0; q < nq; ++q) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of chunk q have landed
    T* as = As + cst * A_STAGE;
    const i64 e0 = cw.rb * BM;
    const int off = cw.s ? seg1.off : seg0.off;
    const int slot = P > 0 ? (int)(crb & 1) : 0;  // pipe: stream has one buffer set
    // Each thread forms gz in the pieces it copied (the loader's mapping):
    // one barrier covers landing and forming; a row block's first chunk
    // waits for the per-row work, which forming reads. Rows past E form
    // finite values (zero g, zero gz_s) that no store reads.
    auto form_own = [&]() {
      const ChunkGz<T> c = a.chunk(off + cw.kt * BK, slot);
      const T* src = smem_at<T>(0) + c.src;
      copy_a.each([&](int, int m, int k) {
        T x[W], y[W];
        Vec<T>::load(src + m * c.ld + k, y);
        if (!c.replace) {
          Vec<T>::load(as + m * AK + k, x);
#pragma unroll
          for (int w = 0; w < W; ++w) y[w] = op_gate<T>(x[w], y[w]);
        }
        Vec<T>::store(as + m * AK + k, y);
      });
    };
    const bool hook = cw.s == 0 && cw.ct == 0 && cw.kt == 0;
    const bool last = cw.s == 1 && cw.ct == ct1 - 1 && cw.kt == kt1 - 1;  // the row block's last chunk
    // The wgmma walks: this chunk's split B (head, then tail), one of two
    // buffers by chunk parity (below)
    [[maybe_unused]] unsigned short* bx = nullptr;
    if constexpr (WG) {
      static_assert(S::b_split + 8 * BK * BN <= S::fixed, "two chunks' halves (layout.rs)");
      bx = smem_at<unsigned short>(S::b_split) + (int)(q & 1) * 2 * BK * BN;
    }
    // The B chunk into wgmma's fp16 core matrices, each piece by the thread
    // that copied it; the next barrier publishes them to the async proxy.
    // Two buffers, by chunk parity: another warpgroup's products of chunk
    // q - 1 may still read the other one, and chunk q - 2's all completed
    // before that warpgroup reached chunk q - 1's barrier (its wait is in
    // wg::chunk).
    auto split_b = [&]() {
      if constexpr (WG) {
        const T* bs = Bs + cst * B_STAGE;
        copy_b.each([&](int, int k, int n0) {
#pragma unroll
          for (int w = 0; w < W; ++w) {
            const int at = wg::at<BK>(n0 + w, k);
            x3::split1(bs[k * BP + n0 + w], bx[at], bx[BK * BN + at]);
          }
        });
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      }
    };
    if constexpr (P > 0) {
      if (hook) bar_sync(WS_FULL + slot, ALL);  // the producers have formed this row block's slot
      form_own();
      split_b();
      sync();  // chunk q is in and formed; everyone is done with chunk q-1's slot
      // The row block's last chunk has read its slot: hand it back if the
      // producers will fill it again (row block crb + 2).
      if (last && crb + 2 < nlocal) bar_arrive(WS_EMPTY + slot, ALL);
      if (lq < nq) load_next();
      cp_async_commit();
    } else {
      if (!hook) form_own();
      split_b();
      sync();  // chunk q is in (formed unless hooked); everyone is done with chunk q-1's slot
      if (lq < nq) load_next();
      cp_async_commit();
      if (hook) {
        a.tile(e0);  // every read of the previous row block is done (barrier above)
        form_own();
        sync();
      }
    }
    if constexpr (PREC == 0) {
      // Several column groups per thread (tn > W): the last column tile of
      // a segment may end inside the tile (seg1 N 192 at bn 128).
      const int live = TN > W ? (cw.s ? seg1.N : seg0.N) - cw.ct * BN : BN;
      mma_stream<T, BM, BN, BK, TM, TN, BP>(acc, as, AK, Bs + cst * B_STAGE, ty, tx, live);
    } else if constexpr (WG) {
      wg::chunk<BK, AK, BN>(accw, as, bx, bx + BK * BN, (BK / 8) * 128, tid / 32, lane);
    } else {
      x3::chunk<BK, AK, BP>(acc3, as, Bs + cst * B_STAGE, wm, wn, lane);
    }
    cst = cst + 1 == STAGES ? 0 : cst + 1;
    if (cw.kt == (cw.s ? kt1 : kt0) - 1) {
      [[maybe_unused]] auto at_off = [&](i64 e, int n, const float* v) { epi(e, off + n, v); };
      if constexpr (PREC == 0) {
        store_acc_regs<T, BM, BN, TM, TN>(acc, ty, tx, e0, cw.ct * BN, E, cw.s ? seg1.N : seg0.N, off, epi);
      } else if constexpr (WG) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          x3::store_frag(accw + 4 * j, e0 + tid / 32 * 16, cw.ct * BN + j * 8, lane, E, cw.s ? seg1.N : seg0.N, at_off);
      } else {
        x3::store(acc3, wm, wn, lane, e0, cw.ct * BN, E, cw.s ? seg1.N : seg0.N, at_off);
      }
    }
    if (P > 0 && last) ++crb;
    cw.step(kt0, kt1, ct0, ct1);
  }
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------
// Warp-specialised row-block GEMM (pipe: ws): the fused backward's core
// where a row block's whole A operand fits in shared memory. A persistent
// block owns row blocks as gemm_rowblock does, but its warps split: P
// producer threads (threads 0..P-1) form each row block's A panel (a.
// prologue: the per-row work; a.fill(s): segment s's columns), one row
// block ahead, while the consumer threads run the GEMM from the panel, only
// B streaming through their cp.async ring. Each segment's half of the panel
// is handed over by named barriers: producers arrive on FULL(s) when it is
// formed and wait on EMPTY(s) before forming the next row block's; consumers
// wait on FULL(s) and arrive on EMPTY(s) after their last read. So the
// per-row work runs beside the FFMA loop, not between its barriers. Each
// output element still accumulates k ascending from zero (mma_stream), then
// epi.

template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, int P, typename S, typename AOp,
          typename Epi>
__device__ __forceinline__ void gemm_ws(i64 E, const Seg<T> seg0, const Seg<T> seg1, AOp& a, Epi epi) {
  constexpr int W = Vec<T>::W, TX = BN / TN, TY = BM / TM, C = TX * TY, ALL = P + C;
  constexpr int B_STAGE = BK * S::b_pitch;
  static_assert(STAGES >= 2, "a ring of at least two chunks");
  static_assert(P % 32 == 0 && C % 32 == 0, "whole warps on each side");
  static_assert(TN % W == 0 && BK % W == 0 && BN % W == 0, "whole 16-byte vectors");
  const i64 nrb = (E + BM - 1) / BM;
  if ((i64)blockIdx.x >= nrb) return;  // whole block: no barrier is skipped

  if ((int)threadIdx.x < P) {
    for (i64 rb = blockIdx.x; rb < nrb; rb += gridDim.x) {
      const bool first = rb == (i64)blockIdx.x;
      // The last row block's fills read the per-row buffers this rewrites.
      if (!first) bar_sync(WS_PRODUCERS, P);
      a.prologue(rb * BM, [] { bar_sync(WS_PRODUCERS, P); });
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (!first) bar_sync(WS_EMPTY + s, ALL);
        a.fill(s, rb * BM);
        bar_arrive(WS_FULL + s, ALL);
      }
    }
    return;
  }

  const int tid = threadIdx.x - P, tx = tid % TX, ty = tid / TX;
  T* Bs = smem_at<T>(S::b_tile);
  const T* panel = a.panel();
  const int ps = a.panel_stride();
  const int kt0 = seg0.N / BK, kt1 = seg1.N / BK;
  const int ct0 = (seg0.N + BN - 1) / BN, ct1 = (seg1.N + BN - 1) / BN;
  const i64 nq = ((nrb - 1 - blockIdx.x) / gridDim.x + 1) * (kt0 * ct0 + kt1 * ct1);
  const ChunkCopy<T, BK, BN / W, C, S::b_pitch> copy_b(tid);
  const unsigned bs0 = smem_addr(Bs);

  // B loader, STAGES - 1 chunks ahead: segment ls, column tile ln0, K chunk
  // lkt (lb its first element); the walk repeats per row block.
  int ls = 0, lkt = 0, ln0 = 0, lst = 0;
  const T* lb = seg0.B;
  i64 lq = 0;
  auto load_next = [&]() {
    const int N = ls ? seg1.N : seg0.N, n0 = ln0;
    copy_b.copy(bs0 + lst * B_STAGE * (int)sizeof(T), lb, N, n0 + BN <= N, [&](int, int n) { return n0 + n < N; });
    lb += BK * N;
    if (++lkt == (ls ? kt1 : kt0)) {
      lkt = 0;
      ln0 += BN;
      if (ln0 >= N) {
        ln0 = 0;
        ls ^= 1;
      }
      lb = (ls ? seg1.B : seg0.B) + ln0;
    }
    lst = lst + 1 == STAGES ? 0 : lst + 1;
    ++lq;
  };

  prime_ring<STAGES>(lq, nq, load_next);
  T acc[TM][TN];
  zero_acc(acc);

  RowWalk cw{(i64)blockIdx.x, 0, 0, 0};
  int cst = 0;
  for (i64 q = 0; q < nq; ++q) {
    const int kts = cw.s ? kt1 : kt0, cts = cw.s ? ct1 : ct0;
    if (cw.ct == 0 && cw.kt == 0) bar_sync(WS_FULL + cw.s, ALL);  // this segment's panel is formed
    cp_async_wait<STAGES - 2>();  // this thread's copies of chunk q have landed
    bar_sync(WS_CONSUMERS, C);    // everyone's have; everyone is done with chunk q-1's slot
    if (lq < nq) load_next();
    cp_async_commit();
    const int off = cw.s ? seg1.off : seg0.off;
    mma_stream<T, BM, BN, BK, TM, TN, S::b_pitch>(acc, panel + off + cw.kt * BK, ps, Bs + cst * B_STAGE, ty, tx);
    cst = cst + 1 == STAGES ? 0 : cst + 1;
    if (cw.kt == kts - 1) {
      // The segment's last read of the panel: hand it back if another row block follows.
      if (cw.ct == cts - 1 && cw.rb + gridDim.x < nrb) bar_arrive(WS_EMPTY + cw.s, ALL);
      store_acc_regs<T, BM, BN, TM, TN>(acc, ty, tx, cw.rb * BM, cw.ct * BN, E, cw.s ? seg1.N : seg0.N, off, epi);
    }
    cw.step(kt0, kt1, ct0, ct1);
  }
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------
// The compensated tensor-core core (PREC 1, tiles.yaml `precision: fp16x3`;
// docs/PRECISION.md). gemm_stream's walk and ring, f32 operands in shared
// memory as the exact path has them; each warp owns a 32 x 32 output tile
// (2 x 4 m16n8 tiles of mma.sync.m16n8k16) and splits its own fragments in
// registers: x -> head h = fp16(x) and tail l = fp16((x - h) 2^11), three
// products per step (h h into one fragment; h l and l h into another), both
// fresh per K chunk and folded into the fp32 result once per chunk as
// (ph + pt 2^-11) 2^-x. A is scaled by a power of two per (row, K chunk),
// 2^(11 - x) for a chunk row max of m 2^x, so its largest value lies in
// [2^10, 2^11): the split keeps fp32 accuracy whatever the row's magnitude
// (fp16's range alone loses it below ~1e-3 and overflows above 6.5e4).
// B (the weights) is split unscaled: |w| up to 6.5e4 (beyond, the head is
// inf and the outputs it touches NaN; below ~1e-4 a weight's tail is
// subnormal; the runtime checks a stack's own weights against the range).
// Every result is a function of the chunk's operands through one
// instruction sequence, so any kernel running this core over the same K
// chunks gets the same bits (gemm_x3 and the fused gemm_rowblock); the
// chunk width BLOCK_K is part of the arithmetic (the scale and the fold
// are per chunk), so every fp16x3 tile has one BLOCK_K (checked by the spec).

// C = epi(A @ B) by the fp16x3 core on stream_walk (gemm_stream's walk and
// ring, at the layout's fp16x3 pitches): (BM / 32) x (BN / 32) warps, each a 32 x 32 tile
// (tm 8 x tn 4 per thread).
template <int BM, int BN, int BK, int STAGES, typename S, typename AOp, typename Epi>
__device__ __forceinline__ void gemm_x3(i64 E, int K, int N, const float* __restrict__ B, AOp& a, Epi epi) {
  constexpr int THREADS = BM * BN / 32, AK = S::a_pitch, BP = S::b_pitch;
  static_assert(BM % 32 == 0 && BN % 32 == 0 && BK % 16 == 0, "whole warp tiles and m16n8k16 steps");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wm = warp / (BN / 32), wn = warp % (BN / 32);
  float acc[2][4][4];
  auto zero = [&] {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
  };
  stream_walk<float, BM, BN, BK, STAGES, THREADS, AK, BP, S::a_tile, S::b_tile>(
      E, K, N, B, a, zero, [&](const float* as, const float* bs) { x3::chunk<BK, AK, BP>(acc, as, bs, wm, wn, lane); },
      [&](i64 e0, int n0) { x3::store(acc, wm, wn, lane, e0, n0, E, N, epi); });
}

// ---------------------------------------------------------------------------
// The fp16x3 core on Hopper's warpgroup MMA (PIPE 5, pipe: wgmma; sm_90a).
// The same scales, splits, products and folds per output element as
// x3::chunk, so the same bits as every other fp16x3 kernel (bench/exp
// fp16x3_gemm.cu's v6, BENCH.md run 119: every element equal at both of the
// seed's shapes and five scales). The block's warpgroups (BM / 64, 64 rows
// each) walk gemm_stream's tiles (blockIdx.x, + gridDim.x, .., column tiles
// fastest). B's column tile, all K rows, is split once (x3::split2) into
// fp16 head and tail halves in a shared-memory panel of wgmma's no-swizzle
// K-major core matrices (8 n x 8 k halves, 128 B; k-neighbours 128 B apart,
// n-neighbours K / 8 x 128 B), and split again only when the block's column
// tile changes (never when gridDim.x is a multiple of the column tiles).
// Each warpgroup streams its rows' A chunks through its own cp.async ring
// and named barrier, scales and splits them in registers (x3::row_scales,
// x3::split_a) and issues each k16 step's three products as m64n64k16
// wgmmas (ph = ah bh, pt = ah bl + al bh, fresh at the chunk's first step),
// folded per chunk as x3::chunk folds them. Columns past N are zeros in the
// panel and never stored. A block's column tile is BN wide, BN / 64
// wgmma tiles of 64 (two at a time under one wait, wg::tile2; an odd one
// or one past N alone, wg::tile) under one split of each A chunk: at BN >= N every row's A is read once, not once per 64 columns
// (fwd_m1 at 64 was bound by L2 throughput, 89.7% with DRAM at 64.5%:
// BENCH.md run 138).

template <int BM, int BN, int BK, int STAGES, typename S, typename AOp, typename Epi>
__device__ __forceinline__ void gemm_wg(i64 E, int K, int N, const float* __restrict__ B, AOp& a, Epi epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(BM % 64 == 0 && BN % 64 == 0 && BK % 16 == 0, "a warpgroup per 64 rows, m64n64k16 (checked by the spec)");
  constexpr int NT = BN / 64;       // 64-column tiles per block, one A split for all
  constexpr int SG = S::epi_batch;  // the staged epilogue's batch (kinds: Geometry::epi_batch)
  static_assert(SG > 0 && 8 % SG == 0, "whole batches of a tile's m16n8 fragments");
  constexpr int AK = S::a_pitch, SLOT = 64 * AK;
  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  float* ring = smem_at<float>(S::a_tile) + wgi * STAGES * SLOT;
  unsigned short* panel = smem_at<unsigned short>(S::b_tile);  // head: K x BN halves, then the tail's
  const int ntn = (N + BN - 1) / BN;
  const i64 tiles = (E + BM - 1) / BM * ntn;
  if ((i64)blockIdx.x >= tiles) return;  // whole block: no barrier is skipped
  const int KT = K / BK;
  const i64 nq = ((tiles - 1 - blockIdx.x) / gridDim.x + 1) * KT;  // this block's chunks, per warpgroup
  const i64 dm = gridDim.x / ntn;
  const int dn = gridDim.x % ntn;
  // stream_walk's walk, per warpgroup (its 64 rows of each tile, its own
  // ring and named barrier): counters and TileWalk, no 64-bit division per
  // chunk, one 64-bit address per chunk copy.
  const TileWalk first{(i64)(blockIdx.x / ntn), (int)(blockIdx.x % ntn)};
  TileWalk lw = first, cw = first;
  int lkt = 0, lst = 0;
  i64 lq = 0;
  const ChunkCopy<float, 64, BK / 4, 128, AK> copy_a(wt);
  const unsigned ring0 = smem_addr(ring);
  const int stride = a.stride();
  auto load_next = [&]() {
    const i64 r0 = lw.m * BM + wgi * 64;
    const int rows = E - r0 >= 64 ? 64 : E > r0 ? (int)(E - r0) : 0;
    copy_a.copy(ring0 + lst * SLOT * (int)sizeof(float), a.row(rows > 0 ? r0 : 0) + lkt * BK, stride, rows == 64,
                [&](int m, int) { return m < rows; });
    if (++lkt == KT) {
      lkt = 0;
      lw.step(dm, dn, ntn);
    }
    lst = lst + 1 == STAGES ? 0 : lst + 1;
    ++lq;
  };
  // Column tile n0's B into the panel, by the whole block.
  auto fill_panel = [&](int n0) {
    unsigned* hw = reinterpret_cast<unsigned*>(panel);
    unsigned* tw = hw + K * BN / 2;
    for (int v = tid; v < BN * (K / 2); v += blockDim.x) {
      const int n = v % BN, k = 2 * (v / BN);
      const bool ok = n0 + n < N;
      unsigned h, l;
      x3::split2(ok ? B[(i64)k * N + n0 + n] : 0.f, ok ? B[(i64)(k + 1) * N + n0 + n] : 0.f, h, l);
      const int w = wg::at(n, k, K) / 2;
      hw[w] = h;
      tw[w] = l;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // these writes, then wgmma's reads
    __syncthreads();
  };
  prime_ring<STAGES>(lq, nq, load_next);
  float acc[NT][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
  int panel_n = -1, ckt = 0, cst = 0;
  for (i64 q = 0; q < nq; ++q) {
    if (ckt == 0 && cw.n != panel_n) {  // block-uniform: every warpgroup walks the same tiles
      __syncthreads();                  // every wgmma on the old panel has completed (waited below)
      fill_panel(cw.n * BN);
      panel_n = cw.n;
    }
    cp_async_wait<STAGES - 2>();
    bar_sync(1 + wgi, 128);  // chunk q is in for the warpgroup; slot (q - 1) % STAGES is free
    if (lq < nq) load_next();
    cp_async_commit();
    // Column tile j's core matrices start j * 64 * K halves into the panel
    // (wg::at); tiles past N are skipped (block-uniform).
    const unsigned short* bh = panel + ckt * BK / 8 * 64;
    wg::SplitA<BK> sa;
    wg::split<BK, AK>(sa, ring + cst * SLOT, warp, lane);
    // Two tiles at a time under one wait, the last alone where NT is odd
    // or N ends inside the pair.
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      const unsigned sbo = (K / 8) * 128;
      const unsigned short* b0 = bh + j * 64 * K;
      const int j1 = j + 1 < NT ? j + 1 : j;
      if (j + 1 < NT && cw.n * BN + (j + 1) * 64 < N) {
        wg::tile2<BK>(acc[j], acc[j1], sa, b0, b0 + BN * K, b0 + 64 * K, b0 + (64 + BN) * K, sbo);
      } else if (j == 0 || cw.n * BN + j * 64 < N) {
        wg::tile<BK>(acc[j], sa, b0, b0 + BN * K, sbo);
      }
    }
    cst = cst + 1 == STAGES ? 0 : cst + 1;
    if (++ckt == KT) {
      const i64 e16 = cw.m * BM + wgi * 64 + warp * 16;
      // SG fragments' epilogue loads first, then their stores: all eight
      // where the register cap allows, else two at a time; one: each
      // fragment's loads after its shuffles, as a plain epilogue runs (at
      // 128 registers, the batch's order spills).
#pragma unroll
      for (int jt = 0; jt < NT; ++jt) {
        const int n0 = cw.n * BN + jt * 64;
        if (jt > 0 && n0 >= N) break;  // block-uniform
        float* c = acc[jt];
        if constexpr (SG == 1) {
#pragma unroll
          for (int j = 0; j < 8; ++j) x3::store_frag(c + 4 * j, e16, n0 + j * 8, lane, E, N, epi);
        } else {
          auto ep = as_staged(epi);
#pragma unroll
          for (int j0 = 0; j0 < 8; j0 += SG) {
            decltype(ep.load(e16, 0)) x[SG];
#pragma unroll
            for (int j = 0; j < SG; ++j) {
              i64 e;
              int n;
              x3::frag_at(e16, n0 + (j0 + j) * 8, lane, e, n);
              if (e < E && n < N) x[j] = ep.load(e, n);
            }
#pragma unroll
            for (int j = 0; j < SG; ++j) {
              auto st = [&](i64 e, int n, const float* v) { ep.store(e, n, v, x[j]); };
              x3::store_frag(c + 4 * (j0 + j), e16, n0 + (j0 + j) * 8, lane, E, N, st);
            }
          }
        }
      }
      ckt = 0;
      cw.step(dm, dn, ntn);
    }
  }
  cp_async_wait<0>();
#else
  __trap();  // built for sm_90a only (the spec's archs and the instance's target)
#endif
}

// The one-segment stages' GEMM: PIPE 0 -> gemm_block (register staged), 1 ->
// gemm_pipe (cp.async), 2 -> gemm_stream (persistent cp.async ring), and
// with PREC 1 (fp16x3) gemm_x3 on the stream walk or, PIPE 5, gemm_wg on
// Hopper's warpgroup MMA; A a plain surface
// (SurfaceA). The fused backward has its own walk, gemm_rowblock.
template <typename T, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S,
          typename AOp, typename Epi>
__device__ __forceinline__ void gemm(i64 E, int K, int N, const T* __restrict__ B, AOp& a, Epi epi) {
  if constexpr (PREC == 1 && PIPE == 5) {
    gemm_wg<BM, BN, BK, STAGES, S>(E, K, N, B, a, epi);
  } else if constexpr (PREC == 1) {
    static_assert(PIPE == 2 && TM == 8 && TN == 4, "fp16x3 tiles: pipe stream, tm 8, tn 4 (checked by the spec)");
    gemm_x3<BM, BN, BK, STAGES, S>(E, K, N, B, a, epi);
  } else if constexpr (PIPE == 2) {
    gemm_stream<T, BM, BN, BK, TM, TN, STAGES, S>(E, K, N, B, a, epi);
  } else {
    auto a_at = [&](int, i64 e, int k) { return a.row(e)[k]; };
    if constexpr (PIPE == 0) {
      gemm_block<T, BM, BN, BK, TM, TN, STAGES, S>(E, K, N, B, a_at, epi);
    } else {
      gemm_pipe<T, BM, BN, BK, TM, TN, STAGES, S>(E, K, N, B, a, epi);
    }
  }
}

}  // namespace ms
