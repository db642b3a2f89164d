//! Channels and client calls: blocking, and `_async` through a completion queue.

use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use isthmus::binding::{block_on, finish_unary, may_hand_off, runtime, SharedCall, SpinFirst, SEND_PATIENCE};
use isthmus::{CallOptions, Code, Config, Status};

use crate::abi::{
    c_bytes, c_str, c_str_or_empty, entry, entry_out, grpc_code, guard, invalid, isthmus_code_t, isthmus_status_t, put,
};
use crate::cq::{
    clear_now, cq_for, isthmus_cq_t, isthmus_event_t, start_on, start_spinning_on, Outcome, Queue,
    ISTHMUS_OP_CLOSE_SEND, ISTHMUS_OP_HEADERS, ISTHMUS_OP_RECV, ISTHMUS_OP_SEND, ISTHMUS_OP_START, ISTHMUS_OP_STATE,
    ISTHMUS_OP_UNARY, NO_SPIN,
};
use crate::handle::Registry;
use crate::object::{
    block_handle, call_handle, isthmus_block_t, isthmus_call_t, isthmus_message_t, isthmus_metadata_t, message_handle,
    metadata_arg, metadata_handle, take_block, CALLS,
};
use crate::tls::{isthmus_tls_options_t, TlsPems};

/// A channel to one server: `shm://NAME` or `shm:///path.sock` (shared memory), or
/// `unix:///path.sock` and `http://host:port` (standard gRPC over HTTP/2). Connects on its
/// first call and again after the server went away.
pub struct isthmus_channel_t {
    /// Calls whose waits read the connection themselves (blocking calls).
    engine: isthmus::Channel,
    /// Calls a completion queue polls: the connection's reader task reads for them, so that
    /// the loop thread that polls them never spins.
    polled: isthmus::Channel,
    /// Unary calls over `shm://`, on the calling thread with no runtime (the fast path).
    blocking: Option<SpinFirst>,
    /// How long a `ISTHMUS_CALL_SPIN` call waits for its reply on the caller's thread, in µs.
    spin_us: std::sync::atomic::AtomicU64,
    closed: AtomicBool,
}

/// Options of one call. Zero-initialise it, then set what you need; a NULL
/// `isthmus_call_options_t*` means all defaults.
#[repr(C)]
pub struct isthmus_call_options_t {
    /// The call's deadline, in microseconds from its start; 0 or less for none.
    pub timeout_us: i64,
    /// Initial metadata to send (NULL for none). Copied; the caller still frees it.
    pub metadata: *const isthmus_metadata_t,
    /// `ISTHMUS_CALL_*` flags ORed together, or 0; any other bit fails the call
    /// `ISTHMUS_INVALID_ARGUMENT`.
    pub flags: u32,
}

/// Call flag: if no server is reachable, keep trying until the deadline instead of failing at
/// once with UNAVAILABLE (gRPC's `wait_for_ready`).
pub const ISTHMUS_CALL_WAIT_FOR_READY: u32 = 1;

/// Call flag for `_async` calls given a `now` event: the operation may wait for its reply on
/// the calling thread for up to the connection's spin bound (50 µs by default) before it
/// returns, so that a fast reply comes back in `now` with no wake-up at all. Without it the
/// calling thread never waits (for an event loop's own thread). On a streaming call
/// (`isthmus_call_start_async`) it lets the call's receives read the connection on the thread
/// that waits (`isthmus_call_recv_spin`), rather than only through the library's reader: a
/// stream's message then costs no hand-over between threads.
pub const ISTHMUS_CALL_SPIN: u32 = 2;

/// Call flag: compress the request messages with gzip over HTTP/2 (`unix://`, `http://`,
/// `https://`), as gRPC's `grpc-encoding: gzip`; a server that does not read gzip fails the
/// call UNIMPLEMENTED. Over `shm://` messages cross no wire and go as they are.
pub const ISTHMUS_CALL_COMPRESS_GZIP: u32 = 4;

/// Call flag: as `ISTHMUS_CALL_COMPRESS_GZIP` with `deflate` (a zlib stream). Both flags
/// together are INVALID_ARGUMENT.
pub const ISTHMUS_CALL_COMPRESS_DEFLATE: u32 = 8;

/// Options of a channel. Zero-initialise it, then set what you need; NULL means defaults.
#[repr(C)]
pub struct isthmus_channel_options_t {
    /// The largest message this side accepts, in bytes; 0 for the default (4 GiB).
    pub max_message_size: u64,
    /// TLS settings for a TCP target (`https://host:port`, `host:port`, `dns:`, `ipv4:`…;
    /// INVALID_ARGUMENT for any other); copied. NULL: plaintext, except that `https://`
    /// trusts the system's roots.
    pub tls: *const isthmus_tls_options_t,
    /// `ISTHMUS_CHANNEL_*` flags ORed together, or 0.
    pub flags: u32,
    /// HTTP/2 keepalive (gRPC's `keepalive_time`): a PING after this many milliseconds in
    /// which nothing arrived, while a call is open (always, with
    /// `ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS`); 0: none. If its answer does not come within
    /// `keepalive_timeout_ms`, the connection closes and its calls end `ISTHMUS_UNAVAILABLE`.
    /// `shm://` needs none: a peer that dies there is seen at once.
    pub keepalive_time_ms: u64,
    /// How long a keepalive PING's answer may take, in milliseconds; 0 for gRPC's 20 s.
    pub keepalive_timeout_ms: u64,
    /// The user agent the channel's calls name (gRPC's `user-agent`, which a server's handlers
    /// see in their metadata), NUL-terminated, copied; NULL: none. Printable ASCII, at most
    /// 1 KiB (`ISTHMUS_INVALID_ARGUMENT` otherwise). Over HTTP/2 the library's own agent
    /// follows it; over `shm://` it goes as it is.
    pub user_agent: *const c_char,
    /// The `:authority` the calls send over HTTP/2 in place of the target's (grpc-go's
    /// `WithAuthority`, grpcio's `grpc.default_authority`), `host[:port]`, NUL-terminated,
    /// copied; NULL: the target's. TLS then checks the server's certificate against its host,
    /// unless `tls` names another. `ISTHMUS_INVALID_ARGUMENT` if it is no `host[:port]`.
    /// `shm://` sends none.
    pub authority: *const c_char,
    /// How long an HTTP/2 connection may take to come up (its connect, TLS handshake and the
    /// server's SETTINGS), in milliseconds; 0 for gRPC's 20 s (grpc-go's
    /// `ConnectParams.MinConnectTimeout`). Past it the calls waiting on that connection fail
    /// `ISTHMUS_UNAVAILABLE` instead of waiting for a host that drops packets or a server that
    /// never answers. `shm://` has its handshake's own bound.
    pub connect_timeout_ms: u64,
}

