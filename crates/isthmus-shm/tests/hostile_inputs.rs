//! The decoders of peer data (the fuzz targets' entry points) on inputs fixed here, and on a
//! fuzz corpus when `ISTHMUS_FUZZ_CORPUS` names one (`fuzz/corpus`, with a directory per
//! target). Natively this is a quick regression check; its purpose is `make miri`, where Miri
//! runs the same code and fails on any undefined behaviour in the unsafe code that reads a
//! hostile peer's ring, cursors and arena, which the fuzzers' sanitizers may not see.

use std::path::PathBuf;

use isthmus_shm::fuzz;

/// Deterministic inputs: a few shapes that reach past the first checks (frames that parse,
/// cursors near the ring's size), then pseudo-random bytes of many lengths.
fn inputs(count: usize) -> Vec<Vec<u8>> {
    let mut out = vec![vec![], vec![0; 16], vec![0xff; 64], vec![0; 4096 + 64]];
    // A tail cursor of 48, and a frame header with a small body after the 16 bytes of cursors.
    let mut framed = 48u64.to_le_bytes().to_vec();
    framed.extend_from_slice(&[0; 8]);
    framed.extend_from_slice(&[16, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    framed.extend_from_slice(&[0x5a; 32]);
    out.push(framed);
    let mut rng = 0x2545f4914f6cdd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for i in 0..count {
        let len = [8, 16, 40, 100, 300, 1000, 5000][i % 7];
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if i % 2 == 0 && len >= 16 {
            // Keep the tail cursor inside the ring most of the time, so frames get read.
            bytes[..8].copy_from_slice(&(next() % 4096).to_le_bytes());
        }
        out.push(bytes);
    }
    out
}

/// The corpus files of `target`, if `ISTHMUS_FUZZ_CORPUS` is set: at most `limit` of them, in
/// name order (Miri takes seconds per input), or `ISTHMUS_FUZZ_CORPUS_LIMIT` for a long run.
fn corpus(target: &str, limit: usize) -> Vec<Vec<u8>> {
    let Some(root) = std::env::var_os("ISTHMUS_FUZZ_CORPUS") else { return vec![] };
    let limit = std::env::var("ISTHMUS_FUZZ_CORPUS_LIMIT").ok().and_then(|n| n.parse().ok()).unwrap_or(limit);
    let dir = PathBuf::from(root).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return vec![] };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    paths.sort();
    paths.truncate(limit);
    paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

fn run(target: &str, entry: fn(&[u8])) {
    let (generated, from_corpus) = if cfg!(miri) { (12, 12) } else { (2_000, usize::MAX) };
    let mut all = inputs(generated);
    all.extend(corpus(target, from_corpus));
    for input in &all {
        entry(input);
    }
}

#[test]
fn frame_headers_and_descriptors() {
    run("frame", fuzz::frame);
}

#[test]
fn handshake_records() {
    run("handshake", fuzz::handshake);
}

#[test]
fn rings_cursors_and_releases() {
    run("ring", fuzz::ring);
}

#[test]
fn a_receivers_frames_and_messages() {
    run("receive", fuzz::receive);
}
