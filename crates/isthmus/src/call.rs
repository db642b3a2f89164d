//! What a call is given and gives back, whichever way it travels: [`CallOptions`], [`Response`],
//! and the checks and deadline helpers both ways share.
//!
//! `check_path` is the rule a method path must meet before any frame goes out: it starts with `/`,
//! is printable ASCII without space, and is at most 1024 bytes. A path without its leading `/`
//! fails UNIMPLEMENTED, as a gRPC server answers it (grpc-go's words, "malformed method name");
//! anything else is INVALID_ARGUMENT.
//! `until` runs a future until a deadline that may be absent, dropping it if the deadline comes
//! first: the async waits of both ways bound themselves with it.

use bytes::Bytes;
use tokio::time::Instant;

use crate::engine::wire;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// Per-call options: metadata to send and the time the call may take.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Initial metadata.
    pub metadata: MetadataMap,
    /// The call's deadline, from when it starts; it travels to the server. Zero is a deadline
    /// passed already: the call fails DEADLINE_EXCEEDED without going. One too long for the
    /// clock to hold (`Duration::MAX`) is none; a server is told at most what its transport can
    /// say (584 years over `shm://`, 11,415 in HTTP/2's `grpc-timeout`).
    pub timeout: Option<std::time::Duration>,
    /// If no server is reachable, keep trying until the deadline instead of failing at once
    /// with UNAVAILABLE (gRPC's `wait_for_ready`).
    pub wait_for_ready: bool,
    /// Compress the request messages, over HTTP/2 (`unix://`, `http://`, `https://`): each goes
    /// with gRPC's compressed flag under `grpc-encoding`. A server that does not read the
    /// encoding fails the call UNIMPLEMENTED, as with any gRPC client. Over `shm://` messages
    /// cross no wire, so they go as they are. `None`: uncompressed.
    pub compression: Option<Compression>,
}

/// A message compression gRPC peers agree on in `grpc-encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Compression {
    /// `gzip` (RFC 1952).
    Gzip,
    /// `deflate`: a zlib stream (RFC 1950), as gRPC's implementations send it.
    Deflate,
}

impl Compression {
    /// Its `grpc-encoding` name.
    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Deflate => "deflate",
        }
    }

    /// The compression `grpc-encoding` calls `name`; `None` for `identity` and any other.
    pub fn from_name(name: &str) -> Option<Compression> {
        match name {
            "gzip" => Some(Compression::Gzip),
            "deflate" => Some(Compression::Deflate),
            _ => None,
        }
    }
}

/// A unary call's result.
#[derive(Debug, Clone)]
pub struct Response {
    /// The server's initial metadata.
    pub metadata: MetadataMap,
    /// The response message.
    pub message: Bytes,
    /// The server's trailing metadata.
    pub trailers: MetadataMap,
    /// The message of the OK status the call ended with: nearly always empty, but a server
    /// may say something beside its success (grpcio's `set_details`), and grpcio's clients
    /// show it (`call.details()`).
    pub status_message: String,
}

/// Refuses a call that cannot start: a method path the server could never match, or a
/// deadline that has passed already (a zero timeout; a binding makes a negative one zero). gRPC
/// fails such a call DEADLINE_EXCEEDED without sending it; sent, a fast handler's reply could
/// still have come back OK.
pub(crate) fn check_start(path: &str, options: &CallOptions) -> Result<(), Status> {
    check_path(path)?;
    match options.timeout {
        Some(t) if t.is_zero() => Err(Status::deadline_exceeded()),
        _ => Ok(()),
    }
}

/// The longest user agent a channel takes.
pub(crate) const MAX_USER_AGENT: usize = 1024;

/// Refuses a user agent no metadata value could carry: empty, longer than
/// [`MAX_USER_AGENT`], or not printable ASCII (gRPC's rule for metadata values).
pub(crate) fn check_user_agent(agent: &str) -> Result<(), Status> {
    let printable = crate::metadata::check_value("user-agent", agent.as_bytes()).is_ok();
    if agent.is_empty() || agent.len() > MAX_USER_AGENT || !printable {
        // A long agent is named by its start only.
        let shown: String = agent.chars().take(64).collect();
        let more = if shown.len() < agent.len() { "…" } else { "" };
        return Err(Status::new(
            Code::InvalidArgument,
            format!("user agent {shown:?}{more} must be 1-{MAX_USER_AGENT} bytes of printable ASCII"),
        ));
    }
    Ok(())
}

/// Refuses a method path the server could never match.
pub(crate) fn check_path(path: &str) -> Result<(), Status> {
    if !path.starts_with('/') && path.len() <= wire::MAX_PATH_LEN {
        // Sent, it would reach a server that answers so: grpc-go and grpcio both say
        // UNIMPLEMENTED (grpc-go in these words), and a caller may act on the code.
        return Err(Status::new(Code::Unimplemented, format!("malformed method name: {path:?}")));
    }
    if !path.starts_with('/') || path.len() > wire::MAX_PATH_LEN || !path.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Status::new(
            Code::InvalidArgument,
            format!(
                "method path {path:?} must start with '/', be printable ASCII and at most {} bytes",
                wire::MAX_PATH_LEN
            ),
        ));
    }
    Ok(())
}

/// When a call given `timeout` from now must end. A timeout too long for the clock to hold (a
/// caller's "forever": `Duration::MAX`, Python's `sys.maxsize` seconds) is no deadline, as an
/// infinite one is: `Instant + Duration` would panic on it.
pub(crate) fn deadline_in(timeout: std::time::Duration) -> Option<std::time::Instant> {
    std::time::Instant::now().checked_add(timeout)
}

/// Runs `fut` until `deadline`; `None` if the deadline came first (the future is dropped).
pub(crate) async fn until<T>(deadline: Option<Instant>, fut: impl std::future::Future<Output = T>) -> Option<T> {
    match deadline {
        None => Some(fut.await),
        Some(d) => tokio::time::timeout_at(d, fut).await.ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_without_its_leading_slash_is_unimplemented_as_a_server_would_answer() {
        let refused = check_path("pkg.Svc/Method").expect_err("refused");
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::Unimplemented, r#"malformed method name: "pkg.Svc/Method""#)
        );
        assert_eq!(check_path("Method").expect_err("refused").code(), Code::Unimplemented);
        // What no server could be given stays the caller's mistake.
        for path in ["/pkg.Svc/Me thod", "/pkg.Svc/M\u{e9}", &format!("/{}", "x".repeat(wire::MAX_PATH_LEN))] {
            assert_eq!(check_path(path).expect_err("refused").code(), Code::InvalidArgument, "{path:?}");
        }
        assert_eq!(check_path(&"x".repeat(wire::MAX_PATH_LEN + 1)).expect_err("refused").code(), Code::InvalidArgument);
        assert!(check_path("/pkg.Svc/Method").is_ok());
    }
}
