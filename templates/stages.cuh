// One device function per stage of specs/stages.yaml. Instance files call
// exactly one of these with their tile and shared-memory layout (computed
// in Rust: crates/gen/src/layout.rs). Arguments follow docs/KERNELS.md.
#pragma once
#include "core.cuh"

namespace ms {

// Per-LG shared buffer `slot` of ROWS rows: after the fixed part.
template <typename T, typename S, int ROWS>
__device__ __forceinline__ T* per_lg_rows(int slot, int LG) {
  return smem_at<T>(S::fixed) + (i64)slot * ROWS * LG;
}

// Rows e0.. of a (E x N) surface to and from shared memory, 16 bytes at a
// time (N a multiple of the vector width); rows past E read as zero.
template <typename T, int ROWS, int THREADS>
__device__ __forceinline__ void store_rows(T* dst, const T* sh, i64 e0, i64 E, int N) {
  constexpr int W = Vec<T>::W;
  const DivBy nv(N / W);
  for (int idx = threadIdx.x; idx < ROWS * nv.d; idx += THREADS) {
    if (e0 + nv.div(idx) < E) Vec<T>::store(dst + e0 * N + (i64)idx * W, sh + idx * W);
  }
}
template <typename T, int ROWS, int THREADS>
__device__ __forceinline__ void load_rows(T* sh, const T* src, i64 e0, i64 E, int N) {
  constexpr int W = Vec<T>::W;
  const DivBy nv(N / W);
  batched<THREADS, 4>(
      ROWS * nv.d,
      [&](int idx) {
        Regs<T, W> x{};
        if (e0 + nv.div(idx) < E) Vec<T>::ldg(src + e0 * N + (i64)idx * W, x.v);
        return x;
      },
      [&](int idx, const Regs<T, W>& x) {
#pragma unroll
        for (int w = 0; w < W; ++w) sh[idx * W + w] = x.v[w];
      });
}

// --------------------------------------------------------- GEMM operands
// The A operand of a one-segment GEMM stage (core.cuh: gemm): a plain
// surface, row e at base + e * ld. (The fused backward's is GzRows.)
template <typename T>
struct SurfaceA {
  const T* base;
  i64 ld;
  __device__ __forceinline__ const T* row(i64 e) const { return base + e * ld; }
  __device__ __forceinline__ int stride() const { return (int)ld; }
};

// alpha[i] where applied, else exactly 1 (x * 1 == x bit for bit, no FTZ).
// Branch-free, so a GEMM epilogue issues every row's loads before the first
// use: with a branch per row the compiler kept one row's loads in flight at
// a time (fwd_final and bwd_final SASS). alpha is an (E, F) buffer whether
// applied or not (the API's contract; the safe and C entry points check its
// length, the raw ones document it), so the load is in bounds either way.
template <typename T>
__device__ __forceinline__ T alpha_or_one(const T* __restrict__ alpha, i64 i, int apply_alpha) {
  const T a = __ldg(alpha + i);
  return apply_alpha ? a : T(1);
}

// Epilogue helpers: W consecutive columns at once (16-byte accesses).
template <typename T>
__device__ __forceinline__ void store_residual(T* out, const T* r, const T* v) {
  constexpr int W = Vec<T>::W;
  T x[W];
  Vec<T>::ldg(r, x);
#pragma unroll
  for (int w = 0; w < W; ++w) x[w] = op_residual<T>(x[w], v[w]);
  Vec<T>::store(out, x);
}

// ----------------------------------------------------------------- forward

template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void fwd_m0(const T* __restrict__ u, const T* __restrict__ w0,
                                       T* __restrict__ z, i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const T* uf = u + (i64)f * E * d.ROW;
  T* zf = z + (i64)f * E * d.ROW;
  SurfaceA<T> a{uf, d.ROW};
  gemm<T, BM, BN, BK, TM, TN, STAGES, PIPE, PREC, S>(
      E, d.M0, d.M0, w0 + (i64)f * d.M0 * d.M0, a,
      [&](i64 e, int n, const T* v) { Vec<T>::store(zf + e * d.ROW + n, v); });
}

// u_next[:, :M0] = u + [silu(s) | z0[:, Cf:] * sig] for the rows e0.. of the
// focus whose first row is at `base`: s from s_sh (rows of Cf), the gate row
// of row m at sig_row(m). Items [0, NS) are the scalar subtile's vectors,
// the rest the gated ones, so a warp (NS is a multiple of 32 at Cf 32 and
// up) runs one branch: with items taken row by row a warp held both kinds
// and ran silu (four exact sigmoids) and the gate product one after the
// other on every element (SASS of fwd_gate, BENCH.md run 53). One loop, so
// each thread keeps U items' loads in flight across both kinds (two loops
// added a round trip per block and were slower, run 54).
template <typename T, int CF, int ROWS, int THREADS, typename SigRow>
__device__ __forceinline__ void gate_residual_rows(const T* __restrict__ u, const T* __restrict__ z,
                                                   const T* s_sh, SigRow sig_row, T* __restrict__ u_next,
                                                   i64 base, i64 e0, i64 E, int L) {
  const Dims d = dims<CF>(L);
  constexpr int W = Vec<T>::W, SV = CF / W, NS = ROWS * SV;
  // Gated subtiles 1..L are the gate groups 0..L-1 in order: column CF + c
  // of a row sits at sig_row(m)[c].
  const DivBy gv(d.LG / W);
  // Item idx: its row m and column col (scalar: col < CF).
  auto at = [&](int idx, int& m, int& col) {
    if (idx < NS) {
      m = idx / SV;
      col = (idx - m * SV) * W;
    } else {
      m = gv.div(idx - NS);
      col = CF + (idx - NS - m * gv.d) * W;
    }
  };
  batched<THREADS, 4>(
      NS + ROWS * gv.d,
      [&](int idx) {
        int m, col;
        at(idx, m, col);
        const i64 i = base + (e0 + m) * d.ROW + col;
        Regs<T, 2 * W> x{};
        if (e0 + m < E) {
          Vec<T>::ldg(u + i, x.v);
          if (idx >= NS) Vec<T>::ldg(z + i, x.v + W);
        }
        return x;
      },
      [&](int idx, const Regs<T, 2 * W>& x) {
        int m, col;
        at(idx, m, col);
        if (e0 + m >= E) return;
        T y[W];
        if (idx < NS) {
#pragma unroll
          for (int w = 0; w < W; ++w) y[w] = op_residual<T>(x.v[w], op_silu<T>(s_sh[m * CF + col + w]));
        } else {
          const T* sg = sig_row(m) + col - CF;
#pragma unroll
          for (int w = 0; w < W; ++w) y[w] = op_residual<T>(x.v[w], op_gate<T>(x.v[W + w], sg[w]));
        }
        Vec<T>::store(u_next + base + (e0 + m) * d.ROW + col, y);
      });
}

// sig = sigmoid(s @ GW); u_next[:, :M0] = u + [silu(s) | z0[:, Cf:] * sig].
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void fwd_gate(const T* __restrict__ u, const T* __restrict__ z,
                                         const T* __restrict__ gw, T* __restrict__ sig,
                                         T* __restrict__ u_next, i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 e0 = (i64)blockIdx.x * ROWS;
  const i64 base = (i64)f * E * d.ROW;
  T* s_sh = smem_at<T>(S::s_rows);
  T* sig_sh = per_lg_rows<T, S, ROWS>(S::sig_slot, d.LG);
  load_scalar_rows<T, CF, ROWS, THREADS>(s_sh, z + base, e0, E, d.ROW);
  __syncthreads();
  compute_sig_rows<T, CF, ROWS, THREADS>(sig_sh, s_sh, gw + (i64)f * CF * d.LG, d.LG);
  __syncthreads();
  store_rows<T, ROWS, THREADS>(sig + (i64)f * E * d.LG, sig_sh, e0, E, d.LG);
  gate_residual_rows<T, CF, ROWS, THREADS>(u, z, s_sh, [&](int m) { return sig_sh + m * d.LG; }, u_next, base, e0,
                                           E, L);
}

// ------------------------------------------- gate GEMMs by cuBLAS (Cf >= 96)
// Where the runtime runs the gate contractions as cuBLAS GEMMs (src/runtime/
// gate_blas.rs says where and why), these stages do the rest of fwd_gate
// and bwd_pointwise. `logit` holds s @ GW (F, E, LG) as cuBLAS wrote it.

// sig rows of block rows e0.. from logit rows (plain loads: fwd_gate_act
// writes sig over logit).
template <typename T, int ROWS, int THREADS>
__device__ __forceinline__ void sig_from_logit_rows(T* sig_sh, const T* logit, i64 e0, i64 E, int LG) {
  constexpr int W = Vec<T>::W;
  const DivBy nv(LG / W);
  for (int idx = threadIdx.x; idx < ROWS * nv.d; idx += THREADS) {
    T x[W] = {};
    if (e0 + nv.div(idx) < E) Vec<T>::load(logit + e0 * LG + (i64)idx * W, x);
#pragma unroll
    for (int w = 0; w < W; ++w) sig_sh[idx * W + w] = op_sigmoid<T>(x[w]);
  }
}

// fwd_gate after a cuBLAS projection: sig = sigmoid(logit), in place;
// u_next[:, :M0] = u + [silu(s) | z0[:, Cf:] * sig].
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void fwd_gate_act(const T* __restrict__ u, const T* __restrict__ z, T* sig,
                                             T* __restrict__ u_next, i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 e0 = (i64)blockIdx.x * ROWS;
  const i64 base = (i64)f * E * d.ROW;
  T* s_sh = smem_at<T>(S::s_rows);
  T* sig_sh = per_lg_rows<T, S, ROWS>(S::sig_slot, d.LG);
  T* sigf = sig + (i64)f * E * d.LG;
  load_scalar_rows<T, CF, ROWS, THREADS>(s_sh, z + base, e0, E, d.ROW);
  sig_from_logit_rows<T, ROWS, THREADS>(sig_sh, sigf, e0, E, d.LG);
  __syncthreads();
  store_rows<T, ROWS, THREADS>(sigf, sig_sh, e0, E, d.LG);
  gate_residual_rows<T, CF, ROWS, THREADS>(u, z, s_sh, [&](int m) { return sig_sh + m * d.LG; }, u_next, base, e0,
                                           E, L);
}

// bwd_pointwise after a cuBLAS projection, before a cuBLAS contraction: gz of
// the gated subtiles, gz[:, :Cf] = g_s * silu'(s) (the contraction adds
// g_logit @ GW^T to it), and g_logit to memory.
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void bwd_glogit(const T* __restrict__ g, const T* __restrict__ z,
                                           const T* __restrict__ logit, T* __restrict__ glog,
                                           T* __restrict__ gz, i64 E, int L) {
  const Dims d = dims<CF>(L);
  constexpr int W = Vec<T>::W;
  const int f = blockIdx.z;
  const i64 e0 = (i64)blockIdx.x * ROWS;
  const i64 base = (i64)f * E * d.ROW;
  const T* gf = g + base;
  const T* zf = z + base;
  T* gzf = gz + base;
  T* sig_sh = per_lg_rows<T, S, ROWS>(S::sig_slot, d.LG);
  T* glog_sh = per_lg_rows<T, S, ROWS>(S::glog_slot, d.LG);
  sig_from_logit_rows<T, ROWS, THREADS>(sig_sh, logit + (i64)f * E * d.LG, e0, E, d.LG);
  __syncthreads();
  compute_glogit_rows<T, CF, ROWS, THREADS>(glog_sh, sig_sh, gf, zf, e0, E, L, d.LG, d.ROW,
                                            [&](int m, int col, const T* gv) {
                                              T y[W];
#pragma unroll
                                              for (int w = 0; w < W; ++w)
                                                y[w] = gz_of<T, CF>(gv[w], sig_sh + m * d.LG, nullptr, L, col + w);
                                              Vec<T>::store(gzf + (e0 + m) * d.ROW + col, y);
                                            });
  batched<THREADS, 4>(
      ROWS * CF / W,
      [&](int idx) {
        const int m = idx / (CF / W), j = (idx - m * (CF / W)) * W;
        Regs<T, 2 * W> x{};
        if (e0 + m < E) {
          Vec<T>::ldg(gf + (e0 + m) * d.ROW + j, x.v);
          Vec<T>::ldg(zf + (e0 + m) * d.ROW + j, x.v + W);
        }
        return x;
      },
      [&](int idx, const Regs<T, 2 * W>& x) {
        const int m = idx / (CF / W), j = (idx - m * (CF / W)) * W;
        if (e0 + m >= E) return;
        T y[W];
#pragma unroll
        for (int w = 0; w < W; ++w) y[w] = op_dsilu_mul<T>(x.v[w], x.v[W + w]);
        Vec<T>::store(gzf + (e0 + m) * d.ROW + j, y);
      });
  __syncthreads();
  store_rows<T, ROWS, THREADS>(glog + (i64)f * E * d.LG, glog_sh, e0, E, d.LG);
}

// z1 = u[:, M0:] @ W1; u_next[:, M0:] = u + z1 * [sig, sig].
template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void fwd_m1(const T* __restrict__ u, const T* __restrict__ w1,
                                       const T* __restrict__ sig, T* __restrict__ z,
                                       T* __restrict__ u_next, i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 base = (i64)f * E * d.ROW;
  const T* uf = u + base;
  const T* sigf = sig + (i64)f * E * d.LG;
  SurfaceA<T> a{uf + d.M0, d.ROW};
  constexpr int W = Vec<T>::W;
  using X = Regs<T, 2 * W>;  // u, then the gates
  gemm<T, BM, BN, BK, TM, TN, STAGES, PIPE, PREC, S>(
      E, d.M1, d.M1, w1 + (i64)f * d.M1 * d.M1, a,
      staged(
          [&](i64 e, int n) {
            const int r = n / CF, gr = r < L ? r : r - L, ch = n - r * CF;  // W columns: one subtile
            X x;
            Vec<T>::ldg(u + base + e * d.ROW + d.M0 + n, x.v);
            Vec<T>::ldg(sigf + e * d.LG + gr * CF + ch, x.v + W);
            return x;
          },
          [&](i64 e, int n, const T* v, const X& x) {
            const i64 at = base + e * d.ROW + d.M0 + n;
            T y[W];
            Vec<T>::store(z + at, v);
#pragma unroll
            for (int w = 0; w < W; ++w) y[w] = op_residual<T>(x.v[w], op_gate<T>(v[w], x.v[W + w]));
            Vec<T>::store(u_next + at, y);
          }));
}

// Identity layer: out[e, f, seg] = (u + u_seg @ W_seg) * alpha, edge-major.
template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void fwd_final(const T* __restrict__ u, const T* __restrict__ w,
                                          const T* __restrict__ alpha, T* __restrict__ out,
                                          i64 E, int L, int seg, int apply_alpha) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z, F = gridDim.z;
  const int off = seg ? d.M0 : 0, K = seg ? d.M1 : d.M0;
  const T* uf = u + (i64)f * E * d.ROW + off;
  SurfaceA<T> a{uf, d.ROW};
  constexpr int W = Vec<T>::W;
  using X = Regs<T, W + 1>;  // u, then alpha (or 1)
  gemm<T, BM, BN, BK, TM, TN, STAGES, PIPE, PREC, S>(
      E, K, K, w + (i64)f * K * K, a,
      staged(
          [&](i64 e, int n) {
            X x;
            Vec<T>::ldg(uf + e * d.ROW + n, x.v);
            x.v[W] = alpha_or_one(alpha, e * F + f, apply_alpha);
            return x;
          },
          [&](i64 e, int n, const T* v, const X& x) {
            T y[W];
#pragma unroll
            for (int i = 0; i < W; ++i) y[i] = op_alpha_scale<T>(op_residual<T>(x.v[i], v[i]), x.v[W]);
            Vec<T>::store(out + (e * F + f) * d.ROW + off + n, y);
          }));
}

