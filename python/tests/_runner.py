"""Runs a test module's ``test_*`` functions as a script: PASS/FAIL lines
(with the failing frames), exit status 1 on a failure, SKIP (status 0)
without torch, and a SKIP line with its reason for a test that calls
``skip`` (under pytest, ``skip`` is pytest's)."""


import faulthandler
import sys
import traceback


class Skipped(Exception):
    """A test that cannot run here; its message says why."""


def skip(reason):
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise Skipped(reason)


def run(namespace, torch):
    # A crash in native code (the op's C++, a loaded package) prints the
    # Python stack of every thread before the process dies.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if torch is None:
        print("SKIP: torch is not installed")
        return 0
    failed = 0
    for name, fn in sorted(namespace.items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Skipped as e:
                print(f"SKIP {name}: {e}")
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
                traceback.print_exc(limit=-3, file=sys.stdout)
    return 1 if failed else 0
