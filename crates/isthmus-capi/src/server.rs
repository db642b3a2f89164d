//! Servers: handlers registered by method path, as C callbacks or as events on a completion
//! queue; each call is handed to its handler as an `isthmus_server_call_t` that the handler
//! answers from any thread, now or later, and ends with `isthmus_server_call_finish`. A thread
//! that spins in `isthmus_cq_take_call` takes a queue's next call before it is queued (`Taker`).

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use isthmus::binding::{block_on, hand_off, runtime, HandedCall, Lender};
use isthmus::{Code, Handler, HandlerFuture, Status};

use crate::abi::{
    c_bytes, c_str, c_str_or_empty, c_strs, entry, entry_out, grpc_code, guard, invalid, isthmus_code_t,
    isthmus_status_t, put,
};
use crate::cq::{
    clear_now, cq_for, cq_get, cq_taker, isthmus_cq_t, isthmus_event_t, start_on, start_trying_on, Outcome, Queue,
    ISTHMUS_OP_DONE, ISTHMUS_OP_NEW_CALL, ISTHMUS_OP_RECV, ISTHMUS_OP_SEND, ISTHMUS_OP_SEND_HEADERS, NO_SPIN,
};
use crate::handle::Registry;
use crate::object::{
    block_handle, isthmus_block_t, isthmus_message_t, isthmus_metadata_t, isthmus_server_call_t, message_handle,
    metadata_arg, metadata_handle, server_call_handle, take_block, SERVER_CALLS,
};
use crate::tls::{isthmus_tls_options_t, TlsPems};

/// A handler callback: called on one of the library's threads for each new call on its path,
/// with the `user_data` given at registration. It must not block for long: hand the call to
/// your own thread or loop, and finish it there (or here, if the answer is at hand). That
/// thread may be the one reading the call's connection, so a blocking library function that
/// waits for the connection (a `recv` whose request is not in, a `send` waiting for the
/// client's credit, `isthmus_server_shutdown` or `_free`) called from the callback waits on
/// itself, and the connection stalls: use the `_async` forms there, or another thread.
pub type isthmus_handler_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, call: *mut isthmus_server_call_t)>;

/// A server: handlers by method path, served on one or more targets at once.
pub struct isthmus_server_t {
    state: Mutex<ServerState>,
    /// Its C callbacks running now.
    callbacks: Arc<Callbacks>,
    /// Its counters, from the moment it starts (kept past a shutdown).
    stats: std::sync::OnceLock<isthmus::ServerStats>,
}

impl isthmus_server_t {
    /// Its counters, once it has started.
    pub(crate) fn stats(&self) -> Option<isthmus::ServerStats> {
        self.stats.get().cloned()
    }
}

enum ServerState {
    /// Taking handlers and options.
    Building {
        server: Box<isthmus::Server>,
        stream_limit: Option<usize>,
        /// The TLS settings, or why they could not be read (reported when the server starts).
        tls: Box<Result<Option<TlsPems>, Status>>,
        /// How replies over HTTP/2 are compressed, or why the flags asked for two ways.
        compression: Result<Option<isthmus::Compression>, Status>,
    },
    /// Serving: `stop` holds when the calls still running are cut off once a shutdown has
    /// begun (the earliest asked for counts); `finished` turns true (or its sender goes) when
    /// the server has stopped.
    Serving {
        stop: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
        finished: tokio::sync::watch::Receiver<bool>,
        /// The HTTP/2 endpoints as clients reach them (with the port chosen for port 0).
        addresses: Vec<std::ffi::CString>,
    },
    /// Stopped, or failed to start.
    Stopped,
}

pub(crate) static SERVERS: Registry<isthmus_server_t> = Registry::new("server");

/// Where a handler's calls go.
enum Deliver {
    Callback {
        f: unsafe extern "C" fn(*mut c_void, *mut isthmus_server_call_t),
        user_data: usize,
        /// The server's, which its free closes.
        callbacks: Arc<Callbacks>,
    },
    Queue {
        cq: Queue,
        tag: u64,
        taker: Arc<Taker>,
    },
}

/// A queue's new calls, offered first to the one thread that spins for one
/// (`isthmus_cq_take_call`): the thread that has just finished a call takes the next with no
/// trip through the queue, whose waiter sleeps and a wake-up costs (tens of µs on two vCPUs;
/// a Go server's unary call took 26-72 µs that way against 4.3-6.0 µs taken). While it spins it
/// reads the connection of the latest call (`Lender::serve_here`, ADR 0020), so the call that
/// comes next on it starts on this thread with no reader in between. At most one thread spins,
/// so idle threads never take both cores.
#[derive(Default)]
pub(crate) struct Taker {
    slot: Mutex<TakerSlot>,
    /// A call waits in the slot: what the spinner watches without the lock.
    ready: AtomicBool,
    /// The queue was freed: no call is taken any more, and a spinner stops.
    closed: AtomicBool,
}

#[derive(Default)]
struct TakerSlot {
    spinning: bool,
    call: Option<(u64, Arc<HandedCall>)>,
    /// The connection of the latest call offered.
    last: Option<Lender>,
}

impl Taker {
    fn lock(&self) -> std::sync::MutexGuard<'_, TakerSlot> {
        // Nothing panics while holding it.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives `call` to the spinner, if one spins with empty hands, else to `queue`; back, if
    /// the queue was freed. Under the lock that `close` takes: a queue freed at that moment
    /// either refuses the call here or finds it among its events when it drains them (it was
    /// queued, after the free's look, to a queue nobody reads). The queuing stays under the
    /// lock, bell and all: queued outside it, a look after queuing would have to finish the
    /// call if the queue was freed meanwhile, and could not tell a call nobody took from one
    /// a handler took and is answering.
    fn deliver(
        &self,
        tag: u64,
        call: Arc<HandedCall>,
        queue: impl FnOnce(Arc<HandedCall>),
    ) -> Result<(), Arc<HandedCall>> {
        let mut slot = self.lock();
        if self.closed.load(Ordering::Acquire) {
            return Err(call);
        }
        if !matches!((&slot.last, call.connection()), (Some(a), Some(b)) if a.same(b)) {
            slot.last = call.connection().cloned();
        }
        if slot.spinning && slot.call.is_none() {
            slot.call = Some((tag, call));
            self.ready.store(true, Ordering::Release);
            return Ok(());
        }
        queue(call);
        Ok(())
    }

    /// Waits up to `spin` for a call offered; `None` at once if another thread spins. A call
    /// offered is taken under the lock that also ends the spin, so none is left behind. A
    /// spin of zero takes only a call offered already, and gives back the connection this
    /// thread may have borrowed, as a wait that took nothing does.
    fn take(&self, spin: Duration) -> Option<(u64, Arc<HandedCall>)> {
        let last = {
            let mut slot = self.lock();
            if slot.spinning || self.closed.load(Ordering::Acquire) {
                return None;
            }
            slot.spinning = true;
            slot.last.clone()
        };
        let spinning = Spinning(self);
        let start = Instant::now();
        let stop = || self.ready.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire);
        if let Some(connection) = last {
            if !spin.is_zero() {
                // A panic there ends that connection (its reader finds the lent receiver
                // poisoned); the slot must still be left right.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    connection.serve_here(spin, stop);
                }));
            }
            // The reading ended without a call for this thread (nothing came, or the call
            // that came went to another handler): the reader task reads on, rather than
            // nobody until the lend's idle bound.
            if !self.ready.load(Ordering::Acquire) {
                connection.give_back();
            }
        }
        // Every look yields the core: the client and the connection's reader may need it for
        // the next call to come at all.
        while !stop() && start.elapsed() < spin {
            std::thread::yield_now();
        }
        std::mem::forget(spinning);
        self.end_spin()
    }

    /// Ends the spin; the call offered meanwhile, if any.
    fn end_spin(&self) -> Option<(u64, Arc<HandedCall>)> {
        let mut slot = self.lock();
        slot.spinning = false;
        self.ready.store(false, Ordering::Release);
        slot.call.take()
    }

    /// The queue is freed: a spinner stops, and no call is taken any more; one offered and
    /// not taken yet is finished UNAVAILABLE.
    pub(crate) fn close(&self) {
        let offered = {
            let mut slot = self.lock();
            self.closed.store(true, Ordering::Release);
            slot.call.take()
        };
        if let Some((_, call)) = offered {
            call.finish(queue_freed());
        }
    }
}

