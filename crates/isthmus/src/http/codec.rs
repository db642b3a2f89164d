//! gRPC over HTTP/2's encodings: the 5-byte message prefix, `grpc-timeout`, metadata as headers
//! (`-bin` values base64), and the status trailers. Everything read here comes from a body or a
//! header map built by tonic code in this process or by a peer over the network, so every
//! length and value is checked.
//!
//! - `prefix(len)`: a compressed flag, then the length as a big-endian `u32`; a message over 4 GiB
//!   is RESOURCE_EXHAUSTED.
//! - `Deframer` cuts a body's data frames back into messages. A message that lies whole in the
//!   first queued frame is a slice of it (`Bytes::split_to`), not a copy; tonic yields each encoded
//!   message as one frame, so that is the usual case, and only a message split across frames is
//!   gathered. A length over the limit is RESOURCE_EXHAUSTED, bytes left at the end of a body a
//!   message cut short.
//! - Compression (`Encoding`): a request's `grpc-encoding` of `gzip` or `deflate` (zlib, as gRPC
//!   means it) is read, any other UNIMPLEMENTED. A message with the compressed flag set is
//!   inflated, and its inflated size held to the same limit (RESOURCE_EXHAUSTED), so a small
//!   bomb cannot grow past it; the flag set with no encoding agreed, or a flag other than 0 and
//!   1, is INTERNAL, as the gRPC spec has it. Replies go uncompressed, which every client
//!   accepts, and say what this side reads in `grpc-accept-encoding`, unless the server asks to
//!   compress them (`Server::send_compressed`) and the client's `grpc-accept-encoding` lists
//!   that encoding (`framed_compressed`). A client's requests are compressed when its call asks
//!   (`CallOptions::compression`, by tonic's encoder).
//! - `grpc-timeout` is read as 1 to 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`), anything
//!   else INVALID_ARGUMENT; written in the finest unit whose count fits 8 digits, rounded up, at
//!   least 1 ns.
//! - Metadata is every header but `grpc-*`, `content-type`, `te`, `user-agent`, `host` and
//!   `content-length`, under `MetadataMap`'s rules; a value that breaks them is INVALID_ARGUMENT,
//!   naming the key. `-bin` values are base64, read padded or not, written unpadded as gRPC sends
//!   them.
//! - Status: `grpc-status` as a number, `grpc-message` percent-encoded (bytes outside printable
//!   ASCII, and `%`), `grpc-status-details-bin` in base64, then the status's metadata. Reading, a
//!   code that does not parse is UNKNOWN, and trailers whose metadata break the rules make an
//!   INTERNAL status.

use std::io::Read;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// The prefix of one message in a gRPC body: compressed flag, then big-endian length.
pub(crate) fn prefix(len: usize) -> Result<[u8; 5], Status> {
    let len = u32::try_from(len).map_err(|_| {
        Status::new(Code::ResourceExhausted, format!("a {len}-byte message is over gRPC's 4 GiB framing limit"))
    })?;
    let mut p = [0u8; 5];
    p[1..].copy_from_slice(&len.to_be_bytes());
    Ok(p)
}

/// Messages at most this long leave the bridge as one data frame with their prefix, copied:
/// cheaper than a second allocation and a second frame for the prefix alone.
const COPY_MAX: usize = 1024;

/// One message as a gRPC body's data: the prefix, then the message's own bytes (a view into
/// shared memory for a large one), or both in one frame for a small message.
pub(crate) fn framed(m: Bytes) -> Result<(Bytes, Option<Bytes>), Status> {
    let p = prefix(m.len())?;
    if m.len() > COPY_MAX {
        return Ok((Bytes::copy_from_slice(&p), Some(m)));
    }
    let mut both = BytesMut::with_capacity(p.len() + m.len());
    both.extend_from_slice(&p);
    both.extend_from_slice(&m);
    Ok((both.freeze(), None))
}

/// One message compressed with `encoding`, behind its prefix with the compressed flag set.
pub(crate) fn framed_compressed(m: &[u8], encoding: Encoding) -> Result<Bytes, Status> {
    use std::io::Write;
    let mut out = vec![0u8; 5];
    let written = match encoding {
        Encoding::Gzip => {
            let mut e = flate2::write::GzEncoder::new(&mut out, flate2::Compression::default());
            e.write_all(m).and_then(|()| e.finish().map(drop))
        }
        Encoding::Deflate => {
            let mut e = flate2::write::ZlibEncoder::new(&mut out, flate2::Compression::default());
            e.write_all(m).and_then(|()| e.finish().map(drop))
        }
    };
    written.map_err(|e| Status::new(Code::Internal, format!("a reply did not compress: {e}")))?;
    let mut p = prefix(out.len() - 5)?;
    p[0] = 1;
    out[..5].copy_from_slice(&p);
    Ok(Bytes::from(out))
}

