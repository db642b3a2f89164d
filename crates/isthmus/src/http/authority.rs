//! Lets gRPC clients that name a unix socket as the `:authority` reach a tonic server.
//!
//! grpc-core clients (grpcio for Python among them) from 1.57 on send the socket's path,
//! %-encoded, as the `:authority` of calls over `unix:` (grpc/grpc#38142), and grpc-java sends it
//! raw. Neither is a valid URI authority, and h2, under tonic, resets such a stream with
//! PROTOCOL_ERROR before any service sees it. A client can be told to send `localhost`, but the
//! point of a unix endpoint is that any gRPC client works as it is.
//!
//! So the bytes a unix-socket client sends pass through this filter before h2 reads them: every
//! HTTP/2 header block is decoded, an `:authority` that is not a valid authority becomes
//! `localhost`, and the block is encoded again, without indexing, so h2's decoder state never
//! depends on ours. Everything else (the preface, every other frame, and everything the server
//! writes) passes through untouched. The peer is untrusted: frame and block lengths are
//! bounded, and a block that does not decode ends the connection, as h2 itself would.
//!
//! How: the preface and every frame pass through unchanged (copied once, from the bytes read to the
//! bytes handed on; each frame's payload is read in place) except header blocks, which are gathered
//! (HEADERS and its CONTINUATIONs; padding removed, priority kept), decoded with an HPACK decoder
//! that follows the client's dynamic table (`hpack.rs`), and encoded again as literals without
//! indexing, so h2's decoder table stays empty and can never disagree with ours. Frames are
//! bounded by the 16 KiB the server's settings allow (refused at their header, before their
//! payload is held); the client may not grow its table past h2's 4096 bytes. A block over 1 MiB,
//! or one that decodes to over 1 MiB, is not held: the rest of it is followed to keep the
//! client's table, only its pseudo-headers go on, with its size, and [`Deadline`] refuses that
//! call RESOURCE_EXHAUSTED; the connection and its other calls go on (grpc-go resets the
//! stream).
//!
//! Deadlines: tonic's server enforces `grpc-timeout` from outside any layer a server can add, and
//! answers an expired call with CANCELLED "Timeout expired", where gRPC and a grpcio client expect
//! DEADLINE_EXCEEDED. So the filter also renames `grpc-timeout` to `x-isthmus-grpc-timeout` on the
//! way in, tonic's timer never starts, and `DeadlineLayer` puts the header back for the service and
//! answers DEADLINE_EXCEEDED ("Deadline Exceeded") when the response is not ready in time.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::http::hpack::{Outcome, Overflow};

/// Where a client's `grpc-timeout` travels between this filter and the deadline layer.
pub(crate) const DEADLINE_HEADER: &str = "x-isthmus-grpc-timeout";

const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 peer accepts before settings say otherwise.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this (after its CONTINUATIONs), or whose header list, decoded, is
/// larger (counted as HTTP/2's SETTINGS_MAX_HEADER_LIST_SIZE counts it: each field's name and
/// value, and 32), fails its call RESOURCE_EXHAUSTED. The server advertises it as that setting,
/// so a client that keeps to it never meets either bound.
pub(crate) const MAX_BLOCK: usize = 1 << 20;
/// A header block is followed (not held) past [`MAX_BLOCK`] up to this, grpc-go's default
/// header list bound four times over; a client that sends more ends its connection.
const MAX_FOLLOWED: usize = 64 << 20;
/// The dynamic table a client's HPACK encoder may use: the SETTINGS_HEADER_TABLE_SIZE h2
/// announces (its default). A hostile client cannot make the filter hold more.
pub(crate) const HEADER_TABLE: usize = 4096;

/// Where the filter tells [`Deadline`] that a call's header list was too large to pass on: its
/// size, as HTTP/2 counts it. A client's own field of this name is dropped.
pub(crate) const TOO_LARGE_HEADER: &str = "x-isthmus-header-list-too-large";

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Block {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// Once the block is larger than [`MAX_BLOCK`]: it is followed, not held, and only its
    /// pseudo-headers will go on.
    over: Option<(Overflow, Rewritten)>,
    /// Its frames' bytes so far, headers included.
    followed: usize,
}