// ---------------------------------------------------------------- backward

// grad_alpha[e, f] = sum_cols(grad_out * out) / max(alpha, eps): one warp per
// (e, f) row. grad_out, out and alpha are edge-major, so the rows of the
// whole grid are taken in memory order (block (x, f) holds flat rows
// (f * gridDim.x + x) * ROWS ..), each block reading one contiguous stretch.
// A lane sums 16-byte vectors c = lane, lane + 32, .. (its first U loads
// issued before any is used), then the warp reduces by xor shuffle: a fixed
// order, whatever the tile.
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void bwd_grad_alpha(const T* __restrict__ grad_out,
                                               const T* __restrict__ out,
                                               const T* __restrict__ alpha,
                                               T* __restrict__ grad_alpha, i64 E, int L) {
  constexpr int W = Vec<T>::W, U = 4;
  const Dims d = dims<CF>(L);
  const i64 rows = E * gridDim.z;
  const int NV = d.ROW / W;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m = warp; m < ROWS; m += THREADS / 32) {
    const i64 r = ((i64)blockIdx.z * gridDim.x + blockIdx.x) * ROWS + m;
    if (r >= rows) break;
    const T* go = grad_out + r * d.ROW;
    const T* ov = out + r * d.ROW;
    T acc = T(0);
    for (int c0 = lane; c0 < NV; c0 += 32 * U) {
      T x[U][W], y[U][W];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < NV) {
          Vec<T>::ldg(go + (c0 + 32 * u) * W, x[u]);
          Vec<T>::ldg(ov + (c0 + 32 * u) * W, y[u]);
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < NV) {
#pragma unroll
          for (int w = 0; w < W; ++w) acc = op_dot_step<T>(x[u][w], y[u][w], acc);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = op_residual<T>(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane == 0) grad_alpha[r] = op_grad_alpha_finish<T>(acc, alpha[r]);
  }
}

