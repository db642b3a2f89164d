//! `isthmus` gives calls over [`isthmus_shm`] gRPC's meaning: a method path, metadata, a
//! deadline, a stream of messages each way, and a [`Status`] at the end.
//!
//! - [`Channel`] connects to a server and starts calls of every shape ([`Channel::unary`],
//!   [`Channel::start`] for streaming); [`ClientCall`] sends, half-closes, receives, cancels.
//! - [`Server`] registers async handlers by method path; each gets a [`ServerCall`].
//! - [`Topic`] pushes one message to many server-streaming calls (subscriptions), written once
//!   into shared memory for all of them, with a bounded queue per subscriber.
//! - [`Status`] and [`Code`] are gRPC's, with one table mapping transport failures to codes
//!   ([`Status::from_transport`]); [`MetadataMap`] holds metadata under gRPC's rules; [`wire`] is
//!   the codec of the RPC frame bodies.
//!
//! - [`blocking::Channel`] makes the same calls from plain threads, with no runtime: the calling
//!   thread reads its own reply.
//!
//! Messages are [`bytes::Bytes`] both ways. A large received message is a view into the
//! sender's shared memory, not a copy; a sender can build a message in place in its own shared
//! memory (`alloc`, then `send_block`). Every stream is flow-controlled
//! ([`INITIAL_WINDOW`]): a slow reader holds back its own writer and no other stream. Calls are
//! `tracing` spans (`isthmus.call` on the client, `isthmus.serve` on the server, at DEBUG).
//!
//! How the crate is laid out (ADR 0009); dependencies point one way, each layer using only those
//! before it:
//!
//! - [`status`], [`metadata`], `call`: gRPC's vocabulary, used by both ways: [`Code`] and
//!   [`Status`], [`MetadataMap`], [`CallOptions`] and [`Response`].
//! - [`engine`]: calls over `isthmus-shm`. The stream table of a connection and who reads it, flow
//!   control per stream, the RPC frame bodies, the async and blocking clients and the server's side
//!   of a call.
//! - [`http`]: standard gRPC over HTTP/2, through tonic: targets in gRPC's forms and listeners,
//!   TLS (rustls), gRPC's HTTP/2 framing, calls by path, tonic clients on a [`Channel`] and tonic
//!   services answering `shm://` calls.
//! - The front, `client` and `server`: [`Channel`] and [`Server`], which pick the way by target
//!   (`shm://` → engine, every other form → HTTP/2) and give one API over both; [`upgrade`]
//!   moves an HTTP/2 channel to `shm://` when its server is a local isthmus server.
//!
//! - [`connectivity`]: a channel's state in gRPC's five (IDLE, CONNECTING, READY,
//!   TRANSIENT_FAILURE, SHUTDOWN), from its connections themselves.
//! - [`binding`]: what the language bindings share (the Python extension, the C ABI): their
//!   runtime, a call two threads drive, completions for event loops, calls handed to foreign
//!   handlers.
//!
//! Bindings need nothing but this crate: besides its own types it re-exports the transport types
//! they use ([`Config`], [`PeerPolicy`], [`SpinPolicy`], [`EventFd`], [`BlockMut`] and
//! [`copy_into_shared`] and [`move_into_shared`], which fill one, the shared arena's [`SharedArena`] and
//! [`SharedBlock`]). tonic, tonic-health, tonic-reflection, h2, hyper-util, rustls and the
//! `http` crates are unconditional dependencies: the Python binding serves and calls HTTP/2
//! through them. A binding for `shm://` alone would not need them; there is no cargo feature to
//! leave them out yet.
//!
//! The hidden module `fuzz` holds the entry points of the `http2_authority`, `hpack`,
//! `grpc_http` and `x509` fuzz targets (the `:authority` filter and its HPACK decoder, gRPC
//! bodies and header values, a TLS client's certificate); `wire::fuzz` serves `rpc_wire`.

pub mod binding;
mod call;
mod client;
pub mod connectivity;
pub mod engine;
pub mod http;
pub mod metadata;
mod server;
pub mod status;
mod topic;
pub mod upgrade;

pub use self::http::{
    BytesCodec, Certificate, ClientTlsConfig, Identity, PeerCertificate, ResponseBody, ServerTlsConfig,
};
pub use call::{CallOptions, Compression, Response};
pub use client::{CallSender, Channel, ChannelBuilder, ClientCall, Keepalive};
pub use connectivity::Connectivity;
pub use engine::flow::{INITIAL_WINDOW, MESSAGE_OVERHEAD, SMALL_INITIAL_WINDOW};
pub use engine::mux::ConnectionCounters;
pub use engine::server::{Handler, HandlerFuture, ServerCall, ServerStats};
pub use engine::{blocking, wire};
pub use metadata::{InvalidMetadata, MetadataMap};
pub use server::{stop_by, Bound, Server, HTTP_MAX_MESSAGE};
pub use status::{Code, Status};
pub use topic::{Delivery, Published, SlowSubscriber, Subscription, Topic, TopicOptions, TopicStats};
pub use upgrade::{ShmOffer, TransportCounts, UpgradeStatus, UpgradedTo};