/// Ends a [`Taker::take`] left by a panic: a spinner left marked would be handed every next
/// call, and take none (each would wait for its deadline). A call offered to it fails.
struct Spinning<'a>(&'a Taker);

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        if let Some((_, call)) = self.0.end_spin() {
            call.finish(Status::new(Code::Internal, "the thread taking the call panicked"));
        }
    }
}

impl Handler for Deliver {
    fn handle(self: Arc<Self>, call: isthmus::ServerCall) -> HandlerFuture {
        Box::pin(hand_off(call, move |handed| {
            match &*self {
                Deliver::Callback { f, user_data, callbacks } => {
                    let mut handed = Some(handed);
                    let ran = callbacks.run(|| {
                        let handle = handed.take().map_or(std::ptr::null_mut(), server_call_handle);
                        // SAFETY: the registrant promised a function and user data valid until
                        // the server is freed, which waits for the callbacks under way and
                        // starts none after; the handle is live until the handler finishes it.
                        unsafe { f(*user_data as *mut c_void, handle) };
                    });
                    if !ran {
                        return Err(Status::new(Code::Unavailable, "the server was freed"));
                    }
                }
                // A freed queue is read by nobody: the call would wait there for its deadline.
                Deliver::Queue { cq, tag, taker } => {
                    let queue =
                        |handed| cq.run(*tag, ISTHMUS_OP_NEW_CALL, std::future::ready(Outcome::NewCall(handed)));
                    if taker.deliver(*tag, handed, queue).is_err() {
                        return Err(queue_freed());
                    }
                }
            }
            Ok(())
        }))
    }
}

/// How a call ends whose handler's completion queue was freed before it took the call.
pub(crate) fn queue_freed() -> Status {
    Status::new(Code::Unavailable, "the handler's completion queue was freed")
}

/// A server's C callbacks running now. `isthmus_server_free` closes it: no callback starts
/// after, and the free returns once those under way have returned, so that the handler and its
/// user data need to live no longer than the server. (The engine's connections end on tasks of
/// their own: a callback may still be under way on one when the server has stopped.)
#[derive(Default)]
struct Callbacks {
    running: Mutex<Running>,
    returned: std::sync::Condvar,
}

#[derive(Default)]
struct Running {
    count: usize,
    closed: bool,
}

thread_local! {
    /// The `Callbacks` (by address) of the callbacks under way on this thread: a callback
    /// that frees its own server does not wait for itself.
    static INSIDE: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Callbacks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        // Nothing panics while holding it.
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `callback`, unless the server was freed: `false` then.
    fn run(&self, callback: impl FnOnce()) -> bool {
        {
            let mut running = self.lock();
            if running.closed {
                return false;
            }
            running.count += 1;
        }
        /// Counts the callback out however it returns.
        struct Returned<'a>(&'a Callbacks);
        impl Drop for Returned<'_> {
            fn drop(&mut self) {
                INSIDE.with(|inside| inside.borrow_mut().pop());
                let mut running = self.0.lock();
                running.count -= 1;
                // Only a free waits (it set `closed` first): no wake-up, and no system call,
                // for every call otherwise.
                if running.closed {
                    self.0.returned.notify_all();
                }
            }
        }
        INSIDE.with(|inside| inside.borrow_mut().push(self as *const Callbacks as usize));
        let _returned = Returned(self);
        callback();
        true
    }

    /// Starts no callback from now on, and waits for those under way on other threads.
    fn close(&self) {
        let me = self as *const Callbacks as usize;
        let mine = INSIDE.with(|inside| inside.borrow().iter().filter(|c| **c == me).count());
        let mut running = self.lock();
        running.closed = true;
        while running.count > mine {
            running = self.returned.wait(running).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Options of a server. Zero-initialise it, then set what you need; NULL means defaults.
#[repr(C)]
pub struct isthmus_server_options_t {
    /// The largest request message accepted on every target, in bytes; 0 for the defaults:
    /// 4 GiB over `shm://`, 4 MiB over HTTP/2 (as gRPC's servers), where a request is gathered
    /// in memory before its handler sees it. A larger one fails its call with
    /// RESOURCE_EXHAUSTED and the server goes on.
    pub max_message_size: u64,
    /// Calls one client connection may have open at once; 0 for no limit. Over `shm://` a call
    /// over the limit is refused with RESOURCE_EXHAUSTED; an HTTP/2 connection is told the limit
    /// in its settings (SETTINGS_MAX_CONCURRENT_STREAMS), and its client waits for a place.
    pub max_concurrent_streams: u32,
    /// TLS settings for the server's TCP targets (`https://host:port`, `host:port`,
    /// `[::]:port`…; an `http://` target stays plaintext): its certificate and key, and for
    /// mutual TLS the CAs of its clients' certificates. Copied; checked by
    /// `isthmus_server_start`. NULL: no TLS (an `https://` target then fails to start).
    pub tls: *const isthmus_tls_options_t,
    /// `ISTHMUS_SERVER_*` flags ORed together, or 0; any other bit fails
    /// `isthmus_server_start` `ISTHMUS_INVALID_ARGUMENT`.
    pub flags: u32,
    /// HTTP/2 keepalive (gRPC's server `keepalive_time`): a PING to a client connection of an
    /// HTTP/2 endpoint after this many milliseconds in which nothing arrived from it; 0: none.
    /// If its answer does not come within `keepalive_timeout_ms`, the connection closes and its
    /// calls are cancelled. `shm://` needs none: a client that dies there is seen at once.
    pub keepalive_time_ms: u64,
    /// How long a keepalive PING's answer may take, in milliseconds; 0 for gRPC's 20 s.
    pub keepalive_timeout_ms: u64,
    /// The longest an HTTP/2 connection may live, in milliseconds (gRPC's
    /// `MAX_CONNECTION_AGE`); 0: no limit. At that age it gets a GOAWAY: its client opens a new
    /// connection for its next calls, and those in progress finish on the old one. `shm://`
    /// connections have no age limit.
    pub max_connection_age_ms: u64,
    /// How long calls in progress may go on after that GOAWAY, in milliseconds (gRPC's
    /// `MAX_CONNECTION_AGE_GRACE`): then the connection closes and they are cancelled, their
    /// clients seeing UNAVAILABLE. 0: for ever (grpc-go's zero value too).
    pub max_connection_age_grace_ms: u64,
}

/// Server flag: the handlers' replies to HTTP/2 calls go compressed with gzip, to each client
/// whose `grpc-accept-encoding` lists it (grpc's clients do); others get them as they are.
/// Replies over `shm://` cross no wire and go as they are.
pub const ISTHMUS_SERVER_COMPRESS_GZIP: u32 = 1;

/// Server flag: as `ISTHMUS_SERVER_COMPRESS_GZIP` with `deflate`. Both flags together fail
/// `isthmus_server_start` with INVALID_ARGUMENT.
pub const ISTHMUS_SERVER_COMPRESS_DEFLATE: u32 = 2;

/// A new server with no handlers. Free it with `isthmus_server_free`.
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `opts` is NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_new(opts: *const isthmus_server_options_t) -> *mut isthmus_server_t {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller promises NULL or a valid struct.
        let opts = unsafe { opts.as_ref() };
        let stream_limit = opts.map(|o| o.max_concurrent_streams).filter(|l| *l > 0).map(|l| l as usize);
        // SAFETY: the caller promises NULL or a valid struct, whose strings are NULL or
        // NUL-terminated. What is wrong with them `isthmus_server_start` reports: this function
        // has no status to say it with.
        let tls = Box::new(unsafe { TlsPems::copy(opts.map_or(std::ptr::null(), |o| o.tls)) });
        let flags = opts.map_or(0, |o| o.flags);
        let known = ISTHMUS_SERVER_COMPRESS_GZIP | ISTHMUS_SERVER_COMPRESS_DEFLATE;
        // A flag this library does not know (a newer header's) is refused at start, with the
        // other settings this function cannot report.
        let compression = match flags & !known {
            0 => crate::client::compression(
                flags & ISTHMUS_SERVER_COMPRESS_GZIP != 0,
                flags & ISTHMUS_SERVER_COMPRESS_DEFLATE != 0,
                "ISTHMUS_SERVER_COMPRESS_GZIP and _DEFLATE together",
            ),
            unknown => Err(invalid(format!("unknown server flags {unknown:#x}"))),
        };
        let mut server = isthmus::Server::builder();
        if let Some(limit) = opts.map(|o| o.max_message_size).filter(|l| *l > 0) {
            server = server.max_message_size(limit);
        }
        if let Some(k) = opts.and_then(|o| crate::client::keepalive(o.keepalive_time_ms, o.keepalive_timeout_ms)) {
            server = server.keepalive(k.time, k.timeout);
        }
        if let Some(o) = opts.filter(|o| o.max_connection_age_ms > 0) {
            server = server.max_connection_age(Duration::from_millis(o.max_connection_age_ms));
            if o.max_connection_age_grace_ms > 0 {
                server = server.max_connection_age_grace(Duration::from_millis(o.max_connection_age_grace_ms));
            }
        }
        let state = ServerState::Building { server: Box::new(server), stream_limit, tls, compression };
        SERVERS.add(isthmus_server_t {
            state: Mutex::new(state),
            callbacks: Arc::default(),
            stats: std::sync::OnceLock::new(),
        })
    })
}

