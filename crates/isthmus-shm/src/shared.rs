//! The shared arena: a block written once and sent on many connections (ADR 0016).
//!
//! A connection's own arena is seen by two processes. A server that publishes the same message
//! to many subscribers, each on its own connection, would copy it into every one of them. A
//! [`SharedArena`] is a third kind of region: one memfd per [`Listener`](crate::Listener), mapped
//! read/write by the server alone and passed, at the handshake, to every client it accepts,
//! which maps it read-only. The server writes a message once into a [`SharedBlockMut`], freezes
//! it into a [`SharedBlock`], and sends that block on any number of its connections
//! ([`Sender::send_shared`](crate::Sender::send_shared)); each receiver reads it in place.
//!
//! - **Nobody but the server writes it.** The memfd is sealed `F_SEAL_FUTURE_WRITE` after the
//!   server maps it: no later mapping may be writable and `write(2)` fails, so a subscriber
//!   cannot change what the others read. The client checks that seal before it maps anything.
//! - **Freed when the last reader is done.** A `SharedBlock` is reference-counted in the
//!   server's private memory. Each connection that carries it holds one reference until its
//!   client hands the block back on the connection's release ring (with the top bit of the
//!   offset set, protocol.md §8.4), or until the connection ends: a subscriber killed with
//!   SIGKILL frees its references when the server notices it gone. The publisher holds one too.
//! - **One reference per connection.** A connection that still holds a block cannot be sent it
//!   again ([`Sender::send_shared`](crate::Sender::send_shared) copies it into the connection's
//!   own arena instead). So a release ring sized for one entry per granule of both arenas never
//!   overflows for an honest client, and a second release of a block is a protocol error.
//! - **A reader's bytes never change under it.** When a connection ends, the blocks its client
//!   had not given back are not freed: the client may still read its messages (their mapping
//!   lives as long as they do). They are kept until the client's process exits (a pidfd from the
//!   `SO_PEERCRED` pid says when), then freed. A client that drops its messages before its
//!   connection ends has given them back, and nothing is kept. The pid is the process that
//!   connected: a connection handed to a child that outlives it is not covered. Where no pidfd
//!   can be had (a pid from another pid namespace, Linux before 5.3), the blocks stay for the
//!   arena's life.
//! - **Only for one user.** Every client maps the whole arena, so it could read what the server
//!   sends any other client through it. A listener whose `PeerPolicy` admits other users has no
//!   shared arena (topics send copies); nor has one on a kernel without `F_SEAL_FUTURE_WRITE`
//!   (before Linux 5.1).
//! - **Room comes back without the publisher's help.** When an allocation finds no room, the
//!   arena first asks every connection that carries its blocks to drain its release ring
//!   ([`Drain`]), since a connection otherwise drains only when it allocates or sends.
//!
//! Allocation never waits: a publisher must not be held back by a subscriber that keeps its
//! blocks. `try_alloc` returns `None` when the arena is full, and the caller sends a copy.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use crate::allocator::Allocator;
use crate::error::{Error, ErrorKind, Result};
use crate::sys;

/// Something that holds references to shared blocks and can give back those its peer released:
/// a connection's arena owner.
pub(crate) trait Drain: Send + Sync {
    /// Takes back what the peer has released so far.
    fn drain(&self);
}

struct Inner {
    fd: OwnedFd,
    map: sys::Mapping,
    alloc: Mutex<Allocator>,
    drains: Mutex<Vec<Weak<dyn Drain>>>,
    /// Blocks held by the clients of connections that ended, until those processes exit.
    graves: Mutex<Vec<Grave>>,
    /// A child forked since the arena was made allocates nothing in it: its copy of the
    /// bookkeeping would hand out blocks the parent hands out too.
    made_in: crate::link::MadeIn,
}

/// What a client process may still read after its connections ended.
struct Grave {
    pid: i32,
    /// Readable once the process has exited; `None` if its exit cannot be watched (then the
    /// blocks stay for the arena's life: leaking is safe, freeing under a reader is not).
    pidfd: Option<OwnedFd>,
    _blocks: Vec<SharedBlock>,
}

/// The shared arena of a listener: blocks written once by the server and sent, by reference,
/// on any of the connections it accepted. Cheap to clone (clones are the same arena).
#[derive(Clone)]
pub struct SharedArena {
    inner: Arc<Inner>,
}

