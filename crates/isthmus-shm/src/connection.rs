//! A connection: a [`Sender`] any number of threads share and one [`Receiver`].
//!
//! `Sender` is `Clone`; clones share one core with two private mutexes, one held for exactly one
//! append to the ring (the copy of one frame and the store of the tail), one for one allocation or
//! one drain of the release ring. No lock is held while a thread waits, so a thread blocked on a
//! full arena does not stop another from sending a small frame; there is no fairness between
//! waiters, so a small frame can overtake a large one waiting for ring room. `Receiver` methods
//! take `&mut self`: the frame ring has one reader, which copies frames out, wakes the producer and
//! reassembles pieces per stream. Which call a frame is for is the RPC layer's business.
//!
//! A message takes one of three routes (`send_message`; `protocol.md` §7.2), and costs:
//!
//! - **Small** (up to `inline_max`, 8 KiB): the header and body are copied into the ring under the
//!   ring lock and the tail stored; the receiver is rung only if it is parked (a fence and a load,
//!   else one `write(2)`). The receiver copies the header into a stack buffer, validates it, copies
//!   the body into a fresh `Vec`, stores its head, and rings the producer if it waits for room. Two
//!   copies; a system call only when the receiver sleeps.
//! - **Large** (up to half the arena): `alloc` takes a block (waiting for arena room if need be),
//!   the payload is copied in, or a caller serialises straight into the [`BlockMut`] and may
//!   `truncate` it, and `send_block` marks it in flight, then pushes a 24-byte descriptor
//!   `{offset, len, total}`. The mark comes before any wait for ring room, and only from the mark
//!   on does the owner accept a release of the block, so a release guessed while the block was
//!   being filled is a protocol error and a generation keeps a late one from freeing the next
//!   allocation at that offset. The receiver checks the descriptor against the arena and hands out
//!   `Bytes::from_owner(lease)`: no copy. When the last reference drops, the block goes back on the
//!   release ring. One copy, or none with `alloc`; the arena's capacity is the backpressure,
//!   bounded by the sender's deadline.
//! - **Very large** (over half the arena): pieces of a quarter of the arena, each an arena message
//!   carrying the whole `total`, `END_STREAM` on the last only. The receiver keeps one partial
//!   message per stream, at most 256 at once (`MAX_PARTIALS`; a sender keeps to 128, waiting for
//!   a place), checks every piece against the total (`len > total - received`, which cannot
//!   overflow), copies it out with `Lease::copy_into` and releases the block at once, so the
//!   sender refills it while the receiver copies the next piece.
//!   A CANCEL or TRAILERS on the stream discards a partial message. A 2 GiB message passes through
//!   a 64 MiB arena this way.
//!
//! A `BlockMut` dropped unsent, or whose send failed, frees its block with `free_own` and rings
//! this side's own tx doorbell if a waiter announced it sleeps: the peer never saw the block and
//! will not ring for it (ADR 0002).
//!
//! Reassembly buffers come from a pool private to the `Receiver`. A buffer starts empty, or is a
//! pooled one cleared, and grows only with the bytes that arrive (`try_reserve` per piece), so the
//! peer's `total` never decides how much is reserved. The bytes held in all of them at once are
//! bounded by `Config::max_reassembly` (`reassembling`), so messages a peer starts and never ends
//! cost at most that. A piece that would go past the bound, or a reservation that fails, makes its
//! message `MessageTooLarge` (its bytes dropped, remaining pieces released uncopied) instead of
//! aborting the process or failing the connection. When the
//! delivered `Bytes` drops, its buffer goes back to the pool, which keeps at most two of at most
//! 256 MiB each. A new message takes the smallest spare that holds its total, else the largest: a
//! stream of large messages reuses memory already faulted in (65,536 page faults saved at 256 MiB,
//! which cost more than the copies), and a small message does not pin the biggest buffer.
//!
//! `try_recv` returns `None` after 256 pieces in one call (`MAX_PIECES_PER_CALL`) even if frames
//! wait, so a long message cannot hold the receiving thread, an event loop's say; `recv` and
//! `recv_async` simply call it again. External event loops drive the receive side with `arm`,
//! `disarm`, `doorbell_fd` and `liveness_fd` (`arm` returns false while a frame waits, so the loop
//! calls `try_recv` again). The send side has no such interface: a send waits only when the ring or
//! the arena is full. [`Interrupter`] lets another thread or task wake a receive wait
//! (`recv_async_interruptible`), which the RPC layer uses to take the receiver from its reader
//! task.

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;

use crate::arena::{Allocator, ArenaOwner, Lease, Releaser};
use crate::config::{Config, SpinPolicy, COMPOSING_MIN};
use crate::doorbell::{wake_if_parked, Bell, Waiter};
use crate::error::{Error, ErrorKind, Result};
use crate::frame::{flags, ArenaDescriptor, FrameHeader, Kind};
use crate::layout::{self, CLIENT_TO_SERVER, SERVER_TO_CLIENT};
use crate::link::{Health, Link};
use crate::ring::{FrameConsumer, FrameProducer};
use crate::segment::Segment;
use crate::shared::{Drain, SharedArena, SharedBlock, SharedView};
use crate::stats::{Counters, Stats};

/// Which end of the handshake this side was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Connected to a listener.
    Client,
    /// Accepted by a listener.
    Server,
}

/// Credentials of the process at the other end, from `SO_PEERCRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// A frame as delivered to the receiver. For MESSAGE frames `body` is the whole message,
/// however it travelled: copied out of the ring, a view into the peer's arena, or reassembled
/// from pieces.
#[derive(Clone, PartialEq, Eq)]
pub struct Frame {
    /// The frame kind.
    pub kind: Kind,
    /// Flag bits (the transport-internal [`flags::TRANSPORT`] bits are never set here).
    pub flags: u8,
    /// The stream the frame belongs to.
    pub stream: u64,
    /// The body.
    pub body: Bytes,
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("flags", &self.flags)
            .field("stream", &self.stream)
            .field("len", &self.body.len())
            .finish()
    }
}

/// The doorbells of one connection: ours we sleep on, the peer's we ring.
#[derive(Debug)]
pub(crate) struct Bells {
    pub(crate) my_rx: Arc<Bell>,
    pub(crate) my_tx: Arc<Bell>,
    pub(crate) peer_rx: Arc<Bell>,
    pub(crate) peer_tx: Arc<Bell>,
}

/// State shared by the sender and receiver of one connection.
#[derive(Debug)]
struct Core {
    seg: Arc<Segment>,
    role: Role,
    tx: usize,
    rx: usize,
    inline_max: usize,
    max_message_size: u64,
    /// `Config::max_reassembly`, resolved.
    max_reassembly: u64,
    spin: SpinPolicy,
    link: Link,
    bells: Bells,
    stats: Stats,
    peer: PeerInfo,
    ring: Mutex<FrameProducer>,
    arena: Mutex<ArenaOwner>,
    /// The listener's shared arena, whose blocks this (server) side can send by reference.
    shared: Option<SharedArena>,
    /// The optional features the handshake agreed on (`handshake::features`).
    features: u16,
    /// Set by an [`Interrupter`]: the receiver's interruptible wait should return.
    interrupted: std::sync::atomic::AtomicBool,
    /// The messages this side is sending in pieces, held below the peer's `MAX_PARTIALS`.
    pieces: PieceSlots,
}

/// Messages one side sends in pieces at once: half of what a receiver takes (`MAX_PARTIALS`,
/// past which it closes the connection), since a message abandoned half-way (its call dropped
/// while it was being sent) gives its place back here before its stream's end reaches the
/// receiver, which holds the message until then.
const MAX_SENDING_IN_PIECES: usize = MAX_PARTIALS / 2;

/// The count of messages being sent in pieces, and the waits for a place among them (blocking
/// and async alike).
#[derive(Debug, Default)]
struct PieceSlots {
    taken: AtomicUsize,
    freed: event_listener::Event,
}

/// A place among the messages in pieces, given back when its message is sent or abandoned.
struct PieceSlot<'a>(&'a PieceSlots);