/// Whether a request's `grpc-accept-encoding` lists `encoding` (a client that sends none reads
/// identity only).
pub(crate) fn accepts(headers: &HeaderMap, encoding: Encoding) -> bool {
    headers
        .get_all(GRPC_ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|name| name.trim() == encoding.name())
}

/// How a server's bridge compresses one HTTP/2 call's replies: with the handler's own choice
/// (`ServerCall::set_compression`, carried in the reply's initial metadata under
/// `REPLY_ENCODING_HEADER`), else the server's (`Server::send_compressed`), each only if the
/// client's `grpc-accept-encoding` lists it; uncompressed otherwise, which every client reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReplyCompression {
    server: Option<Encoding>,
    gzip: bool,
    deflate: bool,
}

impl ReplyCompression {
    /// For a request with `headers` to a server that compresses its replies with `server`.
    pub(crate) fn new(server: Option<Encoding>, headers: &HeaderMap) -> ReplyCompression {
        ReplyCompression {
            server,
            gzip: accepts(headers, Encoding::Gzip),
            deflate: accepts(headers, Encoding::Deflate),
        }
    }

    /// The encoding of the replies, given the handler's choice if it made one (`identity`, or
    /// a name this side does not know: uncompressed).
    pub(crate) fn choose(self, handler: Option<&[u8]>) -> Option<Encoding> {
        let wanted = match handler {
            Some(name) => std::str::from_utf8(name).ok().and_then(Encoding::from_name),
            None => self.server,
        };
        wanted.filter(|&e| match e {
            Encoding::Gzip => self.gzip,
            Encoding::Deflate => self.deflate,
        })
    }
}

/// Cuts a gRPC body's data frames back into messages. A message that lies whole inside one
/// data frame (tonic yields each encoded message as one frame) is a slice of that frame, not a
/// copy; what is left of a frame that does not end at a message's end is copied into a buffer
/// of its own, where the next frames join it. So at most one frame as it came is held (a frame
/// received is a slice of the connection's read buffer, and keeps all of that alive), and the
/// buffer holds at most the message being gathered, within the limit: a client that sends a
/// message a byte per frame costs its bytes, not a read buffer and a queue entry per byte.
#[derive(Debug)]
pub(crate) struct Deframer {
    /// A frame taken as it came, not yet cut (then `gather` is empty).
    frame: Option<Bytes>,
    /// Bytes of a message that did not lie whole in one frame, and the frames after.
    gather: BytesMut,
    limit: usize,
    /// The body's `grpc-encoding`, for messages with the compressed flag; `None`: identity.
    encoding: Option<Encoding>,
    /// Which side receives, as grpc-core names it in a refusal over the limit: `CLIENT` or
    /// `SERVER`.
    side: &'static str,
}

/// The most a message being gathered reserves at once; a larger one grows as it comes.
const RESERVE_MAX: usize = 16 << 20;

/// A message encoding gRPC peers agree on in `grpc-encoding` (besides `identity`): the public
/// [`Compression`](crate::Compression), read here.
pub(crate) use crate::call::Compression as Encoding;

/// What `grpc-accept-encoding` says this side reads.
pub(crate) const ACCEPT_ENCODING: &str = "gzip,deflate,identity";

impl Encoding {
    /// A body's encoding from its `grpc-encoding` header: `None` for identity (or no header);
    /// one this side cannot read is UNIMPLEMENTED, as the gRPC spec asks.
    pub(crate) fn from_headers(headers: &HeaderMap) -> Result<Option<Encoding>, Status> {
        let Some(v) = headers.get(GRPC_ENCODING) else { return Ok(None) };
        let unsupported = || {
            let name = String::from_utf8_lossy(v.as_bytes());
            let message = format!("grpc-encoding {name:?} is not supported; this server reads {ACCEPT_ENCODING}");
            Status::new(Code::Unimplemented, message)
        };
        match v.to_str() {
            Ok("identity") => Ok(None),
            Ok(name) => Encoding::from_name(name).map(Some).ok_or_else(unsupported),
            Err(_) => Err(unsupported()),
        }
    }

