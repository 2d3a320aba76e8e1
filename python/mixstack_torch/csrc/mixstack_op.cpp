// libmixstack_torch.so: the mixstack ops in PyTorch's dispatcher.
//
//   mixstack::stack      forward: (out (E, F, ROW), z_all (n_layers-1, F, E, ROW))
//   mixstack::stack_bwd  input gradients: (grad_u0 (F, E, ROW), grad_alpha (E, F))
//
// The schemas are defined here, in C++, with a CUDA kernel (the C ABI of
// libmixstack.so, include/mixstack.h, on PyTorch's current stream; outputs
// from PyTorch's allocator) and a CPU kernel (the reference math of
// docs/MIXING_STACK.md in ATen ops), so that one registration serves eager
// Python, torch.compile, torch.export / AOTInductor packages (which record
// a call by name) and DeePMD-kit's C++ loading this library through
// DP_PLUGIN_PATH (LAMMPS), where no Python runs. The fake kernels and the
// autograd formula are registered from Python (mixstack_torch/ops.py).
//
// libmixstack.so is opened on first CUDA use: the path given by
// mixstack_torch_set_library (the Python package passes the library it
// loaded), else $MIXSTACK_LIB (a file or its directory), else the
// libmixstack*.so beside this library. Nothing here needs CUDA headers: the
// stream comes from c10's device-generic guard.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "mixstack.h"

namespace {

// ---------------------------------------------------------------------
// libmixstack.so, opened once
// ---------------------------------------------------------------------

// The C ABI's functions, typed from the header.
struct Lib {
  decltype(&::mixstack_abi_version) abi_version;
  decltype(&::mixstack_last_error) last_error;
  decltype(&::mixstack_stack_create_borrowing) create_borrowing;
  decltype(&::mixstack_forward_w) forward_w;
  decltype(&::mixstack_backward_w) backward_w;
  decltype(&::mixstack_last_path) last_path;
  decltype(&::mixstack_release_cached_memory) release_cached_memory;
  decltype(&::mixstack_stack_destroy) destroy;
  std::string path;
};

// Guards the library, the handle map and the last path; never held during
// a C call that launches or waits (the C ABI's handles are thread-safe).
// The globals are made once and never destroyed: a thread still inside an
// op while the process exits must not meet a destroyed map or string.
std::mutex& g_mu = *new std::mutex;
std::string& g_lib_path = *new std::string;  // set by mixstack_torch_set_library
Lib* g_lib = nullptr;

std::string dir_of_this_library() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&dir_of_this_library), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string p = info.dli_fname;
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

bool is_dir(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// One file under two spellings (a symlink, a relative path): same device
// and inode.
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  if (stat(a.c_str(), &sa) != 0 || stat(b.c_str(), &sb) != 0) return a == b;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::vector<std::string> candidates() {
  if (!g_lib_path.empty()) return {g_lib_path};
  if (const char* env = std::getenv("MIXSTACK_LIB"); env != nullptr && *env != '\0') {
    const std::string e = env;
    return {is_dir(e) ? e + "/libmixstack.so" : e};
  }
  // Beside this library: libmixstack.so, or the name `pip install` gives it
  // as an extension (libmixstack.cpython-...so).
  const std::string here = dir_of_this_library();
  std::vector<std::string> out{here + "/libmixstack.so"};
  if (DIR* dir = opendir(here.c_str()); dir != nullptr) {
    std::vector<std::string> named;
    while (const dirent* ent = readdir(dir)) {
      const std::string f = ent->d_name;
      if (f.rfind("libmixstack.cpython", 0) == 0 && f.size() > 3 && f.compare(f.size() - 3, 3, ".so") == 0) {
        named.push_back(here + "/" + f);
      }
    }
    closedir(dir);
    std::sort(named.begin(), named.end());
    out.insert(out.end(), named.begin(), named.end());
  }
  return out;
}

std::string dl_error() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown error";
}

