//! Arithmetic claims made in the CUDA templates, checked on the CPU.

/// templates/core.cuh `DivBy`: n / d as the high word of n * ceil(2^32 / d),
/// claimed exact for n < 2^20 and 2 <= d < 2^12. The floor can only go wrong
/// where n % d is largest and n is large, so every divisor is checked at
/// n = q * d - 1 and q * d across the range and on the last 2d values of it.
#[test]
fn div_by_magic_is_exact_over_the_stated_range() {
    const N: u64 = 1 << 20;
    let div = |n: u64, d: u64| -> u64 {
        let magic = (0xffff_ffffu32 / d as u32).wrapping_add(1) as u64;
        (n * magic) >> 32
    };
    for d in 2u64..(1 << 12) {
        let check = |n: u64| assert_eq!(div(n, d), n / d, "n = {n}, d = {d}");
        let mut q = 1;
        while q * d < N {
            check(q * d - 1);
            check(q * d);
            q += 1 + q / 64;
        }
        for n in N - 2 * d..N {
            check(n);
        }
    }
}
