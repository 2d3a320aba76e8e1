//! CPU tests of `mixstack bench`'s arguments: every one is checked before a
//! device is opened (with or without a GPU, the same refusal), the shape by
//! the runtime's own checks. `--layers 0` used to reach an index
//! underflow after the inputs were allocated on a GPU.

use std::process::Command;

#[test]
fn bad_arguments_are_refused_before_any_device_is_opened() {
    let shape = |layers: &'static str, edges: &'static str, cf: &'static str| {
        vec!["--focus", "2", "--edges", edges, "--cf", cf, "--lmax", "3", "--layers", layers]
    };
    for (args, needle) in [
        (shape("0", "10", "32"), "unsupported n_layers = 0"),
        (shape("3", "0", "32"), "--edges must be at least 1"),
        (shape("3", "10", "40"), "unsupported Cf = 40"),
        (shape("3", "3000000000", "32"), "unsupported E"),
        (vec!["--preset", "seed", "--precision", "fp17"], "--precision fp17"),
        (vec!["--preset", "seed", "--variant", "bogus"], "variant 'bogus'"),
        (vec!["--preset", "seed", "--forward-variant", "nostage=x"], "unknown stage 'nostage'"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mixstack")).arg("bench").args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(needle), "{args:?}: expected {needle:?} in: {err}");
        assert!(!err.contains("needs a CUDA GPU"), "{args:?}: the device was opened first: {err}");
    }
}