impl fmt::Debug for SharedArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedArena").field("size", &self.size()).field("in_use", &self.in_use()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Nothing under these locks can panic halfway through a change the next holder relies on.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SharedArena {
    /// Creates a sealed shared arena of `size` bytes (a validated arena size).
    pub(crate) fn create(size: usize) -> Result<SharedArena> {
        let fd = sys::memfd_create("isthmus-shared").map_err(|e| Error::io("cannot create the shared arena", e))?;
        sys::set_len(fd.as_fd(), size as u64)
            .map_err(|e| Error::io(format!("cannot size the shared arena to {size} bytes"), e))?;
        // Mapped before the seal: this is the one writable mapping there will ever be.
        let map = sys::Mapping::new(fd.as_fd(), size).map_err(|e| Error::io("cannot map the shared arena", e))?;
        crate::segment::advise_huge_pages(&map, 0..size);
        sys::seal_shared(fd.as_fd()).map_err(|e| Error::io("cannot seal the shared arena", e))?;
        Ok(SharedArena {
            inner: Arc::new(Inner {
                fd,
                map,
                alloc: Mutex::new(Allocator::new(size)),
                drains: Mutex::new(Vec::new()),
                graves: Mutex::new(Vec::new()),
                made_in: crate::link::MadeIn::now(),
            }),
        })
    }

    /// An arena of no listener, for tests of code that writes shared blocks: its blocks can only
    /// be sent as copies.
    #[doc(hidden)]
    pub fn for_tests(size: usize) -> Result<SharedArena> {
        crate::config::check_arena_size("shared arena size", size)?;
        SharedArena::create(size)
    }

    /// The arena's size in bytes.
    pub fn size(&self) -> usize {
        self.inner.map.len()
    }

    /// Bytes held now by blocks not yet freed, in whole 4 KiB granules.
    pub fn in_use(&self) -> usize {
        lock(&self.inner.alloc).in_use()
    }

    /// The most bytes ever held at once.
    pub fn high_water(&self) -> usize {
        lock(&self.inner.alloc).high_water()
    }

    /// True if `other` is this same arena.
    pub fn same(&self, other: &SharedArena) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A writable block of `len` bytes, or `None` when the arena has no room now (the blocks
    /// subscribers still hold fill it). Never waits. [`ErrorKind::TooLarge`] if `len` is zero
    /// or more than half the arena: such a message is better copied per connection, in pieces.
    pub fn try_alloc(&self, len: usize) -> Result<Option<SharedBlockMut>> {
        if len == 0 || Allocator::block_len(len) > self.size() / 2 {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("a shared block must hold 1 byte to half the {}-byte shared arena; {len} asked", self.size()),
            ));
        }
        if self.inner.made_in.forked() {
            return Ok(None); // the parent's arena (see `made_in`): the message goes as copies
        }
        self.reap();
        if let Some(block) = self.alloc_now(len) {
            return Ok(Some(block));
        }
        // Blocks may wait on release rings that nobody drains until they send again, or on
        // clients that have exited since their connection ended.
        self.drain_all();
        self.reap();
        Ok(self.alloc_now(len))
    }

    /// Keeps `blocks`, which the client process `pid` may still read, until it exits.
    pub(crate) fn bury(&self, pid: i32, blocks: Vec<SharedBlock>) {
        if blocks.is_empty() {
            return;
        }
        let mut graves = lock(&self.inner.graves);
        // One grave (and one pidfd) per process, however often it reconnects. Not one whose
        // process has exited and not been reaped yet: a new process given the same pid would
        // join it, and the next reap would free its blocks while it still reads them.
        let alive = |g: &Grave| !g.pidfd.as_ref().is_some_and(|fd| sys::pidfd_exited(fd.as_fd()));
        if let Some(grave) = graves.iter_mut().find(|g| g.pid == pid && alive(g)) {
            grave._blocks.extend(blocks);
            return;
        }
        let pidfd = match sys::pidfd_open(pid) {
            Ok(Some(fd)) => Some(fd),
            Ok(None) => return, // exited already: nobody reads them
            Err(_) => None,
        };
        graves.push(Grave { pid, pidfd, _blocks: blocks });
    }

    /// Frees the blocks of client processes that have exited (a `poll` per grave; none when
    /// no connection ended holding blocks).
    fn reap(&self) {
        let dead: Vec<Grave> = {
            let mut graves = lock(&self.inner.graves);
            if graves.is_empty() {
                return;
            }
            let (dead, alive) = std::mem::take(&mut *graves)
                .into_iter()
                .partition(|g| g.pidfd.as_ref().is_some_and(|fd| sys::pidfd_exited(fd.as_fd())));
            *graves = alive;
            dead
        };
        drop(dead); // outside the lock: each block's drop takes the allocator's
    }

    fn alloc_now(&self, len: usize) -> Option<SharedBlockMut> {
        let (offset, generation) = lock(&self.inner.alloc).alloc(len)?;
        // SAFETY: the allocator hands out `offset + len <= size`, the mapping's length.
        let ptr = unsafe { self.inner.map.as_ptr().add(offset) };
        Some(SharedBlockMut { block: Some(BlockInner { arena: self.clone(), offset, generation, ptr, len }) })
    }

    fn drain_all(&self) {
        let live: Vec<Arc<dyn Drain>> = {
            let mut drains = lock(&self.inner.drains);
            drains.retain(|d| d.strong_count() > 0);
            drains.iter().filter_map(Weak::upgrade).collect()
        };
        for d in live {
            d.drain();
        }
    }

    /// Registers a connection that carries this arena's blocks, for [`Drain`]s on a full arena.
    pub(crate) fn register(&self, drain: Weak<dyn Drain>) {
        let mut drains = lock(&self.inner.drains);
        drains.retain(|d| d.strong_count() > 0);
        drains.push(drain);
    }

    /// The memfd, to pass to a client at the handshake.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }
}

