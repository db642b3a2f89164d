//! What the language bindings share (the Python extension, the C ABI): the runtime under
//! their connections and servers, a client call whose halves two threads drive at once, and
//! completions for event loops.
//!
//! - [`runtime`]: one multi-threaded tokio runtime per process (per loaded copy of a
//!   binding), started on first use.
//! - [`SharedCall`]: a [`ClientCall`] of any shape as a foreign caller drives it: one thread
//!   sends while another receives, and a cancel reaches whichever waits.
//! - [`Completions`]: operations started by an event loop (asyncio, nginx, libuv, Go's
//!   netpoller) that complete on an [`EventFd`] the loop watches. Each operation runs on the
//!   thread that starts it as far as it can, and later on the thread that drains the
//!   completions: no task is spawned and no thread is woken per call; a reply only queues its
//!   operation and, for the first of a batch, signals the eventfd.
//! - [`HandedCall`] ([`hand_off`]): a server call whose handler foreign code runs; its
//!   [`Lender`] lets that code's thread read the call's connection while it waits for the next
//!   call (ADR 0020).

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;

use bytes::Bytes;
use isthmus_shm::{EventFd, SocketBell};
use tokio::sync::watch;

use crate::client::{CallSender, ClientCall};
use crate::engine::mux::IdKeys;
pub use crate::engine::mux::Lender;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// The runtime under every connection, channel and server a binding makes. Two worker
/// threads: the machines isthmus is built for have few cores, and calls that wait read their
/// own replies.
///
/// A child forked since the runtime was made gets a runtime of its own on first use: the
/// parent's worker threads do not exist in it. The parent's runtime is left as it is (dropping
/// it would wait for those threads); its tasks never run in the child, and the connections
/// they served are unusable there anyway ([`forks`]).
///
/// # Panics
///
/// If the operating system refuses the runtime's threads at first use.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    type Made = (u64, &'static tokio::runtime::Runtime);
    thread_local! {
        static SEEN: std::cell::Cell<Option<Made>> = const { std::cell::Cell::new(None) };
    }
    static CURRENT: std::sync::Mutex<Option<Made>> = std::sync::Mutex::new(None);
    let forks = isthmus_shm::forks();
    if let Some((made_in, rt)) = SEEN.get() {
        if made_in == forks {
            return rt;
        }
    }
    let mut current = CURRENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let made = match *current {
        Some(made) if made.0 == forks => made,
        _ => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("isthmus")
                // The host may not ignore SIGPIPE (a Go or C program): a peer that hangs up
                // while a worker writes to its Unix socket must fail that write, not kill the
                // host.
                .on_thread_start(isthmus_shm::block_sigpipe_on_this_thread)
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("isthmus cannot start its runtime: {e}"));
            (forks, &*Box::leak(Box::new(rt)))
        }
    };
    *current = Some(made);
    SEEN.set(Some(made));
    made.1
}

/// Forks this process has gone through since isthmus was first used (the transport's count): a
/// value a binding keeps differs in a child forked since. A connection made before a fork is
/// unusable in the child (its calls fail UNAVAILABLE and the channel connects anew) and the
/// child's use of it leaves the parent's connection alone.
pub fn forks() -> u64 {
    isthmus_shm::forks()
}

/// The process something was made in: [`forked`](MadeIn::forked) in a child forked since.
pub use isthmus_shm::MadeIn;

/// Runs `fut` to completion on the calling thread, in the binding [`runtime`]'s context. From
/// a thread of that runtime (a handler a binding called back into), the worker is handed its
/// other tasks first if `fut` must wait, so a blocking call made there cannot stall them.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let current = tokio::runtime::Handle::try_current();
    // Most waits are over before they start (a request already in, room in the ring): one poll
    // answers them with no thread handed anything, which matters most on a runtime's own
    // thread, where waiting would hand its other tasks to a new thread.
    let first = {
        let _context = current.is_err().then(|| runtime().enter());
        fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    };
    if let Poll::Ready(out) = first {
        return out;
    }
    match current {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| handle.block_on(fut))
        }
        _ => runtime().block_on(fut),
    }
}

fn cancelled() -> Status {
    Status::new(Code::Cancelled, "the call was cancelled")
}

/// One client call of any shape, as a binding's caller drives it: its sending side and its
/// receiving side may be used from two threads at once, and [`cancel`](Self::cancel) ends
/// whichever waits.
pub struct SharedCall {
    sender: CallSender,
    /// `None` once cancelled.
    call: tokio::sync::Mutex<Option<ClientCall>>,
    /// The server's initial metadata, or the status the call ended with before any came, once
    /// known: [`headers`](Self::headers) reads it here while a [`recv`](Self::recv) holds `call`
    /// waiting for a message (grpc-go's `Header()` waits for the headers only, whatever else
    /// runs on the stream).
    headers: watch::Sender<Option<Result<MetadataMap, Status>>>,
    cancel: watch::Sender<bool>,
    /// The trailing metadata and the OK status's message (empty after a failure), once the
    /// call has ended.
    trailers: Mutex<Option<(MetadataMap, String)>>,
    /// The fork count the call was made under. In a child forked since, nothing is sent (a
    /// send may wait for credit nobody will give there), and a read finds `call` held for ever
    /// if a thread of the parent was reading at the fork: the call then ends UNAVAILABLE
    /// without it; otherwise the call itself ends so when read (ADR 0030).
    made_in: MadeIn,
    /// A response [`drained_end`](Self::drained_end) received while no reader did, for the
    /// next [`recv`](Self::recv); taken and put only while holding `call`.
    ahead: Mutex<Option<Bytes>>,
    /// Told when a reader takes the response held `ahead`.
    ahead_taken: tokio::sync::Notify,
    /// Receives readers began, by which `drained_end` sees a reader at work.
    turns: std::sync::atomic::AtomicU64,
    /// Whether `drained_end` ever ran: until it does, a receive neither counts its turn nor
    /// looks `ahead` (the C ABI's and Lua's streams never call it).
    drained: std::sync::atomic::AtomicBool,
    /// Whether the sending side was half-closed ([`half_closed`](Self::half_closed)).
    half_closed: std::sync::atomic::AtomicBool,
}

/// How long [`SharedCall::drained_end`] lets a reader at work go on (it will reach the end
/// itself) before it looks again whether it should read on itself.
const READER_IDLE: std::time::Duration = std::time::Duration::from_millis(10);

impl std::fmt::Debug for SharedCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCall").field("cancelled", &*self.cancel.borrow()).finish_non_exhaustive()
    }
}

