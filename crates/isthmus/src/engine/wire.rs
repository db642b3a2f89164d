//! Bodies of the RPC frames: what HEADERS, TRAILERS, CANCEL, GOAWAY and WINDOW carry over
//! isthmus-shm.
//! `docs/protocol.md` ("RPC frame bodies") is the normative description. All integers are
//! little-endian; every length is checked against the body before anything is read.
//!
//! ```text
//! metadata block  u32 count, then per entry: u16 key length, u32 value length, key, value
//! HEADERS (open)  u8 version=1, u8 reserved=0, u16 path length, u64 timeout ns (0 = none),
//!                 path, metadata block
//! HEADERS (reply) u8 version=1, metadata block
//! TRAILERS        u8 version=1, u32 code, u32 message length, u32 details length,
//!                 message (UTF-8), details, metadata block
//! CANCEL          u32 code
//! GOAWAY          u64 last stream id accepted, u32 message length, message
//! WINDOW          u64 credit added to the stream's window (1 ..= 2^40)
//! ```

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::metadata::{check_key, check_value, MetadataMap};
use crate::status::{Code, Status};

/// The metadata key under which a client's user agent travels in the HEADERS that open a
/// call, which a server gives its handlers as `user-agent` (a key gRPC reserves, which a peer
/// may not send as metadata). An HTTP/2 endpoint sends its client's `user-agent` header on
/// to its handlers the same way.
pub(crate) const AGENT_KEY: &str = "x-isthmus-peer-agent";

/// Version byte of the bodies this crate writes.
pub const WIRE_VERSION: u8 = 1;
/// RPC-layer frame flag of a one-frame call (protocol 13.9; only where the handshake granted
/// `features::UNARY_IN_ONE_FRAME`): a client's HEADERS carries the call's only request after its
/// head, or a server's TRAILERS the call's last response after its status.
pub const WITH_MESSAGE: u8 = 0x10;
/// Bytes of the TRAILERS body of a plain OK status (no message, details or metadata): how nearly
/// every call ends, and the least a one-frame call's last message goes beside.
pub(crate) const PLAIN_TRAILERS_LEN: usize = 17;
/// Longest method path accepted.
pub const MAX_PATH_LEN: usize = 1024;

/// A body that does not decode; the connection that sent it is closed with INTERNAL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WireError {}

/// An error that says `what` is wrong with a body.
pub(crate) fn bad(what: impl Into<String>) -> WireError {
    WireError(what.into())
}

/// A bounds-checked cursor over a body copied out of shared memory.
struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(bad(format!("{} body ends early: {n} bytes needed, {} left", self.what, self.buf.len())));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn version(&mut self) -> Result<(), WireError> {
        match self.u8()? {
            WIRE_VERSION => Ok(()),
            v => Err(bad(format!("{} body has version {v}; this side speaks {WIRE_VERSION}", self.what))),
        }
    }

    fn end(&self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(bad(format!("{} body has {} trailing bytes", self.what, self.buf.len())))
        }
    }

    fn metadata(&mut self) -> Result<MetadataMap, WireError> {
        let count = self.u32()? as usize;
        // Each entry takes at least 6 bytes: a count larger than that is a lie, refused before
        // anything is allocated for it.
        if count > self.buf.len() / 6 {
            return Err(bad(format!("{} body claims {count} metadata entries in {} bytes", self.what, self.buf.len())));
        }
        let mut md = MetadataMap::new();
        for _ in 0..count {
            let klen = self.u16()? as usize;
            let vlen = self.u32()? as usize;
            let key = std::str::from_utf8(self.take(klen)?).map_err(|_| bad("metadata key is not UTF-8"))?;
            let value = self.take(vlen)?;
            check_key(key).and_then(|()| check_value(key, value)).map_err(|e| bad(format!("peer metadata: {e}")))?;
            md.append_raw(key, Bytes::copy_from_slice(value)).map_err(|e| bad(e.to_string()))?;
        }
        Ok(md)
    }
}

/// The bytes [`put_metadata`] writes for `md`.
fn metadata_len(md: &MetadataMap) -> usize {
    metadata_len_with(md, None)
}

/// [`metadata_len`] with one more entry.
fn metadata_len_with(md: &MetadataMap, extra: Option<(&str, &[u8])>) -> usize {
    4 + md.sendable().chain(extra).map(|(k, v)| 6 + k.len() + v.len()).sum::<usize>()
}

