//! Completion queues: how an event loop learns that an `_async` operation finished without
//! blocking a thread on it. A queue has a file descriptor that is readable while events wait;
//! the loop watches it (epoll, nginx, libuv, Go's netpoller) and takes the events with
//! `isthmus_cq_poll`. The operations' remaining work runs inside that call, on the loop's
//! thread: no thread is woken and no task spawned per call (`isthmus::binding::Completions`).

use std::ffi::c_char;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use isthmus::binding::{Completions, HandedCall, MadeIn, SharedCall};
use isthmus::{Code, MetadataMap, Response, SocketBell, Status};

use crate::abi::{entry, guard, invalid, isthmus_code_t, isthmus_status_t, status_handle, ISTHMUS_OK};
use crate::handle::Registry;
use crate::object::{
    call_handle, isthmus_call_t, isthmus_message_t, isthmus_metadata_t, isthmus_server_call_t, message_handle,
    metadata_handle, server_call_handle,
};

/// A completion queue (see the module's documentation). Free it with `isthmus_cq_free` once
/// nothing uses it. A queue is its process's: in a child forked after it was made, operations
/// started on it fail `ISTHMUS_FAILED_PRECONDITION`, polls find nothing, `isthmus_cq_fd` gives
/// -1, and freeing it only forgets it (its descriptor and operations are the parent's); the
/// child makes its own.
pub struct isthmus_cq_t {
    completions: Arc<Completions<Finished>>,
    /// Finished operations taken from `completions` that did not fit the caller's array.
    overflow: std::sync::Mutex<std::collections::VecDeque<(u64, Finished)>>,
    /// The socket `isthmus_cq_bell_listen` made, until its connection is accepted.
    bell: std::sync::Mutex<Option<BellListener>>,
    /// New calls for a thread that spins for one (`isthmus_cq_take_call`).
    pub(crate) taker: Arc<crate::server::Taker>,
    /// The fork count the queue was made under. In a child forked since, its descriptor is
    /// the parent's too (a signal here would wake the parent's loop, and the parent's read
    /// would take this one's wake-ups) and its operations are the parent's: the child refuses
    /// to use it, and freeing it there only forgets it.
    made_in: MadeIn,
}

/// A listening socket in a fresh directory only this user may enter; both are removed when it
/// is dropped.
struct BellListener {
    listener: UnixListener,
    dir: PathBuf,
}

impl Drop for BellListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Which operation an event completes.
pub type isthmus_op_t = i32;
/// `isthmus_unary_async`.
pub const ISTHMUS_OP_UNARY: isthmus_op_t = 1;
/// `isthmus_call_start_async`.
pub const ISTHMUS_OP_START: isthmus_op_t = 2;
/// `isthmus_call_send_async`, `isthmus_server_call_send_async`.
pub const ISTHMUS_OP_SEND: isthmus_op_t = 3;
/// `isthmus_call_close_send_async`.
pub const ISTHMUS_OP_CLOSE_SEND: isthmus_op_t = 4;
/// `isthmus_call_recv_async`, `isthmus_server_call_recv_async`.
pub const ISTHMUS_OP_RECV: isthmus_op_t = 5;
/// `isthmus_call_headers_async`.
pub const ISTHMUS_OP_HEADERS: isthmus_op_t = 6;
/// A new call for a handler registered with `isthmus_server_add_handler_cq`.
pub const ISTHMUS_OP_NEW_CALL: isthmus_op_t = 7;
/// `isthmus_server_call_send_headers_async`.
pub const ISTHMUS_OP_SEND_HEADERS: isthmus_op_t = 8;
/// `isthmus_server_call_done_async`: the call is over (finished, cancelled by its client, or
/// past its deadline).
pub const ISTHMUS_OP_DONE: isthmus_op_t = 9;
/// `isthmus_channel_wait_state_async`: the channel's state (`ISTHMUS_STATE_*`) in
/// `message_len`; `ISTHMUS_OK` if it changed, `ISTHMUS_DEADLINE_EXCEEDED` if the time ran out.
pub const ISTHMUS_OP_STATE: isthmus_op_t = 10;