// The C ABI of the library at path, or why not (h is closed then).
std::string open_lib(const std::string& path, Lib& l) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) return dl_error();
  std::string missing;
  auto sym = [&](const char* name, auto& f) {
    f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
    if (f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym("mixstack_abi_version", l.abi_version);
  sym("mixstack_last_error", l.last_error);
  sym("mixstack_stack_create_borrowing", l.create_borrowing);
  sym("mixstack_forward_w", l.forward_w);
  sym("mixstack_backward_w", l.backward_w);
  sym("mixstack_last_path", l.last_path);
  sym("mixstack_release_cached_memory", l.release_cached_memory);
  sym("mixstack_stack_destroy", l.destroy);
  std::string why;
  if (!missing.empty()) {
    why = "no symbol " + missing;
  } else if (const int v = l.abi_version(); v != MIXSTACK_ABI_VERSION) {
    why = "ABI version " + std::to_string(v) + ", this op was built for " + std::to_string(MIXSTACK_ABI_VERSION);
  }
  if (!why.empty()) dlclose(h);
  l.path = path;
  return why;
}

// The library (opened on first use); callers hold g_mu.
Lib& lib_locked() {
  if (g_lib != nullptr) return *g_lib;
  std::string tried;
  for (const auto& p : candidates()) {
    Lib l{};
    const std::string why = open_lib(p, l);
    if (why.empty()) {
      g_lib = new Lib(l);  // for the process's lifetime
      return *g_lib;
    }
    tried += "\n  " + p + ": " + why;
  }
  TORCH_CHECK(false, "mixstack: libmixstack.so could not be opened (set MIXSTACK_LIB to the file or its directory); tried:",
              tried);
}

// A shape's first call creates its handle, which allocates: inside a CUDA
// graph capture that would invalidate the capture. Refuse it plainly (the
// driver's cuStreamIsCapturing, from the libcuda the process has loaded).
void refuse_capture(void* stream) {
  using IsCapturing = int (*)(void*, int*);
  static const IsCapturing is_capturing = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h != nullptr ? reinterpret_cast<IsCapturing>(dlsym(h, "cuStreamIsCapturing")) : nullptr;
  }();
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  if (is_capturing != nullptr && is_capturing(stream, &status) == 0) {
    TORCH_CHECK(status == 0, "mixstack: the first call for this shape is inside a CUDA graph capture; run it once ",
                "before capturing (creating the handle allocates and may synchronise)");
  }
}

// A failed C call: ValueError for what the caller got wrong, RuntimeError otherwise.
void check(int status, const Lib& l, const char* func) {
  if (status == MIXSTACK_OK) return;
  const char* msg = l.last_error();
  const std::string text = (msg != nullptr && *msg != '\0') ? std::string(msg) : std::string(func) + " failed";
  switch (status) {
    case MIXSTACK_ERR_NULL_POINTER:
    case MIXSTACK_ERR_BAD_SHAPE:
    case MIXSTACK_ERR_BAD_DTYPE:
    case MIXSTACK_ERR_MISALIGNED:
    case MIXSTACK_ERR_BAD_ARGUMENT:
    case MIXSTACK_ERR_INVALID_HANDLE:
      TORCH_CHECK_VALUE(false, "mixstack: ", text);
    default:
      TORCH_CHECK(false, "mixstack: ", text);
  }
}

// ---------------------------------------------------------------------
// C handles: one per (device, dtype, F, Cf, lmax, n_layers)
// ---------------------------------------------------------------------

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t>;
// A C handle, shared by the map and every call using it: destroyed by the
// last of them, so clear_cache() never pulls one from under a call in flight.
using Handle = std::shared_ptr<mixstack_stack>;
std::map<Key, Handle>& g_stacks = *new std::map<Key, Handle>;
int g_last_code = 0;  // the most recent backward's path (1 relay, 2 fused) and why
std::string& g_last_reason = *new std::string;

