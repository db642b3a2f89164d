//! gRPC over HTTP/2, the way out: the `unix://` and `http://` endpoints and channels, and the
//! bridge between tonic and the engine.
//!
//! - `endpoint`: parsing targets, binding HTTP/2 listeners, connecting channels; `authority`:
//!   the filter that lets clients naming a Unix socket as `:authority` through.
//! - `call`: calls by method path over HTTP/2, carried by tonic's client ([`BytesCodec`]).
//! - `codec`: gRPC's HTTP/2 framing (the 5-byte prefix, metadata, timeout, status headers).
//! - `tonic_client` and `tonic_server`: the bridge. Generated tonic clients call over isthmus,
//!   and tonic services answer isthmus calls.
//! - `retry`: gRPC's transparent retry of a call its connection never carried to the server
//!   (a GOAWAY crossing it, a connection closed before sending it).
//!
//! Over HTTP/2, a gRPC message travels in the body with a 5-byte prefix, and metadata, deadlines
//! and status travel as headers and trailers. Over `shm://` a message is a frame of its own and
//! the rest is in the RPC frame bodies (`protocol.md` §13). The bridge converts one into the
//! other at the edge, message by message, so neither tonic nor a handler sees a difference:
//!
//! - [`Channel`](crate::Channel) is a `tower::Service` over `http::Request`s, which makes it a
//!   transport for any tonic-generated client (`FooClient::new(channel)`).
//! - [`Server::add_service`](crate::Server::add_service) takes tonic-generated servers; a call
//!   over `shm://` for one of their methods becomes an `http::Request` to them.
//!
//! Large messages are not copied on the way: a body yields the 5-byte prefix and the message's
//! own `Bytes` (a view into shared memory for a large one) as two data frames. A message of at
//! most 1 KiB is copied behind its prefix into one frame, which costs less than a second
//! allocation and frame.
//!
//! Nothing isthmus-specific is generated:
//! `FooClient::new(isthmus::Channel::connect("shm://foo").await?)` and
//! `Server::builder().add_service(FooServer::new(svc))` are the only changes to tonic code. Over
//! `unix://` and `http://` there is no conversion at all: both sides are tonic's own HTTP/2
//! transport under the isthmus types, and connecting, reconnecting and HTTP/2 itself are tonic's.
//!
//! Compression: requests compressed with gzip or deflate are read (`codec::Encoding`), and so
//! are replies a server compressed; isthmus itself sends everything uncompressed, which the gRPC
//! spec lets a sender do whatever its peer accepts.

pub(crate) mod authority;
pub(crate) mod call;
pub(crate) mod codec;
pub(crate) mod endpoint;
pub(crate) mod hpack;
mod retry;
pub(crate) mod tls;
mod tonic_client;
mod tonic_server;
pub(crate) mod x509;

pub use call::BytesCodec;
pub use tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
pub(crate) use tonic_client::Loopback;
pub use tonic_client::ResponseBody;
pub(crate) use tonic_server::{BoxService, ServiceHandler};
pub use x509::PeerCertificate;

/// The first error of type `T` in `e`'s chain of sources, `e` included: what broke under the
/// words tonic and hyper put around it.
pub(crate) fn cause<'e, T: std::error::Error + 'static>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e T> {
    let mut next = Some(e);
    while let Some(c) = next {
        if let Some(t) = c.downcast_ref::<T>() {
            return Some(t);
        }
        next = c.source();
    }
    None
}

/// Fuzzing entry: `data` as a gRPC body cut at every offset (plain, gzip and deflate), and as
/// header values.
pub(crate) fn fuzz(data: &[u8]) {
    // Plain, and with each encoding a peer may name, so that inflating (and its limit) is
    // fuzzed too.
    for encoding in [None, Some(codec::Encoding::Gzip), Some(codec::Encoding::Deflate)] {
        let mut d = codec::Deframer::new(1 << 20).with_encoding(encoding);
        for piece in data.chunks(7) {
            d.push(bytes::Bytes::copy_from_slice(piece));
            while let Ok(Some(_)) = d.next() {}
        }
    }
    if let Ok(v) = http::HeaderValue::from_bytes(data) {
        let mut h = http::HeaderMap::new();
        for name in ["grpc-timeout", "grpc-status", "grpc-message", "grpc-status-details-bin", "x-a", "x-a-bin"] {
            h.insert(name, v.clone());
        }
        let _ = codec::timeout_from(&h);
        let _ = codec::metadata_from(&h);
        let _ = codec::status_from(&h);
    }
}