/// A header block's fields as they go on to h2, and how many of its bytes are the
/// pseudo-headers (all that goes on of a call refused for its size).
#[derive(Default)]
struct Rewritten {
    encoded: Vec<u8>,
    pseudo_end: usize,
    regular_seen: bool,
    /// Only the request's pseudo-headers are wanted, the first of each (a client can name a
    /// 4 KB entry of its table again for one byte: it must not make the filter hold more).
    refusing: bool,
    /// Which of [`REQUEST_PSEUDO`] went on while refusing.
    kept: u8,
}

/// The pseudo-headers of a request that a refused call keeps, so that h2 takes its stream.
const REQUEST_PSEUDO: [&[u8]; 4] = [b":method", b":scheme", b":path", b":authority"];

impl Rewritten {
    fn field(&mut self, name: &[u8], value: &[u8]) {
        if name == TOO_LARGE_HEADER.as_bytes() {
            return;
        }
        if self.refusing {
            let Some(i) = REQUEST_PSEUDO.iter().position(|p| *p == name) else { return };
            if self.kept & (1 << i) != 0 {
                return;
            }
            self.kept |= 1 << i;
        }
        let pseudo = !self.regular_seen && name.starts_with(b":");
        self.regular_seen |= !pseudo;
        let value = if name == b":authority" && !valid_authority(value) { b"localhost" } else { value };
        // The deadline goes around tonic's own timer, which would answer CANCELLED; the
        // endpoint's deadline layer puts it back and answers DEADLINE_EXCEEDED.
        let name = if name == b"grpc-timeout" { DEADLINE_HEADER.as_bytes() } else { name };
        literal(&mut self.encoded, name, value);
        if pseudo {
            self.pseudo_end = self.encoded.len();
        }
    }

    /// The call's header list was `list` bytes, too many to pass on: its pseudo-headers go on
    /// (the call reaches its route), with the size, for [`Deadline`] to refuse the call.
    fn refuse(&mut self, list: usize) {
        self.refusing = true;
        self.encoded.truncate(self.pseudo_end);
        literal(&mut self.encoded, b"content-type", b"application/grpc");
        literal(&mut self.encoded, TOO_LARGE_HEADER.as_bytes(), list.to_string().as_bytes());
    }
}

/// An accepted stream whose inbound header blocks get a valid `:authority`.
pub(crate) struct AuthorityFix<S> {
    io: S,
    decoder: crate::http::hpack::Decoder,
    /// Bytes read from the peer, not yet looked at.
    raw: Vec<u8>,
    /// Bytes ready for h2.
    out: Vec<u8>,
    out_at: usize,
    preface_left: usize,
    block: Option<Block>,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    pub(crate) fn new(io: S) -> AuthorityFix<S> {
        AuthorityFix {
            io,
            decoder: crate::http::hpack::Decoder::new(HEADER_TABLE),
            raw: Vec::new(),
            out: Vec::new(),
            out_at: 0,
            preface_left: PREFACE_LEN,
            block: None,
            eof: false,
        }
    }

    pub(crate) fn get_ref(&self) -> &S {
        &self.io
    }

    /// Moves every whole frame from `raw` to `out`, rewriting header blocks.
    fn process(&mut self) -> io::Result<()> {
        // Taken out while frames are read from it, so header payloads need no copy of their own.
        let mut raw = std::mem::take(&mut self.raw);
        let mut at = 0;
        if self.preface_left > 0 {
            let n = self.preface_left.min(raw.len());
            self.out.extend_from_slice(&raw[..n]);
            self.preface_left -= n;
            at = n;
        }
        while self.preface_left == 0 && raw.len() - at >= FRAME_HEADER_LEN {
            let h = &raw[at..at + FRAME_HEADER_LEN];
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            if len > MAX_FRAME {
                // The server's SETTINGS_MAX_FRAME_SIZE is the default: h2 would refuse the frame
                // at this header too (FRAME_SIZE_ERROR), so none of it is held.
                return Err(bad("a frame over the 16 KiB the server allows"));
            }
            if raw.len() - at < FRAME_HEADER_LEN + len {
                break;
            }
            let frame_end = at + FRAME_HEADER_LEN + len;
            let payload = &raw[at + FRAME_HEADER_LEN..frame_end];
            match kind {
                HEADERS => self.headers(stream, flags, payload)?,
                CONTINUATION => self.continuation(stream, flags, payload)?,
                _ if self.block.is_some() => {
                    return Err(bad("a frame other than CONTINUATION inside a header block"));
                }
                _ => self.out.extend_from_slice(&raw[at..frame_end]),
            }
            at = frame_end;
        }
        raw.drain(..at);
        self.raw = raw;
        Ok(())
    }