/// One finished operation. Every non-NULL handle in it belongs to the caller, who frees it.
#[repr(C)]
pub struct isthmus_event_t {
    /// The tag the operation was started with. A tag names one operation: starting one with
    /// the tag of another still pending on the same queue fails `ISTHMUS_INVALID_ARGUMENT`.
    pub tag: u64,
    /// Which operation (`ISTHMUS_OP_*`).
    pub op: isthmus_op_t,
    /// `ISTHMUS_OK`, or the failure's code (then `status` says why).
    pub code: isthmus_code_t,
    /// `ISTHMUS_OP_START`: the started call.
    pub call: *mut isthmus_call_t,
    /// `ISTHMUS_OP_NEW_CALL`: the call for the handler, to finish with
    /// `isthmus_server_call_finish`.
    pub server_call: *mut isthmus_server_call_t,
    /// `ISTHMUS_OP_RECV`, `ISTHMUS_OP_UNARY`: the message; NULL at the end of the stream.
    pub message: *mut isthmus_message_t,
    /// The message's bytes (as `isthmus_message_data` gives them), valid until it is freed.
    pub message_data: *const u8,
    /// The message's length; `ISTHMUS_OP_STATE`: the channel's state.
    pub message_len: usize,
    /// `ISTHMUS_OP_HEADERS`, `ISTHMUS_OP_UNARY`: the initial metadata (of a failed unary
    /// call too, when the server sent them before it failed it); NULL when there is none.
    pub metadata: *mut isthmus_metadata_t,
    /// `ISTHMUS_OP_UNARY`: the trailing metadata; NULL when there is none.
    pub trailers: *mut isthmus_metadata_t,
    /// On failure: the status (code, message, details, trailers).
    pub status: *mut isthmus_status_t,
}

/// What a finished operation gives back, before it becomes an event.
pub(crate) enum Outcome {
    Unary(Response),
    Started(Arc<SharedCall>),
    Message(Option<Bytes>),
    Metadata(MetadataMap),
    NewCall(Arc<HandedCall>),
    /// A channel's state, and why the wait for a change ended without one.
    State(u32, Option<Status>),
    Done,
    Failed(Status),
}

impl Outcome {
    pub(crate) fn unary(r: Result<Response, Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, Outcome::Unary)
    }

    pub(crate) fn started(r: Result<isthmus::ClientCall, Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, |c| Outcome::Started(SharedCall::new(c)))
    }

    pub(crate) fn received(r: Result<Option<Bytes>, Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, Outcome::Message)
    }

    pub(crate) fn headers(r: Result<MetadataMap, Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, Outcome::Metadata)
    }

    pub(crate) fn done(r: Result<(), Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, |()| Outcome::Done)
    }

    /// `Done` if `ok`, else the status `why` makes.
    pub(crate) fn done_if(ok: bool, why: impl FnOnce() -> Status) -> Outcome {
        match ok {
            true => Outcome::Done,
            false => Outcome::Failed(why()),
        }
    }

    /// The event for this outcome of operation `op`: handles registered for the caller.
    pub(crate) fn event(self, tag: u64, op: isthmus_op_t) -> isthmus_event_t {
        let mut ev = isthmus_event_t { tag, op, ..isthmus_event_t::none() };
        match self {
            Outcome::Unary(r) => {
                ev.set_message(r.message);
                ev.metadata = metadata_or_null(r.metadata);
                ev.trailers = metadata_or_null(r.trailers);
            }
            Outcome::Started(call) => ev.call = call_handle(call),
            Outcome::Message(Some(m)) => ev.set_message(m),
            Outcome::Message(None) | Outcome::Done => {}
            // Asked for, so given even when empty.
            Outcome::Metadata(md) => ev.metadata = metadata_handle(md),
            Outcome::NewCall(call) => ev.server_call = server_call_handle(call),
            Outcome::State(state, why) => {
                ev.message_len = state as usize;
                if let Some(status) = why {
                    ev.code = status.code() as isthmus_code_t;
                    ev.status = status_handle(&status);
                }
            }
            Outcome::Failed(status) => {
                ev.code = status.code() as isthmus_code_t;
                ev.status = status_handle(&status);
                // As `isthmus_unary` gives them: the server's initial metadata before it failed.
                if op == ISTHMUS_OP_UNARY {
                    ev.metadata = metadata_or_null(status.headers().clone());
                }
            }
        }
        ev
    }
}

impl isthmus_event_t {
    /// No event: `op` 0.
    fn none() -> isthmus_event_t {
        isthmus_event_t {
            tag: 0,
            op: 0,
            code: ISTHMUS_OK,
            call: std::ptr::null_mut(),
            server_call: std::ptr::null_mut(),
            message: std::ptr::null_mut(),
            message_data: std::ptr::null(),
            message_len: 0,
            metadata: std::ptr::null_mut(),
            trailers: std::ptr::null_mut(),
            status: std::ptr::null_mut(),
        }
    }

    fn set_message(&mut self, bytes: Bytes) {
        (self.message_data, self.message_len) = (crate::object::data_ptr(&bytes), bytes.len());
        // The bytes stay where they are while the handle holds them.
        self.message = message_handle(bytes);
    }
}

/// A handle for metadata, or NULL for none.
fn metadata_or_null(md: MetadataMap) -> *mut isthmus_metadata_t {
    match md.is_empty() {
        true => std::ptr::null_mut(),
        false => metadata_handle(md),
    }
}