impl PieceSlots {
    fn try_take(&self) -> Option<PieceSlot<'_>> {
        let more = |n: usize| (n < MAX_SENDING_IN_PIECES).then_some(n + 1);
        self.taken.fetch_update(Ordering::AcqRel, Ordering::Acquire, more).ok().map(|_| PieceSlot(self))
    }

    /// A place now, or the listener a freed place wakes: listening before the second look, so
    /// that a place freed in between wakes the wait.
    fn take_or_listen(&self) -> std::result::Result<PieceSlot<'_>, event_listener::EventListener> {
        if let Some(place) = self.try_take() {
            return Ok(place);
        }
        let freed = self.freed.listen();
        self.try_take().ok_or(freed)
    }

    /// Waits until `deadline` for a place (the others' messages are still being sent).
    fn take(&self, deadline: Option<Instant>) -> Result<PieceSlot<'_>> {
        use event_listener::Listener;
        loop {
            let freed = match self.take_or_listen() {
                Ok(place) => return Ok(place),
                Err(freed) => freed,
            };
            match deadline {
                None => freed.wait(),
                Some(deadline) => {
                    if freed.wait_deadline(deadline).is_none() {
                        return self.try_take().ok_or_else(|| {
                            Error::timeout("waiting for one of the other messages being sent in pieces to finish")
                        });
                    }
                }
            }
        }
    }

    #[cfg(feature = "tokio")]
    async fn take_async(&self) -> PieceSlot<'_> {
        loop {
            match self.take_or_listen() {
                Ok(place) => return place,
                Err(freed) => freed.await,
            }
        }
    }
}

impl Drop for PieceSlot<'_> {
    fn drop(&mut self) {
        self.0.taken.fetch_sub(1, Ordering::AcqRel);
        // One more waiter each time (`additional`): a plain `notify(1)` does nothing while an
        // earlier notified waiter has not yet run, so a burst of freed places could rely on
        // that waiter passing its wake-up on.
        self.0.freed.notify(event_listener::IntoNotification::additional(1));
    }
}

fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock().map_err(|_| Error::new(ErrorKind::Closed, "a thread panicked while sending on this connection"))
}

impl Core {
    fn tx_waiter(&self, what: &'static str) -> Waiter<'_> {
        Waiter {
            bell: &self.bells.my_tx,
            parked: self.seg.ctl_u32(self.tx, layout::CTL_PRODUCER_PARKED),
            link: &self.link,
            spin: self.spin,
            stats: &self.stats,
            what,
            composing: None,
        }
    }

    /// The wait for the peer's next frame. For a blocking wait `heard` is
    /// [`Stats::bytes_sent`] when the last frame came in: what we sent since then the peer must
    /// still read, so the spin may last longer ([`SpinPolicy::owing`]). Async waits pass `None`
    /// and their caller's `spin`: their spin holds a runtime worker other tasks need, and
    /// measured slower with the extension (ADR 0014).
    fn rx_waiter(&self, heard: Option<u64>, spin: SpinPolicy) -> Waiter<'_> {
        let spin = match heard {
            Some(heard) => {
                let sent = self.stats.bytes_sent.load(std::sync::atomic::Ordering::Relaxed);
                self.spin.owing(sent.saturating_sub(heard))
            }
            None => spin,
        };
        Waiter {
            bell: &self.bells.my_rx,
            parked: self.seg.ctl_u32(self.rx, layout::CTL_CONSUMER_PARKED),
            link: &self.link,
            spin,
            stats: &self.stats,
            what: "waiting for a frame",
            composing: Some(self.seg.ctl_u64(self.rx, layout::CTL_COMPOSING)),
        }
    }

    /// A fatal error: remember it, tell the peer, hand it back.
    fn fail(&self, e: Error) -> Error {
        if e.is_fatal() {
            self.link.fail(Error::new(e.kind(), e.to_string()));
        }
        e
    }

    fn try_push(&self, header: &FrameHeader, body: &[&[u8]]) -> Result<bool> {
        self.link.check()?;
        let pushed = lock(&self.ring)?.try_push(header, body).map_err(|e| self.fail(e))?;
        if pushed {
            self.stats.add(&self.stats.frames_sent, 1);
            self.wake_peer_reader();
        }
        Ok(pushed)
    }

    /// Rings the peer's receive doorbell if its reader sleeps (no system call otherwise).
    fn wake_peer_reader(&self) {
        if wake_if_parked(self.seg.ctl_u32(self.tx, layout::CTL_CONSUMER_PARKED), &self.bells.peer_rx) {
            self.stats.add(&self.stats.doorbells_rung, 1);
        }
    }

    /// Our `CTL_COMPOSING` word: the bytes of large blocks we are writing (ADR 0026).
    fn composing(&self) -> &std::sync::atomic::AtomicU64 {
        self.seg.ctl_u64(self.tx, layout::CTL_COMPOSING)
    }

    fn ring_has_room(&self, body_len: usize) -> Result<bool> {
        lock(&self.ring)?.has_room(body_len).map_err(|e| self.fail(e))
    }

    fn try_alloc(&self, len: usize) -> Result<Option<(usize, u64, *mut u8)>> {
        self.link.check()?;
        let mut arena = lock(&self.arena)?;
        let got = arena.try_alloc(len).map_err(|e| self.fail(e))?;
        if got.is_some() {
            self.stats.max(&self.stats.arena_high_water, arena.allocator().high_water() as u64);
        }
        Ok(got)
    }

    fn arena_has_room(&self, len: usize) -> Result<bool> {
        lock(&self.arena)?.can_alloc(len).map_err(|e| self.fail(e))
    }

    fn check_block_len(&self, len: usize) -> Result<()> {
        let cap = self.seg.layout().arena_size[self.tx];
        if Allocator::block_len(len) > cap {
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!("a {len}-byte block does not fit this side's {cap}-byte arena"),
            ));
        }
        Ok(())
    }
}

impl Drain for Core {
    fn drain(&self) {
        let Ok(mut arena) = self.arena.lock() else { return };
        if self.link.health.is_closed() {
            // The client releases nothing now, but may still read what it holds: those blocks
            // wait for its process to exit.
            if let Some(shared) = &self.shared {
                shared.bury(self.peer.pid, arena.end_lending());
            }
        } else if let Err(e) = arena.reclaim() {
            self.fail(e);
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        if self.link.health.forked() {
            return; // the lending records are the parent's to keep (link.rs)
        }
        if let Some(shared) = &self.shared {
            // Even after a panic under the lock: the blocks' bookkeeping is whole between calls,
            // and freeing them now could change what the client reads.
            let arena = self.arena.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            shared.bury(self.peer.pid, arena.end_lending());
        }
    }
}

/// A shared block recorded as lent for a frame not pushed yet: if the send is abandoned (its
/// deadline, an error, or its future dropped while it waits for ring room), the peer never sees
/// the frame and will never give the block back, so the record goes.
struct Lending<'a> {
    sender: &'a Sender,
    block: &'a SharedBlock,
    pushed: bool,
}

impl Drop for Lending<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            self.sender.unlend(self.block);
        }
    }
}

/// The sending half of a connection. Cheap to clone; clones share one ring, serialised by a lock
/// in this process's memory (never one in shared memory).
#[derive(Clone)]
pub struct Sender {
    core: Arc<Core>,
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender").field("role", &self.core.role).finish_non_exhaustive()
    }
}

/// How a message of a given size travels.
enum Route {
    Inline,
    Block,
    Pieces(usize),
}

impl Sender {
    fn route(&self, len: usize) -> Route {
        let arena = self.core.seg.layout().arena_size[self.core.tx];
        if len <= self.core.inline_max {
            Route::Inline
        } else if len <= arena / 2 {
            Route::Block
        } else {
            // Quarter-arena pieces let the receiver copy one out while we fill the next.
            Route::Pieces(arena / 4)
        }
    }

    /// Whether a message of `len` bytes goes in pieces (over half the arena), which the peer
    /// reassembles until the last one, or the stream's CANCEL or TRAILERS, arrives.
    pub fn in_pieces(&self, len: usize) -> bool {
        matches!(self.route(len), Route::Pieces(_))
    }

    /// Sends one frame with an inline body (HEADERS, TRAILERS, CANCEL, PING, GOAWAY, or a small
    /// MESSAGE), waiting for ring room until `deadline`.
    pub fn send(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[u8], deadline: Option<Instant>) -> Result<()> {
        self.send_parts(kind, frame_flags, stream, &[body], deadline)
    }