fn put_metadata(out: &mut Vec<u8>, md: &MetadataMap) {
    put_metadata_with(out, md, None)
}

/// [`put_metadata`] with one more entry after `md`'s (an `extra` the caller has checked).
fn put_metadata_with(out: &mut Vec<u8>, md: &MetadataMap, extra: Option<(&str, &[u8])>) {
    out.extend_from_slice(&(md.sendable().chain(extra).count() as u32).to_le_bytes());
    for (k, v) in md.sendable().chain(extra) {
        out.extend_from_slice(&(k.len() as u16).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(v);
    }
}

/// What a client sends to open a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// Method path, `/package.Service/Method`.
    pub path: String,
    /// Time the client allows, measured from when it sent this (gRPC's `grpc-timeout`).
    pub timeout: Option<Duration>,
    /// Initial metadata.
    pub metadata: MetadataMap,
}

/// Encodes a HEADERS body from its parts, for a caller that holds the path only as `&str` (no
/// `RequestHead` to build, so no copy of the path).
pub fn encode_request_head(path: &str, timeout: Option<Duration>, metadata: &MetadataMap) -> Vec<u8> {
    HeadParts::new(path, timeout, metadata).parts().concat()
}

/// A HEADERS body as the three parts a sender copies into the ring back to back (so that no
/// buffer holds it whole): its fixed fields, the path, and the metadata, which is a constant
/// when there is none.
pub(crate) struct HeadParts<'a> {
    fixed: [u8; 12],
    path: &'a str,
    metadata: Cow<'a, [u8]>,
}

/// The metadata block of a call whose only entry is the client's user agent: made once per
/// channel, sent as it is by each call that has no other metadata.
pub(crate) fn agent_block(agent: &str) -> Box<[u8]> {
    let extra = Some((AGENT_KEY, agent.as_bytes()));
    let mut out = Vec::with_capacity(metadata_len_with(&MetadataMap::EMPTY, extra));
    put_metadata_with(&mut out, &MetadataMap::EMPTY, extra);
    out.into_boxed_slice()
}

impl<'a> HeadParts<'a> {
    pub(crate) fn new(path: &'a str, timeout: Option<Duration>, metadata: &MetadataMap) -> HeadParts<'a> {
        HeadParts::with_agent(path, timeout, metadata, None)
    }

    /// [`new`](Self::new), with the client's user agent (printable ASCII, checked when the
    /// channel took it) after the metadata, under [`AGENT_KEY`]: the agent, and its metadata
    /// block alone ([`agent_block`]), which a call with no other metadata sends as it is.
    pub(crate) fn with_agent(
        path: &'a str,
        timeout: Option<Duration>,
        metadata: &MetadataMap,
        agent: Option<(&str, &'a [u8])>,
    ) -> HeadParts<'a> {
        let mut fixed = [0u8; 12];
        fixed[0] = WIRE_VERSION;
        fixed[2..4].copy_from_slice(&(path.len() as u16).to_le_bytes());
        let ns = timeout.map_or(0, |t| t.as_nanos().clamp(1, u64::MAX as u128) as u64);
        fixed[4..12].copy_from_slice(&ns.to_le_bytes());
        let extra = agent.map(|(a, _)| (AGENT_KEY, a.as_bytes()));
        let metadata = if metadata.is_empty() {
            Cow::Borrowed(agent.map_or(&[0u8; 4][..], |(_, block)| block))
        } else {
            let mut out = Vec::with_capacity(metadata_len_with(metadata, extra));
            put_metadata_with(&mut out, metadata, extra);
            Cow::Owned(out)
        };
        HeadParts { fixed, path, metadata }
    }

    /// The body, in order.
    pub(crate) fn parts(&self) -> [&[u8]; 3] {
        [&self.fixed, self.path.as_bytes(), &self.metadata]
    }

    /// The body with the call's only request after it, for a one-frame call (protocol 13.9).
    pub(crate) fn parts_with<'m>(&'m self, request: &'m [u8]) -> [&'m [u8]; 4] {
        [&self.fixed, self.path.as_bytes(), &self.metadata, request]
    }

    /// Bytes of the body.
    pub(crate) fn len(&self) -> usize {
        self.fixed.len() + self.path.len() + self.metadata.len()
    }
}

