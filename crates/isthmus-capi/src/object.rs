//! The handles the other modules share: calls (client and server side, which completion
//! events hand out too), received messages (views into shared memory), writable blocks,
//! metadata and statuses.

use std::ffi::c_char;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use isthmus::binding::{HandedCall, SharedCall};
use isthmus::{BlockMut, Code, MetadataMap, Status};

use crate::abi::{c_bytes, c_str, entry, guard, invalid, isthmus_code_t, isthmus_status_t, put, status_trailers};
use crate::handle::Registry;

/// One client call of any shape. Its sending side (`send`, `close_send`, `alloc`,
/// `send_block`) and its receiving side (`recv`, `headers`) may be used from two threads at
/// once.
pub struct isthmus_call_t {
    pub(crate) call: Arc<SharedCall>,
}

/// The server's side of one call, handed to a handler. The handler ends it with
/// `isthmus_server_call_finish`, exactly once, which also frees the handle; until then its
/// operations may be used from any thread. A call the client cancelled, or whose deadline
/// passed, stays a valid handle whose operations fail with `ISTHMUS_CANCELLED`: finish it
/// all the same.
pub struct isthmus_server_call_t {
    pub(crate) call: Arc<HandedCall>,
}

/// A received message. Over `shm://` a large one is a view into the sender's shared memory,
/// not a copy: holding it keeps that memory from the sender, so free it when done.
pub struct isthmus_message_t {
    bytes: Bytes,
}

/// A writable block in this side's shared memory, from `isthmus_call_alloc` or
/// `isthmus_server_call_alloc`: fill it, then send it without a copy.
pub struct isthmus_block_t {
    block: Mutex<Option<BlockMut>>,
    /// The block's bytes, fixed for its life (shared memory does not move).
    data: usize,
    /// The block's length, for `isthmus_block_data` to read without the lock (a write holds it
    /// while it copies); under the lock the block's own length is read. Only ever shortened
    /// (`isthmus_block_truncate`).
    len: AtomicUsize,
}

/// Metadata: an ordered list of (key, value) entries under gRPC's rules (lower-case keys;
/// keys ending in `-bin` carry bytes, others printable ASCII).
pub struct isthmus_metadata_t {
    map: Mutex<MetadataMap>,
}

pub(crate) static CALLS: Registry<isthmus_call_t> = Registry::new("call");
pub(crate) static SERVER_CALLS: Registry<isthmus_server_call_t> = Registry::new("server call");
pub(crate) static MESSAGES: Registry<isthmus_message_t> = Registry::new("message");
pub(crate) static BLOCKS: Registry<isthmus_block_t> = Registry::new("block");
pub(crate) static METADATA: Registry<isthmus_metadata_t> = Registry::new("metadata");

/// A pointer to `bytes` for C: NULL when there are none, because an empty Rust slice's
/// pointer is a dangling non-NULL value that garbage-collected callers (Go) refuse to hold.
pub(crate) fn data_ptr(bytes: &[u8]) -> *const u8 {
    match bytes.is_empty() {
        true => std::ptr::null(),
        false => bytes.as_ptr(),
    }
}

/// A handle for a started call.
pub(crate) fn call_handle(call: Arc<SharedCall>) -> *mut isthmus_call_t {
    CALLS.add(isthmus_call_t { call })
}

/// A handle for a call handed to a handler.
pub(crate) fn server_call_handle(call: Arc<HandedCall>) -> *mut isthmus_server_call_t {
    SERVER_CALLS.add(isthmus_server_call_t { call })
}

/// A handle for a received message.
pub(crate) fn message_handle(bytes: Bytes) -> *mut isthmus_message_t {
    MESSAGES.add(isthmus_message_t { bytes })
}

/// A handle for a block to fill.
pub(crate) fn block_handle(mut block: BlockMut) -> *mut isthmus_block_t {
    let (data, len) = (block.as_mut_ptr() as usize, block.len());
    BLOCKS.add(isthmus_block_t { block: Mutex::new(Some(block)), data, len: AtomicUsize::new(len) })
}

/// Takes the block out of its handle (to send it); the handle is freed.
pub(crate) fn take_block(handle: *mut isthmus_block_t) -> Result<BlockMut, Status> {
    let b = BLOCKS.remove(handle)?;
    let taken = b.block.lock().ok().and_then(|mut s| s.take());
    taken.ok_or_else(|| invalid("the block was sent already"))
}

/// A handle for metadata received.
pub(crate) fn metadata_handle(map: MetadataMap) -> *mut isthmus_metadata_t {
    METADATA.add(isthmus_metadata_t { map: Mutex::new(map) })
}

/// The metadata behind a caller's handle, NULL meaning none.
pub(crate) fn metadata_arg(md: *const isthmus_metadata_t) -> Result<MetadataMap, Status> {
    if md.is_null() {
        return Ok(MetadataMap::new());
    }
    let md = METADATA.get(md)?;
    let map = md.map.lock().map_err(|_| invalid("metadata poisoned"))?.clone();
    Ok(map)
}