    /// Like [`send`](Self::send) with a body given in parts (a header and a payload, say),
    /// copied into the ring back to back with no intermediate buffer.
    pub fn send_parts(
        &self,
        kind: Kind,
        frame_flags: u8,
        stream: u64,
        body: &[&[u8]],
        deadline: Option<Instant>,
    ) -> Result<()> {
        let header = self.header(kind, frame_flags, stream, body)?;
        self.push(&header, body, deadline)
    }

    /// Pushes one frame, waiting for ring room until `deadline`.
    fn push(&self, header: &FrameHeader, body: &[&[u8]], deadline: Option<Instant>) -> Result<()> {
        let len = header.len as usize;
        while !self.core.try_push(header, body)? {
            self.core.stats.add(&self.core.stats.ring_full_waits, 1);
            self.core
                .tx_waiter("waiting for room in the frame ring")
                .wait(deadline, || self.core.ring_has_room(len))?;
        }
        Ok(())
    }

    /// [`push`](Self::push), waiting on tokio.
    #[cfg(feature = "tokio")]
    async fn push_async(&self, header: &FrameHeader, body: &[&[u8]]) -> Result<()> {
        let len = header.len as usize;
        while !self.core.try_push(header, body)? {
            self.core.stats.add(&self.core.stats.ring_full_waits, 1);
            // Boxed: the wait's state is large and rarely needed, and every future that sends
            // would otherwise carry it (the engine allocates a call's future per call).
            Box::pin(
                self.core.tx_waiter("waiting for room in the frame ring").wait_async(|| self.core.ring_has_room(len)),
            )
            .await?;
        }
        Ok(())
    }

    /// [`send`](Self::send) without waiting: `Ok(false)`, with nothing sent, while the ring
    /// has no room. For a thread that must not wait (a foreign handler's reply, a status), and
    /// has a slower way to fall back on.
    pub fn try_send(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[u8]) -> Result<bool> {
        self.try_send_parts(kind, frame_flags, stream, &[body])
    }

    /// [`try_send`](Self::try_send) with a body given in parts, as [`send_parts`](Self::send_parts).
    pub fn try_send_parts(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[&[u8]]) -> Result<bool> {
        let header = self.frame(kind, frame_flags, stream, body)?;
        let pushed = self.core.try_push(&header, body)?;
        if pushed {
            self.count_sent(&header);
        }
        Ok(pushed)
    }

    /// The header of a frame about to be sent, its message bytes counted as sent.
    fn header(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[&[u8]]) -> Result<FrameHeader> {
        let header = self.frame(kind, frame_flags, stream, body)?;
        self.count_sent(&header);
        Ok(header)
    }

    /// Counts a message frame's bytes as sent.
    fn count_sent(&self, header: &FrameHeader) {
        if header.kind == Kind::Message {
            self.core.stats.add(&self.core.stats.bytes_sent, u64::from(header.len));
        }
    }

