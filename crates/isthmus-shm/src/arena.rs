//! Payload arenas: the owner's allocator and the receiver's leases on the peer's blocks.
//!
//! Each side allocates only from its own arena; the allocator's bookkeeping lives here, in this
//! process's private memory, so the peer can neither corrupt it nor free what it was not given.
//! The receiver hands blocks back through the release ring; the owner checks every release
//! against the blocks it actually has out.
//!
//! - `Allocator` is best fit over whole 4 KiB granules, lowest offset first among equals. Each live
//!   block has a generation and an in-flight flag: `mark_in_flight(offset, generation)` just before
//!   a block's descriptor is pushed, `free` for the peer's releases (accepted only for a block in
//!   flight, with a length at most its size; the whole block is freed),
//!   `free_own(offset, generation)` for our own blocks never sent, which frees only that
//!   allocation, never a later one at the same offset.
//! - `ArenaOwner` reclaims, then allocates: every allocation first drains the release ring and
//!   checks each entry, so the blocks just released, whose pages are warm, are reused first and a
//!   bogus release is caught at the next allocation rather than when the arena runs full.
//!   `can_alloc(len)` (drain, then ask whether `len` fits) is the condition of a wait for arena
//!   room.
//! - `Releaser` returns the peer's blocks from any thread: a 16-byte push under a private mutex,
//!   then the owner's doorbell if it sleeps. A full or corrupted release ring is a protocol error
//!   found in a destructor: it hangs the connection up at once.
//! - `Lease` is a received block: a zero-copy view (the one slice over peer-writable memory on the
//!   receive path, ADR 0003) whose drop releases, and `copy_into`, a raw copy out into a private
//!   buffer that forms no slice.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::doorbell::{wake_if_parked, Bell};
use crate::error::{Error, Result};
use crate::layout::{self, ARENA_GRANULE};
use crate::link::Health;
use crate::ring::{ReleaseConsumer, ReleaseEntry, ReleaseProducer};
use crate::segment::{Region, Segment};

/// A block handed out by the allocator.
#[derive(Debug, Clone, Copy)]
struct Block {
    size: usize,
    /// Distinguishes this allocation from a later one at the same offset.
    generation: u64,
    /// Sent to the peer: only now may the peer give it back. A block still being filled is ours
    /// alone, so a peer that guesses its offset cannot free it under us.
    in_flight: bool,
}

/// Best-fit allocator over `[0, size)` in whole granules, lowest offset first among equals, so
/// recently used (warm, already faulted-in) memory is reused first.
#[derive(Debug)]
pub(crate) struct Allocator {
    by_offset: BTreeMap<usize, usize>,
    by_size: BTreeSet<(usize, usize)>,
    live: HashMap<usize, Block>,
    next_generation: u64,
    in_use: usize,
    high_water: usize,
}

impl Allocator {
    pub(crate) fn new(size: usize) -> Allocator {
        let mut a = Allocator {
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            live: HashMap::new(),
            next_generation: 0,
            in_use: 0,
            high_water: 0,
        };
        if size > 0 {
            a.insert_free(0, size);
        }
        a
    }

    fn insert_free(&mut self, off: usize, len: usize) {
        self.by_offset.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: usize, len: usize) {
        self.by_offset.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// Granule-rounded size of a `len`-byte block.
    pub(crate) fn block_len(len: usize) -> usize {
        len.max(1).next_multiple_of(ARENA_GRANULE)
    }

    /// Allocates a block for `len` bytes: its offset and generation; `None` when no free run is
    /// large enough now.
    pub(crate) fn alloc(&mut self, len: usize) -> Option<(usize, u64)> {
        let need = Self::block_len(len);
        let &(run, off) = self.by_size.range((need, 0)..).next()?;
        self.remove_free(off, run);
        if run > need {
            self.insert_free(off + need, run - need);
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.live.insert(off, Block { size: need, generation, in_flight: false });
        self.in_use += need;
        self.high_water = self.high_water.max(self.in_use);
        Some((off, generation))
    }

    /// Marks an allocation as sent; false if it is not (or no longer) the live block there.
    pub(crate) fn mark_in_flight(&mut self, off: usize, generation: u64) -> bool {
        match self.live.get_mut(&off) {
            Some(b) if b.generation == generation => {
                b.in_flight = true;
                true
            }
            _ => false,
        }
    }

    /// Frees our own allocation `(off, generation)` if it is still live; never someone else's.
    pub(crate) fn free_own(&mut self, off: usize, generation: u64) {
        if self.live.get(&off).is_some_and(|b| b.generation == generation) {
            self.release_run(off);
        }
    }

    /// True if a free run can hold `len` bytes.
    pub(crate) fn fits(&self, len: usize) -> bool {
        self.by_size.range((Self::block_len(len), 0)..).next().is_some()
    }

    /// Takes back a block the peer released: it must be one we sent (in flight) and at least
    /// `len` long (a sender may have sent less of a block than it reserved).
    pub(crate) fn free(&mut self, off: usize, len: usize) -> Result<()> {
        match self.live.get(&off) {
            Some(b) if b.in_flight && len <= b.size => {}
            _ => {
                return Err(Error::protocol(format!(
                    "the peer released arena block {{offset {off}, len {len}}}, which is not a block it was sent"
                )))
            }
        }
        self.release_run(off);
        Ok(())
    }

    /// Returns a live block's run to the free lists, merging with its neighbours.
    fn release_run(&mut self, off: usize) {
        let Some(Block { size, .. }) = self.live.remove(&off) else { return };
        self.in_use -= size;
        let (mut start, mut end) = (off, off + size);
        if let Some((&prev, &plen)) = self.by_offset.range(..off).next_back() {
            if prev + plen == start {
                self.remove_free(prev, plen);
                start = prev;
            }
        }
        if let Some(&nlen) = self.by_offset.get(&end) {
            self.remove_free(end, nlen);
            end += nlen;
        }
        self.insert_free(start, end - start);
    }

    /// Bytes handed out now, rounded to granules.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        self.in_use
    }

    /// The most bytes ever handed out at once.
    pub(crate) fn high_water(&self) -> usize {
        self.high_water
    }
}

/// The owner's side of its arena: the allocator plus the ring the peer returns blocks on.
#[derive(Debug)]
pub(crate) struct ArenaOwner {
    alloc: Allocator,
    releases: ReleaseConsumer,
    region: Region,
}

impl ArenaOwner {
    pub(crate) fn new(seg: &Arc<Segment>, dir: usize) -> ArenaOwner {
        let l = *seg.layout();
        ArenaOwner {
            alloc: Allocator::new(l.arena_size[dir]),
            releases: ReleaseConsumer::new(seg.clone(), dir),
            region: seg.region(l.arena_off[dir], l.arena_size[dir]),
        }
    }

