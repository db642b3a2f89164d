//! `isthmus` gives calls over [`isthmus_shm`] gRPC's meaning: a method path, metadata, a
//! deadline, a stream of messages each way, and a [`Status`] at the end.
//!
//! This first part holds the vocabulary every later piece shares: status codes and the one table
//! that maps transport failures to them ([`Status::from_transport`]), metadata with gRPC's key
//! and value rules ([`MetadataMap`]), and the codec of the RPC frame bodies ([`wire`]). The call
//! engine (channel, server, streams) builds on these.

pub mod metadata;
pub mod status;
pub mod wire;

pub use metadata::{InvalidMetadata, MetadataMap};
pub use status::{Code, Status};