    /// The header of a frame, checked: no transport flags, a body that fits a frame.
    fn frame(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[&[u8]]) -> Result<FrameHeader> {
        if frame_flags & flags::TRANSPORT != 0 {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the ARENA and SHARED flags are the transport's own; send blocks with send_block or send_shared",
            ));
        }
        let len: usize = body.iter().map(|b| b.len()).sum();
        let len = u32::try_from(len)
            .map_err(|_| Error::new(ErrorKind::TooLarge, format!("a {len}-byte frame body is too large")))?;
        Ok(FrameHeader { len, kind, flags: frame_flags, stream })
    }

    /// Sends a message of any size, 0 bytes to many GiB: inline if small, through one arena block
    /// if it fits half the arena, else in quarter-arena pieces the receiver reassembles.
    /// Waits for ring and arena room until `deadline`.
    pub fn send_message(&self, stream: u64, frame_flags: u8, payload: &[u8], deadline: Option<Instant>) -> Result<()> {
        match self.route(payload.len()) {
            Route::Inline => self.send(Kind::Message, frame_flags, stream, payload, deadline),
            Route::Block => {
                let mut block = self.alloc(payload.len(), deadline)?;
                crate::copy_into_shared(&mut block, payload);
                self.send_block(stream, frame_flags, block, deadline)
            }
            Route::Pieces(piece) => {
                let _place = self.core.pieces.take(deadline)?;
                let total = payload.len() as u64;
                let mut chunks = payload.chunks(piece).peekable();
                while let Some(chunk) = chunks.next() {
                    let last = chunks.peek().is_none();
                    let mut block = self.alloc(chunk.len(), deadline)?;
                    crate::copy_into_shared(&mut block, chunk);
                    let f = if last { frame_flags } else { frame_flags & !flags::END_STREAM };
                    self.send_block_as(stream, f, block, total, deadline)?;
                }
                Ok(())
            }
        }
    }

    /// Takes a writable block of `len` bytes from this side's arena, waiting until `deadline`
    /// for the peer to release room. Fill it (or serialize into it) and pass it to
    /// [`send_block`](Self::send_block): the receiver reads it in place, with no copy.
    pub fn alloc(&self, len: usize, deadline: Option<Instant>) -> Result<BlockMut> {
        self.core.check_block_len(len)?;
        loop {
            if let Some((offset, generation, ptr)) = self.core.try_alloc(len)? {
                return Ok(self.block(offset, generation, ptr, len));
            }
            self.core.stats.add(&self.core.stats.arena_full_waits, 1);
            self.core
                .tx_waiter("waiting for room in the payload arena")
                .wait(deadline, || self.core.arena_has_room(len))?;
        }
    }

    /// [`alloc`](Self::alloc) without waiting: `None` while the arena has no room for `len`
    /// bytes (the peer still holds the blocks that would make it), for a caller that must not
    /// wait (an event loop's thread), and has somewhere else to put the bytes.
    pub fn try_alloc(&self, len: usize) -> Result<Option<BlockMut>> {
        self.core.check_block_len(len)?;
        let got = self.core.try_alloc(len)?;
        Ok(got.map(|(offset, generation, ptr)| self.block(offset, generation, ptr, len)))
    }

    /// A block just taken from the arena. One of [`COMPOSING_MIN`] bytes or more is announced
    /// to the peer until it is sent or dropped (`layout::CTL_COMPOSING`), and the announcement
    /// rings a peer that sleeps waiting for frames: it wakes while this side writes the block,
    /// spins, and takes the frame as it comes, where it would otherwise start to wake only
    /// then (ADR 0026).
    fn block(&self, offset: usize, generation: u64, ptr: *mut u8, len: usize) -> BlockMut {
        let mut announced = 0;
        if len >= COMPOSING_MIN {
            announced = len as u64;
            self.core.composing().fetch_add(announced, Ordering::Relaxed);
            self.core.wake_peer_reader();
        }
        BlockMut { sender: self.clone(), offset, generation, ptr, len, sent: false, announced }
    }

    /// Whether `block` was allocated from this connection's arena, the only one it can be sent
    /// on: a caller that reserves something for the send first (flow control's credit) looks
    /// here before, so that a block refused later takes nothing with it.
    pub fn owns(&self, block: &BlockMut) -> bool {
        Arc::ptr_eq(&block.sender.core, &self.core)
    }

    /// Sends a filled block as one MESSAGE of the block's length (after any `truncate`).
    pub fn send_block(&self, stream: u64, frame_flags: u8, block: BlockMut, deadline: Option<Instant>) -> Result<()> {
        let total = block.len as u64;
        self.send_block_as(stream, frame_flags, block, total, deadline)
    }

    fn send_block_as(
        &self,
        stream: u64,
        frame_flags: u8,
        mut block: BlockMut,
        total: u64,
        deadline: Option<Instant>,
    ) -> Result<()> {
        match self.block_frame(stream, frame_flags, &block, total)? {
            None => self.send(Kind::Message, frame_flags, stream, &[], deadline),
            Some((header, body)) => {
                self.push(&header, &[&body], deadline)?;
                block.sent = true; // the peer owns it until it comes back on the release ring
                Ok(())
            }
        }
    }

    /// The MESSAGE frame that sends `block`, marked in flight; `None` for an empty block, which
    /// travels inline.
    fn block_frame(
        &self,
        stream: u64,
        frame_flags: u8,
        block: &BlockMut,
        total: u64,
    ) -> Result<Option<(FrameHeader, [u8; ArenaDescriptor::LEN])>> {
        if !self.owns(block) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "a block can only be sent on the connection it was allocated from",
            ));
        }
        if frame_flags & flags::TRANSPORT != 0 {
            return Err(Error::new(ErrorKind::InvalidConfig, "the ARENA and SHARED flags are the transport's own"));
        }
        if block.len == 0 {
            return Ok(None);
        }
        // From here the peer may give the block back; until here it could not.
        if !lock(&self.core.arena)?.mark_in_flight(block.offset, block.generation) {
            return Err(self.core.fail(Error::new(ErrorKind::Closed, "an arena block was freed before it was sent")));
        }
        let body = ArenaDescriptor { offset: block.offset as u64, len: block.len as u64, total }.encode();
        let header =
            FrameHeader { len: body.len() as u32, kind: Kind::Message, flags: frame_flags | flags::ARENA, stream };
        self.core.stats.add(&self.core.stats.bytes_sent, block.len as u64);
        Ok(Some((header, body)))
    }

    /// Sends a block of the shared arena as one MESSAGE: by reference when this connection came
    /// from the listener that owns `block`'s arena (the peer reads it in place; nothing is
    /// copied), else, or while the peer still holds this block from an earlier send, or for a
    /// message small enough to travel inline, as an ordinary message (a copy). Either way the
    /// peer receives the same bytes. Waits for ring room until `deadline`.
    pub fn send_shared(
        &self,
        stream: u64,
        frame_flags: u8,
        block: &SharedBlock,
        deadline: Option<Instant>,
    ) -> Result<()> {
        match self.shared_frame(stream, frame_flags, block)? {
            None => self.send_message(stream, frame_flags, block, deadline),
            Some((header, body)) => {
                let mut lending = Lending { sender: self, block, pushed: false };
                self.push(&header, &[&body], deadline)?;
                lending.pushed = true;
                Ok(())
            }
        }
    }

    /// [`send_shared`](Self::send_shared) only by reference: `Ok(false)`, and nothing sent, where
    /// it would send a copy.
    pub fn send_shared_by_reference(
        &self,
        stream: u64,
        frame_flags: u8,
        block: &SharedBlock,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let Some((header, body)) = self.shared_frame(stream, frame_flags, block)? else { return Ok(false) };
        let mut lending = Lending { sender: self, block, pushed: false };
        self.push(&header, &[&body], deadline)?;
        lending.pushed = true;
        Ok(true)
    }

    /// Async [`send_shared`](Self::send_shared) for tokio.
    #[cfg(feature = "tokio")]
    pub async fn send_shared_async(&self, stream: u64, frame_flags: u8, block: &SharedBlock) -> Result<()> {
        match self.shared_frame(stream, frame_flags, block)? {
            None => self.send_message_async(stream, frame_flags, block).await,
            Some((header, body)) => {
                let mut lending = Lending { sender: self, block, pushed: false };
                self.push_async(&header, &[&body]).await?;
                lending.pushed = true;
                Ok(())
            }
        }
    }

    /// The frame that sends `block` by reference, with the block recorded as lent to the peer;
    /// `None` when it must go as a copy.
    fn shared_frame(
        &self,
        stream: u64,
        frame_flags: u8,
        block: &SharedBlock,
    ) -> Result<Option<(FrameHeader, [u8; ArenaDescriptor::LEN])>> {
        if frame_flags & flags::TRANSPORT != 0 {
            return Err(Error::new(ErrorKind::InvalidConfig, "the ARENA and SHARED flags are the transport's own"));
        }
        let c = &self.core;
        match &c.shared {
            Some(arena) if arena.same(block.arena()) && block.len() > c.inline_max => {}
            _ => return Ok(None),
        }
        c.link.check()?;
        {
            let mut arena = lock(&c.arena)?;
            // What the peer gave back since the last send comes back first, so a subscriber
            // that keeps up never makes a publisher copy.
            arena.reclaim().map_err(|e| c.fail(e))?;
            if !arena.lend(block) {
                return Ok(None);
            }
        }
        let len = block.len() as u64;
        let body = ArenaDescriptor { offset: block.offset() as u64, len, total: len }.encode();
        let header = FrameHeader {
            len: body.len() as u32,
            kind: Kind::Message,
            flags: frame_flags | flags::ARENA | flags::SHARED,
            stream,
        };
        c.stats.add(&c.stats.bytes_sent, len);
        c.stats.add(&c.stats.shared_sent, 1);
        Ok(Some((header, body)))
    }

    fn unlend(&self, block: &SharedBlock) {
        if let Ok(mut arena) = self.core.arena.lock() {
            arena.unlend(block);
        }
    }

    /// The shared arena whose blocks this side sends by reference (a server's, from its
    /// listener); `None` on a client, or a server without one.
    pub fn shared_arena(&self) -> Option<&SharedArena> {
        self.core.shared.as_ref()
    }

    /// Blocks of the shared arena the peer holds now (sent and not given back yet).
    pub fn shared_lent(&self) -> usize {
        self.core.arena.lock().map_or(0, |a| a.lent())
    }

    /// Async [`send_block`](Self::send_block) for tokio.
    #[cfg(feature = "tokio")]
    pub async fn send_block_async(&self, stream: u64, frame_flags: u8, block: BlockMut) -> Result<()> {
        let total = block.len as u64;
        self.send_block_as_async(stream, frame_flags, block, total).await
    }

    #[cfg(feature = "tokio")]
    async fn send_block_as_async(&self, stream: u64, frame_flags: u8, mut block: BlockMut, total: u64) -> Result<()> {
        match self.block_frame(stream, frame_flags, &block, total)? {
            None => self.send_async(Kind::Message, frame_flags, stream, &[]).await,
            Some((header, body)) => {
                self.push_async(&header, &[&body]).await?;
                block.sent = true;
                Ok(())
            }
        }
    }

    /// Async [`send_message`](Self::send_message) for tokio: any size, with the same routes.
    #[cfg(feature = "tokio")]
    pub async fn send_message_async(&self, stream: u64, frame_flags: u8, payload: &[u8]) -> Result<()> {
        match self.route(payload.len()) {
            Route::Inline => self.send_async(Kind::Message, frame_flags, stream, payload).await,
            Route::Block => {
                let mut block = self.alloc_async(payload.len()).await?;
                crate::copy_into_shared(&mut block, payload);
                self.send_block_as_async(stream, frame_flags, block, payload.len() as u64).await
            }
            Route::Pieces(piece) => {
                let _place = self.core.pieces.take_async().await;
                let total = payload.len() as u64;
                let mut chunks = payload.chunks(piece).peekable();
                while let Some(chunk) = chunks.next() {
                    let f = if chunks.peek().is_none() { frame_flags } else { frame_flags & !flags::END_STREAM };
                    let mut block = self.alloc_async(chunk.len()).await?;
                    crate::copy_into_shared(&mut block, chunk);
                    self.send_block_as_async(stream, f, block, total).await?;
                }
                Ok(())
            }
        }
    }

    /// Async [`send`](Self::send) for tokio; wrap in `tokio::time::timeout` for a deadline.
    #[cfg(feature = "tokio")]
    pub async fn send_async(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[u8]) -> Result<()> {
        self.send_parts_async(kind, frame_flags, stream, &[body]).await
    }

    /// Async [`send_parts`](Self::send_parts) for tokio.
    #[cfg(feature = "tokio")]
    pub async fn send_parts_async(&self, kind: Kind, frame_flags: u8, stream: u64, body: &[&[u8]]) -> Result<()> {
        let header = self.header(kind, frame_flags, stream, body)?;
        self.push_async(&header, body).await
    }

    /// Async [`alloc`](Self::alloc) for tokio.
    #[cfg(feature = "tokio")]
    pub async fn alloc_async(&self, len: usize) -> Result<BlockMut> {
        self.core.check_block_len(len)?;
        loop {
            if let Some((offset, generation, ptr)) = self.core.try_alloc(len)? {
                return Ok(self.block(offset, generation, ptr, len));
            }
            self.core.stats.add(&self.core.stats.arena_full_waits, 1);
            // Boxed for the reason `push_async` gives.
            Box::pin(
                self.core
                    .tx_waiter("waiting for room in the payload arena")
                    .wait_async(|| self.core.arena_has_room(len)),
            )
            .await?;
        }
    }

    /// The optional protocol features both sides agreed on in the handshake
    /// ([`crate::features`]).
    pub fn features(&self) -> u16 {
        self.core.features
    }

    /// Counts a message of `len` bytes that the RPC layer sent inside another frame's body (a
    /// one-frame call's HEADERS or TRAILERS), as [`send_message`](Self::send_message) counts its own.
    pub fn count_sent_inside(&self, len: usize) {
        self.core.stats.add(&self.core.stats.bytes_sent, len as u64);
    }

    /// Takes in a message of `len` bytes that arrived inside another frame's body on `stream`:
    /// counts it as received and holds it to this side's `max_message_size`, failing with
    /// [`ErrorKind::MessageTooLarge`] on that stream as a MESSAGE frame would.
    pub fn received_inside(&self, stream: u64, len: usize) -> Result<()> {
        self.core.stats.add(&self.core.stats.bytes_received, len as u64);
        if len as u64 > self.core.max_message_size {
            return Err(too_large(self.core.role, stream, len as u64, self.core.max_message_size));
        }
        Ok(())
    }

    /// Largest message that travels inline in the ring.
    pub fn inline_max(&self) -> usize {
        self.core.inline_max
    }

    /// Whether [`send_message`](Self::send_message) sends a message of `len` bytes as one block
    /// of the arena (not inline in the ring, nor in pieces).
    pub fn sends_as_block(&self, len: usize) -> bool {
        matches!(self.route(len), Route::Block)
    }

    /// Largest block [`alloc`](Self::alloc) can return: this side's arena size.
    pub fn max_block(&self) -> usize {
        self.core.seg.layout().arena_size[self.core.tx]
    }

    /// Closes the connection: the peer sees EOF, and every wait here ends with
    /// [`ErrorKind::Closed`].
    pub fn close(&self) {
        self.core.link.fail(Error::new(ErrorKind::Closed, "the connection was closed by this side"));
    }

    /// True once the connection is closed, from either end or by an error.
    pub fn is_closed(&self) -> bool {
        self.core.link.health.is_closed()
    }

    /// Whether this process is a child forked since the connection was made: the connection
    /// is the parent's, and counts as closed here (see [`crate::forks`]).
    pub fn forked(&self) -> bool {
        self.core.link.health.forked()
    }

    /// Checks the socket now (one non-blocking system call) and reports a dead peer.
    pub fn check_alive(&self) -> Result<()> {
        self.core.link.poll_alive()
    }

    /// The connection's counters. Takes in the peer's releases first, so `arena_in_use` counts
    /// only what is still out.
    pub fn counters(&self) -> Counters {
        let mut counters = self.core.stats.snapshot();
        if let Ok(mut arena) = self.core.arena.lock() {
            if let Err(e) = arena.reclaim() {
                self.core.fail(e);
            }
            counters.arena_in_use = arena.allocator().in_use() as u64;
        }
        counters
    }

    /// Credentials of the peer process.
    pub fn peer(&self) -> PeerInfo {
        self.core.peer
    }

    /// Which end of the handshake this side was.
    pub fn role(&self) -> Role {
        self.core.role
    }

    /// Test support: writes `bytes` at `offset` of the shared segment, as a hostile or buggy
    /// peer could, bypassing every protocol. Out-of-range writes are clipped. Never use this for
    /// anything but testing how the *other* side copes.
    #[doc(hidden)]
    pub fn scribble_for_tests(&self, offset: usize, bytes: &[u8]) {
        let total = self.core.seg.layout().total;
        if offset >= total {
            return;
        }
        let n = bytes.len().min(total - offset);
        if n == 0 {
            return;
        }
        self.core.seg.region(offset, n).write_wrapping(0, &bytes[..n]);
    }

    /// Test support: rings the peer's receive doorbell, as a producer does after publishing.
    #[doc(hidden)]
    pub fn ring_peer_for_tests(&self) {
        self.core.bells.peer_rx.ring();
    }

    /// Test support: the control word `field` (a `layout::CTL_*` offset) of direction `dir`,
    /// read as a `u64` (a `u32` flag reads as its value: the rest of its stretch is zero).
    /// `None` for a direction or field outside the control block.
    #[doc(hidden)]
    pub fn control_word_for_tests(&self, dir: usize, field: usize) -> Option<u64> {
        if dir > SERVER_TO_CLIENT || field % layout::CONTROL_STRIDE != 0 || field >= 8 * layout::CONTROL_STRIDE {
            return None;
        }
        Some(self.core.seg.ctl_u64(dir, field).load(Ordering::Acquire))
    }

    /// Test support: the segment's layout, to aim [`scribble_for_tests`](Self::scribble_for_tests).
    #[doc(hidden)]
    pub fn layout_for_tests(&self) -> crate::layout::Layout {
        *self.core.seg.layout()
    }
}