pub(crate) static QUEUES: Registry<isthmus_cq_t> = Registry::new("completion queue");

/// The queue behind a caller's handle; FAILED_PRECONDITION in a child forked since it was made.
fn queue(cq: *const isthmus_cq_t) -> Result<Arc<isthmus_cq_t>, Status> {
    let q = QUEUES.get(cq)?;
    match !q.made_in.forked() {
        true => Ok(q),
        false => Err(Status::new(
            Code::FailedPrecondition,
            "the completion queue was made before a fork, by the parent of this process: make one here (isthmus_cq_new)",
        )),
    }
}

/// The queue behind a caller's handle, as the operations that complete on it hold it.
pub(crate) fn cq_get(cq: *const isthmus_cq_t) -> Result<Queue, Status> {
    Ok(Queue(queue(cq)?.completions.clone()))
}

/// The queue behind a caller's handle, for an operation the caller starts with `tag`: refused
/// (INVALID_ARGUMENT) if an operation started with the same tag is still pending there. A tag
/// names one operation: its event, and `isthmus_cq_cancel`, find it by the tag, and a second
/// operation under it made the cancel stop the wrong one, or neither.
pub(crate) fn cq_for(cq: *const isthmus_cq_t, tag: u64) -> Result<Queue, Status> {
    let queue = cq_get(cq)?;
    match queue.0.is_running(tag) {
        true => Err(invalid(format!("tag {tag} names an operation still pending on this queue"))),
        false => Ok(queue),
    }
}

/// The taker of the queue behind a caller's handle (`isthmus_cq_take_call`).
pub(crate) fn cq_taker(cq: *const isthmus_cq_t) -> Result<Arc<crate::server::Taker>, Status> {
    Ok(queue(cq)?.taker.clone())
}

/// A queue as operations start on it.
#[derive(Clone)]
pub(crate) struct Queue(Arc<Completions<Finished>>);

/// A finished operation: which kind, and how it ended.
pub(crate) struct Finished(isthmus_op_t, Outcome);

/// A panic inside an operation is caught where its kind is known ([`tagged`]); this is for
/// the queue's own, should one ever get past that: INTERNAL, with no kind (`op` 0; an outcome
/// given at once in `now` takes the kind the start knows).
impl isthmus::binding::Outcome for Finished {
    fn panicked(status: Status) -> Finished {
        Finished(0, Outcome::Failed(status))
    }
}

/// An operation's future with its kind beside it, what the queue runs; a panic inside it ends
/// the operation INTERNAL, as an event of its kind. A wrapper of the future, not an
/// `async move { (op, fut.await) }` block: such a block holds `fut` twice, as its capture and
/// as the value it awaits (a queued unary call took 1,984 bytes so, 864 now), and the queue
/// allocates it and copies it whole at each move, once per operation.
fn tagged<F>(op: isthmus_op_t, fut: F) -> Tagged<F>
where
    F: std::future::Future<Output = Outcome>,
{
    Tagged { op, fut }
}

pin_project_lite::pin_project! {
    /// [`tagged`]'s future.
    pub(crate) struct Tagged<F> {
        op: isthmus_op_t,
        #[pin]
        fut: F,
    }
}

impl<F: std::future::Future<Output = Outcome>> std::future::Future for Tagged<F> {
    type Output = Finished;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Finished> {
        let this = self.project();
        let op = *this.op;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| this.fut.poll(cx))) {
            Ok(polled) => polled.map(|outcome| Finished(op, outcome)),
            Err(panic) => {
                std::task::Poll::Ready(Finished(op, Outcome::Failed(isthmus::binding::panic_status(&*panic))))
            }
        }
    }
}

impl Queue {
    /// Runs `fut` as operation `op`, named by the caller's `tag`: queued when done.
    pub(crate) fn run<F>(&self, tag: u64, op: isthmus_op_t, fut: F)
    where
        F: std::future::Future<Output = Outcome> + Send + 'static,
    {
        self.0.run(tag, tagged(op, fut));
    }

    /// [`run`](Self::run) for a caller that gave `now`: an outcome ready at once goes there
    /// (and is not queued); otherwise `now.op` is set to 0.
    pub(crate) fn start<F>(&self, tag: u64, op: isthmus_op_t, fut: F, now: *mut isthmus_event_t)
    where
        F: std::future::Future<Output = Outcome> + Send + 'static,
    {
        self.start_tagged(tag, op, tagged(op, fut), now)
    }

