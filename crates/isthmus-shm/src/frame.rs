//! The frame codec: a 16-byte header, then a body padded to 8 bytes.
//!
//! ```text
//! offset  size  field
//! 0       4     body length in bytes (u32, little-endian), padding excluded
//! 4       1     kind
//! 5       1     flags
//! 6       2     reserved, zero
//! 8       8     stream id (u64, little-endian)
//! ```
//!
//! Kinds mirror gRPC's HTTP/2 mapping so a bridge to tonic is direct. The transport interprets
//! only MESSAGE frames carrying [`flags::ARENA`]; every other body is opaque here and defined by
//! the RPC layer. Decoders take bytes already copied out of shared memory and check everything.

use crate::error::{Error, Result};
use crate::layout::FRAME_HEADER_LEN;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Opens a stream or carries initial metadata: method path, metadata, deadline.
    Headers = 1,
    /// One message of a stream (inline bytes, or a descriptor of an arena block).
    Message = 2,
    /// Ends a stream with a status, a message and trailing metadata.
    Trailers = 3,
    /// Abandons a stream.
    Cancel = 4,
    /// Liveness or round-trip probe; answered with [`flags::ACK`] set.
    Ping = 5,
    /// The sender takes no new streams and will close after those in flight.
    GoAway = 6,
    /// Grants the peer more room to send on one stream (flow control; the body is the RPC
    /// layer's).
    Window = 7,
}

impl Kind {
    /// Decodes a kind byte.
    pub fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Headers,
            2 => Kind::Message,
            3 => Kind::Trailers,
            4 => Kind::Cancel,
            5 => Kind::Ping,
            6 => Kind::GoAway,
            7 => Kind::Window,
            _ => return None,
        })
    }
}

/// Flag bits. Bits not listed here are free for the RPC layer and passed through untouched.
pub mod flags {
    /// The sender will send nothing more on this stream (HTTP/2's END_STREAM).
    pub const END_STREAM: u8 = 0x01;
    /// MESSAGE only, transport-internal: the body is an [`ArenaDescriptor`](super::ArenaDescriptor).
    /// Never visible to receivers, who always get the message's bytes.
    pub const ARENA: u8 = 0x02;
    /// PING only: this is the answer.
    pub const ACK: u8 = 0x04;
    /// MESSAGE with [`ARENA`] only, transport-internal (protocol version 2): the descriptor points
    /// into the server's shared arena, not the connection's own. Only a server sends it, only
    /// for a whole message. Never visible to receivers.
    pub const SHARED: u8 = 0x08;
    /// The bits the transport keeps for itself: a caller may not set them on a frame it sends.
    pub const TRANSPORT: u8 = ARENA | SHARED;
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Body length in bytes, before padding.
    pub len: u32,
    /// The frame kind.
    pub kind: Kind,
    /// Flag bits, see [`flags`].
    pub flags: u8,
    /// The stream the frame belongs to; 0 is the connection itself.
    pub stream: u64,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&self.len.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.flags;
        b[8..16].copy_from_slice(&self.stream.to_le_bytes());
        b
    }

    /// Decodes and checks a header. `max_body` is the largest body the ring can hold.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN], max_body: usize) -> Result<FrameHeader> {
        let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let kind = Kind::from_u8(b[4]).ok_or_else(|| Error::protocol(format!("frame has unknown kind {}", b[4])))?;
        let flags = b[5];
        if b[6] != 0 || b[7] != 0 {
            return Err(Error::protocol("frame header's reserved bytes are not zero"));
        }
        let stream = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
        if len as usize > max_body {
            return Err(Error::protocol(format!("frame body of {len} bytes exceeds the ring's limit of {max_body}")));
        }
        if flags & flags::SHARED != 0 && flags & flags::ARENA == 0 {
            return Err(Error::protocol("frame carries the SHARED flag without the ARENA flag"));
        }
        if flags & flags::ARENA != 0 {
            if kind != Kind::Message {
                return Err(Error::protocol(format!("{kind:?} frame carries the ARENA flag, which only MESSAGE may")));
            }
            if len as usize != ArenaDescriptor::LEN {
                return Err(Error::protocol(format!(
                    "arena descriptor is {len} bytes, expected {}",
                    ArenaDescriptor::LEN
                )));
            }
        }
        Ok(FrameHeader { len, kind, flags, stream })
    }
}