/// A writable block of this side's arena, not yet sent. Dropping it unsent gives it back.
pub struct BlockMut {
    sender: Sender,
    offset: usize,
    generation: u64,
    ptr: *mut u8,
    len: usize,
    sent: bool,
    /// What this block added to our `CTL_COMPOSING` word; taken back when it is sent or freed.
    announced: u64,
}

// SAFETY: the block is exclusively ours (the allocator handed it out once and nothing else
// writes to it until it is sent), and the Sender inside keeps the mapping alive.
unsafe impl Send for BlockMut {}
// SAFETY: shared references only read.
unsafe impl Sync for BlockMut {}

/// Keeps the segment of a [`BlockMut`] mapped while it lives, and nothing else of its
/// connection: for a binding whose callers may hold the block's address past its send (a
/// Python object a tool took the address of). Writes there after the send land in the arena,
/// perhaps in a later block, never in unmapped memory.
#[derive(Clone)]
pub struct Mapping {
    _segment: Arc<Segment>,
}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping").finish_non_exhaustive()
    }
}

impl BlockMut {
    /// What keeps this block's memory mapped (see [`Mapping`]).
    pub fn mapping(&self) -> Mapping {
        Mapping { _segment: self.sender.core.seg.clone() }
    }

    /// Whether this block was allocated from `sender`'s connection (the only one it can be
    /// sent on).
    pub fn is_from(&self, sender: &Sender) -> bool {
        Arc::ptr_eq(&self.sender.core, &sender.core)
    }

    /// Shortens the block to `len` bytes (for a serializer that wrote less than it reserved).
    /// The arena space stays reserved until the receiver releases it.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl fmt::Debug for BlockMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockMut").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl Deref for BlockMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is a block of our arena that the allocator gave to this value
        // alone; the mapping lives while `sender` does.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for BlockMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for BlockMut {
    fn drop(&mut self) {
        let core = &self.sender.core;
        if core.link.health.forked() {
            return; // the control words and the peer's bell are the parent's (link.rs)
        }
        if self.announced != 0 {
            // After the push when the block was sent: the peer's spin lasts until the frame is
            // there. The peer may scribble on the word; that only misleads its own spin.
            core.composing().fetch_sub(self.announced, Ordering::Relaxed);
        }
        if self.sent {
            return;
        }
        if let Ok(mut arena) = self.sender.core.arena.lock() {
            arena.free_unsent(self.offset, self.generation);
        }
        // Another thread of ours may be waiting for exactly this room; the peer will not ring
        // for it (it never saw the block), so we do, the way the peer rings for released blocks:
        // only if a waiter has announced its sleep (no system call otherwise).
        wake_if_parked(core.seg.ctl_u32(core.tx, layout::CTL_PRODUCER_PARKED), &core.bells.my_tx);
    }
}

/// Reassembly buffers come back here when the message that used one is dropped, so a stream of
/// large messages reuses warm memory instead of faulting in fresh pages (for 256 MiB that is
/// 65,536 page faults, more than the copies themselves). Bounded: two buffers of up to 256 MiB,
/// so a connection keeps at most 512 MiB warm after its largest messages are gone.
#[derive(Debug, Default)]
struct BufferPool {
    spare: Mutex<Vec<Vec<u8>>>,
}

