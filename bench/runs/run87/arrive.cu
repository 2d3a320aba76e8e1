// racecheck on the named-barrier handover: producers store, bar.arrive;
// consumers bar.sync, load. MODE 0: arrive/sync; 1: sync/sync; 2: none.
#include <cstdio>
__global__ void k(int mode, float* out) {
  __shared__ float buf[128];
  int t = threadIdx.x;
  if (t < 128) {
    buf[t] = t * 2.0f;
    if (mode == 0) asm volatile("bar.arrive 3, 256;" ::: "memory");
    if (mode == 1) asm volatile("bar.sync 3, 256;" ::: "memory");
  } else {
    if (mode != 2) asm volatile("bar.sync 3, 256;" ::: "memory");
    out[t - 128] = buf[(t - 128 + 1) % 128];
  }
}
#include <cstdlib>
int main(int argc, char** argv) {
  int m = atoi(argv[1]);
  float* o; cudaMalloc(&o, 512);
  k<<<1, 256>>>(m, o); cudaDeviceSynchronize(); printf("mode %d done\n", m);
}