    /// Inflates one message, refusing to grow it past `limit` bytes.
    fn inflate(self, compressed: &[u8], limit: usize) -> Result<Bytes, Status> {
        let mut out = Vec::new();
        let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
        let read = match self {
            Encoding::Gzip => flate2::read::GzDecoder::new(compressed).take(cap).read_to_end(&mut out),
            Encoding::Deflate => flate2::read::ZlibDecoder::new(compressed).take(cap).read_to_end(&mut out),
        };
        read.map_err(|e| Status::new(Code::Internal, format!("a {self:?}-compressed message did not inflate: {e}")))?;
        if out.len() > limit {
            return Err(Status::new(
                Code::ResourceExhausted,
                format!(
                    "received a {}-byte compressed message that inflates past the limit of {limit} bytes",
                    compressed.len()
                ),
            ));
        }
        Ok(Bytes::from(out))
    }
}

impl Deframer {
    /// `limit`: the largest message accepted; a larger one is RESOURCE_EXHAUSTED, in grpc-core's
    /// words for a client ([`Deframer::for_server`] for a server's).
    pub(crate) fn new(limit: usize) -> Deframer {
        Deframer { frame: None, gather: BytesMut::new(), limit, encoding: None, side: "CLIENT" }
    }

    /// A server's reading of requests: a refusal over the limit in a server's words, as
    /// `shm://` words it (the client reads them in its status).
    pub(crate) fn for_server(mut self) -> Deframer {
        self.side = "SERVER";
        self
    }

    /// The body's `grpc-encoding` (see [`Encoding::from_headers`]).
    pub(crate) fn with_encoding(mut self, encoding: Option<Encoding>) -> Deframer {
        self.encoding = encoding;
        self
    }

    /// Adds a data frame.
    pub(crate) fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        if self.frame.is_none() && self.gather.is_empty() {
            self.frame = Some(data);
            return;
        }
        self.spill();
        self.gather.extend_from_slice(&data);
    }

    /// Moves the frame held as it came into `gather`.
    fn spill(&mut self) {
        if let Some(frame) = self.frame.take() {
            self.gather.extend_from_slice(&frame);
        }
    }

    /// The next whole message, if one has arrived.
    pub(crate) fn next(&mut self) -> Result<Option<Bytes>, Status> {
        if let Some(frame) = &mut self.frame {
            if frame.len() >= 5 {
                let (len, compressed) = header(&frame[..5], self.encoding, self.limit, self.side)?;
                if frame.len() >= 5 + len {
                    let message = frame.split_to(5 + len).split_off(5);
                    if frame.is_empty() {
                        self.frame = None;
                    }
                    return self.finish(message, compressed).map(Some);
                }
            }
            self.spill();
        }
        if self.gather.len() < 5 {
            return Ok(None);
        }
        let (len, compressed) = header(&self.gather[..5], self.encoding, self.limit, self.side)?;
        if self.gather.len() < 5 + len {
            self.gather.reserve((5 + len - self.gather.len()).min(RESERVE_MAX));
            return Ok(None);
        }
        let message = self.gather.split_to(5 + len).split_off(5).freeze();
        self.finish(message, compressed).map(Some)
    }

    /// A whole message, inflated if its flag said it was compressed.
    fn finish(&self, message: Bytes, compressed: bool) -> Result<Bytes, Status> {
        match self.encoding.filter(|_| compressed) {
            None => Ok(message),
            Some(encoding) => encoding.inflate(&message, self.limit),
        }
    }

    /// Whether bytes of an unfinished message are left (an error at the end of a body).
    pub(crate) fn is_empty(&self) -> bool {
        self.frame.is_none() && self.gather.is_empty()
    }
}

/// A message's length and whether it is compressed, from its 5-byte prefix, if its flag and
/// length are acceptable.
fn header(head: &[u8], encoding: Option<Encoding>, limit: usize, side: &str) -> Result<(usize, bool), Status> {
    let compressed = match (head[0], encoding) {
        (0, _) => false,
        (1, Some(_)) => true,
        (1, None) => {
            return Err(Status::new(Code::Internal, "a compressed message, but no grpc-encoding was given"));
        }
        (flag, _) => {
            return Err(Status::new(Code::Internal, format!("a message flag of {flag}: gRPC's are 0 and 1")));
        }
    };
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > limit {
        return Err(Status::new(
            Code::ResourceExhausted,
            format!("{side}: Received message larger than max ({len} vs. {limit})"),
        ));
    }
    Ok((len, compressed))
}

