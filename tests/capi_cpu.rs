//! CPU tests of the C ABI (src/capi/, include/mixstack.h): argument
//! checking through the C functions themselves, the thread-local error text,
//! and the header against the exported functions. No GPU or driver needed:
//! every check here happens before the driver is touched, except `create`
//! with valid arguments, which must fail cleanly (CUDA_ERROR without a
//! driver) rather than panic.
//!
//! The handle registry: foreign, garbage and dangling handles are refused by
//! every entry point without a GPU. The last section needs a CUDA device for
//! real handles (double destroy, use after destroy, destroy racing a call);
//! without one each of its tests prints `SKIPPED (no CUDA device): <name>`
//! and passes.

mod common;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::{null, null_mut};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use mixstack::capi::*;
use mixstack::runtime::device::driver_present;
use mixstack::runtime::{Dispatch, StackShape};

const HEADER: &str = include_str!("../include/mixstack.h");
/// The exported functions all live here.
const ENTRY_SRC: &str = include_str!("../src/capi/entry.rs");
/// The other files of the C ABI: no exported function in them.
const OTHER_CAPI_SRC: [(&str, &str); 4] = [
    ("src/capi/mod.rs", include_str!("../src/capi/mod.rs")),
    ("src/capi/status.rs", include_str!("../src/capi/status.rs")),
    ("src/capi/handle.rs", include_str!("../src/capi/handle.rs")),
    ("src/capi/checks.rs", include_str!("../src/capi/checks.rs")),
];

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
    for path in [-1, 4, 42] {
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
    for path in [MIXSTACK_PATH_AUTO, MIXSTACK_PATH_RELAY, MIXSTACK_PATH_FUSED, MIXSTACK_PATH_FUSED_ALWAYS] {
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

/// `#[no_mangle]` `extern "C"` functions of src/capi/entry.rs.
fn exported_functions() -> Vec<String> {
    let lines: Vec<&str> = ENTRY_SRC.lines().collect();
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
    // The header is compared with entry.rs alone: an export elsewhere would escape it.
    for (path, text) in OTHER_CAPI_SRC {
        assert!(!text.contains("#[no_mangle]"), "{path} exports a function: keep them in src/capi/entry.rs");
    }
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
        assert!(exported.iter().any(|n| n == name), "src/capi/entry.rs does not export {name}: {exported:?}");
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
        assert!(exported.contains(name), "include/mixstack.h declares {name}, which src/capi/entry.rs does not export");
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
        "int mixstack_set_precision(mixstack_stack* stack, int precision);",
        "int mixstack_last_precision(const mixstack_stack* stack, int* forward, int* backward);",
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
        ("MIXSTACK_PATH_FUSED_ALWAYS", MIXSTACK_PATH_FUSED_ALWAYS),
    ] {
        assert!(code.contains(&format!("#define {name} {v}")), "include/mixstack.h lacks `#define {name} {v}`");
    }
    // The codes are distinct and dense from 0.
    for (i, s) in mixstack_status::ALL.iter().enumerate() {
        assert_eq!(s.code(), i as c_int);
    }
}

// ----------------------------------------------------------------------
// the handle registry: foreign, garbage and dangling handles (no GPU)
// ----------------------------------------------------------------------

/// Call every entry point that takes a handle with `h`, which is not a live
/// handle: each must refuse it with MIXSTACK_ERR_INVALID_HANDLE (E == 0
/// included: before the registry, E == 0 returned MIXSTACK_OK on any
/// pointer), name the function and the handle in its message, and write no
/// out-parameter. Before the registry, every call with E > 0 read through
/// `h` and destroy freed it.
fn assert_every_entry_point_refuses(h: *mut mixstack_stack) {
    let want = mixstack_status::MIXSTACK_ERR_INVALID_HANDLE;
    let addr = format!("{h:p}");
    let check = |rc: c_int, func: &str| {
        let msg = last_error();
        assert!(msg.starts_with(&format!("{func}:")), "message should name {func}: {msg}");
        assert_fails(rc, want, &msg, &["not a live stack handle", &addr]);
    };
    for e in [0i64, 97] {
        let rc = unsafe {
            mixstack_forward(h, e, fake(256), fake(512), 1, fake(1024) as *mut _, fake(2048) as *mut _, null_mut())
        };
        check(rc, "mixstack_forward");
        for path in [MIXSTACK_PATH_AUTO, MIXSTACK_PATH_RELAY, MIXSTACK_PATH_FUSED, MIXSTACK_PATH_FUSED_ALWAYS] {
            let rc = unsafe {
                mixstack_backward(
                    h,
                    e,
                    fake(256),
                    fake(512),
                    fake(1024),
                    fake(2048),
                    1,
                    fake(4096) as *mut _,
                    fake(8192) as *mut _,
                    path,
                    null_mut(),
                )
            };
            check(rc, "mixstack_backward");
        }
    }
    let mut path: c_int = 77;
    let mut buf = [0x55 as c_char; 64];
    let rc = unsafe { mixstack_last_path(h, &mut path, buf.as_mut_ptr(), buf.len()) };
    check(rc, "mixstack_last_path");
    assert_eq!(path, 77, "a refused last_path writes no path");
    assert!(buf.iter().all(|&c| c == 0x55), "a refused last_path writes no reason");
    for code in [MIXSTACK_PRECISION_AUTO, MIXSTACK_PRECISION_FP16X3, 99] {
        let rc = unsafe { mixstack_set_precision(h, code) };
        check(rc, "mixstack_set_precision");
    }
    let (mut fwd, mut bwd): (c_int, c_int) = (77, 77);
    let rc = unsafe { mixstack_last_precision(h, &mut fwd, &mut bwd) };
    check(rc, "mixstack_last_precision");
    assert_eq!((fwd, bwd), (77, 77), "a refused last_precision writes nothing");
    let rc = unsafe { mixstack_release_cached_memory(h) };
    check(rc, "mixstack_release_cached_memory");
    // destroy returns nothing: it must free nothing and record the error
    // (the text above is release_cached_memory's; destroy must replace it),
    // the second time as the first.
    for _ in 0..2 {
        unsafe { mixstack_stack_destroy(h) };
        check(want.code(), "mixstack_stack_destroy");
    }
}

#[test]
fn invalid_handle_status_is_new_and_keeps_the_old_codes() {
    use mixstack_status::*;
    assert_eq!(MIXSTACK_ERR_INVALID_HANDLE.code(), 9);
    assert_eq!(MIXSTACK_ERR_INVALID_HANDLE.name(), "MIXSTACK_ERR_INVALID_HANDLE");
    assert_eq!(MIXSTACK_ERR_NULL_POINTER.code(), 1);
    assert_eq!(MIXSTACK_ERR_BAD_ARGUMENT.code(), 8);
    assert!(HEADER.contains("MIXSTACK_ERR_INVALID_HANDLE = 9"), "the header documents the new status");
}

#[test]
fn foreign_pointer_to_a_local_is_refused_and_left_untouched() {
    let mut local: u64 = 0x0123_4567_89ab_cdef;
    let h = std::ptr::addr_of_mut!(local) as *mut mixstack_stack;
    assert_every_entry_point_refuses(std::hint::black_box(h));
    assert_eq!(std::hint::black_box(local), 0x0123_4567_89ab_cdef, "nothing was written through the handle");
}

#[test]
fn double_destroy_of_a_foreign_pointer_frees_nothing() {
    // Before the registry, the first destroy passed a stack address to the
    // allocator's free (a crash at best).
    let mut local: u64 = 0x0bad_f00d_0bad_f00d;
    let h = std::ptr::addr_of_mut!(local) as *mut mixstack_stack;
    for _ in 0..2 {
        let rc = unsafe { mixstack_release_cached_memory(null_mut()) };
        assert_eq!(rc, code(mixstack_status::MIXSTACK_ERR_NULL_POINTER));
        unsafe { mixstack_stack_destroy(std::hint::black_box(h)) };
        let msg = last_error();
        assert!(msg.starts_with("mixstack_stack_destroy:"), "destroy must record its error: {msg}");
        assert_fails(
            code(mixstack_status::MIXSTACK_ERR_INVALID_HANDLE),
            mixstack_status::MIXSTACK_ERR_INVALID_HANDLE,
            &msg,
            &["not a live stack handle", &format!("{h:p}")],
        );
    }
    assert_eq!(std::hint::black_box(local), 0x0bad_f00d_0bad_f00d);
}

#[test]
fn foreign_pointer_to_heap_memory_is_refused() {
    let mut block = vec![0xa5u8; 4096];
    let h = block.as_mut_ptr() as *mut mixstack_stack;
    assert_every_entry_point_refuses(h);
    assert!(block.iter().all(|&b| b == 0xa5), "nothing was written through the handle");
}

#[test]
fn dangling_pointer_is_refused() {
    // A freed heap block: before the registry, destroy freed it a second
    // time and the calls read freed memory.
    let p = Box::into_raw(Box::new([0u64; 64]));
    drop(unsafe { Box::from_raw(p) });
    assert_every_entry_point_refuses(p as *mut mixstack_stack);
}

#[test]
fn garbage_handle_values_are_refused() {
    for v in [0x8usize, 0x10, 0xdead_beef, usize::MAX, usize::MAX & !0xf, 1 << 47] {
        assert_every_entry_point_refuses(v as *mut mixstack_stack);
    }
}

#[test]
fn null_handle_keeps_its_status_and_destroy_null_stays_a_noop() {
    std::thread::spawn(|| {
        let rc = unsafe { mixstack_forward(null_mut(), 0, null(), null(), 0, null_mut(), null_mut(), null_mut()) };
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["handle"]);
        let rc = unsafe { mixstack_release_cached_memory(null_mut()) };
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["handle"]);
        let before = last_error();
        unsafe { mixstack_stack_destroy(null_mut()) };
        assert_eq!(last_error(), before, "destroy(NULL) is no failure: the text stays");
    })
    .join()
    .unwrap();
}

