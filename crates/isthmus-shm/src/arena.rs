//! Payload arenas: the owner's allocator and the receiver's leases on the peer's blocks.
//!
//! Each side allocates only from its own arena; the allocator's bookkeeping lives here, in this
//! process's private memory, so the peer can neither corrupt it nor free what it was not given.
//! The receiver hands blocks back through the release ring; the owner checks every release
//! against the blocks it actually has out.
//!
//! - `ArenaOwner` reclaims, then allocates: every allocation first drains the release ring and
//!   checks each entry, so the blocks just released, whose pages are warm, are reused first and a
//!   bogus release is caught at the next allocation rather than when the arena runs full.
//!   `can_alloc(len)` (drain, then ask whether `len` fits) is the condition of a wait for arena
//!   room. On a server it also keeps the shared-arena blocks lent to the peer (`lend`, one
//!   reference per block), which come back on the same ring with the offset's top bit set.
//! - `Releaser` returns the peer's blocks from any thread: a 16-byte push under a private mutex,
//!   then the owner's doorbell if it sleeps. A full or corrupted release ring is a protocol error
//!   found in a destructor: it hangs the connection up at once.
//! - `Lease` is a received block: a zero-copy view (the one slice over peer-writable memory on the
//!   receive path, ADR 0003) whose drop releases, and `copy_into`, a raw copy out into a private
//!   buffer that forms no slice. `Lease::shared` views a block of the server's shared arena,
//!   which this side maps read-only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) use crate::allocator::Allocator;
use crate::doorbell::{wake_if_parked, Bell};
use crate::error::{Error, Result};
use crate::layout;
use crate::link::Health;
use crate::ring::{ReleaseConsumer, ReleaseEntry, ReleaseProducer};
use crate::segment::{Region, Segment};
use crate::shared::{SharedBlock, SharedView};

/// The owner's side of its arena: the allocator plus the ring the peer returns blocks on, and
/// the server's shared blocks the peer holds (it returns them on the same ring, tagged).
#[derive(Debug)]
pub(crate) struct ArenaOwner {
    alloc: Allocator,
    releases: ReleaseConsumer,
    region: Region,
    /// Shared blocks sent on this connection and not yet given back, by offset: at most one
    /// reference per block, which bounds the release ring (ADR 0016).
    lent: HashMap<u64, SharedBlock>,
}

impl ArenaOwner {
    pub(crate) fn new(seg: &Arc<Segment>, dir: usize) -> ArenaOwner {
        let l = *seg.layout();
        ArenaOwner {
            alloc: Allocator::new(l.arena_size[dir]),
            releases: ReleaseConsumer::new(seg.clone(), dir),
            region: seg.region(l.arena_off[dir], l.arena_size[dir]),
            lent: HashMap::new(),
        }
    }

    /// Takes back everything the peer released.
    pub(crate) fn reclaim(&mut self) -> Result<usize> {
        let (alloc, lent) = (&mut self.alloc, &mut self.lent);
        self.releases.drain(|e| {
            if e.offset & layout::SHARED_RELEASE != 0 {
                let off = e.offset & !layout::SHARED_RELEASE;
                return match lent.get(&off) {
                    // Dropping our reference frees the block if nobody else holds it.
                    Some(b) if b.len() as u64 == e.len => {
                        lent.remove(&off);
                        Ok(())
                    }
                    _ => Err(Error::protocol(format!(
                        "the peer released shared block {{offset {off}, len {}}}, which it does not hold",
                        e.len
                    ))),
                };
            }
            let off = usize::try_from(e.offset).map_err(|_| Error::protocol("release offset out of range"))?;
            let len = usize::try_from(e.len).map_err(|_| Error::protocol("release length out of range"))?;
            alloc.free(off, len)
        })
    }

    /// Allocates `len` bytes. Releases are reclaimed first, every time: the lowest, most
    /// recently used (already faulted-in) blocks then come back first, and a bogus release is
    /// caught at once rather than when the arena runs full.
    pub(crate) fn try_alloc(&mut self, len: usize) -> Result<Option<(usize, u64, *mut u8)>> {
        self.reclaim()?;
        let Some((off, generation)) = self.alloc.alloc(len) else { return Ok(None) };
        // SAFETY: the allocator only hands out offsets with `off + len <= size`, the region's
        // length, so the pointer stays inside the region.
        Ok(Some((off, generation, unsafe { self.region.ptr().add(off) })))
    }

    /// See [`Allocator::mark_in_flight`].
    pub(crate) fn mark_in_flight(&mut self, off: usize, generation: u64) -> bool {
        self.alloc.mark_in_flight(off, generation)
    }

    /// True if `len` bytes could be allocated now (after reclaiming releases).
    pub(crate) fn can_alloc(&mut self, len: usize) -> Result<bool> {
        self.reclaim()?;
        Ok(self.alloc.fits(len))
    }

    /// Returns a block that was allocated but never (successfully) sent.
    pub(crate) fn free_unsent(&mut self, off: usize, generation: u64) {
        self.alloc.free_own(off, generation);
    }

    pub(crate) fn allocator(&self) -> &Allocator {
        &self.alloc
    }

    /// Records that `block` is about to be sent on this connection; false if the peer holds it
    /// already (the caller then sends a copy: one reference per connection bounds the ring).
    pub(crate) fn lend(&mut self, block: &SharedBlock) -> bool {
        let off = block.offset() as u64;
        if self.lent.contains_key(&off) {
            return false;
        }
        self.lent.insert(off, block.clone());
        true
    }

