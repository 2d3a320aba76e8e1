//! CPU tests of `mixstack report --plan`'s scratch cap: spelt as
//! MIXSTACK_SCRATCH_CAP is (bytes, or a K, M, G or T suffix), parsed by the
//! runtime's own parser, a bad value refused by name. No GPU needed.

use std::process::Command;

fn report_plan(cap: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mixstack"))
        .args(["report", "--plan", "--cap", cap])
        .output()
        .expect("run mixstack")
}

#[test]
fn cap_takes_the_environment_spellings() {
    for (cap, bytes) in [("64M", 67_108_864u64), ("1g", 1 << 30), (" 65536 ", 65_536)] {
        let out = report_plan(cap);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "--cap {cap:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains(&format!("scratch_cap: {bytes}")), "--cap {cap:?} planned as: {text}");
    }
}

#[test]
fn a_bad_cap_is_refused_naming_the_spellings() {
    for cap in ["0", "x", "12Q", "1.5G", "99999999999999999999"] {
        let out = report_plan(cap);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--cap {cap:?} accepted");
        assert!(err.contains("--cap") && err.contains("K, M, G or T"), "--cap {cap:?}: {err}");
    }
}

/// `report --plan` with these arguments: exit status and stderr.
fn plan_with(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mixstack")).args(["report", "--plan"]).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn shapes_no_call_could_take_are_refused_before_planning() {
    // Each of these panicked (multiply overflow), grew memory without bound
    // (billions of planned steps) or printed offsets past 2^63.
    for (args, needle) in [
        (&["--e", "14411518807585587"][..], "unsupported E"),
        (&["--dtype", "f64", "--e", "7000000000000000"], "unsupported E"),
        (&["--e", "100000000000000", "--cf", "128"], "unsupported E"),
        (&["--layers", "100000000", "--e", "1"], "unsupported n_layers"),
        (&["--layers", "18446744073709551615"], "unsupported n_layers"),
    ] {
        let (ok, err) = plan_with(args);
        assert!(!ok && err.contains(needle), "{args:?}: {err}");
    }
}