/// Registers a handler before the server starts. `path` names one method
/// (`/package.Service/Method`); NULL or "" takes every path no other handler takes.
fn add_handler(server: *const isthmus_server_t, path: Option<&str>, deliver: Deliver) -> Result<(), Status> {
    let handler: Arc<dyn Handler> = Arc::new(deliver);
    let path = path.filter(|p| !p.is_empty());
    build_at(server, path, |b| match path {
        Some(path) => b.handler_object(path, handler),
        None => b.fallback(handler),
    })
}

/// Changes the engine's server with `f` (a handler or a topic added), before it starts.
pub(crate) fn build(
    server: *const isthmus_server_t,
    f: impl FnOnce(isthmus::Server) -> isthmus::Server,
) -> Result<(), Status> {
    let server = SERVERS.get(server)?;
    let mut state = server.state.lock().map_err(|_| invalid("server state poisoned"))?;
    let ServerState::Building { server: builder, .. } = &mut *state else {
        return Err(Status::new(Code::FailedPrecondition, "handlers must be added before the server starts"));
    };
    let b = std::mem::take(&mut **builder);
    **builder = f(b);
    Ok(())
}

/// [`build`] for what serves `path` (None: the fallback). A path with no `/` after its leading
/// one, or nothing after its last, would never be called: INVALID_ARGUMENT. One already served:
/// ALREADY_EXISTS, as grpc-go refuses a service registered twice, where the engine's builder
/// would replace the first quietly and its handler (or queue) would never hear of a call again.
pub(crate) fn build_at(
    server: *const isthmus_server_t,
    path: Option<&str>,
    f: impl FnOnce(isthmus::Server) -> isthmus::Server,
) -> Result<(), Status> {
    if let Some(path) = path {
        // grpc-go's rule for the paths it routes: a leading `/`, then a service and a method
        // split at the last `/`. One without that `/`, or with no method after it, no call names.
        let method = path.strip_prefix('/').and_then(|p| p.rsplit_once('/'));
        if method.is_none_or(|(_, method)| method.is_empty()) {
            return Err(invalid(format!("the path {path:?} is no /package.Service/Method")));
        }
    }
    let mut taken = false;
    build(server, |b| {
        taken = b.handles(path);
        if taken {
            b
        } else {
            f(b)
        }
    })?;
    if taken {
        let what = path.map_or_else(|| "the fallback (a NULL or empty path)".to_owned(), |p| format!("the path {p}"));
        return Err(Status::new(Code::AlreadyExists, format!("{what} has a handler already")));
    }
    Ok(())
}

/// The optional path argument of the `add_handler` functions.
///
/// # Safety
///
/// `path` is NULL or NUL-terminated.
unsafe fn path_arg<'a>(path: *const c_char) -> Result<Option<&'a str>, Status> {
    if path.is_null() {
        return Ok(None);
    }
    // SAFETY: not NULL; NUL-terminated by the caller's promise.
    unsafe { c_str(path, "the path") }.map(Some)
}

/// Registers `handler` for `path` (NULL or "": every other path), called with `user_data` for
/// each new call. Before `isthmus_server_start` only. A path that is no
/// `/package.Service/Method` (a leading `/`, and a method after the last `/`, as grpc-go
/// routes them) is `ISTHMUS_INVALID_ARGUMENT`; one already registered (by either
/// `add_handler` function or a topic), or a second fallback, `ISTHMUS_ALREADY_EXISTS`.
///
/// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them). `handler` is
/// called on the library's threads, for several calls at once.
///
/// # Safety
///
/// `path` is NULL or NUL-terminated; `handler` and `user_data` stay valid until the server is
/// freed; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_add_handler(
    server: *const isthmus_server_t,
    path: *const c_char,
    handler: isthmus_handler_fn,
    user_data: *mut c_void,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let f = handler.ok_or_else(|| invalid("the handler is NULL"))?;
        // SAFETY: the caller's promise, passed on.
        let path = unsafe { path_arg(path)? };
        let callbacks = SERVERS.get(server)?.callbacks.clone();
        add_handler(server, path, Deliver::Callback { f, user_data: user_data as usize, callbacks })
    })
}

/// Registers `path` (NULL or "": every other path) to deliver its calls as events on `cq`
/// (`ISTHMUS_OP_NEW_CALL`, with `tag` and the call in `server_call`). Before
/// `isthmus_server_start` only; paths are checked as `isthmus_server_add_handler`'s. The queue
/// should outlive the server: a call that comes once it is freed fails UNAVAILABLE.
///
/// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them). The new calls'
/// events go to whichever thread takes them from `cq`.
///
/// # Safety
///
/// `path` is NULL or NUL-terminated; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_add_handler_cq(
    server: *const isthmus_server_t,
    path: *const c_char,
    cq: *const isthmus_cq_t,
    tag: u64,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let taker = cq_taker(cq)?;
        let cq = cq_get(cq)?;
        // SAFETY: the caller's promise, passed on.
        let path = unsafe { path_arg(path)? };
        add_handler(server, path, Deliver::Queue { cq, tag, taker })
    })
}

