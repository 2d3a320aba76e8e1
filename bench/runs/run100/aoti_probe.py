# Issue 22: where does loading an AOTInductor package in Python crash on the
# GPU machine (run 89's compare.py, run 92-94's test_aoti_package...)? Three
# packages, each loaded in a fresh process (native backtrace on a crash when
# SEGV_TRACE names segv_trace.so):
#   plain: a Linear, no custom op (the machine's AOTInductor alone);
#   plain_cuda: the same on the GPU;
#   op: a module calling torch.ops.mixstack.stack (CPU), with the op library.
# Run 116 found all three dying in the package's std::regex: its top frame,
# cut short in the log, ends like regex_traits<char>::transform or
# transform_primary, which go through std::collate, so perhaps a locale
# question: "plain" runs again with LC_ALL=C and with no locale variable.
#   python3 bench/runs/run100/aoti_probe.py
import os
import subprocess
import sys
import tempfile

import torch

LOAD = (
    "import sys, torch\n"
    "if sys.argv[1]: torch.ops.load_library(sys.argv[1])\n"
    "args = torch.load(sys.argv[3])\n"
    "print('loading', flush=True)\n"
    "m = torch._inductor.aoti_load_package(sys.argv[2])\n"
    "print('loaded', flush=True)\n"
    "out = m(*args)\n"
    "print('ran', float(out.float().abs().sum()), flush=True)\n"
)


def probe(name, module, args, lib="", env_edit=None):
    with tempfile.TemporaryDirectory() as d:
        try:
            pt2 = torch._inductor.aoti_compile_and_package(
                torch.export.export(module, args), package_path=os.path.join(d, "m.pt2")
            )
        except Exception as e:  # noqa: BLE001
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
            return
        torch.save(args, os.path.join(d, "args.pt"))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if os.environ.get("SEGV_TRACE"):
            env["LD_PRELOAD"] = os.environ["SEGV_TRACE"]
        if env_edit:
            env_edit(env)
        r = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", LOAD, lib, pt2, os.path.join(d, "args.pt")],
            capture_output=True, text=True, env=env, cwd=d,
        )
        print(f"{name}: exit {r.returncode}; stdout {r.stdout.strip()!r}", flush=True)
        if r.returncode != 0:
            # the native backtrace's top frames come first (run 116 kept only the tail)
            err = r.stderr
            print(err if len(err) <= 9000 else err[:5000] + "\n[...]\n" + err[-4000:], flush=True)


lin = torch.nn.Linear(8, 4)
x = torch.randn(3, 8)
print("locale variables:", {k: v for k, v in os.environ.items() if k == "LANG" or k.startswith("LC_")}, flush=True)
probe("plain", lin, (x,))
probe("plain_lc_all_c", lin, (x,), env_edit=lambda e: e.update(LC_ALL="C"))
probe("plain_no_locale", lin, (x,), env_edit=lambda e: [e.pop(k) for k in list(e) if k == "LANG" or k.startswith("LC_")])
if torch.cuda.is_available():
    probe("plain_cuda", torch.nn.Linear(8, 4).cuda(), (x.cuda(),))
sys.path.insert(0, "python")
try:
    import mixstack_torch  # noqa: F401
    from mixstack_torch import _ext

    F, E, CF, L, N = 2, 64, 32, 2, 3
    ROW, M0, M1, LG = (3 * L + 1) * CF, (L + 1) * CF, 2 * L * CF, L * CF

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w0 = torch.nn.Parameter(torch.randn(N, F, M0, M0) / M0**0.5)
            self.w1 = torch.nn.Parameter(torch.randn(N, F, M1, M1) / M1**0.5)
            self.gw = torch.nn.Parameter(torch.randn(N - 1, F, CF, LG) / CF**0.5)

        def forward(self, u0, alpha):
            out, _ = torch.ops.mixstack.stack(u0, alpha, self.w0, self.w1, self.gw, L, CF, True, "auto")
            return out.square().sum(dim=-1)

    probe("op", M(), (torch.randn(F, E, ROW), torch.rand(E, F)), _ext.library_path())
except Exception as e:  # noqa: BLE001
    print(f"op: not probed: {type(e).__name__}: {e}", flush=True)