// Final identity layer: g[f, e, seg] = ga + ga_seg @ W_seg^T, ga = grad_out
// * alpha (grad_out edge-major, g focus-major). alpha is one scalar per row,
// so it scales the product and the residual in the epilogue: the A operand is
// grad_out as it lies and the K loop has no fix pass (a per-chunk scaling
// pass cost this stage ~0.8 ms of 5 at the seed workload, BENCH.md run 25).
template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void bwd_final(const T* __restrict__ grad_out,
                                          const T* __restrict__ alpha, const T* __restrict__ wt,
                                          T* __restrict__ g, i64 E, int L, int seg,
                                          int apply_alpha) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z, F = gridDim.z;
  const int off = seg ? d.M0 : 0, K = seg ? d.M1 : d.M0;
  SurfaceA<T> a{grad_out + (i64)f * d.ROW + off, (i64)F * d.ROW};
  T* gf = g + (i64)f * E * d.ROW + off;
  constexpr int W = Vec<T>::W;
  using X = Regs<T, W + 1>;  // grad_out, then alpha (or 1)
  gemm<T, BM, BN, BK, TM, TN, STAGES, PIPE, PREC, S>(
      E, K, K, wt + (i64)f * K * K, a,
      staged(
          [&](i64 e, int n) {
            X x;
            Vec<T>::ldg(a.row(e) + n, x.v);
            x.v[W] = alpha_or_one(alpha, e * F + f, apply_alpha);
            return x;
          },
          [&](i64 e, int n, const T* v, const X& x) {
            T y[W];
#pragma unroll
            for (int i = 0; i < W; ++i)
              y[i] = op_residual<T>(op_alpha_scale<T>(x.v[i], x.v[W]), op_alpha_scale<T>(v[i], x.v[W]));
            Vec<T>::store(gf + e * d.ROW + n, y);
          }));
}

