//! The allocator of an arena's blocks, in the owner's private memory: best fit over whole 4 KiB
//! granules, lowest offset first among equals, so recently used (warm, already faulted-in) memory
//! is reused first. Each live block has a generation and an in-flight flag:
//! `mark_in_flight(offset, generation)` just before a block's descriptor is pushed, `free` for the
//! peer's releases (accepted only for a block in flight, with a length at most its size; the whole
//! block is freed), `free_own(offset, generation)` for our own blocks never sent, which frees only
//! that allocation, never a later one at the same offset. Connection arenas and the shared arena
//! both allocate with it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, Result};
use crate::layout::ARENA_GRANULE;
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

    /// Granule-rounded size of a `len`-byte block; `usize::MAX`, which no arena holds, for a
    /// `len` that does not round within `usize` (a caller's `SIZE_MAX`, or a negative `int`
    /// made `size_t`). Wrapping would have made it 0, a block that fits anywhere.
    pub(crate) fn block_len(len: usize) -> usize {
        len.max(1).checked_next_multiple_of(ARENA_GRANULE).unwrap_or(usize::MAX)
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
    pub(crate) fn in_use(&self) -> usize {
        self.in_use
    }

    /// The most bytes ever handed out at once.
    pub(crate) fn high_water(&self) -> usize {
        self.high_water
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
    fn a_size_that_does_not_round_within_usize_fits_nowhere() {
        let mut a = Allocator::new(16 * ARENA_GRANULE);
        for len in [usize::MAX, usize::MAX - ARENA_GRANULE + 2, usize::MAX - 1] {
            assert_eq!(Allocator::block_len(len), usize::MAX, "{len}");
            assert!(!a.fits(len) && a.alloc(len).is_none(), "{len}");
        }
        assert_eq!(Allocator::block_len(usize::MAX - ARENA_GRANULE + 1), usize::MAX - ARENA_GRANULE + 1);
        assert!(a.alloc(100).is_some(), "the arena is as it was");
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

    /// Warm reuse (ADR 0014): a message's block, once the peer frees it, is where the next
    /// message of that size goes, so an echo keeps writing memory that is faulted in and
    /// cached instead of walking the arena; among free runs that fit equally, the lowest.
    #[test]
    fn a_freed_block_is_where_the_next_message_goes() {
        let mut a = Allocator::new(64 * ARENA_GRANULE);
        let send = |a: &mut Allocator, len: usize| {
            let (off, generation) = a.alloc(len).expect("room");
            assert!(a.mark_in_flight(off, generation));
            off
        };
        let len = 3 * ARENA_GRANULE;
        let first = send(&mut a, len);
        a.free(first, len).expect("sent");
        let held = send(&mut a, ARENA_GRANULE); // a message the peer keeps meanwhile
        assert_eq!(held, first, "one free run again: its lowest offset");
        let base = send(&mut a, len);
        a.free(base, len).expect("sent");
        for _ in 0..100 {
            let off = send(&mut a, len);
            assert_eq!(off, base, "the block just freed, not a cold one further on");
            a.free(off, len).expect("sent");
        }
        // Three equal holes, freed highest first: the next block takes the lowest.
        let blocks: Vec<usize> = (0..6).map(|_| send(&mut a, len)).collect();
        for &i in &[4, 2, 0] {
            a.free(blocks[i], len).expect("sent");
        }
        assert_eq!(send(&mut a, len), blocks[0]);
    }
}