/// Waits up to `spin_us` microseconds on the calling thread for a new call of a handler
/// registered on `cq` (`isthmus_server_add_handler_cq`), and takes it: `*tag` and `*call` are
/// set as its `ISTHMUS_OP_NEW_CALL` event would set them, and that event never comes. `*call`
/// is NULL (and `*tag` 0) if none came in time, or at once if another thread waits here
/// already (one thread waits at a time), and on an error. Meant for the thread that has just
/// finished a call: the next call then reaches it with no wake-up of the queue's waiter. Calls
/// that come while nobody waits here go to the queue as before. The thread also reads the
/// connection of the latest call meanwhile, so a call on it may start (and a callback handler
/// run) on this thread; the connection goes back to its reader when the wait takes nothing. A
/// `spin_us` of 0 takes only a call offered already, and gives that connection back: for a
/// thread that will not wait again soon. Freeing the queue ends a wait with no call.
///
/// Thread-safety: any thread, which it holds for up to `spin_us`, and longer while a callback
/// handler runs on it (above).
///
/// # Safety
///
/// `tag` and `call` are writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_cq_take_call(
    cq: *const isthmus_cq_t,
    spin_us: u32,
    tag: *mut u64,
    call: *mut *mut isthmus_server_call_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        // SAFETY: each is NULL or writable by the caller's promise. Set first, so that a
        // failure below (a queue that is no live handle) leaves no earlier call's handle there.
        unsafe {
            put(tag, 0);
            put(call, std::ptr::null_mut());
        }
        if tag.is_null() || call.is_null() {
            return Err(invalid("tag or call is NULL"));
        }
        let taker = cq_taker(cq)?;
        let taken = taker.take(Duration::from_micros(u64::from(spin_us)));
        let (t, handle) = match taken {
            Some((t, handed)) => (t, server_call_handle(handed)),
            None => (0, std::ptr::null_mut()),
        };
        // SAFETY: both checked not NULL; the caller promises them writable.
        unsafe {
            tag.write(t);
            call.write(handle);
        }
        Ok(())
    })
}

/// Binds every target in `targets` (`count` NUL-terminated strings: `shm://NAME`,
/// `unix:///path.sock`, `http://host:port`) and starts serving them in the background.
/// Clients can connect as soon as this returns. A server starts once; a start that fails (a
/// target that does not parse or bind, TLS settings that do not load) leaves it as it was,
/// handlers and options kept, to be started again.
///
/// Thread-safety: any thread, which it blocks while it binds; of two calls at once, one starts the
/// server and the other fails `ISTHMUS_FAILED_PRECONDITION`.
///
/// # Safety
///
/// `targets` is valid for `count` NUL-terminated strings; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_start(
    server: *const isthmus_server_t,
    targets: *const *const c_char,
    count: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let server = SERVERS.get(server)?;
        if targets.is_null() || count == 0 {
            return Err(invalid("no target to serve"));
        }
        // SAFETY: the caller promises `count` valid string pointers; a count no array holds is
        // refused before any is read.
        let list = unsafe { c_strs(targets, count, "the targets")? };
        let mut state = server.state.lock().map_err(|_| invalid("server state poisoned"))?;
        let ServerState::Building { server: builder, stream_limit, tls, compression } = &*state else {
            let why = match &*state {
                ServerState::Stopped => "the server was shut down",
                _ => "the server was started already",
            };
            return Err(Status::new(Code::FailedPrecondition, why));
        };
        // A copy is bound: a start that fails (a target that does not parse or bind, bad TLS
        // settings) leaves the server as it was, its handlers and options kept for another try.
        let mut builder = (**builder).clone();
        if let Some(compression) = compression.clone()? {
            builder = builder.send_compressed(compression);
        }
        if let Some(tls) = tls.as_ref().as_ref().map_err(Clone::clone)? {
            builder = builder.tls_config(tls.server()?);
        }
        if let Some(limit) = *stream_limit {
            builder = builder.max_concurrent_streams(limit);
        }
        let _runtime = runtime().enter();
        let bound = builder.bind_all(list.iter().copied())?;
        let _ = server.stats.set(bound.stats());
        let addresses = bound.http_addresses().into_iter().filter_map(|a| std::ffi::CString::new(a).ok()).collect();
        let (stop, stopped) = tokio::sync::watch::channel(None);
        let (ended, finished) = tokio::sync::watch::channel(false);
        runtime().spawn(async move {
            let _ = bound.serve_until_deadline(stopped).await;
            ended.send_replace(true);
        });
        *state = ServerState::Serving { stop, finished, addresses };
        Ok(())
    })
}

/// The `index`th HTTP/2 endpoint of a serving server as clients reach it (`unix:///path`,
/// `http://host:port` with the port the system chose for port 0), NUL-terminated and valid
/// until the server is shut down; NULL past the last one or if it does not serve.
///
/// Thread-safety: any thread; the string goes with the shutdown, so do not shut the server down on
/// another thread while it is in use.
#[no_mangle]
pub extern "C" fn isthmus_server_http_address(server: *const isthmus_server_t, index: usize) -> *const c_char {
    guard(std::ptr::null(), || {
        let Ok(server) = SERVERS.get(server) else { return std::ptr::null() };
        let Ok(state) = server.state.lock() else { return std::ptr::null() };
        match &*state {
            // The string lives in the state until shutdown replaces it.
            ServerState::Serving { addresses, .. } => addresses.get(index).map_or(std::ptr::null(), |a| a.as_ptr()),
            _ => std::ptr::null(),
        }
    })
}

/// Shuts the server down gracefully, blocking until it has: its sockets go, clients are told
/// to go away, new calls are refused with UNAVAILABLE, and calls in progress get `grace_ms`
/// milliseconds to finish before their connections close. The handle stays valid (free it
/// with `isthmus_server_free`). A server shut down before it started never starts:
/// `isthmus_server_start` then fails `ISTHMUS_FAILED_PRECONDITION`, as grpc-go's `Serve`
/// after `Stop` does.
///
/// Thread-safety: any thread, which it blocks. A second call meanwhile (or an
/// `isthmus_server_free`) waits for the shutdown to finish, and ends its grace period sooner if
/// its own would end sooner (grpc-go's `Stop` during `GracefulStop`). From a handler of this
/// server, its own unfinished call holds the shutdown for the whole grace period.
#[no_mangle]
pub extern "C" fn isthmus_server_shutdown(server: *const isthmus_server_t, grace_ms: u64) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let server = SERVERS.get(server)?;
        stop(&server, Duration::from_millis(grace_ms));
        Ok(())
    })
}

/// Stops a serving server and waits until it has stopped; a stop already under way is waited
/// for the same way, its grace cut to this one's if that ends sooner.
fn stop(server: &isthmus_server_t, grace: Duration) {
    let Ok(mut state) = server.state.lock() else { return };
    let mut finished = match &*state {
        ServerState::Serving { stop, finished, .. } => {
            isthmus::stop_by(stop, grace);
            finished.clone()
        }
        // Stopped before it started: it never starts (grpc-go's `Serve` after `Stop` fails).
        ServerState::Building { .. } => {
            *state = ServerState::Stopped;
            return;
        }
        ServerState::Stopped => return,
    };
    drop(state);
    // Err: the serving task is gone (it panicked), which ends the server too.
    let _ = block_on(finished.wait_for(|done| *done));
    if let Ok(mut state) = server.state.lock() {
        *state = ServerState::Stopped;
    }
}

