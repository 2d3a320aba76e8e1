//! CPU tests of the C ABI (src/capi.rs, include/mixstack.h): argument
//! checking through the C functions themselves, the thread-local error text,
//! and the header against the exported functions. No GPU or driver needed:
//! every check here happens before the driver is touched, except `create`
//! with valid arguments, which must fail cleanly (CUDA_ERROR without a
//! driver) rather than panic.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::{null, null_mut};

use mixstack::capi::*;
use mixstack::runtime::device::driver_present;
use mixstack::runtime::Dispatch;

const HEADER: &str = include_str!("../include/mixstack.h");
const CAPI_SRC: &str = include_str!("../src/capi.rs");

fn code(s: mixstack_status) -> c_int {
    s.code()
}

fn last_error() -> String {
    // SAFETY: mixstack_last_error returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(mixstack_last_error()) }.to_str().expect("utf-8").to_string()
}

/// A fake device address (never dereferenced: every call here fails before).
fn fake(addr: usize) -> *const c_void {
    addr as *const c_void
}

/// Whether the build's table has the kernels of the f32/f64 Cf = 32 shapes
/// the tests use as "valid" (false only for a stub build).
fn table_has_cf32() -> bool {
    let ok = !Dispatch::builtin().entries().is_empty();
    if !ok {
        println!("SKIPPED part: the kernel table is empty (stub build)");
    }
    ok
}

#[allow(clippy::too_many_arguments)]
fn create(
    dtype: c_int,
    f: i64,
    cf: i64,
    lmax: i64,
    n_layers: i64,
    w0: *const c_void,
    w1: *const c_void,
    gw: *const c_void,
) -> (c_int, *mut mixstack_stack, String) {
    // A non-null sentinel: a failing create must reset it to null.
    let mut h = 0x10 as *mut mixstack_stack;
    let rc = unsafe { mixstack_stack_create(dtype, 0, f, cf, lmax, n_layers, w0, w1, gw, null_mut(), &mut h) };
    (rc, h, if rc == 0 { String::new() } else { last_error() })
}

fn assert_fails(rc: c_int, want: mixstack_status, msg: &str, needles: &[&str]) {
    assert_eq!(rc, code(want), "expected {} ({}), got {rc}; message: {msg}", want.name(), code(want));
    assert!(msg.contains(want.name()), "message should name the status {}: {msg}", want.name());
    for n in needles {
        assert!(msg.contains(n), "message should mention `{n}`: {msg}");
    }
}

// ----------------------------------------------------------------------
// version, destroy, last_error
// ----------------------------------------------------------------------

#[test]
fn abi_version_matches_header() {
    assert_eq!(mixstack_abi_version(), MIXSTACK_ABI_VERSION);
    assert!(
        HEADER.contains(&format!("#define MIXSTACK_ABI_VERSION {}", MIXSTACK_ABI_VERSION)),
        "include/mixstack.h must define MIXSTACK_ABI_VERSION {MIXSTACK_ABI_VERSION}"
    );
}

#[test]
fn destroy_null_is_a_noop() {
    unsafe { mixstack_stack_destroy(null_mut()) };
    unsafe { mixstack_stack_destroy(null_mut()) };
}

#[test]
fn release_cached_memory_needs_a_handle() {
    std::thread::spawn(|| {
        let rc = unsafe { mixstack_release_cached_memory(null_mut()) };
        assert_eq!(rc, code(mixstack_status::MIXSTACK_ERR_NULL_POINTER));
        let text = last_error();
        assert!(text.starts_with("mixstack_release_cached_memory:") && text.contains("null"), "{text}");
    })
    .join()
    .unwrap();
}

#[test]
fn last_error_is_empty_on_a_fresh_thread_and_per_thread() {
    std::thread::spawn(|| {
        assert_eq!(last_error(), "", "a thread with no failing call has no error text");
        let rc = unsafe { mixstack_forward(null_mut(), 1, null(), null(), 0, null_mut(), null_mut(), null_mut()) };
        assert_eq!(rc, code(mixstack_status::MIXSTACK_ERR_NULL_POINTER));
        let here = last_error();
        assert!(here.starts_with("mixstack_forward:"), "{here}");
        // Another thread does not see it.
        std::thread::spawn(|| assert_eq!(last_error(), "")).join().unwrap();
        // destroy(NULL) is not a failure: the text stays.
        unsafe { mixstack_stack_destroy(null_mut()) };
        assert_eq!(last_error(), here);
        // The next failure replaces it.
        let mut h = null_mut();
        let rc = unsafe { mixstack_stack_create(9, 0, 1, 32, 1, 1, null(), null(), null(), null_mut(), &mut h) };
        assert_eq!(rc, code(mixstack_status::MIXSTACK_ERR_BAD_DTYPE));
        assert!(last_error().starts_with("mixstack_stack_create:"), "{}", last_error());
    })
    .join()
    .unwrap();
}