/// Channel flag: calls to an HTTP/2 address move to shared memory when its server is a local
/// isthmus server that offers it (ADR 0013), even where the environment variable
/// `ISTHMUS_UPGRADE=0` turns that off for the process.
pub const ISTHMUS_CHANNEL_UPGRADE: u32 = 1;

/// Channel flag: calls to an HTTP/2 address stay on HTTP/2, whatever the server offers.
/// Without either flag, the process's default holds: on, unless `ISTHMUS_UPGRADE` is `0`,
/// `off` or `false`.
pub const ISTHMUS_CHANNEL_NO_UPGRADE: u32 = 2;

/// Channel flag: keepalive PINGs (`keepalive_time_ms`) go out while no call is open too (gRPC's
/// `keepalive_permit_without_calls`).
pub const ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS: u32 = 4;

pub(crate) static CHANNELS: Registry<isthmus_channel_t> = Registry::new("channel");

/// The engine's keepalive for a caller's `keepalive_time_ms` and `keepalive_timeout_ms` (0:
/// gRPC's 20 s), as both options structs carry them; none for a time of 0.
pub(crate) fn keepalive(time_ms: u64, timeout_ms: u64) -> Option<isthmus::Keepalive> {
    (time_ms > 0).then(|| {
        let mut keepalive = isthmus::Keepalive::new(Duration::from_millis(time_ms));
        if timeout_ms > 0 {
            keepalive.timeout = Duration::from_millis(timeout_ms);
        }
        keepalive
    })
}

/// The options behind a caller's pointer.
///
/// # Safety
///
/// `opts` is NULL or points to a valid `isthmus_call_options_t`.
unsafe fn call_options(opts: *const isthmus_call_options_t) -> Result<CallOptions, Status> {
    // SAFETY: the caller promises a valid struct when not NULL.
    let Some(o) = (unsafe { opts.as_ref() }) else { return Ok(CallOptions::default()) };
    // A flag this library does not know (a newer header's) is refused, not silently dropped.
    let known =
        ISTHMUS_CALL_WAIT_FOR_READY | ISTHMUS_CALL_SPIN | ISTHMUS_CALL_COMPRESS_GZIP | ISTHMUS_CALL_COMPRESS_DEFLATE;
    if o.flags & !known != 0 {
        return Err(invalid(format!("unknown call flags {:#x}", o.flags & !known)));
    }
    let compression = compression(
        o.flags & ISTHMUS_CALL_COMPRESS_GZIP != 0,
        o.flags & ISTHMUS_CALL_COMPRESS_DEFLATE != 0,
        "ISTHMUS_CALL_COMPRESS_GZIP and _DEFLATE together",
    )?;
    Ok(CallOptions {
        metadata: metadata_arg(o.metadata)?,
        timeout: u64::try_from(o.timeout_us).ok().filter(|t| *t > 0).map(Duration::from_micros),
        wait_for_ready: o.flags & ISTHMUS_CALL_WAIT_FOR_READY != 0,
        compression,
    })
}

/// The compression a pair of flags asks for (`both` is the complaint when both are set), for
/// calls' and servers' options alike.
pub(crate) fn compression(gzip: bool, deflate: bool, both: &str) -> Result<Option<isthmus::Compression>, Status> {
    match (gzip, deflate) {
        (false, false) => Ok(None),
        (true, false) => Ok(Some(isthmus::Compression::Gzip)),
        (false, true) => Ok(Some(isthmus::Compression::Deflate)),
        (true, true) => Err(invalid(both)),
    }
}

fn closed() -> Status {
    Status::new(Code::Unavailable, "the channel was closed")
}

impl isthmus_channel_t {
    /// The engine handle for an `_async` call with these options: one whose waits read the
    /// connection (and so may spin) only if the caller allowed it.
    fn for_flags(&self, opts: *const isthmus_call_options_t) -> isthmus::Channel {
        // SAFETY: the caller of the entry point promises NULL or a valid struct.
        let spin = unsafe { opts.as_ref() }.is_some_and(|o| o.flags & ISTHMUS_CALL_SPIN != 0);
        match spin {
            true => self.engine.clone(),
            false => self.polled.clone(),
        }
    }

    /// The blocking channel, for a unary call that may wait for its reply on the caller's
    /// thread first (`ISTHMUS_CALL_SPIN`, over `shm://`, a small request, and not too many
    /// slow replies waited for by threads already); `None` for the completion queue's path.
    fn spin_first(
        &self,
        opts: *const isthmus_call_options_t,
        request_len: usize,
    ) -> Option<&isthmus::blocking::Channel> {
        // SAFETY: the caller of the entry point promises NULL or a valid struct.
        let flags = unsafe { opts.as_ref() }.map_or(0, |o| o.flags);
        // wait_for_ready may back off and retry for long: never on the caller's thread.
        let spin = flags & ISTHMUS_CALL_SPIN != 0 && flags & ISTHMUS_CALL_WAIT_FOR_READY == 0;
        self.blocking.as_ref().filter(|_| spin && request_len <= SPIN_REQUEST_MAX)?.ready()
    }

    fn open(&self) -> Result<(), Status> {
        match self.closed.load(Ordering::Acquire) {
            true => Err(closed()),
            false => Ok(()),
        }
    }
}