/// The body of a MESSAGE frame whose payload lies in the sender's arena.
///
/// A message larger than the arena travels as several pieces, each its own descriptor with the
/// same `total`; the receiver reassembles them in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaDescriptor {
    /// Offset of the piece from the start of the sender's arena.
    pub offset: u64,
    /// Length of this piece; never zero.
    pub len: u64,
    /// Length of the whole message.
    pub total: u64,
}

impl ArenaDescriptor {
    /// Encoded size.
    pub const LEN: usize = 24;

    /// Encodes the descriptor.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b
    }

    /// Decodes and checks a descriptor against the size of the arena it points into.
    pub fn decode(b: &[u8], arena_size: u64) -> Result<ArenaDescriptor> {
        let b: &[u8; Self::LEN] = b.try_into().map_err(|_| Error::protocol("arena descriptor has the wrong length"))?;
        let word =
            |i: usize| u64::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3], b[i + 4], b[i + 5], b[i + 6], b[i + 7]]);
        let d = ArenaDescriptor { offset: word(0), len: word(8), total: word(16) };
        let end = d.offset.checked_add(d.len);
        if d.len == 0 || d.len > d.total || end.is_none_or(|e| e > arena_size) {
            return Err(Error::protocol(format!(
                "arena descriptor {{offset {}, len {}, total {}}} does not fit an arena of {arena_size} bytes",
                d.offset, d.len, d.total
            )));
        }
        Ok(d)
    }
}

/// Bytes a frame with a `body_len`-byte body takes in the ring.
pub fn frame_footprint(body_len: usize) -> usize {
    FRAME_HEADER_LEN + body_len.next_multiple_of(crate::layout::FRAME_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        for kind in [Kind::Headers, Kind::Message, Kind::Trailers, Kind::Cancel, Kind::Ping, Kind::GoAway, Kind::Window]
        {
            let h = FrameHeader { len: 77, kind, flags: flags::END_STREAM, stream: u64::MAX - 3 };
            assert_eq!(FrameHeader::decode(&h.encode(), 1000).expect("decodes"), h);
        }
    }

    #[test]
    fn header_rejects_bad_fields() {
        let good = FrameHeader { len: 8, kind: Kind::Message, flags: 0, stream: 1 }.encode();
        let mut b = good;
        b[4] = 0;
        assert!(FrameHeader::decode(&b, 100).is_err(), "kind 0");
        b = good;
        b[4] = 8;
        assert!(FrameHeader::decode(&b, 100).is_err(), "kind 8");
        b = good;
        b[6] = 1;
        assert!(FrameHeader::decode(&b, 100).is_err(), "reserved");
        assert!(FrameHeader::decode(&good, 7).is_err(), "too long for ring");
        b = good;
        b[5] = flags::ARENA;
        assert!(FrameHeader::decode(&b, 100).is_err(), "arena flag with wrong length");
        let h = FrameHeader { len: 24, kind: Kind::Headers, flags: flags::ARENA, stream: 1 };
        assert!(FrameHeader::decode(&h.encode(), 100).is_err(), "arena flag on HEADERS");
        let h = FrameHeader { len: 24, kind: Kind::Message, flags: flags::SHARED, stream: 1 };
        assert!(FrameHeader::decode(&h.encode(), 100).is_err(), "shared flag without the arena flag");
        let h = FrameHeader { len: 24, kind: Kind::Message, flags: flags::SHARED | flags::ARENA, stream: 1 };
        assert!(FrameHeader::decode(&h.encode(), 100).is_ok(), "a shared descriptor");
    }

    #[test]
    fn descriptor_checks_bounds() {
        let ok = ArenaDescriptor { offset: 4096, len: 100, total: 100 };
        assert_eq!(ArenaDescriptor::decode(&ok.encode(), 8192).expect("fits"), ok);
        let cases = [
            ArenaDescriptor { offset: 8100, len: 100, total: 100 },
            ArenaDescriptor { offset: 0, len: 0, total: 0 },
            ArenaDescriptor { offset: 0, len: 10, total: 5 },
            ArenaDescriptor { offset: u64::MAX, len: 2, total: 2 },
        ];
        for d in cases {
            assert!(ArenaDescriptor::decode(&d.encode(), 8192).is_err(), "{d:?}");
        }
        assert!(ArenaDescriptor::decode(&[0u8; 23], 8192).is_err());
    }
}