/// Frees a server, shutting it down first (with no grace) if it serves. It returns once no
/// handler callback of the server runs on another thread, and none starts after: a call that
/// comes meanwhile fails UNAVAILABLE. The handlers' user data may be freed then.
///
/// Thread-safety: any thread, once, which it blocks while the server stops and its callbacks
/// return; as `isthmus_server_shutdown` otherwise.
#[no_mangle]
pub extern "C" fn isthmus_server_free(server: *mut isthmus_server_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let server = SERVERS.remove(server)?;
        stop(&server, Duration::ZERO);
        server.callbacks.close();
        Ok(())
    })
}

// ---- the server's side of a call ----

fn handed(call: *const isthmus_server_call_t) -> Result<Arc<HandedCall>, Status> {
    Ok(SERVER_CALLS.get(call)?.call.clone())
}

/// Bytes the call holds (its path, its peer…) as a pointer valid until the call is finished,
/// their length in `*len`; NULL (length 0) for an invalid handle or bytes it does not have.
///
/// # Safety
///
/// `len` is NULL or writable.
unsafe fn call_bytes(
    call: *const isthmus_server_call_t,
    len: *mut usize,
    part: impl FnOnce(&HandedCall) -> Option<&[u8]>,
) -> *const u8 {
    guard(std::ptr::null(), || {
        let got = SERVER_CALLS.get(call);
        // The bytes live in the HandedCall, which the registry holds until `finish`.
        let (p, n) =
            got.as_ref().ok().and_then(|c| part(&c.call)).map_or((std::ptr::null(), 0), |b| (b.as_ptr(), b.len()));
        // SAFETY: the caller promises `len` is NULL or writable.
        unsafe { put(len, n) };
        p
    })
}

/// The call's method path (not NUL-terminated; its length in `*len`), valid until the call
/// is finished.
///
/// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
/// thread while they are in use.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_path(call: *const isthmus_server_call_t, len: *mut usize) -> *const u8 {
    // SAFETY: the caller's promise, passed on.
    unsafe { call_bytes(call, len, |c| Some(c.path().as_bytes())) }
}

/// The client's address (not NUL-terminated; its length in `*len`), valid until the call is
/// finished: gRPC's forms (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:/path.sock`) over
/// HTTP/2, and over `shm://` the client process's credentials (`shm:pid=123,uid=1000`). NULL
/// (length 0) for an invalid handle.
///
/// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
/// thread while they are in use.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_peer(call: *const isthmus_server_call_t, len: *mut usize) -> *const u8 {
    // SAFETY: the caller's promise, passed on.
    unsafe { call_bytes(call, len, |c| Some(c.peer().as_bytes())) }
}

/// 1 if the call came over TLS, 0 if not (or for an invalid handle).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_server_call_is_tls(call: *const isthmus_server_call_t) -> i32 {
    guard(0, || handed(call).map_or(0, |c| i32::from(c.is_tls())))
}

/// The client's certificate, DER-encoded (its length in `*len`), for a call that came over
/// mutual TLS; NULL (length 0) for any other call. Valid until the call is finished.
///
/// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
/// thread while they are in use.
///
/// # Safety
///
/// `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_peer_cert(
    call: *const isthmus_server_call_t,
    len: *mut usize,
) -> *const u8 {
    // SAFETY: the caller's promise, passed on.
    unsafe { call_bytes(call, len, |c| c.peer_certificate().map(|p| p.der())) }
}

/// A copy of the client's initial metadata (the caller frees it); NULL for an invalid handle.
///
/// Thread-safety: any thread; the copy is the caller's alone.
#[no_mangle]
pub extern "C" fn isthmus_server_call_metadata(call: *const isthmus_server_call_t) -> *mut isthmus_metadata_t {
    guard(std::ptr::null_mut(), || handed(call).map_or(std::ptr::null_mut(), |c| metadata_handle(c.metadata().clone())))
}

/// Microseconds left before the client's deadline; -1 if it set none.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_server_call_time_remaining_us(call: *const isthmus_server_call_t) -> i64 {
    guard(-1, || handed(call).map_or(-1, |c| micros_left(&c)))
}

/// Microseconds left before a call's deadline; -1 if it has none.
fn micros_left(call: &HandedCall) -> i64 {
    call.time_remaining().map_or(-1, |t| t.as_micros().min(i64::MAX as u128) as i64)
}

/// What a unary handler asks first, in one call: the client's initial metadata (`*metadata`, a
/// copy the caller frees; NULL when there is none: the client's user agent is in it as
/// `user-agent` when the client named one), the microseconds left before its
/// deadline (`*time_remaining_us`, -1 if it set none), and its request if that is in already:
/// then `*now` is written as [`isthmus_server_call_recv_async`] with `flags` 0 would write it
/// (`ISTHMUS_OP_RECV`, tag 0: the message, NULL if the client half-closed without one, or the
/// failure) and 1 is returned. 0 if the request has not come yet: receive it with
/// `isthmus_server_call_recv_async`. -1, with nothing written, for an invalid handle or a NULL
/// pointer. For a handler that runs on the connection's reading thread: one crossing of the
/// boundary where it would make five.
///
/// Thread-safety: any thread; the call's receiving side, as a receive.
///
/// # Safety
///
/// `metadata`, `time_remaining_us` and `now` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_begin(
    call: *const isthmus_server_call_t,
    metadata: *mut *mut isthmus_metadata_t,
    time_remaining_us: *mut i64,
    now: *mut isthmus_event_t,
) -> i32 {
    guard(-1, || {
        if metadata.is_null() || time_remaining_us.is_null() || now.is_null() {
            return -1;
        }
        let Ok(call) = handed(call) else { return -1 };
        let md = match call.metadata().is_empty() {
            true => std::ptr::null_mut(),
            false => metadata_handle(call.metadata().clone()),
        };
        let left = micros_left(&call);
        let received = call.try_recv();
        // SAFETY: all three are not NULL, and the ABI's rules make them writable.
        unsafe {
            metadata.write(md);
            time_remaining_us.write(left);
            match received {
                Some(r) => {
                    now.write(Outcome::received(r).event(0, ISTHMUS_OP_RECV));
                    1
                }
                None => 0,
            }
        }
    })
}

/// 1 if the client has half-closed and every request it sent has been taken (received, or
/// given by [`isthmus_server_call_begin`]); 0 if not yet, while another thread receives, and
/// for an invalid handle. For a handler of a method that takes one request: having taken it,
/// 1 says no second one comes, without a receive; 0 asks for one, which gives the end of the
/// stream or the second request (gRPC's servers fail such a call INTERNAL, "cardinality
/// violation").
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_server_call_half_closed(call: *const isthmus_server_call_t) -> i32 {
    guard(0, || handed(call).map_or(0, |c| i32::from(c.half_closed())))
}

/// 1 while the call runs (not finished, not cancelled by the client, deadline not passed);
/// 0 otherwise.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_server_call_is_active(call: *const isthmus_server_call_t) -> i32 {
    guard(0, || handed(call).map_or(0, |c| i32::from(c.is_active())))
}

/// 1 once the call's initial metadata has gone or is on its way: sent by
/// `isthmus_server_call_send_headers`, by a receive with `ISTHMUS_RECV_FLUSH_HEADERS` that had
/// to wait (decided by the time `isthmus_server_call_recv_async` returns), or with a first
/// response; 0 before, and for an invalid handle. A receive that found its request in sends
/// nothing.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_server_call_headers_sent(call: *const isthmus_server_call_t) -> i32 {
    guard(0, || handed(call).map_or(0, |c| i32::from(c.has_responded())))
}

