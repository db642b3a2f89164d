//! Copying a message into shared memory: plain `memcpy` up to a size, then stores that bypass
//! the cache (ADR 0022).
//!
//! A copy into a block is read once, by the other process, usually on the other core. While the
//! copy's source, its block and the peer's copy of it fit in the last-level cache together,
//! `memcpy` is best: the peer reads the block from the cache. Past that, `memcpy`'s stores first
//! read each destination line in (for ownership) only to evict lines the copy itself still
//! needs, and the peer reads the block from memory anyway. Non-temporal stores (`movntdq`)
//! write whole lines straight to memory with no read. Measured on a 2-vCPU host with a 32 MiB
//! L3 (`bench`'s `floor-copy`: both sides copy, one hand-over each way): 16 MiB 1.6-1.9 ms
//! against 2.9-5.8 ms with `memcpy`, 8 MiB 0.73 ms against 0.78-0.94 ms, while at 4 MiB and below
//! `memcpy` won (0.28 ms against 0.31 ms). Hence the bound: a quarter of the last-level cache,
//! read from sysfs once per process (8 MiB if it cannot be), or `ISTHMUS_STREAMING_COPY_MIN`
//! (bytes; `0` streams every copy, a huge value never does).
//!
//! A streaming copy also asks for its source two pages ahead (`prefetchnta`). Its source is
//! usually a block the other process just streamed out, so it comes from memory, and the
//! hardware's prefetchers stop at every 4 KiB page boundary: without the hint the reads stall
//! at each one. With it, `floor-copy` at 16 MiB went from 1.7-2.0 ms to 1.43-1.46 ms here
//! (ADR 0023).
//!
//! Where the CPU has AVX2 it moves a cache line in two 32-byte streaming stores, not four of 16
//! (SSE2, which every x86-64 has): Go's raw 16 MiB echo fell from 1.63-1.89 to 1.49-1.59 ms on
//! an AMD EPYC host, the transport's own within the noise (ADR 0022). 64-byte stores (AVX-512)
//! measured no better there.
//!
//! Below the bound, a copy whose source and destination sit at different offsets within a
//! 64-byte line (their addresses differ by other than a multiple of 64), from 2 KiB on, goes
//! through a loop of 32-byte loads and stores where the CPU has AVX2, not `memcpy`. glibc copies
//! that range with `rep movsb`, which on an AMD EPYC host (FSRM) ran 14-28x slower so placed
//! than aligned: 64 KiB in 23.8 µs against 1.36 µs, 4 KiB in 1.41 µs against 0.05 µs, 256 KiB in
//! 98 µs against 7.2 µs; the loop took 1.65, 0.08 and 7.5 µs (`memcpy` streams from about 1 MiB
//! on, unaffected). Where a block's payload lands against the caller's buffer is chance, so this
//! made a 64 KiB call cost twice the transport's on that host and not on another (ADR 0032).
//! That loop is for AMD's CPUs (and Hygon's, of the same design) only: on an Intel Xeon host
//! (ERMS and FSRM) `rep movsb` copied misplaced buffers into a block the peer had just read
//! faster than the loop, whose 32-byte stores must each first fetch their line back from the
//! other core, where whole-line string stores need not. The engine's echo there, p50 of three
//! alternated rounds, loop against `memcpy`: 16 KiB 6.47-6.53 against 5.80-5.88 µs, 64 KiB
//! 16.8-17.1 against 13.8-14.0 µs, 100 KiB 24.4-24.5 against 19.6-20.0 µs, 1 MiB 145-152
//! against 138-147 µs (ADR 0032's amendment of 2026-12-06).
//!
//! Only x86-64 has these paths; elsewhere every copy is `memcpy`.

use std::sync::OnceLock;

/// The bound when sysfs does not tell the last-level cache's size.
const DEFAULT_MIN: usize = 8 << 20;

