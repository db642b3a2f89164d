//! The handshake messages exchanged on the Unix socket before any shared memory is used.
//!
//! Every message starts with a fixed 64-byte record (little-endian):
//!
//! ```text
//! offset  size  field
//! 0       8     magic "ISTHMUS\0"
//! 8       2     protocol version
//! 10      1     kind: 1 client hello, 2 server hello, 3 refuse
//! 11      1     refuse only: reason code (1 version, 2 permission, 3 bad request), else zero
//! 12      2     refuse only: reason length (the UTF-8 reason follows the record)
//! 14      2     features (u16): a client's offer, the server's grant (a subset of the offer)
//! 16      16    ring sizes   [client→server, server→client] (u64 each)
//! 32      16    arena sizes  [client→server, server→client] (u64 each)
//! 48      8     segment length (server hello only)
//! 56      8     shared-arena length (server hello only; zero if the server has none)
//! ```
//!
//! The first 14 bytes (magic, version, kind, reason code and length) are frozen across all
//! protocol versions, so a peer of any version can read a refusal that names both versions.
//!
//! A client that rejects the server's hello (its policy refuses the server's uid, the fds or seals
//! are wrong, the sizes do not add up) sends a refusal record with its reason before it closes,
//! even after the server has sent its hello. The server can meet those bytes later, on a socket
//! that is otherwise silent: `link` peeks them (`late_refusal`, at most 64 + 1024 bytes) when it
//! checks liveness, and `decode_late_refusal` here turns them into the refusal's error with the
//! client's reason, instead of a bare protocol error.

use crate::error::{Error, ErrorKind, Result};

/// The protocol version this crate speaks.
/// Version 2 added the server's shared arena (ADR 0016): its length in the hello, a sixth fd, the
/// `SHARED` flag and the tagged releases. Version 3 made bytes 14..16 of the hello a features
/// word (ADR 0025), so that what the RPC layer adds is agreed on without a new version.
pub const PROTOCOL_VERSION: u16 = 3;

/// Optional behaviours two sides agree on in the handshake (bytes 14..16 of the hello): the
/// client offers the ones it knows, the server grants the ones of those it knows and allows, and
/// both use what the server granted. A bit neither knows is never granted; a server that grants
/// a bit the client did not offer breaks the protocol.
pub mod features {
    /// The RPC layer's one-frame unary call: a client's HEADERS may carry the call's only
    /// request, and a server's TRAILERS the call's last response (protocol 13.9).
    pub const UNARY_IN_ONE_FRAME: u16 = 0x0001;
    /// The RPC layer's streams start with a window of 64 KiB instead of 4 MiB (protocol 13.8):
    /// for a connection that carries many other parties' calls (a server's loopback, ADR 0037),
    /// where a stream nobody reads should hold little. Not in [`ALL`]: only a connection whose
    /// two ends ask for it uses it.
    pub const SMALL_WINDOW: u16 = 0x0002;
    /// The features a connection uses by default (`Config::features`).
    pub const ALL: u16 = UNARY_IN_ONE_FRAME;
    /// Every feature this crate knows: what a hello may offer or grant.
    pub const KNOWN: u16 = UNARY_IN_ONE_FRAME | SMALL_WINDOW;
}
/// The handshake magic.
pub const MAGIC: [u8; 8] = *b"ISTHMUS\0";
/// Size of the fixed handshake record.
pub const HELLO_LEN: usize = 64;
/// Longest refusal reason a peer may send.
pub const MAX_REASON_LEN: usize = 1024;
/// Fds the server attaches to its hello: the segment, then the doorbells (client rx, client tx,
/// server rx, server tx), then the shared arena when the hello gives it a length.
pub const SERVER_FDS: usize = 5;
/// Most fds a server's hello may carry: [`SERVER_FDS`] and the shared arena.
pub const MAX_SERVER_FDS: usize = SERVER_FDS + 1;

/// Which handshake message a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HelloKind {
    /// The client's opening message.
    Client = 1,
    /// The server's answer, sent with the segment and doorbell fds.
    Server = 2,
    /// Either side declines; a UTF-8 reason follows the record.
    Refuse = 3,
}

/// One handshake record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version of the sender.
    pub version: u16,
    /// Message kind.
    pub kind: HelloKind,
    /// Refuse only: why, see [`RefuseCode`].
    pub code: u8,
    /// Refuse only: length of the reason that follows.
    pub reason_len: u16,
    /// Hellos only: the features a client offers, or a server grants (see [`features`]).
    pub features: u16,
    /// Frame-ring sizes, `[client→server, server→client]`. A client states what it wants, the
    /// server what it granted.
    pub ring_size: [u64; 2],
    /// Arena sizes, same order.
    pub arena_size: [u64; 2],
    /// Server hello only: length of the segment passed along.
    pub segment_len: u64,
    /// Server hello only: length of the shared arena passed along, or zero.
    pub shared_len: u64,
}