/// Reads `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a unit).
pub(crate) fn timeout_from(headers: &HeaderMap) -> Result<Option<Duration>, Status> {
    let Some(v) = headers.get(GRPC_TIMEOUT) else { return Ok(None) };
    // grpc-go's code for it.
    let bad = || Status::new(Code::Internal, format!("malformed grpc-timeout {v:?}"));
    let s = v.to_str().map_err(|_| bad())?;
    if s.len() < 2 || s.len() > 9 {
        return Err(bad());
    }
    let (digits, unit) = s.split_at(s.len() - 1);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    Ok(Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(bad()),
    }))
}

/// The longest timeout `grpc-timeout` can say: 8 digits of hours (11,415 years).
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(99_999_999 * 3600);

/// Writes `grpc-timeout` in the finest unit whose count fits 8 digits.
pub(crate) fn timeout_value(t: Duration) -> HeaderValue {
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    let ns = t.as_nanos().max(1);
    for (per, unit) in units {
        let n = ns.div_ceil(per);
        if n < 100_000_000 {
            return HeaderValue::from_str(&format!("{n}{unit}")).unwrap_or(HeaderValue::from_static("99999999H"));
        }
    }
    HeaderValue::from_static("99999999H")
}

/// Headers that belong to HTTP/2 or to gRPC's own framing, never metadata.
fn is_protocol_header(key: &str) -> bool {
    key.starts_with("grpc-") || matches!(key, "content-type" | "te" | "user-agent" | "host" | "content-length")
}

/// The metadata in a header map (request headers, response headers or trailers), as a server
/// reads a request's: `-bin` values are base64 (padded or not; several joined by `,`, which the
/// spec lets a proxy do), and one that does not decode is INTERNAL, naming the key, as grpc-go
/// refuses it. An entry this side cannot hold (a text value that is not printable
/// ASCII, a key gRPC would not send) is left out: the spec says such a value must not fail the
/// call, and may be dropped.
pub(crate) fn metadata_from(headers: &HeaderMap) -> Result<MetadataMap, Status> {
    read_metadata(headers, true)
}

/// [`metadata_from`] as a client reads a response's: a `-bin` value that does not decode is
/// left out too, with the rest kept (a server's bad entry must not lose its others).
pub(crate) fn metadata_from_server(headers: &HeaderMap) -> MetadataMap {
    read_metadata(headers, false).unwrap_or_default()
}

/// Whether a request's `-bin` values all decode, as [`metadata_from`] reads them: for the
/// services that read their metadata lazily, which grpc-go's server would refuse INTERNAL.
pub(crate) fn check_binary_metadata(headers: &HeaderMap) -> Result<(), Status> {
    for (key, value) in headers {
        if crate::metadata::is_binary_key(key.as_str())
            && value.as_bytes().split(|b| *b == b',').any(|part| decode_base64(part.trim_ascii()).is_none())
        {
            return Err(Status::new(Code::Internal, format!("metadata {key}: value is not base64")));
        }
    }
    Ok(())
}

fn read_metadata(headers: &HeaderMap, strict_binary: bool) -> Result<MetadataMap, Status> {
    let mut md = MetadataMap::new();
    for (key, value) in headers {
        let key = key.as_str();
        if is_protocol_header(key) {
            continue;
        }
        if !crate::metadata::is_binary_key(key) {
            if let Ok(text) = value.to_str() {
                let _ = md.append(key, text);
            }
            continue;
        }
        for part in value.as_bytes().split(|b| *b == b',') {
            match decode_base64(part.trim_ascii()) {
                Some(decoded) => {
                    let _ = md.append_bin(key, decoded);
                }
                None if strict_binary => {
                    // grpc-go's code for it ("malformed binary metadata").
                    return Err(Status::new(Code::Internal, format!("metadata {key}: value is not base64")));
                }
                None => {}
            }
        }
    }
    Ok(md)
}

/// Appends `md` to a header map (`-bin` values base64 without padding, as gRPC sends them).
pub(crate) fn metadata_into(md: &MetadataMap, headers: &mut HeaderMap) {
    for (key, value) in md.sendable() {
        let Ok(name) = http::HeaderName::from_bytes(key.as_bytes()) else { continue };
        let value = if crate::metadata::is_binary_key(key) {
            HeaderValue::from_str(&encode_base64(value))
        } else {
            HeaderValue::from_bytes(value)
        };
        if let Ok(v) = value {
            headers.append(name, v);
        }
    }
}