// Relay 1/3: sig = sigmoid(s @ GW) to memory.
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void bwd_recompute(const T* __restrict__ z, const T* __restrict__ gw,
                                              T* __restrict__ sig, i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 e0 = (i64)blockIdx.x * ROWS;
  T* s_sh = smem_at<T>(S::s_rows);
  T* sig_sh = per_lg_rows<T, S, ROWS>(S::sig_slot, d.LG);
  load_scalar_rows<T, CF, ROWS, THREADS>(s_sh, z + (i64)f * E * d.ROW, e0, E, d.ROW);
  __syncthreads();
  compute_sig_rows<T, CF, ROWS, THREADS>(sig_sh, s_sh, gw + (i64)f * CF * d.LG, d.LG);
  __syncthreads();
  store_rows<T, ROWS, THREADS>(sig + (i64)f * E * d.LG, sig_sh, e0, E, d.LG);
}

// Relay 2/3: gz from g, z and sig (scalar chain folded in) to memory. Each
// value of g is read once: gz of the gated subtiles leaves with the
// gate-logit pass that loaded their g; the scalar subtile's gz is the scalar
// chain (gz_of's first case), stored as the chain's contraction finishes.
template <typename T, int CF, int ROWS, int THREADS, typename S>
__device__ __forceinline__ void bwd_pointwise(const T* __restrict__ g, const T* __restrict__ z,
                                              const T* __restrict__ sig,
                                              const T* __restrict__ gwt, T* __restrict__ gz,
                                              i64 E, int L) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 e0 = (i64)blockIdx.x * ROWS;
  const i64 base = (i64)f * E * d.ROW;
  const T* gf = g + base;
  const T* zf = z + base;
  T* gzf = gz + base;
  const T* sigf = sig + (i64)f * E * d.LG;
  T* sig_sh = per_lg_rows<T, S, ROWS>(S::sig_slot, d.LG);
  T* glog_sh = per_lg_rows<T, S, ROWS>(S::glog_slot, d.LG);
  load_rows<T, ROWS, THREADS>(sig_sh, sigf, e0, E, d.LG);
  __syncthreads();
  compute_glogit_rows<T, CF, ROWS, THREADS>(glog_sh, sig_sh, gf, zf, e0, E, L, d.LG, d.ROW,
                                            [&](int m, int col, const T* gv) {
                                              constexpr int W = Vec<T>::W;
                                              T y[W];
#pragma unroll
                                              for (int w = 0; w < W; ++w)
                                                y[w] = gz_of<T, CF>(gv[w], sig_sh + m * d.LG, nullptr, L, col + w);
                                              Vec<T>::store(gzf + (e0 + m) * d.ROW + col, y);
                                            });
  __syncthreads();
  compute_gzs_rows<T, CF, ROWS, THREADS>(
      [&](int m, int j, T v) {
        if (e0 + m < E) gzf[(e0 + m) * d.ROW + j] = v;
      },
      [&](int, i64 e, int j) { return zf[e * d.ROW + j]; }, glog_sh, gwt + (i64)f * d.LG * CF, gf, e0, E, d.LG,
      d.ROW);
}