// The library and the handle for this call's shape (made on first use).
std::pair<const Lib*, Handle> stack_for(int device, int dtype, int64_t F, int64_t cf, int64_t lmax, int64_t n,
                                        void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  Lib& l = lib_locked();
  const Key key{device, dtype, F, cf, lmax, n};
  if (auto it = g_stacks.find(key); it != g_stacks.end()) return {&l, it->second};
  refuse_capture(stream);
  mixstack_stack* raw = nullptr;
  check(l.create_borrowing(dtype, device, F, cf, lmax, n, &raw), l, "mixstack_stack_create_borrowing");
  const Lib* lib = &l;  // for the process's lifetime
  Handle h(raw, [lib](mixstack_stack* p) { lib->destroy(p); });
  g_stacks.emplace(key, h);
  return {&l, h};
}

void* current_stream(const at::Device& d) {
  c10::impl::VirtualGuardImpl impl(d.type());
  return impl.getStream(d).native_handle();
}

// ---------------------------------------------------------------------
// argument checks (ValueError, naming the argument)
// ---------------------------------------------------------------------

struct Dims {
  int64_t L, cf, row, m0, m1, lg;
};

Dims dims(int64_t lmax, int64_t focus_dim) {
  TORCH_CHECK_VALUE(lmax >= 1, "mixstack_stack: lmax must be >= 1, got ", std::to_string(lmax));
  TORCH_CHECK_VALUE(focus_dim >= 1, "mixstack_stack: focus_dim must be >= 1, got ", std::to_string(focus_dim));
  // Checked: a wrapped ROW could match another lmax's tensors (2^62 + 1
  // ran as lmax 1).
  int64_t l3, row, m0, m1, lg;
  const bool wraps = __builtin_mul_overflow(lmax, int64_t{3}, &l3) || __builtin_add_overflow(l3, int64_t{1}, &l3) ||
                     __builtin_mul_overflow(l3, focus_dim, &row) || __builtin_mul_overflow(lmax, focus_dim, &lg) ||
                     __builtin_add_overflow(lg, focus_dim, &m0) || __builtin_mul_overflow(lg, int64_t{2}, &m1);
  TORCH_CHECK_VALUE(!wraps, "mixstack_stack: lmax = ", std::to_string(lmax), " and focus_dim = ",
                    std::to_string(focus_dim), " give sizes past int64");
  return {lmax, focus_dim, row, m0, m1, lg};
}

int path_code(c10::string_view path) {
  if (path == "auto") return MIXSTACK_PATH_AUTO;
  if (path == "relay") return MIXSTACK_PATH_RELAY;
  if (path == "fused") return MIXSTACK_PATH_FUSED;
  if (path == "fused_always") return MIXSTACK_PATH_FUSED_ALWAYS;
  TORCH_CHECK_VALUE(false, "mixstack_stack: path must be one of ['auto', 'fused', 'fused_always', 'relay'], got '",
                    std::string(path), "'");
}

// Numbers in messages go in as std::to_string text, never as integers
// streamed by c10::str. A workaround: on the GPU machine (GCC 13.3, torch
// 2.11+cu130) a refusal whose message streamed an int64_t crashed the
// process, while messages of text only were refused cleanly; the cause is
// not established (BENCH.md run 94, bench/runs/run94/throws.py).
// list_of: "[a, b, c]" for sizes and strides.
std::string list_of(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

void defined(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), "mixstack_stack: `", name, "` is None (an undefined tensor)");
}

void same_kind(std::initializer_list<std::pair<const char*, const at::Tensor*>> ts) {
  for (const auto& [name, t] : ts) {
    defined(name, *t);
    // No forward-mode derivative: a dual tensor's tangent would be dropped.
    // (torch.func.jvp's tensors reach the kernel plain: not seen here.)
    TORCH_CHECK_NOT_IMPLEMENTED(!t->_fw_grad(/*level=*/0).defined(), "mixstack_stack: `", name,
                                "` carries a forward-mode tangent: forward-mode AD is not supported");
  }
  const auto& [first, t0] = *ts.begin();
  for (const auto& [name, t] : ts) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble, "mixstack_stack: `", name,
                      "` has dtype ", t->scalar_type(), ": mixstack supports float32 and float64 only");
    TORCH_CHECK_VALUE(t->device() == t0->device(), "mixstack_stack: `", name, "` is on ", t->device(), ", `", first,
                      "` on ", t0->device(), ": all tensors must be on one device");
    TORCH_CHECK_VALUE(t->scalar_type() == t0->scalar_type(), "mixstack_stack: `", name, "` has dtype ",
                      t->scalar_type(), ", `", first, "` ", t0->scalar_type(), ": all tensors must have one dtype");
    TORCH_CHECK_VALUE(t->is_contiguous(), "mixstack_stack: `", name, "` is not contiguous (strides ",
                      list_of(t->strides()),
                      "): mixstack reads dense row-major tensors and does not copy; pass `", name, ".contiguous()`");
  }
}