// ---- messages ----

/// The message's bytes; their count in `*len`. Valid until the message is freed. NULL (and
/// length 0) for an empty message or an invalid handle.
///
/// Thread-safety: any thread; several may read the bytes at once. They go with
/// `isthmus_message_free`, so do not free the message on another thread while they are in use.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_message_data(msg: *const isthmus_message_t, len: *mut usize) -> *const u8 {
    guard(std::ptr::null(), || {
        let (ptr, n) = match MESSAGES.get(msg) {
            // The bytes live as long as the registry holds the message, whatever this Arc does.
            Ok(m) => (data_ptr(&m.bytes), m.bytes.len()),
            Err(_) => (std::ptr::null(), 0),
        };
        // SAFETY: the caller promises `len` is NULL or writable.
        unsafe { put(len, n) };
        ptr
    })
}

/// The message's length in bytes (0 for an invalid handle).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_message_len(msg: *const isthmus_message_t) -> usize {
    guard(0, || MESSAGES.get(msg).map_or(0, |m| m.bytes.len()))
}

/// Frees a message (over `shm://`, gives its shared memory back to the sender once nothing
/// else holds it). `ISTHMUS_INVALID_ARGUMENT` for NULL or a message freed already.
///
/// Thread-safety: any thread, once; the bytes that other threads hold from `isthmus_message_data`
/// die with it.
#[no_mangle]
pub extern "C" fn isthmus_message_free(msg: *mut isthmus_message_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || MESSAGES.remove(msg).map(drop))
}

// ---- blocks ----

/// The block's writable bytes; their count in `*len` (after `isthmus_block_truncate`, the
/// count it was cut to; NULL and 0 for a block cut to nothing). Valid until the block is sent or
/// freed.
///
/// Thread-safety: any thread; the bytes are plain memory, so writers on several threads order their
/// writes themselves. They go when the block is sent or freed, on any thread.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_block_data(block: *mut isthmus_block_t, len: *mut usize) -> *mut u8 {
    guard(std::ptr::null_mut(), || {
        let (ptr, n) = match BLOCKS.get(block).map(|b| (b.data, b.len.load(Ordering::Acquire))) {
            Ok((data, len)) if len > 0 => (data as *mut u8, len),
            Ok(_) | Err(_) => (std::ptr::null_mut(), 0),
        };
        // SAFETY: the caller promises `len` is NULL or writable.
        unsafe { put(len, n) };
        ptr
    })
}

/// Copies `len` bytes from `data` into the block at byte `offset`, the way the library fills
/// the blocks it copies into: `memcpy` for most sizes, and past a quarter of the last-level
/// cache stores that bypass the cache, since the reader is another process (ADR 0022, 0023).
/// `data` may lie inside the block itself (the bytes then move as `memmove` moves them).
/// `ISTHMUS_INVALID_ARGUMENT`, with nothing written, for a NULL, freed or sent block, a NULL
/// `data` with a nonzero `len`, or a range past the block's end (the status says which).
///
/// Thread-safety: any thread. Writes to one block from several threads take turns (to fill a
/// block from many threads at once, write through `isthmus_block_data`). A send that comes
/// while a write runs waits for it, a free lets it finish before the memory goes back, and a
/// write after either fails.
///
/// # Safety
///
/// `data` is NULL or readable for `len` bytes; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_block_write(
    block: *mut isthmus_block_t,
    offset: usize,
    data: *const u8,
    len: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        // Under the block's lock, so the block is neither sent nor freed under the copy.
        with_unsent(block, |b, unsent| {
            let size = unsent.len();
            let end = offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
                invalid(format!("a write of {len} bytes at offset {offset} does not fit the block's {size} bytes"))
            })?;
            if data.is_null() && len > 0 {
                return Err(invalid(format!("data is NULL with length {len}")));
            }
            // SAFETY: the destination is `offset..end` of the block's writable bytes (checked
            // above), alive while the lock keeps the block from being sent; the caller promises
            // `data` readable for `len` bytes, and it may point into the block itself.
            unsafe { isthmus::move_into_shared((b.data + offset) as *mut u8, data, end - offset) };
            Ok(())
        })
    })
}

/// Runs `f` on a block not yet sent, under its lock (a send or a free waits for it).
fn with_unsent<R>(
    block: *mut isthmus_block_t,
    f: impl FnOnce(&isthmus_block_t, &mut BlockMut) -> Result<R, Status>,
) -> Result<R, Status> {
    let b = BLOCKS.get(block)?;
    let mut held = b.block.lock().map_err(|_| invalid("block poisoned"))?;
    let unsent = held.as_mut().ok_or_else(|| invalid("the block was sent already"))?;
    f(&b, unsent)
}