/// One allocation, as long as something holds it.
struct BlockInner {
    arena: SharedArena,
    offset: usize,
    generation: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is into the arena's mapping, which `arena` keeps alive; who may write
// through it is settled by the types that hold a `BlockInner` (a `SharedBlockMut` alone, then
// nobody once frozen), not by the thread.
unsafe impl Send for BlockInner {}
// SAFETY: `&BlockInner` gives nothing that writes.
unsafe impl Sync for BlockInner {}

impl Drop for BlockInner {
    fn drop(&mut self) {
        lock(&self.arena.inner.alloc).free_own(self.offset, self.generation);
    }
}

/// A block of the shared arena being filled; nothing has seen it yet. Dropping it frees it.
pub struct SharedBlockMut {
    /// `None` only after [`freeze`](Self::freeze) moved it out.
    block: Option<BlockInner>,
}

impl SharedBlockMut {
    fn inner(&self) -> &BlockInner {
        // Only `freeze` empties it, and `freeze` consumes the value.
        self.block.as_ref().unwrap_or_else(|| unreachable!("a frozen block is gone"))
    }

    /// Shortens the block to `len` bytes (for a serializer that wrote less than it reserved);
    /// the granules stay reserved until the block is freed.
    pub fn truncate(&mut self, len: usize) {
        if let Some(b) = &mut self.block {
            b.len = b.len.min(len).max(1);
        }
    }

    /// Ends the writing: the block becomes a read-only [`SharedBlock`] that can be sent on many
    /// connections.
    pub fn freeze(mut self) -> SharedBlock {
        let inner = self.block.take().unwrap_or_else(|| unreachable!("a block is frozen once"));
        SharedBlock(Arc::new(inner))
    }
}

impl fmt::Debug for SharedBlockMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.inner();
        f.debug_struct("SharedBlockMut").field("offset", &b.offset).field("len", &b.len).finish()
    }
}

impl Deref for SharedBlockMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let b = self.inner();
        // SAFETY: `ptr..ptr+len` is a block of the arena given to this value alone; the mapping
        // lives while `b.arena` does.
        unsafe { std::slice::from_raw_parts(b.ptr, b.len) }
    }
}

impl DerefMut for SharedBlockMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        let b = self.inner();
        // SAFETY: as in `deref`; `&mut self` makes this the only reference, and no reader has
        // the block yet (it is sent only once frozen).
        unsafe { std::slice::from_raw_parts_mut(b.ptr, b.len) }
    }
}

/// A written block of the shared arena: read-only, cheap to clone, freed when the last clone
/// and the last connection carrying it let go.
#[derive(Clone)]
pub struct SharedBlock(Arc<BlockInner>);

impl SharedBlock {
    /// The arena this block lives in.
    pub fn arena(&self) -> &SharedArena {
        &self.0.arena
    }

    /// Offset of the block in its arena.
    pub(crate) fn offset(&self) -> usize {
        self.0.offset
    }
}

impl fmt::Debug for SharedBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBlock").field("offset", &self.0.offset).field("len", &self.0.len).finish()
    }
}

impl Deref for SharedBlock {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the block lies inside the mapping (allocator bound), which the Arc'd arena keeps
        // mapped; once frozen nothing writes it until the last reference is gone.
        unsafe { std::slice::from_raw_parts(self.0.ptr, self.0.len) }
    }
}

