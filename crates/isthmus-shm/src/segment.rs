//! The shared segment: one mapping, laid out by [`Layout`], with typed access to its parts.
//!
//! This is one of the two modules that turn raw memory into safe types (with `ring` and
//! `arena`). Control words are reached only as atomics; region bytes only through raw-pointer
//! copies, so no `&T` to peer-writable plain data is ever formed here.
//!
//! A heap-backed segment (`Segment::heap`) serves the unit tests and the fuzz targets: both ends in
//! one process, the same code paths, no memfd.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::layout::{self, Layout};
use crate::sys;

/// How much of an arena's start stays in small pages (ADR 0023). The allocator hands out the
/// lowest offsets first, so a connection that only sends small messages lives there, where a
/// huge page would cost it 2 MiB of memory for a few KiB in use.
const SMALL_PAGED_HEAD: usize = 2 << 20;

/// Advises huge pages for the arena at bytes `arena` of `map`, past its small-paged head: large
/// messages then cross a few page-table entries instead of thousands. Advice only; where the
/// host keeps shared memory in small pages it changes nothing.
pub(crate) fn advise_huge_pages(map: &sys::Mapping, arena: std::ops::Range<usize>) -> bool {
    let from = arena.start.saturating_add(SMALL_PAGED_HEAD);
    map.advise_huge_pages(from..arena.end)
}

/// What keeps a segment's memory alive (held for its `Drop`, never read).
#[derive(Debug)]
#[allow(dead_code)]
enum Backing {
    /// A shared mapping of a memfd (the real thing).
    Mapped(sys::Mapping),
    /// Private heap memory of the same layout, for unit tests and fuzzing.
    Heap(HeapWords),
}

/// A heap segment's words, owned through a raw pointer rather than a `Box`: moving a `Box`
/// asserts unique access to what it points to, which would void the segment's `base`, derived
/// from it before the move (Miri's aliasing model says so, and the optimiser may act on it).
#[derive(Debug)]
struct HeapWords(std::ptr::NonNull<[AtomicU64]>);

impl HeapWords {
    fn zeroed(words: usize) -> HeapWords {
        let boxed: Box<[AtomicU64]> = (0..words).map(|_| AtomicU64::new(0)).collect();
        HeapWords(std::ptr::NonNull::from(Box::leak(boxed)))
    }

    fn base(&self) -> *mut u8 {
        self.0.as_ptr() as *mut u8
    }
}