/// The trailers that end a response with `status` (and its metadata).
pub(crate) fn status_trailers(status: &Status) -> HeaderMap {
    if status.code() == Code::Ok && status.message().is_empty() && status.details().is_empty() {
        return ok_trailers(Some(status.metadata()));
    }
    let mut t = HeaderMap::new();
    metadata_into(status.metadata(), &mut t);
    t.insert(GRPC_STATUS, HeaderValue::from(status.code() as u32));
    if !status.message().is_empty() {
        let encoded = percent_encode(status.message());
        if let Ok(v) = HeaderValue::from_str(&encoded) {
            t.insert(GRPC_MESSAGE, v);
        }
    }
    if !status.details().is_empty() {
        if let Ok(v) = HeaderValue::from_str(&encode_base64(status.details())) {
            t.insert(GRPC_STATUS_DETAILS, v);
        }
    }
    t
}

/// gRPC's own header names, made once: looking one up by `&str` parses the name on every call.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
pub(crate) const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
pub(crate) const GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
pub(crate) const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The trailers of a call that ended with OK: `metadata`, and `grpc-status: 0`.
pub(crate) fn ok_trailers(metadata: Option<&MetadataMap>) -> HeaderMap {
    let mut t = HeaderMap::new();
    if let Some(md) = metadata {
        metadata_into(md, &mut t);
    }
    t.insert(GRPC_STATUS, HeaderValue::from_static("0"));
    t
}

/// tonic's words when its codec refuses a message over a limit (`max_decoding_message_size`,
/// `max_encoding_message_size`), which it says with OUT_OF_RANGE; they go on
/// `": found N bytes, the limit is: M bytes"`.
pub(crate) const TONIC_TOO_LARGE: [&str; 2] =
    ["Error, decoded message length too large", "Error, encoded message length too large"];

/// Whether a status of `code` and `message` is tonic's refusal of a message over a limit, in
/// tonic's words to the last one, which gRPC names RESOURCE_EXHAUSTED (grpc-go and grpc-core
/// do).
pub(crate) fn tonic_too_large(code: Code, message: &str) -> bool {
    code == Code::OutOfRange && tonic_refusal(message).is_some()
}

/// tonic's refusal in `message`, to the last word: whether of a message it decoded (received),
/// the message's size and the limit, as written.
pub(crate) fn tonic_refusal(message: &str) -> Option<(bool, &str, &str)> {
    fn number_then<'a>(s: &'a str, then: &str) -> Option<(&'a str, &'a str)> {
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0).then(|| s[digits..].strip_prefix(then).map(|rest| (&s[..digits], rest))).flatten()
    }
    TONIC_TOO_LARGE.iter().enumerate().find_map(|(i, words)| {
        let rest = message.strip_prefix(words)?.strip_prefix(": found ")?;
        let (size, rest) = number_then(rest, " bytes, the limit is: ")?;
        let (limit, rest) = number_then(rest, " bytes")?;
        rest.is_empty().then_some((i == 0, size, limit))
    })
}

/// `status`, with gRPC's code if it is tonic's refusal of a message over a limit: what a tonic
/// service served through isthmus answers, over `shm://` as over HTTP/2.
pub(crate) fn too_large_code(status: Status) -> Status {
    if !tonic_too_large(status.code(), status.message()) {
        return status;
    }
    Status::new(Code::ResourceExhausted, status.message().to_owned())
        .with_details(status.details().clone())
        .with_metadata(status.metadata().clone())
}

/// The same for a status in `headers` (trailers, or a trailers-only response's headers): its
/// `grpc-status` becomes RESOURCE_EXHAUSTED; the rest stays as tonic wrote it.
pub(crate) fn too_large_code_in(headers: &mut HeaderMap) {
    let out_of_range = headers.get(GRPC_STATUS).is_some_and(|c| c == "11");
    if out_of_range
        && headers.get(GRPC_MESSAGE).is_some_and(|m| tonic_too_large(Code::OutOfRange, &percent_decode(m.as_bytes())))
    {
        headers.insert(GRPC_STATUS, HeaderValue::from(Code::ResourceExhausted as u32));
    }
}

/// The status in trailers (or in the headers of a trailers-only response), if there is one.
pub(crate) fn status_from(headers: &HeaderMap) -> Option<Status> {
    let code = headers.get(GRPC_STATUS)?;
    let code = code.to_str().ok().and_then(|c| c.parse::<u32>().ok()).map_or(Code::Unknown, Code::from_u32);
    let mut status = Status::new(code, status_message(headers));
    if let Some(d) = headers.get(GRPC_STATUS_DETAILS).and_then(|d| decode_base64(d.as_bytes())) {
        status = status.with_details(d);
    }
    match metadata_from(headers) {
        Ok(md) if !md.is_empty() => Some(status.with_metadata(md)),
        Ok(_) => Some(status),
        Err(e) => Some(Status::new(Code::Internal, format!("trailers with invalid metadata: {}", e.message()))),
    }
}