    /// Takes back everything the peer released.
    pub(crate) fn reclaim(&mut self) -> Result<usize> {
        let alloc = &mut self.alloc;
        self.releases.drain(|e| {
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
}

/// Hands the peer's blocks back, from whichever thread drops the last view of one.
#[derive(Debug)]
pub(crate) struct Releaser {
    ring: Mutex<ReleaseProducer>,
    seg: Arc<Segment>,
    dir: usize,
    peer_tx_bell: Arc<Bell>,
    health: Arc<Health>,
}

impl Releaser {
    pub(crate) fn new(seg: Arc<Segment>, dir: usize, peer_tx_bell: Arc<Bell>, health: Arc<Health>) -> Releaser {
        Releaser { ring: Mutex::new(ReleaseProducer::new(seg.clone(), dir)), seg, dir, peer_tx_bell, health }
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
        // SAFETY: `ptr..ptr+len` lies inside the arena (checked in `new`), which stays mapped while
        // the Releaser's Arc<Segment> lives, i.e. at least as long as `self`. This is the one
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: a byte map of which granules are taken.
    #[test]
    fn agrees_with_a_granule_map() {
        let granules = 64;
        let mut a = Allocator::new(granules * ARENA_GRANULE);
        let mut taken = vec![false; granules];
        let mut live: Vec<(usize, usize)> = vec![];
        let mut rng = 0x2545f4914f6cdd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..50_000 {
            if next() % 2 == 0 || live.is_empty() {
                let len = (next() % (10 * ARENA_GRANULE as u64)) as usize;
                let g = Allocator::block_len(len) / ARENA_GRANULE;
                let fits = (0..=granules.saturating_sub(g)).any(|s| taken[s..s + g].iter().all(|t| !t));
                match a.alloc(len) {
                    Some((off, generation)) => {
                        assert!(a.mark_in_flight(off, generation));
                        let s = off / ARENA_GRANULE;
                        assert!(taken[s..s + g].iter().all(|t| !t), "overlap at {s}");
                        taken[s..s + g].iter_mut().for_each(|t| *t = true);
                        live.push((off, len));
                    }
                    None => assert!(!fits, "allocator refused {g} granules that fit"),
                }
            } else {
                let (off, len) = live.swap_remove((next() as usize) % live.len());
                a.free(off, len).expect("live block frees");
                let s = off / ARENA_GRANULE;
                taken[s..s + Allocator::block_len(len) / ARENA_GRANULE].iter_mut().for_each(|t| *t = false);
            }
            assert_eq!(a.in_use(), taken.iter().filter(|t| **t).count() * ARENA_GRANULE);
        }
    }

    #[test]
    fn rejects_foreign_early_and_double_frees() {
        let mut a = Allocator::new(16 * ARENA_GRANULE);
        let (off, g) = a.alloc(100).expect("room");
        assert!(a.free(off, 100).is_err(), "not sent yet: the peer cannot free it under us");
        assert!(a.mark_in_flight(off, g));
        assert!(a.free(off + ARENA_GRANULE, 100).is_err(), "never given");
        assert!(a.free(off, 5 * ARENA_GRANULE).is_err(), "longer than the block");
        a.free(off, 100).expect("right");
        assert!(a.free(off, 100).is_err(), "double");
        let (again, g2) = a.alloc(16 * ARENA_GRANULE).expect("coalesced back to one run");
        assert_eq!(again, 0);
        a.free_own(off, g);
        assert!(a.mark_in_flight(again, g2), "a stale owner's free leaves the new block alone");
    }
}