impl Hello {
    /// A record of `kind` at this crate's version, with every size zero.
    pub fn new(kind: HelloKind) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            kind,
            code: 0,
            reason_len: 0,
            features: 0,
            ring_size: [0; 2],
            arena_size: [0; 2],
            segment_len: 0,
            shared_len: 0,
        }
    }

    /// Encodes the record.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10] = self.kind as u8;
        b[11] = self.code;
        b[12..14].copy_from_slice(&self.reason_len.to_le_bytes());
        b[14..16].copy_from_slice(&self.features.to_le_bytes());
        let words = [
            self.ring_size[0],
            self.ring_size[1],
            self.arena_size[0],
            self.arena_size[1],
            self.segment_len,
            self.shared_len,
        ];
        for (i, w) in words.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// Decodes a record. Checks magic, kind and reserved fields; the version is returned as sent
    /// so the caller can name both versions when they differ.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello> {
        if b[0..8] != MAGIC {
            return Err(Error::protocol("handshake: the peer is not an isthmus endpoint (bad magic)"));
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        let kind = match b[10] {
            1 => HelloKind::Client,
            2 => HelloKind::Server,
            3 => HelloKind::Refuse,
            k => return Err(Error::protocol(format!("handshake: unknown message kind {k}"))),
        };
        let code = b[11];
        let reason_len = u16::from_le_bytes([b[12], b[13]]);
        if reason_len as usize > MAX_REASON_LEN || ((reason_len != 0 || code != 0) && kind != HelloKind::Refuse) {
            return Err(Error::protocol(format!("handshake: reason length {reason_len} is not allowed here")));
        }
        if version != PROTOCOL_VERSION {
            // Past byte 14 a record of another version may mean anything.
            return Ok(Hello { version, kind, code, reason_len, ..Hello::new(kind) });
        }
        let features = u16::from_le_bytes([b[14], b[15]]);
        if features != 0 && kind == HelloKind::Refuse {
            return Err(Error::protocol("handshake: a refusal carries no features"));
        }
        let word = |i: usize| {
            let o = 16 + 8 * i;
            u64::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3], b[o + 4], b[o + 5], b[o + 6], b[o + 7]])
        };
        Ok(Hello {
            version,
            kind,
            code,
            reason_len,
            features,
            ring_size: [word(0), word(1)],
            arena_size: [word(2), word(3)],
            segment_len: word(4),
            shared_len: word(5),
        })
    }
}

/// Why a handshake was refused (byte 11 of a refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RefuseCode {
    /// The protocol versions differ.
    Version = 1,
    /// The peer's credentials are not allowed.
    Permission = 2,
    /// The request was malformed or asked for sizes out of range.
    BadRequest = 3,
}

/// Encodes a refusal: the record and its reason, truncated to [`MAX_REASON_LEN`] on a character
/// boundary.
pub fn encode_refusal(code: RefuseCode, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &reason[..end];
    let mut h = Hello::new(HelloKind::Refuse);
    h.code = code as u8;
    h.reason_len = reason.len() as u16;
    let mut out = h.encode().to_vec();
    out.extend_from_slice(reason.as_bytes());
    out
}

/// The error a side reports when the peer's version differs from ours.
pub(crate) fn version_mismatch(peer_role: &str, peer_version: u16) -> Error {
    Error::new(
        ErrorKind::VersionMismatch,
        format!(
            "isthmus protocol version mismatch: the {peer_role} speaks version {peer_version}, this side speaks version {PROTOCOL_VERSION}"
        ),
    )
}

/// The error a refusal record stands for, as the side that receives it reports it.
pub(crate) fn refusal_error(h: &Hello, peer_role: &str, text: &str) -> Error {
    let kind = match h.code {
        c if c == RefuseCode::Version as u8 => ErrorKind::VersionMismatch,
        c if c == RefuseCode::Permission as u8 => ErrorKind::PermissionDenied,
        _ if h.version != PROTOCOL_VERSION => ErrorKind::VersionMismatch,
        _ => ErrorKind::Protocol,
    };
    Error::new(kind, format!("the {peer_role} refused the connection: {text}"))
}

/// A client's refusal record (and its reason) at the start of `bytes`, if that is what they hold.
pub(crate) fn decode_late_refusal(bytes: &[u8]) -> Option<Error> {
    let h = Hello::decode(bytes.get(..HELLO_LEN)?.try_into().ok()?).ok()?;
    if h.kind != HelloKind::Refuse {
        return None;
    }
    let reason = bytes.get(HELLO_LEN..(HELLO_LEN + h.reason_len as usize).min(bytes.len()))?;
    Some(refusal_error(&h, "client", &String::from_utf8_lossy(reason)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let mut h = Hello::new(HelloKind::Server);
        h.features = features::KNOWN | 0x8000;
        h.ring_size = [1 << 20, 1 << 16];
        h.arena_size = [64 << 20, 1 << 30];
        h.segment_len = 12345;
        h.shared_len = 64 << 20;
        assert_eq!(Hello::decode(&h.encode()).expect("decodes"), h);
    }

    #[test]
    fn rejects_garbage_but_reads_any_version() {
        let mut b = Hello::new(HelloKind::Client).encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).is_err());
        let mut b = Hello::new(HelloKind::Client).encode();
        b[10] = 9;
        assert!(Hello::decode(&b).is_err());
        let mut b = Hello::new(HelloKind::Refuse).encode();
        b[14] = 1;
        assert!(Hello::decode(&b).is_err());
        let mut future = Hello::new(HelloKind::Client);
        future.version = 99;
        let mut b = future.encode();
        b[60] = 7; // a future version may use the reserved bytes
        assert_eq!(Hello::decode(&b).expect("readable").version, 99);
    }

    #[test]
    fn refusal_is_bounded() {
        let r = encode_refusal(RefuseCode::BadRequest, &"é".repeat(2000));
        let h = Hello::decode(r[..HELLO_LEN].try_into().expect("64 bytes")).expect("decodes");
        assert!(h.reason_len as usize <= MAX_REASON_LEN);
        assert_eq!(r.len(), HELLO_LEN + h.reason_len as usize);
        assert!(std::str::from_utf8(&r[HELLO_LEN..]).is_ok());
    }
}