/// Receive flag: if the call has sent nothing yet and must wait for a request, send its
/// (empty) initial metadata first. A client that sends its first request only once the
/// response has opened (tonic's generated streaming clients do) is then not left waiting on a
/// handler that waits for that request; initial metadata can no longer be sent once it has
/// (`isthmus_server_call_headers_sent`). A receive that finds its request in sends nothing.
pub const ISTHMUS_RECV_FLUSH_HEADERS: u32 = 1;

/// Receive flag for `isthmus_server_call_recv_async` with a `now` event: a request that comes
/// within 50 µs (a fixed bound) is taken on the calling thread and returned in `now`, without
/// the two wake-ups a trip through the queue costs (as `isthmus_call_recv_spin` on the
/// client's side). The thread spins, yielding its core between looks after the first
/// microseconds; over `shm://`, while its call is the only one open on the connection, it reads
/// the connection itself meanwhile, so the request needs no hand-over from the library's reader.
pub const ISTHMUS_RECV_SPIN: u32 = 2;

/// `flags` of a receive, if it knows each: an older library refuses a flag it does not know
/// (`ISTHMUS_INVALID_ARGUMENT`), as every other flags argument does, instead of dropping it.
fn recv_flags(flags: u32) -> Result<(), Status> {
    match flags & !(ISTHMUS_RECV_FLUSH_HEADERS | ISTHMUS_RECV_SPIN) {
        0 => Ok(()),
        unknown => Err(invalid(format!("unknown receive flags {unknown:#x}"))),
    }
}

/// Receives the next request message, blocking: `ISTHMUS_OK` with `*message` set, or with
/// `*message` NULL once the client has half-closed; another code if the call is over. With
/// `flags` 0 it sends nothing, so `isthmus_server_call_send_headers` works after it; see
/// `ISTHMUS_RECV_FLUSH_HEADERS` for request-streaming handlers. An unknown flag is
/// `ISTHMUS_INVALID_ARGUMENT`.
///
/// Thread-safety: any thread, which it blocks; the call's receiving side, usable while another
/// thread sends (receives from two threads take turns).
///
/// # Safety
///
/// `message` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_recv(
    call: *const isthmus_server_call_t,
    flags: u32,
    message: *mut *mut isthmus_message_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    let flush = flags & ISTHMUS_RECV_FLUSH_HEADERS != 0;
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(message, "message", status, || {
            recv_flags(flags)?;
            Ok(block_on(handed(call)?.recv(flush))?.map(message_handle))
        })
    }
}

/// [`isthmus_server_call_recv`] without blocking (`ISTHMUS_OP_RECV`); an unknown flag is
/// `ISTHMUS_INVALID_ARGUMENT`, returned at once.
///
/// Thread-safety: any thread, which it holds up to 50 µs with `ISTHMUS_RECV_SPIN` only; the call's
/// receiving side, usable while another thread sends.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_recv_async(
    call: *const isthmus_server_call_t,
    flags: u32,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    let flush = flags & ISTHMUS_RECV_FLUSH_HEADERS != 0;
    let spin = match flags & ISTHMUS_RECV_SPIN != 0 {
        true => isthmus::SpinPolicy::default(),
        false => NO_SPIN,
    };
    // A spinning receive first reads the connection itself while its call is alone there (ADR
    // 0029): the request then comes without a hand-over from the connection's reader; the spin
    // that follows has what is left of the bound. Not a receive that must flush the initial
    // metadata first: its client may wait for them before it sends. (`read_for_request` looks
    // first: a `try_recv` that finds nothing has the reader task take the connection back, as
    // for a receive that waits.)
    let at_hand = |call: &Arc<HandedCall>, spin: &mut isthmus::SpinPolicy| {
        if !spin.max.is_zero() && (!flush || call.has_responded()) {
            let start = std::time::Instant::now();
            call.read_for_request(spin.max);
            let spent = start.elapsed();
            spin.max = spin.max.saturating_sub(spent);
            spin.yield_after = spin.yield_after.saturating_sub(spent);
        }
        call.try_recv().map(Outcome::received)
    };
    let call = recv_flags(flags).and_then(|()| handed(call));
    start_trying_on(call, cq, tag, ISTHMUS_OP_RECV, now, spin, status, at_hand, |call| {
        Ok(async move { Outcome::received(call.recv(flush).await) })
    })
}

/// Asks for an event (`ISTHMUS_OP_DONE`, with `tag`) on `cq` when the call is over: finished,
/// cancelled by its client (or its connection's end), or past its deadline. If it is over
/// already, the event is queued at once. A handler that works on after its client gave up
/// learns of it this way. An operation like the `_async` ones: `tag` is taken until its event
/// is, and `isthmus_cq_cancel` abandons it.
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_done_async(
    call: *const isthmus_server_call_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let (call, cq) = (handed(call)?, cq_for(cq, tag)?);
        // An operation of the queue like any other, pending until the call is over: its tag is
        // taken meanwhile, and `isthmus_cq_cancel` abandons it. A call over already drops the
        // callback, and with it the sender: the wait ends at once.
        let (over, ended) = tokio::sync::oneshot::channel::<()>();
        call.add_done_callback(Box::new(move || {
            let _ = over.send(());
        }));
        cq.run(tag, ISTHMUS_OP_DONE, async move {
            let _ = ended.await;
            Outcome::Done
        });
        Ok(())
    })
}

/// Sends one response message (copied), blocking while flow control holds it back.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives. Sends from two threads at once take turns, in an order they fix themselves.
///
/// # Safety
///
/// `data` is valid for `len` bytes; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_send(
    call: *const isthmus_server_call_t,
    data: *const u8,
    len: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let call = handed(call)?;
        // SAFETY: the caller's promise, passed on.
        let message = unsafe { c_bytes(data, len, "the message")? };
        block_on(call.send(message))
    })
}

/// [`isthmus_server_call_send`] without blocking (`ISTHMUS_OP_SEND`); the message is copied
/// before this returns.
///
/// Thread-safety: any thread; the call's sending side, usable while another thread receives. Sends
/// started from two threads at once go in an order they fix themselves.
///
/// # Safety
///
/// As [`isthmus_server_call_send`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_send_async(
    call: *const isthmus_server_call_t,
    data: *const u8,
    len: usize,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    start_on(handed(call), cq, tag, ISTHMUS_OP_SEND, now, status, |call| {
        // SAFETY: the caller's promise, passed on.
        let message = unsafe { c_bytes(data, len, "the message")? }.to_vec();
        Ok(async move { Outcome::done(call.send(&message).await) })
    })
}