// Relay 3/3: g_next[seg] = g[seg] + gz_seg @ W_seg^T.
template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void bwd_gemm(const T* __restrict__ gz, const T* __restrict__ g,
                                         const T* __restrict__ wt, T* __restrict__ g_next,
                                         i64 E, int L, int seg) {
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const int off = seg ? d.M0 : 0, K = seg ? d.M1 : d.M0;
  const i64 base = (i64)f * E * d.ROW + off;
  SurfaceA<T> a{gz + base, d.ROW};
  constexpr int W = Vec<T>::W;
  using X = Regs<T, W>;  // the residual g
  gemm<T, BM, BN, BK, TM, TN, STAGES, PIPE, PREC, S>(
      E, K, K, wt + (i64)f * K * K, a,
      staged(
          [&](i64 e, int n) {
            X x;
            Vec<T>::ldg(g + base + e * d.ROW + n, x.v);
            return x;
          },
          [&](i64 e, int n, const T* v, const X& x) {
            T y[W];
#pragma unroll
            for (int w = 0; w < W; ++w) y[w] = op_residual<T>(x.v[w], v[w]);
            Vec<T>::store(g_next + base + e * d.ROW + n, y);
          }));
}

// Both fused A operands' per-row work: what the relay's recompute and
// pointwise kernels compute for rows e0.., with their own functions. s
// (the scalar slice of z), sig = sigmoid(s @ GW), then g_logit GB rows at a
// time (a GB x LG buffer, not BM x LG: what lets more blocks share an SM)
// and the scalar chain gz_s over s's buffer (each element read as z's
// scalar slice, then overwritten with gz_s, by one thread); sync() between
// phases.
template <typename T, int CF, int BM, int THREADS, typename S>
struct RowWork {
  // Rows of the g_logit buffer (crates/gen/src/layout.rs: GLOG_SUB_ROWS).
  static constexpr int GB = S::glog_rows;
  static_assert(GB > 0 && BM % GB == 0, "whole g_logit sub-blocks");
  const T* gf;
  const T* zf;
  const T* gwf;
  const T* gwtf;
  i64 E;
  int L, LG, ROW;
  template <typename Sync>
  __device__ __forceinline__ void per_row(i64 e0, T* s, T* sig, T* glog, Sync sync) const {
    // The rows this block takes next (persistent walk): g and z into L2 now,
    // so that their per-row work finds them there, not in DRAM (that work
    // runs between barriers, one latency per phase).
    const i64 next = e0 + (i64)gridDim.x * BM;
    if (threadIdx.x == 0 && next < E) {
      const unsigned bytes = (unsigned)((E - next < BM ? E - next : BM) * ROW * sizeof(T));
      prefetch_l2(gf + next * ROW, bytes);
      prefetch_l2(zf + next * ROW, bytes);
    }
    load_scalar_rows<T, CF, BM, THREADS>(s, zf, e0, E, ROW);
    sync();
    compute_sig_rows<T, CF, BM, THREADS>(sig, s, gwf, LG);
    sync();
    for (int r0 = 0; r0 < BM; r0 += GB) {
      compute_glogit_rows<T, CF, GB, THREADS>(glog, sig + r0 * LG, gf, zf, e0 + r0, E, L, LG, ROW);
      sync();
      // gz_s over s in place: each (m, j) is read, then written, by one thread.
      const T* zs = s + r0 * CF;
      compute_gzs_rows<T, CF, GB, THREADS>([&](int m, int j, T v) { s[(r0 + m) * CF + j] = v; },
                                           [&](int m, i64, int j) { return zs[m * CF + j]; }, glog, gwtf, gf, e0 + r0,
                                           E, LG, ROW);
      sync();
    }
  }
};

