//! The call engine: gRPC calls over one [`isthmus_shm`] connection. What goes on the wire, frame
//! by frame, is `protocol.md` §13.7, and flow control §13.8; this module tree is the Rust side of
//! it.
//!
//! A connection carries many calls, each a stream of frames (HEADERS, MESSAGE, TRAILERS,
//! CANCEL) with its own id. The parts, from the wire up:
//!
//! - [`wire`]: the bodies of HEADERS, TRAILERS, CANCEL, GOAWAY and WINDOW.
//! - `mux`: one connection's stream table, the routing of every frame, and the ways a connection
//!   is read. `inbox` is one stream's queue of events, `queue` the queue under it, `flow` the
//!   credit windows per stream, so that a slow reader holds back its own writer and no other.
//! - `call`: what both clients share: the connection slot, the state of one call as its events
//!   arrive, reconnecting, the HEADERS that open a call.
//! - `client` (async, on tokio) and [`blocking`] (plain threads, no runtime): the two clients,
//!   with the same methods and meaning.
//! - `server`: the server's side of a call (the [`ServerCall`](crate::ServerCall) a handler gets),
//!   accepting `shm://` connections, and running each call's handler against its deadline and its
//!   client's cancel.
//!
//! Who reads a connection, and why, is ADR 0005 (one place routes every frame), ADR 0006 (credit
//! per stream; whoever waits reads) and ADR 0008 (async calls read their own replies). In short: a
//! reader task per connection for the async client and the server; an async call that waits reads
//! for itself while nobody else does; the blocking client's waiting threads take turns. A new
//! server call gets its first poll on the reader task and becomes a task of its own only if it must
//! wait; its handler runs inside its call's future, never in a task of its own.
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