void shape_is(const char* name, const at::Tensor& t, std::vector<int64_t> want) {
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(want), "mixstack_stack: ", name, " must be ", list_of(want),
                    ", got ", list_of(t.sizes()));
}

// n_layers, after checking the weights' shapes for F focus streams.
int64_t weights(const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& gw, int64_t F, const Dims& d) {
  TORCH_CHECK_VALUE(w0.dim() == 4, "mixstack_stack: w0_all must be (n_layers, F, M0, M0), got ", list_of(w0.sizes()));
  const int64_t n = w0.size(0);
  TORCH_CHECK_VALUE(n >= 1, "mixstack_stack: w0_all has n_layers = 0");
  shape_is("w0_all", w0, {n, F, d.m0, d.m0});
  shape_is("w1_all", w1, {n, F, d.m1, d.m1});
  shape_is("gw_all", gw, {n - 1, F, d.cf, d.lg});
  return n;
}

int dtype_code(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? MIXSTACK_DTYPE_F32 : MIXSTACK_DTYPE_F64; }

// The transposes the backward reads ((in, out) -> (out, in) per block).
at::Tensor blocks_t(const at::Tensor& w) { return w.transpose(-1, -2).contiguous(); }

// A call's checked arguments: its dims, path code and (F, E, n_layers).
struct Call {
  Dims d;
  int path;
  int64_t F, E, n;
};

Call forward_call(const at::Tensor& u0, const at::Tensor& alpha, const at::Tensor& w0, const at::Tensor& w1,
                  const at::Tensor& gw, int64_t lmax, int64_t focus_dim, c10::string_view path) {
  const Dims d = dims(lmax, focus_dim);
  const int code = path_code(path);
  same_kind({{"u0", &u0}, {"alpha", &alpha}, {"w0_all", &w0}, {"w1_all", &w1}, {"gw_all", &gw}});
  TORCH_CHECK_VALUE(u0.dim() == 3, "mixstack_stack: u0 must be (F, E, ROW), got ", list_of(u0.sizes()));
  const int64_t F = u0.size(0), E = u0.size(1);
  TORCH_CHECK_VALUE(u0.size(2) == d.row, "mixstack_stack: u0 has ", std::to_string(u0.size(2)),
                    " columns, expected ROW = (3*lmax+1)*focus_dim = ", std::to_string(d.row));
  TORCH_CHECK_VALUE(F >= 1, "mixstack_stack: u0 has F = 0 focus streams");
  shape_is("alpha", alpha, {E, F});
  return {d, code, F, E, weights(w0, w1, gw, F, d)};
}