impl SharedCall {
    /// Wraps a started call.
    pub fn new(call: ClientCall) -> Arc<SharedCall> {
        Arc::new(SharedCall {
            sender: call.sender(),
            call: tokio::sync::Mutex::new(Some(call)),
            headers: watch::Sender::new(None),
            cancel: watch::Sender::new(false),
            trailers: Mutex::new(None),
            made_in: MadeIn::now(),
            ahead: Mutex::new(None),
            ahead_taken: tokio::sync::Notify::new(),
            turns: std::sync::atomic::AtomicU64::new(0),
            drained: std::sync::atomic::AtomicBool::new(false),
            half_closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether the sending side was half-closed (a send with `last`, or
    /// [`close_send`](Self::close_send)). A message sent after it goes nowhere (the server has
    /// seen the end of the requests), so a binding refuses it, as grpc-go's `SendMsg` after
    /// `CloseSend` fails INTERNAL, rather than report it sent.
    pub fn half_closed(&self) -> bool {
        self.half_closed.load(std::sync::atomic::Ordering::Acquire)
    }

    fn closing_send(&self, last: bool) {
        if last {
            self.half_closed.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// The call, locked; UNAVAILABLE in a child forked since the call was made if a thread of
    /// the parent held the lock at the fork.
    async fn lock(&self) -> Result<tokio::sync::MutexGuard<'_, Option<ClientCall>>, Status> {
        if !self.made_in.forked() {
            return Ok(self.call.lock().await);
        }
        self.call.try_lock().map_err(|_| {
            self.ended(MetadataMap::new(), "");
            crate::status::made_before_fork()
        })
    }

    /// Sends one request (`last` half-closes with it); `false` if the call is over (or
    /// cancelled): its status then comes from [`recv`](Self::recv).
    pub async fn send(&self, message: Bytes, last: bool) -> bool {
        self.closing_send(last);
        if self.made_in.forked() {
            return false;
        }
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => false,
            sent = self.sender.send_bytes(message, last) => sent,
        }
    }

    /// A writable block in this side's shared memory (`shm://` only), to fill and send with
    /// [`send_block`](Self::send_block).
    pub async fn alloc(&self, len: usize) -> Result<crate::BlockMut, Status> {
        if self.made_in.forked() {
            return Err(crate::status::made_before_fork());
        }
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => Err(cancelled()),
            block = self.sender.alloc(len) => block,
        }
    }

    /// Whether `block` can go by [`send_block`](Self::send_block) (`CallSender::can_send`):
    /// INVALID_ARGUMENT, as the engine's own refusal says it, for a block of another connection.
    pub fn can_send_block(&self, block: &crate::BlockMut) -> Result<(), Status> {
        match self.sender.can_send(block) {
            true => Ok(()),
            false => Err(crate::engine::client::foreign_block()),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request; `false` if the call is over.
    pub async fn send_block(&self, block: crate::BlockMut, last: bool) -> bool {
        self.closing_send(last);
        if self.made_in.forked() {
            return false;
        }
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => false,
            sent = self.sender.send_block(block, last) => sent,
        }
    }

    /// Half-closes.
    pub async fn close_send(&self) {
        self.closing_send(true);
        if self.made_in.forked() {
            return;
        }
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => {}
            _ = self.sender.close() => {}
        }
    }

    fn ended(&self, trailers: MetadataMap, message: &str) {
        if let Ok(mut t) = self.trailers.lock() {
            t.get_or_insert_with(|| (trailers, message.to_owned()));
        }
    }

    /// The next response; `None` at an OK end (the trailers are then in
    /// [`trailers`](Self::trailers)); the call's status otherwise.
    pub async fn recv(&self) -> Result<Option<Bytes>, Status> {
        use std::sync::atomic::Ordering::Relaxed;
        // A turn that begins as `drained_end` first sets `drained` may go uncounted: its
        // response may then be held `ahead` for it, as for a reader already waiting.
        if self.drained.load(Relaxed) {
            self.turns.fetch_add(1, Relaxed);
        }
        let mut cancel = self.cancel.subscribe();
        let mut guard = self.lock().await?;
        // `drained` is read under the call, which `drained_end` set it before taking: it is
        // seen if anything is `ahead`. Not in a child forked since: the response is the
        // parent's (its block, over shm://, the parent gives back), and the call ends
        // UNAVAILABLE there when read.
        if self.drained.load(Relaxed) && !self.made_in.forked() {
            if let Some(message) = self.ahead.lock().ok().and_then(|mut a| a.take()) {
                self.ahead_taken.notify_waiters();
                return Ok(Some(message));
            }
        }
        self.receive(&mut cancel, &mut guard).await
    }

    /// The next response from the call held in `guard`, as [`recv`](Self::recv) gives it.
    async fn receive(
        &self,
        cancel: &mut watch::Receiver<bool>,
        guard: &mut tokio::sync::MutexGuard<'_, Option<ClientCall>>,
    ) -> Result<Option<Bytes>, Status> {
        let Some(call) = guard.as_mut() else { return Err(cancelled()) };
        let received = tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => None,
            r = Self::headers_then_recv(&self.headers, call) => Some(r),
        };
        match received {
            None => {
                if let Some(call) = guard.take() {
                    call.cancel().await;
                }
                self.ended(MetadataMap::new(), "");
                Err(cancelled())
            }
            Some(Ok(Some(message))) => Ok(Some(message)),
            Some(Ok(None)) => {
                self.ended(call.trailers().cloned().unwrap_or_default(), call.status_message().unwrap_or_default());
                Ok(None)
            }
            Some(Err(status)) => {
                self.ended(status.metadata().clone(), "");
                Err(status)
            }
        }
    }

    /// The call's end once every response before it was read, as grpcio gives a response
    /// stream's status: `Ok(())` for OK, the status otherwise. A reader at work reaches the
    /// end itself, and this waits (one that was already waiting when this began may find its
    /// next response held for it: after that, this waits); while none is, this reads on
    /// itself, and keeps a response it meets for the next [`recv`](Self::recv), waiting for a
    /// reader to take it. `None` if `until` passes with a response still untaken (grpcio's
    /// call then ends DEADLINE_EXCEEDED: the caller ends it so, and [`cancel`](Self::cancel)
    /// drops the response). Cancel-safe as `recv` is.
    pub async fn drained_end(&self, until: Option<Instant>) -> Option<Result<(), Status>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.drained.store(true, Relaxed);
        let mut cancel = self.cancel.subscribe();
        let mut seen = self.turns.load(Relaxed);
        loop {
            let mut guard = tokio::select! {
                biased;
                _ = cancel.wait_for(|c| *c) => return Some(Err(cancelled())),
                guard = self.lock() => match guard {
                    Ok(guard) => guard,
                    Err(status) => return Some(Err(status)),
                },
            };
            let turns = self.turns.load(Relaxed);
            if turns != seen {
                // A reader at work, or one that came while this waited for the call.
                drop(guard);
                seen = turns;
                tokio::select! {
                    biased;
                    _ = cancel.wait_for(|c| *c) => return Some(Err(cancelled())),
                    _ = tokio::time::sleep(READER_IDLE) => continue,
                }
            }
            if self.ahead.lock().is_ok_and(|a| a.is_some()) {
                let taken = self.ahead_taken.notified();
                let mut taken = std::pin::pin!(taken);
                taken.as_mut().enable(); // before the call is let go: a reader may take it at once
                drop(guard);
                let expiry = async {
                    match until {
                        Some(until) => tokio::time::sleep_until(until.into()).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = cancel.wait_for(|c| *c) => return Some(Err(cancelled())),
                    _ = taken => continue,
                    _ = expiry => return None,
                }
            }
            match self.receive(&mut cancel, &mut guard).await {
                Ok(Some(message)) => {
                    if let Ok(mut ahead) = self.ahead.lock() {
                        *ahead = Some(message);
                    }
                }
                Ok(None) => return Some(Ok(())),
                Err(status) => return Some(Err(status)),
            }
        }
    }

    /// The next response, the headers first if they are not known yet: they are published
    /// for [`headers`](Self::headers), which cannot take the call while this waits. A message
    /// that comes first implies empty headers and is kept for the `recv` after.
    async fn headers_then_recv(
        headers: &watch::Sender<Option<Result<MetadataMap, Status>>>,
        call: &mut ClientCall,
    ) -> Result<Option<Bytes>, Status> {
        if headers.borrow().is_none() {
            let got = call.headers().await;
            headers.send_if_modified(|h| h.is_none() && h.replace(got).is_none());
        }
        call.recv().await
    }

    /// The server's initial metadata, waiting for it (not for a message a concurrent
    /// [`recv`](Self::recv) waits for).
    pub async fn headers(&self) -> Result<MetadataMap, Status> {
        let mut cancel = self.cancel.subscribe();
        let mut known = self.headers.subscribe();
        if let Some(h) = known.borrow().clone() {
            return h;
        }
        let mut guard = tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => return Err(cancelled()),
            // Published by a recv that holds the call meanwhile.
            h = known.wait_for(Option::is_some) => {
                return h.ok().and_then(|h| h.clone()).unwrap_or_else(|| Err(cancelled()));
            }
            guard = self.lock() => guard?,
        };
        let Some(call) = guard.as_mut() else { return Err(cancelled()) };
        let got = tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => return Err(cancelled()),
            h = call.headers() => h,
        };
        self.headers.send_if_modified(|h| h.is_none() && h.replace(got.clone()).is_none());
        got
    }