// The fused backward's A operand with pipe: stream or split: gz, formed
// chunk by chunk from the landed g chunk (gemm_rowblock's form_own, from
// chunk()), never stored. Its per-row work (s, sig, g_logit, gz_s) runs once
// per row block: with pipe: stream the whole block runs it at the row
// block's first chunk (tile(); one per-row buffer set: the block keeps BM x
// (L*Cf + Cf) + GB x L*Cf values besides its ring, so four 64-row blocks
// share an SM at the seed's shapes); with pipe: split the THREADS producer
// threads run it (produce()) into one of two buffer sets (slots), a row
// block ahead of the GEMM's threads.
template <typename T, int CF, int BM, int THREADS, typename S>
struct GzRows : RowWork<T, CF, BM, THREADS, S> {
  // Slot's s / gz_s and sig buffers: pointers for the per-row work, element
  // offsets into shared memory for chunk() (offsets, not pointers: see
  // ChunkGz). Two forms of one placement: the pointer form keeps the
  // constant offsets folded into the per-row work's loads (one add more per
  // row block, and other register counts, with the offset form).
  __device__ __forceinline__ T* s_sh(int slot) const { return smem_at<T>(S::s_rows) + slot * BM * CF; }
  __device__ __forceinline__ T* sig_sh(int slot) const {
    return per_lg_rows<T, S, BM>(S::sig_slot + slot, this->LG);
  }
  __device__ __forceinline__ int s_off(int slot) const { return (int)(S::s_rows / sizeof(T)) + slot * BM * CF; }
  __device__ __forceinline__ int sig_off(int slot) const {
    return (int)(S::fixed / sizeof(T)) + (S::sig_slot + slot) * BM * this->LG;
  }
  __device__ __forceinline__ const T* row(i64 e) const { return this->gf + e * this->ROW; }
  __device__ __forceinline__ int stride() const { return this->ROW; }
  template <typename Sync>
  __device__ __forceinline__ void produce(i64 e0, int slot, Sync sync) const {
    this->per_row(e0, s_sh(slot), sig_sh(slot), per_lg_rows<T, S, BM>(S::glog_slot, this->LG), sync);
  }
  __device__ __forceinline__ void tile(i64 e0) const {
    produce(e0, 0, [] { __syncthreads(); });
  }
  // Subtile 0 is the scalar chain, formed whole by the per-row work: its g
  // is never copied into the ring.
  __device__ __forceinline__ bool computed(int col) const { return col < CF; }
  // The chunk at column c0 (one subtile, Cf % BK == 0) of slot's buffers:
  // its gz_s, or its group's gates (gate_at: consecutive columns,
  // consecutive gates), as shared-memory offsets.
  __device__ __forceinline__ ChunkGz<T> chunk(int c0, int slot) const {
    if (c0 < CF) return ChunkGz<T>{s_off(slot) + c0, CF, true};
    return ChunkGz<T>{sig_off(slot) + gate_col<CF>(this->L, c0), this->LG, false};
  }
};

