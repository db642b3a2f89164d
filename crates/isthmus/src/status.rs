//! gRPC status codes and the status a call ends with.
//!
//! [`Code`] carries gRPC's numbers; a number it does not know becomes UNKNOWN, as gRPC specifies.
//! [`Status`] is boxed, one pointer wide, so a `Result<T, Status>` stays small on the hot path.
//!
//! [`Status::from_transport`] is the one place a transport error becomes a status, and its message
//! is the error's sentence: `PeerGone`, `Closed`, `Io`, `AddrInUse` and `NotFound` are UNAVAILABLE;
//! `Protocol` and `VersionMismatch` INTERNAL; `Timeout` DEADLINE_EXCEEDED; `MessageTooLarge` and
//! `TooLarge` RESOURCE_EXHAUSTED; `PermissionDenied` PERMISSION_DENIED; `InvalidAddress` and
//! `InvalidConfig` INVALID_ARGUMENT. `ErrorKind` is non-exhaustive, so the `match` ends in a
//! catch-all that gives UNAVAILABLE to a kind added later. The unit test
//! `transport_failures_map_to_grpc_codes` pins the table kind by kind.
//!
//! The statuses the engine makes itself, for reference: INTERNAL for a malformed body or a reused
//! stream id (the connection closes), a handler's panic, or a peer past its flow-control window
//! (that call only); UNIMPLEMENTED for a path nobody serves; DEADLINE_EXCEEDED; CANCELLED;
//! RESOURCE_EXHAUSTED for a message over the limit or a call over the stream limit; UNAVAILABLE for
//! a call refused after GOAWAY or a reader that stopped.

use std::fmt;

use bytes::Bytes;
use isthmus_shm::ErrorKind;

use crate::metadata::MetadataMap;