impl AsRef<[u8]> for SharedBlock {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A client's read-only mapping of its server's shared arena.
#[derive(Debug)]
pub(crate) struct SharedView {
    map: sys::Mapping,
}

impl SharedView {
    /// Maps the server's shared arena read-only, after checking its seals and size.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<SharedView> {
        let seals = sys::seals(fd).map_err(|e| Error::io("handshake: the shared arena is not a sealable memfd", e))?;
        let want = sys::REQUIRED_SEALS | sys::SHARED_SEALS;
        if seals & want != want {
            return Err(Error::protocol(
                "handshake: the server's shared arena is not sealed against resizing and against writers",
            ));
        }
        let size = sys::file_size(fd).map_err(|e| Error::io("handshake: cannot stat the shared arena", e))?;
        if size != len as u64 {
            return Err(Error::protocol(format!("handshake: the shared arena is {size} bytes, the hello says {len}")));
        }
        let map = sys::Mapping::read_only(fd, len).map_err(|e| Error::io("cannot map the shared arena", e))?;
        crate::segment::advise_huge_pages(&map, 0..len);
        Ok(SharedView { map })
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The address of byte `offset`; the caller checked `offset + len <= self.len()`.
    pub(crate) fn at(&self, offset: usize) -> *const u8 {
        assert!(offset <= self.len(), "offset outside the shared arena");
        // SAFETY: the assertion keeps the pointer inside (or one past) the mapping.
        unsafe { self.map.as_ptr().add(offset) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_freed_when_the_last_holder_lets_go() {
        let arena = SharedArena::create(1 << 20).expect("arena");
        let mut b = arena.try_alloc(10_000).expect("size ok").expect("room");
        b.fill(7);
        b.truncate(9_000);
        assert_eq!(b.len(), 9_000);
        let frozen = b.freeze();
        let again = frozen.clone();
        assert_eq!(arena.in_use(), 12 << 10);
        drop(frozen);
        assert_eq!(arena.in_use(), 12 << 10, "a clone still holds it");
        assert!(again.iter().all(|&x| x == 7));
        drop(again);
        assert_eq!(arena.in_use(), 0);
        drop(arena.try_alloc(100).expect("ok").expect("room"));
        assert_eq!(arena.in_use(), 0, "an unfrozen block is freed on drop");
        assert_eq!(arena.high_water(), 12 << 10);
    }

    #[test]
    fn refuses_what_it_cannot_hold_and_never_waits() {
        let arena = SharedArena::create(256 << 10).expect("arena");
        assert_eq!(arena.try_alloc(0).expect_err("empty").kind(), ErrorKind::TooLarge);
        assert_eq!(arena.try_alloc((128 << 10) + 1).expect_err("over half").kind(), ErrorKind::TooLarge);
        let a = arena.try_alloc(128 << 10).expect("ok").expect("room");
        let b = arena.try_alloc(128 << 10).expect("ok").expect("room");
        assert!(arena.try_alloc(1).expect("ok").is_none(), "full: None at once");
        drop((a, b));
        assert!(arena.try_alloc(1).expect("ok").is_some());
    }

    #[test]
    fn a_process_given_an_exited_ones_pid_gets_a_grave_of_its_own() {
        // The exited process: a child, waited for, whose grave is not reaped yet.
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pidfd = sys::pidfd_open(child.id() as i32).expect("pidfd_open").expect("alive");
        child.wait().expect("wait");
        let arena = SharedArena::create(1 << 20).expect("arena");
        let block = |arena: &SharedArena| arena.try_alloc(4096).expect("ok").expect("room").freeze();
        // This process stands for the new one the pid went to: its blocks join no dead grave.
        let pid = std::process::id() as i32;
        // Both allocated first: an allocation reaps.
        let (theirs, ours) = (block(&arena), block(&arena));
        lock(&arena.inner.graves).push(Grave { pid, pidfd: Some(pidfd), _blocks: vec![theirs] });
        arena.bury(pid, vec![ours]);
        assert_eq!(arena.in_use(), 8 << 10);
        arena.reap();
        assert_eq!(arena.in_use(), 4 << 10, "the exited process's block freed, the live one's kept");
    }

    #[test]
    fn nobody_else_can_write_it() {
        let arena = SharedArena::create(64 << 10).expect("arena");
        assert!(sys::Mapping::new(arena.fd(), 64 << 10).is_err(), "a new writable mapping is refused");
        let view = SharedView::map(arena.fd(), 64 << 10).expect("read-only mapping");
        let mut b = arena.try_alloc(5).expect("ok").expect("room");
        b.copy_from_slice(b"hello");
        let b = b.freeze();
        // SAFETY: the block is inside the view's mapping, and frozen.
        let seen = unsafe { std::slice::from_raw_parts(view.at(b.offset()), 5) };
        assert_eq!(seen, b"hello");
        assert!(SharedView::map(arena.fd(), 128 << 10).is_err(), "the size must match the hello");
    }
}
