//! The two handshake flows over the Unix socket: a client connecting, a server accepting.
//!
//! - `connect` (client): before connecting to `shm://NAME` it checks that the runtime directory is
//!   a directory it owns with no group or other permissions, as the server does before binding;
//!   then it checks the server's uid (`SO_PEERCRED`) against its `PeerPolicy`, the sizes in the
//!   server's hello, the five fds, and the memfd's seals (`F_SEAL_SHRINK` and `F_SEAL_GROW`) and
//!   size, so no access inside the mapping can raise `SIGBUS`. It makes the four doorbell fds
//!   non-blocking itself. A failure of any check sends a refusal with the reason before it closes
//!   (`protocol.md` §3.4).
//! - `accept` (server): reads the client's hello against one deadline for the whole record, so a
//!   client that trickles bytes cannot hold the server past `handshake_timeout`; checks the
//!   client's uid; creates the sealed segment and the four eventfds and passes all five fds with
//!   its hello, and the listener's shared arena as a sixth if it has one.
//!
//! A refusal that arrives after the server's hello is the business of `link` (`late_refusal`) and
//! `handshake` (`decode_late_refusal`).

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{self, Config};
use crate::connection::SharedSide;
use crate::connection::{Bells, Connection, Parts, PeerInfo, Role};
use crate::doorbell::Bell;
use crate::error::{Error, ErrorKind, Result};
use crate::handshake::{
    self, encode_refusal, Hello, HelloKind, RefuseCode, HELLO_LEN, MAX_SERVER_FDS, PROTOCOL_VERSION, SERVER_FDS,
};
use crate::layout::Layout;
use crate::link::Link;
use crate::segment::Segment;
use crate::shared::{SharedArena, SharedView};
use crate::sys;
use crate::Address;

fn set_timeouts(s: &UnixStream, t: Duration) -> Result<()> {
    let t = Some(t.max(Duration::from_millis(1)));
    s.set_read_timeout(t)
        .and_then(|()| s.set_write_timeout(t))
        .map_err(|e| Error::io("cannot set handshake timeouts", e))
}

fn peer_info(s: &UnixStream) -> Result<PeerInfo> {
    let c = sys::peer_cred(s.as_fd()).map_err(|e| Error::io("cannot read the peer's credentials (SO_PEERCRED)", e))?;
    Ok(PeerInfo { pid: c.pid, uid: c.uid, gid: c.gid })
}

/// Reads the rest of a refusal and turns it into an error.
fn read_refusal(s: &mut UnixStream, h: &Hello, peer_role: &str) -> Error {
    let mut reason = vec![0u8; (h.reason_len as usize).min(handshake::MAX_REASON_LEN)];
    let text = match s.read_exact(&mut reason) {
        Ok(()) => String::from_utf8_lossy(&reason).into_owned(),
        Err(_) => String::from("(no reason given)"),
    };
    handshake::refusal_error(h, peer_role, &text)
}