    fn headers(&mut self, stream: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        if self.block.is_some() {
            return Err(bad("HEADERS inside a header block"));
        }
        let mut body = payload;
        if flags & PADDED != 0 {
            let (&pad, rest) = body.split_first().ok_or_else(|| bad("PADDED HEADERS without its pad length"))?;
            let keep = rest.len().checked_sub(usize::from(pad)).ok_or_else(|| bad("HEADERS padding too long"))?;
            body = &rest[..keep];
        }
        let mut priority = None;
        if flags & PRIORITY != 0 {
            let p: [u8; 5] = body.get(..5).and_then(|p| p.try_into().ok()).ok_or_else(|| bad("short PRIORITY"))?;
            priority = Some(p);
            body = &body[5..];
        }
        self.block = Some(Block {
            stream,
            flags,
            priority,
            fragment: body.to_vec(),
            over: None,
            followed: FRAME_HEADER_LEN + payload.len(),
        });
        if flags & END_HEADERS != 0 {
            self.finish_block()?;
        }
        Ok(())
    }

    fn continuation(&mut self, stream: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        let block = self.block.as_mut().ok_or_else(|| bad("CONTINUATION outside a header block"))?;
        if block.stream != stream {
            return Err(bad("CONTINUATION on another stream"));
        }
        // Frames count with their headers: empty CONTINUATIONs are not free.
        block.followed += FRAME_HEADER_LEN + payload.len();
        if let Some((over, kept)) = block.over.as_mut() {
            if block.followed > MAX_FOLLOWED {
                return Err(bad("a header block over 64 MiB"));
            }
            over.feed(&mut self.decoder, payload, |n, v| kept.field(n, v)).map_err(undecodable)?;
        } else if block.followed > MAX_BLOCK {
            // Too large to hold: followed from here on, so the connection's other calls go on.
            let mut over = Overflow::default();
            let mut kept = Rewritten { refusing: true, ..Rewritten::default() };
            for piece in [&block.fragment[..], payload] {
                over.feed(&mut self.decoder, piece, |n, v| kept.field(n, v)).map_err(undecodable)?;
            }
            block.fragment = Vec::new();
            block.over = Some((over, kept));
        } else {
            block.fragment.extend_from_slice(payload);
        }
        if flags & END_HEADERS != 0 {
            self.finish_block()?;
        }
        Ok(())
    }