    /// Forgets a block whose send failed: the peer never saw it.
    pub(crate) fn unlend(&mut self, block: &SharedBlock) {
        self.lent.remove(&(block.offset() as u64));
    }

    /// The connection has ended: takes back what the peer released (a damaged ring only stops
    /// that), then hands over the blocks it still holds, which it may still read.
    pub(crate) fn end_lending(&mut self) -> Vec<SharedBlock> {
        let _ = self.reclaim();
        self.lent.drain().map(|(_, b)| b).collect()
    }

    /// Shared blocks the peer holds now.
    pub(crate) fn lent(&self) -> usize {
        self.lent.len()
    }
}

/// Hands the peer's blocks back, from whichever thread drops the last view of one.
#[derive(Debug)]
pub(crate) struct Releaser {
    ring: Mutex<ReleaseProducer>,
    seg: Arc<Segment>,
    dir: usize,
    peer_tx_bell: Arc<Bell>,
    health: Arc<Health>,
    /// The server's shared arena, mapped read-only (a client of a server that has one).
    shared: Option<Arc<SharedView>>,
}

impl Releaser {
    pub(crate) fn new(
        seg: Arc<Segment>,
        dir: usize,
        peer_tx_bell: Arc<Bell>,
        health: Arc<Health>,
        shared: Option<Arc<SharedView>>,
    ) -> Releaser {
        Releaser { ring: Mutex::new(ReleaseProducer::new(seg.clone(), dir)), seg, dir, peer_tx_bell, health, shared }
    }

    /// Length of the peer's shared arena; zero if it has none.
    pub(crate) fn shared_len(&self) -> usize {
        self.shared.as_ref().map_or(0, |v| v.len())
    }

    fn release(&self, offset: u64, len: u64) {
        if self.health.is_closed() {
            return; // the peer is gone or misbehaved; nobody will reuse the block
        }
        let pushed = match self.ring.lock() {
            Ok(mut ring) => ring.push(ReleaseEntry { offset, len }),
            Err(_) => Err(Error::protocol("release ring lock poisoned")),
        };
        match pushed {
            Ok(()) => {
                wake_if_parked(self.seg.ctl_u32(self.dir, layout::CTL_PRODUCER_PARKED), &self.peer_tx_bell);
            }
            Err(e) => self.health.fail_and_hang_up(e),
        }
    }
}

/// A received block of the peer's arena, read in place; dropping it gives the block back.
///
/// The bytes are the peer's: a well-behaved peer never touches a block between sending it and
/// getting it back, but a hostile one could, so treat them as untrusted input as any message is.
#[derive(Debug)]
pub(crate) struct Lease {
    ptr: *const u8,
    len: usize,
    /// The offset the release names: the descriptor's, tagged for a shared block.
    offset: u64,
    releaser: Arc<Releaser>,
}

// SAFETY: a Lease is a read-only view of mapped memory kept alive by the Arc<Segment> inside
// its Releaser; nothing in it is tied to the creating thread.
unsafe impl Send for Lease {}
// SAFETY: shared access only reads.
unsafe impl Sync for Lease {}

impl Lease {
    /// A lease on `len` bytes at `offset` of arena `dir`; the caller validated the range.
    pub(crate) fn new(releaser: Arc<Releaser>, offset: u64, len: u64) -> Lease {
        let l = *releaser.seg.layout();
        let region = releaser.seg.region(l.arena_off[releaser.dir], l.arena_size[releaser.dir]);
        assert!(offset.checked_add(len).is_some_and(|e| e <= region.len() as u64), "lease outside arena");
        // SAFETY: the assertion keeps `offset + len` within the arena region.
        let ptr = unsafe { region.ptr().add(offset as usize) };
        Lease { ptr, len: len as usize, offset, releaser }
    }

    /// A lease on `len` bytes at `offset` of the server's shared arena; the caller validated
    /// the range against [`Releaser::shared_len`].
    pub(crate) fn shared(releaser: Arc<Releaser>, offset: u64, len: u64) -> Lease {
        let view = releaser.shared.as_ref().unwrap_or_else(|| unreachable!("checked by the caller"));
        assert!(offset.checked_add(len).is_some_and(|e| e <= view.len() as u64), "lease outside shared arena");
        let ptr = view.at(offset as usize);
        Lease { ptr, len: len as usize, offset: offset | layout::SHARED_RELEASE, releaser }
    }
}

impl Lease {
    /// Appends the block's bytes to `out` by a raw copy (no slice of peer memory is formed).
    /// Fails, leaving `out` as it was, if the memory cannot be reserved.
    pub(crate) fn copy_into(&self, out: &mut Vec<u8>) -> Result<()> {
        out.try_reserve(self.len)
            .map_err(|_| Error::new(crate::ErrorKind::MessageTooLarge, "cannot reserve memory for a message"))?;
        // SAFETY: the source lies inside the mapped arena (checked in `new`, kept mapped by our
        // Arc<Segment>); the destination is `len` bytes of spare capacity just reserved, in
        // private memory, so the ranges cannot overlap; `set_len` covers exactly what was written.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr().add(out.len()), self.len);
            out.set_len(out.len() + self.len);
        }
        Ok(())
    }
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies inside the arena or the shared arena (checked in `new` and
        // `shared`), which stay mapped while the Releaser's Arcs live, at least as long as `self`. This is the one
        // place a slice over peer-writable memory is formed, on purpose: it is the zero-copy
        // receive path (ADR 0003). An honest peer never writes a block between sending it and
        // getting it back; a hostile one could change bytes the application is reading, which
        // makes them untrusted input like any message, but no decision of the transport's is
        // taken from them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.releaser.release(self.offset, self.len as u64);
    }
}