/// A unary handler's whole answer: sends `data` as the response message, then finishes the
/// call OK with `trailers` (NULL for none; copied) and frees the handle, as
/// [`isthmus_server_call_send_async`] followed by `isthmus_server_call_finish(call, ISTHMUS_OK,
/// NULL, trailers, NULL)` would. A small reply that can go at once (the usual case) goes from
/// this thread with nothing queued, and the event is in `now`; otherwise the send goes on in
/// the queue and the call is finished once it is done. The event (`ISTHMUS_OP_SEND`) says
/// whether the message went; a send that failed finished the call with its status.
///
/// The handle is freed whatever happens, as by `isthmus_server_call_finish`: a `data` that is
/// NULL with a length, a `trailers` or `cq` that is no live handle, a `tag` that names an
/// operation still pending on `cq` (`isthmus_server_call_done_async`'s, say: give the reply a
/// tag of its own), or a `cq` made before a `fork` still ends the call (INTERNAL, saying which)
/// and returns the code that says why (`ISTHMUS_INVALID_ARGUMENT`, or
/// `ISTHMUS_FAILED_PRECONDITION` for the fork), with no event.
///
/// Thread-safety: any thread, exactly once, in place of `isthmus_server_call_finish`; operations
/// other threads start on the call afterwards fail `ISTHMUS_INVALID_ARGUMENT`.
///
/// # Safety
///
/// `data` is valid for `len` bytes; `now` is NULL or writable; `status` is NULL or writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn isthmus_server_call_reply_async(
    call: *mut isthmus_server_call_t,
    data: *const u8,
    len: usize,
    trailers: *const isthmus_metadata_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    clear_now(now);
    entry(status, || {
        let call = SERVER_CALLS.remove(call)?.call.clone();
        // SAFETY: the caller's promise, passed on.
        let args = unsafe { c_bytes(data, len, "the message") }
            .and_then(|message| Ok((message, metadata_arg(trailers)?, cq_for(cq, tag)?)));
        let (message, trailers, cq) = match args {
            Ok(args) => args,
            Err(bad) => {
                call.finish(Status::new(Code::Internal, format!("the handler's reply failed: {}", bad.message())));
                return Err(bad);
            }
        };
        let ok = move || Status::new(Code::Ok, "").with_metadata(trailers.clone());
        if call.try_reply(message, &ok) {
            match now.is_null() {
                true => cq.run(tag, ISTHMUS_OP_SEND, std::future::ready(Outcome::Done)),
                // SAFETY: `now` is not NULL, and the ABI's rules make it writable.
                false => unsafe { now.write(Outcome::Done.event(tag, ISTHMUS_OP_SEND)) },
            }
            return Ok(());
        }
        let message = message.to_vec();
        // The operation owns the call now (its handle is gone): if the operation is dropped
        // unfinished (its tag cancelled, its queue freed), the guard ends the call, which
        // would otherwise wait for its deadline with nobody left to finish it.
        let call = FinishOnDrop(call);
        cq.start(
            tag,
            ISTHMUS_OP_SEND,
            async move {
                let sent = call.0.send(&message).await;
                call.0.finish(sent.as_ref().map_or_else(Status::clone, |_| ok()));
                Outcome::done(sent)
            },
            now,
        );
        Ok(())
    })
}

/// A handed call that an operation on a queue owns: finished CANCELLED when dropped, if the
/// operation did not finish it first (`HandedCall::finish` does nothing the second time).
struct FinishOnDrop(Arc<HandedCall>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finish(Status::new(Code::Cancelled, "the reply's operation was cancelled before the reply went"));
    }
}

/// Sends initial metadata now (otherwise the first message sends empty metadata), blocking.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_send_headers(
    call: *const isthmus_server_call_t,
    metadata: *const isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let (call, md) = (handed(call)?, metadata_arg(metadata)?);
        block_on(call.send_headers(md))
    })
}

/// [`isthmus_server_call_send_headers`] without blocking (`ISTHMUS_OP_SEND_HEADERS`).
///
/// Thread-safety: any thread; the call's sending side, usable while another thread receives.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_send_headers_async(
    call: *const isthmus_server_call_t,
    metadata: *const isthmus_metadata_t,
    cq: *const isthmus_cq_t,
    tag: u64,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    let md = metadata_arg(metadata);
    start_on(handed(call), cq, tag, ISTHMUS_OP_SEND_HEADERS, now, status, |call| {
        let md = md?;
        Ok(async move { Outcome::done(call.send_headers(md).await) })
    })
}

/// Chooses how the call's replies are compressed where they cross a wire, as grpc-go's
/// `grpc.SetSendCompressor` and grpcio's `context.set_compression`: `encoding` is `"gzip"`,
/// `"deflate"` or `"identity"` (uncompressed, even where the server compresses its replies,
/// `ISTHMUS_SERVER_COMPRESS_*`). It applies to calls that came over HTTP/2, for a client whose
/// `grpc-accept-encoding` lists the encoding (the others get the replies uncompressed); over
/// `shm://` nothing is compressed, and it changes nothing. The choice goes with the initial
/// metadata: FAILED_PRECONDITION, and nothing changed, once they or a message have gone or begun
/// to go; INVALID_ARGUMENT for a NULL or another name. Made while another thread holds the call
/// (an `isthmus_server_call_alloc` waiting for room), the choice waits for the first send.
///
/// Thread-safety: any thread; it never blocks.
///
/// # Safety
///
/// `encoding` is NULL or a NUL-terminated string; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_set_compression(
    call: *const isthmus_server_call_t,
    encoding: *const c_char,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let call = handed(call)?;
        // SAFETY: the caller promises NULL or a NUL-terminated string, read only here.
        let name = unsafe { c_str(encoding, "encoding") }?;
        let compression =
            match name {
                "identity" => None,
                _ => Some(isthmus::Compression::from_name(name).ok_or_else(|| {
                    invalid(format!("no compression {name:?}: \"gzip\", \"deflate\" or \"identity\""))
                })?),
            };
        match call.set_compression(compression) {
            true => Ok(()),
            false => Err(Status::new(
                Code::FailedPrecondition,
                "the call's compression is chosen before its initial metadata or first message goes",
            )),
        }
    })
}

/// A writable block of `len` bytes in the server's shared memory (`shm://` calls only), for a
/// reply written in place; send it with `isthmus_server_call_send_block`.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
/// receives.
///
/// # Safety
///
/// `block` is writable; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_alloc(
    call: *const isthmus_server_call_t,
    len: usize,
    block: *mut *mut isthmus_block_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { entry_out(block, "block", status, || Ok(Some(block_handle(block_on(handed(call)?.alloc(len))?)))) }
}

/// Sends a block from `isthmus_server_call_alloc` as one response message, with no copy. The
/// block handle is consumed, sent or not. A block of another connection fails
/// `ISTHMUS_INVALID_ARGUMENT`, and the call goes on.
///
/// Thread-safety: any thread, which it blocks; the call's sending side, as
/// `isthmus_server_call_send`. No other thread may write the block once it is passed here.
///
/// # Safety
///
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_send_block(
    call: *const isthmus_server_call_t,
    block: *mut isthmus_block_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let call = handed(call);
        let block = take_block(block)?;
        block_on(call?.send_block(block))
    })
}

/// Ends the call with `code` (`ISTHMUS_OK` or a gRPC code), `message` (NULL for none) and
/// trailing metadata (NULL for none; copied), and frees the handle. Exactly once per call. A
/// `code` that is no gRPC code ends the call UNKNOWN, as gRPC clients read one. A `message`
/// that is not UTF-8 or a `trailers` that is no live handle still ends the call (INTERNAL,
/// saying which) and frees the handle, and returns `ISTHMUS_INVALID_ARGUMENT`.
///
/// Thread-safety: any thread, exactly once; operations other threads start on the call afterwards
/// fail `ISTHMUS_INVALID_ARGUMENT`, and the path from `isthmus_server_call_path` dies.
///
/// # Safety
///
/// `message` is NULL or NUL-terminated; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_finish(
    call: *mut isthmus_server_call_t,
    code: isthmus_code_t,
    message: *const c_char,
    trailers: *const isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on; no details.
    unsafe { finish(call, code, message, std::ptr::null(), 0, trailers, status) }
}