    /// Decodes the gathered block, fixes `:authority`, and writes it out again; or, for a block
    /// too large to pass on, writes its pseudo-headers and its size for [`Deadline`] to refuse
    /// the call with.
    fn finish_block(&mut self) -> io::Result<()> {
        let Some(block) = self.block.take() else { return Ok(()) };
        let encoded = match block.over {
            Some((over, mut kept)) => {
                kept.refuse(over.finish().map_err(undecodable)?);
                kept.encoded
            }
            None => {
                let mut kept =
                    Rewritten { encoded: Vec::with_capacity(block.fragment.len() + 16), ..Rewritten::default() };
                // Decoded, a block can be far larger than it is: a field indexed in the
                // client's table costs one byte each time it is named again (a 62 KB block
                // made this filter write 240 MB before). What it decodes to is bounded too:
                // past the bound the rest is only counted.
                let outcome =
                    self.decoder.decode(&block.fragment, MAX_BLOCK, |n, v| kept.field(n, v)).map_err(undecodable)?;
                if let Outcome::Over(over) = outcome {
                    kept.refuse(over.finish().map_err(undecodable)?);
                }
                kept.encoded
            }
        };
        // HEADERS, then CONTINUATIONs, each within the default frame size.
        let mut first_len = MAX_FRAME;
        let mut head = Vec::new();
        let mut flags = block.flags & !(PADDED | END_HEADERS);
        if let Some(p) = block.priority {
            head.extend_from_slice(&p);
            first_len -= p.len();
        } else {
            flags &= !PRIORITY;
        }
        let (first, mut rest) = encoded.split_at(first_len.min(encoded.len()));
        let end = if rest.is_empty() { END_HEADERS } else { 0 };
        head.extend_from_slice(first);
        frame(&mut self.out, HEADERS, flags | end, block.stream, &head);
        while !rest.is_empty() {
            let (piece, more) = rest.split_at(MAX_FRAME.min(rest.len()));
            let end = if more.is_empty() { END_HEADERS } else { 0 };
            frame(&mut self.out, CONTINUATION, end, block.stream, piece);
            rest = more;
        }
        Ok(())
    }
}

/// A block that does not decode ends the connection: the decoder's table is in no known state.
fn undecodable(e: crate::http::hpack::Error) -> io::Error {
    bad(&format!("header block does not decode: {e:?}"))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 from a unix-socket client: {what}"))
}

fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// HPACK "literal header field without indexing, new name", no Huffman coding.
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    string(out, name);
    string(out, value);
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    integer(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// HPACK integer with an `n`-bit prefix under `high` (RFC 7541 §5.1).
fn integer(out: &mut Vec<u8>, mut v: usize, n: u32, high: u8) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(high | v as u8);
        return;
    }
    out.push(high | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_at);
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 16 * 1024];
            let mut rb = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.raw.extend_from_slice(rb.filled());
            this.process()?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for AuthorityFix<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.get_ref().connect_info()
    }
}

/// Enforces a call's deadline on an HTTP/2 endpoint with gRPC's code. tonic's server answers an
/// expired `grpc-timeout` with CANCELLED ("Timeout expired"), from outside any layer a server
/// can add; [`AuthorityFix`] renames the header on the way in so tonic's timer never sees it,
/// and this layer restores it (handlers read it as before) and answers DEADLINE_EXCEEDED. It also
/// refuses, RESOURCE_EXHAUSTED, a call whose header list the filter found too large.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeadlineLayer;

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline(inner)
    }
}

/// The service [`DeadlineLayer`] makes.
#[derive(Debug, Clone)]
pub(crate) struct Deadline<S>(S);

type Responding<E> = Pin<Box<dyn std::future::Future<Output = Result<http::Response<tonic::body::Body>, E>> + Send>>;

impl<S, B> tower_service::Service<http::Request<B>> for Deadline<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Responding<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if let Some(list) = request.headers().get(TOO_LARGE_HEADER) {
            // Only the filter sets it (it drops a client's own): the call's header list was too
            // large to pass on. grpc-core says RESOURCE_EXHAUSTED too.
            let message = format!(
                "header list of {} bytes is larger than this server's limit of {MAX_BLOCK} bytes",
                String::from_utf8_lossy(list.as_bytes())
            );
            return Box::pin(std::future::ready(Ok(tonic::Status::resource_exhausted(message).into_http())));
        }
        let refuse = |s: crate::Status| {
            let refused = tonic::Status::new(tonic::Code::Internal, s.message().to_owned());
            Box::pin(std::future::ready(Ok(refused.into_http()))) as Self::Future
        };
        // Whatever serves the method, as grpc-go's server (tonic's services read their
        // metadata lazily, and ran the call).
        if let Err(s) = crate::http::codec::check_binary_metadata(request.headers()) {
            return refuse(s);
        }
        let mut timeout = None;
        if let Some(v) = request.headers_mut().remove(DEADLINE_HEADER) {
            let mut h = http::HeaderMap::new();
            h.insert(crate::http::codec::GRPC_TIMEOUT, v.clone());
            // One that does not parse fails the call, as grpc-go's server fails it, whatever
            // serves the method: tonic's services ran it with no deadline at all.
            match crate::http::codec::timeout_from(&h) {
                Ok(t) => timeout = t,
                Err(s) => return refuse(s),
            }
            request.headers_mut().insert(crate::http::codec::GRPC_TIMEOUT, v);
        }
        let responding = self.0.call(request);
        Box::pin(async move {
            match timeout {
                None => responding.await,
                Some(t) => match tokio::time::timeout(t, responding).await {
                    Ok(r) => r,
                    Err(_) => Ok(tonic::Status::deadline_exceeded(crate::status::DEADLINE_EXCEEDED).into_http()),
                },
            }
        })
    }
}