    /// The trailing metadata, once the call has ended.
    pub fn trailers(&self) -> Option<MetadataMap> {
        Some(self.trailers.lock().ok()?.as_ref()?.0.clone())
    }

    /// The message of the OK status the call ended with (nearly always empty), once it has
    /// ended; empty after a failure, whose status has its own.
    pub fn status_message(&self) -> Option<String> {
        Some(self.trailers.lock().ok()?.as_ref()?.1.clone())
    }

    /// Ends the call with CANCELLED on both sides: wakes a waiting receiver, which sends the
    /// cancel, or sends it from the [`runtime`] if none waits. Idempotent.
    pub fn cancel(self: &Arc<Self>) {
        // In a child forked since, the wakers waiting on `cancel` are the parent's (a wake would
        // ring the parent's runtime or loop), and a task would wait on `call` for ever if a
        // parent's thread held it: the call is over here, and a read of it says UNAVAILABLE.
        if self.made_in.forked() {
            self.ended(MetadataMap::new(), "");
            return;
        }
        // A response held for a reader goes: over shm:// it pins a block of the server's arena.
        if let Ok(mut ahead) = self.ahead.lock() {
            ahead.take();
        }
        if self.cancel.send_replace(true) {
            return;
        }
        let this = self.clone();
        runtime().spawn(async move {
            if let Some(call) = this.call.lock().await.take() {
                call.cancel().await;
            }
            this.ended(MetadataMap::new(), "");
        });
    }
}

type OpFuture<O> = Pin<Box<dyn Future<Output = O> + Send>>;

/// The outcome of a [`Completions`] operation, which can also say that the operation's future
/// panicked: the operation then still completes (INTERNAL), and the others drained with it are
/// not lost with the panic.
pub trait Outcome: Send + 'static {
    /// The outcome of an operation whose future panicked; `status` is INTERNAL and says so.
    fn panicked(status: Status) -> Self;
}

/// Polls an operation's future, a panic becoming its outcome.
fn poll_op<O: Outcome>(future: &mut OpFuture<O>, cx: &mut Context<'_>) -> Poll<O> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx)))
        .unwrap_or_else(|panic| Poll::Ready(O::panicked(panic_status(&*panic))))
}

/// The INTERNAL status a binding reports for a panic it caught (`panic` is what
/// `catch_unwind` gave).
pub fn panic_status(panic: &(dyn std::any::Any + Send)) -> Status {
    Status::new(Code::Internal, format!("isthmus caught a panic: {}", crate::status::panic_text(panic)))
}

/// A lock of the completions' plain data, taken even if a thread panicked holding it: every
/// change under these locks is one push, take or removal, so no half-made state is left, and
/// refusing the lock would lose every operation's outcome from then on.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An operation that had to wait: its future, polled again on the draining thread each time
/// it is woken.
struct Op<O> {
    token: u64,
    future: Mutex<Option<OpFuture<O>>>,
    completions: Weak<Completions<O>>,
}

impl<O: Outcome> Wake for Op<O> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(completions) = self.completions.upgrade() {
            completions.queue(|q| q.woken.push(self.clone()));
        }
    }
}

/// What the next [`Completions::take`] takes.
struct Queue<O> {
    done: Vec<(u64, O)>,
    woken: Vec<Arc<Op<O>>>,
}

impl<O> Default for Queue<O> {
    fn default() -> Self {
        Queue { done: Vec::new(), woken: Vec::new() }
    }
}

/// Operations of one event loop, each named by a caller's token, completing with an outcome of
/// type `O` (see the module's documentation).
pub struct Completions<O> {
    fd: EventFd,
    /// Rung with `fd` when set: for a loop that can watch only a socket it connected itself.
    bell: Mutex<Option<SocketBell>>,
    queue: Mutex<Queue<O>>,
    /// Operations waiting, by token (to abandon them); a token is hashed as a stream id is,
    /// cheaper than SipHash, on every operation that waits.
    running: Mutex<HashMap<u64, Arc<Op<O>>, IdKeys>>,
    /// Set by [`abort_all`](Self::abort_all) under `running`'s lock: an operation that would
    /// wait after it (started on another thread as the queue closed) is dropped instead, so
    /// that what it was doing (a reply, a receive) ends rather than waits for a poll that no
    /// one will make.
    closed: std::sync::atomic::AtomicBool,
}

impl<O> std::fmt::Debug for Completions<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completions").field("fd", &self.fd.as_raw_fd()).finish_non_exhaustive()
    }
}