    /// [`start`](Self::start) of a future [`tagged`] already.
    fn start_tagged<F>(&self, tag: u64, op: isthmus_op_t, fut: F, now: *mut isthmus_event_t)
    where
        F: std::future::Future<Output = Finished> + Send + 'static,
    {
        if now.is_null() {
            return self.0.run(tag, fut);
        }
        let ev = match self.0.run_now(tag, fut) {
            // `op`, not the outcome's: a panic the queue caught itself carries no kind.
            Some(Finished(_, outcome)) => outcome.event(tag, op),
            None => isthmus_event_t::none(),
        };
        // SAFETY: `now` is not NULL, and the ABI's rules make it writable.
        unsafe { now.write(ev) };
    }

    /// [`start`](Self::start), but first waiting on the calling thread for up to `spin`: an
    /// outcome that comes within it goes to `now` with no trip through the queue, which costs
    /// the caller a wake-up of the thread that waits on the queue and one of its own (tens of
    /// µs each on two vCPUs: a Go stream's message took ~60 µs that way, a unary reply ~6).
    /// The spin yields the core between looks after `spin.yield_after`: the peer may need it.
    pub(crate) fn start_spinning<F>(
        &self,
        tag: u64,
        op: isthmus_op_t,
        fut: F,
        now: *mut isthmus_event_t,
        spin: isthmus::SpinPolicy,
    ) where
        F: std::future::Future<Output = Outcome> + Send + 'static,
    {
        if now.is_null() || spin.max.is_zero() {
            return self.start(tag, op, fut, now);
        }
        // Polled here with a waker that does nothing: each look polls again, and the future,
        // unfinished, goes on in the queue, which polls it with its own waker (a future is woken
        // through the waker of its latest poll), so nothing that arrives meanwhile is lost.
        // Tagged before the spin's polls, so that a panic in one ends the operation as any other.
        let mut fut = Box::pin(tagged(op, fut));
        let started = Instant::now();
        {
            let _runtime = isthmus::binding::runtime().enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            loop {
                if let std::task::Poll::Ready(Finished(_, outcome)) = std::future::Future::poll(fut.as_mut(), &mut cx) {
                    // SAFETY: `now` is not NULL, and the ABI's rules make it writable.
                    unsafe { now.write(outcome.event(tag, op)) };
                    return;
                }
                let spent = started.elapsed();
                if spent >= spin.max {
                    break;
                }
                if spent >= spin.yield_after {
                    std::thread::yield_now();
                } else {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                }
            }
        }
        self.start_tagged(tag, op, fut, now)
    }
}

/// The shape of every `_async` operation on a call: the call (looked up by the caller) and
/// the queue checked, then operation `op` started on the queue with the future `make` builds.
pub(crate) fn start_on<C, F>(
    call: Result<C, Status>,
    cq: *const isthmus_cq_t,
    tag: u64,
    op: isthmus_op_t,
    now: *mut isthmus_event_t,
    status: *mut *mut isthmus_status_t,
    make: impl FnOnce(C) -> Result<F, Status>,
) -> isthmus_code_t
where
    F: std::future::Future<Output = Outcome> + Send + 'static,
{
    start_spinning_on(call, cq, tag, op, now, NO_SPIN, status, make)
}

/// No wait on the calling thread (for [`start_spinning_on`]).
pub(crate) const NO_SPIN: isthmus::SpinPolicy =
    isthmus::SpinPolicy { max: Duration::ZERO, yield_after: Duration::ZERO };

/// [`start_on`], waiting for the outcome on the calling thread first for up to `spin`
/// ([`Queue::start_spinning`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_spinning_on<C, F>(
    call: Result<C, Status>,
    cq: *const isthmus_cq_t,
    tag: u64,
    op: isthmus_op_t,
    now: *mut isthmus_event_t,
    spin: isthmus::SpinPolicy,
    status: *mut *mut isthmus_status_t,
    make: impl FnOnce(C) -> Result<F, Status>,
) -> isthmus_code_t
where
    F: std::future::Future<Output = Outcome> + Send + 'static,
{
    start_trying_on(call, cq, tag, op, now, spin, status, |_, _| None, make)
}

/// [`start_spinning_on`] with a first look that needs no future: an outcome `at_hand` gives
/// (a request already in) goes to `now` at once, with nothing boxed or polled. `at_hand` may
/// shorten the spin that follows (it waited on the calling thread already).
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_trying_on<C, F>(
    call: Result<C, Status>,
    cq: *const isthmus_cq_t,
    tag: u64,
    op: isthmus_op_t,
    now: *mut isthmus_event_t,
    spin: isthmus::SpinPolicy,
    status: *mut *mut isthmus_status_t,
    at_hand: impl FnOnce(&C, &mut isthmus::SpinPolicy) -> Option<Outcome>,
    make: impl FnOnce(C) -> Result<F, Status>,
) -> isthmus_code_t
where
    F: std::future::Future<Output = Outcome> + Send + 'static,
{
    clear_now(now);
    entry(status, || {
        let (call, cq) = (call?, cq_for(cq, tag)?);
        let mut spin = spin;
        if !now.is_null() {
            if let Some(outcome) = at_hand(&call, &mut spin) {
                // SAFETY: `now` is not NULL, and the ABI's rules make it writable.
                unsafe { now.write(outcome.event(tag, op)) };
                return Ok(());
            }
        }
        cq.start_spinning(tag, op, make(call)?, now, spin);
        Ok(())
    })
}