// ----------------------------------------------------------------------
// create
// ----------------------------------------------------------------------

#[test]
fn create_null_out_pointer() {
    let rc =
        unsafe { mixstack_stack_create(0, 0, 2, 32, 3, 3, fake(256), fake(512), fake(1024), null_mut(), null_mut()) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["`out`"]);
}

#[test]
fn create_bad_dtype() {
    for dtype in [-1, 2, 16] {
        let (rc, h, msg) = create(dtype, 2, 32, 3, 3, fake(256), fake(512), fake(1024));
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_DTYPE, &msg, &["dtype", &dtype.to_string()]);
        assert!(h.is_null(), "a failing create stores NULL in *out");
    }
}

#[test]
fn create_negative_device() {
    let mut h = null_mut();
    let rc = unsafe { mixstack_stack_create(0, -1, 2, 32, 3, 3, fake(256), fake(512), fake(1024), null_mut(), &mut h) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_ARGUMENT, &last_error(), &["device"]);
    assert!(h.is_null());
}

#[test]
fn create_bad_shape_values() {
    let cases: [(i64, i64, i64, i64, &str); 7] = [
        (0, 32, 3, 3, "F"),
        (-2, 32, 3, 3, "F"),
        (2, 0, 3, 3, "Cf"),
        (2, -32, 3, 3, "Cf"),
        (2, 32, 0, 3, "lmax"),
        (2, 32, -1, 3, "lmax"),
        (2, 32, 3, 0, "n_layers"),
    ];
    for (f, cf, lmax, n, name) in cases {
        for dtype in [0, 1] {
            let (rc, h, msg) = create(dtype, f, cf, lmax, n, fake(256), fake(512), fake(1024));
            assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &msg, &[name]);
            assert!(h.is_null());
        }
    }
}

#[test]
fn create_shape_outside_the_build() {
    // Cf 48 has no kernel; lmax 7 is past the build's range (1..=6); both
    // are refused from the table alone, before any driver call.
    for dtype in [0, 1] {
        let (rc, _, msg) = create(dtype, 2, 48, 3, 3, fake(256), fake(512), fake(1024));
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &msg, &["48"]);
        let (rc, _, msg) = create(dtype, 2, 32, 7, 3, fake(256), fake(512), fake(1024));
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &msg, &["lmax"]);
    }
}

#[test]
fn create_null_weights() {
    if !table_has_cf32() {
        return;
    }
    for dtype in [0, 1] {
        let (rc, h, msg) = create(dtype, 2, 32, 3, 3, null(), fake(512), fake(1024));
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &msg, &["`w0`"]);
        assert!(h.is_null());
        let (rc, _, msg) = create(dtype, 2, 32, 3, 3, fake(256), null(), fake(1024));
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &msg, &["`w1`"]);
        let (rc, _, msg) = create(dtype, 2, 32, 3, 3, fake(256), fake(512), null());
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &msg, &["`gw`"]);
    }
}

#[test]
fn create_misaligned_weights() {
    if !table_has_cf32() {
        return;
    }
    // f32: 4-byte alignment; f64: 8-byte (an address aligned to 4 only fails).
    let (rc, _, msg) = create(0, 2, 32, 3, 3, fake(258), fake(512), fake(1024));
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_MISALIGNED, &msg, &["`w0`", "4 bytes"]);
    let (rc, _, msg) = create(0, 2, 32, 3, 3, fake(256), fake(513), fake(1024));
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_MISALIGNED, &msg, &["`w1`"]);
    let (rc, _, msg) = create(1, 2, 32, 3, 3, fake(256), fake(512), fake(1028));
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_MISALIGNED, &msg, &["`gw`", "8 bytes"]);
    let (rc, _, msg) = create(1, 2, 32, 3, 3, fake(260), fake(512), fake(1024));
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_MISALIGNED, &msg, &["`w0`", "8 bytes"]);
}