/// The status message in `headers` (`grpc-message`, percent-decoded); empty if there is none.
pub(crate) fn status_message(headers: &HeaderMap) -> String {
    headers.get(GRPC_MESSAGE).map(|m| percent_decode(m.as_bytes())).unwrap_or_default()
}

/// tonic's base64 for status details (its `util::base64::STANDARD`): `decode_base64` is
/// more lenient (trailing bits), and what it takes tonic may still refuse.
const TONICS_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

/// A peer's status headers (a trailers-only response's headers, or trailers) made readable by
/// tonic, which reads them strictly: `grpc-status-details-bin` that is not base64 is dropped
/// (tonic panics on it), and a `grpc-message` that is not UTF-8 once percent-decoded is kept
/// with U+FFFD in place of the bad bytes (tonic replaces the status's code with UNKNOWN; the
/// spec says a message that does not decode must not be thrown away).
pub(crate) fn conform_status(headers: &mut HeaderMap) {
    use base64::Engine as _;
    if headers.get(GRPC_STATUS_DETAILS).is_some_and(|d| TONICS_BASE64.decode(d.as_bytes()).is_err()) {
        headers.remove(GRPC_STATUS_DETAILS);
    }
    let unreadable = headers
        .get(GRPC_MESSAGE)
        .is_some_and(|m| percent_encoding::percent_decode(m.as_bytes()).decode_utf8().is_err());
    if unreadable {
        let message = status_message(headers);
        match HeaderValue::from_str(&percent_encode(&message)) {
            Ok(value) => headers.insert(GRPC_MESSAGE, value),
            Err(_) => headers.remove(GRPC_MESSAGE),
        };
    }
}

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable ASCII, and `%`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(b: &[u8]) -> String {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub(crate) fn encode_base64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(BASE64[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// Standard base64, padded or not; `None` if it is not base64.
fn decode_base64(text: &[u8]) -> Option<Vec<u8>> {
    let text = text.strip_suffix(b"==").or_else(|| text.strip_suffix(b"=")).unwrap_or(text);
    if text.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            let v = BASE64.iter().position(|&b| b == c)? as u32;
            n |= v << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut_from_any_split_of_the_body() {
        let mut body = Vec::new();
        let messages: Vec<Vec<u8>> = vec![vec![], vec![1, 2, 3], vec![9; 70_000]];
        for m in &messages {
            body.extend_from_slice(&prefix(m.len()).expect("prefix"));
            body.extend_from_slice(m);
        }
        for step in [1, 2, 5, 7, 4096, body.len()] {
            let mut d = Deframer::new(1 << 20);
            let mut got = Vec::new();
            for piece in body.chunks(step) {
                d.push(Bytes::copy_from_slice(piece));
                while let Some(m) = d.next().expect("well-formed") {
                    got.push(m.to_vec());
                }
            }
            assert_eq!(got, messages, "split every {step} bytes");
            assert!(d.is_empty());
        }
    }

    #[test]
    fn a_message_in_many_frames_holds_none_of_them() {
        // Frames are slices of the connection's read buffer; one kept per byte of a message
        // sent a byte per frame kept that whole buffer alive, and a queue entry, per byte.
        let read_buffer = Bytes::from(vec![7u8; 64 << 10]);
        let mut d = Deframer::new(1 << 20);
        d.push(Bytes::copy_from_slice(&prefix(1000).expect("prefix")));
        for i in 0..999 {
            d.push(read_buffer.slice(i..i + 1));
            assert_eq!(d.next().expect("well-formed"), None);
        }
        assert!(read_buffer.is_unique(), "a frame of the read buffer is still held");
        d.push(read_buffer.slice(0..1));
        assert_eq!(d.next().expect("well-formed").expect("the message"), vec![7u8; 1000]);
        assert!(d.is_empty());
        // A frame of whole messages is cut in place, not copied.
        let mut body = prefix(3).expect("prefix").to_vec();
        body.extend_from_slice(b"abc");
        let frame = Bytes::from(body);
        let mut d = Deframer::new(1 << 20);
        d.push(frame.clone());
        let message = d.next().expect("well-formed").expect("the message");
        assert_eq!(message.as_ptr(), frame[5..].as_ptr());
    }

    #[test]
    fn oversize_and_unagreed_compressed_messages_are_refused() {
        let mut d = Deframer::new(10);
        d.push(Bytes::from_static(&[0, 0, 0, 0, 11]));
        assert_eq!(d.next().expect_err("too large").code(), Code::ResourceExhausted);
        let mut d = Deframer::new(10);
        d.push(Bytes::from_static(&[1, 0, 0, 0, 1, 7]));
        assert_eq!(d.next().expect_err("compressed, no encoding").code(), Code::Internal);
        let mut d = Deframer::new(10).with_encoding(Some(Encoding::Gzip));
        d.push(Bytes::from_static(&[2, 0, 0, 0, 1, 7]));
        assert_eq!(d.next().expect_err("flag 2").code(), Code::Internal);
    }

    fn compressed(encoding: Encoding, message: &[u8]) -> Bytes {
        use std::io::Write;
        let body = match encoding {
            Encoding::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(message).expect("gzip");
                e.finish().expect("gzip")
            }
            Encoding::Deflate => {
                let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(message).expect("zlib");
                e.finish().expect("zlib")
            }
        };
        let mut framed = vec![1];
        framed.extend_from_slice(&u32::try_from(body.len()).expect("small").to_be_bytes());
        framed.extend_from_slice(&body);
        Bytes::from(framed)
    }

    #[test]
    fn gzip_and_deflate_messages_are_inflated_within_the_limit() {
        let message = b"hello, compressed world; hello, compressed world".repeat(20);
        for encoding in [Encoding::Gzip, Encoding::Deflate] {
            let framed = compressed(encoding, &message);
            // Cut across frames, and beside an uncompressed message in the same body.
            let mut d = Deframer::new(message.len()).with_encoding(Some(encoding));
            for piece in framed.chunks(3) {
                d.push(Bytes::copy_from_slice(piece));
            }
            d.push(Bytes::from_static(&[0, 0, 0, 0, 2, 8, 9]));
            assert_eq!(d.next().expect("inflates").expect("whole"), Bytes::from(message.clone()));
            assert_eq!(d.next().expect("plain").expect("whole"), Bytes::from_static(&[8, 9]));
            assert!(d.is_empty());

            // A message that inflates past the limit stops at it: a bomb grows no further.
            let mut d = Deframer::new(message.len() - 1).with_encoding(Some(encoding));
            d.push(framed.clone());
            let e = d.next().expect_err("over the limit once inflated");
            assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
            assert!(e.message().contains(&format!("limit of {} bytes", message.len() - 1)), "{e:?}");

            // Bytes that are not the encoding's are INTERNAL, not a panic.
            let mut d = Deframer::new(1000).with_encoding(Some(encoding));
            d.push(Bytes::from_static(&[1, 0, 0, 0, 4, 0xde, 0xad, 0xbe, 0xef]));
            assert_eq!(d.next().expect_err("not gzip").code(), Code::Internal);
        }
    }

    #[test]
    fn grpc_encoding_is_read_and_unknown_ones_are_unimplemented() {
        let mut h = HeaderMap::new();
        assert_eq!(Encoding::from_headers(&h).expect("none"), None);
        for (value, want) in [("identity", None), ("gzip", Some(Encoding::Gzip)), ("deflate", Some(Encoding::Deflate))]
        {
            h.insert("grpc-encoding", HeaderValue::from_static(value));
            assert_eq!(Encoding::from_headers(&h).expect(value), want);
        }
        h.insert("grpc-encoding", HeaderValue::from_static("snappy"));
        let e = Encoding::from_headers(&h).expect_err("snappy");
        assert_eq!(e.code(), Code::Unimplemented);
        assert!(e.message().contains("snappy") && e.message().contains(ACCEPT_ENCODING), "{e:?}");
    }

    #[test]
    fn tonics_refusal_of_a_message_too_large_gets_grpcs_code_and_nothing_else_does() {
        let words = "Error, decoded message length too large: found 5242880 bytes, the limit is: 4194304 bytes";
        assert_eq!(tonic_refusal(words), Some((true, "5242880", "4194304")));
        let refused = tonic::Status::out_of_range(words);
        // As tonic writes it: trailers (or a trailers-only response's headers), message encoded.
        let mut headers = HeaderMap::new();
        refused.add_header(&mut headers).expect("headers");
        assert!(headers.get("grpc-message").is_some_and(|m| m.as_bytes().windows(3).any(|w| w == b"%20")));
        too_large_code_in(&mut headers);
        let status = status_from(&headers).expect("a status");
        assert_eq!((status.code(), status.message()), (Code::ResourceExhausted, words));
        let sent = "Error, encoded message length too large: found 9 bytes, the limit is: 8 bytes";
        assert_eq!(too_large_code(Status::new(Code::OutOfRange, sent)).code(), Code::ResourceExhausted);
        // An application's own OUT_OF_RANGE, tonic's words cut short or followed by more, and
        // tonic's words under another code, stay.
        let cut = "Error, decoded message length too large: found 5242880 bytes";
        let more = format!("{words}, said the backend");
        for (code, message) in [
            (Code::OutOfRange, "page 9 of 3"),
            (Code::OutOfRange, cut),
            (Code::OutOfRange, more.as_str()),
            (Code::OutOfRange, "Error, decoded message length too large: found many bytes, the limit is: 4 bytes"),
            (Code::Internal, words),
        ] {
            let mut headers = status_trailers(&Status::new(code, message));
            too_large_code_in(&mut headers);
            assert_eq!(status_from(&headers).expect("a status").code(), code);
            assert_eq!(too_large_code(Status::new(code, message)).code(), code);
        }
    }

    /// The spec: a value that is a valid HTTP field value but not gRPC's must not fail the call
    /// (it is dropped here), and binary values a proxy joined with `,` are split before they
    /// are decoded. One entry this side cannot read failed a request INVALID_ARGUMENT, and
    /// lost a response all its metadata.
    #[test]
    fn metadata_a_peer_may_send_is_read_entry_by_entry() {
        let mut h = HeaderMap::new();
        h.insert("x-ok", HeaderValue::from_static("1"));
        h.insert("x-note", HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"));
        h.insert("x!y", HeaderValue::from_static("1"));
        h.insert("x-b-bin", HeaderValue::from_static("AAEC, AwQ"));
        let md = metadata_from(&h).expect("read");
        assert_eq!(md.get("x-ok"), Some("1"));
        assert_eq!(md.get_all("x-b-bin").collect::<Vec<_>>(), [&[0u8, 1, 2][..], &[3, 4]]);
        assert_eq!(md.len(), 3, "{md:?}");
        h.insert("x-bad-bin", HeaderValue::from_static("!!!"));
        assert_eq!(metadata_from(&h).map_err(|s| s.code()).err(), Some(Code::Internal));
        let md = metadata_from_server(&h);
        assert_eq!((md.get("x-ok"), md.get_all("x-b-bin").count(), md.len()), (Some("1"), 2, 3));
    }

    #[test]
    fn timeouts_round_trip_in_eight_digits() {
        for t in [Duration::from_nanos(1), Duration::from_millis(1500), Duration::from_secs(86_400 * 400)] {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", timeout_value(t));
            let back = timeout_from(&h).expect("parses").expect("present");
            assert!(back >= t && back <= t + t / 10_000_000 + Duration::from_secs(3600), "{t:?} -> {back:?}");
        }
        for bad in ["", "1", "123456789S", "10x", "-1S"] {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(bad).unwrap_or(HeaderValue::from_static("?")));
            assert!(timeout_from(&h).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn status_and_metadata_survive_headers() {
        let mut md = MetadataMap::new();
        md.append("x-a", "1").expect("ascii");
        md.append_bin("x-b-bin", vec![0u8, 255, 7, 8]).expect("bin");
        let status = Status::new(Code::Aborted, "naïve 100% \n").with_details(vec![1u8, 2, 3, 4, 5]).with_metadata(md);
        let back = status_from(&status_trailers(&status)).expect("a status");
        assert_eq!(
            (back.code(), back.message(), &back.details()[..]),
            (Code::Aborted, "naïve 100% \n", &[1u8, 2, 3, 4, 5][..])
        );
        assert_eq!(back.metadata().get("x-a"), Some("1"));
        assert_eq!(back.metadata().get_bin("x-b-bin"), Some(&[0u8, 255, 7, 8][..]));
        for n in 0..40 {
            let data: Vec<u8> = (0..n).map(|i| (i * 37) as u8).collect();
            assert_eq!(decode_base64(encode_base64(&data).as_bytes()), Some(data.clone()));
            let padded = format!("{}{}", encode_base64(&data), "=".repeat((4 - encode_base64(&data).len() % 4) % 4));
            assert_eq!(decode_base64(padded.as_bytes()), Some(data));
        }
        assert_eq!(decode_base64(b"a"), None);
        assert_eq!(decode_base64(b"ab*d"), None);
    }
}