/// Marks `now` (when given) as holding no event, before anything that can fail: a start that
/// fails leaves no earlier event there for a caller that reads `now` whatever the code.
pub(crate) fn clear_now(now: *mut isthmus_event_t) {
    if !now.is_null() {
        // SAFETY: `now` is not NULL, and the ABI's rules make it writable.
        unsafe { now.write(isthmus_event_t::none()) };
    }
}

/// A new completion queue, or NULL if the system refuses an eventfd.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_cq_new() -> *mut isthmus_cq_t {
    guard(std::ptr::null_mut(), || match Completions::new() {
        Ok(completions) => QUEUES.add(isthmus_cq_t {
            completions,
            overflow: Default::default(),
            bell: Default::default(),
            taker: Default::default(),
            made_in: MadeIn::now(),
        }),
        Err(_) => std::ptr::null_mut(),
    })
}

/// The queue's file descriptor: readable while events wait. Watch it for reading; do not
/// read, write or close it. -1 for an invalid handle, and for a queue made before a fork by
/// the parent of this process (the descriptor is the parent's too).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_cq_fd(cq: *const isthmus_cq_t) -> i32 {
    guard(-1, || queue(cq).map_or(-1, |q| q.completions.fd()))
}

/// Takes up to `capacity` finished operations into `events`, without blocking; the number
/// taken. Runs what the woken operations have left to do, on this thread. Events not taken
/// (beyond `capacity`) stay queued and keep the descriptor readable.
///
/// Thread-safety: any thread, usually the one loop that watches the queue: threads polling one
/// queue at once each get different events. The operations' remaining work runs on the polling
/// thread.
///
/// # Safety
///
/// `events` is valid for writes of `capacity` events.
#[no_mangle]
pub unsafe extern "C" fn isthmus_cq_poll(
    cq: *const isthmus_cq_t,
    events: *mut isthmus_event_t,
    capacity: usize,
) -> usize {
    guard(0, || {
        let Ok(q) = queue(cq) else { return 0 };
        if events.is_null() || capacity == 0 {
            return 0;
        }
        let mut taken = q.take_into(capacity);
        let n = taken.len();
        for (i, ev) in taken.drain(..).enumerate() {
            // SAFETY: i < n <= capacity, and the caller promises room for `capacity` events.
            unsafe { events.add(i).write(ev) };
        }
        n
    })
}

/// [`isthmus_cq_poll`], but waits first until an event is ready: spinning for up to
/// `spin_us` microseconds, then asleep on the descriptor until `timeout_us` (from the call;
/// negative: no limit) has passed. 0 if none came: the time ran out, `isthmus_cq_wake` woke
/// it, or the operations woken meanwhile have not finished yet (wait again).
///
/// Thread-safety: any thread, which it blocks (up to `timeout_us`); as `isthmus_cq_poll` otherwise.
///
/// # Safety
///
/// As [`isthmus_cq_poll`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_cq_wait(
    cq: *const isthmus_cq_t,
    events: *mut isthmus_event_t,
    capacity: usize,
    spin_us: u32,
    timeout_us: i64,
) -> usize {
    guard(0, || {
        let Ok(q) = queue(cq) else { return 0 };
        let deadline = u64::try_from(timeout_us).ok().map(|t| Instant::now() + Duration::from_micros(t));
        q.completions.wait(Duration::from_micros(spin_us.into()), deadline);
        // SAFETY: the caller's promise, passed on.
        unsafe { isthmus_cq_poll(cq, events, capacity) }
    })
}

/// Abandons the operation started with `tag` on `cq`: it will not complete (a call it was
/// making is cancelled) and its event never comes. `ISTHMUS_NOT_FOUND` if it has finished
/// already: its event is then queued, or was taken.
///
/// Thread-safety: any thread; if another thread takes the operation's event meanwhile, this gives
/// `ISTHMUS_NOT_FOUND`.
#[no_mangle]
pub extern "C" fn isthmus_cq_cancel(cq: *const isthmus_cq_t, tag: u64) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let q = queue(cq)?;
        match q.completions.abort(tag) {
            true => Ok(()),
            false => Err(Status::new(isthmus::Code::NotFound, format!("no operation {tag} waits on this queue"))),
        }
    })
}