impl<O: Outcome> Completions<O> {
    /// Empty completions with a fresh eventfd.
    pub fn new() -> std::io::Result<Arc<Completions<O>>> {
        Ok(Arc::new(Completions {
            fd: EventFd::new()?,
            bell: Mutex::new(None),
            queue: Mutex::default(),
            running: Mutex::default(),
            closed: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// The eventfd: readable while completions wait to be taken.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn queue(&self, add: impl FnOnce(&mut Queue<O>)) {
        let mut queue = lock(&self.queue);
        let first = queue.done.is_empty() && queue.woken.is_empty();
        add(&mut queue);
        drop(queue);
        // `take` drains the eventfd before it takes the queue, so a queue found empty here has
        // been (or is being) taken: one signal per batch.
        if first {
            self.signal();
        }
    }

    /// Rings `bell` too whenever the eventfd is signalled, instead of the bell set before.
    pub fn set_bell(&self, bell: SocketBell) {
        *lock(&self.bell) = Some(bell);
        if self.is_ready() {
            self.signal(); // what came before the bell
        }
    }

    /// Runs `fut` and queues its outcome under `token`. Polled here first, so what can happen
    /// at once (sending a request) happens before this returns.
    pub fn run<F>(self: &Arc<Self>, token: u64, fut: F)
    where
        F: Future<Output = O> + Send + 'static,
    {
        if let Some(outcome) = self.start(token, fut) {
            self.queue(|q| q.done.push((token, outcome)));
        }
    }

    /// [`run`](Self::run), but an outcome ready at once is returned here instead of queued
    /// (the caller gets its answer without a trip through the eventfd).
    pub fn run_now<F>(self: &Arc<Self>, token: u64, fut: F) -> Option<O>
    where
        F: Future<Output = O> + Send + 'static,
    {
        self.start(token, fut)
    }

    /// Polls `fut` once; its outcome if ready, else it waits among the running operations.
    fn start<F>(self: &Arc<Self>, token: u64, fut: F) -> Option<O>
    where
        F: Future<Output = O> + Send + 'static,
    {
        let op = Arc::new(Op { token, future: Mutex::new(None), completions: Arc::downgrade(self) });
        let mut slot = lock(&op.future);
        // In the slot before the first poll: a wake-up that comes before this returns finds
        // the future there (and waits for this lock).
        let future = slot.insert(Box::pin(fut));
        let _runtime = runtime().enter();
        match poll_op(future, &mut Context::from_waker(&Waker::from(op.clone()))) {
            Poll::Ready(outcome) => {
                *slot = None;
                Some(outcome)
            }
            Poll::Pending => {
                // Registered while the slot is still locked: a `take` that polls it to its end
                // (after a wake-up during the first poll) then finds it there to remove.
                let mut running = lock(&self.running);
                if self.closed.load(std::sync::atomic::Ordering::Relaxed) {
                    drop(running);
                    let future = slot.take();
                    drop(slot);
                    drop(future); // as abort_all drops those that waited before
                    return None;
                }
                running.insert(token, op.clone());
                drop(running);
                drop(slot);
                None
            }
        }
    }

    /// Polls every woken operation; the finished ones, with those that finished at once.
    pub fn take(&self) -> Vec<(u64, O)> {
        self.fd.drain();
        let Queue { mut done, woken } = std::mem::take(&mut *lock(&self.queue));
        let _runtime = runtime().enter();
        for op in woken {
            let mut slot = lock(&op.future);
            let Some(future) = slot.as_mut() else { continue }; // finished or abandoned
            if let Poll::Ready(outcome) = poll_op(future, &mut Context::from_waker(&Waker::from(op.clone()))) {
                *slot = None;
                self.forget(&op);
                done.push((op.token, outcome));
            }
        }
        done
    }

    /// Removes a finished operation from `running`, unless a later one took its token there
    /// (a caller that reused a token still in use, which a binding refuses but two threads can
    /// race past): that one stays, so that `abort` still finds it.
    fn forget(&self, op: &Arc<Op<O>>) {
        let mut running = lock(&self.running);
        if running.get(&op.token).is_some_and(|r| Arc::ptr_eq(r, op)) {
            running.remove(&op.token);
        }
    }

    /// Makes the eventfd readable (for a caller that took fewer completions than were ready).
    pub fn signal(&self) {
        self.fd.signal();
        if let Some(bell) = lock(&self.bell).as_ref() {
            bell.ring();
        }
    }

    /// True if something waits to be taken (without taking it).
    pub fn is_ready(&self) -> bool {
        let q = lock(&self.queue);
        !q.done.is_empty() || !q.woken.is_empty()
    }

    /// Waits until something waits to be taken or `deadline` passes: first spinning for up to
    /// `spin`, then asleep on the eventfd. True if something is ready.
    pub fn wait(&self, spin: std::time::Duration, deadline: Option<Instant>) -> bool {
        let start = Instant::now();
        while start.elapsed() < spin {
            if self.is_ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        self.is_ready() || self.fd.wait(deadline) || self.is_ready()
    }

    /// Waits on this thread, never asleep, until something waits to be taken or `spin` has
    /// passed: spinning, and after `yield_after` yielding the CPU between looks (a peer that
    /// shares this core gets it). True if something is ready. For an event loop whose one
    /// pending operation may finish within microseconds: taken this way, it costs no sleep and
    /// no wake-up.
    pub fn spin(&self, spin: std::time::Duration, yield_after: std::time::Duration) -> bool {
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            if self.is_ready() {
                return true;
            }
            let spent = start.elapsed();
            if spent >= spin {
                return false;
            }
            if spent >= yield_after {
                std::thread::yield_now();
            }
        }
    }

    /// Whether an operation started with `token` is still waiting (neither finished nor
    /// abandoned): a binding whose caller picks the tokens refuses one in use.
    pub fn is_running(&self, token: u64) -> bool {
        lock(&self.running).contains_key(&token)
    }

    /// Drops a waiting operation's future (which cancels a call it was making); its token
    /// never completes. `false` if it is not waiting.
    pub fn abort(&self, token: u64) -> bool {
        let Some(op) = lock(&self.running).remove(&token) else { return false };
        let future = lock(&op.future).take();
        // No future: a `take` polled it to its end meanwhile (it removes the operation from
        // `running` only after), so its outcome is queued or taken. Saying "abandoned" then
        // would let a caller reuse what waits for it while that outcome is still delivered.
        let abandoned = future.is_some();
        drop(future);
        abandoned
    }

    /// Abandons every waiting operation (the loop is closing), and every one that would wait
    /// from now on.
    pub fn abort_all(&self) {
        let ops: Vec<_> = {
            let mut running = lock(&self.running);
            self.closed.store(true, std::sync::atomic::Ordering::Relaxed);
            running.drain().map(|(_, op)| op).collect()
        };
        for op in ops {
            let future = lock(&op.future).take();
            drop(future);
        }
    }
}

type Finish = tokio::sync::oneshot::Sender<Result<(), Status>>;
type DoneCallback = Box<dyn FnOnce() + Send>;

/// A server call handed to foreign code (a Python handler, a C callback): its operations from
/// any thread, and its end by [`finish`](Self::finish). Made by [`hand_off`].
pub struct HandedCall {
    /// The sending half (and the call's end); the requests are apart, so that a handler's
    /// thread reading them never holds up another that sends.
    call: tokio::sync::Mutex<crate::ServerCall>,
    /// The receiving half, taken out of the call (None if a bridge had taken it before).
    requests: tokio::sync::Mutex<Option<crate::engine::server::Requests>>,
    path: String,
    metadata: MetadataMap,
    peer: String,
    /// The `shm://` connection the call came on, for the handler's thread to read.
    connection: Option<Lender>,
    tls: bool,
    peer_certificate: Option<crate::PeerCertificate>,
    deadline: Option<Instant>,
    /// False once the call is over: finished, cancelled by the client, or past its deadline.
    active: std::sync::atomic::AtomicBool,
    /// Notified when `active` turns false: waits that nothing else ends (room in the arena)
    /// end then ([`until_over`](HandedCall::until_over)).
    over: tokio::sync::Notify,
    /// Initial metadata or a message has been sent, or is being sent.
    responded: std::sync::atomic::AtomicBool,
    /// A choice of compression made while another thread held `call`, for whoever sends
    /// first to apply ([`set_compression`](HandedCall::set_compression)).
    chosen: Mutex<Option<Option<crate::Compression>>>,
    /// Set once a choice has waited in `chosen`: senders look there only then.
    choice_waits: std::sync::atomic::AtomicBool,
    /// Taken by `finish`.
    finish: Mutex<Option<Finish>>,
    /// Run once when the call ends (grpc's `add_callback`).
    done: Mutex<Vec<DoneCallback>>,
    /// Run when the call ends without its handler's `finish` (`add_abandon_callback`).
    abandoned: Mutex<Vec<DoneCallback>>,
    /// Run by `finish` before the status goes out (`on_finish`).
    finishing: Mutex<Option<DoneCallback>>,
}

impl std::fmt::Debug for HandedCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandedCall").field("path", &self.path).field("active", &self.is_active()).finish()
    }
}

/// Runs a server call by handing it to foreign code: `deliver` gets the call (and must not
/// block); the returned future, a handler's, ends when that code calls
/// [`HandedCall::finish`]. If it is dropped first (the client cancelled, the deadline
/// passed), the call is no longer active and its operations fail.
pub async fn hand_off(
    mut call: crate::ServerCall,
    deliver: impl FnOnce(Arc<HandedCall>) -> Result<(), Status>,
) -> Result<(), Status> {
    use std::sync::atomic::AtomicBool;
    let (finish, finished) = tokio::sync::oneshot::channel();
    let handed = Arc::new(HandedCall {
        path: call.path().to_owned(),
        metadata: call.metadata().clone(),
        peer: call.peer().to_owned(),
        connection: call.lender(),
        tls: call.is_tls(),
        peer_certificate: call.peer_certificate(),
        deadline: call.time_remaining().map(|t| Instant::now() + t),
        requests: tokio::sync::Mutex::new(call.take_requests()),
        call: tokio::sync::Mutex::new(call),
        active: AtomicBool::new(true),
        over: tokio::sync::Notify::new(),
        responded: AtomicBool::new(false),
        chosen: Mutex::new(None),
        choice_waits: AtomicBool::new(false),
        finish: Mutex::new(Some(finish)),
        done: Mutex::new(Vec::new()),
        abandoned: Mutex::new(Vec::new()),
        finishing: Mutex::new(None),
    });
    let _ended = Ended(handed.clone());
    deliver(handed)?;
    crate::engine::mux::handed_off();
    // The sender lives in the call, which this future holds (`_ended`): it is never dropped
    // unsent while the call waits here. A binding whose handler may let go of its handle
    // unfinished finishes it then itself (Python's server call does, when it is dropped).
    finished.await.unwrap_or_else(|_| Err(Status::new(Code::Unknown, "the call's finish was lost")))
}

/// Marks a handed call over and runs its callbacks when its handler's future ends, however it
/// ends.
struct Ended(Arc<HandedCall>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.active.store(false, std::sync::atomic::Ordering::Release);
        self.0.over.notify_waiters();
        let mut callbacks = self.0.done.lock().map(|mut c| std::mem::take(&mut *c)).unwrap_or_default();
        let abandoned = self.0.abandoned.lock().map(|mut c| std::mem::take(&mut *c)).unwrap_or_default();
        // Unfinished: the client cancelled, the deadline passed or the connection ended.
        if self.0.finish.lock().is_ok_and(|f| f.is_some()) {
            callbacks.extend(abandoned);
        }
        if callbacks.is_empty() {
            return;
        }
        let run = move || callbacks.into_iter().for_each(|callback| callback());
        // This runs on the connection's reader (ADR 0019), and a binding's callback may wait
        // for its interpreter's lock: it runs on a thread of the pool, not there.
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(run)),
            Err(_) => run(),
        }
    }
}

