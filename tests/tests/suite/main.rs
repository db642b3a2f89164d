//! The cross-process tests, one module per file (`<area>_<topic>.rs`), linked into one test
//! binary: twenty binaries each linking the engine cost `make test` more to build than their
//! tests take to run. A test that counts what its whole process holds (fds, mappings) or sets
//! process-wide state (a global `tracing` subscriber) has a binary of its own beside this folder.
//!
//! Run one file's tests with `cargo test -p isthmus-tests --test suite rpc_calls::`.

mod go_peers;
mod grpcio_peer;
mod grpcurl_peer;
mod python_servers;
mod rpc_blocking;
mod rpc_calls;
mod rpc_connect_timeout;
mod rpc_connection_age;
mod rpc_flow;
mod rpc_keepalive;
mod rpc_misanswers;
mod rpc_one_frame;
mod shm_big;
mod shm_composing;
mod shm_handshake;
mod shm_hostile;
mod shm_liveness;
mod shm_roundtrip;
mod shm_shared;
mod tls_targets;
mod tonic_conformance;
mod topic;
mod upgrade;