impl BufferPool {
    const KEEP: usize = 2;
    const MAX_POOLED: usize = 256 << 20;

    /// A buffer for a `total`-byte message: the smallest spare that holds it, else the largest
    /// (it grows from there), else a new one.
    fn take(&self, total: u64) -> Vec<u8> {
        let reused = self.spare.lock().ok().and_then(|mut spare| {
            let fits = |v: &Vec<u8>| v.capacity() as u64 >= total;
            let best = spare
                .iter()
                .enumerate()
                .filter(|(_, v)| fits(v))
                .min_by_key(|(_, v)| v.capacity())
                .or_else(|| spare.iter().enumerate().max_by_key(|(_, v)| v.capacity()))
                .map(|(i, _)| i)?;
            Some(spare.swap_remove(best))
        });
        match reused {
            Some(mut v) => {
                v.clear();
                v
            }
            // Grows with what arrives (large reallocations are remaps, not copies).
            None => Vec::new(),
        }
    }

    fn give(&self, v: Vec<u8>) {
        if v.capacity() <= Self::MAX_POOLED {
            if let Ok(mut spare) = self.spare.lock() {
                if spare.len() < Self::KEEP {
                    spare.push(v);
                }
            }
        }
    }
}

/// The bytes of received messages copied out of the arena and not yet dropped
/// (`Config::copy_received`), against its limit.
#[derive(Debug)]
struct Copies {
    held: AtomicU64,
    limit: u64,
}

impl Copies {
    /// Counts `len` bytes more if they stay within the limit; whether they do.
    fn take(&self, len: u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(len).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    fn give(&self, len: u64) {
        self.held.fetch_sub(len, Ordering::AcqRel);
    }
}

/// Who is told when a message held in our own memory is dropped.
trait Keeper {
    fn dropped(&self, buf: Vec<u8>);
}

impl Keeper for BufferPool {
    fn dropped(&self, buf: Vec<u8>) {
        self.give(buf);
    }
}

impl Keeper for Copies {
    fn dropped(&self, buf: Vec<u8>) {
        self.give(buf.len() as u64);
    }
}

/// A received message in our own memory: a reassembled one, whose buffer goes back to the
/// pool, or one copied out of the arena, whose bytes leave the count of copies, when the last
/// `Bytes` of it drops.
struct Held<K: Keeper> {
    buf: Vec<u8>,
    keeper: Arc<K>,
}

impl<K: Keeper> AsRef<[u8]> for Held<K> {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl<K: Keeper> Drop for Held<K> {
    fn drop(&mut self) {
        self.keeper.dropped(std::mem::take(&mut self.buf));
    }
}

/// Pieces `try_recv` handles before it returns to its caller.
const MAX_PIECES_PER_CALL: usize = 256;
/// Messages that may be arriving in pieces at once on one connection; more is a protocol error
/// (each costs the peer one frame and us a buffer).
const MAX_PARTIALS: usize = 256;

/// A message arriving in pieces.
#[derive(Debug)]
struct Partial {
    buf: Vec<u8>,
    received: u64,
    total: u64,
    oversize: bool,
    /// Under the limit, but no memory for it: why, once known.
    refused: Option<Refused>,
}

/// Why a message in pieces under `max_message_size` is dropped all the same.
#[derive(Debug, Clone, Copy)]
enum Refused {
    /// The allocator had no room for its next piece.
    Unreservable,
    /// Its next piece would have taken the bytes held in pieces past `max_reassembly`; the
    /// bytes of the other messages held then.
    OverReassembly { others: u64 },
}

/// The receiving half of a connection. One per connection: the frame ring has one reader.
pub struct Receiver {
    core: Arc<Core>,
    ring: FrameConsumer,
    releaser: Arc<Releaser>,
    partial: HashMap<u64, Partial>,
    /// Bytes copied into the buffers of `partial` (those not dropped), against
    /// `Core::max_reassembly`.
    reassembling: u64,
    pool: Arc<BufferPool>,
    /// `Config::copy_received`: whole arena messages are copied out as they arrive, while the
    /// copies held stay under its limit.
    copies: Option<Arc<Copies>>,
    /// Our `bytes_sent` when the peer's last frame came in (see [`Core::rx_waiter`]); read by
    /// blocking waits only.
    heard: u64,
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver").field("role", &self.core.role).finish_non_exhaustive()
    }
}

impl Receiver {
    /// Messages arriving in pieces that this side holds part of now: each ends with its last
    /// piece, or with its stream's CANCEL or TRAILERS.
    pub fn partial_messages(&self) -> usize {
        self.partial.len()
    }

    /// Takes the next frame if one is waiting. Frames the peer wrote before it died are still
    /// delivered; after them comes [`ErrorKind::PeerGone`]. Returns `None` after a bounded number
    /// of message pieces even if more are waiting, so a peer streaming pieces cannot hold the
    /// caller (an event-loop thread, say) here.
    pub fn try_recv(&mut self) -> Result<Option<Frame>> {
        for _ in 0..MAX_PIECES_PER_CALL {
            let health = &self.core.link.health;
            if health.is_closed() && health.error().kind() != ErrorKind::PeerGone {
                return Err(health.error());
            }
            let raw = match self.ring.try_pop() {
                Ok(Some(raw)) => raw,
                Ok(None) => {
                    health.check()?;
                    return Ok(None);
                }
                Err(e) => return Err(self.core.fail(e)),
            };
            let c = &self.core;
            c.stats.add(&c.stats.frames_received, 1);
            self.heard = c.stats.bytes_sent.load(std::sync::atomic::Ordering::Relaxed);
            wake_if_parked(c.seg.ctl_u32(c.rx, layout::CTL_PRODUCER_PARKED), &c.bells.peer_tx);
            match self.deliver(raw.header, raw.body) {
                Ok(Some(frame)) => return Ok(Some(frame)),
                Ok(None) => continue, // a piece of a larger message
                Err(e) => return Err(self.core.fail(e)),
            }
        }
        Ok(None)
    }

