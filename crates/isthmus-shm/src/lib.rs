//! `isthmus-shm` moves frames between two processes on one machine through shared memory.
//!
//! It knows nothing of RPC: it gives a connection whose [`Sender`] writes frames (kind, flags,
//! stream id, body) and whose [`Receiver`] reads them, at the cost of a memory copy and — only
//! when the reader sleeps — one `write(2)` on an eventfd.
//!
//! - A server [`Listener`] binds a Unix socket (`shm://NAME` in a private 0700 directory, or
//!   `shm:///abs/path.sock`). A client [`Connection::connect`]s; both send a HELLO with the
//!   protocol version and sizes; the server checks the client's uid (and the client the
//!   server's, and the privacy of the runtime directory), creates a sealed `memfd` segment and
//!   four eventfd doorbells and passes them over the socket. No file under `/dev/shm` is ever
//!   created.
//! - The segment holds one SPSC frame ring and one payload arena per direction. Small messages
//!   travel inline in the ring; large ones are written once into the sender's arena and read in
//!   place by the receiver as a [`bytes::Bytes`] whose drop gives the block back. Messages larger
//!   than half the arena travel in pieces.
//! - The socket stays open: EOF on it wakes every waiter on both sides with
//!   [`ErrorKind::PeerGone`] at once.
//! - Everything read from shared memory is validated; a malformed frame or a corrupted cursor
//!   closes the connection with [`ErrorKind::Protocol`], never a panic.
//!
//! `docs/protocol.md` in the repository specifies the wire format.
//!
//! The modules, bottom up; each uses only those listed before it: `sys` (every system call),
//! `copy` (filling a block: streaming stores for large copies, ADR 0022), `error`, [`layout`],
//! `config`, [`handshake`], [`frame`], `addr`, `segment`, `ring`, `stats`, `link`, `doorbell`,
//! `allocator`, `shared`, `arena`, `connection`, `establish`, `listener`.
//!
//! The frame codec, the frame kinds and the connection live here rather than in the RPC crate: the
//! transport must read frames to route arena messages. What frames *mean* belongs to `isthmus`.
//!
//! [`layout`], [`handshake`] and [`frame`] are public for three users: the fuzz targets and
//! integration tests, which aim damage at exact offsets; other implementations, which can read the
//! constants; and the RPC crate. Everything else is private, and the public surface is what this
//! file re-exports.
//!
//! Cargo features:
//!
//! - `tokio` (default): the async waits (`send_async`, `alloc_async`, `recv_async`, ...) through
//!   tokio's reactor.
//!
//! Hidden from the documentation, the hooks of the hostile-peer tests:
//! `Sender::scribble_for_tests(offset, bytes)` writes anywhere in the segment as a hostile peer
//! could, `layout_for_tests()` gives the offsets to aim at, `ring_peer_for_tests()` rings the
//! peer's receive doorbell without publishing a tail, and `Error::for_tests` builds an error of
//! any kind. They are always compiled (a feature for them made every build of the workspace
//! compile this crate and the engine twice) and harmless: they can do nothing a peer cannot,
//! and both sides treat the segment as untrusted.
//!
//! The hidden module `fuzz` holds the entry points of the `frame`, `handshake` and `ring` fuzz
//! targets; it is always compiled.
//!
//! ```no_run
//! use isthmus_shm::{Address, Config, Connection, Kind, Listener};
//! # fn main() -> Result<(), isthmus_shm::Error> {
//! let addr: Address = "shm://example".parse()?;
//! let listener = Listener::bind(&addr, Config::default())?;
//! std::thread::spawn(move || -> Result<(), isthmus_shm::Error> {
//!     let mut conn = listener.accept()?;
//!     let frame = conn.receiver.recv(None)?;
//!     conn.sender.send_message(frame.stream, 0, &frame.body, None) // echo
//! });
//! let mut conn = Connection::connect(&addr, &Config::default())?;
//! conn.sender.send_message(1, 0, b"hello", None)?;
//! let reply = conn.receiver.recv(None)?;
//! assert_eq!((reply.kind, &reply.body[..]), (Kind::Message, &b"hello"[..]));
//! # Ok(()) }
//! ```

mod addr;
mod allocator;
mod arena;
mod config;
mod connection;
mod copy;
mod doorbell;
mod error;
mod establish;
pub mod frame;
pub mod handshake;
pub mod layout;
mod link;
mod listener;
mod ring;
mod segment;
mod shared;
mod stats;
mod sys;