/// The gRPC status codes, with gRPC's numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Code {
    /// Not an error.
    Ok = 0,
    /// The operation was cancelled, typically by the caller.
    Cancelled = 1,
    /// Unknown error (also: an error from a handler that raised something other than a status).
    Unknown = 2,
    /// The client specified an invalid argument.
    InvalidArgument = 3,
    /// The deadline expired before the operation could complete.
    DeadlineExceeded = 4,
    /// Some requested entity was not found.
    NotFound = 5,
    /// The entity a client tried to create already exists.
    AlreadyExists = 6,
    /// The caller does not have permission.
    PermissionDenied = 7,
    /// Some resource has been exhausted (e.g. a message larger than the limit).
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation.
    FailedPrecondition = 9,
    /// The operation was aborted.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The operation (e.g. the method) is not implemented.
    Unimplemented = 12,
    /// An invariant of the system is broken (e.g. malformed data from the peer).
    Internal = 13,
    /// The service is unavailable (e.g. the peer is gone); retrying may help.
    Unavailable = 14,
    /// Unrecoverable data loss.
    DataLoss = 15,
    /// The request lacks valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// Every code, in numeric order.
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The code for a number; numbers gRPC does not define are [`Code::Unknown`], as gRPC says.
    pub fn from_u32(n: u32) -> Code {
        Code::ALL.get(n as usize).copied().unwrap_or(Code::Unknown)
    }

    /// The code's canonical name, e.g. `DEADLINE_EXCEEDED`.
    pub fn name(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a call ended: a code, a message for people, optional binary details (a serialized
/// `google.rpc.Status`, as gRPC's `grpc-status-details-bin`) and trailing metadata; on a
/// client, also the initial metadata the server sent before it failed the call.
///
/// One word: a plain OK (no message, details or metadata), which nearly every call ends with,
/// is no allocation at all.
#[derive(Clone, PartialEq, Eq)]
pub struct Status(Option<Box<StatusInner>>);

/// The message of a call whose own deadline passed: grpc-core's words, which grpcio's and
/// grpc.aio's clients give as `details()` (the zero timeout of a call that never started too),
/// so code written against them reads the same over isthmus. grpc-go's clients say "context
/// deadline exceeded"; the Go package maps to that.
pub const DEADLINE_EXCEEDED: &str = "Deadline Exceeded";

#[derive(Clone, PartialEq, Eq)]
struct StatusInner {
    code: Code,
    message: String,
    details: Bytes,
    metadata: MetadataMap,
    headers: MetadataMap,
}

static NO_DETAILS: Bytes = Bytes::new();
static NO_METADATA: MetadataMap = MetadataMap::EMPTY;

impl Status {
    /// What a channel's `close` given `status` ends its calls with: `status`, or CANCELLED "the
    /// channel was closed" for OK (the Rust API takes any status, and a call the channel ended
    /// did not succeed).
    pub(crate) fn closing(status: Status) -> Status {
        match status.code() {
            Code::Ok => Status::new(Code::Cancelled, "the channel was closed"),
            _ => status,
        }
    }

    /// A status with a code and a message.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        let message = message.into();
        if code == Code::Ok && message.is_empty() {
            return Status(None);
        }
        Status(Some(Box::new(StatusInner {
            code,
            message,
            details: Bytes::new(),
            metadata: MetadataMap::new(),
            headers: MetadataMap::new(),
        })))
    }

    /// The OK status.
    pub fn ok() -> Status {
        Status(None)
    }

    /// DEADLINE_EXCEEDED for a call whose own deadline passed, however it was noticed, in
    /// grpc-core's words ([`DEADLINE_EXCEEDED`]).
    pub fn deadline_exceeded() -> Status {
        Status::new(Code::DeadlineExceeded, DEADLINE_EXCEEDED)
    }

    /// The fields, made real for a change.
    fn inner_mut(&mut self) -> &mut StatusInner {
        self.0.get_or_insert_with(|| {
            Box::new(StatusInner {
                code: Code::Ok,
                message: String::new(),
                details: Bytes::new(),
                metadata: MetadataMap::new(),
                headers: MetadataMap::new(),
            })
        })
    }

    /// Adds binary details.
    pub fn with_details(mut self, details: impl Into<Bytes>) -> Status {
        let details = details.into();
        if !details.is_empty() || self.0.is_some() {
            self.inner_mut().details = details;
        }
        self
    }

    /// Adds trailing metadata.
    pub fn with_metadata(mut self, metadata: MetadataMap) -> Status {
        if !metadata.is_empty() || self.0.is_some() {
            self.inner_mut().metadata = metadata;
        }
        self
    }

    /// Adds the initial metadata a server sent before it ended the call with this status. A
    /// client's failed call carries them (gRPC keeps a response's headers apart from its
    /// trailers, and grpcio's `RpcError.initial_metadata()` or grpc-go's `grpc.Header` give
    /// them); a server sends only the trailers of a status it is given.
    pub fn with_headers(mut self, headers: MetadataMap) -> Status {
        if !headers.is_empty() || self.0.is_some() {
            self.inner_mut().headers = headers;
        }
        self
    }

    /// A client call's end as its caller sees it: a failure keeps `headers`, the initial
    /// metadata that came before it, if any came (OK keeps them in the response instead).
    pub(crate) fn after_headers(self, headers: Option<&MetadataMap>) -> Status {
        match headers.filter(|h| !h.is_empty()) {
            Some(headers) if self.code() != Code::Ok => self.with_headers(headers.clone()),
            _ => self,
        }
    }

    /// The code.
    pub fn code(&self) -> Code {
        self.0.as_ref().map_or(Code::Ok, |s| s.code)
    }

    /// The message.
    pub fn message(&self) -> &str {
        self.0.as_ref().map_or("", |s| &s.message)
    }

    /// The binary details (empty if none).
    pub fn details(&self) -> &Bytes {
        self.0.as_ref().map_or(&NO_DETAILS, |s| &s.details)
    }

    /// The trailing metadata.
    pub fn metadata(&self) -> &MetadataMap {
        self.0.as_ref().map_or(&NO_METADATA, |s| &s.metadata)
    }

    /// The initial metadata the server sent before the call failed (empty if it sent none, or
    /// the call failed before they came): see [`with_headers`](Self::with_headers).
    pub fn headers(&self) -> &MetadataMap {
        self.0.as_ref().map_or(&NO_METADATA, |s| &s.headers)
    }

    /// The status a transport failure means for a call: the one table that maps them.
    pub fn from_transport(e: &isthmus_shm::Error) -> Status {
        let code = match e.kind() {
            ErrorKind::PeerGone | ErrorKind::Closed | ErrorKind::NotFound => Code::Unavailable,
            ErrorKind::Timeout => Code::DeadlineExceeded,
            ErrorKind::MessageTooLarge | ErrorKind::TooLarge => Code::ResourceExhausted,
            ErrorKind::PermissionDenied => Code::PermissionDenied,
            ErrorKind::Protocol | ErrorKind::VersionMismatch => Code::Internal,
            ErrorKind::InvalidAddress | ErrorKind::InvalidConfig => Code::InvalidArgument,
            ErrorKind::AddrInUse | ErrorKind::Io => Code::Unavailable,
            _ => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

/// The text of a panic's payload (what `catch_unwind` gave): its `&str` or `String`, else "a
/// non-text panic". For the statuses that report a panic caught (a handler's, a binding's).
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".into())
}

/// The status of a call made before a fork, used in the child (ADR 0030): UNAVAILABLE, as a
/// connection made before a fork is closed there.
pub(crate) fn made_before_fork() -> Status {
    Status::new(Code::Unavailable, "the call was made by the parent of this process, before a fork")
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Status");
        d.field("code", &self.code()).field("message", &self.message());
        if !self.details().is_empty() {
            d.field("details", &format_args!("{} bytes", self.details().len()));
        }
        if !self.metadata().is_empty() {
            d.field("metadata", self.metadata());
        }
        if !self.headers().is_empty() {
            d.field("headers", self.headers());
        }
        d.finish()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message().is_empty() {
            write!(f, "{}", self.code())
        } else {
            write!(f, "{}: {}", self.code(), self.message())
        }
    }
}

impl std::error::Error for Status {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_numbers_are_unknown() {
        for (i, c) in Code::ALL.iter().enumerate() {
            assert_eq!(Code::from_u32(i as u32), *c);
            assert_eq!(*c as u32, i as u32);
        }
        assert_eq!(Code::from_u32(17), Code::Unknown);
        assert_eq!(Code::from_u32(u32::MAX), Code::Unknown);
    }

    /// The one table from transport failures to codes, pinned.
    #[test]
    fn transport_failures_map_to_grpc_codes() {
        use isthmus_shm::ErrorKind as K;
        let table = [
            (K::PeerGone, Code::Unavailable),
            (K::Closed, Code::Unavailable),
            (K::NotFound, Code::Unavailable),
            (K::AddrInUse, Code::Unavailable),
            (K::Io, Code::Unavailable),
            (K::Timeout, Code::DeadlineExceeded),
            (K::MessageTooLarge, Code::ResourceExhausted),
            (K::TooLarge, Code::ResourceExhausted),
            (K::PermissionDenied, Code::PermissionDenied),
            (K::Protocol, Code::Internal),
            (K::VersionMismatch, Code::Internal),
            (K::InvalidAddress, Code::InvalidArgument),
            (K::InvalidConfig, Code::InvalidArgument),
        ];
        for (kind, code) in table {
            let e = isthmus_shm::Error::for_tests(kind, "failure");
            assert_eq!(Status::from_transport(&e).code(), code, "{kind:?}");
        }
    }

    /// A plain OK is no allocation, and reads the same as any other status.
    #[test]
    fn a_plain_ok_reads_as_one_built_field_by_field() {
        let built = Status::new(Code::Ok, "").with_details(Bytes::new()).with_metadata(MetadataMap::new());
        assert!(built.0.is_none() && Status::ok().0.is_none());
        assert_eq!(built, Status::ok());
        assert_eq!(
            (built.code(), built.message(), built.details().len(), built.metadata().len()),
            (Code::Ok, "", 0, 0)
        );
        let mut md = MetadataMap::new();
        md.append("k", "v").expect("valid metadata");
        let with = Status::ok().with_metadata(md.clone());
        assert_eq!((with.code(), with.metadata()), (Code::Ok, &md));
        assert_ne!(with, Status::ok());
        assert_eq!(Status::ok().with_details(&b"d"[..]).details(), &Bytes::from_static(b"d"));
        assert_eq!(format!("{}", Status::ok()), "OK");
    }

    #[test]
    fn status_is_small() {
        assert_eq!(std::mem::size_of::<Status>(), std::mem::size_of::<usize>());
    }
}