/// Shortens the block to its first `len` bytes, for a caller that wrote less than it
/// allocated: a send then carries those bytes only. The arena space stays the block's until
/// the receiver releases the message. `isthmus_block_data` gives the new length after.
/// `ISTHMUS_INVALID_ARGUMENT`, the block unchanged, for a NULL, freed or sent block or a `len`
/// longer than the block (a block never grows).
///
/// Thread-safety: any thread; waits for a write to the block under way (`isthmus_block_write`).
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_block_truncate(
    block: *mut isthmus_block_t,
    len: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        with_unsent(block, |b, unsent| {
            let size = unsent.len();
            if len > size {
                return Err(invalid(format!("cannot lengthen a block of {size} bytes to {len}")));
            }
            unsent.truncate(len);
            b.len.store(len, Ordering::Release);
            Ok(())
        })
    })
}

/// Frees a block that will not be sent (its shared memory goes back to the arena).
///
/// Thread-safety: any thread, once; not while another thread still writes the block's bytes.
#[no_mangle]
pub extern "C" fn isthmus_block_free(block: *mut isthmus_block_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || BLOCKS.remove(block).map(drop))
}

// ---- metadata ----

/// New empty metadata, to fill with `isthmus_metadata_add` and pass to a call; free it with
/// `isthmus_metadata_free` (a call copies what it needs).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_metadata_new() -> *mut isthmus_metadata_t {
    guard(std::ptr::null_mut(), || metadata_handle(MetadataMap::new()))
}

/// Appends an entry. The key (NUL-terminated) must be lower-case `0-9 a-z - _ .` and not
/// reserved (`grpc-*`, `content-type`, `te`, `user-agent`); keys ending in `-bin` take any
/// bytes, others printable ASCII. `ISTHMUS_INVALID_ARGUMENT` with the reason otherwise.
/// Entry pointers taken earlier from this metadata are invalid afterwards.
///
/// Thread-safety: any thread (a lock guards the entries), but it invalidates the entry pointers
/// that `isthmus_metadata_get` gave other threads: do not add while another thread reads entries.
///
/// # Safety
///
/// `key` is NULL or NUL-terminated; `value` is valid for `value_len` bytes; `status` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_metadata_add(
    md: *mut isthmus_metadata_t,
    key: *const c_char,
    value: *const u8,
    value_len: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let md = METADATA.get(md)?;
        // SAFETY: the caller's promises, passed on.
        let (key, value) = unsafe { (c_str(key, "the key")?, c_bytes(value, value_len, "the value")?) };
        let mut map = md.map.lock().map_err(|_| invalid("metadata poisoned"))?;
        map.append_raw(key, Bytes::copy_from_slice(value)).map_err(|e| invalid(e.to_string()))
    })
}

/// The number of entries (0 for an invalid handle).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_metadata_len(md: *const isthmus_metadata_t) -> usize {
    guard(0, || METADATA.get(md).ok().and_then(|m| m.map.lock().ok().map(|s| s.len())).unwrap_or(0))
}

/// Entry `index`: its key (not NUL-terminated) and value (NULL when empty), valid until the
/// metadata is changed or freed. `ISTHMUS_OUT_OF_RANGE` past the end; on an error every
/// out-pointer is set to NULL or 0.
///
/// Thread-safety: any thread; the pointers last until the metadata is changed
/// (`isthmus_metadata_add`) or freed, on any thread.
///
/// # Safety
///
/// Each out-pointer is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_metadata_get(
    md: *const isthmus_metadata_t,
    index: usize,
    key: *mut *const u8,
    key_len: *mut usize,
    value: *mut *const u8,
    value_len: *mut usize,
) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        // SAFETY: each is NULL or writable by the caller's promise; set before anything can fail.
        unsafe {
            put(key, std::ptr::null());
            put(key_len, 0);
            put(value, std::ptr::null());
            put(value_len, 0);
        }
        let md = METADATA.get(md)?;
        let map = md.map.lock().map_err(|_| invalid("metadata poisoned"))?;
        let (k, v) = map
            .iter()
            .nth(index)
            .ok_or_else(|| Status::new(Code::OutOfRange, format!("no entry {index} in {}", map.len())))?;
        // SAFETY: the caller promises each pointer is NULL or writable. The bytes live in the
        // map's entries, which move only on `add`, for as long as the handle lives.
        unsafe {
            put(key, k.as_ptr());
            put(key_len, k.len());
            put(value, data_ptr(v));
            put(value_len, v.len());
        }
        Ok(())
    })
}

/// Frees metadata.
///
/// Thread-safety: any thread, once; calls given the metadata have copied it already.
#[no_mangle]
pub extern "C" fn isthmus_metadata_free(md: *mut isthmus_metadata_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || METADATA.remove(md).map(drop))
}

// ---- statuses ----

/// A copy of the status's trailing metadata, which the caller frees; NULL for an invalid
/// handle.
///
/// Thread-safety: any thread; the copy is the caller's alone.
#[no_mangle]
pub extern "C" fn isthmus_status_trailers(status: *const isthmus_status_t) -> *mut isthmus_metadata_t {
    guard(std::ptr::null_mut(), || status_trailers(status).map_or(std::ptr::null_mut(), metadata_handle))
}