impl RequestHead {
    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        encode_request_head(&self.path, self.timeout, &self.metadata)
    }

    /// Decodes and checks a body.
    pub fn decode(body: &[u8]) -> Result<RequestHead, WireError> {
        let (head, rest) = RequestHead::decode_prefix(body)?;
        if rest != body.len() {
            return Err(bad(format!("HEADERS body has {} trailing bytes", body.len() - rest)));
        }
        Ok(head)
    }

    /// Decodes and checks the head at the start of a HEADERS body that carries the call's first
    /// message after it (`flags::WITH_MESSAGE`); also where that message starts.
    pub fn decode_prefix(body: &[u8]) -> Result<(RequestHead, usize), WireError> {
        let mut r = Reader { buf: body, what: "HEADERS" };
        r.version()?;
        if r.u8()? != 0 {
            return Err(bad("HEADERS reserved byte is not zero"));
        }
        let plen = r.u16()? as usize;
        let ns = r.u64()?;
        if plen > MAX_PATH_LEN {
            return Err(bad(format!("method path of {plen} bytes exceeds {MAX_PATH_LEN}")));
        }
        let path = std::str::from_utf8(r.take(plen)?).map_err(|_| bad("method path is not UTF-8"))?;
        if !path.starts_with('/') || !path.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(format!("method path {path:?} must start with '/' and be printable ASCII")));
        }
        let metadata = r.metadata()?;
        let head = RequestHead { path: path.to_owned(), timeout: (ns > 0).then(|| Duration::from_nanos(ns)), metadata };
        Ok((head, body.len() - r.buf.len()))
    }
}

/// What a server sends before its first message: initial metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    /// Initial metadata.
    pub metadata: MetadataMap,
}

impl ResponseHead {
    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![WIRE_VERSION];
        put_metadata(&mut out, &self.metadata);
        out
    }

    /// Decodes and checks a body.
    pub fn decode(body: &[u8]) -> Result<ResponseHead, WireError> {
        let mut r = Reader { buf: body, what: "HEADERS" };
        r.version()?;
        let metadata = r.metadata()?;
        r.end()?;
        Ok(ResponseHead { metadata })
    }
}