impl Drop for HeapWords {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::leak` in `zeroed` and is freed only here, once;
        // the segment that used it is being dropped, so nothing reaches it any more.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// A mapped segment and its layout.
#[derive(Debug)]
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    layout: Layout,
    _backing: Backing,
}

// SAFETY: the segment is memory shared with another process anyway; every access from this
// process goes through atomics or raw-pointer copies whose callers synchronise through the ring
// and arena protocols, so sharing the handle between threads adds nothing unsound.
unsafe impl Send for Segment {}
// SAFETY: see Send.
unsafe impl Sync for Segment {}

impl Segment {
    /// Maps `fd`, which must be at least `layout.total` bytes long.
    pub(crate) fn map(fd: BorrowedFd<'_>, layout: Layout) -> Result<Segment> {
        let map = sys::Mapping::new(fd, layout.total).map_err(|e| Error::io("cannot map the shared segment", e))?;
        debug_assert_eq!(map.len(), layout.total);
        for d in 0..2 {
            advise_huge_pages(&map, layout.arena_off[d]..layout.arena_off[d] + layout.arena_size[d]);
        }
        Ok(Segment { base: map.as_ptr(), len: map.len(), layout, _backing: Backing::Mapped(map) })
    }

    /// A zeroed heap segment with the same layout: for tests and fuzzing only, where both ends
    /// live in one process.
    pub(crate) fn heap(layout: Layout) -> Segment {
        let words = HeapWords::zeroed(layout.total.div_ceil(8));
        Segment { base: words.base(), len: layout.total, layout, _backing: Backing::Heap(words) }
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Writes the informational header; the server does this once before handing the fd out.
    pub(crate) fn init_header(&self) {
        self.word(0).store(layout::SEGMENT_MAGIC, Ordering::Relaxed);
        self.word(8).store(crate::handshake::PROTOCOL_VERSION as u64, Ordering::Relaxed);
    }

    /// The u64 control word at byte offset `off` of the control block.
    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= layout::CONTROL_LEN);
        // SAFETY: `off` is 8-aligned and inside the control block, which lies inside the mapping
        // (Layout starts every region after it) and the mapping is page-aligned, so the pointer is
        // aligned and valid for the segment's lifetime, which bounds the returned reference.
        // Atomics are the one way this module lets the peer's writes be observed.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    /// Direction `dir`'s u64 control word `field` (one of `layout::CTL_*`).
    pub(crate) fn ctl_u64(&self, dir: usize, field: usize) -> &AtomicU64 {
        self.word(layout::control_base(dir) + field)
    }

    /// Direction `dir`'s u32 flag `field`.
    pub(crate) fn ctl_u32(&self, dir: usize, field: usize) -> &AtomicU32 {
        let off = layout::control_base(dir) + field;
        assert!(off % 4 == 0 && off + 4 <= layout::CONTROL_LEN);
        // SAFETY: as in `word`, for a 4-aligned offset inside the control block.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    /// Base pointer and length of the region at `off..off + len`.
    pub(crate) fn region(&self, off: usize, len: usize) -> Region {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "region outside segment");
        // SAFETY: the assertion keeps `off + len` within the segment's allocation.
        Region { ptr: unsafe { self.base.add(off) }, len }
    }
}

/// A byte range inside a segment, accessed only by copies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Region is an address range; the segment it points into outlives every holder
// (holders keep an `Arc<Segment>`), and users synchronise access through the ring protocols.
unsafe impl Send for Region {}
// SAFETY: see Send.
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copies `src` into the region at `at`, wrapping around its end (the region is a ring).
    pub(crate) fn write_wrapping(&self, at: usize, src: &[u8]) {
        assert!(at < self.len && src.len() <= self.len);
        let first = src.len().min(self.len - at);
        // SAFETY: `at + first <= len` and `src.len() - first <= at < len`, so both copies stay in
        // the region; `src` is private memory, so source and destination never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(at), first);
        }
        // SAFETY: the wrapped tail starts at the region's base and is shorter than the region.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.ptr, src.len() - first);
        }
    }

    /// Copies from the region at `at` into `dst`, wrapping around its end.
    pub(crate) fn read_wrapping(&self, at: usize, dst: &mut [u8]) {
        // SAFETY: `dst` is valid for `dst.len()` bytes of writes.
        unsafe { self.read_wrapping_raw(at, dst.as_mut_ptr(), dst.len()) }
    }

    /// `len` bytes from the region at `at`, wrapping around its end, in a new vector. Unlike
    /// [`read_wrapping`](Self::read_wrapping) into a zeroed buffer, the bytes are written once:
    /// a frame's body costs one allocation and one copy.
    pub(crate) fn read_wrapping_to_vec(&self, at: usize, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        // SAFETY: the vector has capacity for `len` bytes, all of which the call writes (the
        // region holds at least `len` bytes: checked inside), so they are initialised before
        // `set_len` makes them part of the vector.
        unsafe {
            self.read_wrapping_raw(at, v.as_mut_ptr(), len);
            v.set_len(len);
        }
        v
    }

    /// Copies `len` bytes from the region at `at` to `dst`, wrapping around the region's end.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes and not overlap the region.
    unsafe fn read_wrapping_raw(&self, at: usize, dst: *mut u8, len: usize) {
        assert!(at < self.len && len <= self.len);
        let first = len.min(self.len - at);
        // SAFETY: as in `write_wrapping`, with the roles of source and destination swapped (the
        // caller vouches for `dst`). The peer may write these bytes concurrently; they are
        // copied as plain bytes (any value is a valid u8) and validated by the caller after the
        // copy.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(at), dst, first);
        }
        // SAFETY: the wrapped tail starts at the region's base and is shorter than the region.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr, dst.add(first), len - first);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::sys::inspect::{huge_mapped_kib, shmem_huge_on_advice, shmem_huge_setting};

    #[test]
    fn an_arena_past_its_head_asks_for_huge_pages_and_its_head_does_not() {
        let layout = Layout::new([4096, 4096], [16 << 20, 16 << 20], 0).expect("layout");
        let fd = sys::memfd_create("segment").expect("memfd");
        sys::set_len(fd.as_fd(), layout.total as u64).expect("size");
        let seg = Segment::map(fd.as_fd(), layout).expect("map");
        let Backing::Mapped(map) = &seg._backing else { unreachable!() };
        // The first 2 MiB, where a connection's small messages live.
        let head = layout.arena_off[0]..layout.arena_off[0] + (2 << 20);
        let arena = layout.arena_off[0]..layout.arena_off[0] + layout.arena_size[0];
        // SAFETY: both ranges lie inside the writable mapping, which this test alone uses.
        unsafe { std::ptr::write_bytes(seg.base.add(head.start), 1, head.len()) };
        // With `within_size`, `always` or `force` the host gives every shared mapping huge
        // pages, the head's too; with `advise` only what asks for them.
        let only_advised = shmem_huge_setting().as_deref() == Some("advise");
        if only_advised {
            assert_eq!(huge_mapped_kib(map, head.clone()), 0, "a small message's memory stays in small pages");
        }
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(seg.base.add(arena.start), 2, arena.len()) };
        let huge = huge_mapped_kib(map, arena);
        if shmem_huge_on_advice() {
            assert!(huge >= 12 << 10, "16 MiB arena: only {huge} KiB in huge pages");
        } else {
            assert_eq!(huge, 0);
        }
        if only_advised {
            assert_eq!(huge_mapped_kib(map, head), 0, "the head asked for none");
        }
    }
}