// The warp-specialised fused backward's A operand (pipe: ws): the whole row
// block's gz as a panel in shared memory (rows ROW + W apart), formed by the
// producer warps with the relay's own functions, as GzRows forms it: s, sig
// and g_logit (GB rows at a time) and the scalar chain gz_s into s's buffer,
// then each segment's gz (gz_s copied, g * gate elsewhere). Shared memory
// (crates/gen/src/layout.rs): the B ring and s, then the panel, sig (BM x
// LG) and the g_logit rows.
template <typename T, int CF, int BM, int P, typename S>
struct GzPanel : RowWork<T, CF, BM, P, S> {
  static constexpr int W = Vec<T>::W;
  __device__ __forceinline__ int panel_stride() const { return this->ROW + W; }
  __device__ __forceinline__ T* panel() const { return smem_at<T>(S::panel); }
  __device__ __forceinline__ T* sig() const { return panel() + BM * panel_stride(); }
  __device__ __forceinline__ T* glog() const { return sig() + BM * this->LG; }
  __device__ __forceinline__ T* s() const { return smem_at<T>(S::s_rows); }
  // The per-row work of rows e0.. (producers only: sync is theirs).
  template <typename Sync>
  __device__ __forceinline__ void prologue(i64 e0, Sync sync) const {
    this->per_row(e0, s(), sig(), glog(), sync);
  }
  // gz of segment seg's columns of rows e0.. into the panel (rows past E
  // zero). g comes straight into the panel by cp.async (every piece of a
  // thread in flight at once, no registers: four producer warps loading
  // through registers were the bottleneck, BENCH.md run 79), then each
  // thread gates the pieces it copied, in place. Segment 0 starts with the
  // scalar subtile: gz_s as formed.
  __device__ __forceinline__ void fill(int seg, i64 e0) const {
    const int L = this->L, LG = this->LG, ROW = this->ROW;
    const i64 E = this->E;
    const T* gf = this->gf;
    T* pn = panel();
    const int ps = panel_stride();
    const int c0 = seg ? (L + 1) * CF : CF, nv = (seg ? 2 * LG : LG) / W;
    const DivBy dv(nv);
    auto each = [&](auto f) {
      for (int idx = threadIdx.x; idx < BM * nv; idx += P) {
        const int m = dv.div(idx);
        f(m, c0 + (idx - m * nv) * W);
      }
    };
    each([&](int m, int c) {
      const bool in = e0 + m < E;  // past E: zero fill from a valid address
      cp_async16(pn + m * ps + c, in ? gf + (e0 + m) * ROW + c : gf, in ? 16 : 0);
    });
    cp_async_commit();
    if (seg == 0) {
      for (int idx = threadIdx.x; idx < BM * CF / W; idx += P) {
        const int m = idx / (CF / W), j = (idx - m * (CF / W)) * W;
        T x[W];
        Vec<T>::load(s() + m * CF + j, x);
        Vec<T>::store(pn + m * ps + j, x);
      }
    }
    cp_async_wait<0>();  // this thread's pieces have landed
    const T* sg = sig();
    each([&](int m, int c) {
      const T* gate = gate_at<CF>(sg + m * LG, L, c);
      T x[W];
      Vec<T>::load(pn + m * ps + c, x);
#pragma unroll
      for (int w = 0; w < W; ++w) x[w] = op_gate<T>(x[w], gate[w]);
      Vec<T>::store(pn + m * ps + c, x);
    });
  }
};