/// `read_exact` bounded by one deadline for the whole record, so a client trickling bytes
/// cannot hold the handshake open longer than the configured timeout.
fn read_exact_by(s: &mut UnixStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn refuse(s: &mut UnixStream, code: RefuseCode, e: Error) -> Error {
    // MSG_NOSIGNAL: a client gone already must not raise SIGPIPE in a host that has not
    // ignored it (a Go or C program).
    let _ = sys::send_with_fds(s.as_fd(), &encode_refusal(code, &e.to_string()), &[]);
    e
}

/// Client side: connect to `addr` and complete the handshake.
pub(crate) fn connect(addr: &Address, cfg: &Config) -> Result<Connection> {
    cfg.validate()?;
    // Whoever can write the runtime directory can pose as the server: check it as the server does.
    addr.check_dir()?;
    let path = addr.socket_path();
    // One deadline for the whole handshake, the wait for room in a busy (or stopped) server's
    // listen backlog included.
    let deadline = Instant::now() + cfg.handshake_timeout;
    let mut s = crate::connect_unix(path, Some(cfg.handshake_timeout)).map_err(|e| {
        let kind = e.kind();
        let err = Error::io(format!("cannot connect to {addr} (socket {})", path.display()), e);
        if matches!(kind, std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) {
            Error::new(
                ErrorKind::NotFound,
                format!("no isthmus server is listening at {addr} (socket {})", path.display()),
            )
        } else {
            err
        }
    })?;
    set_timeouts(&s, deadline.saturating_duration_since(Instant::now()))?;
    let peer = peer_info(&s)?;
    let own = sys::uid();
    if peer.uid != 0 && !cfg.peer_policy.allows(own, peer.uid) {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "the server at {addr} runs as uid {} (pid {}), which this client's policy does not allow ({:?})",
                peer.uid, peer.pid, cfg.peer_policy
            ),
        ));
    }

    let mut hello = Hello::new(HelloKind::Client);
    hello.ring_size = [cfg.ring_size as u64, 0];
    hello.arena_size = [cfg.arena_size as u64, 0];
    hello.features = cfg.features & handshake::features::KNOWN;
    sys::send_with_fds(s.as_fd(), &hello.encode(), &[]).map_err(|e| Error::io("handshake: cannot send hello", e))?;

    // The fds arrive with the first byte of the server's record; the rest may trail behind.
    let mut rec = [0u8; HELLO_LEN];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < HELLO_LEN {
        // Each read gets what is left of the deadline, so a server that trickles its hello
        // cannot stretch the handshake past it.
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(ErrorKind::Timeout, "handshake: the server's hello did not come in time"));
        }
        s.set_read_timeout(Some(left)).map_err(|e| Error::io("cannot set handshake timeouts", e))?;
        let (n, more) = sys::recv_with_fds(s.as_fd(), &mut rec[got..], MAX_SERVER_FDS)
            .map_err(|e| Error::io("handshake: cannot read the server's hello", e))?;
        if n == 0 {
            return Err(Error::new(
                ErrorKind::PeerGone,
                "handshake: the server closed the connection before answering",
            ));
        }
        fds.extend(more);
        got += n;
        if fds.len() > MAX_SERVER_FDS {
            return Err(Error::protocol("handshake: the server sent more fds than the protocol allows"));
        }
    }
    let h = Hello::decode(&rec)?;
    if h.kind == HelloKind::Refuse {
        return Err(read_refusal(&mut s, &h, "server"));
    }
    if h.version != PROTOCOL_VERSION {
        return Err(refuse(&mut s, RefuseCode::Version, handshake::version_mismatch("server", h.version)));
    }
    if h.kind != HelloKind::Server {
        return Err(refuse(&mut s, RefuseCode::BadRequest, Error::protocol("handshake: expected the server's hello")));
    }
    if h.features & !hello.features != 0 {
        let e = Error::protocol(format!(
            "handshake: the server granted features {:#06x}, of which this client offered only {:#06x}",
            h.features, hello.features
        ));
        return Err(refuse(&mut s, RefuseCode::BadRequest, e));
    }
    let (seg, bells, shared) = match client_segment(&h, fds) {
        Ok(v) => v,
        Err(e) => return Err(refuse(&mut s, RefuseCode::BadRequest, e)),
    };
    let link = Link::new(s)?;
    let parts = Parts { seg, role: Role::Client, link, bells, peer, shared, features: h.features };
    Ok(Connection::from_parts(parts, cfg))
}

/// Checks what the server's hello and fds describe, and maps the segment and the shared arena.
fn client_segment(h: &Hello, fds: Vec<OwnedFd>) -> Result<(Arc<Segment>, Bells, SharedSide)> {
    let layout = validate_sizes(h)?;
    if h.segment_len != layout.total as u64 {
        return Err(Error::protocol(format!(
            "handshake: server says the segment is {} bytes, its sizes make {}",
            h.segment_len, layout.total
        )));
    }
    let want_fds = if layout.shared_size > 0 { MAX_SERVER_FDS } else { SERVER_FDS };
    if fds.len() != want_fds {
        return Err(Error::protocol(format!("handshake: expected {want_fds} fds from the server, got {}", fds.len())));
    }
    let mut fds = fds.into_iter();
    let mut next = || fds.next().ok_or_else(|| Error::protocol("handshake: fd missing"));
    let memfd = next()?;
    // A segment the server could still shrink would let it crash us with SIGBUS.
    let seals =
        sys::seals(memfd.as_fd()).map_err(|e| Error::io("handshake: the segment fd is not a sealable memfd", e))?;
    if seals & sys::REQUIRED_SEALS != sys::REQUIRED_SEALS {
        return Err(Error::protocol("handshake: the server's segment is not sealed against shrinking and growing"));
    }
    let size = sys::file_size(memfd.as_fd()).map_err(|e| Error::io("handshake: cannot stat the segment", e))?;
    if size != layout.total as u64 {
        return Err(Error::protocol(format!("handshake: the segment is {size} bytes, expected {}", layout.total)));
    }
    let seg = Arc::new(Segment::map(memfd.as_fd(), layout)?);
    drop(memfd);
    let mut bell = |n: usize| -> Result<Arc<Bell>> {
        let fd = next()?;
        // Anything else would disturb our wake-ups: a regular file or a socket is always
        // readable (a busy loop), a pipe's writes fill it up.
        match sys::fd_kind(fd.as_fd()) {
            Some(kind) if kind != sys::EVENTFD_KIND => {
                return Err(Error::protocol(format!("handshake: doorbell fd {n} is {kind}, not an eventfd")))
            }
            _ => {}
        }
        // A blocking doorbell would let the server stall our every send.
        sys::set_nonblocking(fd.as_fd()).map_err(|e| Error::io("handshake: a doorbell fd is unusable", e))?;
        Ok(Arc::new(Bell::new(fd)))
    };
    let bells = Bells { my_rx: bell(1)?, my_tx: bell(2)?, peer_rx: bell(3)?, peer_tx: bell(4)? };
    let shared = match layout.shared_size {
        0 => SharedSide::None,
        len => SharedSide::View(Arc::new(SharedView::map(next()?.as_fd(), len)?)),
    };
    Ok((seg, bells, shared))
}