/// Copies `src` into `dst`, which must be as long, the way a block of shared memory is best
/// filled for a reader in another process: see the module's documentation. The copy is
/// complete and ordered before any later store (an `sfence` ends a streaming one), so a release
/// store that publishes the block afterwards publishes these bytes too.
///
/// # Panics
///
/// If the lengths differ, as [`slice::copy_from_slice`] does.
pub fn copy_into_shared(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_into_shared: the lengths differ");
    if src.len() >= streaming_min() {
        streaming_copy(dst, src);
    } else if src.len() >= MISPLACED_MIN && misplaced(dst, src) && rep_movsb_slow_when_misplaced() {
        misplaced_copy(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// The size from which a copy between buffers at different offsets in a line avoids `memcpy`
/// (glibc's `rep movsb` starts at 2 KiB with AVX2).
const MISPLACED_MIN: usize = 2 << 10;

/// Whether `dst` and `src` start at different offsets within a 64-byte line.
fn misplaced(dst: &[u8], src: &[u8]) -> bool {
    (dst.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize) % 64 != 0
}

/// Whether this CPU's `rep movsb` (glibc's `memcpy` from 2 KiB) is slow between buffers at
/// different offsets in a line: AMD's and Hygon's are (ADR 0032); Intel's are not (above).
fn rep_movsb_slow_when_misplaced() -> bool {
    static SLOW: OnceLock<bool> = OnceLock::new();
    *SLOW.get_or_init(|| matches!(&cpu_vendor(), b"AuthenticAMD" | b"HygonGenuine"))
}

/// The CPU's vendor string (`cpuid` leaf 0); zeros where there is no `cpuid`.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn cpu_vendor() -> [u8; 12] {
    // SAFETY: every x86-64 CPU has `cpuid`, and leaf 0 on all of them. (A safe function from
    // Rust 1.87 on; the crate's `rust-version` is older.)
    #[allow(unused_unsafe)]
    let id = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut vendor = [0u8; 12];
    for (chunk, word) in vendor.chunks_exact_mut(4).zip([id.ebx, id.edx, id.ecx]) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    vendor
}

#[cfg(any(not(target_arch = "x86_64"), miri))]
fn cpu_vendor() -> [u8; 12] {
    [0; 12]
}

#[cfg(target_arch = "x86_64")]
fn misplaced_copy(dst: &mut [u8], src: &[u8]) {
    #[cfg(not(miri))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, which is all `cached_copy_avx2` asks.
        return unsafe { cached_copy_avx2(dst, src) };
    }
    dst.copy_from_slice(src);
}

#[cfg(not(target_arch = "x86_64"))]
fn misplaced_copy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// Copies `src` into `dst` (as long) through the cache, 128 bytes per step in 32-byte loads
/// and stores that take any alignment, then the tail with `memcpy` (under 128 bytes, which it
/// moves with vector registers, not `rep movsb`).
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn cached_copy_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};

    const STEP: usize = 128;
    let body = dst.len().min(src.len()) / STEP * STEP;
    let (d, s) = (dst[..body].as_mut_ptr().cast::<__m256i>(), src[..body].as_ptr().cast::<__m256i>());
    let mut at = 0;
    while at < body / 32 {
        // SAFETY: `at + 4 <= body / 32`, so the four 32-byte lanes lie inside the first `body`
        // bytes of `dst` and `src` (the slices above); unaligned loads and stores take any
        // address; the CPU has AVX2 (this function's contract).
        unsafe {
            let (a, b) = (_mm256_loadu_si256(s.add(at)), _mm256_loadu_si256(s.add(at + 1)));
            let (c, e) = (_mm256_loadu_si256(s.add(at + 2)), _mm256_loadu_si256(s.add(at + 3)));
            _mm256_storeu_si256(d.add(at), a);
            _mm256_storeu_si256(d.add(at + 1), b);
            _mm256_storeu_si256(d.add(at + 2), c);
            _mm256_storeu_si256(d.add(at + 3), e);
        }
        at += 4;
    }
    dst[body..].copy_from_slice(&src[body..]);
}