/// Encodes the TRAILERS body for a call's final status.
pub fn encode_trailers(status: &Status) -> Cow<'static, [u8]> {
    // Version, code OK, no message, no details, no metadata: how nearly every call ends.
    static PLAIN_OK: [u8; PLAIN_TRAILERS_LEN] = [WIRE_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let (msg, details, md) = (status.message().as_bytes(), status.details(), status.metadata());
    if status.code() == Code::Ok && msg.is_empty() && details.is_empty() && md.is_empty() {
        return Cow::Borrowed(&PLAIN_OK);
    }
    let mut out = Vec::with_capacity(13 + msg.len() + details.len() + metadata_len(md));
    out.push(WIRE_VERSION);
    out.extend_from_slice(&(status.code() as u32).to_le_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&(details.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    out.extend_from_slice(details);
    put_metadata(&mut out, md);
    Cow::Owned(out)
}

/// Decodes a TRAILERS body into the call's final status.
pub fn decode_trailers(body: &[u8]) -> Result<Status, WireError> {
    let (status, at) = decode_trailers_prefix(body)?;
    if at != body.len() {
        return Err(bad(format!("TRAILERS body has {} trailing bytes", body.len() - at)));
    }
    Ok(status)
}

/// Decodes the status at the start of a TRAILERS body that carries the call's last message
/// after it (`WITH_MESSAGE`); also where that message starts.
pub fn decode_trailers_prefix(body: &[u8]) -> Result<(Status, usize), WireError> {
    let mut r = Reader { buf: body, what: "TRAILERS" };
    r.version()?;
    let code = Code::from_u32(r.u32()?);
    let mlen = r.u32()? as usize;
    let dlen = r.u32()? as usize;
    let message = String::from_utf8_lossy(r.take(mlen)?).into_owned();
    let details = Bytes::copy_from_slice(r.take(dlen)?);
    let metadata = r.metadata()?;
    Ok((Status::new(code, message).with_details(details).with_metadata(metadata), body.len() - r.buf.len()))
}

/// Encodes a CANCEL body.
pub fn encode_cancel(code: Code) -> [u8; 4] {
    (code as u32).to_le_bytes()
}

/// Decodes a CANCEL body.
pub fn decode_cancel(body: &[u8]) -> Result<Code, WireError> {
    let mut r = Reader { buf: body, what: "CANCEL" };
    let code = Code::from_u32(r.u32()?);
    r.end()?;
    Ok(code)
}

/// The largest credit one WINDOW frame may grant: far above any window an honest side grants,
/// low enough that adding grants can never overflow.
pub const MAX_WINDOW_INCREMENT: u64 = 1 << 40;

/// Encodes a WINDOW body: the peer may send `increment` more bytes (as charged by the flow
/// control) on the frame's stream.
pub fn encode_window(increment: u64) -> [u8; 8] {
    increment.to_le_bytes()
}

/// Decodes a WINDOW body.
pub fn decode_window(body: &[u8]) -> Result<u64, WireError> {
    let mut r = Reader { buf: body, what: "WINDOW" };
    let n = r.u64()?;
    r.end()?;
    if n == 0 || n > MAX_WINDOW_INCREMENT {
        return Err(bad(format!("WINDOW increment {n} is outside 1..={MAX_WINDOW_INCREMENT}")));
    }
    Ok(n)
}

/// The sender takes no stream after `last_stream` and will close once those in flight end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoAway {
    /// Highest stream id the sender accepted.
    pub last_stream: u64,
    /// Why, for people.
    pub message: String,
}

impl GoAway {
    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(12 + self.message.len());
        out.extend_from_slice(&self.last_stream.to_le_bytes());
        out.extend_from_slice(&(self.message.len() as u32).to_le_bytes());
        out.extend_from_slice(self.message.as_bytes());
        out
    }

    /// Decodes a body.
    pub fn decode(body: &[u8]) -> Result<GoAway, WireError> {
        let mut r = Reader { buf: body, what: "GOAWAY" };
        let last_stream = r.u64()?;
        let len = r.u32()? as usize;
        let message = String::from_utf8_lossy(r.take(len)?).into_owned();
        r.end()?;
        Ok(GoAway { last_stream, message })
    }
}