// The backward's, with grad_out made dense: autograd may hand in any
// layout (e.g. an expanded one).
std::pair<Call, at::Tensor> backward_call(const at::Tensor& grad_out_in, const at::Tensor& out,
                                          const at::Tensor& z_all, const at::Tensor& alpha, const at::Tensor& w0,
                                          const at::Tensor& w1, const at::Tensor& gw, int64_t lmax,
                                          int64_t focus_dim, c10::string_view path) {
  const Dims d = dims(lmax, focus_dim);
  const int code = path_code(path);
  defined("out", out);
  defined("grad_out", grad_out_in);
  // Autograd may hand in another floating dtype; anything else is refused,
  // never converted (a complex grad_out would lose its imaginary part).
  TORCH_CHECK_VALUE(at::isFloatingType(grad_out_in.scalar_type()), "mixstack_stack: `grad_out` has dtype ",
                    grad_out_in.scalar_type(), ": a floating dtype is expected");
  at::Tensor grad_out = grad_out_in.to(out.scalar_type()).contiguous();
  same_kind({{"out", &out},
             {"grad_out", &grad_out},
             {"z_all", &z_all},
             {"alpha", &alpha},
             {"w0_all", &w0},
             {"w1_all", &w1},
             {"gw_all", &gw}});
  TORCH_CHECK_VALUE(out.dim() == 3, "mixstack_stack: out must be (E, F, ROW), got ", list_of(out.sizes()));
  const int64_t E = out.size(0), F = out.size(1);
  TORCH_CHECK_VALUE(F >= 1, "mixstack_stack: out has F = 0 focus streams");
  const int64_t n = weights(w0, w1, gw, F, d);
  shape_is("out", out, {E, F, d.row});
  shape_is("grad_out", grad_out, {E, F, d.row});
  shape_is("z_all", z_all, {n - 1, F, E, d.row});
  shape_is("alpha", alpha, {E, F});
  return {{d, code, F, E, n}, grad_out};
}

// ---------------------------------------------------------------------
// CUDA: the C ABI
// ---------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> stack_cuda(const at::Tensor& u0, const at::Tensor& alpha, const at::Tensor& w0,
                                              const at::Tensor& w1, const at::Tensor& gw, int64_t lmax,
                                              int64_t focus_dim, bool apply_alpha, c10::string_view path) {
  const auto [d, code, F, E, n] = forward_call(u0, alpha, w0, w1, gw, lmax, focus_dim, path);
  at::Tensor out = at::empty({E, F, d.row}, u0.options());
  at::Tensor z_all = at::empty({n - 1, F, E, d.row}, u0.options());
  if (E == 0) return {out, z_all};
  const c10::DeviceGuard guard(u0.device());
  void* stream = current_stream(u0.device());
  const auto [l, h] = stack_for(u0.device().index(), dtype_code(u0), F, d.cf, d.L, n, stream);
  check(l->forward_w(h.get(), E, u0.data_ptr(), alpha.data_ptr(), apply_alpha ? 1 : 0, w0.data_ptr(), w1.data_ptr(),
                     gw.numel() ? gw.data_ptr() : nullptr, out.data_ptr(), z_all.numel() ? z_all.data_ptr() : nullptr,
                     stream),
        *l, "mixstack_forward_w");
  return {out, z_all};
}

std::tuple<at::Tensor, at::Tensor> stack_bwd_cuda(const at::Tensor& grad_out_in, const at::Tensor& out,
                                                  const at::Tensor& z_all, const at::Tensor& alpha,
                                                  const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& gw,
                                                  int64_t lmax, int64_t focus_dim, bool apply_alpha,
                                                  c10::string_view path) {
  const auto [call, grad_out] = backward_call(grad_out_in, out, z_all, alpha, w0, w1, gw, lmax, focus_dim, path);
  const auto [d, code, F, E, n] = call;
  at::Tensor grad_u0 = at::empty({F, E, d.row}, out.options());
  at::Tensor grad_alpha = at::empty({E, F}, out.options());
  if (E == 0) return {grad_u0, grad_alpha};
  const c10::DeviceGuard guard(out.device());
  const at::Tensor wt0 = blocks_t(w0), wt1 = blocks_t(w1), gwt = blocks_t(gw);
  void* stream = current_stream(out.device());
  const auto [l, h] = stack_for(out.device().index(), dtype_code(out), F, d.cf, d.L, n, stream);
  check(l->backward_w(h.get(), E, grad_out.data_ptr(), out.data_ptr(), z_all.numel() ? z_all.data_ptr() : nullptr,
                      alpha.data_ptr(), apply_alpha ? 1 : 0, wt0.data_ptr(), wt1.data_ptr(),
                      gw.numel() ? gw.data_ptr() : nullptr, gwt.numel() ? gwt.data_ptr() : nullptr, grad_u0.data_ptr(),
                      grad_alpha.data_ptr(), code, stream),
        *l, "mixstack_backward_w");
  // Which path ran, for last_backward_path(); the work is enqueued already,
  // so a failure here only leaves the record as it was.
  int path_ran = 0;
  char reason[256] = {0};
  if (l->last_path(h.get(), &path_ran, reason, sizeof reason) == MIXSTACK_OK) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_last_code = path_ran;
    g_last_reason = reason;
  }
  return {grad_u0, grad_alpha};
}