use std::os::unix::net::UnixStream;

pub use addr::{runtime_dir, Address};
pub use config::{Config, PeerPolicy, SpinPolicy};
pub use connection::{BlockMut, Connection, Frame, Interrupter, Mapping, PeerInfo, Receiver, Role, Sender};
pub use copy::{copy_into_shared, move_into_shared};
pub use doorbell::{EventFd, SocketBell};
pub use error::{Error, ErrorKind, Result};
pub use frame::{flags, Kind};
pub use handshake::features;
pub use link::MadeIn;
pub use listener::{Incoming, Listener};
pub use shared::{SharedArena, SharedBlock, SharedBlockMut};
pub use stats::Counters;

/// Connects to a Unix stream socket at `path` without an unbounded wait: a listener that has
/// stopped accepting (hung, stopped) and whose backlog is full makes a blocking `connect(2)`
/// wait for room for ever. `wait` bounds that wait (`TimedOut` past it; one try at least, and
/// the stream comes back blocking, with no timeouts); `None` waits not at all (`WouldBlock` at
/// once, and the stream is non-blocking). Any other error is `connect(2)`'s.
pub fn connect_unix(path: &std::path::Path, wait: Option<std::time::Duration>) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    sys::connect_unix(path.as_os_str().as_bytes(), false, wait)
}

/// [`connect_unix`] to `name` in Linux's abstract socket namespace (no file; `name` without the
/// leading NUL byte).
pub fn connect_unix_abstract(name: &[u8], wait: Option<std::time::Duration>) -> std::io::Result<UnixStream> {
    sys::connect_unix(name, true, wait)
}

/// Blocks SIGPIPE on the calling thread: a write to a socket whose peer has gone then fails
/// with EPIPE instead of killing the process. For the threads of a library that runs inside
/// hosts that do not ignore SIGPIPE (Go, C programs); Rust programs and Python ignore it
/// already.
pub fn block_sigpipe_on_this_thread() {
    sys::block_sigpipe();
}

/// Forks this process has gone through since the transport was first used: a value taken
/// before a `fork` differs in the child. A connection made before a fork is unusable in the
/// child, and leaves the parent's untouched (see `link.rs`); a binding's runtime made before a
/// fork has no threads in the child and must be made anew.
pub fn forks() -> u64 {
    sys::forks()
}

/// A counter for timing short spans on one thread more cheaply than `Instant::now()` (about
/// 9 ns a read against 20 here), for the engine: the CPU's time-stamp counter on x86-64, which counts at a fixed rate
/// of 1-4 GHz depending on the host (not calibrated: compare differences with generous
/// bounds), elsewhere nanoseconds since the first call. A thread moved between cores while it
/// measures may see the count go back: subtract with `saturating_sub`.
pub fn ticks() -> u64 {
    sys::ticks()
}

#[doc(hidden)]
pub mod fuzz {
    //! Entry points for the fuzz targets in `fuzz/`: each feeds arbitrary bytes to a decoder of
    //! peer data and must return (with an error, usually), never panic or read out of bounds.

    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use crate::arena::ArenaOwner;
    use crate::frame::{ArenaDescriptor, FrameHeader};
    use crate::layout::{self, Layout, FRAME_HEADER_LEN};
    use crate::ring::FrameConsumer;
    use crate::segment::Segment;

    /// Decodes a frame header and, for arena messages, a descriptor.
    pub fn frame(data: &[u8]) {
        if data.len() < FRAME_HEADER_LEN {
            return;
        }
        let (h, body) = data.split_at(FRAME_HEADER_LEN);
        let Ok(h) = h.try_into() else { return };
        if let Ok(h) = FrameHeader::decode(h, 1 << 16) {
            if h.flags & crate::flags::ARENA != 0 {
                let _ = ArenaDescriptor::decode(&body[..body.len().min(h.len as usize)], 1 << 20);
            }
        }
    }

    /// Decodes a handshake record.
    pub fn handshake(data: &[u8]) {
        if let Ok(rec) = data.get(..crate::handshake::HELLO_LEN).unwrap_or_default().try_into() {
            let _ = crate::handshake::Hello::decode(rec);
        }
    }

    /// The `i`th little-endian word of `data`, zero past its end.
    fn word(data: &[u8], i: usize) -> u64 {
        let mut b = [0u8; 8];
        for (k, x) in b.iter_mut().enumerate() {
            *x = data.get(i * 8 + k).copied().unwrap_or(0);
        }
        u64::from_le_bytes(b)
    }