/// For event loops that can watch only a socket they connect themselves (nginx's Lua
/// cosockets) instead of the queue's descriptor: makes a Unix socket to connect to and writes
/// its path, NUL-terminated, into `path` (`capacity` bytes). Connect to it, then call
/// `isthmus_cq_bell_accept`; from then on a byte arrives on that connection whenever the
/// descriptor becomes readable (read them, then `isthmus_cq_poll`). The socket lives in a fresh
/// directory only this user may enter, under `$TMPDIR` (or `/tmp`), removed once accepted.
///
/// Thread-safety: any thread (a lock guards the bell).
///
/// # Safety
///
/// `path` is valid for writes of `capacity` bytes; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_cq_bell_listen(
    cq: *const isthmus_cq_t,
    path: *mut c_char,
    capacity: usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    entry(status, || {
        let q = queue(cq)?;
        if path.is_null() {
            return Err(invalid("the path buffer is NULL"));
        }
        let unavailable =
            |e: std::io::Error| Status::new(Code::Unavailable, format!("cannot make the bell's socket: {e}"));
        // A name no one can guess ahead (another user could otherwise make it first), made
        // anew if it exists.
        let mut attempt = 0;
        let dir = loop {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            let nanos = now.map_or(0, |d| d.subsec_nanos());
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("isthmus-bell-{}-{n}-{nanos:08x}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => break dir,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 8 => attempt += 1,
                Err(e) => return Err(unavailable(e)),
            }
        };
        let socket = dir.join("bell.sock");
        let listener = UnixListener::bind(&socket).map_err(|e| {
            let _ = std::fs::remove_dir_all(&dir);
            unavailable(e)
        })?;
        let listener = BellListener { listener, dir };
        let bytes = socket.to_str().ok_or_else(|| invalid("the temporary directory's path is not UTF-8"))?.as_bytes();
        if bytes.len() >= capacity {
            return Err(invalid(format!("the path needs {} bytes, the buffer has {capacity}", bytes.len() + 1)));
        }
        // SAFETY: `path` has room for `capacity` > bytes.len() bytes, by the caller's promise.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), path.cast::<u8>(), bytes.len());
            path.add(bytes.len()).write(0);
        }
        *q.bell.lock().map_err(|_| Status::new(Code::Internal, "a thread panicked holding the bell"))? = Some(listener);
        Ok(())
    })
}

/// Accepts the connection made to the socket of `isthmus_cq_bell_listen` (which must have
/// been made already: `ISTHMUS_FAILED_PRECONDITION` otherwise) and rings it from now on, in
/// place of an earlier bell. Removes the socket and its directory.
///
/// Thread-safety: any thread (a lock guards the bell).
#[no_mangle]
pub extern "C" fn isthmus_cq_bell_accept(
    cq: *const isthmus_cq_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        let q = queue(cq)?;
        let mut bell = q.bell.lock().map_err(|_| Status::new(Code::Internal, "a thread panicked holding the bell"))?;
        let listening = bell.take().ok_or_else(|| {
            Status::new(Code::FailedPrecondition, "no bell socket: call isthmus_cq_bell_listen first")
        })?;
        let accepted = listening.listener.set_nonblocking(true).and_then(|()| listening.listener.accept());
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                *bell = Some(listening);
                return Err(Status::new(Code::FailedPrecondition, "nothing has connected to the bell's socket yet"));
            }
            Err(e) => return Err(Status::new(Code::Unavailable, format!("cannot accept on the bell's socket: {e}"))),
        };
        drop(listening);
        q.completions.set_bell(SocketBell::new(stream));
        Ok(())
    })
}

/// Makes the queue's descriptor readable and rings its bell, with no event to take: wakes the
/// loop that watches it (nginx's watcher, when its worker is exiting).
///
/// Thread-safety: any thread: it is how another thread wakes the queue's loop.
#[no_mangle]
pub extern "C" fn isthmus_cq_wake(cq: *const isthmus_cq_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        queue(cq)?.completions.signal();
        Ok(())
    })
}

/// Frees a queue. Operations still waiting on it are abandoned: their calls are cancelled and
/// their events never come; events not yet taken are freed, and a new call among them (a
/// handler's `ISTHMUS_OP_NEW_CALL`) is finished UNAVAILABLE, as one that comes after.
///
/// Thread-safety: any thread, once: operations other threads start on it afterwards fail
/// `ISTHMUS_INVALID_ARGUMENT`, a thread asleep in `isthmus_cq_wait` on it wakes and gets no
/// event, and one in `isthmus_cq_take_call` returns soon with no call.
#[no_mangle]
pub extern "C" fn isthmus_cq_free(cq: *mut isthmus_cq_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let q = QUEUES.remove(cq)?;
        if q.made_in.forked() {
            // The parent's operations and descriptor: neither run, abandoned, nor signalled here.
            std::mem::forget(q);
            return Ok(());
        }
        q.taker.close();
        q.completions.abort_all();
        let untaken: Vec<(u64, Finished)> = {
            let mut overflow = q.overflow.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            overflow.drain(..).chain(q.completions.take()).collect()
        };
        // A new call nobody took is finished, as one that comes after the free is: dropped, it
        // stayed open until its deadline (for ever without one), and held the server's
        // shutdown for its whole grace.
        for (_, Finished(_, outcome)) in untaken {
            if let Outcome::NewCall(call) = outcome {
                call.finish(crate::server::queue_freed());
            }
        }
        // Wakes a waiter, whose poll then finds no queue (the waiter's hold on it keeps the
        // descriptor open until it has looked).
        q.completions.signal();
        Ok(())
    })
}