// ---------------------------------------------------------------------
// CPU: the reference math (docs/MIXING_STACK.md), batched over F
// ---------------------------------------------------------------------

at::Tensor silu_of(const at::Tensor& s) { return s * at::sigmoid(s); }

std::tuple<at::Tensor, at::Tensor> stack_cpu(const at::Tensor& u0, const at::Tensor& alpha, const at::Tensor& w0,
                                             const at::Tensor& w1, const at::Tensor& gw, int64_t lmax,
                                             int64_t focus_dim, bool apply_alpha, c10::string_view path) {
  const auto [d, code, F, E, n] = forward_call(u0, alpha, w0, w1, gw, lmax, focus_dim, path);
  at::Tensor u = u0;
  std::vector<at::Tensor> zs;
  for (int64_t k = 0; k + 1 < n; ++k) {
    const at::Tensor z0 = at::bmm(u.narrow(2, 0, d.m0), w0[k]);
    const at::Tensor z1 = at::bmm(u.narrow(2, d.m0, d.m1), w1[k]);
    const at::Tensor s = z0.narrow(2, 0, d.cf);
    const at::Tensor sig = at::sigmoid(at::bmm(s, gw[k]));
    const at::Tensor act =
        at::cat({silu_of(s), z0.narrow(2, d.cf, d.lg) * sig, z1 * at::cat({sig, sig}, -1)}, -1);
    u = u + act;
    zs.push_back(at::cat({z0, z1}, -1));
  }
  at::Tensor v = u + at::cat({at::bmm(u.narrow(2, 0, d.m0), w0[n - 1]), at::bmm(u.narrow(2, d.m0, d.m1), w1[n - 1])}, -1);
  if (apply_alpha) v = v * alpha.t().unsqueeze(-1);
  at::Tensor out = v.transpose(0, 1).contiguous();
  at::Tensor z_all = zs.empty() ? at::empty({0, F, E, d.row}, u0.options()) : at::stack(zs, 0);
  return {out, z_all};
}

std::tuple<at::Tensor, at::Tensor> stack_bwd_cpu(const at::Tensor& grad_out_in, const at::Tensor& out,
                                                 const at::Tensor& z_all, const at::Tensor& alpha,
                                                 const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& gw,
                                                 int64_t lmax, int64_t focus_dim, bool apply_alpha,
                                                 c10::string_view path) {
  const auto [call, grad_out] = backward_call(grad_out_in, out, z_all, alpha, w0, w1, gw, lmax, focus_dim, path);
  const auto [d, code, F, E, n] = call;
  at::Tensor g = grad_out.transpose(0, 1);
  at::Tensor grad_alpha;
  if (apply_alpha) {
    const at::Tensor a = alpha.t();
    grad_alpha = ((g * out.transpose(0, 1)).sum(-1) / a.clamp_min(1e-12)).t().contiguous();
    g = g * a.unsqueeze(-1);
  } else {
    grad_alpha = at::zeros_like(alpha);
  }
  const int64_t m0 = d.m0, m1 = d.m1;  // (a lambda may not capture structured bindings before C++20)
  auto back = [&](const at::Tensor& x, int64_t k) {
    return at::cat({at::bmm(x.narrow(2, 0, m0), w0[k].transpose(1, 2)), at::bmm(x.narrow(2, m0, m1), w1[k].transpose(1, 2))},
                   -1);
  };
  g = g + back(g, n - 1);
  for (int64_t k = n - 2; k >= 0; --k) {
    const at::Tensor z = z_all[k];
    const at::Tensor s = z.narrow(2, 0, d.cf);
    const at::Tensor sig = at::sigmoid(at::bmm(s, gw[k]));
    const at::Tensor s0 = at::sigmoid(s);
    at::Tensor gz_s = g.narrow(2, 0, d.cf) * s0 * (1 + s * (1 - s0));
    // The three gated subtile groups, LG wide each: (m=0, l>=1), (m=-1), (m=+1).
    const at::Tensor ga = g.narrow(2, d.cf, d.lg), gb = g.narrow(2, d.m0, d.lg), gc = g.narrow(2, d.m0 + d.lg, d.lg);
    const at::Tensor za = z.narrow(2, d.cf, d.lg), zb = z.narrow(2, d.m0, d.lg), zc = z.narrow(2, d.m0 + d.lg, d.lg);
    const at::Tensor g_logit = (ga * za + gb * zb + gc * zc) * sig * (1 - sig);
    gz_s = gz_s + at::bmm(g_logit, gw[k].transpose(1, 2));
    g = g + back(at::cat({gz_s, ga * sig, gb * sig, gc * sig}, -1), k);
  }
  return {g.contiguous(), grad_alpha};
}

}  // namespace