impl HandedCall {
    /// The method path.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The client's initial metadata.
    pub fn metadata(&self) -> &MetadataMap {
        &self.metadata
    }

    /// The `shm://` connection the call came on, which the thread that ran its handler may
    /// read while it waits for its next call ([`Lender::serve_here`], ADR 0020); `None` for
    /// other transports.
    pub fn connection(&self) -> Option<&Lender> {
        self.connection.as_ref()
    }

    /// The client's address ([`ServerCall::peer`](crate::ServerCall::peer)).
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether the call came over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The client's certificate, for a call that came over mutual TLS.
    pub fn peer_certificate(&self) -> Option<&crate::PeerCertificate> {
        self.peer_certificate.as_ref()
    }

    /// Time left before the client's deadline, if it set one.
    pub fn time_remaining(&self) -> Option<std::time::Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// True once the call's initial metadata has gone or is going: sent on its own (by a
    /// handler, or by a [`recv`](Self::recv) that flushed it), or with a first response.
    pub fn has_responded(&self) -> bool {
        self.responded.load(std::sync::atomic::Ordering::Acquire)
    }

    /// True while the call runs and has not been finished.
    pub fn is_active(&self) -> bool {
        self.active.load(std::sync::atomic::Ordering::Acquire) && self.finish.lock().is_ok_and(|f| f.is_some())
    }

    /// Runs `callback` when [`finish`](Self::finish) is called, before the status goes out (so
    /// before the client can see the end): for a binding that accounts for the call until its
    /// handler is done with it (a server's concurrency limit). Replaces one set before; never
    /// run if the call is dropped unfinished.
    pub fn on_finish(&self, callback: DoneCallback) {
        if let Ok(mut slot) = self.finishing.lock() {
            *slot = Some(callback);
        }
    }

    /// Runs `callback` once when the call ends; `false` (and not run) if it has already ended.
    pub fn add_done_callback(&self, callback: DoneCallback) -> bool {
        let Ok(mut done) = self.done.lock() else { return false };
        if !self.active.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        done.push(callback);
        true
    }

    /// Runs `callback` once if the call ends before its handler finishes it (the client
    /// cancelled, the deadline passed, the connection ended): for a binding that must stop the
    /// handler then, at no cost to the calls that end normally. `false` (and not run) if the
    /// call has already ended.
    pub fn add_abandon_callback(&self, callback: DoneCallback) -> bool {
        let Ok(mut abandoned) = self.abandoned.lock() else { return false };
        if !self.active.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        abandoned.push(callback);
        true
    }

    fn check_active(&self) -> Result<(), Status> {
        match self.is_active() {
            true => Ok(()),
            false => Err(Status::new(Code::Cancelled, "the call is over")),
        }
    }