#[test]
fn scalar_checks_still_come_before_the_handle_check() {
    // A foreign handle with E < 0 or an unknown path code: the scalar error,
    // as for NULL (nothing is read either way).
    let mut local = 0u64;
    let h = std::ptr::addr_of_mut!(local) as *mut mixstack_stack;
    let rc = unsafe { mixstack_forward(h, -3, null(), null(), 0, null_mut(), null_mut(), null_mut()) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_SHAPE, &last_error(), &["E = -3"]);
    let rc =
        unsafe { mixstack_backward(h, 10, null(), null(), null(), null(), 1, null_mut(), null_mut(), 9, null_mut()) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_ARGUMENT, &last_error(), &["path", "9"]);
}

#[test]
fn header_states_the_handle_rules() {
    // The header's text without line breaks and the comments' leading `*`.
    let flat: String = HEADER.split_whitespace().filter(|w| *w != "*").collect::<Vec<_>>().join(" ");
    for needle in [
        "a handle must not be destroyed while another thread is in a call on it",
        "MIXSTACK_ERR_INVALID_HANDLE without reading anything through it",
        "guards against destroyed and foreign handles only",
    ] {
        assert!(flat.contains(needle), "include/mixstack.h should say `{needle}`");
    }
    let destroy_doc = flat.split("/* Destroy a stack").nth(1).expect("destroy's comment").split("*/").next().unwrap();
    assert!(destroy_doc.contains("MIXSTACK_ERR_INVALID_HANDLE"), "destroy's comment names the status: {destroy_doc}");
}