#[test]
fn create_with_valid_arguments_fails_cleanly_without_memory() {
    if !table_has_cf32() {
        return;
    }
    // Valid shape and aligned (fake) pointers: without a driver this is
    // CUDA_ERROR with a message; with one, the fake pointers are not device
    // memory and are refused. Either way no panic, and *out stays NULL.
    for (dtype, n_layers, gw) in [(0, 3, fake(1024)), (1, 3, fake(1024)), (0, 1, null())] {
        let (rc, h, msg) = create(dtype, 2, 32, 3, n_layers, fake(256), fake(512), gw);
        assert!(h.is_null(), "failing create must leave *out NULL");
        if !driver_present() {
            assert_fails(rc, mixstack_status::MIXSTACK_ERR_CUDA, &msg, &["driver"]);
        } else {
            assert_ne!(rc, 0, "fake pointers must not create a stack");
            assert!(!msg.is_empty());
            println!("driver present: create with fake pointers -> {rc}: {msg}");
        }
    }
}

// ----------------------------------------------------------------------
// forward / backward / last_path
// ----------------------------------------------------------------------

#[test]
fn forward_null_handle() {
    for e in [0i64, 1, 1000] {
        let rc = unsafe {
            mixstack_forward(
                null_mut(),
                e,
                fake(256),
                fake(512),
                1,
                fake(1024) as *mut _,
                fake(2048) as *mut _,
                null_mut(),
            )
        };
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["handle"]);
    }
}

#[test]
fn forward_negative_edges() {
    let rc = unsafe { mixstack_forward(null_mut(), -5, null(), null(), 0, null_mut(), null_mut(), null_mut()) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &last_error(), &["E = -5"]);
}

#[test]
fn backward_bad_path_code() {
    for path in [-1, 3, 42] {
        let rc = unsafe {
            mixstack_backward(
                null_mut(),
                10,
                null(),
                null(),
                null(),
                null(),
                1,
                null_mut(),
                null_mut(),
                path,
                null_mut(),
            )
        };
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_ARGUMENT, &last_error(), &["path", &path.to_string()]);
    }
}

#[test]
fn backward_null_handle_and_negative_edges() {
    for path in [MIXSTACK_PATH_AUTO, MIXSTACK_PATH_RELAY, MIXSTACK_PATH_FUSED] {
        let rc = unsafe {
            mixstack_backward(
                null_mut(),
                7,
                null(),
                null(),
                null(),
                null(),
                1,
                null_mut(),
                null_mut(),
                path,
                null_mut(),
            )
        };
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["handle"]);
    }
    let rc = unsafe {
        mixstack_backward(null_mut(), -1, null(), null(), null(), null(), 1, null_mut(), null_mut(), 1, null_mut())
    };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &last_error(), &["E = -1"]);
}

#[test]
fn last_path_null_handle() {
    let mut path: c_int = 77;
    let mut buf = [0 as c_char; 64];
    let rc = unsafe { mixstack_last_path(null(), &mut path, buf.as_mut_ptr(), buf.len()) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["handle"]);
    assert_eq!(path, 77, "a failing call writes nothing");
}

// ----------------------------------------------------------------------
// the header
// ----------------------------------------------------------------------

/// The header without its comments.
fn header_code() -> String {
    let mut out = String::new();
    let mut rest = HEADER;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        let j = rest[i..].find("*/").expect("unterminated comment in mixstack.h");
        rest = &rest[i + j + 2..];
    }
    out.push_str(rest);
    out
}

fn ident_before_paren(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut names = Vec::new();
    for (i, &c) in b.iter().enumerate() {
        if c != b'(' {
            continue;
        }
        let mut end = i;
        while end > 0 && b[end - 1] == b' ' {
            end -= 1;
        }
        let mut start = end;
        while start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_') {
            start -= 1;
        }
        if start < end {
            names.push(text[start..end].to_string());
        }
    }
    names
}

/// `#[no_mangle]` `extern "C"` functions of src/capi.rs.
fn exported_functions() -> Vec<String> {
    let lines: Vec<&str> = CAPI_SRC.lines().collect();
    let mut names = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l.trim() != "#[no_mangle]" {
            continue;
        }
        let decl = lines[i + 1..].iter().find(|l| l.contains("fn ")).expect("fn after #[no_mangle]");
        assert!(decl.contains("extern \"C\" fn "), "#[no_mangle] function is not extern \"C\": {decl}");
        let after = decl.split("fn ").nth(1).unwrap();
        names.push(after.split('(').next().unwrap().trim().to_string());
    }
    names
}