/// Checks the five sizes a server granted and lays them out.
fn validate_sizes(h: &Hello) -> Result<Layout> {
    let mut ring = [0usize; 2];
    let mut arena = [0usize; 2];
    for d in 0..2 {
        ring[d] = usize::try_from(h.ring_size[d]).map_err(|_| Error::protocol("ring size out of range"))?;
        arena[d] = usize::try_from(h.arena_size[d]).map_err(|_| Error::protocol("arena size out of range"))?;
        config::check_ring_size("ring size", ring[d]).map_err(|e| Error::protocol(format!("handshake: {e}")))?;
        config::check_arena_size("arena size", arena[d]).map_err(|e| Error::protocol(format!("handshake: {e}")))?;
    }
    let shared = usize::try_from(h.shared_len).map_err(|_| Error::protocol("shared arena size out of range"))?;
    if shared != 0 {
        config::check_arena_size("shared arena size", shared)
            .map_err(|e| Error::protocol(format!("handshake: {e}")))?;
    }
    Layout::new(ring, arena, shared)
}

/// Server side: run the handshake on an accepted socket; `shared` is the listener's shared arena.
pub(crate) fn accept(mut s: UnixStream, cfg: &Config, shared: Option<SharedArena>) -> Result<Connection> {
    let deadline = Instant::now() + cfg.handshake_timeout;
    set_timeouts(&s, cfg.handshake_timeout)?;
    let peer = peer_info(&s)?;
    let mut rec = [0u8; HELLO_LEN];
    read_exact_by(&mut s, &mut rec, deadline).map_err(|e| Error::io("handshake: cannot read the client's hello", e))?;
    let h = Hello::decode(&rec).map_err(|e| refuse(&mut s, RefuseCode::BadRequest, e))?;
    if h.version != PROTOCOL_VERSION {
        return Err(refuse(&mut s, RefuseCode::Version, handshake::version_mismatch("client", h.version)));
    }
    if h.kind != HelloKind::Client {
        return Err(refuse(&mut s, RefuseCode::BadRequest, Error::protocol("handshake: expected the client's hello")));
    }
    let own = sys::uid();
    if !cfg.peer_policy.allows(own, peer.uid) {
        let e = Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "peer uid {} (pid {}) is not allowed by this server's policy ({:?}; server uid {own})",
                peer.uid, peer.pid, cfg.peer_policy
            ),
        );
        return Err(refuse(&mut s, RefuseCode::Permission, e));
    }
    // The client sizes what it sends, within our caps; we size what we send.
    let want_ring = usize::try_from(h.ring_size[0]).unwrap_or(usize::MAX).min(cfg.max_ring_size);
    let want_arena = usize::try_from(h.arena_size[0]).unwrap_or(usize::MAX).min(cfg.max_arena_size);
    let granted = config::check_ring_size("client ring_size", want_ring)
        .and_then(|()| config::check_arena_size("client arena_size", want_arena))
        .and_then(|()| {
            let shared_size = shared.as_ref().map_or(0, SharedArena::size);
            Layout::new([want_ring, cfg.ring_size], [want_arena, cfg.arena_size], shared_size)
        });
    let layout = granted.map_err(|e| refuse(&mut s, RefuseCode::BadRequest, e))?;

    let memfd = sys::memfd_create("isthmus-segment")
        .map_err(|e| Error::io("cannot create the shared segment (memfd_create)", e))?;
    sys::set_len(memfd.as_fd(), layout.total as u64)
        .map_err(|e| Error::io(format!("cannot size the shared segment to {} bytes", layout.total), e))?;
    sys::seal(memfd.as_fd()).map_err(|e| Error::io("cannot seal the shared segment", e))?;
    let seg = Arc::new(Segment::map(memfd.as_fd(), layout)?);
    seg.init_header();
    let bell = || sys::eventfd().map_err(|e| Error::io("cannot create a doorbell (eventfd)", e));
    let (c_rx, c_tx, s_rx, s_tx) = (bell()?, bell()?, bell()?, bell()?);

    let mut reply = Hello::new(HelloKind::Server);
    reply.ring_size = [layout.ring_size[0] as u64, layout.ring_size[1] as u64];
    reply.arena_size = [layout.arena_size[0] as u64, layout.arena_size[1] as u64];
    reply.segment_len = layout.total as u64;
    reply.shared_len = layout.shared_size as u64;
    reply.features = h.features & cfg.features & handshake::features::KNOWN;
    let mut fds = vec![memfd.as_fd(), c_rx.as_fd(), c_tx.as_fd(), s_rx.as_fd(), s_tx.as_fd()];
    if let Some(shared) = &shared {
        fds.push(shared.fd());
    }
    sys::send_with_fds(s.as_fd(), &reply.encode(), &fds)
        .map_err(|e| Error::io("handshake: cannot send the segment to the client", e))?;
    drop(memfd);

    let bells = Bells {
        my_rx: Arc::new(Bell::new(s_rx)),
        my_tx: Arc::new(Bell::new(s_tx)),
        peer_rx: Arc::new(Bell::new(c_rx)),
        peer_tx: Arc::new(Bell::new(c_tx)),
    };
    let link = Link::new(s)?;
    let shared = shared.map_or(SharedSide::None, SharedSide::Owner);
    let features = reply.features;
    Ok(Connection::from_parts(Parts { seg, role: Role::Server, link, bells, peer, shared, features }, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's hello and the five fds a server sends with it, the doorbell at `odd` (1 to 4)
    /// being `instead` rather than an eventfd.
    fn server_answer(odd: usize, instead: Option<OwnedFd>) -> (Hello, Vec<OwnedFd>) {
        let (ring, arena) = (1usize << 16, 1usize << 20);
        let layout = Layout::new([ring; 2], [arena; 2], 0).expect("layout");
        let mut h = Hello::new(HelloKind::Server);
        h.ring_size = [ring as u64; 2];
        h.arena_size = [arena as u64; 2];
        h.segment_len = layout.total as u64;
        let memfd = sys::memfd_create("isthmus-test").expect("memfd");
        sys::set_len(memfd.as_fd(), h.segment_len).expect("size");
        sys::seal(memfd.as_fd()).expect("seal");
        let mut fds = vec![memfd];
        let mut instead = instead;
        for n in 1..=4 {
            fds.push(match (n == odd, instead.take()) {
                (true, Some(fd)) => fd,
                (_, kept) => {
                    instead = kept;
                    sys::eventfd().expect("eventfd")
                }
            });
        }
        (h, fds)
    }

    #[test]
    fn a_doorbell_that_is_no_eventfd_is_refused_by_name() {
        let (h, fds) = server_answer(0, None);
        assert!(client_segment(&h, fds).is_ok(), "four eventfds");
        let (socket, _other) = UnixStream::pair().expect("socket pair");
        let (h, fds) = server_answer(3, Some(OwnedFd::from(socket)));
        let e = client_segment(&h, fds).err().expect("a socket refused");
        assert_eq!(e.kind(), crate::ErrorKind::Protocol, "{e}");
        assert!(e.to_string().contains("doorbell fd 3 is socket:["), "{e}");
        let file = std::fs::File::open("/proc/self/status").expect("a regular file");
        let (h, fds) = server_answer(1, Some(OwnedFd::from(file)));
        let e = client_segment(&h, fds).err().expect("a file refused");
        assert!(e.to_string().contains("doorbell fd 1 is /proc/"), "{e}");
    }
}