/// Makes a channel to `target`. It connects on its first call, so this fails only for a
/// target it cannot parse, or options it cannot take (bad TLS settings, unknown flags, both
/// upgrade flags): `ISTHMUS_INVALID_ARGUMENT`. Close it with `isthmus_channel_close`.
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `target` is a NUL-terminated string; `opts` is NULL or valid; `out` is writable; `status`
/// is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_new(
    target: *const c_char,
    opts: *const isthmus_channel_options_t,
    out: *mut *mut isthmus_channel_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(out, "channel", status, || {
            let (target, opts) = (c_str(target, "the target")?, opts.as_ref());
            let mut config = Config::default();
            let spin_us = std::sync::atomic::AtomicU64::new(config.spin.max.as_micros() as u64);
            if let Some(limit) = opts.map(|o| o.max_message_size).filter(|l| *l > 0) {
                config.max_message_size = limit;
            }
            let mut builder = isthmus::Channel::builder(target).config(config.clone());
            let flags = opts.map_or(0, |o| o.flags);
            let known = ISTHMUS_CHANNEL_UPGRADE | ISTHMUS_CHANNEL_NO_UPGRADE | ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS;
            if flags & !known != 0 {
                return Err(invalid(format!("unknown channel flags {flags:#x}")));
            }
            match (flags & ISTHMUS_CHANNEL_UPGRADE != 0, flags & ISTHMUS_CHANNEL_NO_UPGRADE != 0) {
                (true, true) => return Err(invalid("ISTHMUS_CHANNEL_UPGRADE and ISTHMUS_CHANNEL_NO_UPGRADE together")),
                (on, off) if on || off => builder = builder.upgrade(on),
                _ => {}
            }
            if let Some(mut k) = opts.and_then(|o| keepalive(o.keepalive_time_ms, o.keepalive_timeout_ms)) {
                k.permit_without_calls = flags & ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS != 0;
                builder = builder.keepalive(k);
            }
            if let Some(tls) = TlsPems::copy(opts.map_or(std::ptr::null(), |o| o.tls))? {
                builder = builder.tls_config(tls.client()?);
            }
            let agent = match opts.map_or(std::ptr::null(), |o| o.user_agent) {
                p if p.is_null() => None,
                p => Some(c_str(p, "the user agent")?),
            };
            if let Some(agent) = agent {
                builder = builder.user_agent(agent);
            }
            match opts.map_or(std::ptr::null(), |o| o.authority) {
                p if p.is_null() => {}
                p => builder = builder.authority(c_str(p, "the authority")?),
            }
            if let Some(o) = opts {
                // 0 is the engine's default too.
                builder = builder.connect_timeout(Duration::from_millis(o.connect_timeout_ms));
            }
            let engine = {
                let _runtime = runtime().enter();
                builder.connect_lazy()?
            };
            let blocking = match target.starts_with("shm:") {
                true => {
                    let blocking = isthmus::blocking::Channel::lazy_with(target, config)?;
                    if let Some(agent) = agent {
                        blocking.set_user_agent(agent)?;
                    }
                    Some(SpinFirst::new(blocking))
                }
                false => None,
            };
            let polled = engine.with_calls_read(false);
            Ok(Some(CHANNELS.add(isthmus_channel_t {
                engine,
                polled,
                blocking,
                spin_us,
                closed: AtomicBool::new(false),
            })))
        })
    }
}

/// Closes a channel and frees its handle. Calls in progress go on until they end; new calls
/// on a closed handle are not possible (the handle is gone).
///
/// Thread-safety: any thread, once; calls in progress on other threads go on, and their later uses
/// of the handle fail `ISTHMUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn isthmus_channel_close(channel: *mut isthmus_channel_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let channel = CHANNELS.remove(channel)?;
        channel.closed.store(true, Ordering::Release);
        Ok(())
    })
}

/// Ends a channel's calls in progress now with status `code` (a gRPC code other than OK) and
/// `message` (NULL: none), as grpc-go's `ClientConn.Close` ("grpc: the client connection is
/// closing", CANCELLED) and grpcio's `close` do: blocking calls return it, queued operations
/// complete with it, and the server's handlers see their calls end. The channel's `shm://`
/// connections close; later calls on it fail (UNAVAILABLE over `shm://`, `code` over HTTP/2).
/// The handle stays valid until `isthmus_channel_close`.
///
/// Thread-safety: any thread; calls in progress on other threads end.
///
/// # Safety
///
/// `message` is NULL or NUL-terminated; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_shutdown(
    channel: *const isthmus_channel_t,
    code: isthmus_code_t,
    message: *const c_char,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let channel = CHANNELS.get(channel)?;
        let code = grpc_code(code)
            .filter(|c| *c != Code::Ok)
            .ok_or_else(|| invalid(format!("{code} is not a gRPC status code other than OK")))?;
        // SAFETY: NULL or NUL-terminated, by the caller's promise.
        let text = unsafe { c_str_or_empty(message, "the message")? };
        let status = Status::new(code, text);
        if let Some(blocking) = &channel.blocking {
            blocking.channel().close(status.clone());
        }
        let _runtime = runtime().enter();
        channel.engine.close(status);
        Ok(())
    })
}

/// Sets how long a unary call started with `ISTHMUS_CALL_SPIN` on this channel waits for its
/// reply on the calling thread before it leaves the reply to the completion queue, in µs (the
/// default is the connection's spin bound, 50 µs). An event loop that has other work when
/// replies are slow (nginx under load) waits less; with 0 the request is still sent on the
/// calling thread, and a thread of the library's pool waits for the reply. A request over
/// 1 KiB waits longer by the time the server needs to read it: 0.25 µs per KiB, at most 50 µs
/// more (a spin of 0 stays 0).
///
/// Thread-safety: any thread; calls started after it use the new value.
#[no_mangle]
pub extern "C" fn isthmus_channel_set_spin(channel: *const isthmus_channel_t, spin_us: u32) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        CHANNELS.get(channel)?.spin_us.store(spin_us.into(), Ordering::Relaxed);
        Ok(())
    })
}

/// Connectivity states (`isthmus_channel_state`), numbered as gRPC numbers them (grpc-go's
/// `connectivity.State`, grpcio's `ChannelConnectivity`): no connection and none being made.
pub const ISTHMUS_STATE_IDLE: u32 = 0;
/// A connection is being made.
pub const ISTHMUS_STATE_CONNECTING: u32 = 1;
/// A connection is up: calls go out at once.
pub const ISTHMUS_STATE_READY: u32 = 2;
/// The last attempt to connect failed.
pub const ISTHMUS_STATE_TRANSIENT_FAILURE: u32 = 3;
/// The channel was closed.
pub const ISTHMUS_STATE_SHUTDOWN: u32 = 4;

/// How often a wait for a state change looks at the `shm://` fast path's connection, whose
/// changes nobody announces.
const STATE_POLL: Duration = Duration::from_millis(10);

impl isthmus_channel_t {
    /// The counters of the channel's `shm://` connections: the engine's (its calls from a
    /// completion queue share it) and the fast path's.
    pub(crate) fn counters(&self) -> Vec<isthmus::ConnectionCounters> {
        let mut all = vec![self.engine.counters()];
        all.extend(self.blocking.as_ref().map(|b| b.channel().counters()));
        all
    }