    /// A small heap segment whose client→server ring holds `data` as a hostile client wrote it:
    /// word 0 is the ring's tail, the bytes from 16 on its contents; with the bytes past the
    /// ring, for the caller.
    fn hostile_ring(data: &[u8]) -> Option<(Arc<Segment>, Layout, &[u8])> {
        let layout = Layout::new([4096, 4096], [64 << 10, 64 << 10], 0).ok()?;
        let seg = Arc::new(Segment::heap(layout));
        seg.ctl_u64(0, layout::CTL_TAIL).store(word(data, 0) % 16384, Ordering::Relaxed);
        let body = data.get(16..).unwrap_or_default();
        let ring = seg.region(layout.ring_off[0], layout.ring_size[0]);
        ring.write_wrapping(0, &body[..body.len().min(ring.len())]);
        Some((seg, layout, body.get(ring.len()..).unwrap_or_default()))
    }

    /// Fills a client's ring and arena with `data` as a hostile client would, then reads them as
    /// the server's `Receiver` does: frames, arena descriptors, and messages in pieces with their
    /// reassembly, under small limits taken from `data` (`max_message_size`, `max_reassembly`),
    /// reading whole messages in place or copying them out (`copy_received`) as `data` says.
    pub fn receive(data: &[u8]) {
        use crate::connection::{Bells, Parts, SharedSide};
        use crate::doorbell::Bell;
        use crate::{Config, Connection, PeerInfo, Role};

        let Some((seg, layout, rest)) = hostile_ring(data) else { return };
        let arena = seg.region(layout.arena_off[0], layout.arena_size[0]);
        arena.write_wrapping(0, &rest[..rest.len().min(arena.len())]);

        let bell = || crate::sys::eventfd().ok().map(|fd| Arc::new(Bell::new(fd)));
        let (Some(my_rx), Some(my_tx), Some(peer_rx), Some(peer_tx)) = (bell(), bell(), bell(), bell()) else {
            return;
        };
        let Ok((socket, _peer)) = std::os::unix::net::UnixStream::pair() else { return };
        let Ok(link) = crate::link::Link::new(socket) else { return };
        let parts = Parts {
            seg,
            role: Role::Server,
            link,
            bells: Bells { my_rx, my_tx, peer_rx, peer_tx },
            peer: PeerInfo { pid: 0, uid: 0, gid: 0 },
            shared: SharedSide::None,
            features: crate::features::ALL,
        };
        let limits = word(data, 1);
        let cfg = Config {
            max_message_size: limits % (256 << 10),
            max_reassembly: Some((limits >> 32) % (128 << 10)),
            copy_received: (limits & (1 << 31) != 0).then_some((limits >> 16) % (256 << 10)),
            ..Config::default()
        };
        let mut receiver = Connection::from_parts(parts, &cfg).receiver;
        for _ in 0..512 {
            match receiver.try_recv() {
                Ok(Some(_)) => {}
                Err(e) if !e.is_fatal() => {}
                _ => break,
            }
        }
    }

    /// Fills a ring, its cursors and a release ring with `data` as a hostile peer would, then
    /// reads it as the receiver and the arena owner do.
    pub fn ring(data: &[u8]) {
        let Some((seg, layout, rest)) = hostile_ring(data) else { return };
        seg.ctl_u64(0, layout::CTL_REL_TAIL).store(word(data, 1) % 64, Ordering::Relaxed);
        let rel = seg.region(layout.rel_off[0], layout.rel_cap[0] * layout::RELEASE_ENTRY_LEN);
        rel.write_wrapping(0, &rest[..rest.len().min(rel.len())]);

        let mut consumer = FrameConsumer::new(seg.clone(), 0);
        for _ in 0..512 {
            match consumer.try_pop() {
                Ok(Some(f)) => {
                    if f.header.flags & crate::flags::ARENA != 0 {
                        let _ = ArenaDescriptor::decode(&f.body, layout.arena_size[0] as u64);
                    }
                }
                _ => break,
            }
        }
        // Blocks in flight, as if sent, so fuzzed releases can be accepted as well as refused.
        let mut owner = ArenaOwner::new(&seg, 0);
        for len in [4096, 10_000, 1] {
            if let Ok(Some((off, generation, _))) = owner.try_alloc(len) {
                owner.mark_in_flight(off, generation);
            }
        }
        let _ = owner.reclaim();
    }
}