/// Feeds `data` to a filter in pieces of the sizes its first byte picks; never panics.
pub(crate) fn fuzz(data: &[u8]) {
    let Some((&step, rest)) = data.split_first() else { return };
    let mut f = AuthorityFix::new(());
    let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    input.extend_from_slice(rest);
    for piece in input.chunks(usize::from(step).max(1)) {
        f.raw.extend_from_slice(piece);
        if f.process().is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::hpack::FIELD_OVERHEAD;

    /// A client's bytes: the preface, a SETTINGS frame, one header block split over HEADERS and
    /// CONTINUATION (padded, with priority), a DATA frame.
    fn client_bytes(authority: &[u8]) -> Vec<u8> {
        let mut block = Vec::new();
        for (n, v) in
            [(&b":method"[..], &b"POST"[..]), (b":scheme", b"http"), (b":path", b"/a.B/C"), (b":authority", authority)]
        {
            literal(&mut block, n, v);
        }
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, 0x4, 0, 0, &[]);
        let (a, b) = block.split_at(10);
        let mut headers = vec![2u8]; // pad length
        headers.extend_from_slice(&[0, 0, 0, 0, 16]); // priority
        headers.extend_from_slice(a);
        headers.extend_from_slice(&[0, 0]); // padding
        frame(&mut bytes, HEADERS, PADDED | PRIORITY, 1, &headers);
        frame(&mut bytes, CONTINUATION, END_HEADERS, 1, b);
        frame(&mut bytes, 0x0, 0x1, 1, b"payload");
        bytes
    }

    fn filter(input: &[u8], step: usize) -> io::Result<Vec<u8>> {
        let mut f = AuthorityFix::new(());
        for piece in input.chunks(step) {
            f.raw.extend_from_slice(piece);
            f.process()?;
        }
        Ok(std::mem::take(&mut f.out))
    }

    fn decoded_headers(out: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let frames = &out[PREFACE_LEN..];
        let mut at = 0;
        let mut block = Vec::new();
        while at + FRAME_HEADER_LEN <= frames.len() {
            let len =
                (usize::from(frames[at]) << 16) | (usize::from(frames[at + 1]) << 8) | usize::from(frames[at + 2]);
            let (kind, flags) = (frames[at + 3], frames[at + 4]);
            let p = &frames[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + len];
            if kind == HEADERS {
                block.extend_from_slice(if flags & PRIORITY != 0 { &p[5..] } else { p });
            } else if kind == CONTINUATION {
                block.extend_from_slice(p);
            }
            at += FRAME_HEADER_LEN + len;
        }
        let mut fields = Vec::new();
        crate::http::hpack::Decoder::new(HEADER_TABLE)
            .decode(&block, usize::MAX, |n, v| fields.push((n.to_vec(), v.to_vec())))
            .expect("re-encoded block decodes");
        fields
    }

    #[test]
    fn an_invalid_authority_becomes_localhost_and_the_rest_survives() {
        for authority in [&b"%2Ftmp%2Fx.sock"[..], b"/var/run/x.sock"] {
            for step in [1, 3, 7, 1000] {
                let out = filter(&client_bytes(authority), step).expect("filters");
                let headers = decoded_headers(&out);
                assert!(headers.contains(&(b":authority".to_vec(), b"localhost".to_vec())), "step {step}");
                assert!(headers.contains(&(b":path".to_vec(), b"/a.B/C".to_vec())));
                assert!(out.ends_with(b"payload"));
            }
        }
        let out = filter(&client_bytes(b"localhost:50051"), 5).expect("filters");
        assert!(decoded_headers(&out).contains(&(b":authority".to_vec(), b"localhost:50051".to_vec())));
    }

    #[test]
    fn a_block_that_decodes_past_the_bound_goes_on_as_its_pseudo_headers_and_its_size() {
        // One 4,000-byte field into the client's table, then named again by its index (one
        // byte) 2,000 times: a 6 KB block that decodes to 8 MB.
        let mut block = Vec::new();
        for (n, v) in [(&b":method"[..], &b"POST"[..]), (b":scheme", b"http"), (b":path", b"/a.B/C")] {
            literal(&mut block, n, v);
        }
        literal(&mut block, b"content-type", b"application/grpc");
        block.push(0x40); // literal with incremental indexing, new name
        string(&mut block, b"x-big");
        string(&mut block, &[b'a'; 4000]);
        block.extend(std::iter::repeat_n(0x80 | 62, 2000)); // indexed: the table's newest entry
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, HEADERS, END_HEADERS, 1, &block);
        let out = filter(&bytes, 4096).expect("the connection goes on");
        let list = 3 * FIELD_OVERHEAD + 33 + (12 + 16 + FIELD_OVERHEAD) + 2001 * (5 + 4000 + FIELD_OVERHEAD);
        assert_eq!(
            decoded_headers(&out),
            [
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), b"/a.B/C".to_vec()),
                (b"content-type".to_vec(), b"application/grpc".to_vec()),
                (TOO_LARGE_HEADER.as_bytes().to_vec(), list.to_string().into_bytes()),
            ]
        );
        assert!(out.len() < 200, "what was written of it: {} bytes", out.len());
        // At the bound itself the block goes through.
        let fields = (MAX_BLOCK - 3 * 100 - 60) / (5 + 4000 + FIELD_OVERHEAD);
        let mut block = block[..block.len() - 2000].to_vec();
        block.extend(std::iter::repeat_n(0x80 | 62, fields - 1));
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, HEADERS, END_HEADERS, 1, &block);
        assert_eq!(decoded_headers(&filter(&bytes, 4096).expect("within the bound")).len(), 4 + fields);
    }

    #[test]
    fn a_block_over_1_mib_is_followed_not_held_and_the_next_block_decodes() {
        // 2 MiB of metadata over HEADERS and 128 CONTINUATIONs, with an entry for the client's
        // table after it; then another call that names that entry.
        let mut block = Vec::new();
        for (n, v) in [(&b":method"[..], &b"POST"[..]), (b":scheme", b"http"), (b":path", b"/a.B/C")] {
            literal(&mut block, n, v);
        }
        literal(&mut block, b"x-large-bin", &vec![7u8; 2 << 20]);
        block.push(0x40);
        string(&mut block, b"x-kept");
        string(&mut block, b"in the table");
        literal(&mut block, TOO_LARGE_HEADER.as_bytes(), b"1"); // a client's own: dropped
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut pieces = block.chunks(MAX_FRAME).peekable();
        let first = pieces.next().expect("a first piece");
        frame(&mut bytes, HEADERS, if pieces.peek().is_none() { END_HEADERS } else { 0 }, 1, first);
        while let Some(piece) = pieces.next() {
            frame(&mut bytes, CONTINUATION, if pieces.peek().is_none() { END_HEADERS } else { 0 }, 1, piece);
        }
        frame(&mut bytes, 0x0, 0x1, 1, b"payload");
        let mut next = Vec::new();
        for (n, v) in [(&b":method"[..], &b"POST"[..]), (b":scheme", b"http"), (b":path", b"/a.B/D")] {
            literal(&mut next, n, v);
        }
        next.push(0x80 | 62); // x-kept, from the table the large block left
        frame(&mut bytes, HEADERS, END_HEADERS | 0x1, 3, &next);
        let mut f = AuthorityFix::new(());
        for piece in bytes.chunks(10_000) {
            f.raw.extend_from_slice(piece);
            f.process().expect("the connection goes on");
            // What is held: a frame, and a block up to 1 MiB, then nothing of it.
            assert!(f.raw.len() < MAX_FRAME + 10_000, "held {}", f.raw.len());
            assert!(f
                .block
                .as_ref()
                .is_none_or(|b| b.fragment.len() <= MAX_BLOCK && (b.over.is_none() || b.fragment.is_empty())));
        }
        let out = std::mem::take(&mut f.out);
        assert!(out.len() < 1000, "written: {} bytes", out.len());
        let list =
            3 * FIELD_OVERHEAD + 33 + (11 + (2 << 20) + FIELD_OVERHEAD) + (6 + 12 + FIELD_OVERHEAD) + (31 + 1 + 32);
        let fields = decoded_headers(&out);
        assert_eq!(
            fields[..5].to_vec(),
            [
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), b"/a.B/C".to_vec()),
                (b"content-type".to_vec(), b"application/grpc".to_vec()),
                (TOO_LARGE_HEADER.as_bytes().to_vec(), list.to_string().into_bytes()),
            ]
        );
        assert_eq!(fields[8..], [(b"x-kept".to_vec(), b"in the table".to_vec())]);
        assert_eq!(fields[7], (b":path".to_vec(), b"/a.B/D".to_vec()));
    }

    #[test]
    fn a_refused_block_keeps_one_of_each_pseudo_header_however_often_it_is_named() {
        // A 4,000-byte :path into the client's table, then named again by its index (one byte)
        // 1.2 million times, past 1 MiB of frames: what goes on is one :path, not 4.8 GB of them.
        let mut block = Vec::new();
        literal(&mut block, b":method", b"POST");
        block.extend([0x44, 0x7f, 0xa1, 0x1e]); // :path (static name), indexed, 4,000 bytes
        block.extend(std::iter::repeat_n(b'/', 4000));
        block.extend(std::iter::repeat_n(0x80 | 62, 1_200_000));
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut pieces = block.chunks(MAX_FRAME).peekable();
        frame(&mut bytes, HEADERS, 0, 1, pieces.next().expect("a first piece"));
        while let Some(piece) = pieces.next() {
            frame(&mut bytes, CONTINUATION, if pieces.peek().is_none() { END_HEADERS } else { 0 }, 1, piece);
        }
        let out = filter(&bytes, 100_000).expect("the connection goes on");
        assert!(out.len() < 5000, "written: {} bytes", out.len());
        let fields = decoded_headers(&out);
        assert_eq!(fields.iter().filter(|(n, _)| n == b":path").count(), 1);
        assert_eq!(fields[0], (b":method".to_vec(), b"POST".to_vec()));
        assert_eq!(fields.last().map(|(n, _)| n.as_slice()), Some(TOO_LARGE_HEADER.as_bytes()));
    }

    #[test]
    fn a_frame_over_16_kib_is_refused_at_its_header() {
        // The server allows the default frame size: a longer frame ends the connection once its
        // nine-byte header is in, none of its payload held (a client could send up to 16 MiB).
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let at = bytes.len();
        frame(&mut bytes, 0x0, 0, 1, &[0u8; MAX_FRAME + 1]);
        let mut f = AuthorityFix::new(());
        f.raw.extend_from_slice(&bytes[..at + FRAME_HEADER_LEN]);
        let err = f.process().expect_err("refused");
        assert!(err.to_string().contains("over the 16 KiB"), "{err}");
        // One of 16 KiB passes whole.
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, 0x0, 0, 1, &[7u8; MAX_FRAME]);
        assert_eq!(filter(&bytes, 1000).expect("passes"), bytes);
    }

    #[test]
    fn malformed_input_ends_the_connection_instead_of_panicking() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, CONTINUATION, END_HEADERS, 1, b"x");
        assert!(filter(&bytes, 4).is_err());
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]);
        assert!(filter(&bytes, 64).is_err());
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        frame(&mut bytes, HEADERS, END_HEADERS | PADDED, 1, &[200, 1, 2]);
        assert!(filter(&bytes, 64).is_err());
    }
}
