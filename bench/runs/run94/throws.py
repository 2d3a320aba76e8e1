# Which refusal of the C++ op crashes on the GPU machine: each failing call
# alone, five times, on CPU tensors (the C++ CPU kernel), one line each:
#   python3 bench/runs/run94/throws.py [CASE...]   (one case per process: a crash names it)
import sys
import torch
import mixstack_torch  # noqa: F401  (loads libmixstack_torch.so)

F, E, CF, L, N = 2, 64, 32, 2, 3
ROW, M0, M1, LG = (3 * L + 1) * CF, (L + 1) * CF, 2 * L * CF, L * CF
u0 = torch.randn(F, E, ROW)
alpha = torch.rand(E, F)
w0, w1, gw = torch.randn(N, F, M0, M0), torch.randn(N, F, M1, M1), torch.randn(N - 1, F, CF, LG)
op = torch.ops.mixstack.stack
cases = {
    "ok": lambda: op(u0, alpha, w0, w1, gw, L, CF, True, "auto"),
    "alpha_shape": lambda: op(u0, alpha[:10].contiguous(), w0, w1, gw, L, CF, True, "auto"),
    "row": lambda: op(u0, alpha, w0, w1, gw, L, 16, True, "auto"),
    "path": lambda: op(u0, alpha, w0, w1, gw, L, CF, True, "bogus"),
    "noncontig": lambda: op(u0.transpose(0, 1).contiguous().transpose(0, 1), alpha, w0, w1, gw, L, CF, True, "auto"),
    "lmax0": lambda: op(u0, alpha, w0, w1, gw, 0, CF, True, "auto"),
    # Text-only messages thrown where "row" was (forward_call's own body) and
    # in weights(): clean here but crashing on the GPU machine would put the
    # cause in the throw site (the unwinder), not in integer formatting.
    "f0": lambda: op(u0[:0].contiguous(), alpha[:, :0].contiguous(), w0, w1, gw, L, CF, True, "auto"),
    "n0": lambda: op(u0, alpha, w0[:0].contiguous(), w1, gw, L, CF, True, "auto"),
}
for name in sys.argv[1:] or list(cases):
    for i in range(5):
        try:
            cases[name]()
            print(name, i, "ok", flush=True)
        except Exception as e:  # a RuntimeError must not end the script like the crash hunted here
            print(name, i, type(e).__name__, str(e)[:60], flush=True)