    /// `op`, unless the call ends first (its client cancels, its deadline passes, another
    /// thread finishes it): then CANCELLED, or DEADLINE_EXCEEDED past the deadline. A send or
    /// an `alloc` waiting for room in the arena (held by a client that keeps what it received)
    /// watches nothing else, and held its thread, and the call's other sends, after the call
    /// was over. An `op` ready at once costs no watch.
    async fn until_over<T>(&self, op: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
        let over = async {
            loop {
                let notified = self.over.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if !self.active.load(std::sync::atomic::Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        };
        tokio::select! {
            biased;
            done = op => done,
            // Within the engine's rounding of the deadline, it is what ended the call.
            () = over => Err(match self.deadline.is_some_and(|d| Instant::now() + std::time::Duration::from_millis(10) >= d) {
                true => Status::new(Code::DeadlineExceeded, "the call's deadline passed"),
                false => Status::new(Code::Cancelled, "the call is over"),
            }),
        }
    }

    /// The next request; `None` once the client has half-closed. With `flush_headers`, a
    /// call that has sent nothing yet and must wait for a request sends its (empty) initial
    /// metadata first: a client that waits for the response to open before it sends its first
    /// request (tonic's generated clients do) is then not left waiting on a handler that waits
    /// for that request.
    pub async fn recv(&self, flush_headers: bool) -> Result<Option<Bytes>, Status> {
        use std::sync::atomic::Ordering;
        self.check_active()?;
        let mut requests = self.requests.lock().await;
        let Some(requests) = requests.as_mut() else {
            return Err(Status::new(Code::FailedPrecondition, "the request stream was handed to a tonic service"));
        };
        if flush_headers && !self.responded.load(Ordering::Acquire) {
            if let Poll::Ready(r) = std::future::poll_fn(|cx| Poll::Ready(requests.poll_recv(cx))).await {
                return r;
            }
            self.sending().await.flush_headers().await?;
        }
        std::future::poll_fn(|cx| requests.poll_recv(cx)).await
    }

    /// The next request if it is in already, taken without waiting: `None` if it must be
    /// waited for (or another thread is receiving), and [`recv`](Self::recv) then waits. For a
    /// foreign thread that would otherwise poll a future for a request that is there.
    pub fn try_recv(&self) -> Option<Result<Option<Bytes>, Status>> {
        if let Err(over) = self.check_active() {
            return Some(Err(over));
        }
        let mut requests = self.requests.try_lock().ok()?;
        // Polled with a waker that does nothing: a later `recv` polls with its own, and a
        // request is woken through the waker of the latest poll.
        match requests.as_mut()?.poll_recv(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        }
    }

    /// Whether the client has half-closed and every request it sent has been taken: a handler
    /// of a method that takes one request, having taken it, knows then that no second one
    /// comes (gRPC's cardinality check) without waiting. False if not (yet), or while another
    /// thread receives.
    pub fn half_closed(&self) -> bool {
        self.requests.try_lock().is_ok_and(|r| r.as_ref().is_some_and(|r| r.half_closed()))
    }

    /// Waits up to `budget` for the next request on this thread, reading the call's connection
    /// meanwhile while this is the only call open on it ([`Lender::read_for_call`], ADR 0029):
    /// a streaming handler's receive that spins then takes the message without a hand-over from
    /// the connection's reader task. Returns at once if the request is in, another thread
    /// receives, or the connection cannot be read here; [`try_recv`](Self::try_recv) then takes
    /// what came. Credit owed to the client goes first: the client may be waiting for it to
    /// send the request.
    pub fn read_for_request(&self, budget: std::time::Duration) {
        let Some(lender) = &self.connection else { return };
        let Ok(mut requests) = self.requests.try_lock() else { return };
        let Some(requests) = requests.as_mut() else { return };
        if requests.is_ready() || !self.is_active() {
            return;
        }
        requests.settle();
        // A call that ends closes its stream's inbox, which `is_ready` sees.
        lender.read_for_call(budget, || requests.is_ready())
    }

    /// A unary handler's whole answer: sends `message` and finishes the call with `status()`,
    /// now, from the calling thread, if that takes no wait (see `ServerCall::try_send_now`),
    /// in one frame where the connection agreed to one-frame calls (`ServerCall::send_last`).
    /// False, with nothing sent, otherwise: then [`send`](Self::send) and
    /// [`finish`](Self::finish) as usual (the send fails if the call has ended meanwhile).
    pub fn try_reply(&self, message: &[u8], status: impl FnOnce() -> Status) -> bool {
        if !self.active.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let Ok(mut call) = self.call.try_lock() else { return false };
        // Responding from here on (a reply that cannot go now goes through `send`), and a
        // choice of compression made meanwhile decides how.
        self.responded.store(true, std::sync::atomic::Ordering::SeqCst);
        self.apply_choice(&mut call);
        self.settle();
        if call.reserve_last(message.len()) {
            // One frame, the message inside the status, sent under this hold of the call.
            let Some(finish) = self.begin_finish() else { return false };
            // False: the call ended meanwhile (its deadline, its client's cancel) and nothing
            // went. Its finish is taken, so the caller's send fails CANCELLED ("the call is
            // over"), as any send after the end does.
            let sent = call.end_now(status(), Some(message));
            let _ = finish.send(Ok(()));
            return sent;
        }
        if !call.try_send_now(message) {
            return false;
        }
        drop(call);
        self.finish(status());
        true
    }

    /// The first step of finishing the call, once: takes what tells its handler's future, and
    /// runs the `on_finish` hook. `None` if it was finished already.
    fn begin_finish(&self) -> Option<Finish> {
        let finish = self.finish.lock().ok().and_then(|mut f| f.take())?;
        if let Some(finishing) = self.finishing.lock().ok().and_then(|mut f| f.take()) {
            finishing();
        }
        Some(finish)
    }

    /// Credit owed to the client goes out before a send, unless a receive holds the requests
    /// (it sends it then): the client may be waiting for exactly that credit.
    fn settle(&self) {
        if let Ok(mut requests) = self.requests.try_lock() {
            if let Some(requests) = requests.as_mut() {
                requests.settle();
            }
        }
    }

    /// Sends one response message.
    pub async fn send(&self, message: &[u8]) -> Result<(), Status> {
        self.check_active()?;
        self.settle();
        self.until_over(async { self.sending().await.send(message).await }).await
    }

    /// Sends initial metadata now.
    pub async fn send_headers(&self, metadata: MetadataMap) -> Result<(), Status> {
        self.check_active()?;
        self.until_over(async { self.sending().await.send_headers(metadata).await }).await
    }

    /// Chooses the compression of this call's replies where they cross a wire (see
    /// [`ServerCall::set_compression`](crate::ServerCall::set_compression)); false once initial
    /// metadata or a message has gone or begun to go. Never waits: an event loop's thread may
    /// call it while the loop's own operations hold the call (an `alloc` waiting for room, say);
    /// the choice then waits for the first send, which applies it.
    pub fn set_compression(&self, compression: Option<crate::Compression>) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if self.responded.load(SeqCst) {
            return false;
        }
        if let Ok(mut call) = self.call.try_lock() {
            // A choice that waited is older than this one.
            if let Ok(mut older) = self.chosen.lock() {
                older.take();
            }
            return call.set_compression(compression);
        }
        let Ok(mut chosen) = self.chosen.lock() else { return false };
        *chosen = Some(compression);
        drop(chosen);
        // Each sender marks `responded`, then looks for a waiting choice; this marks the
        // choice, then looks at `responded` (both SeqCst): at least one sees the other. If a
        // send has begun, the choice counts only if that send took it.
        self.choice_waits.store(true, SeqCst);
        !self.responded.load(SeqCst) || self.chosen.lock().is_ok_and(|mut c| c.take().is_none())
    }

    /// The call, for a send: marks the call as responding, waits for the call, and applies a
    /// choice of compression that waited for it (`set_compression`), in that order.
    async fn sending(&self) -> tokio::sync::MutexGuard<'_, crate::ServerCall> {
        self.responded.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut call = self.call.lock().await;
        self.apply_choice(&mut call);
        call
    }

    /// Applies a choice of compression that waited for the call (`set_compression`); the
    /// caller holds the call, has marked `responded`, and sends next.
    fn apply_choice(&self, call: &mut crate::ServerCall) {
        if !self.choice_waits.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        if let Some(choice) = self.chosen.lock().ok().and_then(|mut c| c.take()) {
            call.set_compression(choice);
        }
    }

    /// A writable block in the server's shared memory (`shm://` calls only).
    pub async fn alloc(&self, len: usize) -> Result<crate::BlockMut, Status> {
        self.check_active()?;
        self.until_over(async { self.call.lock().await.alloc(len).await }).await
    }

