// racecheck on the named-barrier handover of gemm_ws: producers (threads
// 0..127) store, bar.arrive 3; consumers (128..255) bar.sync 3, load.
//   0: arrive/sync   1: sync/sync   2: no barrier (must report)
//   3: 0 + producers-only bar.sync 1,128 before the stores, consumers-only
//      bar.sync 2,128 after the wait (as gemm_ws)
//   4: 0 with the consumers' wait under a uniform runtime condition
//   5: 0 with the stores gating cp.async'd data in place (as GzPanel::fill)
//   6: 3 + 4 + 5
#include <cstdio>
#include <cstdlib>
__global__ void k(int mode, const float* in, float* out, int flag) {
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