impl isthmus_cq_t {
    /// Up to `capacity` events: those left over from the last poll first.
    fn take_into(&self, capacity: usize) -> Vec<isthmus_event_t> {
        // A panic while it was held (it is held while operations are polled) left nothing half
        // done: refusing it would lose every event from then on.
        let mut overflow = self.overflow.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if overflow.len() < capacity {
            overflow.extend(self.completions.take());
        }
        let n = overflow.len().min(capacity);
        let taken: Vec<(u64, Finished)> = overflow.drain(..n).collect();
        if !overflow.is_empty() {
            self.completions.signal(); // the rest keeps the descriptor readable
        }
        drop(overflow);
        taken.into_iter().map(|(tag, Finished(op, outcome))| outcome.event(tag, op)).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::abi::ISTHMUS_FAILED_PRECONDITION;

    fn listen(cq: *const isthmus_cq_t) -> String {
        let mut path = [0 as c_char; 256];
        // SAFETY: `path` has room for 256 bytes.
        let rc = unsafe { isthmus_cq_bell_listen(cq, path.as_mut_ptr(), path.len(), std::ptr::null_mut()) };
        assert_eq!(rc, ISTHMUS_OK);
        // SAFETY: the function wrote a NUL-terminated path.
        unsafe { std::ffi::CStr::from_ptr(path.as_ptr()) }.to_str().expect("utf8").to_owned()
    }

    #[test]
    fn the_bell_rings_on_the_socket_a_loop_connected_and_its_directory_goes() {
        let cq = isthmus_cq_new();
        let path = listen(cq);
        assert_eq!(isthmus_cq_bell_accept(cq, std::ptr::null_mut()), ISTHMUS_FAILED_PRECONDITION, "nothing connected");
        let mut watcher = UnixStream::connect(&path).expect("connect");
        assert_eq!(isthmus_cq_bell_accept(cq, std::ptr::null_mut()), ISTHMUS_OK);
        let dir = std::path::Path::new(&path).parent().expect("dir").to_path_buf();
        assert!(!dir.exists(), "the socket's directory is removed once accepted");

        assert_eq!(isthmus_cq_wake(cq), ISTHMUS_OK);
        let mut byte = [0u8; 1];
        watcher.read_exact(&mut byte).expect("rung");

        // A second bell replaces the first.
        let path = listen(cq);
        let mut second = UnixStream::connect(&path).expect("connect");
        assert_eq!(isthmus_cq_bell_accept(cq, std::ptr::null_mut()), ISTHMUS_OK);
        assert_eq!(isthmus_cq_wake(cq), ISTHMUS_OK);
        second.read_exact(&mut byte).expect("rung");

        assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
        assert_eq!(isthmus_cq_wake(cq), crate::abi::ISTHMUS_INVALID_ARGUMENT, "freed");
        let mut rest = Vec::new();
        second.read_to_end(&mut rest).expect("closed with the queue");
    }

    /// A new call whose `ISTHMUS_OP_NEW_CALL` event nobody took when its queue is freed ends
    /// UNAVAILABLE for its client, at once, as one that comes after the free does. It stayed
    /// open until its deadline (for ever without one), and held the server's shutdown for its
    /// whole grace.
    #[test]
    fn a_new_call_left_in_a_freed_queue_ends_unavailable() {
        use crate::client::{isthmus_channel_close, isthmus_channel_new};
        use crate::server::{
            isthmus_server_add_handler_cq, isthmus_server_free, isthmus_server_new, isthmus_server_start,
        };
        // A socket path of the test's own, removed however the test ends (a panic left the
        // runtime directory's socket behind).
        struct Removed(std::path::PathBuf);
        impl Drop for Removed {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        let socket = Removed(std::env::temp_dir().join(format!("capi-freed-queue-{}.sock", std::process::id())));
        let target = std::ffi::CString::new(format!("shm://{}", socket.0.display())).expect("name");
        let cq = isthmus_cq_new();
        // SAFETY: NULL options are the defaults; the path is NULL (every path); `target` is a
        // NUL-terminated string that outlives the calls; every out pointer is writable.
        unsafe {
            let server = isthmus_server_new(std::ptr::null());
            assert_eq!(
                isthmus_server_add_handler_cq(server, std::ptr::null(), cq, 7, std::ptr::null_mut()),
                ISTHMUS_OK
            );
            let targets = [target.as_ptr()];
            assert_eq!(isthmus_server_start(server, targets.as_ptr(), 1, std::ptr::null_mut()), ISTHMUS_OK);
            let mut channel = std::ptr::null_mut();
            assert_eq!(
                isthmus_channel_new(target.as_ptr(), std::ptr::null(), &mut channel, std::ptr::null_mut()),
                ISTHMUS_OK
            );
            let address = channel as usize; // the handle crosses to the client's thread
            let client = std::thread::spawn(move || {
                let (rc, reply, status) = crate::client::unary_for_test(address, c"/t.S/Unary", b"hi");
                assert!(reply.is_null());
                crate::abi::isthmus_status_free(status);
                rc
            });
            // The call's event is in the queue, untaken.
            let mut readable = libc::pollfd { fd: isthmus_cq_fd(cq), events: libc::POLLIN, revents: 0 };
            assert_eq!(libc::poll(&mut readable, 1, 30_000), 1, "the new call's event came");
            assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
            let (ended, end) = std::sync::mpsc::channel();
            std::thread::spawn(move || ended.send(client.join().expect("client")));
            let rc = end.recv_timeout(Duration::from_secs(20)).expect("the client's call ended");
            assert_eq!(rc, crate::abi::ISTHMUS_UNAVAILABLE);
            assert_eq!(isthmus_channel_close(channel), ISTHMUS_OK);
            assert_eq!(isthmus_server_free(server), ISTHMUS_OK);
        }
    }

    #[test]
    fn a_listening_bell_never_accepted_leaves_nothing_behind() {
        let cq = isthmus_cq_new();
        let path = listen(cq);
        assert!(std::path::Path::new(&path).exists());
        assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
        assert!(!std::path::Path::new(&path).parent().expect("dir").exists());
        let mut small = [0 as c_char; 8];
        let cq = isthmus_cq_new();
        // SAFETY: `small` has room for 8 bytes.
        let rc = unsafe { isthmus_cq_bell_listen(cq, small.as_mut_ptr(), small.len(), std::ptr::null_mut()) };
        assert_eq!(rc, crate::abi::ISTHMUS_INVALID_ARGUMENT, "a buffer too small is refused");
        assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
    }

    #[test]
    fn an_operation_that_panics_ends_internal_as_an_event_of_its_kind() {
        let cq = isthmus_cq_new();
        let queue = cq_get(cq).expect("queue");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        queue.run(1, ISTHMUS_OP_RECV, async move {
            let _ = rx.await;
            panic!("a bug inside an operation")
        });
        let (tx2, rx2) = tokio::sync::oneshot::channel::<()>();
        queue.run(2, ISTHMUS_OP_SEND, async move {
            let _ = rx2.await;
            Outcome::Done
        });
        tx.send(()).expect("send");
        tx2.send(()).expect("send");
        let mut events: Vec<isthmus_event_t> = (0..4).map(|_| isthmus_event_t::none()).collect();
        // SAFETY: `events` has room for 4 events.
        let n = unsafe { isthmus_cq_poll(cq, events.as_mut_ptr(), events.len()) };
        assert_eq!(n, 2, "both operations end, the one that panicked too");
        events.truncate(n);
        events.sort_by_key(|e| e.tag);
        assert_eq!((events[0].tag, events[0].op, events[0].code), (1, ISTHMUS_OP_RECV, crate::abi::ISTHMUS_INTERNAL));
        assert!(!events[0].status.is_null(), "the failure says why");
        assert_eq!((events[1].tag, events[1].op, events[1].code), (2, ISTHMUS_OP_SEND, ISTHMUS_OK));
        assert_eq!(crate::abi::isthmus_status_free(events[0].status), ISTHMUS_OK);
        // A panic in a look of a spinning start ends it in `now`, as an event of its kind.
        let mut now = isthmus_event_t::none();
        let spin = isthmus::SpinPolicy { max: Duration::from_millis(1), yield_after: Duration::from_micros(100) };
        queue.start_spinning(3, ISTHMUS_OP_RECV, async { panic!("a bug in a spin") }, &mut now, spin);
        assert_eq!((now.tag, now.op, now.code), (3, ISTHMUS_OP_RECV, crate::abi::ISTHMUS_INTERNAL));
        assert_eq!(crate::abi::isthmus_status_free(now.status), ISTHMUS_OK);
        assert_eq!(isthmus_cq_free(cq), ISTHMUS_OK);
    }
}