/// [`copy_into_shared`] for a binding's caller, whose source may lie inside the destination
/// block itself (a view of it from Python, a pointer into it from C): overlapping ranges are
/// moved as `memmove` moves them, others copied as `copy_into_shared` copies.
///
/// # Safety
///
/// `dst` is valid for writes of `len` bytes and `src` for reads of `len` bytes, and nothing
/// else reads or writes `dst`'s bytes meanwhile. The two ranges may overlap.
pub unsafe fn move_into_shared(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    if len == 0 {
        return;
    }
    if d < s.saturating_add(len) && s < d.saturating_add(len) {
        // SAFETY: both ranges are valid for `len` bytes (the caller's promise); `ptr::copy`
        // allows them to overlap, and no reference to either is formed.
        unsafe { std::ptr::copy(src, dst, len) };
    } else {
        // SAFETY: valid for `len` bytes each (the caller's promise), apart, and `dst`'s bytes
        // are this call's alone, so the two slices alias nothing.
        let (dst, src) = unsafe { (std::slice::from_raw_parts_mut(dst, len), std::slice::from_raw_parts(src, len)) };
        copy_into_shared(dst, src);
    }
}

/// The size from which copies stream, worked out once per process.
fn streaming_min() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| {
        if let Some(n) = std::env::var("ISTHMUS_STREAMING_COPY_MIN").ok().and_then(|v| v.trim().parse().ok()) {
            return n;
        }
        bound(last_level_cache())
    })
}

/// The bound for a last-level cache of `llc` bytes, if known.
fn bound(llc: Option<usize>) -> usize {
    llc.map_or(DEFAULT_MIN, |llc| (llc / 4).max(1 << 20))
}

/// The size of the largest cache of CPU 0, in bytes, as sysfs gives it.
fn last_level_cache() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| cache_size(&std::fs::read_to_string(e.ok()?.path().join("size")).ok()?)).max()
}

/// A sysfs cache size ("32768K", "1M") in bytes.
fn cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: usize = digits.parse().ok()?;
    match unit {
        "K" => n.checked_mul(1 << 10),
        "M" => n.checked_mul(1 << 20),
        "G" => n.checked_mul(1 << 30),
        "" => Some(n),
        _ => None,
    }
}

/// The line a streaming copy moves per step.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 64;

/// How far ahead a streaming copy asks for its source. The hardware's prefetchers stop at each
/// 4 KiB page boundary, so a source larger than the cache (usually just written by the other
/// process) is read in bursts; asking two pages ahead keeps the reads going across them.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 8 << 10;

#[cfg(target_arch = "x86_64")]
fn streaming_copy(dst: &mut [u8], src: &[u8]) {
    // Miri cannot run AVX2's streaming store; the SSE2 loop has a stand-in for it.
    #[cfg(not(miri))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, which is all `streaming_copy_avx2` asks.
        return unsafe { streaming_copy_avx2(dst, src) };
    }
    streaming_copy_sse2(dst, src)
}

/// The frame both streaming copies share: a plain copy up to `dst`'s first `align`-byte
/// boundary (streaming stores need it), then `line(d, s)` for each whole line, with the source
/// asked for `AHEAD` bytes on, then a plain copy of the tail. The caller fences.
///
/// # Safety
///
/// `line` may assume that `d` is valid for a `LINE`-byte write and `align`-aligned, and `s`
/// valid for a `LINE`-byte read, and must be sound under that. `align` divides `LINE`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream_lines(dst: &mut [u8], src: &[u8], align: usize, line: impl Fn(*mut u8, *const u8)) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA};

    let head = dst.as_ptr().align_offset(align).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / LINE * LINE;
    let (d, s) = (dst[head..head + body].as_mut_ptr(), src[head..head + body].as_ptr());
    let mut at = 0;
    while at < body {
        // SAFETY: `at + LINE <= body`, and `d`/`s` point at `body` bytes of `dst`/`src` (the
        // slices above), so the line is in bounds, and so is the prefetch's address. `d + at`
        // is `align`-aligned: `d` is (the head above), and `at` is a multiple of `LINE`, which
        // `align` divides. That is what `line` may assume.
        unsafe {
            if at + AHEAD < body {
                _mm_prefetch::<_MM_HINT_NTA>(s.add(at + AHEAD).cast::<i8>());
            }
            line(d.add(at), s.add(at));
        }
        at += LINE;
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

/// [`streaming_copy`] with 32-byte loads and streaming stores.
///
/// # Safety
///
/// The CPU has AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn streaming_copy_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};

    let line = |d: *mut u8, s: *const u8| {
        let (d, s) = (d.cast::<__m256i>(), s.cast::<__m256i>());
        // SAFETY: both halves of the line are in bounds and `d` is 32-byte aligned
        // (`stream_lines`' promise); loads take any alignment; the CPU has AVX2 (this
        // function's contract, which the closure inherits).
        unsafe {
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
        }
    };
    // SAFETY: `line` is sound for what `stream_lines` promises (a 32-byte-aligned writable
    // line and a readable one), and 32 divides 64.
    unsafe { stream_lines(dst, src, 32, line) };
    // Orders the weakly ordered streaming stores before every later store, such as the
    // release store that publishes the block. (Safe to call here: the function enables
    // the features it needs.)
    std::arch::x86_64::_mm_sfence();
}