/// What a binding needs of the transport under the engine, so that bindings (the Python
/// extension, the C ABI) stand on this crate alone.
pub use isthmus_shm::{
    copy_into_shared, features, move_into_shared, BlockMut, Config, EventFd, Mapping, PeerPolicy, SharedArena,
    SharedBlock, SharedBlockMut, SocketBell, SpinPolicy,
};

/// What the crate's unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    /// A directory of one test's own, made fresh and removed however the test ends.
    pub(crate) struct TempDir(pub(crate) std::path::PathBuf);

    impl TempDir {
        /// A new directory named after `tag`, this process and the time.
        pub(crate) fn new(tag: &str) -> TempDir {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let dir = TempDir(std::env::temp_dir().join(format!("isthmus-{tag}-{}-{nanos}", std::process::id())));
            std::fs::create_dir_all(&dir.0).expect("the test's directory");
            dir
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Entry points for the fuzz targets (`fuzz/`): decoders of what HTTP/2 peers send. Not API.
#[doc(hidden)]
pub mod fuzz {
    /// Arbitrary bytes as a unix- or TCP-socket client's HTTP/2 stream, in pieces.
    pub fn http2_client_bytes(data: &[u8]) {
        crate::http::authority::fuzz(data);
    }

    /// Arbitrary bytes as a gRPC body and as header values (messages, timeout, metadata, status).
    pub fn grpc_http(data: &[u8]) {
        crate::http::fuzz(data);
    }

    /// Arbitrary bytes as a TLS peer's certificate (the names the auth context shows).
    pub fn x509(data: &[u8]) {
        crate::http::x509::fuzz(data);
    }

    /// The `:authority` filter's HPACK decoder, following one connection's dynamic table (as
    /// large as the filter lets a client make it), for a target that compares it with another
    /// decoder.
    pub struct Hpack(crate::http::hpack::Decoder);

    impl std::fmt::Debug for Hpack {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Hpack")
        }
    }

    impl Default for Hpack {
        fn default() -> Hpack {
            Hpack(crate::http::hpack::Decoder::new(crate::http::authority::HEADER_TABLE))
        }
    }

    impl Hpack {
        /// The fields of one header block, or None where it does not decode (after which the
        /// decoder's table is in no known state).
        #[allow(clippy::type_complexity)]
        pub fn decode(&mut self, block: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
            self.decode_bounded(block, usize::MAX).map(|(fields, _)| fields)
        }

        /// A decoder whose client may use a table of only `allowed` bytes, so that short
        /// strings are already too long to hold when followed past a bound.
        pub fn with_table(allowed: usize) -> Hpack {
            Hpack(crate::http::hpack::Decoder::new(allowed))
        }

        /// The fields handed on before the list passed `bound` (all of them within it), and
        /// the list's size, as HTTP/2 counts it; None where the block does not decode.
        #[allow(clippy::type_complexity)]
        pub fn decode_bounded(&mut self, block: &[u8], bound: usize) -> Option<(Vec<(Vec<u8>, Vec<u8>)>, usize)> {
            let mut fields = Vec::new();
            let mut list = 0;
            let outcome = self
                .0
                .decode(block, bound, |n, v| {
                    list += n.len() + v.len() + crate::http::hpack::FIELD_OVERHEAD;
                    fields.push((n.to_vec(), v.to_vec()))
                })
                .ok()?;
            match outcome {
                crate::http::hpack::Outcome::Within => Some((fields, list)),
                crate::http::hpack::Outcome::Over(over) => Some((fields, over.finish().ok()?)),
            }
        }

        /// The same block followed as the filter follows one too large to hold, in pieces of
        /// `step` bytes: the fields it hands on (each one held whole), or None where it does
        /// not decode or ends inside a field.
        #[allow(clippy::type_complexity)]
        pub fn follow(&mut self, block: &[u8], step: usize) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
            let mut fields = Vec::new();
            let mut over = crate::http::hpack::Overflow::default();
            for piece in block.chunks(step.max(1)) {
                over.feed(&mut self.0, piece, |n, v| fields.push((n.to_vec(), v.to_vec()))).ok()?;
            }
            over.finish().ok()?;
            Some(fields)
        }
    }
}
