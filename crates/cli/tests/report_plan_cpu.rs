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

/// `--precision` takes MIXSTACK_PRECISION's spellings: the plan and the
/// dispatch table name the mode's GEMM kernels (`_x3`), a dtype the mode
/// does not serve is the runtime's typed refusal, a bad spelling is refused
/// naming the spellings.
#[test]
fn precision_picks_the_modes_kernels() {
    let plan_with = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_mixstack")).args(["report", "--plan"]).args(args).output().unwrap();
        let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), format!("{o}{e}"))
    };
    let (ok, text) = plan_with(&["--precision", "fp16x3"]);
    assert!(ok && text.contains("precision fp16x3"), "{text}");
    let launches: Vec<&str> = text.lines().filter(|l| l.contains("launch ms_fwd_m1_")).collect();
    assert!(!launches.is_empty() && launches.iter().all(|l| l.contains("_x3 ")), "{text}");
    let (ok, text) = plan_with(&["--precision", "exact"]);
    assert!(ok && text.contains("launch ms_fwd_m1_") && !text.contains("_x3 "), "{text}");
    let (ok, text) = plan_with(&["--precision", "fp16x3", "--dtype", "f64"]);
    assert!(!ok && text.contains("f32 only"), "{text}");
    let (ok, text) = plan_with(&["--precision", "fp17"]);
    assert!(!ok && text.contains("exact or fp16x3"), "{text}");
    let out = Command::new(env!("CARGO_BIN_EXE_mixstack"))
        .args(["report", "--gpu", "NVIDIA H200", "--precision", "fp16x3"])
        .output()
        .expect("run mixstack");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && table.contains("precision fp16x3"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("fwd_m1 ") && l.contains("_x3 ")), "{table}");
}