    /// [`alloc`](Self::alloc) without waiting, for an event loop's thread: `None` while the
    /// arena has no room, or while another task of the call holds it (sending).
    pub fn try_alloc(&self, len: usize) -> Result<Option<crate::BlockMut>, Status> {
        self.check_active()?;
        match self.call.try_lock() {
            Ok(mut call) => call.try_alloc(len),
            Err(_) => Ok(None),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one response message.
    pub async fn send_block(&self, block: crate::BlockMut) -> Result<(), Status> {
        self.check_active()?;
        self.settle();
        self.until_over(async { self.sending().await.send_block(block).await }).await
    }

    /// Delivers `topic` to this call until the client leaves or the topic closes
    /// ([`Topic::serve_with`](crate::Topic::serve_with) for a handed call): each large message by
    /// reference to the one block `publish` wrote; with `on_gap`, after messages were dropped
    /// the queued ones are dropped too and `on_gap(n)`'s message, if any, is sent in their
    /// place. Leaves the topic at once when the call ends (the client's cancel, its deadline,
    /// its death): `Err` CANCELLED then; `Err` RESOURCE_EXHAUSTED at once for a subscriber that
    /// fell behind, even while a send waits for it, or for a message over `max_send` bytes
    /// ([`Topic::serve_limited`](crate::Topic::serve_limited)); `Err` UNAVAILABLE once the
    /// server starts to shut down and what was queued is sent.
    pub async fn serve_topic(
        &self,
        topic: &crate::Topic,
        max_send: Option<usize>,
        mut on_gap: Option<impl FnMut(u64) -> Option<Bytes>>,
    ) -> Result<(), Status> {
        use crate::Delivery;
        self.check_active()?;
        // Raced against the call's end, as every send here is: the initial metadata wait for
        // ring room, which a stalled client's never gives, and this held its thread.
        let (arena, inline_max, direct, going_away) = self
            .until_over(async {
                let mut call = self.sending().await;
                Ok((call.shared_arena().cloned(), call.inline_max(), call.direct().await?, call.going_away()))
            })
            .await?;
        let mut sub = topic.subscribe_sending(arena.as_ref(), inline_max, max_send.unwrap_or(usize::MAX));
        sub.end_when(going_away);
        sub.send_directly(direct);
        if !self.add_done_callback(Box::new(sub.canceller())) {
            return Err(Status::new(Code::Cancelled, "the call is over"));
        }
        while let Some(next) = sub.next().await? {
            let (message, published) = match next {
                Delivery::Gap(n) => match on_gap.as_mut().map(|on_gap| topic.resync(&sub, n, on_gap)).transpose()? {
                    Some(Some(resync)) => (Err(resync), false),
                    _ => continue,
                },
                Delivery::Message(p) => match arena.as_ref().and_then(|a| p.shared_block(a)) {
                    Some(block) => (Ok(block.clone()), true),
                    None => (Err(p.bytes()), true),
                },
            };
            let send = async {
                let mut call = self.call.lock().await;
                match &message {
                    Ok(block) => call.send_shared(block).await,
                    Err(bytes) => call.send(bytes).await,
                }
            };
            tokio::select! {
                biased;
                sent = send => sent?,
                status = sub.cancelled() => return Err(status),
            }
            if published {
                topic.count_delivered();
            }
        }
        Ok(())
    }

    /// Ends the call with `status` (OK with no trailers ends it plainly). Later calls do
    /// nothing; `false` if it had already been finished.
    ///
    /// The status goes onto the ring from the calling thread when no other operation of the
    /// call is under way (`ServerCall::end_now`): the client has its answer without the
    /// engine's task being woken first. Otherwise, and if the call ended meanwhile, the
    /// engine sends it when the handler's future ends.
    pub fn finish(&self, status: Status) -> bool {
        let Some(finish) = self.begin_finish() else { return false };
        // Not once the call is over: its end (the deadline, the client's cancel) is the
        // engine's to send, and the handler may be finishing only because that end reached it
        // (`Ended` marks the call inactive before it runs the callbacks that tell it).
        if self.active.load(std::sync::atomic::Ordering::Acquire) {
            if let Ok(call) = self.call.try_lock() {
                let ended = call.end_now(status, None);
                let _ = finish.send(Ok(()));
                return ended;
            }
        }
        let outcome = if status.code() == Code::Ok && status.metadata().is_empty() && status.message().is_empty() {
            Ok(())
        } else {
            // An OK status with trailers or a message goes as a status too: the engine sends it
            // as it is.
            Err(status)
        };
        let _ = finish.send(outcome);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Outcome for u32 {
        fn panicked(_: Status) -> u32 {
            u32::MAX
        }
    }

    #[test]
    fn an_operation_that_would_wait_once_the_queue_closed_is_dropped() {
        struct Dropped(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let completions = Completions::<u32>::new().expect("eventfd");
        let before = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Dropped(before.clone());
        completions.run(1, async move {
            let _guard = guard;
            std::future::pending::<u32>().await
        });
        assert!(completions.is_running(1));
        completions.abort_all();
        assert!(before.load(std::sync::atomic::Ordering::SeqCst), "a waiting operation was not dropped");
        // Started after the close (another thread's, as the queue was freed): dropped too,
        // where it waited for ever among the running.
        let after = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Dropped(after.clone());
        completions.run(2, async move {
            let _guard = guard;
            std::future::pending::<u32>().await
        });
        assert!(after.load(std::sync::atomic::Ordering::SeqCst), "an operation started after the close waits");
        assert!(!completions.is_running(2));
        // One that finishes at once still gives its outcome.
        assert_eq!(completions.run_now(3, async { 7 }), Some(7));
    }

    #[test]
    fn an_operation_that_panics_completes_and_the_others_of_its_batch_too() {
        let completions = Completions::<u32>::new().expect("eventfd");
        // Panics at once: the start gives its outcome.
        let at_once = completions.run_now(1, async { panic!("at once") });
        assert_eq!(at_once, Some(u32::MAX));
        // Three waiting; the middle one panics when woken. All three are drained together.
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..3).map(|_| tokio::sync::oneshot::channel::<u32>()).unzip();
        for (i, rx) in rxs.into_iter().enumerate() {
            let token = 10 + i as u64;
            completions.run(token, async move {
                let v = rx.await.unwrap_or(0);
                assert!(token != 11, "a bug inside an operation");
                v
            });
        }
        for (i, tx) in txs.into_iter().enumerate() {
            tx.send(i as u32 + 1).expect("send");
        }
        let mut done = completions.take();
        done.sort();
        assert_eq!(done, vec![(10, 1), (11, u32::MAX), (12, 3)]);
        assert!(!completions.is_running(11), "the panicked operation is over");
        // The queue still works after it.
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        completions.run(20, async move { rx.await.unwrap_or(0) });
        tx.send(7).expect("send");
        assert_eq!(completions.take(), vec![(20, 7)]);
    }

    #[test]
    fn a_token_reused_while_in_use_names_the_later_operation() {
        // Two threads past a binding's check at once: both operations wait under token 3.
        let completions = Completions::<u32>::new().expect("eventfd");
        let (tx1, rx1) = tokio::sync::oneshot::channel::<u32>();
        let (_tx2, rx2) = tokio::sync::oneshot::channel::<u32>();
        completions.run(3, async move { rx1.await.unwrap_or(0) });
        completions.run(3, async move { rx2.await.unwrap_or(0) });
        // The first finishes; the second still waits under the token, and can be abandoned.
        tx1.send(1).expect("send");
        assert_eq!(completions.take(), vec![(3, 1)]);
        assert!(completions.is_running(3), "the later operation still waits");
        assert!(completions.abort(3), "and is abandoned by its token");
        assert!(completions.take().is_empty());
    }

    #[test]
    fn an_operation_abandoned_after_it_finished_is_not_reported_abandoned() {
        let completions = Completions::<u32>::new().expect("eventfd");
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        completions.run(7, async move { rx.await.unwrap_or(0) });
        // Pending: waiting among the running operations, so abandoning it works.
        let (tx2, rx2) = tokio::sync::oneshot::channel::<u32>();
        completions.run(8, async move { rx2.await.unwrap_or(0) });
        assert!(completions.abort(8), "a waiting operation is abandoned");
        drop(tx2);
        assert!(completions.take().is_empty(), "an abandoned operation has no outcome");

        // The moment `take` has polled operation 7 to its end but not yet removed it from
        // `running`: an abort then must say "finished", since the outcome is on its way.
        tx.send(5).expect("send");
        let op = completions.running.lock().expect("lock").get(&7).cloned().expect("running");
        let future = op.future.lock().expect("lock").take();
        drop(future);
        assert!(!completions.abort(7), "finished, not abandoned");
        assert!(!completions.abort(7), "and no longer waiting");
    }
}

/// Unary calls that an event loop's thread sends and waits for itself for a moment before it
/// leaves the reply to its completions: over a blocking channel (its own `shm://` connection,
/// read by whichever thread waits, ADR 0010), so that a reply that comes within the spin is
/// taken with no thread woken at all. A slower reply is waited for by a thread of the
/// runtime's blocking pool ([`finish_unary`]), at most [`HANDED_OFF_MAX`] at once.
#[derive(Debug)]
pub struct SpinFirst {
    channel: crate::blocking::Channel,
    /// A thread of the pool is connecting `channel`.
    connecting: Arc<std::sync::atomic::AtomicBool>,
}

/// How long a request sent from an event loop's thread may wait for room in the connection
/// ([`crate::blocking::Channel::unary_begin_within`]) before it goes the completions' way
/// instead: a server that is behind, or has stopped reading, never stalls the loop longer.
pub const SEND_PATIENCE: std::time::Duration = std::time::Duration::from_micros(200);

/// Unary calls whose slow replies threads of the pool wait for, at most: beyond it,
/// [`SpinFirst::ready`] declines and calls take the completions' path from the start.
pub const HANDED_OFF_MAX: usize = 64;

static HANDED_OFF: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One count in `HANDED_OFF`, given back when dropped (also if the thread's closure never
/// runs or panics).
struct HandedOff;

impl HandedOff {
    fn new() -> HandedOff {
        HANDED_OFF.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        HandedOff
    }
}

impl Drop for HandedOff {
    fn drop(&mut self) {
        HANDED_OFF.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// True while threads of the pool wait for fewer than [`HANDED_OFF_MAX`] slow replies.
pub fn may_hand_off() -> bool {
    HANDED_OFF.load(std::sync::atomic::Ordering::Relaxed) < HANDED_OFF_MAX
}

impl SpinFirst {
    /// Calls over `channel` (not connected yet, typically: [`ready`](Self::ready) connects it).
    pub fn new(channel: crate::blocking::Channel) -> SpinFirst {
        SpinFirst { channel, connecting: Arc::default() }
    }

    /// The blocking channel, whatever its state (for calls that may block).
    pub fn channel(&self) -> &crate::blocking::Channel {
        &self.channel
    }

    /// The channel for a call sent from an event loop's thread: `None` while it is not
    /// connected (a thread of the pool connects it then: a handshake with a slow server never
    /// runs on the loop's thread) or while [`may_hand_off`] is false.
    pub fn ready(&self) -> Option<&crate::blocking::Channel> {
        if !may_hand_off() {
            return None;
        }
        self.connected().then_some(&self.channel)
    }

    /// True if the blocking channel is connected; if not, a thread of the pool starts
    /// connecting it (never the caller's thread, which may be an event loop's).
    pub fn connected(&self) -> bool {
        use std::sync::atomic::Ordering;
        if self.channel.is_connected() {
            return true;
        }
        if !self.connecting.swap(true, Ordering::AcqRel) {
            let (channel, connecting) = (self.channel.clone(), self.connecting.clone());
            runtime().spawn_blocking(move || {
                let _ = channel.connect_now();
                connecting.store(false, Ordering::Release);
            });
        }
        false
    }
}

/// A unary call whose request is a block of `channel`'s arena
/// ([`alloc`](crate::blocking::Channel::alloc)), sent and waited for by a thread of the
/// runtime's blocking pool, so that an event loop's thread never waits for ring room or for the
/// reply. Dropping the future cancels the call (noticed within 20 ms).
pub fn unary_block_off_loop(
    channel: crate::blocking::Channel,
    path: String,
    block: crate::BlockMut,
    options: crate::CallOptions,
) -> impl Future<Output = Result<crate::Response, Status>> + Send + 'static {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let handed = HandedOff::new();
    runtime().spawn_blocking(move || {
        let _handed = handed;
        match channel.unary_block_begin(&path, block, options) {
            Ok(unary) => wait_on_pool(unary, tx),
            Err(status) => drop(tx.send(Err(status))),
        }
    });
    async move { rx.await.unwrap_or_else(|_| Err(abandoned())) }
}

/// On a thread of the blocking pool: waits for `unary`'s outcome and sends it through `tx`, in
/// slices, to notice a receiver that gave up and cancel the call then.
fn wait_on_pool(
    mut unary: crate::blocking::PendingUnary,
    tx: tokio::sync::oneshot::Sender<Result<crate::Response, Status>>,
) {
    loop {
        if let Some(outcome) = unary.wait_until(Instant::now() + std::time::Duration::from_millis(20)) {
            return drop(tx.send(outcome));
        }
        if tx.is_closed() {
            return unary.cancel();
        }
    }
}

fn abandoned() -> Status {
    Status::new(Code::Cancelled, "the call was abandoned")
}

/// The outcome of a unary call sent from the caller's thread: waited for there for up to
/// `spin`, longer for a large request
/// ([`PendingUnary::spin_for`](crate::blocking::PendingUnary::spin_for)), so that a fast reply
/// is ready at the future's first poll with no wake-up at all, and otherwise by a thread of the
/// runtime's blocking pool. Dropping the future before it is
/// ready cancels the call.
pub fn finish_unary(
    mut unary: crate::blocking::PendingUnary,
    spin: std::time::Duration,
) -> impl Future<Output = Result<crate::Response, Status>> + Send + 'static {
    let quick = unary.wait_until(Instant::now() + unary.spin_for(spin));
    let (tx, rx) = tokio::sync::oneshot::channel();
    match quick {
        Some(outcome) => drop(tx.send(outcome)),
        None => {
            let handed = HandedOff::new();
            runtime().spawn_blocking(move || {
                let _handed = handed;
                wait_on_pool(unary, tx);
            });
        }
    }
    async move { rx.await.unwrap_or_else(|_| Err(abandoned())) }
}