#[doc(hidden)]
/// Fuzz entry point: every decoder over arbitrary bytes must return, never panic.
pub fn fuzz(data: &[u8]) {
    let _ = RequestHead::decode(data);
    let _ = RequestHead::decode_prefix(data);
    let _ = decode_trailers_prefix(data);
    let _ = ResponseHead::decode(data);
    let _ = decode_trailers(data);
    let _ = decode_cancel(data);
    let _ = GoAway::decode(data);
    let _ = decode_window(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler's metadata with its HTTP/2 caller's `user-agent` in it, passed on to a call
    /// of its own: the agent stays behind, and the body decodes (a peer refuses reserved keys).
    #[test]
    fn entries_under_reserved_keys_are_not_encoded() {
        let mut metadata = md();
        metadata.append_transport("user-agent", Bytes::from_static(b"grpc-go/1.85.0"));
        assert_eq!(metadata.get("user-agent"), Some("grpc-go/1.85.0"));
        let body = encode_request_head("/a.B/C", None, &metadata);
        assert_eq!(RequestHead::decode(&body).expect("decodes").metadata, md());
    }

    /// A channel's user agent goes last in the metadata of the HEADERS that open a call, under
    /// its key, with or without other metadata.
    #[test]
    fn a_user_agent_travels_after_the_metadata() {
        for metadata in [MetadataMap::new(), md()] {
            let block = agent_block("app/1.0");
            let head = HeadParts::with_agent("/a.B/C", None, &metadata, Some(("app/1.0", &block)));
            let decoded = RequestHead::decode(&head.parts().concat()).expect("decodes").metadata;
            let mut expected = metadata.clone();
            expected.append(AGENT_KEY, "app/1.0").expect("ascii");
            assert_eq!(decoded, expected);
        }
    }

    fn md() -> MetadataMap {
        let mut m = MetadataMap::new();
        m.append("x-user", "ada").expect("ascii");
        m.append_bin("blob-bin", vec![0u8, 1, 255]).expect("binary");
        m
    }

    #[test]
    fn every_body_round_trips() {
        let h =
            RequestHead { path: "/pkg.Svc/Call".into(), timeout: Some(Duration::from_millis(1500)), metadata: md() };
        assert_eq!(RequestHead::decode(&h.encode()), Ok(h));
        let none = RequestHead { path: "/a/b".into(), timeout: None, metadata: MetadataMap::new() };
        assert_eq!(RequestHead::decode(&none.encode()), Ok(none));
        let r = ResponseHead { metadata: md() };
        assert_eq!(ResponseHead::decode(&r.encode()), Ok(r));
        for code in Code::ALL {
            let s = Status::new(code, "why").with_details(vec![9u8; 40]).with_metadata(md());
            assert_eq!(decode_trailers(&encode_trailers(&s)), Ok(s));
            assert_eq!(decode_cancel(&encode_cancel(code)), Ok(code));
        }
        // The plain OK's fixed bytes say what the general encoding says.
        let ok_with_md = Status::ok().with_metadata(md());
        assert_eq!(decode_trailers(&encode_trailers(&ok_with_md)), Ok(ok_with_md));
        assert_eq!(decode_trailers(&encode_trailers(&Status::ok())), Ok(Status::ok()));
        let mut by_hand = vec![WIRE_VERSION];
        for field in [Code::Ok as u32, 0, 0, 0] {
            by_hand.extend_from_slice(&field.to_le_bytes()); // code, message, details, metadata
        }
        assert_eq!(&encode_trailers(&Status::ok())[..], &by_hand[..]);
        assert_eq!(decode_window(&encode_window(4096)), Ok(4096));
        assert!(decode_window(&encode_window(0)).is_err());
        assert!(decode_window(&encode_window(MAX_WINDOW_INCREMENT + 1)).is_err());
        assert!(decode_window(&[1, 0, 0, 0]).is_err());
        let g = GoAway { last_stream: 77, message: "shutting down".into() };
        assert_eq!(GoAway::decode(&g.encode()), Ok(g));
    }

    #[test]
    fn a_one_frame_calls_message_starts_where_the_head_or_status_ends() {
        let h = RequestHead { path: "/pkg.Svc/Call".into(), timeout: None, metadata: md() };
        let parts = HeadParts::new(&h.path, h.timeout, &h.metadata);
        for request in [&b""[..], b"request bytes"] {
            let body = parts.parts_with(request).concat();
            assert_eq!(parts.len() + request.len(), body.len());
            let (head, at) = RequestHead::decode_prefix(&body).expect("head");
            assert_eq!((head, &body[at..]), (h.clone(), request));
            // Without the flag the same bytes are a HEADERS with trailing bytes.
            assert_eq!(RequestHead::decode(&body).is_err(), !request.is_empty());
        }
        let s = Status::new(Code::NotFound, "why").with_metadata(md());
        let mut body = encode_trailers(&s).into_owned();
        body.extend_from_slice(b"last response");
        let (status, at) = decode_trailers_prefix(&body).expect("status");
        assert_eq!((status, &body[at..]), (s, &b"last response"[..]));
        assert!(decode_trailers(&body).is_err());
        // A head cut short is an error either way.
        assert!(RequestHead::decode_prefix(&parts.parts_with(b"x").concat()[..5]).is_err());
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let h = RequestHead { path: "/pkg.Svc/Call".into(), timeout: None, metadata: md() }.encode();
        for n in 0..h.len() {
            assert!(RequestHead::decode(&h[..n]).is_err(), "truncated at {n}");
        }
        let mut long = h.clone();
        long.push(0);
        assert!(RequestHead::decode(&long).is_err());
        let t = encode_trailers(&Status::new(Code::NotFound, "x").with_metadata(md()));
        for n in 0..t.len() {
            assert!(decode_trailers(&t[..n]).is_err(), "truncated at {n}");
        }
    }

    #[test]
    fn peer_metadata_is_held_to_the_rules() {
        let mut body = vec![WIRE_VERSION];
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&11u16.to_le_bytes());
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(b"grpc-status0");
        assert!(ResponseHead::decode(&body).is_err(), "reserved key from a peer");
        let mut lie = vec![WIRE_VERSION];
        lie.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(ResponseHead::decode(&lie).is_err(), "a count larger than the body");
        let bad_path = RequestHead { path: "no-slash".into(), timeout: None, metadata: MetadataMap::new() }.encode();
        assert!(RequestHead::decode(&bad_path).is_err());
    }
}