/// [`isthmus_server_call_finish`] with binary details: `details_len` bytes at `details` (NULL
/// for none when `details_len` is 0; copied), a serialized `google.rpc.Status` whose code and
/// message should match `code` and `message`. They reach the client as the status's details
/// (`isthmus_status_details`; over HTTP/2, gRPC's `grpc-status-details-bin` trailer). With a
/// NULL `details` and a non-zero length the call still ends (INTERNAL, saying why), the
/// handle is freed, and this returns `ISTHMUS_INVALID_ARGUMENT`.
///
/// Thread-safety: as `isthmus_server_call_finish`.
///
/// # Safety
///
/// `message` is NULL or NUL-terminated; `details` is NULL or valid for `details_len` bytes;
/// `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_call_finish_with_details(
    call: *mut isthmus_server_call_t,
    code: isthmus_code_t,
    message: *const c_char,
    details: *const u8,
    details_len: usize,
    trailers: *const isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { finish(call, code, message, details, details_len, trailers, status) }
}

/// The body of the finish functions.
///
/// # Safety
///
/// As [`isthmus_server_call_finish_with_details`].
unsafe fn finish(
    call: *mut isthmus_server_call_t,
    code: isthmus_code_t,
    message: *const c_char,
    details: *const u8,
    details_len: usize,
    trailers: *const isthmus_metadata_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let handle = SERVER_CALLS.remove(call)?;
        // SAFETY: NULL or NUL-terminated, by the caller's promise.
        let text = unsafe { c_str_or_empty(message, "the message") };
        let code = grpc_code(code).unwrap_or(Code::Unknown);
        // The handle is gone now, so the call ends here whatever else is wrong: a call left
        // unfinished would hang until the client's deadline, if it set one.
        let made = text.and_then(|text| {
            // SAFETY: the caller promises `details` is NULL or valid for `details_len` bytes.
            let details = unsafe { c_bytes(details, details_len, "the details")? };
            let status = Status::new(code, text).with_metadata(metadata_arg(trailers)?);
            Ok(match details.is_empty() {
                true => status,
                false => status.with_details(bytes::Bytes::copy_from_slice(details)),
            })
        });
        match made {
            Ok(status) => {
                handle.call.finish(status);
                Ok(())
            }
            Err(bad) => {
                handle
                    .call
                    .finish(Status::new(Code::Internal, format!("the handler's finish failed: {}", bad.message())));
                Err(bad)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::{c_void, CStr, CString};

    use super::*;
    use crate::abi::{isthmus_status_free, isthmus_status_message, ISTHMUS_NOT_FOUND, ISTHMUS_OK};
    use crate::client::{isthmus_channel_close, isthmus_channel_new, unary_for_test};

    /// Ends every call NOT_FOUND "kept": a status only this handler gives.
    unsafe extern "C" fn kept(_: *mut c_void, call: *mut isthmus_server_call_t) {
        // SAFETY: a live call, handed to this handler; a NUL-terminated message.
        unsafe {
            isthmus_server_call_finish(
                call,
                ISTHMUS_NOT_FOUND,
                c"kept".as_ptr(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
    }

    /// A start that fails leaves the server as it was: started again on a target that binds, it
    /// serves with the handler added before. The first start took the server's builder before
    /// binding, so a failed one lost its handlers, and every later start failed
    /// FAILED_PRECONDITION "started already".
    #[test]
    fn a_start_that_fails_keeps_the_server_for_another() {
        let name = CString::new(format!("shm://capi-restart-{}", std::process::id())).expect("name");
        let bad = c"nosuch://where";
        // SAFETY: NULL options are the defaults; the strings are NUL-terminated and outlive the
        // calls; the out-pointers are writable.
        unsafe {
            let server = isthmus_server_new(std::ptr::null());
            let path = c"/t.S/M";
            let rc = isthmus_server_add_handler(
                server,
                path.as_ptr(),
                Some(kept),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            assert_eq!(rc, ISTHMUS_OK);
            let mut status = std::ptr::null_mut();
            let targets = [bad.as_ptr()];
            assert_ne!(isthmus_server_start(server, targets.as_ptr(), 1, &mut status), ISTHMUS_OK);
            let message = CStr::from_ptr(isthmus_status_message(status)).to_string_lossy().into_owned();
            assert!(message.contains("nosuch"), "{message}");
            isthmus_status_free(status);

            let targets = [name.as_ptr()];
            assert_eq!(isthmus_server_start(server, targets.as_ptr(), 1, std::ptr::null_mut()), ISTHMUS_OK);
            let mut channel = std::ptr::null_mut();
            assert_eq!(
                isthmus_channel_new(name.as_ptr(), std::ptr::null(), &mut channel, std::ptr::null_mut()),
                ISTHMUS_OK
            );
            let (rc, _, status) = unary_for_test(channel as usize, path, b"hi");
            assert_eq!(rc, ISTHMUS_NOT_FOUND, "the handler added before the failed start answers");
            assert_eq!(CStr::from_ptr(isthmus_status_message(status)).to_str(), Ok("kept"));
            isthmus_status_free(status);
            assert_eq!(
                isthmus_server_start(server, targets.as_ptr(), 1, std::ptr::null_mut()),
                crate::abi::ISTHMUS_FAILED_PRECONDITION
            );
            assert_eq!(isthmus_channel_close(channel), ISTHMUS_OK);
            assert_eq!(isthmus_server_free(server), ISTHMUS_OK);
        }
    }

    /// An entry point that fails leaves no stale value in its out-pointers: a worker loop that
    /// reuses its variables and reads them regardless finds no earlier call's handle (which it
    /// would then finish a second time), entry or state.
    #[test]
    fn a_failure_leaves_no_stale_out_values() {
        use crate::client::{isthmus_channel_state, ISTHMUS_STATE_READY, ISTHMUS_STATE_SHUTDOWN};
        use crate::cq::{isthmus_cq_free, isthmus_cq_new};
        use crate::object::{isthmus_metadata_add, isthmus_metadata_free, isthmus_metadata_get, isthmus_metadata_new};
        let cq = isthmus_cq_new();
        assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
        let (mut tag, mut call) = (7u64, 0x10 as *mut isthmus_server_call_t);
        // SAFETY: writable out-pointers; the freed queue is refused by the registry.
        let rc = unsafe { isthmus_cq_take_call(cq, 0, &mut tag, &mut call, std::ptr::null_mut()) };
        assert_eq!(rc, crate::abi::ISTHMUS_INVALID_ARGUMENT);
        assert_eq!((tag, call), (0, std::ptr::null_mut()));

        let md = isthmus_metadata_new();
        // SAFETY: a live handle, NUL-terminated key, a value of 1 byte.
        let added = unsafe { isthmus_metadata_add(md, c"k".as_ptr(), b"v".as_ptr(), 1, std::ptr::null_mut()) };
        assert_eq!(added, ISTHMUS_OK);
        let (mut key, mut key_len) = (b"stale".as_ptr(), 5usize);
        let (mut value, mut value_len) = (b"stale".as_ptr(), 5usize);
        // SAFETY: writable out-pointers.
        let rc = unsafe { isthmus_metadata_get(md, 1, &mut key, &mut key_len, &mut value, &mut value_len) };
        assert_eq!(rc, crate::abi::ISTHMUS_OUT_OF_RANGE);
        assert_eq!((key, key_len, value, value_len), (std::ptr::null(), 0, std::ptr::null(), 0));
        assert_eq!(isthmus_metadata_free(md), ISTHMUS_OK);

        let mut state = ISTHMUS_STATE_READY;
        // SAFETY: a writable out-pointer; the handle is none the library made.
        let rc = unsafe { isthmus_channel_state(0x10 as *const _, 0, &mut state) };
        assert_eq!(rc, crate::abi::ISTHMUS_INVALID_ARGUMENT);
        assert_eq!(state, ISTHMUS_STATE_SHUTDOWN);
    }
}
