//! The call engine: gRPC calls over one [`isthmus_shm`] connection.
//!
//! A connection carries many calls, each a stream of frames (HEADERS, MESSAGE, TRAILERS,
//! CANCEL) with its own id. The parts, from the wire up:
//!
//! - [`wire`]: the bodies of the RPC frames (request and response heads, trailers, cancel).
//! - `mux`: one connection's stream table and whoever reads the connection for it: a reader
//!   task, or a call that reads its own reply (ADR 0008); `inbox` and `queue`: one stream's
//!   events.
//! - `flow`: a window per stream, so that a slow reader holds back its own writer and no other.
//! - `call`: what the async and the blocking client share: the connection slot, reconnecting,
//!   and a call's state as its events arrive.
//! - `client`: the async client's connection and calls; [`blocking`]: the same from plain
//!   threads, with no runtime.
//! - `server`: accepting connections, running each call's handler against its deadline and its
//!   client's cancel, and the [`ServerCall`](crate::ServerCall) the handler gets.
//!
//! Nothing here knows HTTP/2: [`crate::http`] builds on this module, never the other way round.

pub mod blocking;
pub(crate) mod call;
pub(crate) mod client;
pub(crate) mod flow;
pub(crate) mod inbox;
pub(crate) mod mux;
pub(crate) mod queue;
pub(crate) mod server;
pub mod wire;
