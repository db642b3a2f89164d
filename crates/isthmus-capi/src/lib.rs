//! `isthmus-capi`: the isthmus engine behind a C ABI, for every language that can load a C
//! library (Go through cgo, LuaJIT through `ffi`, C and C++ directly). The header,
//! `include/isthmus.h`, is generated from this crate by cbindgen and checked in; a test fails
//! when it is stale.
//!
//! The ABI drives the engine ([`isthmus`]); it implements no transport of its own. Its rules,
//! which the header repeats:
//!
//! - **Handles.** Every object is an opaque pointer made by a `_new`/`_connect`/`_start`
//!   function (or handed out in an event) and released by exactly one `_free`/`_close`/
//!   `_finish`. Handles live in a registry of this library: a NULL, a handle already freed, or
//!   a pointer that is no handle of that type is refused with `ISTHMUS_INVALID_ARGUMENT`
//!   instead of crashing (a freed handle whose address a new object of the same type took is
//!   that new object: free each handle once). The registry keeps every handle reachable, so
//!   leak checkers cannot see one never freed: `isthmus_live_handles` counts them instead.
//! - **Errors.** Fallible functions return an `isthmus_code_t`: `ISTHMUS_OK` (0) or a gRPC
//!   status code. Where a function takes `isthmus_status_t **status` and it is not NULL, a
//!   failure stores there a status (code, message, trailers) that the caller frees with
//!   `isthmus_status_free`; success stores NULL. No panic crosses the boundary: every entry
//!   point catches one and reports `ISTHMUS_INTERNAL`.
//! - **Memory.** Byte arguments are `(pointer, length)` pairs, copied (or sent) before the
//!   function returns, so the caller keeps its buffers. Strings are NUL-terminated UTF-8.
//!   Pointers *into* an object (a message's bytes, a block's bytes, a status's message, a
//!   metadata entry) stay valid until that object is freed.
//! - **Threads.** Every function may be called from any thread. A call's sending side and its
//!   receiving side may be used from two threads at once.
//! - **Blocking.** Functions without `_async` block the calling thread until done (bounded by
//!   the call's timeout). Each `_async` function returns at once; its result arrives as an
//!   `isthmus_event_t` on a completion queue (`isthmus_cq_t`), whose file descriptor an event
//!   loop (nginx, libuv, Go's netpoller) watches. Given a `now` event (not NULL), an
//!   `_async` function that finishes before it returns stores its event there instead of
//!   queueing it (`now->op` is then non-zero; 0 means "it will come on the queue"), and with
//!   `ISTHMUS_CALL_SPIN` a call may wait up to the connection's spin bound for that.
//! - **State.** No global state but the runtime this copy of the library starts on first use,
//!   and its handle registries: a second `dlopen` of another copy gets its own.

// The C names of the ABI's types (`isthmus_channel_t`) are its Rust names too, so that cbindgen
// writes the header's names without a rename table.
#![allow(non_camel_case_types)]
// The handles are opaque to C and hold engine objects with no `Debug` of their own.
#![allow(missing_debug_implementations)]

mod client;
mod cq;
mod handle;
mod object;
mod server;

pub use client::*;
pub use cq::*;
pub use object::*;
pub use server::*;

use isthmus::{Code, Status};

/// The version of this ABI. It changes when a function or a struct changes incompatibly;
/// functions are added without a change. See `docs/capi.md`.
pub const ISTHMUS_ABI_VERSION: u32 = 1;

/// A gRPC status code: 0 is OK.
pub type isthmus_code_t = i32;

/// The call succeeded.
pub const ISTHMUS_OK: isthmus_code_t = 0;
/// The operation was cancelled.
pub const ISTHMUS_CANCELLED: isthmus_code_t = 1;
/// An error of no other kind.
pub const ISTHMUS_UNKNOWN: isthmus_code_t = 2;
/// The caller gave an invalid argument (a NULL, a freed handle, a bad target or path).
pub const ISTHMUS_INVALID_ARGUMENT: isthmus_code_t = 3;
/// The deadline passed before the operation completed.
pub const ISTHMUS_DEADLINE_EXCEEDED: isthmus_code_t = 4;
/// Nothing is registered at the method path.
pub const ISTHMUS_NOT_FOUND: isthmus_code_t = 5;
/// What the caller tried to create exists.
pub const ISTHMUS_ALREADY_EXISTS: isthmus_code_t = 6;
/// The caller may not do this.
pub const ISTHMUS_PERMISSION_DENIED: isthmus_code_t = 7;
/// A limit was hit (a message larger than the peer accepts, too many calls).
pub const ISTHMUS_RESOURCE_EXHAUSTED: isthmus_code_t = 8;
/// The system is not in a state the operation needs.
pub const ISTHMUS_FAILED_PRECONDITION: isthmus_code_t = 9;
/// The operation was aborted.
pub const ISTHMUS_ABORTED: isthmus_code_t = 10;
/// Out of range.
pub const ISTHMUS_OUT_OF_RANGE: isthmus_code_t = 11;
/// Not implemented (by this transport, or by the server).
pub const ISTHMUS_UNIMPLEMENTED: isthmus_code_t = 12;
/// An invariant broke (malformed data from a peer; a panic caught at the boundary).
pub const ISTHMUS_INTERNAL: isthmus_code_t = 13;
/// The peer is not reachable or went away.
pub const ISTHMUS_UNAVAILABLE: isthmus_code_t = 14;
/// Unrecoverable data loss.
pub const ISTHMUS_DATA_LOSS: isthmus_code_t = 15;
/// The caller did not authenticate.
pub const ISTHMUS_UNAUTHENTICATED: isthmus_code_t = 16;