    /// The channel's state. Over `shm://` a channel has two connections (the fast path's,
    /// which unary calls from the caller's thread use, and the engine's): it is as far along
    /// as the further of the two, so a channel whose calls all went the fast path is READY.
    fn state(&self, try_to_connect: bool) -> isthmus::Connectivity {
        use isthmus::Connectivity::{Connecting, Idle, Ready, Shutdown, TransientFailure};
        if self.closed.load(Ordering::Acquire) {
            return Shutdown;
        }
        // Connecting in the background needs the runtime (never the caller's thread: it may
        // be an event loop's).
        let _runtime = runtime().enter();
        let engine = self.engine.connectivity(try_to_connect);
        let fast = self.blocking.as_ref().map_or(Idle, |b| b.channel().connectivity(false));
        let rank = |s| match s {
            Idle => 0,
            TransientFailure => 1,
            Connecting => 2,
            Ready => 3,
            Shutdown => 4,
        };
        if rank(fast) > rank(engine) {
            fast
        } else {
            engine
        }
    }
}

/// The channel's connectivity state (`ISTHMUS_STATE_*`) into `*state`. With `try_to_connect`
/// not 0, an IDLE or failed channel starts connecting in the background (retrying with
/// backoff until it is READY), as grpc-go's `Connect` and grpcio's `try_to_connect`; the
/// calling thread never waits for it. On an error (a handle that is no channel) `*state` is
/// `ISTHMUS_STATE_SHUTDOWN`.
///
/// Thread-safety: any thread, an event loop's included: it never waits.
///
/// # Safety
///
/// `state` is writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_state(
    channel: *const isthmus_channel_t,
    try_to_connect: i32,
    state: *mut u32,
) -> isthmus_code_t {
    // SAFETY: the caller's promise, passed on.
    unsafe { entry_state(state, || Ok((CHANNELS.get(channel)?.state(try_to_connect != 0), Ok(())))) }
}

/// [`entry`] for the connectivity calls: `state` NULL is refused; otherwise the state the body
/// gives is stored there, and its result (OK, or DEADLINE_EXCEEDED for a wait that ran out)
/// returned. A body that fails (a handle that is no channel, a `last` that is no state) leaves
/// SHUTDOWN there, so a caller that reads it regardless reads no stale state.
///
/// # Safety
///
/// `state` is NULL or writable.
unsafe fn entry_state(
    state: *mut u32,
    body: impl FnOnce() -> Result<(isthmus::Connectivity, Result<(), Status>), Status>,
) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        if state.is_null() {
            return Err(invalid("the state out-pointer is NULL"));
        }
        // SAFETY: checked not NULL; writable by the caller's promise.
        unsafe { state.write(ISTHMUS_STATE_SHUTDOWN) };
        let (now, result) = body()?;
        // SAFETY: checked not NULL; writable by the caller's promise.
        unsafe { state.write(now as u32) };
        result
    })
}

/// Blocks until the channel's state is not `last` (an `ISTHMUS_STATE_*`), for at most
/// `timeout_ms` milliseconds: `ISTHMUS_OK` with the new state in `*state`, or
/// `ISTHMUS_DEADLINE_EXCEEDED` with the state, still `last`, if the time ran out (grpc-go's
/// `WaitForStateChange`). Closing the channel from another thread moves it to SHUTDOWN. On
/// an error (a handle that is no channel, a `last` that is no state) `*state` is
/// `ISTHMUS_STATE_SHUTDOWN`.
///
/// Thread-safety: any thread, which it blocks; closing the channel on another thread ends the wait.
///
/// # Safety
///
/// `state` is writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_wait_state(
    channel: *const isthmus_channel_t,
    last: u32,
    timeout_ms: u32,
    state: *mut u32,
) -> isthmus_code_t {
    // SAFETY: the caller's promise, passed on.
    unsafe {
        entry_state(state, || {
            if last > ISTHMUS_STATE_SHUTDOWN {
                return Err(invalid(format!("{last} is not a connectivity state")));
            }
            // The handle may be closed meanwhile: this keeps the channel until the wait ends.
            let channel = CHANNELS.get(channel)?;
            let until = std::time::Instant::now() + Duration::from_millis(timeout_ms.into());
            let now = block_on(state_other_than(&channel, last, Some(until)));
            let result = match now as u32 == last {
                true => Err(stayed(now, timeout_ms)),
                false => Ok(()),
            };
            Ok((now, result))
        })
    }
}

/// Waits until `channel`'s state is not `last`, or until `until` (`None`: no limit): the state
/// then. The engine's connection announces its changes; the fast path's is looked at every
/// `STATE_POLL`.
async fn state_other_than(
    channel: &isthmus_channel_t,
    last: u32,
    until: Option<std::time::Instant>,
) -> isthmus::Connectivity {
    loop {
        let state = channel.state(false);
        let left = until.map(|u| u.saturating_duration_since(std::time::Instant::now()));
        if state as u32 != last || left.is_some_and(|l| l.is_zero()) {
            return state;
        }
        let engine = channel.engine.connectivity(false);
        let slice = left.map_or(STATE_POLL, |l| l.min(STATE_POLL));
        let _ = tokio::time::timeout(slice, channel.engine.connectivity_changed(engine)).await;
    }
}

/// The status of a wait for a state change that ran out of time.
fn stayed(state: isthmus::Connectivity, timeout_ms: impl std::fmt::Display) -> Status {
    Status::new(Code::DeadlineExceeded, format!("the state stayed {state:?} for {timeout_ms} ms"))
}

/// [`isthmus_channel_wait_state`] without blocking (`ISTHMUS_OP_STATE`: the state in
/// `message_len`, with `ISTHMUS_OK` once it is not `last`, or `ISTHMUS_DEADLINE_EXCEEDED` and
/// the state, still `last`, after `timeout_ms` milliseconds; a negative `timeout_ms` waits
/// without a limit). Give up on it with `isthmus_cq_cancel`. For event loops (nginx, Go's
/// netpoller), where a wait must not hold a thread.
///
/// Thread-safety: any thread; it never blocks.
///
/// # Safety
///
/// `now` is NULL or writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_wait_state_async(
    channel: *const isthmus_channel_t,
    last: u32,
    timeout_ms: i64,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    let until = u64::try_from(timeout_ms).ok().map(|ms| std::time::Instant::now() + Duration::from_millis(ms));
    start_on(CHANNELS.get(channel), cq, tag, ISTHMUS_OP_STATE, now, status, |channel| {
        if last > ISTHMUS_STATE_SHUTDOWN {
            return Err(invalid(format!("{last} is not a connectivity state")));
        }
        Ok(async move {
            let state = state_other_than(&channel, last, until).await;
            Outcome::State(state as u32, (state as u32 == last).then(|| stayed(state, timeout_ms)))
        })
    })
}

