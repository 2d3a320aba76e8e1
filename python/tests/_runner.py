"""Runs a test module's ``test_*`` functions as a script: PASS/FAIL lines,
exit status 1 on a failure, SKIP (status 0) without torch."""


def run(namespace, torch):
    if torch is None:
        print("SKIP: torch is not installed")
        return 0
    failed = 0
    for name, fn in sorted(namespace.items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    return 1 if failed else 0
