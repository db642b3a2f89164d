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
//!   instead of crashing. A handle's value is not handed out again until 2^36 more handles
//!   have been made (2^28 where the address space is limited; `handle.rs`), so a handle freed
//!   twice is refused even when others were made in between. The registry keeps every handle
//!   reachable, so leak checkers cannot see one never freed: `isthmus_live_handles` counts them
//!   instead.
//! - **Errors.** Fallible functions return an `isthmus_code_t`: `ISTHMUS_OK` (0) or a gRPC
//!   status code. Where a function takes `isthmus_status_t **status` and it is not NULL, a
//!   failure stores there a status (code, message, details, trailers) that the caller frees with
//!   `isthmus_status_free`; success stores NULL. No panic crosses the boundary: every entry
//!   point catches one and reports `ISTHMUS_INTERNAL`.
//! - **Memory.** Byte arguments are `(pointer, length)` pairs, copied (or sent) before the
//!   function returns, so the caller keeps its buffers. Strings are NUL-terminated UTF-8.
//!   Pointers *into* an object (a message's bytes, a block's bytes, a status's message or
//!   details, a metadata entry) stay valid until that object is freed.
//! - **Threads.** Every function may be called from any thread. A call's sending side and its
//!   receiving side may be used from two threads at once. Each function's documentation ends
//!   with a "Thread-safety:" line: what it allows beside that, what it blocks, and which of its
//!   pointers another thread's free or change ends.
//! - **Blocking.** Functions without `_async` block the calling thread until done (bounded by
//!   the call's timeout). Each `_async` function returns at once; its result arrives as an
//!   `isthmus_event_t` on a completion queue (`isthmus_cq_t`), whose file descriptor an event
//!   loop (nginx, libuv, Go's netpoller) watches. Given a `now` event (not NULL), an
//!   `_async` function that finishes before it returns stores its event there instead of
//!   queueing it (`now->op` is then non-zero; 0 means "it will come on the queue", and is what
//!   a function that fails leaves there), and with `ISTHMUS_CALL_SPIN` a call may wait up to the
//!   connection's spin bound for that.
//! - **State.** No global state but the runtime this copy of the library starts on first use,
//!   and its handle registries: a second `dlopen` of another copy gets its own.

// The C names of the ABI's types (`isthmus_channel_t`) are its Rust names too, so that cbindgen
// writes the header's names without a rename table.
#![allow(non_camel_case_types)]
// The handles are opaque to C and hold engine objects with no `Debug` of their own.
#![allow(missing_debug_implementations)]

mod abi;
mod client;
mod cq;
mod handle;
mod object;
mod proto;
mod server;
mod stats;
mod tls;
mod topic;

pub use abi::*;
pub use client::*;
pub use cq::*;
pub use object::*;
pub use proto::*;
pub use server::*;
pub use stats::*;
pub use tls::*;
pub use topic::*;

/// The ABI version of the loaded library ([`ISTHMUS_ABI_VERSION`] when it was built): compare
/// with the header's before use.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_abi_version() -> u32 {
    ISTHMUS_ABI_VERSION
}

/// Microseconds on a monotonic clock, counted from an arbitrary moment fixed for the process:
/// for a caller with no clock of its own (LuaJIT outside nginx) to bound a wait made of several
/// `isthmus_cq_wait`s, which may return before their time (the operations woken have not
/// finished yet).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_clock_us() -> i64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    abi::guard(0, || {
        let start = *START.get_or_init(std::time::Instant::now);
        i64::try_from(start.elapsed().as_micros()).unwrap_or(i64::MAX)
    })
}

/// The gRPC name of `code` (`"UNAVAILABLE"`), static and NUL-terminated; `"UNKNOWN"` for a
/// number that is no code.
///
/// Thread-safety: any thread; the string is static.
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
///
/// Thread-safety: any thread; the count of that moment, which calls on other threads change.
#[no_mangle]
pub extern "C" fn isthmus_live_handles() -> usize {
    guard(0, || {
        object::MESSAGES.len()
            + object::BLOCKS.len()
            + object::METADATA.len()
            + abi::STATUSES.len()
            + client::CHANNELS.len()
            + object::CALLS.len()
            + cq::QUEUES.len()
            + server::SERVERS.len()
            + object::SERVER_CALLS.len()
            + proto::PROTOS.len()
            + topic::TOPICS.len()
    })
}