/// A unary call, blocking: sends `request` to `path` (`/package.Service/Method`) and waits
/// for the one response. On success `*reply` holds the response message; `*headers` and
/// `*trailers` (each out-pointer may be NULL) the server's initial and trailing metadata, or
/// NULL when there is none. All are the caller's to free. On failure `*status` (if not NULL) says
/// why, `*reply` and `*trailers` are NULL (the status holds the trailers), and `*headers` holds
/// the initial metadata the server sent before it failed the call, or NULL.
///
/// Thread-safety: any thread, which it blocks (not an event loop's); many threads may call at once
/// on one channel.
///
/// # Safety
///
/// `path` is NUL-terminated; `request` is valid for `request_len` bytes; `opts` is NULL or
/// valid; each out-pointer is NULL or writable (`reply` must not be NULL).
#[no_mangle]
pub unsafe extern "C" fn isthmus_unary(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    request: *const u8,
    request_len: usize,
    opts: *const isthmus_call_options_t,
    reply: *mut *mut isthmus_message_t,
    headers: *mut *mut isthmus_metadata_t,
    trailers: *mut *mut isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: each out-pointer is NULL or writable, as the caller promises.
    unsafe { clear_response(reply, headers, trailers) };
    entry(status, || {
        if reply.is_null() {
            return Err(invalid("the reply out-pointer is NULL"));
        }
        let channel = CHANNELS.get(channel)?;
        channel.open()?;
        // SAFETY: the caller's promises, passed on.
        let (path, request, options) =
            unsafe { (c_str(path, "the path")?, c_bytes(request, request_len, "the request")?, call_options(opts)?) };
        let response = match &channel.blocking {
            Some(blocking) => blocking.channel().unary(path, request, options),
            None => block_on(channel.engine.unary(path, request, options)),
        };
        // SAFETY: as above.
        let response = unsafe { put_failed_headers(response, headers) }?;
        // SAFETY: as above.
        unsafe { put_response(response, reply, headers, trailers) };
        Ok(())
    })
}

/// Sets a unary call's out-pointers to NULL, as they stay on failure.
///
/// # Safety
///
/// Each is NULL or writable.
unsafe fn clear_response(
    reply: *mut *mut isthmus_message_t,
    headers: *mut *mut isthmus_metadata_t,
    trailers: *mut *mut isthmus_metadata_t,
) {
    // SAFETY: the caller's promise.
    unsafe {
        put(reply, std::ptr::null_mut());
        put(headers, std::ptr::null_mut());
        put(trailers, std::ptr::null_mut());
    }
}

/// Hands a failed unary call's initial metadata, if the server sent any before it failed the
/// call, to the caller's `headers` (grpc-go's `grpc.Header` and grpcio's
/// `RpcError.initial_metadata()` give them).
///
/// # Safety
///
/// `headers` is NULL or writable.
unsafe fn put_failed_headers(
    response: Result<isthmus::Response, Status>,
    headers: *mut *mut isthmus_metadata_t,
) -> Result<isthmus::Response, Status> {
    if let Err(failed) = &response {
        if !headers.is_null() && !failed.headers().is_empty() {
            // SAFETY: the caller's promise.
            unsafe { put(headers, metadata_handle(failed.headers().clone())) };
        }
    }
    response
}

/// Hands a unary call's response to the caller's out-pointers (headers and trailers only when
/// asked for and not empty).
///
/// # Safety
///
/// `reply` is writable; `headers` and `trailers` are NULL or writable.
unsafe fn put_response(
    response: isthmus::Response,
    reply: *mut *mut isthmus_message_t,
    headers: *mut *mut isthmus_metadata_t,
    trailers: *mut *mut isthmus_metadata_t,
) {
    // SAFETY: the caller's promises.
    unsafe {
        put(reply, message_handle(response.message));
        if !headers.is_null() && !response.metadata.is_empty() {
            put(headers, metadata_handle(response.metadata));
        }
        if !trailers.is_null() && !response.trailers.is_empty() {
            put(trailers, metadata_handle(response.trailers));
        }
    }
}

/// [`isthmus_unary`] without blocking: returns at once, and the outcome arrives on `cq` as an
/// event with `op = ISTHMUS_OP_UNARY` and this `tag`: `message`, `metadata` (initial) and
/// `trailers` on success; on failure `status`, and `metadata` if the server sent initial
/// metadata before it failed the call.
///
/// Thread-safety: any thread, many at once on one channel. It does not block; with
/// `ISTHMUS_CALL_SPIN` it may wait on the calling thread up to the channel's spin. The event goes
/// to whichever thread takes it from `cq`.
///
/// # Safety
///
/// As [`isthmus_unary`]; the request is copied before this returns.
#[no_mangle]
pub unsafe extern "C" fn isthmus_unary_async(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    request: *const u8,
    request_len: usize,
    opts: *const isthmus_call_options_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    clear_now(now);
    entry(status, || {
        let (channel, cq) = (CHANNELS.get(channel)?, cq_for(cq, tag)?);
        channel.open()?;
        // SAFETY: the caller's promises, passed on.
        let (path, request, options) =
            unsafe { (c_str(path, "the path")?, c_bytes(request, request_len, "the request")?, call_options(opts)?) };
        if let Some(blocking) = channel.spin_first(opts, request.len()) {
            let spin = Duration::from_micros(channel.spin_us.load(Ordering::Relaxed));
            let begun = match blocking.unary_begin_within(path, request, &options, SEND_PATIENCE) {
                Ok(Some(unary)) => Ok(unary),
                Err(status) => Err(status),
                // No room in the connection now: the queue's path sends it, off this thread.
                Ok(None) => return queue_unary(&channel, &cq, tag, path, request, options, now),
            };
            complete_begun(&cq, tag, begun, spin, now);
            return Ok(());
        }
        // Declined by `spin_first` (or not asked): the queue's path, which never reads the
        // connection on the caller's thread.
        queue_unary(&channel, &cq, tag, path, request, options, now)
    })
}

/// A unary call on the completion queue's path: the runtime sends it and reads its reply.
fn queue_unary(
    channel: &isthmus_channel_t,
    cq: &Queue,
    tag: u64,
    path: &str,
    request: &[u8],
    options: isthmus::CallOptions,
    now: *mut isthmus_event_t,
) -> Result<(), Status> {
    let (path, request, engine) = (path.to_owned(), request.to_vec(), channel.polled.clone());
    cq.start(tag, ISTHMUS_OP_UNARY, async move { Outcome::unary(engine.unary(&path, &request, options).await) }, now);
    Ok(())
}

/// Requests up to this size may be sent from an event loop's thread (with `ISTHMUS_CALL_SPIN`):
/// they go into shared memory at once (a copy of at most tens of µs) unless the server holds
/// the whole arena; larger ones take the completion queue's path, where the runtime sends them.
const SPIN_REQUEST_MAX: usize = 1024 * 1024;

