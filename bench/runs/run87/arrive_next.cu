// racecheck on the named-barrier handover of gemm_ws: producers (threads
// 0..127) store, bar.arrive 3; consumers (128..255) bar.sync 3, load.
//   0: arrive/sync   1: sync/sync   2: no barrier (must report)
//   3: 0 + producers-only bar.sync 1,128 before the stores, consumers-only
//      bar.sync 2,128 after the wait (as gemm_ws)
//   4: 0 with the consumers' wait under a uniform runtime condition
//   5: 0 with the stores gating cp.async'd data in place (as GzPanel::fill)
//   6: 3 + 4 + 5
//   7: two segments, as gemm_ws hands the panel over: producers store
//      segment 0, bar.arrive 3, store segment 1, bar.arrive 4, exit;
//      consumers bar.sync 3, load segment 0, bar.sync 4, load segment 1
//   8: 7 with the consumers' barrier id in a register (WS_FULL + cw.s)
//   9: 8 + 3 + 5 (run 88: 0-6 clean, 2 reports; these are what is left of
//      the differences from the ws kernels, BENCH.md runs 88-89; run 90:
//      7 and 8 clean, 9 reports 3 hazards)
//  10: 8 + 5 (no producers-/consumers-only barriers)
//  11: 8 + 3 (no cp.async)
//  12: 7 + 5 (immediate barrier ids, cp.async in place). Run 97: 2
//      hazards (10: 4, 11: none): the two-segment handover of cp.async'd
//      data rewritten in place is reported whatever names the barriers.
#include <cstdio>
#include <cstdlib>
__device__ __forceinline__ void bar_sync_r(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
// Modes 7-9: buf[0, 256) is segment 0, buf[256, 512) segment 1.
__device__ void two_segments(int mode, const float* in, float* out, int seg_id) {
  __shared__ __align__(16) float buf[512];
  const int t = threadIdx.x;
  const bool pair = mode == 9 || mode == 11, async = mode == 9 || mode == 10 || mode == 12, reg = mode >= 8 && mode != 12;
  if (t < 128) {
    if (pair) asm volatile("bar.sync 1, 128;" ::: "memory");
    for (int s = 0; s < 2; ++s) {
      float* seg = buf + 256 * s;
      if (async && t < 64) {
        unsigned d = (unsigned)__cvta_generic_to_shared(seg + 4 * t);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(in + 4 * t) : "memory");
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 0;\n" ::);
        float4 v = *reinterpret_cast<float4*>(seg + 4 * t);
        v.x *= 2.f; v.y *= 2.f; v.z *= 2.f; v.w *= 2.f;
        *reinterpret_cast<float4*>(seg + 4 * t) = v;
      } else {
        seg[t] = t * 2.0f;
        seg[t + 128] = t * 3.0f;
      }
      if (s == 0) asm volatile("bar.arrive 3, 256;" ::: "memory");
      else asm volatile("bar.arrive 4, 256;" ::: "memory");
    }
    return;
  }
  float acc = 0.f;
  for (int s = 0; s < 2; ++s) {
    if (reg) bar_sync_r(seg_id + s, 256);
    else if (s == 0) asm volatile("bar.sync 3, 256;" ::: "memory");
    else asm volatile("bar.sync 4, 256;" ::: "memory");
    if (pair) asm volatile("bar.sync 2, 128;" ::: "memory");
    acc += buf[256 * s + (4 * (t - 128) + 5) % 256];
  }
  out[t - 128] = acc;
}

__global__ void k(int mode, const float* in, float* out, int flag) {
  if (mode >= 7) {
    two_segments(mode, in, out, 3 * flag);  // flag is 1: barrier 3, then 4
    return;
  }
  __shared__ __align__(16) float buf[512];
  int t = threadIdx.x;
  bool pair = mode == 3 || mode == 6, cond = mode == 4 || mode == 6, async = mode == 5 || mode == 6;
  if (t < 128) {
    if (pair) asm volatile("bar.sync 1, 128;" ::: "memory");
    if (async) {
      unsigned d = (unsigned)__cvta_generic_to_shared(buf + 4 * t);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(in + 4 * t) : "memory");
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_group 0;\n" ::);
      float4 v = *reinterpret_cast<float4*>(buf + 4 * t);
      v.x *= 2.f; v.y *= 2.f; v.z *= 2.f; v.w *= 2.f;
      *reinterpret_cast<float4*>(buf + 4 * t) = v;
    } else {
      buf[t] = t * 2.0f;
    }
    if (mode != 1 && mode != 2) asm volatile("bar.arrive 3, 256;" ::: "memory");
    if (mode == 1) asm volatile("bar.sync 3, 256;" ::: "memory");
  } else {
    if (mode != 2) {
      if (!cond || flag) asm volatile("bar.sync 3, 256;" ::: "memory");
    }
    if (pair) asm volatile("bar.sync 2, 128;" ::: "memory");
    out[t - 128] = buf[(4 * (t - 128) + 5) % 512];
  }
}
int main(int argc, char** argv) {
  int m = atoi(argv[1]);
  float *o, *in;
  cudaMalloc(&o, 512 * 4);
  cudaMalloc(&in, 512 * 4);
  cudaMemset(in, 0, 512 * 4);
  k<<<1, 256>>>(m, in, o, 1);
  printf("mode %d: %s\n", m, cudaGetErrorString(cudaDeviceSynchronize()));
}
