// LD_PRELOAD=./segv_trace.so: on SIGSEGV/SIGABRT/SIGBUS print the native
// backtrace (with the mapped object of each frame) to stderr, then die with
// the signal. Python's fault handler shows only Python frames.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
  void* frames[128];
  const char head[] = "\n== segv_trace: native backtrace ==\n";
  write(2, head, sizeof head - 1);
  int n = backtrace(frames, 128);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_fault;
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
}