// Fused: one gated layer, g_next = g + [gz_m0 @ W0^T | gz_m1 @ W1^T]; both
// segments of a row block in one block. pipe: stream -> gz formed per chunk
// from GzRows (gemm_rowblock; wgmma: the same walk, its fp16x3 products on
// wgmma); pipe: split -> the same, the per-row work on producer warps
// (gemm_rowblock with P producers; split_wgmma: its products on wgmma);
// pipe: ws -> from the producers' panel (GzPanel, gemm_ws).
template <typename T, int CF, int BM, int BN, int BK, int TM, int TN, int STAGES, int PIPE, int PREC, typename S>
__device__ __forceinline__ void bwd_fused(const T* __restrict__ g, const T* __restrict__ z,
                                          const T* __restrict__ gw, const T* __restrict__ gwt,
                                          const T* __restrict__ wt0, const T* __restrict__ wt1,
                                          T* __restrict__ g_next, i64 E, int L) {
  static_assert(PIPE >= 2 && PIPE <= 6, "the fused backward streams (pipe: stream, ws, split, wgmma or split_wgmma)");
  static_assert(CF % BK == 0, "a K chunk lies in one subtile");
  static_assert(PREC == 0 || PIPE != 3, "fp16x3 fused tiles walk rows (pipe: stream, split, wgmma or split_wgmma), not the ws panel");
  const Dims d = dims<CF>(L);
  const int f = blockIdx.z;
  const i64 base = (i64)f * E * d.ROW;
  const Seg<T> seg0{wt0 + (i64)f * d.M0 * d.M0, d.M0, 0}, seg1{wt1 + (i64)f * d.M1 * d.M1, d.M1, d.M0};
  auto epi = [&](i64 e, int n, const T* v) {
    const i64 at = base + e * d.ROW + n;
    store_residual<T>(g_next + at, g + at, v);
  };
  if constexpr (PIPE == 3) {
    GzPanel<T, CF, BM, S::producers, S> a{
        {g + base, z + base, gw + (i64)f * CF * d.LG, gwt + (i64)f * d.LG * CF, E, L, d.LG, d.ROW}};
    gemm_ws<T, BM, BN, BK, TM, TN, STAGES, S::producers, S>(E, seg0, seg1, a, epi);
  } else {
    // The per-row work's threads: the producers (split) or the whole block.
    constexpr int P = PIPE == 4 || PIPE == 6 ? S::producers : 0, ROW_THREADS = P ? P : (BM / TM) * (BN / TN);
    GzRows<T, CF, BM, ROW_THREADS, S> a{
        {g + base, z + base, gw + (i64)f * CF * d.LG, gwt + (i64)f * d.LG * CF, E, L, d.LG, d.ROW}};
    gemm_rowblock<T, BM, BN, BK, TM, TN, STAGES, S, P, PREC, PIPE == 5 || PIPE == 6>(E, seg0, seg1, a, epi);
  }
}

}  // namespace ms