    fn deliver(&mut self, h: FrameHeader, body: Bytes) -> Result<Option<Frame>> {
        let c = &self.core;
        let frame = |body: Bytes| Frame { kind: h.kind, flags: h.flags & !flags::TRANSPORT, stream: h.stream, body };
        if h.kind != Kind::Message {
            if matches!(h.kind, Kind::Cancel | Kind::Trailers) {
                // The stream is over: a message cut short by a sender's deadline goes with it.
                if let Some(p) = self.partial.remove(&h.stream) {
                    self.reassembling -= p.buf.len() as u64;
                }
            }
            return Ok(Some(frame(body)));
        }
        if h.flags & flags::ARENA == 0 {
            if self.partial.contains_key(&h.stream) {
                return Err(Error::protocol(format!(
                    "stream {}: an inline message arrived in the middle of a message in pieces",
                    h.stream
                )));
            }
            c.stats.add(&c.stats.bytes_received, body.len() as u64);
            if body.len() as u64 > c.max_message_size {
                return Err(self.too_large(h.stream, body.len() as u64));
            }
            return Ok(Some(frame(body)));
        }
        if h.flags & flags::SHARED != 0 {
            return self.deliver_shared(h, &body).map(|b| Some(frame(b)));
        }
        let arena_size = c.seg.layout().arena_size[c.rx] as u64;
        let d = ArenaDescriptor::decode(&body, arena_size)?;
        let lease = Lease::new(self.releaser.clone(), d.offset, d.len);
        c.stats.add(&c.stats.bytes_received, d.len);
        if d.len == d.total && !self.partial.contains_key(&h.stream) {
            if d.total > c.max_message_size {
                return Err(self.too_large(h.stream, d.total));
            }
            return self.received(h.stream, lease, d.len).map(|b| Some(frame(b)));
        }
        if !self.partial.contains_key(&h.stream) && self.partial.len() >= MAX_PARTIALS {
            return Err(Error::protocol(format!("more than {MAX_PARTIALS} messages in pieces at once")));
        }
        let limit = c.max_message_size;
        let pool = &self.pool;
        let p = self.partial.entry(h.stream).or_insert_with(|| {
            let oversize = d.total > limit;
            let buf = if oversize { Vec::new() } else { pool.take(d.total) };
            Partial { buf, received: 0, total: d.total, oversize, refused: None }
        });
        if p.total != d.total || d.len > p.total - p.received {
            return Err(Error::protocol(format!(
                "stream {}: message piece of {} bytes does not continue a {}-byte message ({} received)",
                h.stream, d.len, p.total, p.received
            )));
        }
        // Memory grows with what actually arrives, never with what `total` claims, and in sum no
        // further than `max_reassembly`; a piece past it, or a buffer we cannot get, makes the
        // message too large, not the process abort.
        if !p.oversize {
            let held = p.buf.len() as u64;
            let refused = if self.reassembling.saturating_add(d.len) > c.max_reassembly {
                Some(Refused::OverReassembly { others: self.reassembling - held })
            } else if lease.copy_into(&mut p.buf).is_err() {
                Some(Refused::Unreservable)
            } else {
                self.reassembling += d.len;
                None
            };
            if refused.is_some() {
                self.reassembling -= held;
                p.oversize = true;
                p.refused = refused;
                p.buf = Vec::new();
            }
        }
        drop(lease);
        p.received += d.len;
        if p.received < p.total {
            return Ok(None);
        }
        let p = self.partial.remove(&h.stream).ok_or_else(|| Error::protocol("partial message vanished"))?;
        self.reassembling -= p.buf.len() as u64;
        match p.refused {
            Some(Refused::Unreservable) => {
                let what = format!("stream {}: could not reserve memory for a {}-byte message", h.stream, p.total);
                return Err(Error::new(ErrorKind::MessageTooLarge, what).on_stream(h.stream));
            }
            Some(Refused::OverReassembly { others }) => {
                let what = format!(
                    "stream {}: a {}-byte message in pieces would have taken the bytes held in pieces past the \
                     limit of {} bytes ({others} held for other messages)",
                    h.stream, p.total, c.max_reassembly
                );
                return Err(Error::new(ErrorKind::MessageTooLarge, what).on_stream(h.stream));
            }
            None if p.oversize => return Err(self.too_large(h.stream, p.total)),
            None => {}
        }
        Ok(Some(frame(Bytes::from_owner(Held { buf: p.buf, keeper: self.pool.clone() }))))
    }

    /// A whole message by reference into the server's shared arena.
    fn deliver_shared(&mut self, h: FrameHeader, body: &[u8]) -> Result<Bytes> {
        let shared_len = self.releaser.shared_len() as u64;
        if self.core.role != Role::Client || shared_len == 0 {
            return Err(Error::protocol("a SHARED message from a peer that has no shared arena"));
        }
        let d = ArenaDescriptor::decode(body, shared_len)?;
        if d.len != d.total || self.partial.contains_key(&h.stream) {
            return Err(Error::protocol(format!(
                "stream {}: a SHARED message must be a whole message ({} of {} bytes)",
                h.stream, d.len, d.total
            )));
        }
        let lease = Lease::shared(self.releaser.clone(), d.offset, d.len);
        let c = &self.core;
        c.stats.add(&c.stats.bytes_received, d.len);
        if d.total > c.max_message_size {
            return Err(self.too_large(h.stream, d.total)); // the lease's drop gives it back
        }
        self.received(h.stream, lease, d.len)
    }

    /// A whole message of `len` bytes in an arena block: a view of it (`lease`, which gives the
    /// block back when the last view drops), or, where `Config::copy_received` asks and its
    /// limit allows, a copy in our own memory, the block given back at once. No memory for the
    /// copy fails the message, not the connection.
    fn received(&self, stream: u64, lease: Lease, len: u64) -> Result<Bytes> {
        let copies = match &self.copies {
            Some(copies) if copies.take(len) => copies,
            _ => return Ok(Bytes::from_owner(lease)),
        };
        // Not from the pool, whose spare may be far larger than a message held this long.
        let mut buf = Vec::new();
        if lease.copy_into(&mut buf).is_err() {
            copies.give(len);
            let what = format!("stream {stream}: could not reserve memory for a {len}-byte message");
            return Err(Error::new(ErrorKind::MessageTooLarge, what).on_stream(stream));
        }
        Ok(Bytes::from_owner(Held { buf, keeper: copies.clone() }))
    }

    fn too_large(&self, stream: u64, size: u64) -> Error {
        too_large(self.core.role, stream, size, self.core.max_message_size)
    }

    /// Waits for the next frame until `deadline`: spins briefly, then sleeps on the doorbell.
    pub fn recv(&mut self, deadline: Option<Instant>) -> Result<Frame> {
        loop {
            if let Some(f) = self.try_recv()? {
                return Ok(f);
            }
            let (ring, core) = (&self.ring, &self.core);
            let waiter = core.rx_waiter(Some(self.heard), core.spin);
            match waiter.wait(deadline, || ring.is_ready().map_err(|e| core.fail(e))) {
                // Frames the peer wrote before it died come first; try_recv reports the death.
                Err(e) if e.kind() == ErrorKind::PeerGone => continue,
                r => r?,
            }
        }
    }

    /// Async [`recv`](Self::recv) for tokio; cancel-safe (no frame is lost if the future is
    /// dropped). Wrap in `tokio::time::timeout` for a deadline.
    #[cfg(feature = "tokio")]
    pub async fn recv_async(&mut self) -> Result<Frame> {
        self.recv_async_spinning(self.core.spin).await
    }

    /// [`recv_async`](Self::recv_async) whose wait spins as `spin` says, not as the connection's
    /// configuration does: a caller that knows no frame is due soon waits without spinning.
    #[cfg(feature = "tokio")]
    pub async fn recv_async_spinning(&mut self, spin: SpinPolicy) -> Result<Frame> {
        loop {
            if let Some(f) = self.try_recv()? {
                return Ok(f);
            }
            let (ring, core) = (&self.ring, &self.core);
            match core.rx_waiter(None, spin).wait_async(|| ring.is_ready().map_err(|e| core.fail(e))).await {
                Err(e) if e.kind() == ErrorKind::PeerGone => continue,
                r => r?,
            }
        }
    }

    /// [`recv_async_spinning`](Self::recv_async_spinning) that gives up, with `Ok(None)`, once an
    /// [`Interrupter`] of this receiver interrupts it (before or during the wait; each
    /// interrupt ends one wait). Lets a reader task hand the receiver to another reader that
    /// asks for it, even while it sleeps on the doorbell.
    #[cfg(feature = "tokio")]
    pub async fn recv_async_interruptible(&mut self, spin: SpinPolicy) -> Result<Option<Frame>> {
        use std::sync::atomic::Ordering;
        loop {
            // Every server's reader waits here: a plain load first, the swap only when set.
            if self.core.interrupted.load(Ordering::Acquire) && self.core.interrupted.swap(false, Ordering::AcqRel) {
                return Ok(None);
            }
            if let Some(f) = self.try_recv()? {
                return Ok(Some(f));
            }
            let (ring, core) = (&self.ring, &self.core);
            let ready = || Ok(core.interrupted.load(Ordering::Acquire) || ring.is_ready().map_err(|e| core.fail(e))?);
            match core.rx_waiter(None, spin).wait_async(ready).await {
                Err(e) if e.kind() == ErrorKind::PeerGone => continue,
                r => r?,
            }
        }
    }

    /// A handle that interrupts this receiver's
    /// [`recv_async_interruptible`](Self::recv_async_interruptible) from any thread.
    pub fn interrupter(&self) -> Interrupter {
        Interrupter { core: self.core.clone() }
    }

    /// How long a wait for a frame spins before it sleeps (the connection's configuration).
    /// A caller that polls [`try_recv`](Self::try_recv) in a loop of its own should spin no
    /// longer.
    pub fn spin_policy(&self) -> SpinPolicy {
        self.core.spin
    }