/// Blocks up to this size sent by `isthmus_unary_block_async` without `ISTHMUS_CALL_SPIN` are
/// copied to the queue's connection rather than waited for by a thread of the pool.
const COPIED_BLOCK_MAX: usize = 64 * 1024;

/// Completes a unary call begun on the caller's thread (or its failure to begin) on `cq`: its
/// reply waited for there for up to `spin`, then by a thread of the pool (`finish_unary`).
fn complete_begun(
    cq: &Queue,
    tag: u64,
    begun: Result<isthmus::blocking::PendingUnary, Status>,
    spin: Duration,
    now: *mut isthmus_event_t,
) {
    match begun {
        Ok(unary) => {
            let reply = finish_unary(unary, spin);
            cq.start(tag, ISTHMUS_OP_UNARY, async move { Outcome::unary(reply.await) }, now)
        }
        Err(status) => cq.start(tag, ISTHMUS_OP_UNARY, std::future::ready(Outcome::Failed(status)), now),
    }
}

/// A writable block of `len` bytes in the channel's shared memory, to fill in place and send
/// as a unary request with `isthmus_unary_block` or `isthmus_unary_block_async`, with no copy.
/// `shm://` channels only (`ISTHMUS_UNIMPLEMENTED` otherwise). Blocks the calling thread while
/// it connects (with `ISTHMUS_CALL_WAIT_FOR_READY`, until a server is there) and while the
/// arena is full, at most for `opts`' timeout (no bound without one). `*block` is the caller's: it is consumed by the send, or freed with
/// `isthmus_block_free`. If the connection ends before the block is sent, the send fails
/// UNAVAILABLE.
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `opts` is NULL or valid; `block` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_alloc(
    channel: *const isthmus_channel_t,
    len: usize,
    opts: *const isthmus_call_options_t,
    block: *mut *mut isthmus_block_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(block, "block", status, || {
            let channel = CHANNELS.get(channel)?;
            channel.open()?;
            let options = call_options(opts)?;
            let blocking = channel.blocking.as_ref().ok_or_else(no_blocks)?;
            Ok(Some(block_handle(blocking.channel().alloc_for(len, &options)?)))
        })
    }
}

fn no_blocks() -> Status {
    Status::new(Code::Unimplemented, "blocks of shared memory need an shm:// channel")
}

/// [`isthmus_unary`] whose request is a block from `isthmus_channel_alloc` of the same
/// channel, sent where it lies. The block handle is consumed, sent or not.
///
/// Thread-safety: any thread, which it blocks; many at once on one channel. No other thread may
/// write the block once it is passed here.
///
/// # Safety
///
/// As [`isthmus_unary`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_unary_block(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    block: *mut isthmus_block_t,
    opts: *const isthmus_call_options_t,
    reply: *mut *mut isthmus_message_t,
    headers: *mut *mut isthmus_metadata_t,
    trailers: *mut *mut isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: each out-pointer is NULL or writable, as the caller promises.
    unsafe { clear_response(reply, headers, trailers) };
    entry(status, || {
        let block = take_block(block)?;
        if reply.is_null() {
            return Err(invalid("the reply out-pointer is NULL"));
        }
        let channel = CHANNELS.get(channel)?;
        channel.open()?;
        // SAFETY: the caller's promises, passed on.
        let (path, options) = unsafe { (c_str(path, "the path")?, call_options(opts)?) };
        let response = channel.blocking.as_ref().ok_or_else(no_blocks)?.channel().unary_block(path, block, options);
        // SAFETY: as above.
        let response = unsafe { put_failed_headers(response, headers) }?;
        // SAFETY: as above.
        unsafe { put_response(response, reply, headers, trailers) };
        Ok(())
    })
}

/// [`isthmus_unary_block`] without blocking on the reply, as [`isthmus_unary_async`]. With
/// `ISTHMUS_CALL_SPIN` the request is sent where it lies, on the calling thread, which then
/// waits up to the channel's spin (see `isthmus_channel_set_spin`) for the reply (it comes
/// back in `now`); a thread of the library waits for a slower one, which arrives as an
/// `ISTHMUS_OP_UNARY` event. Without the
/// flag a block over 64 KiB is sent the same way and waited for by a library thread at once.
/// A block up to 64 KiB without the flag, a call with `ISTHMUS_CALL_WAIT_FOR_READY`, and any
/// call while 64 slow replies are waited for already are copied to the completion queue's
/// connection instead and sent by the runtime. Sending on the calling thread never connects
/// (a block whose connection is gone fails UNAVAILABLE) but does wait while the server's ring
/// is full, up to the call's deadline. The block handle is consumed, sent or not.
///
/// Thread-safety: any thread, many at once on one channel; see above for what it may wait for on
/// the calling thread. No other thread may write the block once it is passed here.
///
/// # Safety
///
/// As [`isthmus_unary_async`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_unary_block_async(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    block: *mut isthmus_block_t,
    opts: *const isthmus_call_options_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    clear_now(now);
    entry(status, || {
        let block = take_block(block)?;
        let (channel, cq) = (CHANNELS.get(channel)?, cq_for(cq, tag)?);
        channel.open()?;
        // SAFETY: the caller's promises, passed on.
        let (path, options) = unsafe { (c_str(path, "the path")?, call_options(opts)?) };
        let blocking = channel.blocking.as_ref().ok_or_else(no_blocks)?;
        // SAFETY: as above.
        let spinning = unsafe { opts.as_ref() }.is_some_and(|o| o.flags & ISTHMUS_CALL_SPIN != 0);
        let spin = match spinning {
            true => Duration::from_micros(channel.spin_us.load(Ordering::Relaxed)),
            false => Duration::ZERO,
        };
        // Only a thread that waits reads the block's connection: a thread of the pool would wait
        // for this reply. Past the pool's bound, and for a small block that this thread will not
        // wait for (a hand-off costs more than its copy), the call goes the queue's way, whose
        // connection is not the block's: its bytes are copied there.
        if !may_hand_off() || options.wait_for_ready || (!spinning && block.len() <= COPIED_BLOCK_MAX) {
            let (path, request, engine) = (path.to_owned(), block.to_vec(), channel.polled.clone());
            drop(block);
            cq.start(
                tag,
                ISTHMUS_OP_UNARY,
                async move { Outcome::unary(engine.unary(&path, &request, options).await) },
                now,
            );
            return Ok(());
        }
        complete_begun(&cq, tag, blocking.channel().unary_block_begin(path, block, options), spin, now);
        Ok(())
    })
}

