//! `isthmus` gives calls over [`isthmus_shm`] gRPC's meaning: a method path, metadata, a
//! deadline, a stream of messages each way, and a [`Status`] at the end.
//!
//! - [`Channel`] connects to a server and starts calls of every shape ([`Channel::unary`],
//!   [`Channel::start`] for streaming); [`ClientCall`] sends, half-closes, receives, cancels.
//! - [`Server`] registers async handlers by method path; each gets a [`ServerCall`].
//! - [`Status`] and [`Code`] are gRPC's, with one table mapping transport failures to codes
//!   ([`Status::from_transport`]); [`MetadataMap`] holds metadata under gRPC's rules; [`wire`] is
//!   the codec of the RPC frame bodies.
//!
//! This is the engine's first part: async (tokio) on `shm://`. The blocking client, flow
//! control between streams, tracing spans, and the unix:// and http:// endpoints come next.

mod client;
pub mod metadata;
mod mux;
mod server;
pub mod status;
pub mod wire;

pub use client::{CallOptions, Channel, ClientCall, Response};
pub use metadata::{InvalidMetadata, MetadataMap};
pub use mux::ConnectionCounters;
pub use server::{Bound, Server, ServerCall, ServerStats};
pub use status::{Code, Status};