// ----------------------------------------------------------------------
// the handle registry with real handles (GPU; SKIPPED without one)
// ----------------------------------------------------------------------

/// F = 2, Cf = 32, lmax = 3, n_layers = 3 (vectors case 0), f32.
const SHAPE: (usize, usize, usize, usize) = (2, 32, 3, 3);
const E: usize = 97;

fn shape() -> StackShape {
    StackShape::new(SHAPE.0, SHAPE.1, SHAPE.2, SHAPE.3)
}

/// The device's primary context and its legacy default stream, or `None`
/// after printing the skip line.
fn gpu(test: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
    let ctx = common::device(test)?;
    let stream = ctx.default_stream();
    Some((ctx, stream))
}

fn zeros(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    stream.alloc_zeros::<f32>(n).expect("alloc_zeros")
}

fn addr(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> *const c_void {
    let (p, _sync) = s.device_ptr(stream);
    p as usize as *const c_void
}

/// A real f32 stack of [`SHAPE`] with zero weights, through the C ABI.
fn create_real(stream: &Arc<CudaStream>) -> *mut mixstack_stack {
    let sh = shape();
    let (w0, w1, gw) =
        (zeros(stream, sh.w0_len().unwrap()), zeros(stream, sh.w1_len().unwrap()), zeros(stream, sh.gw_len().unwrap()));
    stream.synchronize().unwrap();
    let (f, cf, lmax, n) = SHAPE;
    let mut h = null_mut();
    let rc = unsafe {
        mixstack_stack_create(
            MIXSTACK_DTYPE_F32,
            0,
            f as i64,
            cf as i64,
            lmax as i64,
            n as i64,
            addr(stream, &w0),
            addr(stream, &w1),
            addr(stream, &gw),
            null_mut(),
            &mut h,
        )
    };
    assert_eq!(rc, 0, "create: {}", last_error());
    assert!(!h.is_null());
    h
}

/// Device buffers of one forward over E edges: u0, alpha, out, z_all.
struct Io {
    u0: CudaSlice<f32>,
    alpha: CudaSlice<f32>,
    out: CudaSlice<f32>,
    z_all: CudaSlice<f32>,
}

impl Io {
    fn new(stream: &Arc<CudaStream>) -> Self {
        let sh = shape();
        let io = Io {
            u0: zeros(stream, sh.surface_len(E).unwrap()),
            alpha: zeros(stream, sh.alpha_len(E).unwrap()),
            out: zeros(stream, sh.surface_len(E).unwrap()),
            z_all: zeros(stream, sh.z_all_len(E).unwrap()),
        };
        stream.synchronize().unwrap();
        io
    }

    fn forward(&self, stream: &Arc<CudaStream>, h: *mut mixstack_stack) -> c_int {
        unsafe {
            mixstack_forward(
                h,
                E as i64,
                addr(stream, &self.u0),
                addr(stream, &self.alpha),
                1,
                addr(stream, &self.out) as *mut _,
                addr(stream, &self.z_all) as *mut _,
                null_mut(),
            )
        }
    }
}

#[test]
fn gpu_double_destroy_and_use_after_destroy_are_refused() {
    let Some((_ctx, stream)) = gpu("gpu_double_destroy_and_use_after_destroy_are_refused") else {
        return;
    };
    let io = Io::new(&stream);
    let h = create_real(&stream);
    #[cfg(target_pointer_width = "64")]
    assert!((h as usize) >> 48 != 0, "a handle is a tagged token, not an address: {h:p}");
    assert_eq!(io.forward(&stream, h), 0, "forward on a live handle: {}", last_error());
    let mut path: c_int = 77;
    assert_eq!(unsafe { mixstack_last_path(h, &mut path, null_mut(), 0) }, 0, "{}", last_error());
    assert_eq!(path, 0, "no backward yet");
    assert_eq!(unsafe { mixstack_release_cached_memory(h) }, 0, "{}", last_error());

    // First destroy: success, no error recorded.
    let before = last_error();
    unsafe { mixstack_stack_destroy(h) };
    assert_eq!(last_error(), before, "a successful destroy records nothing");
    // Every use after it, a second destroy included, is refused (before the
    // registry: a use after free, then a double free).
    assert_every_entry_point_refuses(h);
    assert_eq!(io.forward(&stream, h), code(mixstack_status::MIXSTACK_ERR_INVALID_HANDLE), "{}", last_error());

    // A later create never gets the destroyed handle back, and the
    // destroyed one stays invalid.
    let fresh: Vec<_> = (0..3).map(|_| create_real(&stream)).collect();
    for &g in &fresh {
        assert_ne!(g, h, "a destroyed handle value was handed out again");
        assert_eq!(io.forward(&stream, g), 0, "{}", last_error());
    }
    assert_every_entry_point_refuses(h);
    for &g in &fresh {
        unsafe { mixstack_stack_destroy(g) };
    }
    for &g in &fresh {
        assert_every_entry_point_refuses(g);
    }
    stream.synchronize().unwrap();
}

/// The precision of a live handle: set, run, read back. fp16x3 runs where
/// the device's build serves it and is refused as unsupported elsewhere; a
/// bad code is refused and leaves the handle's mode as it was.
#[test]
fn gpu_precision_is_set_run_and_reported() {
    let Some((ctx, stream)) = gpu("gpu_precision_is_set_run_and_reported") else {
        return;
    };
    let cc = mixstack::runtime::device::compute_capability(&ctx).unwrap();
    let serves = Dispatch::builtin()
        .for_device(cc)
        .unwrap()
        .with_precision(mixstack::runtime::Precision::Fp16x3)
        .check_precision(mixstack::kinds::Dtype::F32, SHAPE.1 as u32)
        .is_ok();
    let io = Io::new(&stream);
    let h = create_real(&stream);
    let last = || {
        let (mut f, mut b): (c_int, c_int) = (77, 77);
        assert_eq!(unsafe { mixstack_last_precision(h, &mut f, &mut b) }, 0, "{}", last_error());
        (f, b)
    };
    assert_eq!(last(), (0, 0), "nothing ran yet");
    assert_eq!(unsafe { mixstack_set_precision(h, MIXSTACK_PRECISION_EXACT) }, 0, "{}", last_error());
    assert_eq!(io.forward(&stream, h), 0, "{}", last_error());
    assert_eq!(last(), (MIXSTACK_PRECISION_EXACT, 0));
    assert_eq!(unsafe { mixstack_set_precision(h, MIXSTACK_PRECISION_FP16X3) }, 0, "{}", last_error());
    let rc = io.forward(&stream, h);
    if serves {
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(last().0, MIXSTACK_PRECISION_FP16X3);
    } else {
        assert_fails(rc, mixstack_status::MIXSTACK_ERR_UNSUPPORTED, &last_error(), &["fp16x3"]);
    }
    let rc = unsafe { mixstack_set_precision(h, 7) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_BAD_ARGUMENT, &last_error(), &["precision code 7"]);
    if serves {
        assert_eq!(io.forward(&stream, h), 0, "{}", last_error());
        assert_eq!(last().0, MIXSTACK_PRECISION_FP16X3, "a refused code changes nothing");
    }
    unsafe { mixstack_stack_destroy(h) };
    stream.synchronize().unwrap();
}

#[test]
fn gpu_destroy_racing_calls_on_another_thread_stays_safe() {
    // Against the header's rule (destroy while another thread is in a call),
    // yet it must not crash: the other thread's calls succeed until the
    // handle is gone, then are refused; none sees a freed stack.
    let Some((_ctx, stream)) = gpu("gpu_destroy_racing_calls_on_another_thread_stays_safe") else {
        return;
    };
    for round in 0..4 {
        let h = create_real(&stream) as usize;
        let started = Arc::new(std::sync::Barrier::new(2));
        let worker = {
            let (stream, started) = (stream.clone(), started.clone());
            std::thread::spawn(move || {
                let io = Io::new(&stream);
                let h = h as *mut mixstack_stack;
                let (mut ok, mut refused) = (0usize, 0usize);
                started.wait();
                for _ in 0..400 {
                    let rc = io.forward(&stream, h);
                    if rc == 0 {
                        assert_eq!(refused, 0, "a call succeeded after one was refused");
                        ok += 1;
                    } else {
                        assert_eq!(rc, code(mixstack_status::MIXSTACK_ERR_INVALID_HANDLE), "{}", last_error());
                        refused += 1;
                    }
                }
                stream.synchronize().unwrap();
                (ok, refused)
            })
        };
        started.wait();
        std::thread::sleep(std::time::Duration::from_micros(200 * round));
        unsafe { mixstack_stack_destroy(h as *mut mixstack_stack) };
        let (ok, refused) = worker.join().expect("worker thread");
        println!("round {round}: {ok} forwards before the destroy, {refused} refused after");
        assert_every_entry_point_refuses(h as *mut mixstack_stack);
    }
}

/// The precision codes are the header's, and a NULL handle or out-pointer is
/// refused by name before anything is read.
#[test]
fn precision_codes_and_null_arguments() {
    for (name, v) in [
        ("MIXSTACK_PRECISION_AUTO", MIXSTACK_PRECISION_AUTO),
        ("MIXSTACK_PRECISION_EXACT", MIXSTACK_PRECISION_EXACT),
        ("MIXSTACK_PRECISION_FP16X3", MIXSTACK_PRECISION_FP16X3),
    ] {
        assert!(HEADER.contains(&format!("#define {name} {v}")), "the header defines {name} {v}");
    }
    let rc = unsafe { mixstack_set_precision(null_mut(), MIXSTACK_PRECISION_EXACT) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["mixstack_set_precision"]);
    let (mut fwd, mut bwd): (c_int, c_int) = (77, 77);
    let rc = unsafe { mixstack_last_precision(null(), &mut fwd, &mut bwd) };
    assert_fails(rc, mixstack_status::MIXSTACK_ERR_NULL_POINTER, &last_error(), &["mixstack_last_precision"]);
    assert_eq!((fwd, bwd), (77, 77));
}
