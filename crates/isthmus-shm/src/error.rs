//! The transport's one error type. An [`Error`] carries an [`ErrorKind`], a sentence a person can
//! act on (which limit, which size, which path), and the `io::Error` it came from, if any, as its
//! `source()`.
//!
//! [`Error::is_fatal`] says whether the connection is finished: `PeerGone`, `Closed`, `Protocol`
//! and `Io` are fatal; the rest leave the connection usable, and most arise before one exists
//! (bind, connect, handshake). The first fatal error of a connection is kept (`link`'s `Health`)
//! and every later operation reports it. [`Error::stream`] names the stream a non-fatal error
//! concerns: the `Receiver` sets it on `MessageTooLarge`, so the RPC layer fails that one call and
//! the connection goes on.
//!
//! The kinds, and what raises them:
//!
//! - `PeerGone`: end-of-file or a reset on the socket, or the peer closed during the handshake (as
//!   a client does when its policy rejects the server).
//! - `Closed`: this side closed the connection; a sender thread panicked holding a lock; an arena
//!   block was found freed before it was sent (a bug here, not peer input).
//! - `Timeout`: a deadline passed waiting for ring room, arena room or a frame; a handshake read or
//!   write timed out, or the client's hello did not come in time.
//! - `MessageTooLarge`: a received message over `max_message_size`, or a message in pieces whose
//!   next piece would take the bytes held in pieces past `max_reassembly`, or for which memory
//!   could not be reserved; only that message is dropped.
//! - `Protocol`: the peer broke the protocol (a bad frame, cursor, descriptor or release, a release
//!   of a block not yet sent, more than 256 messages in pieces at once, stray bytes on the socket),
//!   or refused with code 3 (bad request).
//! - `VersionMismatch`: the versions differ (either side refused).
//! - `PermissionDenied`: a policy refused the peer's uid, or the runtime directory is not a
//!   directory, is someone else's, or is not private.
//! - `TooLarge`: a caller's frame body larger than the ring, or block larger than the arena.
//! - `InvalidAddress`: a malformed `shm://` address, or a socket path over 107 bytes.
//! - `InvalidConfig`: a value out of range, or misuse: an ARENA flag from a caller, a block sent on
//!   another connection, an async wait outside a tokio runtime with I/O.
//! - `AddrInUse`: a live server owns the socket path, or the path is not a socket.
//! - `NotFound`: no server listens at the address.
//! - `Io`: an operating-system call failed; see `source()`.
//!
//! [`ErrorKind`] is `#[non_exhaustive]`. `isthmus::Status::from_transport` maps each kind to a gRPC
//! code in one `match`, pinned by a test; a kind added here falls to UNAVAILABLE there until it
//! gets an arm.

use std::fmt;
use std::io;

/// What went wrong, in terms a caller can act on.
///
/// The RPC layer maps these to gRPC status codes: [`PeerGone`](ErrorKind::PeerGone) and
/// [`Closed`](ErrorKind::Closed) to UNAVAILABLE, [`Timeout`](ErrorKind::Timeout) to
/// DEADLINE_EXCEEDED, [`MessageTooLarge`](ErrorKind::MessageTooLarge) to RESOURCE_EXHAUSTED and
/// [`Protocol`](ErrorKind::Protocol) to INTERNAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The other process closed its end or died; the connection is finished.
    PeerGone,
    /// This side closed the connection (or an earlier fatal error did).
    Closed,
    /// The deadline passed before the operation could complete; the connection is still usable.
    Timeout,
    /// The peer wrote something that breaks the protocol: a bad frame, a cursor out of range, a
    /// descriptor outside the arena; or it refused our handshake as malformed (refusal code 3).
    /// The connection is closed.
    Protocol,
    /// Handshake: the peer speaks another protocol version.
    VersionMismatch,
    /// Handshake: the peer's credentials are not allowed by the policy, or the peer refused us.
    PermissionDenied,
    /// A received message is larger than the configured limit. Only that message is dropped;
    /// the connection is still usable.
    MessageTooLarge,
    /// A frame or block does not fit the ring or arena it was meant for (a caller error).
    TooLarge,
    /// An `shm://` or path address is malformed.
    InvalidAddress,
    /// A configuration value is out of range.
    InvalidConfig,
    /// Another live server owns the socket path.
    AddrInUse,
    /// No server listens at the address.
    NotFound,
    /// An operating-system call failed; see [`std::error::Error::source`].
    Io,
}

/// An error from the shared-memory transport: a kind plus a sentence a person can act on.
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<io::Error>,
    stream: Option<u64>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into(), source: None, stream: None }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Error {
        let kind = match source.kind() {
            io::ErrorKind::AddrInUse => ErrorKind::AddrInUse,
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ErrorKind::NotFound,
            io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted => ErrorKind::PeerGone,
            _ => ErrorKind::Io,
        };
        Error { kind, message: context.into(), source: Some(source), stream: None }
    }

    pub(crate) fn protocol(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Protocol, message)
    }

    pub(crate) fn peer_gone() -> Error {
        Error::new(ErrorKind::PeerGone, "the peer closed the connection or exited")
    }

    pub(crate) fn timeout(what: &str) -> Error {
        Error::new(ErrorKind::Timeout, format!("deadline passed while {what}"))
    }

    pub(crate) fn on_stream(mut self, stream: u64) -> Error {
        self.stream = Some(stream);
        self
    }

    /// The stream a non-fatal error concerns (a [`ErrorKind::MessageTooLarge`] message), so the
    /// RPC layer can fail that call alone.
    pub fn stream(&self) -> Option<u64> {
        self.stream
    }

    /// An error of any kind, for tests of code that maps errors (the RPC layer's status table).
    #[doc(hidden)]
    pub fn for_tests(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error::new(kind, message)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// True if the connection can no longer be used after this error.
    pub fn is_fatal(&self) -> bool {
        matches!(self.kind, ErrorKind::PeerGone | ErrorKind::Closed | ErrorKind::Protocol | ErrorKind::Io)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("message", &self.message);
        if let Some(s) = &self.source {
            d.field("source", s);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