#[test]
fn header_declares_every_exported_function() {
    let exported = exported_functions();
    let expected = [
        "mixstack_stack_create",
        "mixstack_forward",
        "mixstack_backward",
        "mixstack_last_path",
        "mixstack_last_error",
        "mixstack_stack_destroy",
        "mixstack_abi_version",
    ];
    for name in expected {
        assert!(exported.iter().any(|n| n == name), "src/capi.rs does not export {name}: {exported:?}");
    }
    let code = header_code();
    let declared: Vec<String> = ident_before_paren(&code).into_iter().filter(|n| n.starts_with("mixstack_")).collect();
    for name in &exported {
        assert!(declared.contains(name), "include/mixstack.h does not declare {name} (declared: {declared:?})");
        // Its declaration line (a return type first), and a comment right above.
        let lines: Vec<&str> = HEADER.lines().collect();
        let decl = lines
            .iter()
            .position(|l| {
                l.contains(&format!(" {name}(")) && ["int ", "void ", "const char* "].iter().any(|t| l.starts_with(t))
            })
            .unwrap_or_else(|| panic!("no declaration line of {name} in the header"));
        assert!(
            decl > 0 && lines[decl - 1].trim_end().ends_with("*/"),
            "{name} has no comment right above its declaration in the header"
        );
    }
    for name in &declared {
        assert!(exported.contains(name), "include/mixstack.h declares {name}, which src/capi.rs does not export");
    }
    assert_eq!(declared.len(), exported.len(), "each function declared once: {declared:?}");
}

#[test]
fn header_prototypes_match_the_brief() {
    let code: String = header_code().split_whitespace().collect::<Vec<_>>().join(" ");
    for proto in [
        "int mixstack_stack_create(int dtype, int device, int64_t f, int64_t cf, int64_t lmax, int64_t n_layers, const void* w0_dev, const void* w1_dev, const void* gw_dev, void* cu_stream, mixstack_stack** out);",
        "int mixstack_forward(mixstack_stack* stack, int64_t e, const void* u0, const void* alpha, int apply_alpha, void* out, void* z_all, void* cu_stream);",
        "int mixstack_backward(mixstack_stack* stack, int64_t e, const void* grad_out, const void* out, const void* z_all, const void* alpha, int apply_alpha, void* grad_u0, void* grad_alpha, int path, void* cu_stream);",
        "int mixstack_last_path(const mixstack_stack* stack, int* path, char* reason, size_t reason_len);",
        "const char* mixstack_last_error(void);",
        "void mixstack_stack_destroy(mixstack_stack* stack);",
        "int mixstack_abi_version(void);",
        "typedef struct mixstack_stack mixstack_stack;",
    ] {
        assert!(code.contains(proto), "include/mixstack.h lacks `{proto}`");
    }
}

#[test]
fn header_status_codes_and_constants_match() {
    let code = header_code();
    for s in mixstack_status::ALL {
        let want = format!("{} = {}", s.name(), s.code());
        assert!(code.contains(&want), "include/mixstack.h lacks `{want}`");
    }
    let n_enum = code.matches("MIXSTACK_OK").count() + code.matches("MIXSTACK_ERR_").count();
    assert_eq!(n_enum, mixstack_status::ALL.len(), "the header's status enum has other members");
    for (name, v) in [
        ("MIXSTACK_DTYPE_F32", MIXSTACK_DTYPE_F32),
        ("MIXSTACK_DTYPE_F64", MIXSTACK_DTYPE_F64),
        ("MIXSTACK_PATH_AUTO", MIXSTACK_PATH_AUTO),
        ("MIXSTACK_PATH_RELAY", MIXSTACK_PATH_RELAY),
        ("MIXSTACK_PATH_FUSED", MIXSTACK_PATH_FUSED),
    ] {
        assert!(code.contains(&format!("#define {name} {v}")), "include/mixstack.h lacks `#define {name} {v}`");
    }
    // The codes are distinct and dense from 0.
    for (i, s) in mixstack_status::ALL.iter().enumerate() {
        assert_eq!(s.code(), i as c_int);
    }
}