/// The ABI version of the loaded library ([`ISTHMUS_ABI_VERSION`] when it was built): compare
/// with the header's before use.
#[no_mangle]
pub extern "C" fn isthmus_abi_version() -> u32 {
    ISTHMUS_ABI_VERSION
}

/// The gRPC name of `code` (`"UNAVAILABLE"`), static and NUL-terminated; `"UNKNOWN"` for a
/// number that is no code.
#[no_mangle]
pub extern "C" fn isthmus_code_name(code: isthmus_code_t) -> *const std::ffi::c_char {
    const NAMES: [&std::ffi::CStr; 17] = [
        c"OK",
        c"CANCELLED",
        c"UNKNOWN",
        c"INVALID_ARGUMENT",
        c"DEADLINE_EXCEEDED",
        c"NOT_FOUND",
        c"ALREADY_EXISTS",
        c"PERMISSION_DENIED",
        c"RESOURCE_EXHAUSTED",
        c"FAILED_PRECONDITION",
        c"ABORTED",
        c"OUT_OF_RANGE",
        c"UNIMPLEMENTED",
        c"INTERNAL",
        c"UNAVAILABLE",
        c"DATA_LOSS",
        c"UNAUTHENTICATED",
    ];
    usize::try_from(code).ok().and_then(|i| NAMES.get(i)).unwrap_or(&NAMES[2]).as_ptr()
}

/// The number of handles made and not yet freed, of every type. A handle lives in this
/// library's registry until it is freed, so a leak checker (LeakSanitizer, valgrind) sees one
/// never freed as reachable, not leaked: a test that wants to know it freed everything compares
/// this with its value before (or with 0 at the end).
#[no_mangle]
pub extern "C" fn isthmus_live_handles() -> usize {
    guard(0, || {
        object::MESSAGES.len()
            + object::BLOCKS.len()
            + object::METADATA.len()
            + object::STATUSES.len()
            + client::CHANNELS.len()
            + client::CALLS.len()
            + cq::QUEUES.len()
            + server::SERVERS.len()
            + server::SERVER_CALLS.len()
    })
}

/// Runs one entry point's body, turning a panic into `fallback` (the ABI's INTERNAL, in the
/// form the function returns) so that no unwind crosses `extern "C"`.
pub(crate) fn guard<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// A status for a bad argument from the caller.
pub(crate) fn invalid(what: impl Into<String>) -> Status {
    Status::new(Code::InvalidArgument, what)
}

/// The code of `result`, storing a failure's status for the caller (see the crate's rules).
pub(crate) fn report(result: Result<(), Status>, status: *mut *mut object::isthmus_status_t) -> isthmus_code_t {
    let code = match &result {
        Ok(()) => ISTHMUS_OK,
        Err(s) => s.code() as isthmus_code_t,
    };
    object::store_status(status, result.err());
    code
}

/// [`guard`] for the common shape: a body that succeeds or fails with a status.
pub(crate) fn entry(
    status: *mut *mut object::isthmus_status_t,
    body: impl FnOnce() -> Result<(), Status>,
) -> isthmus_code_t {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-text panic".into());
        Err(Status::new(Code::Internal, format!("isthmus caught a panic: {what}")))
    });
    report(result, status)
}

/// A NUL-terminated UTF-8 argument as `&str`.
///
/// # Safety
///
/// `s` is NULL or points to a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn c_str<'a>(s: *const std::ffi::c_char, what: &str) -> Result<&'a str, Status> {
    if s.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: not NULL, and the caller promises a NUL-terminated string alive for 'a.
    unsafe { std::ffi::CStr::from_ptr(s) }.to_str().map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// A `(pointer, length)` argument as a slice; NULL is allowed for length 0.
///
/// # Safety
///
/// `data` is NULL or valid for reads of `len` bytes for `'a`.
pub(crate) unsafe fn c_bytes<'a>(data: *const u8, len: usize, what: &str) -> Result<&'a [u8], Status> {
    if len == 0 {
        return Ok(&[]);
    }
    if data.is_null() {
        return Err(invalid(format!("{what} is NULL with length {len}")));
    }
    if len > isize::MAX as usize {
        return Err(invalid(format!("{what}: length {len} is too large")));
    }
    // SAFETY: not NULL, length checked against isize::MAX; the caller promises `len` readable
    // bytes alive for 'a.
    Ok(unsafe { std::slice::from_raw_parts(data, len) })
}

/// Stores `value` through an out-pointer the caller gave, if it is not NULL.
///
/// # Safety
///
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: the caller promises `out` is writable when not NULL.
        unsafe { out.write(value) };
    }
}