/// Starts a call of any shape on `path`, blocking until its head is sent (connecting if
/// needed). `*call` is the caller's, freed with `isthmus_call_free`.
///
/// Thread-safety: any thread, which it blocks; many at once on one channel.
///
/// # Safety
///
/// `path` is NUL-terminated; `opts` is NULL or valid; `call` is writable; `status` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_start(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    opts: *const isthmus_call_options_t,
    call: *mut *mut isthmus_call_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(call, "call", status, || {
            let channel = CHANNELS.get(channel)?;
            channel.open()?;
            let (path, options) = (c_str(path, "the path")?, call_options(opts)?);
            let started = block_on(channel.engine.start(path, options))?;
            Ok(Some(call_handle(SharedCall::new(started))))
        })
    }
}

/// [`isthmus_call_start`] without blocking: the event (`ISTHMUS_OP_START`) carries the call
/// in `call` on success. The call's later operations are best made `_async` on the same queue:
/// it is polled by whoever drains that queue.
///
/// Thread-safety: any thread; it does not block.
///
/// # Safety
///
/// As [`isthmus_call_start`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_start_async(
    channel: *const isthmus_channel_t,
    path: *const c_char,
    opts: *const isthmus_call_options_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    clear_now(now);
    entry(status, || {
        let (channel, cq) = (CHANNELS.get(channel)?, cq_for(cq, tag)?);
        channel.open()?;
        // SAFETY: the caller's promises, passed on.
        let (path, options) = unsafe { (c_str(path, "the path")?, call_options(opts)?) };
        let (path, engine) = (path.to_owned(), channel.for_flags(opts));
        cq.start(tag, ISTHMUS_OP_START, async move { Outcome::started(engine.start(&path, options).await) }, now);
        Ok(())
    })
}

/// A call's status once it has failed on the sending side: the sender only learns that the
/// call is over; why comes with the next `recv`.
fn over() -> Status {
    Status::new(Code::Cancelled, "the call is over: recv gives its status")
}

/// A send on `call` may go: INTERNAL once its sending side was half-closed, in grpc-go's
/// words, where the message was dropped and the send said it went (over `shm://`; over HTTP/2
/// it failed CANCELLED, as if the call were over).
fn sendable(call: &SharedCall) -> Result<(), Status> {
    match call.half_closed() {
        true => Err(Status::new(Code::Internal, "SendMsg called after CloseSend")),
        false => Ok(()),
    }
}

/// Sends one request message (copied), blocking while flow control holds it back; `last`
/// (non-zero) half-closes with it. A call that is over fails with `ISTHMUS_CANCELLED`: its
/// status comes from `isthmus_call_recv`. A send after the half-close (a send with `last`, or
/// `isthmus_call_close_send`) fails with `ISTHMUS_INTERNAL`, as grpc-go's `SendMsg` after
/// `CloseSend`, and the call goes on.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives. Sends from two threads at once both go, in an order they fix themselves.
///
/// # Safety
///
/// `data` is valid for `len` bytes; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_send(
    call: *const isthmus_call_t,
    data: *const u8,
    len: usize,
    last: i32,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let call = CALLS.get(call)?;
        sendable(&call.call)?;
        // SAFETY: the caller's promise, passed on.
        let message = Bytes::copy_from_slice(unsafe { c_bytes(data, len, "the message")? });
        match block_on(call.call.send(message, last != 0)) {
            true => Ok(()),
            false => Err(over()),
        }
    })
}

/// [`isthmus_call_send`] without blocking (`ISTHMUS_OP_SEND`; `code` is `ISTHMUS_CANCELLED`
/// if the call was over). The message is copied before this returns. After the half-close it
/// fails at once with `ISTHMUS_INTERNAL`, as `isthmus_call_send` does. Abandoned before it
/// completes (`isthmus_cq_cancel`, or its queue freed), it cancels the call: part of the
/// message may have gone.
///
/// Thread-safety: any thread; the call's sending side, usable while another thread receives. Sends
/// started from two threads at once go in an order they fix themselves.
///
/// # Safety
///
/// As [`isthmus_call_send`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_send_async(
    call: *const isthmus_call_t,
    data: *const u8,
    len: usize,
    last: i32,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    start_on(CALLS.get(call).map(|c| c.call.clone()), cq, tag, ISTHMUS_OP_SEND, now, status, |shared| {
        sendable(&shared)?;
        // SAFETY: the caller's promise, passed on.
        let message = Bytes::copy_from_slice(unsafe { c_bytes(data, len, "the message")? });
        Ok(async move {
            let abandoned = CancelIfAbandoned(Some(shared.clone()));
            let sent = shared.send(message, last != 0).await;
            abandoned.finished();
            Outcome::done_if(sent, over)
        })
    })
}

/// Cancels its call when dropped before [`finished`](Self::finished): a send abandoned while
/// it waits (`isthmus_cq_cancel`, its queue freed) may have taken flow-control credit, or
/// begun a message in pieces, that the server never gets, and every later send on the call
/// then waited for its end. The header's promise: a call such an operation was making is
/// cancelled.
struct CancelIfAbandoned(Option<std::sync::Arc<SharedCall>>);

impl CancelIfAbandoned {
    fn finished(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelIfAbandoned {
    fn drop(&mut self) {
        if let Some(call) = self.0.take() {
            call.cancel();
        }
    }
}

/// Half-closes: no more request messages.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives.
#[no_mangle]
pub extern "C" fn isthmus_call_close_send(call: *const isthmus_call_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let call = CALLS.get(call)?;
        block_on(call.call.close_send());
        Ok(())
    })
}

/// [`isthmus_call_close_send`] without blocking (`ISTHMUS_OP_CLOSE_SEND`). Abandoned before it
/// completes, it cancels the call, as an abandoned send does.
///
/// Thread-safety: any thread; the call's sending side, usable while another thread receives.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_close_send_async(
    call: *const isthmus_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    start_on(CALLS.get(call).map(|c| c.call.clone()), cq, tag, ISTHMUS_OP_CLOSE_SEND, now, status, |shared| {
        Ok(async move {
            let abandoned = CancelIfAbandoned(Some(shared.clone()));
            shared.close_send().await;
            abandoned.finished();
            Outcome::Done
        })
    })
}

/// Receives the next response message, blocking. `ISTHMUS_OK` with `*message` set: a message
/// (the caller's to free); `ISTHMUS_OK` with `*message` NULL: the server ended the call with
/// OK (its trailers: `isthmus_call_trailers`); any other code: the call failed, and `*status`
/// (if not NULL) holds the server's status with its trailers.
///
/// Thread-safety: any thread, which it blocks; the call's receiving side, usable while another
/// thread sends. Receives from two threads take turns, each message going to one of them.
///
/// # Safety
///
/// `message` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_recv(
    call: *const isthmus_call_t,
    message: *mut *mut isthmus_message_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { entry_out(message, "message", status, || Ok(block_on(CALLS.get(call)?.call.recv())?.map(message_handle))) }
}

