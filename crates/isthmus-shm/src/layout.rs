//! Where everything lives in a segment. `docs/protocol.md` is the normative description.
//!
//! ```text
//! 0        control block (4 KiB): header, then one 1 KiB area per direction
//! ring[0]  client→server frame ring          (ring_size[0] bytes, power of two)
//! ring[1]  server→client frame ring          (ring_size[1])
//! rel[0]   release ring for arena[0]         (arena_size[0] / 4 KiB entries of 16 bytes)
//! rel[1]   release ring for arena[1] and the  ((arena_size[1] + shared_size) / 4 KiB entries)
//!          server's shared arena
//! arena[0] client-owned payload arena        (arena_size[0])
//! arena[1] server-owned payload arena        (arena_size[1])
//! ```
//!
//! Every region starts on a 4 KiB boundary. The layout is a pure function of the five sizes the
//! handshake agrees on, so neither side ever reads an offset from shared memory. The server's
//! shared arena (`shared_size`, possibly zero) is a memfd of its own, not part of the segment;
//! it counts here because its blocks come back on release ring 1.

use crate::error::{Error, Result};

/// Segment magic, written by the server at offset 0 (informational; never trusted).
pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"ISTHMSEG");
/// Size of the control block.
pub const CONTROL_LEN: usize = 4096;
/// Offset of direction `d`'s control area: 1024 for client→server, 2048 for server→client.
pub const fn control_base(dir: usize) -> usize {
    1024 + dir * 1024
}
/// Each control word sits alone on a 128-byte stretch (two cache lines), so the producer's and
/// consumer's words never share a line nor an adjacent-line prefetch pair.
pub const CONTROL_STRIDE: usize = 128;
/// Control word: frame-ring tail, written by the producer (u64 byte count, monotonic).
pub const CTL_TAIL: usize = 0;
/// Control word: frame-ring head, written by the consumer.
pub const CTL_HEAD: usize = CONTROL_STRIDE;
/// Control word: non-zero while the consumer sleeps on its doorbell (u32).
pub const CTL_CONSUMER_PARKED: usize = 2 * CONTROL_STRIDE;
/// Control word: non-zero while the producer sleeps waiting for ring or arena space (u32).
pub const CTL_PRODUCER_PARKED: usize = 3 * CONTROL_STRIDE;
/// Control word: release-ring tail, written by the consumer (entry count, monotonic).
pub const CTL_REL_TAIL: usize = 4 * CONTROL_STRIDE;
/// Control word: release-ring head, written by the producer.
pub const CTL_REL_HEAD: usize = 5 * CONTROL_STRIDE;
/// Control word: bytes of arena blocks the producer has taken for messages it is still writing
/// (u64). A hint for the consumer's spin, written by the producer; the consumer only bounds a
/// spin by it (ADR 0026).
pub const CTL_COMPOSING: usize = 6 * CONTROL_STRIDE;

const _: () = assert!(control_base(1) + 7 * CONTROL_STRIDE <= CONTROL_LEN);

/// Fixed size of a frame header in the ring.
pub const FRAME_HEADER_LEN: usize = 16;
/// Frames start on 8-byte boundaries; bodies are padded up to one.
pub const FRAME_ALIGN: usize = 8;
/// Arena blocks are whole multiples of this, and start on one.
pub const ARENA_GRANULE: usize = 4096;
/// Size of one release-ring entry: `{offset: u64, len: u64}`.
pub const RELEASE_ENTRY_LEN: usize = 16;
/// Set in a release entry's offset (and only there) when the block is one of the server's
/// shared arena rather than of the connection's own arena.
pub const SHARED_RELEASE: u64 = 1 << 63;

/// Direction index of client→server.
pub const CLIENT_TO_SERVER: usize = 0;
/// Direction index of server→client.
pub const SERVER_TO_CLIENT: usize = 1;

const PAGE: usize = 4096;

/// Offsets and sizes of one segment, derived from the negotiated sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Frame-ring bytes per direction.
    pub ring_size: [usize; 2],
    /// Arena bytes per direction.
    pub arena_size: [usize; 2],
    /// Bytes of the server's shared arena (zero if it has none).
    pub shared_size: usize,
    /// Offset of each frame ring.
    pub ring_off: [usize; 2],
    /// Offset of each release ring.
    pub rel_off: [usize; 2],
    /// Entries in each release ring.
    pub rel_cap: [usize; 2],
    /// Offset of each arena.
    pub arena_off: [usize; 2],
    /// Total segment size.
    pub total: usize,
}

fn page_align(n: usize) -> Option<usize> {
    n.checked_add(PAGE - 1).map(|v| v & !(PAGE - 1))
}

impl Layout {
    /// Lays out a segment; sizes must already be validated (power-of-two rings, granular arenas).
    pub fn new(ring_size: [usize; 2], arena_size: [usize; 2], shared_size: usize) -> Result<Layout> {
        let overflow = || Error::protocol("segment sizes overflow the address space");
        let mut off = CONTROL_LEN;
        let mut ring_off = [0; 2];
        for d in 0..2 {
            ring_off[d] = off;
            off = off.checked_add(ring_size[d]).and_then(page_align).ok_or_else(overflow)?;
        }
        let mut rel_off = [0; 2];
        let mut rel_cap = [0; 2];
        for d in 0..2 {
            rel_off[d] = off;
            // The server's shared blocks come back on the server→client ring (ADR 0016).
            let shared = if d == SERVER_TO_CLIENT { shared_size } else { 0 };
            rel_cap[d] = arena_size[d].checked_add(shared).ok_or_else(overflow)? / ARENA_GRANULE;
            let bytes = rel_cap[d].checked_mul(RELEASE_ENTRY_LEN).ok_or_else(overflow)?;
            off = off.checked_add(bytes).and_then(page_align).ok_or_else(overflow)?;
        }
        let mut arena_off = [0; 2];
        for d in 0..2 {
            arena_off[d] = off;
            off = off.checked_add(arena_size[d]).and_then(page_align).ok_or_else(overflow)?;
        }
        Ok(Layout { ring_size, arena_size, shared_size, ring_off, rel_off, rel_cap, arena_off, total: off })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_page_aligned_and_disjoint() {
        let l = Layout::new([1 << 12, 1 << 20], [64 << 10, 1 << 26], 1 << 20).expect("layout");
        assert_eq!(l.rel_cap, [16, (1 << 14) + 256]);
        let mut regions = vec![(0, CONTROL_LEN)];
        for d in 0..2 {
            regions.push((l.ring_off[d], l.ring_size[d]));
            regions.push((l.rel_off[d], l.rel_cap[d] * RELEASE_ENTRY_LEN));
            regions.push((l.arena_off[d], l.arena_size[d]));
        }
        regions.sort();
        for w in regions.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
            assert_eq!(w[1].0 % PAGE, 0);
        }
        let last = regions.last().expect("regions");
        assert!(last.0 + last.1 <= l.total);
    }
}
