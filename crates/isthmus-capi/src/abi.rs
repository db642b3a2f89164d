//! The boundary's rules in code: status codes, the guard every entry point runs under, the
//! checks of the caller's pointers, and status objects (how a failure reaches the caller).

use std::ffi::{c_char, CString};

use bytes::Bytes;
use isthmus::{Code, MetadataMap, Status};

use crate::handle::Registry;

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
pub(crate) fn report(result: Result<(), Status>, status: *mut *mut isthmus_status_t) -> isthmus_code_t {
    let code = match &result {
        Ok(()) => ISTHMUS_OK,
        Err(s) => s.code() as isthmus_code_t,
    };
    store_status(status, result.err());
    code
}

/// [`guard`] for the common shape: a body that succeeds or fails with a status.
pub(crate) fn entry(status: *mut *mut isthmus_status_t, body: impl FnOnce() -> Result<(), Status>) -> isthmus_code_t {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .unwrap_or_else(|p| Err(isthmus::binding::panic_status(&*p)));
    report(result, status)
}

/// [`entry`] for the functions that give one handle through an out-pointer: `*out` is NULL
/// unless the body gives a handle, and a NULL `out` is refused (`what` names it).
///
/// # Safety
///
/// `out` is NULL or writable; `status` is NULL or writable.
pub(crate) unsafe fn entry_out<T>(
    out: *mut *mut T,
    what: &str,
    status: *mut *mut isthmus_status_t,
    body: impl FnOnce() -> Result<Option<*mut T>, Status>,
) -> isthmus_code_t {
    // SAFETY: the caller promises `out` is NULL or writable.
    unsafe { put(out, std::ptr::null_mut()) };
    entry(status, || {
        if out.is_null() {
            return Err(invalid(format!("the {what} out-pointer is NULL")));
        }
        if let Some(handle) = body()? {
            // SAFETY: checked not NULL; writable by the caller's promise.
            unsafe { out.write(handle) };
        }
        Ok(())
    })
}

/// A NUL-terminated UTF-8 argument as `&str`.
///
/// # Safety
///
/// `s` is NULL or points to a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn c_str<'a>(s: *const c_char, what: &str) -> Result<&'a str, Status> {
    if s.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: not NULL, and the caller promises a NUL-terminated string alive for 'a.
    unsafe { std::ffi::CStr::from_ptr(s) }.to_str().map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// A list of `n` C strings as Rust strings (`what` names it in errors).
///
/// # Safety
///
/// `list` is NULL (with `n` 0) or valid for reads of `n` NUL-terminated strings.
pub(crate) unsafe fn c_strs<'a>(list: *const *const c_char, n: usize, what: &str) -> Result<Vec<&'a str>, Status> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if list.is_null() {
        return Err(invalid(format!("{what} is NULL with {n} entries")));
    }
    // No array that large exists: a count past this is a caller's mistake, and a slice of it
    // is undefined behaviour.
    if n > isize::MAX as usize / std::mem::size_of::<*const c_char>() {
        return Err(invalid(format!("{what}: {n} entries is more than any array holds")));
    }
    // SAFETY: not NULL, within isize::MAX bytes; the caller promises `n` readable entries.
    let items = unsafe { std::slice::from_raw_parts(list, n) };
    // SAFETY: each entry is a NUL-terminated string by the caller's promise.
    items.iter().map(|s| unsafe { c_str(*s, what) }).collect()
}

/// An optional NUL-terminated UTF-8 argument (a status's message): NULL is "".
///
/// # Safety
///
/// As [`c_str`].
pub(crate) unsafe fn c_str_or_empty<'a>(s: *const c_char, what: &str) -> Result<&'a str, Status> {
    match s.is_null() {
        true => Ok(""),
        // SAFETY: the caller's promise, passed on.
        false => unsafe { c_str(s, what) },
    }
}

/// A gRPC status code from a caller (0-16), or None for a number gRPC does not define.
pub(crate) fn grpc_code(code: isthmus_code_t) -> Option<Code> {
    u32::try_from(code).ok().filter(|c| *c <= 16).map(Code::from_u32)
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

/// A gRPC status: code, message, binary details and trailing metadata.
pub struct isthmus_status_t {
    code: isthmus_code_t,
    message: CString,
    /// A serialized `google.rpc.Status` (gRPC's `grpc-status-details-bin`), or empty.
    details: Bytes,
    trailers: MetadataMap,
}

pub(crate) static STATUSES: Registry<isthmus_status_t> = Registry::new("status");

/// A handle for `status`.
pub(crate) fn status_handle(status: &Status) -> *mut isthmus_status_t {
    let message = CString::new(status.message().replace('\0', " ")).unwrap_or_default();
    STATUSES.add(isthmus_status_t {
        code: status.code() as isthmus_code_t,
        message,
        details: status.details().clone(),
        trailers: status.metadata().clone(),
    })
}

/// Stores a failure's status through the caller's out-pointer (NULL on success).
pub(crate) fn store_status(out: *mut *mut isthmus_status_t, status: Option<Status>) {
    if out.is_null() {
        return;
    }
    let handle = status.map_or(std::ptr::null_mut(), |s| status_handle(&s));
    // SAFETY: `out` is not NULL; the ABI's rules make it writable.
    unsafe { put(out, handle) };
}

// ---- statuses ----

/// The status's code (`ISTHMUS_INVALID_ARGUMENT` for an invalid handle).
///
/// Thread-safety: any thread; several may read one status at once.
#[no_mangle]
pub extern "C" fn isthmus_status_code(status: *const isthmus_status_t) -> isthmus_code_t {
    guard(ISTHMUS_INTERNAL, || STATUSES.get(status).map_or(ISTHMUS_INVALID_ARGUMENT, |s| s.code))
}

/// The status's message, NUL-terminated, valid until the status is freed ("" for an invalid
/// handle).
///
/// Thread-safety: any thread; the string goes with `isthmus_status_free`, so do not free the status
/// on another thread while it is in use.
#[no_mangle]
pub extern "C" fn isthmus_status_message(status: *const isthmus_status_t) -> *const c_char {
    guard(c"".as_ptr(), || STATUSES.get(status).map_or(c"".as_ptr(), |s| s.message.as_ptr()))
}

/// The status's binary details: a serialized `google.rpc.Status` as the server sent it (gRPC's
/// `grpc-status-details-bin`, whose code and message should match the status's own), their
/// length in `*len`. Valid until the status is freed. NULL (and length 0) when the status has
/// none, or for an invalid handle.
///
/// Thread-safety: any thread; the bytes go with `isthmus_status_free`, so do not free the
/// status on another thread while they are in use.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_status_details(status: *const isthmus_status_t, len: *mut usize) -> *const u8 {
    guard(std::ptr::null(), || {
        let (ptr, n) = match STATUSES.get(status) {
            // The bytes live as long as the registry holds the status, whatever this Arc does.
            Ok(s) => (crate::object::data_ptr(&s.details), s.details.len()),
            Err(_) => (std::ptr::null(), 0),
        };
        // SAFETY: the caller promises `len` is NULL or writable.
        unsafe { put(len, n) };
        ptr
    })
}

/// The trailing metadata of a live status handle.
pub(crate) fn status_trailers(status: *const isthmus_status_t) -> Option<MetadataMap> {
    STATUSES.get(status).ok().map(|s| s.trailers.clone())
}

/// Frees a status.
///
/// Thread-safety: any thread, once; pointers into the status (message, details) that other threads
/// hold die with it.
#[no_mangle]
pub extern "C" fn isthmus_status_free(status: *mut isthmus_status_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || STATUSES.remove(status).map(drop))
}
