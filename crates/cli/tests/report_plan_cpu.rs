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