/// [`streaming_copy`] with the 16-byte loads and streaming stores every x86-64 has.
#[cfg(target_arch = "x86_64")]
fn streaming_copy_sse2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128};

    let line = |d: *mut u8, s: *const u8| {
        let (d, s) = (d.cast::<__m128i>(), s.cast::<__m128i>());
        // SAFETY: the four quarters of the line are in bounds and `d` is 16-byte aligned
        // (`stream_lines`' promise); loads take any alignment; SSE2 is part of x86-64.
        unsafe {
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            stream(d, a);
            stream(d.add(1), b);
            stream(d.add(2), c);
            stream(d.add(3), e);
        }
    };
    // SAFETY: `line` is sound for what `stream_lines` promises (a 16-byte-aligned writable
    // line and a readable one), and 16 divides 64.
    unsafe { stream_lines(dst, src, 16, line) };
    // SAFETY: a fence has no preconditions. It orders the weakly ordered streaming stores
    // before every later store, such as the release store that publishes the block.
    #[cfg(not(miri))]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// One streaming store of 16 bytes to `d`, which must be 16-byte aligned.
///
/// # Safety
///
/// `d` is valid for a 16-byte write and 16-byte aligned.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream(d: *mut std::arch::x86_64::__m128i, v: std::arch::x86_64::__m128i) {
    // SAFETY: the caller's promise.
    #[cfg(not(miri))]
    unsafe {
        std::arch::x86_64::_mm_stream_si128(d, v)
    };
    // Miri cannot run the instruction (stdarch writes it in inline assembly): a plain store
    // stands in, after the alignment the real one needs is checked. Bounds and alignment are
    // what Miri is asked about.
    #[cfg(miri)]
    {
        assert!(d.is_aligned(), "a streaming store needs 16-byte alignment");
        // SAFETY: the caller's promise.
        unsafe { std::arch::x86_64::_mm_storeu_si128(d, v) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn streaming_copy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `copy` is exact, and writes nothing outside its destination, at every alignment of
    /// source and destination and at lengths around a line and past the prefetch distance.
    fn exact_at_every_alignment_and_length(copy: impl Fn(&mut [u8], &[u8])) {
        let src: Vec<u8> = (0..(AHEAD_FOR_TESTS + 4096 + 200)).map(|i| (i * 7 + 3) as u8).collect();
        for from in [0, 1, 7, 16, 33] {
            for to in [0, 1, 9, 16, 31, 32, 63] {
                for len in [0, 1, 15, 16, 31, 32, 63, 64, 65, 127, 128, 1000, 4096, AHEAD_FOR_TESTS + 4096] {
                    let mut dst = vec![0xeeu8; len + to + 8];
                    copy(&mut dst[to..to + len], &src[from..from + len]);
                    assert_eq!(&dst[to..to + len], &src[from..from + len], "from {from} to {to} len {len}");
                    assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0xee), "wrote outside");
                }
            }
        }
    }

    /// Past the prefetch distance where it applies; small enough for Miri otherwise.
    #[cfg(target_arch = "x86_64")]
    const AHEAD_FOR_TESTS: usize = if cfg!(miri) { 0 } else { AHEAD };
    #[cfg(not(target_arch = "x86_64"))]
    const AHEAD_FOR_TESTS: usize = 0;

    /// [`exact_at_every_alignment_and_length`] for a copy that needs AVX2, where the CPU has it.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn exact_where_the_cpu_has_avx2(copy: unsafe fn(&mut [u8], &[u8])) {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 on this CPU: its copy is not run here");
            return;
        }
        // SAFETY: AVX2 was just detected, which is all either AVX2 copy asks.
        exact_at_every_alignment_and_length(|d, s| unsafe { copy(d, s) });
    }

    #[test]
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn the_vendor_is_the_kernels() {
        let vendor = cpu_vendor();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let kernels = cpuinfo.lines().find_map(|l| l.strip_prefix("vendor_id")).expect("a vendor_id line");
        assert_eq!(kernels.trim_start_matches([' ', '\t', ':']), String::from_utf8_lossy(&vendor));
    }

    #[test]
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn the_avx2_cached_copy_is_exact_where_the_cpu_has_it() {
        exact_where_the_cpu_has_avx2(cached_copy_avx2);
    }

    #[test]
    fn a_copy_into_shared_memory_is_exact_at_every_alignment_and_length() {
        // Below the streaming bound: misplaced copies from 2 KiB on take the loop on AMD's CPUs.
        exact_at_every_alignment_and_length(copy_into_shared);
    }

    #[test]
    fn a_streaming_copy_is_exact_at_every_alignment_and_length() {
        exact_at_every_alignment_and_length(streaming_copy);
    }

    #[test]
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn the_sse2_streaming_copy_is_exact_too() {
        // The copy every x86-64 falls back to, checked where AVX2 takes the usual path. (Under
        // Miri the usual path is this one, checked by the test above.)
        exact_at_every_alignment_and_length(streaming_copy_sse2);
    }

    #[test]
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn the_avx2_streaming_copy_is_exact_where_the_cpu_has_it() {
        exact_where_the_cpu_has_avx2(streaming_copy_avx2);
    }

    #[test]
    #[cfg_attr(miri, ignore = "megabytes to interpret; the streaming copy's own test covers its unsafe code")]
    fn copies_of_either_kind_agree() {
        let src: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        copy_into_shared(&mut dst, &src);
        assert_eq!(dst, src);
        dst.fill(0);
        streaming_copy(&mut dst[3..], &src[3..]);
        assert_eq!(dst[3..], src[3..]);
    }

    #[test]
    fn a_move_within_one_buffer_is_memmove_and_a_move_between_two_a_copy() {
        // Past the streaming bound, but small enough for Miri (`make miri` lowers the bound).
        let big = if cfg!(miri) { 8 << 10 } else { 9 << 20 };
        let original: Vec<u8> = (0..big + 67).map(|i| (i % 253) as u8).collect();
        for (from, to, len) in [(0, 1, 4096), (1, 0, 4096), (5, 5, 100), (0, 64, big), (64, 0, big)] {
            let mut buf = original.clone();
            let mut want = original.clone();
            want.copy_within(from..from + len, to);
            let p = buf.as_mut_ptr();
            // SAFETY: both ranges lie inside `buf`, which nothing else touches meanwhile.
            unsafe { move_into_shared(p.add(to), p.add(from), len) };
            assert!(buf == want, "from {from} to {to} len {len}");
        }
        let mut dst = vec![0u8; original.len()];
        // SAFETY: two distinct buffers of `original.len()` bytes.
        unsafe { move_into_shared(dst.as_mut_ptr(), original.as_ptr(), original.len()) };
        assert!(dst == original, "a move between two buffers");
        // SAFETY: zero bytes: nothing is read or written, whatever the pointers.
        unsafe { move_into_shared(std::ptr::null_mut(), std::ptr::null(), 0) };
    }

    #[test]
    fn the_bound_is_at_least_a_mebibyte() {
        for llc in [None, Some(0), Some(512 << 10), Some(2 << 20), Some(32 << 20), Some(usize::MAX)] {
            assert!(bound(llc) >= 1 << 20, "{llc:?}");
        }
        assert_eq!(bound(Some(32 << 20)), 8 << 20);
    }

    #[test]
    fn sysfs_cache_sizes_parse() {
        assert_eq!(cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(cache_size("1M"), Some(1 << 20));
        assert_eq!(cache_size("4096"), Some(4096));
        assert_eq!(cache_size("12Q"), None);
        assert_eq!(cache_size("K"), None);
        assert_eq!(cache_size("99999999999999999999G"), None);
    }
}