// ---------------------------------------------------------------------
// registration
// ---------------------------------------------------------------------

TORCH_LIBRARY(mixstack, m) {
  m.def(
      "stack(Tensor u0, Tensor alpha, Tensor w0_all, Tensor w1_all, Tensor gw_all, int lmax, int focus_dim, "
      "bool apply_alpha, str path) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "stack_bwd(Tensor grad_out, Tensor out, Tensor z_all, Tensor alpha, Tensor w0_all, Tensor w1_all, "
      "Tensor gw_all, int lmax, int focus_dim, bool apply_alpha, str path) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mixstack, CUDA, m) {
  m.impl("stack", &stack_cuda);
  m.impl("stack_bwd", &stack_bwd_cuda);
}

TORCH_LIBRARY_IMPL(mixstack, CPU, m) {
  m.impl("stack", &stack_cpu);
  m.impl("stack_bwd", &stack_bwd_cpu);
}

// ---------------------------------------------------------------------
// plain C entry points for the Python package (ctypes)
// ---------------------------------------------------------------------

// Exported (the library is built with -fvisibility=hidden).
#define MIXSTACK_TORCH_API __attribute__((visibility("default")))

extern "C" {

// The libmixstack.so to open (before the first CUDA call; later calls
// change nothing once it is open). Returns 0, or 1 if another is open or
// path is NULL.
MIXSTACK_TORCH_API int mixstack_torch_set_library(const char* path) noexcept {
  if (path == nullptr) return 1;
  try {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_lib != nullptr) return same_file(g_lib->path, path) ? 0 : 1;
    g_lib_path = path;
    return 0;
  } catch (...) {
    return 1;
  }
}

// The most recent backward's path (1 relay, 2 fused; 0 none yet) and why.
MIXSTACK_TORCH_API int mixstack_torch_last_path(char* reason, size_t len) noexcept {
  std::lock_guard<std::mutex> lock(g_mu);
  if (reason != nullptr && len > 0) {
    std::strncpy(reason, g_last_reason.c_str(), len - 1);
    reason[len - 1] = '\0';
  }
  return g_last_code;
}

// release_only: hands every handle's cached scratch back to the device;
// else destroys every handle (the next call makes them again). 0, or the
// status of the last failing call (its message: mixstack_last_error()).
MIXSTACK_TORCH_API int mixstack_torch_clear_cache(int release_only) noexcept {
  try {
    const Lib* l = nullptr;
    std::vector<Handle> handles;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_lib == nullptr) return 0;
      l = g_lib;
      for (const auto& kv : g_stacks) handles.push_back(kv.second);
      if (!release_only) g_stacks.clear();
    }
    // Without the map's references a handle is destroyed when `handles`
    // goes (or, if a call is using it, when that call ends).
    int status = 0;
    if (release_only) {
      for (const Handle& h : handles) {
        if (const int s = l->release_cached_memory(h.get()); s != MIXSTACK_OK) status = s;
      }
    }
    return status;
  } catch (...) {
    return MIXSTACK_ERR_INTERNAL;
  }
}

}  // extern "C"