/// [`isthmus_call_recv`] without blocking (`ISTHMUS_OP_RECV`: `message`, NULL at the OK end;
/// `status` on failure).
///
/// Thread-safety: any thread; the call's receiving side, usable while another thread sends.
/// Receives started from two threads take turns.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_recv_async(
    call: *const isthmus_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    recv_on(call, cq, tag, now, NO_SPIN, status)
}

/// [`isthmus_call_recv_async`], but a message (or the call's end) that comes within 50 µs is
/// taken on the calling thread and returned in `now`, without the two wake-ups a trip through
/// the queue costs. The thread spins, yielding its core between looks after the first
/// microseconds. The bound is fixed (`isthmus_channel_set_spin` does not change it); a call
/// started with `ISTHMUS_CALL_SPIN` also reads the connection while polled, and may wait
/// longer. For a caller that can spare its thread that long (Go's streams, within their bound
/// on threads held); with a NULL `now` it is [`isthmus_call_recv_async`].
///
/// Thread-safety: any thread, which it may hold for its spin (above); the call's receiving
/// side, as `isthmus_call_recv_async`.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_recv_spin(
    call: *const isthmus_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    recv_on(call, cq, tag, now, isthmus::SpinPolicy::default(), status)
}

/// The two receives of a client call: waiting on the calling thread first for up to `spin`.
fn recv_on(
    call: *const isthmus_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    spin: isthmus::SpinPolicy,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    start_spinning_on(CALLS.get(call).map(|c| c.call.clone()), cq, tag, ISTHMUS_OP_RECV, now, spin, status, |shared| {
        Ok(async move { Outcome::received(shared.recv().await) })
    })
}

/// The server's initial metadata, blocking until it arrives (the caller frees `*headers`).
///
/// Thread-safety: any thread, which it blocks; the call's receiving side (it takes turns with
/// receives), usable while another thread sends.
///
/// # Safety
///
/// `headers` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_headers(
    call: *const isthmus_call_t,
    headers: *mut *mut isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(headers, "headers", status, || Ok(Some(metadata_handle(block_on(CALLS.get(call)?.call.headers())?))))
    }
}

/// [`isthmus_call_headers`] without blocking (`ISTHMUS_OP_HEADERS`: `metadata`).
///
/// Thread-safety: any thread; the call's receiving side, as `isthmus_call_headers`.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_headers_async(
    call: *const isthmus_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    start_on(CALLS.get(call).map(|c| c.call.clone()), cq, tag, ISTHMUS_OP_HEADERS, now, status, |shared| {
        Ok(async move { Outcome::headers(shared.headers().await) })
    })
}

/// A copy of the server's trailing metadata once the call has ended (the caller frees it);
/// NULL while it runs.
///
/// Thread-safety: any thread; it never waits.
#[no_mangle]
pub extern "C" fn isthmus_call_trailers(call: *const isthmus_call_t) -> *mut isthmus_metadata_t {
    guard(std::ptr::null_mut(), || {
        CALLS.get(call).ok().and_then(|c| c.call.trailers()).map_or(std::ptr::null_mut(), metadata_handle)
    })
}

/// A writable block of `len` bytes in this side's shared memory (`shm://` only), for a
/// request built in place: fill it (`isthmus_block_data`), then `isthmus_call_send_block`.
/// Blocks while the arena is full.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives.
///
/// # Safety
///
/// `block` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_alloc(
    call: *const isthmus_call_t,
    len: usize,
    block: *mut *mut isthmus_block_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { entry_out(block, "block", status, || Ok(Some(block_handle(block_on(CALLS.get(call)?.call.alloc(len))?)))) }
}

/// Sends a block from `isthmus_call_alloc` as one request message, with no copy; `last`
/// (non-zero) half-closes with it. The block handle is consumed, sent or not. After the
/// half-close it fails as `isthmus_call_send` does; a block of another connection (another
/// channel's, `isthmus_channel_alloc`'s, or the call's own from before a reconnect) fails
/// `ISTHMUS_INVALID_ARGUMENT`, and the call goes on.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, as `isthmus_call_send`. No
/// other thread may write the block once it is passed here.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_call_send_block(
    call: *const isthmus_call_t,
    block: *mut isthmus_block_t,
    last: i32,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let call = CALLS.get(call);
        let block = take_block(block)?;
        let call = call?;
        sendable(&call.call)?;
        call.call.can_send_block(&block)?;
        match block_on(call.call.send_block(block, last != 0)) {
            true => Ok(()),
            false => Err(over()),
        }
    })
}

/// Cancels the call: the server sees CANCELLED, and a `recv` waiting in another thread
/// returns `ISTHMUS_CANCELLED`. The handle stays valid until freed.
///
/// Thread-safety: any thread, typically another than the one waiting on the call: that wait ends
/// `ISTHMUS_CANCELLED`.
#[no_mangle]
pub extern "C" fn isthmus_call_cancel(call: *const isthmus_call_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        CALLS.get(call)?.call.cancel();
        Ok(())
    })
}

/// Frees a call; one still running is cancelled.
///
/// Thread-safety: any thread, once; operations other threads have under way end (the call is
/// cancelled), and their later uses of the handle fail `ISTHMUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn isthmus_call_free(call: *mut isthmus_call_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let call = CALLS.remove(call)?;
        if call.call.trailers().is_none() {
            call.call.cancel();
        }
        Ok(())
    })
}

/// For the crate's tests: one blocking unary call of `request` on `channel` (an address, so that
/// it crosses to another thread); its code, reply and status (NULL where none came).
#[cfg(test)]
pub(crate) fn unary_for_test(
    channel: usize,
    path: &std::ffi::CStr,
    request: &[u8],
) -> (isthmus_code_t, *mut isthmus_message_t, *mut isthmus_status_t) {
    let (mut reply, mut status) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: a NUL-terminated path, a request valid for its length, NULL options and metadata
    // out-pointers, writable reply and status out-pointers; a channel that is no live handle is
    // refused by the registry.
    let rc = unsafe {
        isthmus_unary(
            channel as *const isthmus_channel_t,
            path.as_ptr(),
            request.as_ptr(),
            request.len(),
            std::ptr::null(),
            &mut reply,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut status,
        )
    };
    (rc, reply, status)
}