    /// For an external event loop (epoll, asyncio, libuv): announces that this side is about to
    /// sleep on [`doorbell_fd`](Self::doorbell_fd). Returns false, and announces nothing, if a
    /// frame is already waiting; then call [`try_recv`](Self::try_recv) instead of sleeping.
    /// After the loop reports the fd readable, call [`disarm`](Self::disarm).
    pub fn arm(&self) -> Result<bool> {
        self.core.link.check()?; // closed, or the parent's connection in a forked child
        let parked = self.core.seg.ctl_u32(self.core.rx, layout::CTL_CONSUMER_PARKED);
        parked.store(1, std::sync::atomic::Ordering::Relaxed);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.ring.is_ready().map_err(|e| self.core.fail(e))? {
            parked.store(0, std::sync::atomic::Ordering::Relaxed);
            return Ok(false);
        }
        Ok(true)
    }

    /// Ends a sleep begun with [`arm`](Self::arm): clears the announcement and the doorbell and
    /// checks the socket, reporting a dead peer.
    pub fn disarm(&self) -> Result<()> {
        if self.core.link.health.forked() {
            return self.core.link.check(); // the parent's words and doorbell (link.rs)
        }
        let parked = self.core.seg.ctl_u32(self.core.rx, layout::CTL_CONSUMER_PARKED);
        parked.store(0, std::sync::atomic::Ordering::Relaxed);
        crate::sys::eventfd_drain(self.core.bells.my_rx.fd());
        self.core.link.observe_socket();
        self.core.link.check()
    }

    /// The eventfd the peer rings when frames arrive while this side is armed.
    pub fn doorbell_fd(&self) -> BorrowedFd<'_> {
        self.core.bells.my_rx.fd()
    }

    /// The handshake socket: readable (EOF) when the peer is gone.
    pub fn liveness_fd(&self) -> BorrowedFd<'_> {
        self.core.link.fd()
    }
}

/// Interrupts a [`Receiver`]'s interruptible wait, from any thread (see
/// [`Receiver::recv_async_interruptible`]).
#[derive(Clone)]
pub struct Interrupter {
    core: Arc<Core>,
}

impl fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Interrupter").finish_non_exhaustive()
    }
}

impl Interrupter {
    /// Makes the current or the next interruptible wait return `Ok(None)`; wakes it if it
    /// sleeps on the doorbell (the same announce-then-check protocol as a frame's arrival).
    pub fn interrupt(&self) {
        let c = &self.core;
        c.interrupted.store(true, std::sync::atomic::Ordering::Release);
        if c.link.health.forked() {
            return; // the parent's control word and doorbell (link.rs)
        }
        wake_if_parked(c.seg.ctl_u32(c.rx, layout::CTL_CONSUMER_PARKED), &c.bells.my_rx);
    }
}

/// An established connection: one [`Sender`] and one [`Receiver`].
#[derive(Debug)]
pub struct Connection {
    /// The sending half.
    pub sender: Sender,
    /// The receiving half.
    pub receiver: Receiver,
}

/// A connection's part in a shared arena.
pub(crate) enum SharedSide {
    /// The server has none.
    None,
    /// Server: the listener's arena, whose blocks this connection may carry.
    Owner(SharedArena),
    /// Client: the server's arena, mapped read-only.
    View(Arc<SharedView>),
}

/// Everything the handshake produced, ready to become a [`Connection`].
pub(crate) struct Parts {
    pub(crate) seg: Arc<Segment>,
    pub(crate) role: Role,
    pub(crate) link: Link,
    pub(crate) bells: Bells,
    pub(crate) peer: PeerInfo,
    pub(crate) shared: SharedSide,
    pub(crate) features: u16,
}

/// The error for a received message above the limit of this side (`role`); the call on
/// `stream` fails, the connection goes on. In grpc-core's words, which grpcio's and grpc.aio's
/// users read in `details()`: "CLIENT: Received message larger than max (N vs. M)", or
/// "SERVER: …" in a status a server sends.
fn too_large(role: Role, stream: u64, size: u64, limit: u64) -> Error {
    let side = match role {
        Role::Client => "CLIENT",
        Role::Server => "SERVER",
    };
    Error::new(ErrorKind::MessageTooLarge, format!("{side}: Received message larger than max ({size} vs. {limit})"))
        .on_stream(stream)
}

impl Connection {
    pub(crate) fn from_parts(p: Parts, cfg: &Config) -> Connection {
        let (tx, rx) = match p.role {
            Role::Client => (CLIENT_TO_SERVER, SERVER_TO_CLIENT),
            Role::Server => (SERVER_TO_CLIENT, CLIENT_TO_SERVER),
        };
        let layout = *p.seg.layout();
        // A message must fit the ring inline; the ring may be the peer's choice and smaller
        // than ours was.
        let inline_max = cfg.inline_max.min(layout.ring_size[tx] / 4 - layout::FRAME_HEADER_LEN);
        let health: Arc<Health> = p.link.health.clone();
        let (shared, view) = match p.shared {
            SharedSide::None => (None, None),
            SharedSide::Owner(arena) => (Some(arena), None),
            SharedSide::View(view) => (None, Some(view)),
        };
        let releaser = Arc::new(Releaser::new(p.seg.clone(), rx, p.bells.peer_tx.clone(), health, view));
        let core = Arc::new(Core {
            ring: Mutex::new(FrameProducer::new(p.seg.clone(), tx)),
            arena: Mutex::new(ArenaOwner::new(&p.seg, tx)),
            shared,
            features: p.features,
            seg: p.seg.clone(),
            role: p.role,
            tx,
            rx,
            inline_max,
            max_message_size: cfg.max_message_size,
            max_reassembly: cfg.max_reassembly.unwrap_or(cfg.max_message_size),
            spin: cfg.spin,
            link: p.link,
            bells: p.bells,
            stats: Stats::default(),
            peer: p.peer,
            interrupted: std::sync::atomic::AtomicBool::new(false),
            pieces: PieceSlots::default(),
        });
        if let Some(arena) = &core.shared {
            let drain: std::sync::Weak<dyn Drain> = Arc::downgrade(&core) as std::sync::Weak<Core>;
            arena.register(drain);
        }
        let receiver = Receiver {
            ring: FrameConsumer::new(p.seg, rx),
            core: core.clone(),
            releaser,
            partial: HashMap::new(),
            reassembling: 0,
            pool: Arc::default(),
            copies: cfg.copy_received.map(|limit| Arc::new(Copies { held: AtomicU64::new(0), limit })),
            heard: 0,
        };
        Connection { sender: Sender { core }, receiver }
    }

    /// Splits into the two halves.
    pub fn split(self) -> (Sender, Receiver) {
        (self.sender, self.receiver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_message_over_the_limit_is_refused_in_grpc_cores_words_for_its_side() {
        // grpcio's and grpc.aio's users read these in `details()`.
        let client = too_large(Role::Client, 7, 2014, 1000);
        assert_eq!(client.kind(), ErrorKind::MessageTooLarge);
        assert_eq!(client.stream(), Some(7));
        assert!(client.to_string().contains("CLIENT: Received message larger than max (2014 vs. 1000)"), "{client}");
        let server = too_large(Role::Server, 9, 1500, 1000);
        assert!(server.to_string().contains("SERVER: Received message larger than max (1500 vs. 1000)"), "{server}");
    }

    #[test]
    fn places_freed_one_right_after_another_wake_every_waiter() {
        // Two waiters with no deadline, and every place freed in a burst, faster than the first
        // waiter wakes: each must get a place (a free place never waits for a new sender).
        for _ in 0..50 {
            let slots = Arc::new(PieceSlots::default());
            let held: Vec<_> = (0..MAX_SENDING_IN_PIECES).map(|_| slots.try_take().expect("a place")).collect();
            assert!(slots.try_take().is_none(), "all places taken");
            let (done, finished) = std::sync::mpsc::channel();
            for _ in 0..2 {
                let (slots, done) = (slots.clone(), done.clone());
                std::thread::spawn(move || {
                    let taken = slots.take(None).is_ok();
                    let _ = done.send(taken);
                });
            }
            while slots.freed.total_listeners() < 2 {
                std::thread::yield_now();
            }
            drop(held); // frees every place, one after another
            for _ in 0..2 {
                let taken = finished.recv_timeout(Duration::from_secs(20));
                assert_eq!(taken, Ok(true), "a waiter was left waiting with places free");
            }
        }
    }
}
