//! One connection's stream table, shared by both clients and the server, and the ways it is read.
//!
//! The table maps a stream id to the stream's shared state (its `Inbox` and both flow-control
//! windows), the batch in which it opened, and on the server the `Cancel` that stops its handler; a
//! call holds its side through a `Stream`. Ids are hashed with `IdHasher`, cheaper than SipHash
//! and keyed per table, so that the peer, which picks the ids, cannot make them collide.
//!
//! Routing (`step`, `route`) is the same whoever reads: HEADERS, MESSAGE (charged to the receive
//! window first), TRAILERS and CANCEL become events in the stream's inbox, under the table's lock;
//! WINDOW adds credit to the stream's send window. A frame for a stream not in the table is
//! dropped, except a server's HEADERS, which opens a call: refused with TRAILERS if the connection
//! is draining (UNAVAILABLE) or already has `max_concurrent_streams` calls (RESOURCE_EXHAUSTED);
//! else decoded, registered and handed to the server as a new call. A HEADERS for a stream still
//! open is malformed input. A one-frame call (protocol 13.9, where the handshake granted it) brings
//! its request inside its HEADERS and its response inside its TRAILERS: each becomes one event
//! (`Event::Last`, the request and the half-close; `Event::Final`, the response and the end), and
//! the message inside is held to `max_message_size` as a MESSAGE is. An end removes the stream and
//! closes its entry (inbox, send window, the server's `Cancel`). Routing never waits for a call:
//! flow control, not the inbox, bounds what a peer may queue.
//!
//! The reader task (`read_loop`) owns the `Receiver` for the async client and the server. It reads
//! in batches: one wait, then up to 256 frames already in the ring without waiting, so calls start
//! even while a peer keeps the ring full. On the server it then polls each new call once, right
//! there: a unary call's request usually came in the same batch, so its handler finishes and its
//! status goes out with no task spawned and no thread woken. A client writes HEADERS and its
//! message a fraction of a µs apart, so before that first poll, if the batch opened a call with
//! nothing after its HEADERS yet (`Accept::bare`), it spins up to 2 µs for the next frame
//! (`follow_up`): a handler run inline by a foreign thread (Go's, C's) looks for its request once
//! and otherwise waits for it through a queue. Before spawning a call that still returned
//! `Pending` it does so once more (unless the first spin saw nothing) and polls again: a missed
//! request costs a task wake-up, often on the other worker. After a batch that may have woken a
//! task (an event for a stream opened in an earlier batch, or a spawned call) it yields to the
//! scheduler before waiting again, since its own spin would hold the woken task's worker. A call
//! handed to a foreign handler (`binding::hand_off`: Python, C, Go) is not spawned: the reader
//! keeps it in `HandedCalls` and polls it whenever its own task is woken, so the foreign thread's
//! `finish` wakes a running task rather than a sleeping worker (ADR 0019). A call whose handler
//! holds its thread for long (`server::Pace`) asks in its first poll to be a task of its own
//! (`to_own_task`): it is spawned at once, and the reader then yields through the run queue
//! (`requeue`), not `yield_now`, so that an idle worker takes the reader, and the I/O driver,
//! while the handler holds this one (ADR 0031).
//!
//! Async calls read for themselves (`Lead`, `read_here`, ADR 0008): the `Receiver` sits in a slot
//! under a mutex; a call whose inbox is empty, polled on a tokio thread, takes it if free and reads
//! until its event comes or `SpinPolicy::max` passes, holding the mutex so others see someone
//! reads. It puts the receiver back, releases the mutex, and only then rings `free` for the reader
//! task: woken first, a reader or call would find the mutex held and sleep with nobody reading. A
//! call that finds the reader task holding the receiver registers its waker and interrupts the
//! reader's wait (`Interrupter`); the reader hands the receiver back, wakes the calls that asked,
//! and yields once before taking it again. `Channel::with_calls_read(false)` leaves reading to the
//! reader task, for calls an event loop polls. A call that got its event while no other call is
//! open parks the receiver instead of ringing (ADR 0029): the next read of that call, or the next
//! call, takes it from the slot with no hand-over, and the reader task stays asleep until a call
//! waits without reading (`want_reader`), a writer waits for credit, or `PARK_IDLE` passes.
//!
//! The blocking client's threads read through `driven` and `wait` (see `blocking`).
//!
//! A server's reader task lends its receiver to a foreign handler's thread that asks (`Lend`,
//! `serve_here`, ADR 0020) while no other call is in progress: a Python executor thread waiting
//! for its next call reads the connection itself, so the call it finds runs where it was read.
//! The task takes the receiver back when the borrower gives it back, when a call waits for a
//! frame (`need_reader`), or when it lay unread for a millisecond.
//!
//! Whoever reads also sends a few frames: the PING answer, the TRAILERS that refuse a call, the
//! CANCEL for a peer past its window, and the frames that end a call whose message was too large;
//! and a call that takes a message may grant credit (WINDOW). None of them waits for ring room
//! (`Mux::reply`): one that finds the ring full, or others queued before it, joins the queue, and
//! a flusher (a task of the connection's runtime, or a thread where there is none) sends the
//! queue in order as room comes. So a peer that stops reading its ring while it writes into ours
//! cannot stop our reading, and two readers each waiting for the other's room cannot deadlock. At
//! most `REPLIES_MAX` answers of `REPLY_BYTES_MAX` bytes in all wait; a peer that makes more
//! while it reads nothing of ours loses the rest (logged and counted in
//! `ConnectionCounters::answers_dropped`), except grants, four per open stream beyond it. A server
//! call the peer broke (past its window, a message too large) is ended by the reader, which claims
//! the call's end first (`end_broken`), so that its handler's task sends no second one.
//!
//! The end: `fail_all(status)` records the connection's `dead` status (the first stays), empties
//! the table, ends every call with it, fires every server `Cancel`, and closes every entry; from
//! then on `register` fails with it (and looks again after inserting, so a call racing the reader's
//! death is not stranded). It runs on a fatal transport error (`from_transport`: UNAVAILABLE for a
//! peer gone) and, after closing the connection, on a body that does not decode or a reused open id
//! (INTERNAL). A `MessageTooLarge` names its stream: only that call fails, RESOURCE_EXHAUSTED with
//! the transport's message; the server sends TRAILERS and stops the handler, the client sends
//! CANCEL. The reader task holds a `Watch` guard whose drop, if the task is dropped unfinished with
//! its runtime, fails every call UNAVAILABLE ("the connection's reader stopped") and closes the
//! sender. On the server, `go_away` marks the connection draining and sends GOAWAY with the highest
//! id accepted; on the client a GOAWAY sets `dead` to UNAVAILABLE without touching the table (calls
//! in flight go on; a blocking channel sees it only when a thread reads).
//!
//! `calls` counts calls by final code (a call the client cancelled, under that CANCEL's code:
//! CANCELLED, or DEADLINE_EXCEEDED if its deadline fired first; a refused call not at all);
//! `counters()` adds the transport's `Counters`. `Channel::counters()` gives the current
//! connection's, afresh after a reconnect; `Bound::stats()` every live connection's.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use bytes::Bytes;
use isthmus_shm::{flags, Error, ErrorKind, Frame, Kind, Receiver, Sender};
use tokio::sync::Notify;

use super::inbox::{Event, Inbox};
use crate::engine::flow::{Consumed, RecvWindow, SendWindow};
use crate::engine::wire;
use crate::status::{Code, Status};

/// A new call the server's reader found: its head and its stream (whose shared state holds the
/// signal that the client cancelled it, or the connection died, which must stop its handler).
pub(crate) struct Incoming {
    pub(crate) head: wire::RequestHead,
    pub(crate) stream: Stream,
}

/// A server call's whole life as one future: its handler, then its status sent.
pub(crate) type CallFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

thread_local! {
    /// Set by [`handed_off`] while a server reader gives a call its first poll.
    static HANDED_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// True while a server reader gives a call its first poll on the reader's own task.
    static ON_READER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set by [`to_own_task`] in such a poll.
    static OWN_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the call being polled has handed itself to a foreign thread ([`handed_off`]) in a
/// reader's poll.
pub(crate) fn handing_off() -> bool {
    HANDED_OFF.get()
}

/// Tells the server reader polling the current call that the call is to be a task of its own
/// before its handler runs, since the handler holds its thread for long (`server::Pace`): the
/// reader spawns it and does not yield to it, so that it goes on reading (a task woken by a
/// yield waits in the list of the worker that yielded, which the handler is about to hold).
pub(crate) fn to_own_task() {
    OWN_TASK.set(true);
}

/// Whether the current poll is a call's first, made by its connection's reader on the reader's
/// task: a call that returns `Pending` from it, without having handed itself off, becomes a task
/// of its own at once (so it may return `Pending` with no waker registered).
pub(crate) fn polled_by_reader() -> bool {
    ON_READER.get()
}

/// Tells the server reader polling the current call that its handler is now a foreign
/// thread's, and that the call's future only waits for that thread to finish it
/// (`binding::hand_off`). Outside a reader's first poll it does nothing.
pub(crate) fn handed_off() {
    HANDED_OFF.set(true);
}

/// Yields once to the tasks queued on this worker, as `tokio::task::yield_now` does, but
/// through the worker's run queue, which the other workers steal from, and waking one that is
/// idle. `yield_now` puts the task in a list of the worker's own that it reads only when it
/// runs out of tasks: behind a task that then holds the thread (a handler that blocks or
/// computes), the reader would read nothing, though the other worker was idle; and an idle
/// worker asleep on its condition variable rather than on the I/O driver would not watch the
/// connection's doorbell for it.
async fn requeue() {
    let mut woken = false;
    std::future::poll_fn(|cx| {
        if woken {
            return std::task::Poll::Ready(());
        }
        woken = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// How a reader's poll of a new call went, and what the call said of itself meanwhile.
struct FirstPoll {
    done: bool,
    /// [`handed_off`] was called.
    handed_off: bool,
    /// [`to_own_task`] was called.
    own_task: bool,
}

/// Polls a new call on a server reader, with [`polled_by_reader`] true meanwhile: restored after,
/// even if the poll panics (a handler's panic is caught inside the call, but a `Handler` whose
/// `handle` panics before it returns its future is not), so that no later poll on this thread
/// passes for a reader's.
fn first_poll(call: &mut CallFuture, cx: &mut std::task::Context<'_>) -> FirstPoll {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON_READER.set(self.0);
        }
    }
    HANDED_OFF.set(false);
    OWN_TASK.set(false);
    let restore = Restore(ON_READER.replace(true));
    let done = call.as_mut().poll(cx).is_ready();
    drop(restore);
    FirstPoll { done, handed_off: HANDED_OFF.replace(false), own_task: OWN_TASK.replace(false) }
}

/// A server reader's calls handed to foreign handlers: polled by the reader's task when one
/// is woken (its handler finished it, its deadline passed, its client cancelled).
#[derive(Default)]
struct HandedCalls {
    calls: futures_util::stream::FuturesUnordered<CallFuture>,
}

impl HandedCalls {
    /// Runs `fut` while serving the calls: each woken call is polled as it comes.
    async fn serve_while<T>(&mut self, fut: impl std::future::Future<Output = T>) -> T {
        use futures_util::StreamExt;
        let mut fut = std::pin::pin!(fut);
        let calls = &mut self.calls;
        std::future::poll_fn(|cx| {
            while let std::task::Poll::Ready(Some(())) = calls.poll_next_unpin(cx) {}
            fut.as_mut().poll(cx)
        })
        .await
    }

    /// Polls the calls that were woken, without waiting.
    async fn poll_ready(&mut self) {
        self.serve_while(std::future::ready(())).await;
    }

    /// The connection is over: each call left finishes as a task of its own.
    fn spawn_all(&mut self) {
        for call in std::mem::take(&mut self.calls) {
            tokio::spawn(call);
        }
    }
}

/// Makes a new call's future (the server's handler lookup and bookkeeping).
pub(crate) type NewCallFn = dyn Fn(Incoming) -> CallFuture + Send + Sync;

/// The server side of a reader: how to make calls, and the calls read in the current batch of
/// frames, to start once the batch is routed.
pub(crate) struct Accept {
    pub(crate) make: Box<NewCallFn>,
    batch: Vec<CallFuture>,
    /// The streams of `batch` whose HEADERS came with nothing after them yet.
    bare: Vec<u64>,
}

impl Accept {
    pub(crate) fn new(make: Box<NewCallFn>) -> Accept {
        Accept { make, batch: Vec::new(), bare: Vec::new() }
    }
}

/// A call's end of one stream.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) id: u64,
    pub(crate) shared: Arc<StreamShared>,
    /// What the call's application has taken and not yet given back as credit.
    consumed: Consumed,
}

impl Stream {
    /// This stream for another holder (the tonic bridge's request body, a foreign handler's
    /// requests), with what the application took and owes credit for: this one keeps nothing
    /// to give back.
    pub(crate) fn hand_over(&mut self) -> Stream {
        Stream { id: self.id, shared: self.shared.clone(), consumed: std::mem::take(&mut self.consumed) }
    }

    /// Counts a message the application took, and gives credit back to the peer once due
    /// (one WINDOW frame per half window).
    pub(crate) fn took(&mut self, len: usize, mux: &Mux) {
        if let Some(n) = self.consumed.take(len, &self.shared.recv_window) {
            self.give(n, mux);
        }
    }

    /// Sends credit still owed: a grant that could not be queued (`Mux::reply`). Call it before
    /// waiting for a message, since the peer may be waiting for exactly this credit.
    pub(crate) fn settle(&mut self, mux: &Mux) {
        if let Some(n) = self.consumed.due(&self.shared.recv_window) {
            self.give(n, mux);
        }
    }

    /// Sends a WINDOW without waiting for ring room (this may run on an event loop, or in a
    /// poll): now, or once there is room (`Mux::reply`); if it cannot even wait for room, the
    /// credit stays owed for the next `took` or `settle`.
    fn give(&mut self, n: u64, mux: &Mux) {
        let window = Reply { kind: Kind::Window, flags: 0, stream: self.id, body: wire::encode_window(n).to_vec() };
        if !mux.reply(window) {
            self.consumed.undo(n, &self.shared.recv_window);
        }
    }
}

/// What a stream's call and the connection's reader share: the events, both directions'
/// flow-control windows, and a server call's state that its handler and its future share (one
/// allocation per stream: a 64 B call allocated three more on the server when these had each
/// their own).
#[derive(Debug)]
pub(crate) struct StreamShared {
    pub(crate) inbox: Inbox,
    pub(crate) send_window: SendWindow,
    pub(crate) recv_window: RecvWindow,
    /// Who writes messages on the stream now (server side): the handler, a topic's direct send,
    /// nobody, or nobody ever again by direct send (see `engine::server::Writer`).
    pub(crate) writer: std::sync::atomic::AtomicU8,
    /// A server call's signal that its client cancelled it or the connection died.
    pub(crate) cancel: Cancel,
    /// Who sends a server call's end: its future, its handler (`ServerCall::end_now`) or the
    /// reader.
    pub(crate) ended: super::server::EndedBy,
    /// Trailing metadata a server call's handler set (`ServerCall::set_trailers`).
    pub(crate) trailers: Mutex<crate::metadata::MetadataMap>,
    /// Whether `trailers` was ever set: most calls' ends look at this, not take that lock.
    pub(crate) trailers_set: std::sync::atomic::AtomicBool,
    /// A server call's only response, held to go out inside its TRAILERS (`ServerCall::send_last`):
    /// set once, and read in place by whoever sends the end, with no lock.
    pub(crate) last: std::sync::OnceLock<Vec<u8>>,
}

impl StreamShared {
    /// A stream's state as it opens, with its connection's `window` both ways.
    fn new(window: u64) -> StreamShared {
        StreamShared {
            inbox: Inbox::default(),
            send_window: SendWindow::new(window),
            recv_window: RecvWindow::new(window),
            writer: std::sync::atomic::AtomicU8::default(),
            cancel: Cancel::default(),
            ended: super::server::EndedBy::default(),
            trailers: Mutex::default(),
            trailers_set: std::sync::atomic::AtomicBool::new(false),
            last: std::sync::OnceLock::new(),
        }
    }
}

/// Tells a server call that it is over before its handler finished, and with which code (the
/// client's CANCEL carries CANCELLED or DEADLINE_EXCEEDED; a dead connection is UNAVAILABLE).
#[derive(Debug, Default)]
pub(crate) struct Cancel {
    pub(crate) signal: Notify,
    code: Mutex<Option<Code>>,
}

impl Cancel {
    fn fire(&self, code: Code) {
        if let Ok(mut c) = self.code.lock() {
            c.get_or_insert(code);
        }
        self.signal.notify_one();
    }

    /// The code the call ended with, once fired.
    pub(crate) fn code(&self) -> Code {
        self.code.lock().ok().and_then(|c| *c).unwrap_or(Code::Cancelled)
    }

    /// Whether the call is over already.
    pub(crate) fn fired(&self) -> bool {
        self.code.lock().map_or(true, |c| c.is_some())
    }
}

/// Builds the hashers of one table of stream ids, with keys of its own: the peer chooses the
/// ids, and with a fixed function it could choose ids that all land in one bucket (ids with the
/// same low bits did, with the multiply-shift this replaced), making each insert scan them all
/// under the table's lock. The bindings' operations, named by their caller's tokens, are kept
/// so too (`binding::Completions`).
#[derive(Clone)]
pub(crate) struct IdKeys {
    key: u64,
}

impl Default for IdKeys {
    fn default() -> IdKeys {
        // std's RandomState is seeded from the OS once per thread, then varied per instance.
        IdKeys { key: std::collections::hash_map::RandomState::new().hash_one(0u8) }
    }
}

impl BuildHasher for IdKeys {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher { state: 0, key: self.key }
    }
}

/// Hashes a stream id with its table's key: the id keyed, then mixed by murmur3's finalizer,
/// so that every bit of the id reaches both the low bits that pick a bucket and the top 7 that
/// tag it. Far cheaper than SipHash on every frame's lookup. (One keyed multiply, tried first,
/// left ids that differ only in high bits in a third of the buckets they should fill.)
pub(crate) struct IdHasher {
    state: u64,
    key: u64,
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.state ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.state = fmix64(id ^ self.key);
    }
}

/// murmur3's 64-bit finalizer: every input bit reaches every output bit, the low ones that pick
/// a bucket and the top 7 that tag it (also [`PathHasher`](super::server::PathHasher)'s end).
pub(crate) fn fmix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x = (x ^ (x >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// One open stream: where its events go, its windows, and (server side) who to tell of a
/// cancel.
struct Entry {
    /// The reader's batch in which the stream opened: an event for a stream opened in the
    /// current batch wakes no task (its call has not been polled yet).
    born: u64,
    /// The peer has half-closed: no more messages will come on this stream.
    peer_done: AtomicBool,
    /// A client's stream has had its server's HEADERS, which come once (protocol 13.7, rule 2).
    headers_seen: AtomicBool,
    shared: Arc<StreamShared>,
    /// A server's stream, whose end fires its call's cancel signal.
    serving: bool,
}

impl Entry {
    /// The stream is over for this side: its call drains its events and sees the end, and a
    /// writer waiting for credit wakes for good.
    fn close(self) {
        self.shared.inbox.close();
        self.shared.send_window.close();
    }
}

/// Clears the answers' queue when dropped (see `Mux::reply`).
struct ClearOnDrop<'a>(&'a Mutex<Replies>);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        Replies::clear(self.0);
    }
}

/// A call's message on its way out ([`Mux::send_message`]): its stream, the flags of its (last)
/// frame, and the call's deadline.
pub(crate) struct Outgoing<'a> {
    pub(crate) id: u64,
    pub(crate) shared: &'a StreamShared,
    pub(crate) flags: u8,
    pub(crate) deadline: Option<std::time::Instant>,
}

/// A message in pieces under way on a stream ([`Mux::send_message`]): dropped armed (its send
/// abandoned or failed midway), it ends the stream's call here and at the peer.
struct CutShort<'a> {
    mux: &'a Mux,
    id: u64,
    deadline: Option<std::time::Instant>,
    armed: bool,
}

impl Drop for CutShort<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let code = match self.deadline {
            Some(d) if d <= std::time::Instant::now() => Code::DeadlineExceeded,
            _ => Code::Cancelled,
        };
        let why = "a message in pieces was cut short: its send stopped midway";
        self.mux.abandon(self.id, Status::new(code, why));
    }
}

/// A stream out of the table and not yet closed ([`Mux::unlist`]); dropping it closes it.
pub(crate) struct Unlisted(Option<Entry>);

impl Drop for Unlisted {
    fn drop(&mut self) {
        if let Some(e) = self.0.take() {
            e.close();
        }
    }
}

/// A frame the reader sends in answer to one it read (a PING's answer, a refusal, a cancel).
pub(crate) struct Reply {
    kind: Kind,
    flags: u8,
    stream: u64,
    body: Vec<u8>,
}

/// What the reader does after one frame.
enum Step {
    Continue(Option<Reply>),
    /// The connection is finished, with this status for every call on it.
    Stop(Status),
}

/// Lets the calls' own threads read the connection, one at a time, instead of a reader task
/// (the blocking client). Whoever needs something from the peer and finds no reader becomes it
/// (the leader); the others sleep until the leader delivers to them or steps down. With one call
/// in flight, its thread reads its own reply: no hand-off between threads.
struct Pump {
    receiver: Mutex<Receiver>,
    state: Mutex<PumpState>,
    changed: Condvar,
}

#[derive(Default)]
struct PumpState {
    leader: bool,
    /// Bumped whenever the leader delivered something or stepped down.
    generation: u64,
    /// Threads asleep on `changed`.
    waiting: usize,
}

impl Pump {
    /// Wakes the sleepers, if any: something changed.
    fn bump(&self, step_down: bool) {
        let Ok(mut st) = self.state.lock() else { return };
        if step_down {
            st.leader = false;
        }
        if st.waiting > 0 {
            st.generation = st.generation.wrapping_add(1);
            self.changed.notify_all();
        }
    }
}

/// Lets the async client's calls read the connection themselves while they wait, beside its
/// reader task (ADR 0008, 0029). A call that waits for its reply (on a channel handle that allows it:
/// `Channel::with_calls_read`) takes the receiver, if nobody reads, and reads until its own
/// event has come or the spin bound has passed: the reply then costs no task wake-up and no
/// hand-off between threads (the reader task would route it and wake the call's task, often on
/// the other worker). Whenever no call reads, the reader task
/// does, as it would without this; a call that finds the reader task holding the receiver
/// interrupts its wait and is woken when it is handed back.
struct Lead {
    slot: Mutex<Slot>,
    interrupter: isthmus_shm::Interrupter,
    /// Rung whenever the receiver is put back for the reader task.
    free: Notify,
    spin: isthmus_shm::SpinPolicy,
    /// The receiver lies in the slot, unread, left by a call that got its event on a connection
    /// with no other call open: that call is likely to read again within microseconds (the next
    /// message of a ping-pong stream, the next unary call), so the reader task was not rung and
    /// does not spin beside it. The reader task takes it back when something rings `free`
    /// ([`Mux::want_reader`]) or once it has lain unread for [`PARK_IDLE`].
    parked: AtomicBool,
    /// When a call last parked the receiver, in nanoseconds since `since`.
    parked_at: AtomicU64,
    /// Writers waiting for credit, whose grants come as frames: no call parks the receiver
    /// while there are any ([`Mux::reader_wanted`]).
    writers: std::sync::atomic::AtomicUsize,
    /// Calls that asked the reader task for the receiver and wait for it: the reader task
    /// leaves it in the slot for them, parked, only while there are any.
    askers: std::sync::atomic::AtomicUsize,
    since: std::time::Instant,
}

/// A writer waiting for credit ([`Mux::reader_wanted`]).
pub(crate) struct ReaderWanted<'a>(Option<&'a Lead>);

impl Drop for ReaderWanted<'_> {
    fn drop(&mut self) {
        if let Some(lead) = self.0 {
            lead.writers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The longest a receiver parked by a call ([`Lead::parked`]) lies unread before the reader task
/// takes it back: the bound on how late a frame nobody waits for (a PING, a GOAWAY, the peer's
/// end) is read while calls come and go (1-2 ms in practice: tokio's timer ticks by the
/// millisecond).
const PARK_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

/// The receiver while nobody reads (`None` while the reader task holds it), and the calls that
/// asked the reader task for it.
struct Slot {
    receiver: Option<Receiver>,
    wanting: Vec<std::task::Waker>,
}

impl Lead {
    /// How long the parked receiver has lain unread.
    fn parked_for(&self) -> std::time::Duration {
        let at = std::time::Duration::from_nanos(self.parked_at.load(Ordering::Acquire));
        self.since.elapsed().saturating_sub(at)
    }

    /// Marks the receiver parked as of now (it is about to be put back, or has just been).
    fn park(&self) {
        self.parked_at.store(self.since.elapsed().as_nanos() as u64, Ordering::Release);
        self.parked.store(true, Ordering::SeqCst);
    }

    /// A call that asked for the receiver gives up waiting for it: the reader task may have
    /// handed it over already, and takes it back.
    fn stop_asking(&self) {
        self.askers.fetch_sub(1, Ordering::SeqCst);
        self.unpark();
    }

    /// Rings the reader task if the receiver is parked: someone waits for a frame without
    /// reading.
    fn unpark(&self) {
        if self.parked.load(Ordering::SeqCst) && self.parked.swap(false, Ordering::SeqCst) {
            self.free.notify_one();
        }
    }

    /// Puts the receiver back and wakes the calls that asked for it.
    fn give_back(&self, mut slot: MutexGuard<'_, Slot>, receiver: Receiver) {
        slot.receiver = Some(receiver);
        let wanting = std::mem::take(&mut slot.wanting);
        drop(slot);
        for w in wanting {
            w.wake();
        }
    }

    /// Waits between two looks at the receiver or the ring: spins, then yields the CPU, as a
    /// wait on the doorbell does before it sleeps. `false` once `done()` holds or the spin bound
    /// has passed. Both are looked at every 64th pause only: a look at the ring costs less than
    /// reading the clock or locking the call's inbox.
    fn pause(&self, start: std::time::Instant, pauses: &mut u32, done: &mut impl FnMut() -> bool) -> bool {
        *pauses = pauses.wrapping_add(1);
        if *pauses % 64 != 0 {
            std::hint::spin_loop();
            return true;
        }
        let spent = start.elapsed();
        if done() || spent >= self.spin.max {
            return false;
        }
        if spent >= self.spin.yield_after {
            std::thread::yield_now();
        }
        true
    }
}

/// Lets the thread that runs a server's foreign handlers (Python's executor threads) read the
/// connection while it waits for its next call, instead of the reader task (ADR 0020). The
/// handler then runs on the thread that read its request: one server thread is runnable per
/// call instead of two, which on two cores is the difference between a reader and a handler
/// taking turns through `sched_yield` and no turns at all.
///
/// The reader task lends only when a borrower asks ([`Mux::serve_here`] interrupts its wait),
/// and only a quiet connection: while calls overlap, it reads on the other core during the
/// handlers, where a borrower could read only between them ([`BUSY_NO_LEND`]). It takes the
/// receiver back, with the new-call machinery and the calls first polled meanwhile, when the
/// borrower gives it back (nothing came for its spin, another connection's call called it away,
/// an answer found no ring room, calls overlap), when a call waits for a frame nobody reads
/// ([`Mux::need_reader`]), when the connection ended under the borrower, or when the receiver
/// has lain unread for [`LEND_IDLE`] (a handler that runs long).
struct Lend {
    slot: Mutex<Option<Lent>>,
    interrupter: isthmus_shm::Interrupter,
    /// Rung when the reader task should look at the slot.
    free: Notify,
    /// The receiver is lent (set and cleared by the reader task).
    out: AtomicBool,
    /// A borrower wants the receiver or reads it.
    wanted: AtomicBool,
    /// The reader task should take the receiver back as soon as nobody reads it.
    back: AtomicBool,
    /// When a borrower last put the receiver back, in nanoseconds since `since`.
    used: AtomicU64,
    /// No lend until then (nanoseconds since `since`): calls overlapped on the connection.
    busy_until: AtomicU64,
    since: std::time::Instant,
}

/// What a borrower needs to read the connection as its reader task would.
struct Lent {
    receiver: Receiver,
    accept: Accept,
    /// Calls whose handlers were handed off in a borrower's first poll and that wait for them to
    /// finish; the reader task adopts them when it takes the receiver back.
    calls: Vec<CallFuture>,
    /// Reading sessions since the lend.
    sessions: u64,
    /// The connection ended under a borrower.
    stop: Option<Status>,
    runtime: tokio::runtime::Handle,
}

/// How a borrower's reading ended.
#[derive(PartialEq, Eq)]
enum Read {
    /// A call was handed to its thread: the receiver stays lent while its handler runs.
    Handed,
    /// The reader task should read now.
    GiveBack,
    /// `stop()` held after a frame was routed: what the borrower waited for may have come.
    Stopped,
}

/// How long a connection whose calls overlapped is not lent: while a client keeps several calls
/// in flight, a reader task on the other core reads while the handlers run, where a borrower
/// would read only between its handlers.
const BUSY_NO_LEND: std::time::Duration = std::time::Duration::from_millis(100);

/// The longest the receiver stays lent and unread before the reader task takes it back.
const LEND_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

impl Lend {
    fn since_nanos(&self) -> u64 {
        self.since.elapsed().as_nanos() as u64
    }

    fn mark_used(&self) {
        self.used.store(self.since_nanos(), Ordering::Release);
    }

    fn unused_for(&self) -> std::time::Duration {
        let used = std::time::Duration::from_nanos(self.used.load(Ordering::Acquire));
        self.since.elapsed().saturating_sub(used)
    }

    /// The receiver back for the reader task, if it should have it now (see [`Lend`]).
    fn take_back(&self) -> Option<Lent> {
        let mut slot = match self.slot.try_lock() {
            Ok(slot) => slot,
            // A borrower panicked while reading: the connection cannot go on.
            Err(std::sync::TryLockError::Poisoned(p)) => {
                let mut slot = p.into_inner();
                if let Some(lent) = slot.as_mut() {
                    lent.stop.get_or_insert_with(poisoned);
                }
                slot
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        let lent = slot.as_ref()?;
        let unread = !self.wanted.load(Ordering::SeqCst) && (lent.sessions == 0 || self.unused_for() >= LEND_IDLE);
        if !(lent.stop.is_some() || self.back.swap(false, Ordering::AcqRel) || unread) {
            return None;
        }
        if unread && lent.sessions > 0 {
            // Its borrower has been away a while (a long handler, or other threads holding the
            // interpreter): not a connection to lend again soon.
            self.busy_until.store(self.since_nanos() + BUSY_NO_LEND.as_nanos() as u64, Ordering::Release);
        }
        self.out.store(false, Ordering::SeqCst);
        slot.take()
    }

    /// Gives the receiver back to the reader task now.
    fn call_back(&self) {
        self.back.store(true, Ordering::Release);
        self.free.notify_one();
    }
}

/// A server connection a foreign handler's thread may read while it waits for calls
/// ([`crate::binding::HandedCall::connection`]). Holds the connection weakly.
#[derive(Clone)]
pub struct Lender(std::sync::Weak<Mux>);

impl std::fmt::Debug for Lender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lender").finish_non_exhaustive()
    }
}

impl Lender {
    /// Reads the connection on this thread, as its reader task would, for up to `budget` or until
    /// `stop()` holds: new calls start here, and a call handed to a foreign handler ends the
    /// reading (its handler is this thread's to run, through the binding's queue, which makes
    /// `stop()` hold). Returns at once if another thread reads the connection, other calls are
    /// in progress on it, or it is over.
    pub fn serve_here(&self, budget: std::time::Duration, stop: impl FnMut() -> bool) {
        if let Some(mux) = self.0.upgrade() {
            mux.serve_here(budget, 0, stop);
        }
    }

    /// [`serve_here`](Self::serve_here) for a streaming handler that waits for its call's next
    /// request: reads until `ready()` holds (the request, or the call's end, is in) or `budget`
    /// has passed, and only while its call is the only one open on the connection. The receiver
    /// then stays lent, so the handler's next wait reads again with no hand-over (ADR 0029); a
    /// call that waits without reading has the reader task take it back
    /// (`Mux::need_reader`).
    pub fn read_for_call(&self, budget: std::time::Duration, ready: impl FnMut() -> bool) {
        if let Some(mux) = self.0.upgrade() {
            mux.serve_here(budget, 1, ready);
        }
    }

    /// Has the reader task take the receiver back as soon as nobody reads it, if it is lent:
    /// for a thread that borrowed it and will not read again soon, so that the connection does
    /// not lie unread until the lend's idle bound (1 ms) passes.
    pub fn give_back(&self) {
        if let Some(mux) = self.0.upgrade() {
            mux.need_reader();
        }
    }

    /// Whether both name the same connection.
    pub fn same(&self, other: &Lender) -> bool {
        std::sync::Weak::ptr_eq(&self.0, &other.0)
    }
}

/// How long the flusher's thread, where the connection has no runtime to wait on, waits for ring
/// room at a time (`Mux::reply`); then it waits again, with the frame first in line, for as long
/// as the connection lives.
const FLUSHER_THREAD_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a server's reader waits for ring room to send the GOAWAY that names a fault before
/// it closes the connection without one.
const FAULT_GOAWAY_PATIENCE: std::time::Duration = std::time::Duration::from_millis(100);

/// The stream table of one connection.
pub(crate) struct Mux {
    pub(crate) sender: Sender,
    /// Set when the calls' threads read the connection themselves (no reader task).
    pump: Option<Pump>,
    /// Set when calls may read the connection beside the reader task (the async client).
    lead: Option<Lead>,
    /// Set when a foreign handler's thread may read the connection (the server).
    lend: Option<Lend>,
    /// Server side: calls open at once on this connection, at most.
    stream_limit: usize,
    /// The reader task's current batch of frames, and whether routing it may have woken a task.
    batch: AtomicU64,
    woke: AtomicBool,
    /// The current batch held only WINDOW and PING frames (see `spin_for_next`).
    credit_only: AtomicBool,
    streams: Mutex<HashMap<u64, Entry, IdKeys>>,
    /// `streams.len()`, kept under its lock.
    open: std::sync::atomic::AtomicUsize,
    /// Set once the connection is finished: every later call fails with it.
    dead: Mutex<Option<Status>>,
    /// `dead` is set: every call's start looks, and this look takes no lock. Stored (SeqCst)
    /// after `dead` is, before the table is emptied (`register_entry` relies on that order).
    is_dead: AtomicBool,
    /// Server side: GOAWAY was sent; new calls are refused.
    draining: AtomicBool,
    /// Server side: wakes the calls that end once the server goes away (`GoingAway`).
    going_away: Notify,
    /// Server side: the highest stream id accepted.
    last_stream: AtomicU64,
    /// Calls started and finished on this connection, by final code.
    pub(crate) calls: CallTally,
    /// The runtime the connection was made on, if any: the frames `reply` queues go out from a
    /// task of it.
    runtime: Option<tokio::runtime::Handle>,
    /// The reader's answers that wait for ring room (`reply`).
    replies: Arc<Mutex<Replies>>,
}

/// The answers waiting for ring room, in the order they were made, and whether a flusher is
/// sending them.
#[derive(Default)]
struct Replies {
    queue: std::collections::VecDeque<Reply>,
    bytes: usize,
    flushing: bool,
    /// Answers dropped because the queue was full ([`ConnectionCounters::answers_dropped`]).
    dropped: u64,
}

/// At most this many of the reader's answers wait for ring room at once ...
const REPLIES_MAX: usize = 1024;
/// ... holding at most this many bytes of bodies (a PING's answer carries the PING's body).
const REPLY_BYTES_MAX: usize = 4 << 20;

impl Replies {
    /// The next answer to send, or none: then the flusher stops, under the same lock that a
    /// new answer looks at `flushing` under.
    fn next(replies: &Mutex<Replies>) -> Option<Reply> {
        let mut q = replies.lock().ok()?;
        let next = q.queue.pop_front();
        match &next {
            Some(r) => q.bytes -= r.body.len(),
            None => q.flushing = false,
        }
        next
    }

    /// An answer that found no room yet goes first again, its flusher still at work.
    fn put_back(replies: &Mutex<Replies>, r: Reply) {
        if let Ok(mut q) = replies.lock() {
            q.bytes += r.body.len();
            q.queue.push_front(r);
        }
    }

    /// The connection is over: what waits is dropped, and a later answer starts afresh (and
    /// fails at once).
    fn clear(replies: &Mutex<Replies>) {
        if let Ok(mut q) = replies.lock() {
            *q = Replies { dropped: q.dropped, ..Replies::default() };
        }
    }
}

/// Calls started, and calls finished by their final code.
#[derive(Debug, Default)]
pub(crate) struct CallTally {
    started: AtomicU64,
    finished: [AtomicU64; 17],
}

impl CallTally {
    pub(crate) fn start(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes back a [`start`](Self::start) whose call never went out.
    pub(crate) fn unstart(&self) {
        self.started.fetch_sub(1, Ordering::Relaxed);
    }

    pub(crate) fn finish(&self, code: Code) {
        self.finished[code as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of one connection's calls and transport counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionCounters {
    /// Calls started (client) or accepted (server).
    pub calls_started: u64,
    /// Calls finished, indexed by the final code's number (`Code::Ok as usize` = 0, …).
    pub calls_finished: [u64; 17],
    /// The transport's counters: frames and bytes each way, doorbell rings, sleeps, spins,
    /// ring-full and arena-full waits, arena high-water mark.
    pub transport: isthmus_shm::Counters,
    /// Answers of this side's reader (a PING's, a refusal, a CANCEL, a WINDOW grant) dropped
    /// because the peer read nothing of ours while 1,024 of them, or 4 MiB, waited for ring room
    /// (ADR 0027); each is also logged. A dropped grant stays owed.
    pub answers_dropped: u64,
}

impl ConnectionCounters {
    /// Calls finished with `code`.
    pub fn finished(&self, code: Code) -> u64 {
        self.calls_finished[code as usize]
    }

    /// Calls started and not finished yet.
    pub fn in_flight(&self) -> u64 {
        self.calls_started.saturating_sub(self.calls_finished.iter().sum())
    }

    /// The counters of several connections (a binding's channel, a server's) as one: sums, but
    /// the largest high-water mark ([`isthmus_shm::Counters::merged`]).
    pub fn total(counters: impl IntoIterator<Item = ConnectionCounters>) -> ConnectionCounters {
        counters.into_iter().fold(ConnectionCounters::default(), |mut t, c| {
            t.calls_started += c.calls_started;
            for (sum, n) in t.calls_finished.iter_mut().zip(c.calls_finished) {
                *sum += n;
            }
            t.transport = t.transport.merged(c.transport);
            t.answers_dropped += c.answers_dropped;
            t
        })
    }
}

fn poisoned() -> Status {
    Status::new(Code::Internal, "a thread panicked while holding the stream table")
}

impl Mux {
    /// The async client's connection: a reader task reads its frames
    /// ([`read_loop`](Self::read_loop)), and so do calls while they wait ([`read_here`](Self::read_here)).
    /// `receiver` is for the reader task, which holds it first.
    pub(crate) fn led(sender: Sender, receiver: &Receiver) -> Arc<Mux> {
        let lead = Lead {
            interrupter: receiver.interrupter(),
            spin: receiver.spin_policy(),
            slot: Mutex::new(Slot { receiver: None, wanting: Vec::new() }),
            free: Notify::new(),
            parked: AtomicBool::new(false),
            parked_at: AtomicU64::new(0),
            writers: Default::default(),
            askers: Default::default(),
            since: std::time::Instant::now(),
        };
        Mux::build(sender, None, Some(lead), None, usize::MAX, tokio::runtime::Handle::try_current().ok())
    }

    /// A server's connection: a reader task, which lends `receiver` to a foreign handler's
    /// thread that asks ([`Lend`]), and at most `stream_limit` calls open at once.
    pub(crate) fn serving(sender: Sender, receiver: &Receiver, stream_limit: usize) -> Arc<Mux> {
        let lend = Lend {
            slot: Mutex::new(None),
            interrupter: receiver.interrupter(),
            free: Notify::new(),
            out: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            back: AtomicBool::new(false),
            used: AtomicU64::new(0),
            busy_until: AtomicU64::new(0),
            since: std::time::Instant::now(),
        };
        Mux::build(sender, None, None, Some(lend), stream_limit, tokio::runtime::Handle::try_current().ok())
    }

    /// A connection whose frames the calls' threads read themselves ([`wait`](Self::wait)).
    pub(crate) fn driven(sender: Sender, receiver: Receiver) -> Arc<Mux> {
        let pump = Pump { receiver: Mutex::new(receiver), state: Mutex::default(), changed: Condvar::new() };
        // Its answers that wait for ring room go out from a thread of their own, never a
        // task of whatever runtime the connecting thread was inside: that runtime may have
        // ended since, or be blocked in this very call, and the task never ran (every later
        // answer queued behind it, grants a stream waits for among them).
        Mux::build(sender, Some(pump), None, None, usize::MAX, None)
    }

    fn build(
        sender: Sender,
        pump: Option<Pump>,
        lead: Option<Lead>,
        lend: Option<Lend>,
        stream_limit: usize,
        runtime: Option<tokio::runtime::Handle>,
    ) -> Arc<Mux> {
        Arc::new(Mux {
            sender,
            pump,
            lead,
            lend,
            stream_limit,
            batch: AtomicU64::new(0),
            woke: AtomicBool::new(false),
            credit_only: AtomicBool::new(false),
            streams: Mutex::new(HashMap::default()),
            open: std::sync::atomic::AtomicUsize::new(0),
            dead: Mutex::new(None),
            is_dead: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            going_away: Notify::new(),
            last_stream: AtomicU64::new(0),
            calls: CallTally::default(),
            runtime,
            replies: Arc::default(),
        })
    }

    /// This connection's counters.
    pub(crate) fn counters(&self) -> ConnectionCounters {
        let mut finished = [0u64; 17];
        for (f, c) in finished.iter_mut().zip(&self.calls.finished) {
            *f = c.load(Ordering::Relaxed);
        }
        ConnectionCounters {
            calls_started: self.calls.started.load(Ordering::Relaxed),
            calls_finished: finished,
            transport: self.sender.counters(),
            answers_dropped: self.replies.lock().map_or(0, |q| q.dropped),
        }
    }

    /// Whether the handshake agreed to one-frame calls (protocol 13.9).
    pub(crate) fn one_frame(&self) -> bool {
        self.sender.features() & isthmus_shm::features::UNARY_IN_ONE_FRAME != 0
    }

    /// Each stream's window as it opens, both ways (protocol 13.8): the small one where the
    /// handshake agreed to it.
    pub(crate) fn window(&self) -> u64 {
        if self.sender.features() & isthmus_shm::features::SMALL_WINDOW != 0 {
            crate::engine::flow::SMALL_INITIAL_WINDOW
        } else {
            crate::INITIAL_WINDOW
        }
    }

    /// The status every call gets once the connection is gone, if it is.
    pub(crate) fn dead(&self) -> Option<Status> {
        if !self.is_dead.load(Ordering::SeqCst) {
            return None;
        }
        self.dead.lock().ok().and_then(|d| d.clone())
    }

    /// Records the connection's end (the first status stays).
    fn set_dead(&self, status: Status) {
        if let Ok(mut d) = self.dead.lock() {
            d.get_or_insert(status);
        }
        self.is_dead.store(true, Ordering::SeqCst);
    }

    /// Whether new calls may start here: not once the connection is dead, going away, or its
    /// transport failed (which its reader learns a moment later; a call that tried meanwhile
    /// never reached the peer, so it may start again elsewhere).
    pub(crate) fn takes_calls(&self) -> bool {
        self.dead().is_none() && !self.sender.is_closed()
    }

    /// Opens stream `id`: its event queue and its windows.
    pub(crate) fn register(&self, id: u64) -> Result<Stream, Status> {
        self.register_entry(id, false, None, false)
    }

    /// Opens stream `id`; a server's stream whose request came inside its HEADERS (`last`)
    /// opens with that request queued as its last message, charged to its window, and one
    /// whose HEADERS half-closed it with no request (`closed`, a client-streaming call with no
    /// message) opens half-closed.
    fn register_entry(&self, id: u64, serving: bool, last: Option<Bytes>, closed: bool) -> Result<Stream, Status> {
        if let Some(s) = self.dead() {
            return Err(s);
        }
        let mut fresh = StreamShared::new(self.window());
        // Queued before the stream is shared, let alone in the table, where nothing else can see
        // it yet: no lock of its queue, one of the table per call. A fresh window takes any first
        // message.
        let peer_done = last.is_some() || closed;
        if let Some(m) = last {
            fresh.recv_window.charge_fresh(m.len());
            fresh.inbox.push_fresh(Event::Last(m));
        } else if closed {
            fresh.inbox.push_fresh(Event::HalfClose);
        }
        let shared = Arc::new(fresh);
        let mut streams = self.streams.lock().map_err(|_| poisoned())?;
        let std::collections::hash_map::Entry::Vacant(vacant) = streams.entry(id) else {
            return Err(Status::new(Code::Internal, format!("the peer reused open stream id {id}")));
        };
        vacant.insert(Entry {
            born: self.batch.load(Ordering::Relaxed),
            peer_done: AtomicBool::new(peer_done),
            headers_seen: AtomicBool::new(false),
            shared: shared.clone(),
            serving,
        });
        self.open.store(streams.len(), Ordering::SeqCst);
        drop(streams);
        // The reader may have died between the check and the insert; it empties the table
        // after setting `dead`, so look again.
        if let Some(s) = self.dead() {
            self.unregister(id);
            return Err(s);
        }
        Ok(Stream { id, shared, consumed: Consumed::default() })
    }

    /// The streams in the table (without its lock: a borrower looks at every wait, ADR 0020).
    fn open_streams(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    pub(crate) fn unregister(&self, id: u64) {
        drop(self.unlist(id));
    }

    /// Takes stream `id` out of the table (it no longer counts against the stream limit, and
    /// frames for it are dropped); the stream closes when the result is dropped, so that a
    /// server call's end can go out first and the waking be done after.
    pub(crate) fn unlist(&self, id: u64) -> Unlisted {
        Unlisted(self.streams.lock().ok().and_then(|mut s| {
            let entry = s.remove(&id);
            self.open.store(s.len(), Ordering::SeqCst);
            entry
        }))
    }

    fn deliver(&self, id: u64, ev: Event) {
        let end = match &ev {
            Event::End(status) | Event::Final(_, status) => Some(status.code()),
            _ => None,
        };
        // The call is woken, a server call's cancel fired and an ended stream closed once the
        // table is unlocked (`push`): each may wake a task.
        let (waker, ended) = {
            let Ok(mut s) = self.streams.lock() else { return };
            let waker = s.get(&id).and_then(|entry| self.push(entry, ev, end.is_some()));
            let ended = end.and_then(|_| s.remove(&id));
            if ended.is_some() {
                self.open.store(s.len(), Ordering::SeqCst);
            }
            (waker, ended)
        };
        if let Some(w) = waker {
            w.wake();
        }
        if let (Some(e), Some(code)) = (ended, end) {
            if e.serving {
                e.shared.cancel.fire(code);
            }
            // Its queue closed with its last event.
            e.shared.send_window.close();
        }
    }

    /// Queues an event for a stream's call, noting whether that may wake a task; the call's
    /// waker, to be woken once the stream table is unlocked: a wake-up may make a system call
    /// (an eventfd's write, a runtime worker's unpark), and every call of the connection, and
    /// its reader, take that lock.
    #[must_use = "the waker must be woken"]
    /// `last` closes the stream's queue with the event: one lock of it, not two.
    fn push(&self, entry: &Entry, ev: Event, last: bool) -> Option<std::task::Waker> {
        if entry.born != self.batch.load(Ordering::Relaxed) {
            self.woke.store(true, Ordering::Relaxed);
        }
        if matches!(ev, Event::HalfClose | Event::Last(_)) {
            entry.peer_done.store(true, Ordering::Relaxed);
        }
        entry.shared.inbox.push_unwoken(ev, last)
    }

    /// Ends stream `id` here with `status` (its call sees it as its end) and tells the peer with a
    /// CANCEL, without waiting for ring room.
    pub(crate) fn abandon(&self, id: u64, status: Status) {
        let code = status.code();
        self.deliver(id, Event::End(status));
        self.send_cancel(id, code, std::time::Instant::now());
    }

    /// Sends one message of a call on stream `id`, as the transport's `send_message_async`, and
    /// keeps the protocol's word for a message in pieces, which the peer holds until its last
    /// piece or the stream's CANCEL or TRAILERS (13.7, "Cancellation"):
    /// - pieces that went after this side ended the stream (another task's CANCEL, a server's
    ///   answer to its client's) would begin a message the peer held for the connection's life,
    ///   taking one of its few places for messages in pieces: a CANCEL follows them, which ends
    ///   it, and which the peer ignores for a stream it no longer knows;
    /// - a send dropped or failed midway left the peer holding its first pieces, and the call's
    ///   next message would break the connection: it ends the call, here and at the peer, with
    ///   DEADLINE_EXCEEDED once `deadline` has passed and CANCELLED before.
    pub(crate) async fn send_message(&self, out: Outgoing<'_>, message: &[u8]) -> Result<(), Error> {
        if !self.sender.in_pieces(message.len()) {
            return self.sender.send_message_async(out.id, out.flags, message).await;
        }
        let mut cut = CutShort { mux: self, id: out.id, deadline: out.deadline, armed: true };
        let sent = self.sender.send_message_async(out.id, out.flags, message).await;
        cut.armed = false;
        self.pieces_sent(&out, sent.is_ok());
        sent
    }

    /// [`send_message`](Self::send_message) on the caller's thread, waiting for room until
    /// the call's deadline.
    pub(crate) fn send_message_blocking(&self, out: Outgoing<'_>, message: &[u8]) -> Result<(), Error> {
        let pieces = self.sender.in_pieces(message.len());
        let sent = self.sender.send_message(out.id, out.flags, message, out.deadline);
        if pieces {
            self.pieces_sent(&out, sent.is_ok());
        }
        sent
    }

    /// What follows a message in pieces once its send is over (see `send_message`).
    fn pieces_sent(&self, out: &Outgoing<'_>, whole: bool) {
        if !whole {
            drop(CutShort { mux: self, id: out.id, deadline: out.deadline, armed: true });
        } else if out.shared.send_window.is_closed() {
            self.send_cancel(out.id, Code::Cancelled, std::time::Instant::now());
        }
    }

    /// Sends a CANCEL for `id`, waiting for ring room until `patience` at most; if the ring is
    /// still full then, the CANCEL goes once it has room, behind the reader's answers
    /// (`reply`), so that the peer's handler stops rather than run on until its deadline or the
    /// connection's end.
    pub(crate) fn send_cancel(&self, id: u64, code: Code, patience: std::time::Instant) {
        let body = wire::encode_cancel(code);
        let Err(e) = self.sender.send(Kind::Cancel, 0, id, &body, Some(patience)) else { return };
        // Any other error: the connection is over, and the peer's calls end with it.
        if e.kind() == isthmus_shm::ErrorKind::Timeout {
            self.reply(Reply::cancel(id, code));
        }
    }

    /// Sends one of the reader's answers (a PING's, a refusal, a cancel), a grant or a dropped
    /// call's CANCEL without waiting: at once
    /// if the ring has room and no earlier answer waits, else after those, from a flusher (a task
    /// of the connection's runtime, or a thread where there is none; either waits as long as the
    /// connection lives). Past `REPLIES_MAX` answers or `REPLY_BYTES_MAX` bytes waiting, the
    /// peer reads nothing of ours while it keeps asking: the answer is dropped, and `false` says
    /// so. Grants are kept past the limit, up to four per open stream more: a call waiting for
    /// one would wait for good once the peer read again, and an open stream's cannot pile up,
    /// since the peer sends its next window only once a grant reaches it (a few wait per stream
    /// at most, each for half a window taken).
    fn reply(&self, r: Reply) -> bool {
        let Ok(mut q) = self.replies.lock() else { return false };
        if !q.flushing {
            match self.sender.try_send(r.kind, r.flags, r.stream, &r.body) {
                Ok(false) => {}
                // Sent, or the connection is over and the peer's calls end with it.
                Ok(true) | Err(_) => return true,
            }
        }
        let full = q.queue.len() >= REPLIES_MAX || q.bytes + r.body.len() > REPLY_BYTES_MAX;
        // Grants go past the limit by a few per open stream (what the peer's windows allow), not
        // further: grants of streams that ended stay queued, and a peer that opens, fills and
        // ends streams while it reads nothing would grow the queue without end.
        let grant_fits = r.kind == Kind::Window && q.queue.len() < REPLIES_MAX.saturating_add(4 * self.open_streams());
        if full && !grant_fits {
            q.dropped += 1;
            tracing::warn!(
                kind = ?r.kind,
                stream = r.stream,
                "isthmus: the peer reads nothing of ours while {} answers to it wait; this one is dropped",
                q.queue.len()
            );
            return false;
        }
        q.bytes += r.body.len();
        q.queue.push_back(r);
        if std::mem::replace(&mut q.flushing, true) {
            return true;
        }
        drop(q);
        let (replies, sender) = (self.replies.clone(), self.sender.clone());
        match &self.runtime {
            Some(rt) => drop(rt.spawn(async move {
                // A task dropped before it finished (its runtime shutting down) leaves the
                // queue as the connection's end does, not `flushing` for good.
                let flushing = ClearOnDrop(&replies);
                while let Some(r) = Replies::next(&replies) {
                    if sender.send_async(r.kind, r.flags, r.stream, &r.body).await.is_err() {
                        return;
                    }
                }
                std::mem::forget(flushing);
            })),
            None => {
                // Waits as long as the connection lives, since what waits may be credit a
                // stream needs, and while its table does: a connection replaced (after a
                // GOAWAY) or dropped is not kept open by this thread's sender.
                let table = Arc::downgrade(&replies);
                let flush = move || {
                    while let Some(replies) = table.upgrade() {
                        let Some(r) = Replies::next(&replies) else { return };
                        let patience = std::time::Instant::now() + FLUSHER_THREAD_PATIENCE;
                        match sender.send(r.kind, r.flags, r.stream, &r.body, Some(patience)) {
                            Ok(()) => {}
                            Err(e) if e.kind() == ErrorKind::Timeout => Replies::put_back(&replies, r),
                            Err(_) => return Replies::clear(&replies),
                        }
                    }
                };
                if std::thread::Builder::new().name("isthmus-reply".into()).spawn(flush).is_err() {
                    Replies::clear(&replies);
                }
            }
        }
        true
    }

    /// Delivers a message, charging it to the stream's window; a peer that had no credit left
    /// broke flow control, which ends that call (only) with INTERNAL.
    fn deliver_message(&self, id: u64, message: Bytes, half_close: bool) -> Option<Reply> {
        let charged = {
            // One lookup for the message and its half-close: this is every message's path.
            let s = self.streams.lock().ok()?;
            let entry = s.get(&id)?; // a stream that has ended: the message crossed its end
            if entry.serving && entry.peer_done.load(Ordering::Relaxed) {
                drop(s);
                let status =
                    Status::new(Code::Internal, format!("the client sent on stream {id} after it half-closed"));
                return self.end_broken(id, status, Reply::cancel(id, Code::Internal));
            }
            entry.shared.recv_window.charge_arrival(message.len()).then(|| {
                self.push(entry, if half_close { Event::Last(message) } else { Event::Message(message) }, false)
            })
        };
        let Some(waker) = charged else {
            let status = Status::new(
                Code::Internal,
                format!("the peer sent on stream {id} past its flow-control window ({} bytes)", self.window()),
            );
            return self.end_broken(id, status, Reply::cancel(id, Code::Internal));
        };
        if let Some(w) = waker {
            w.wake();
        }
        None
    }

    /// A client's half-close without a message (its TRAILERS). Once per stream: a peer that
    /// sent it again and again would have queued an event each time, for a call that may never
    /// read them (a subscription's handler, already half-closed).
    fn half_close(&self, id: u64) {
        let waker = {
            let Ok(s) = self.streams.lock() else { return };
            let Some(entry) = s.get(&id) else { return };
            if entry.peer_done.load(Ordering::Relaxed) {
                return;
            }
            self.push(entry, Event::HalfClose, false)
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// A server's HEADERS on a client's stream. Once per call (protocol 13.7, rule 2): a
    /// second breaks the call, as a HEADERS after HEADERS breaks an HTTP/2 stream, rather than
    /// queue the metadata of every one a peer sends.
    fn deliver_headers(&self, id: u64, metadata: crate::metadata::MetadataMap) -> Option<Reply> {
        let waker = {
            let s = self.streams.lock().ok()?;
            let entry = s.get(&id)?;
            if entry.headers_seen.swap(true, Ordering::Relaxed) {
                drop(s);
                let status = Status::new(Code::Internal, format!("the server sent a second HEADERS on stream {id}"));
                return self.end_broken(id, status, Reply::cancel(id, Code::Internal));
            }
            self.push(entry, Event::Headers(metadata), false)
        };
        if let Some(w) = waker {
            w.wake();
        }
        None
    }

    /// Ends a call the peer broke (past its window, a message too large) with `status`, and
    /// returns `tell`, the frame that tells the peer; a server call's end is claimed for the
    /// reader first, so that its handler's task sends no second one, and `None` if the call
    /// had ended already.
    fn end_broken(&self, id: u64, status: Status, tell: Reply) -> Option<Reply> {
        let claimed = match self.streams.lock().ok()?.get(&id) {
            Some(entry) => !entry.serving || entry.shared.ended.claim(super::server::EndedBy::READER),
            None => true,
        };
        self.deliver(id, Event::End(status)); // which also forgets the stream
        claimed.then_some(tell)
    }

    /// Ends every call with `status` and refuses new ones.
    /// The connection is over: no frame goes out any more, and every call ends with `status`.
    pub(crate) fn end(&self, status: Status) {
        // The calls end first: a reader that wakes to the closed sender would end them with its
        // own "closed by this side" (UNAVAILABLE), not with `status` (a closed channel's CANCELLED).
        self.fail_all(status);
        self.sender.close();
    }

    /// In a child forked since the connection was made, nothing reads it here (its reader task
    /// ran on the parent's runtime), so every call on it ends now with the connection's error
    /// (UNAVAILABLE).
    pub(crate) fn end_if_forked(&self) {
        if self.sender.forked() {
            let why = self.sender.check_alive().err().map_or_else(
                || Status::new(Code::Unavailable, "the connection was made before a fork"),
                |e| Status::from_transport(&e),
            );
            self.fail_all(why);
        }
    }

    /// Every call on the connection ends with `status`, and the connection counts as dead.
    pub(crate) fn fail_all(&self, status: Status) {
        self.set_dead(status.clone());
        let streams = self
            .streams
            .lock()
            .map(|mut s| {
                self.open.store(0, Ordering::SeqCst);
                std::mem::take(&mut *s)
            })
            .unwrap_or_default();
        for (_, entry) in streams {
            entry.shared.inbox.push(Event::End(status.clone()));
            if entry.serving {
                entry.shared.cancel.fire(status.code());
            }
            entry.close();
        }
    }

    /// Server side: tells the client no new call will be taken here (GOAWAY); calls in progress
    /// go on.
    pub(crate) async fn go_away(&self, why: &str) {
        self.draining.store(true, Ordering::Release);
        self.going_away.notify_waiters();
        let g = wire::GoAway { last_stream: self.last_stream.load(Ordering::Acquire), message: why.to_owned() };
        let _ = self.sender.send_async(Kind::GoAway, 0, 0, &g.encode()).await;
    }

    /// Server side: whether GOAWAY was sent (or is on its way).
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Server side: resolves once GOAWAY was sent (at once if it was already).
    pub(crate) async fn gone_away(&self) {
        let notified = self.going_away.notified();
        tokio::pin!(notified);
        // Enabled before the look: a `go_away` between the two wakes it.
        notified.as_mut().enable();
        if !self.draining.load(Ordering::Acquire) {
            notified.await;
        }
    }

    /// Sends a CANCEL for `id` (best effort: the connection may be gone) and forgets it.
    pub(crate) async fn cancel(&self, id: u64, code: Code) {
        self.unregister(id);
        let _ = self.sender.send_async(Kind::Cancel, 0, id, &wire::encode_cancel(code)).await;
    }

    /// Reads frames until the connection ends, routing each to its call. On the server side
    /// (`accept`), HEADERS for an unknown stream opens a call.
    ///
    /// Frames are read in batches: one wait, then everything already in the ring. New calls
    /// start after their batch is routed, with one poll right here on the reader's task: a unary
    /// call's request is then usually in its queue already, so its handler runs to completion in
    /// that poll, with no task spawned and no thread woken. A call that has to wait becomes a
    /// task of its own, unless a foreign thread runs its handler: the reader keeps those.
    pub(crate) async fn read_loop(self: Arc<Self>, receiver: Receiver, mut accept: Option<Accept>) {
        // If this task is dropped unfinished (its runtime shut down), nobody reads replies any
        // more: the connection must count as dead, or calls on it would wait for ever.
        struct Watch(Arc<Mux>);
        impl Drop for Watch {
            fn drop(&mut self) {
                self.0.fail_all(Status::new(
                    Code::Unavailable,
                    "the connection's reader stopped (its tokio runtime shut down)",
                ));
                self.0.sender.close();
                // A lent receiver's calls end here too (they hold this connection: a cycle).
                if let Some(lend) = &self.0.lend {
                    let lent = lend.slot.lock().map_or_else(|p| p.into_inner().take(), |mut s| s.take());
                    drop(lent);
                }
            }
        }
        let _watch = Watch(self.clone());
        // Calls whose handler a foreign thread runs (Python, C, Go: `binding::hand_off`) wait
        // here rather than as tasks of their own: the thread that finishes one then wakes this
        // task, which is usually running, instead of a worker asleep (ADR 0019).
        let mut handed = HandedCalls::default();
        let serving = accept.is_some();
        let mut held = Some(receiver);
        let end = 'read: loop {
            let mut receiver = match held.take() {
                Some(r) => r,
                None => match self.take_back().await {
                    Some(r) => r,
                    None => break 'read poisoned(),
                },
            };
            let first = match (&self.lead, &self.lend) {
                (None, None) => {
                    let spin = self.spin_for_next(&receiver, !handed.calls.is_empty());
                    handed.serve_while(receiver.recv_async_spinning(spin)).await
                }
                (None, Some(lend)) => {
                    let spin = self.spin_for_next(&receiver, !handed.calls.is_empty());
                    match handed.serve_while(receiver.recv_async_interruptible(spin)).await.transpose() {
                        Some(got) => got,
                        // A foreign handler's thread asked to read (ADR 0020).
                        None => {
                            let Some(acc) = accept.take() else {
                                held = Some(receiver);
                                continue;
                            };
                            let lent = Lent {
                                receiver,
                                accept: acc,
                                calls: Vec::new(),
                                sessions: 0,
                                stop: None,
                                runtime: tokio::runtime::Handle::current(),
                            };
                            let lent = handed.serve_while(Self::lend_out(lend, lent)).await;
                            handed.calls.extend(lent.calls);
                            accept = Some(lent.accept);
                            if let Some(status) = lent.stop {
                                break 'read status;
                            }
                            held = Some(lent.receiver);
                            continue;
                        }
                    }
                }
                (Some(lead), _) => match receiver.recv_async_interruptible(lead.spin).await.transpose() {
                    Some(got) => got,
                    // A call asked for the receiver: it reads until its reply has come. Let it run
                    // (it may be queued on this worker) before taking the receiver back.
                    None => {
                        // Handed over as if parked: this task looks at the slot again only when
                        // rung or after `PARK_IDLE`, so it does not take the receiver back before
                        // the call that asked has it (a call that gives up rings).
                        match lead.slot.lock() {
                            Ok(slot) => {
                                lead.park();
                                lead.give_back(slot, receiver);
                            }
                            Err(_) => break 'read poisoned(),
                        }
                        // An interrupt left from an ask that ended meanwhile, or an asker that
                        // gave up before this: nobody comes for it (each side writes, then reads
                        // the other's word).
                        if lead.askers.load(Ordering::SeqCst) == 0 {
                            lead.unpark();
                        }
                        tokio::task::yield_now().await;
                        continue;
                    }
                },
            };
            self.batch.fetch_add(1, Ordering::Relaxed);
            self.woke.store(false, Ordering::Relaxed);
            self.credit_only.store(true, Ordering::Relaxed);
            // Whether the batch made calls tasks of their own because their handlers hold
            // their thread for long (`server::Pace`).
            let mut own_tasks = false;
            let mut stop = self.route_batch(&mut receiver, first, accept.as_mut()).await;
            if let Some(acc) = accept.as_mut() {
                // A client writes a call's HEADERS and its first message a fraction of a
                // microsecond apart, so a call may have started without its request: wait that
                // long for more frames before its first poll. A call that finds its request runs
                // to completion here, instead of becoming a task that the next batch wakes (often
                // on the other worker, at the cost of a wake-up); a handler a foreign thread runs
                // inline (Go's, C's) looks for its request once, and otherwise waits for it
                // through a queue: a Go echo of 4 KiB found it missing on one call in four.
                let mut spun = false;
                if !acc.bare.is_empty() && stop.is_none() {
                    spun = true;
                    if let Some(next) = Self::follow_up(&mut receiver).transpose() {
                        (spun, stop) = (false, self.route_batch(&mut receiver, next, Some(&mut *acc)).await);
                    }
                }
                acc.bare.clear();
                // Drained, not taken: the batch's vector keeps its room for the next batch.
                let mut waiting = Self::start_calls(&mut acc.batch, &mut handed, &mut own_tasks).await;
                // Calls still waiting get one more look as long (unless the ring stayed empty
                // through the first) and one more poll.
                if !waiting.is_empty() && stop.is_none() && !spun {
                    if let Some(next) = Self::follow_up(&mut receiver).transpose() {
                        stop = self.route_batch(&mut receiver, next, Some(&mut *acc)).await;
                        waiting.append(&mut acc.batch);
                        acc.bare.clear();
                        waiting = Self::start_calls(&mut waiting, &mut handed, &mut own_tasks).await;
                    }
                }
                for call in waiting {
                    tokio::spawn(call);
                    self.woke.store(true, Ordering::Relaxed);
                }
            }
            if let Some(status) = stop {
                break 'read status;
            }
            handed.poll_ready().await;
            // The batch woke tasks (handlers and calls waiting for their messages), queued on
            // this worker: let them run now, before the wait for the next frame spins on this
            // thread. A batch that only opened and finished calls inline skips the trip through
            // the scheduler. The calls that run meanwhile may read the connection themselves.
            if self.woke.load(Ordering::Relaxed) || own_tasks {
                match &self.lead {
                    None => held = Some(receiver),
                    Some(lead) => match lead.slot.lock() {
                        Ok(slot) => lead.give_back(slot, receiver),
                        Err(_) => break 'read poisoned(),
                    },
                }
                if own_tasks {
                    // Through the run queue: this worker is about to run a handler that holds
                    // it, and another must take this task (and the I/O driver) meanwhile.
                    requeue().await;
                } else {
                    tokio::task::yield_now().await;
                }
            } else {
                held = Some(receiver);
            }
        };
        if serving && end.code() == Code::Internal {
            // A fault (malformed input from the client, a transport protocol error, a failure of
            // ours): tell the client why before hanging up, so that its calls fail naming the
            // fault rather than a vanished peer. Best effort: a client that reads nothing of ours
            // gets no GOAWAY.
            let why = format!("a fault ends this connection: {}", end.message());
            let _ = tokio::time::timeout(FAULT_GOAWAY_PATIENCE, self.go_away(&why)).await;
        }
        self.end(end);
        // Cancelled by the connection's end: they finish as tasks of their own.
        handed.spawn_all();
    }

    /// Routes `first` and the frames already in the ring after it, at most 256 in all, so calls
    /// start even while a client keeps the ring full. `Some` if the connection is finished.
    async fn route_batch(
        &self,
        receiver: &mut Receiver,
        first: Result<Frame, Error>,
        mut accept: Option<&mut Accept>,
    ) -> Option<Status> {
        let mut got = Some(first);
        let mut budget = 256;
        while let Some(frame) = got.take() {
            match self.step(frame, accept.as_deref_mut()) {
                Step::Continue(None) => {}
                Step::Continue(Some(r)) => {
                    self.reply(r);
                }
                Step::Stop(status) => return Some(status),
            }
            budget -= 1;
            if budget > 0 {
                got = receiver.try_recv().transpose();
            }
        }
        None
    }

    /// How the server's reader waits for the next frame: with the connection's spin, unless the
    /// last batch was only WINDOW and PING frames and no open call expects anything from the
    /// peer (every one has its requests and credit to send). What comes then answers this side's
    /// own sends, at their pace, so a spin would only burn the worker: a topic's publisher would
    /// otherwise spin on each subscriber's connection after each grant of credit (ADR 0016).
    /// While foreign threads run handlers of this connection (`handed`), every look yields the
    /// core: where such a thread shares it, it gets it back at once (ADR 0019).
    fn spin_for_next(&self, receiver: &Receiver, handed: bool) -> isthmus_shm::SpinPolicy {
        let mut full = receiver.spin_policy();
        if handed {
            full.yield_after = std::time::Duration::ZERO;
        }
        if !self.credit_only.load(Ordering::Relaxed) {
            return full;
        }
        let Ok(streams) = self.streams.lock() else { return full };
        let awaited = streams.is_empty()
            || streams.values().any(|e| !e.peer_done.load(Ordering::Relaxed) || e.shared.send_window.starved());
        if awaited {
            full
        } else {
            isthmus_shm::SpinPolicy { max: std::time::Duration::ZERO, ..full }
        }
    }

    /// Lends the receiver to a foreign handler's thread (ADR 0020), and takes it back when
    /// that thread gives it back for good, a call needs a reader, the connection ended under the
    /// borrower, or it lay unread for [`LEND_IDLE`] (see [`Lend`]).
    async fn lend_out(lend: &Lend, lent: Lent) -> Lent {
        lend.back.store(false, Ordering::Release);
        lend.mark_used();
        *lend.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(lent);
        lend.out.store(true, Ordering::SeqCst);
        loop {
            if let Some(lent) = lend.take_back() {
                return lent;
            }
            // Next look: when the receiver will have lain unread for `LEND_IDLE`.
            let wait = LEND_IDLE.saturating_sub(lend.unused_for()).max(std::time::Duration::from_micros(100));
            tokio::select! {
                _ = lend.free.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// A handle on this connection for a foreign handler's thread to read it while it waits
    /// for calls; `None` where the server reads its connections only on its own task.
    pub(crate) fn lender(self: &Arc<Self>) -> Option<Lender> {
        self.lend.as_ref().map(|_| Lender(Arc::downgrade(self)))
    }

    /// A call waits for a frame from the peer: if the receiver is lent (ADR 0020), the reader
    /// task takes it back as soon as nobody reads it.
    pub(crate) fn need_reader(&self) {
        if let Some(lend) = &self.lend {
            if lend.out.load(Ordering::Acquire) && !lend.back.load(Ordering::Acquire) {
                lend.call_back();
            }
        }
    }

    /// Reads the connection on a foreign handler's thread (see [`Lender::serve_here`]); `mine`
    /// is how many of the open calls are the borrower's own (its stream, for
    /// [`Lender::read_for_call`]).
    fn serve_here(&self, budget: std::time::Duration, mine: usize, mut stop: impl FnMut() -> bool) {
        let Some(lend) = &self.lend else { return };
        // Lend only a quiet connection: while other calls are in progress here, the reader task
        // keeps reading for them, and a lend would be given back at once (see the end).
        if !lend.out.load(Ordering::Acquire)
            && (lend.since_nanos() < lend.busy_until.load(Ordering::Acquire) || self.open_streams() > mine)
        {
            return;
        }
        if self.dead().is_some() {
            return;
        }
        let start = std::time::Instant::now();
        lend.wanted.store(true, Ordering::SeqCst);
        // The receiver: in the slot if lent already; else the reader task lends it when asked.
        let mut asked = false;
        let mut looks = 0u32;
        let mut slot = loop {
            match lend.slot.try_lock() {
                Ok(slot) if slot.is_some() => break slot,
                Ok(_) if !asked => {
                    asked = true;
                    lend.interrupter.interrupt();
                }
                Ok(_) | Err(std::sync::TryLockError::WouldBlock) => {}
                Err(std::sync::TryLockError::Poisoned(_)) => {
                    lend.wanted.store(false, Ordering::SeqCst);
                    return;
                }
            }
            looks = looks.wrapping_add(1);
            if looks % 16 == 0 && (stop() || start.elapsed() >= budget) {
                // A lend that comes after this goes straight back: nobody wants it.
                lend.wanted.store(false, Ordering::SeqCst);
                lend.free.notify_one();
                return;
            }
            // The reader task needs a core to hand the receiver over; this thread may share it.
            std::thread::yield_now();
        };
        let Some(lent) = slot.as_mut() else { return };
        if lent.stop.is_some() {
            // Over: the reader task's now.
            lend.wanted.store(false, Ordering::SeqCst);
            drop(slot);
            lend.call_back();
            return;
        }
        lent.sessions += 1;
        let _runtime = lent.runtime.enter();
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        // Calls handed over in earlier sessions whose handlers have finished: their ends.
        lent.calls.retain_mut(|call| call.as_mut().poll(&mut cx).is_pending());
        // Calls still in progress here run on other threads: the reader task reads for them
        // better (see below), and this thread waits for its next call as before.
        let overlapping = self.open_streams() > mine;
        // A streaming handler whose request came keeps the receiver: its next wait reads again.
        let give_back = overlapping
            || match self.read_lent(lent, &mut cx, start, budget, &mut stop, mine == 0) {
                Read::Handed => false,
                Read::GiveBack => true,
                Read::Stopped => mine == 0,
            };
        // Other calls in progress here (more than the one this thread is about to run) may get
        // frames, and the client may start more, while this thread runs its handler: the reader
        // task reads for them meanwhile (a wake-up, shared by all those calls). With only this
        // thread's call open, the receiver stays lent.
        let busy = overlapping || self.open_streams() > 1;
        if busy {
            // Calls overlap here: the reader task is the better reader for a while (ADR 0020).
            lend.busy_until.store(lend.since_nanos() + BUSY_NO_LEND.as_nanos() as u64, Ordering::Release);
        }
        lend.mark_used();
        lend.wanted.store(false, Ordering::SeqCst);
        drop(slot);
        // `back` looked at after the slot is free: a `need_reader` just before finds it set, one
        // just after finds the slot free.
        if give_back || busy || lend.back.load(Ordering::Acquire) {
            lend.call_back();
        }
    }

    /// A borrower's reading, until a call is handed to its thread (`Handed`: the receiver stays
    /// lent while it runs), or the connection ends, an answer waits for ring room, `stop()`
    /// holds or `budget` has passed since `start` (`GiveBack`).
    fn read_lent(
        &self,
        lent: &mut Lent,
        cx: &mut std::task::Context<'_>,
        start: std::time::Instant,
        budget: std::time::Duration,
        stop: &mut impl FnMut() -> bool,
        inline: bool,
    ) -> Read {
        let spin = lent.receiver.spin_policy();
        let mut looks = 0u32;
        loop {
            let got = match lent.receiver.try_recv().transpose() {
                Some(got) => got,
                None => {
                    looks = looks.wrapping_add(1);
                    if looks % 32 != 0 {
                        std::hint::spin_loop();
                        continue;
                    }
                    // Called away (a call of another connection), or nothing came: either way
                    // the reader task reads from now on.
                    if stop() || start.elapsed() >= budget {
                        return Read::GiveBack;
                    }
                    let spent = start.elapsed();
                    if spent >= spin.yield_after {
                        std::thread::yield_now();
                    }
                    continue;
                }
            };
            self.batch.fetch_add(1, Ordering::Relaxed);
            if let Some(status) = self.route_here(&mut lent.receiver, got, &mut lent.accept) {
                lent.stop.get_or_insert(status);
            }
            // As the reader task does: a call whose HEADERS came alone gets a moment for its
            // request before its first poll.
            if !lent.accept.bare.is_empty() && lent.stop.is_none() {
                if let Some(next) = Self::follow_up(&mut lent.receiver).transpose() {
                    if let Some(status) = self.route_here(&mut lent.receiver, next, &mut lent.accept) {
                        lent.stop.get_or_insert(status);
                    }
                }
            }
            lent.accept.bare.clear();
            let mut handed = false;
            if !inline && !lent.accept.batch.is_empty() {
                // A streaming handler's thread runs no other call's handler (a C callback would
                // run here, inside its receive): new calls go to the runtime, and the reader
                // task, which reads for them, takes the receiver back.
                for call in lent.accept.batch.drain(..) {
                    drop(lent.runtime.spawn(call));
                }
                return Read::GiveBack;
            }
            for mut call in lent.accept.batch.drain(..) {
                // A call that asks for a task of its own is spawned below like any that waits.
                let polled = first_poll(&mut call, cx);
                if polled.done {
                    continue;
                }
                if polled.handed_off {
                    handed = true;
                    lent.calls.push(call);
                } else {
                    drop(lent.runtime.spawn(call));
                }
            }
            if lent.stop.is_some() {
                return Read::GiveBack;
            }
            if handed {
                return Read::Handed;
            }
            if stop() {
                return Read::Stopped;
            }
            if start.elapsed() >= budget {
                return Read::GiveBack;
            }
        }
    }

    /// [`route_batch`](Self::route_batch) on a borrower's thread.
    fn route_here(&self, receiver: &mut Receiver, first: Result<Frame, Error>, accept: &mut Accept) -> Option<Status> {
        let mut got = Some(first);
        let mut budget = 256;
        while let Some(frame) = got.take() {
            match self.step(frame, Some(&mut *accept)) {
                Step::Continue(None) => {}
                Step::Continue(Some(r)) => {
                    self.reply(r);
                }
                Step::Stop(status) => return Some(status),
            }
            budget -= 1;
            if budget > 0 {
                got = receiver.try_recv().transpose();
            }
        }
        None
    }

    /// Polls each new call once, here on the reader's task; the calls that must wait, but for
    /// those handed to a foreign handler, which join `handed`.
    async fn start_calls(calls: &mut Vec<CallFuture>, handed: &mut HandedCalls, own: &mut bool) -> Vec<CallFuture> {
        let mut waiting = Vec::new();
        for mut call in calls.drain(..) {
            let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(first_poll(&mut call, cx))).await;
            if polled.done {
                continue;
            }
            match (polled.handed_off, polled.own_task) {
                (true, _) => handed.calls.push(call),
                (false, true) => {
                    *own = true;
                    drop(tokio::spawn(call));
                }
                (false, false) => waiting.push(call),
            }
        }
        waiting
    }

    /// The next frame if one arrives within a couple of microseconds (spinning).
    fn follow_up(receiver: &mut Receiver) -> Result<Option<Frame>, Error> {
        const WITHIN: std::time::Duration = std::time::Duration::from_micros(2);
        let start = std::time::Instant::now();
        loop {
            for _ in 0..16 {
                if let Some(f) = receiver.try_recv()? {
                    return Ok(Some(f));
                }
                std::hint::spin_loop();
            }
            if start.elapsed() >= WITHIN {
                return Ok(None);
            }
        }
    }

    /// The reader task takes the receiver back once no call reads; `None` if a call panicked
    /// while reading.
    async fn take_back(&self) -> Option<Receiver> {
        let lead = self.lead.as_ref()?;
        loop {
            let notified = lead.free.notified();
            // A call that reads now may park the receiver without ringing: look again by then.
            let mut wait = PARK_IDLE;
            match lead.slot.try_lock() {
                Ok(mut slot) => {
                    if slot.receiver.is_some() {
                        let unread = lead.parked_for();
                        if !lead.parked.load(Ordering::SeqCst) || unread >= PARK_IDLE {
                            lead.parked.store(false, Ordering::SeqCst);
                            return slot.receiver.take();
                        }
                        wait = PARK_IDLE - unread;
                    }
                }
                Err(std::sync::TryLockError::Poisoned(_)) => return None,
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    /// For a call (or a send waiting for credit) that waits for a frame without reading the
    /// connection itself: if a call parked the receiver, the reader task takes it back now.
    pub(crate) fn want_reader(&self) {
        if let Some(lead) = &self.lead {
            lead.unpark();
        }
    }

    /// [`want_reader`](Self::want_reader) for a writer about to wait for credit, and no call parks
    /// the receiver until the returned guard drops.
    pub(crate) fn reader_wanted(&self) -> ReaderWanted<'_> {
        if let Some(lead) = &self.lead {
            lead.writers.fetch_add(1, Ordering::SeqCst);
            lead.unpark();
        }
        ReaderWanted(self.lead.as_ref())
    }

    /// Whether a call that got its event may park the receiver: nothing else on the connection
    /// waits for a frame (no stream is open but its own, `own` of them, and no writer waits for
    /// credit).
    fn may_park(&self, lead: &Lead, own: usize) -> bool {
        self.open.load(Ordering::SeqCst) <= own && lead.writers.load(Ordering::SeqCst) == 0
    }

    /// Client side: reads the connection on this thread while a call waits, until `ready()`
    /// holds or the connection's spin bound has passed (see [`Lead`]). Does nothing if another
    /// call reads (it delivers to this one too); if the reader task reads, asks it for the
    /// receiver, and `cx` is woken once it is handed back.
    pub(crate) fn read_here(&self, id: u64, cx: &std::task::Context<'_>, mut ready: impl FnMut() -> bool) {
        let Some(lead) = &self.lead else { return };
        let start = std::time::Instant::now();
        let mut pauses = 0;
        let mut asked = false;
        // The slot's lock is held while this call reads, so the other calls see at once that
        // someone does (and leave the reading to it).
        let (slot, mut receiver) = loop {
            let mut slot = match lead.slot.try_lock() {
                Ok(slot) => slot,
                // Another call reads, and delivers to this one too; but once this call has asked
                // the reader task, the lock is most likely its hand-back, with the receiver
                // next: a call that left here lost it to the reader task taking it again.
                Err(std::sync::TryLockError::WouldBlock) if asked => {
                    if !lead.pause(start, &mut pauses, &mut ready) {
                        lead.stop_asking();
                        return;
                    }
                    continue;
                }
                Err(_) => {
                    if asked {
                        lead.stop_asking();
                    }
                    return;
                }
            };
            if let Some(r) = slot.receiver.take() {
                lead.parked.store(false, Ordering::SeqCst);
                if asked {
                    lead.askers.fetch_sub(1, Ordering::SeqCst);
                }
                break (slot, r);
            }
            // The reader task holds it: ask for it, once. A spinning reader hands it back within
            // a fraction of a microsecond, so wait for it here rather than sleep; the reader
            // wakes this call if the wait runs out first.
            let ask = !asked;
            if ask && !slot.wanting.iter().any(|w| w.will_wake(cx.waker())) {
                slot.wanting.push(cx.waker().clone());
            }
            drop(slot);
            if ask {
                lead.askers.fetch_add(1, Ordering::SeqCst);
                lead.interrupter.interrupt();
                asked = true;
            }
            if !lead.pause(start, &mut pauses, &mut ready) {
                if asked {
                    lead.stop_asking();
                }
                return;
            }
        };
        let (start, mut pauses) = (std::time::Instant::now(), 0);
        let mut done = false;
        loop {
            let Some(got) = receiver.try_recv().transpose() else {
                // Nothing new: only this thread routes frames now, so `ready` can change only by
                // the connection's end, which `pause` looks for.
                if !lead.pause(start, &mut pauses, &mut ready) {
                    break;
                }
                continue;
            };
            match self.step(got, None) {
                Step::Continue(None) => {}
                Step::Continue(Some(r)) => {
                    self.reply(r);
                }
                Step::Stop(status) => {
                    self.end(status);
                    break;
                }
            }
            if ready() {
                done = true;
                break;
            }
        }
        // With no other call open, this call (or the next) will read again soon: the receiver
        // is parked, and the reader task left asleep. A call that opens meanwhile and waits
        // without reading rings it (`want_reader`); one that opened as this call parked is seen
        // by the second look at `open` (each side writes, then reads the other's word).
        // Its own stream counts only while it is open (its end takes it out of the table); the
        // table is looked at only when that decides: one stream open.
        let own = match done && self.open.load(Ordering::SeqCst) == 1 {
            true => self.streams.lock().map_or(1, |s| s.contains_key(&id) as usize),
            false => 0,
        };
        let park = done && self.may_park(lead, own);
        if park {
            lead.park();
        }
        // The reader task takes over; it looks at the slot only once the lock is free.
        lead.give_back(slot, receiver);
        if !park {
            lead.free.notify_one();
        } else if !self.may_park(lead, own) {
            lead.unpark();
        }
    }

    /// Blocks until `ready()` holds, reading the connection on this thread while no other
    /// thread does (the blocking client; see [`Pump`]). `false` if `deadline` passed first.
    /// Every wait ends when the connection does: its death ends every stream, which is what the
    /// callers' `ready` look for.
    pub(crate) fn wait(&self, deadline: Option<std::time::Instant>, mut ready: impl FnMut() -> bool) -> bool {
        let Some(pump) = &self.pump else { return ready() };
        loop {
            if ready() {
                return true;
            }
            let Ok(mut st) = pump.state.lock() else { return ready() };
            if ready() {
                return true;
            }
            if st.leader {
                let seen = st.generation;
                st.waiting += 1;
                while st.leader && st.generation == seen {
                    let timeout = match deadline {
                        None => None,
                        Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                            Some(left) if !left.is_zero() => Some(left),
                            _ => break,
                        },
                    };
                    st = match timeout {
                        None => pump.changed.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner),
                        Some(t) => {
                            pump.changed.wait_timeout(st, t).unwrap_or_else(std::sync::PoisonError::into_inner).0
                        }
                    };
                }
                st.waiting -= 1;
                drop(st);
                if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                    return ready();
                }
                continue;
            }
            st.leader = true;
            drop(st);
            let expired = self.lead(pump, deadline, &mut ready);
            pump.bump(true);
            if expired {
                return ready();
            }
        }
    }

    /// Reads frames as the leader until `ready()` holds; `true` if the deadline passed first.
    fn lead(&self, pump: &Pump, deadline: Option<std::time::Instant>, ready: &mut impl FnMut() -> bool) -> bool {
        let Ok(mut receiver) = pump.receiver.try_lock() else {
            // Only a leader touches the receiver; a poisoned lock means one panicked mid-read.
            self.end(poisoned());
            return false;
        };
        loop {
            let got = receiver.recv(deadline);
            if matches!(&got, Err(e) if e.kind() == ErrorKind::Timeout) {
                return true;
            }
            match self.step(got, None) {
                Step::Continue(None) => {}
                Step::Continue(Some(r)) => {
                    self.reply(r);
                }
                Step::Stop(status) => {
                    self.end(status);
                    return false;
                }
            }
            // Done: the caller steps down, which wakes the sleepers as this would (one lock).
            if ready() {
                return false;
            }
            pump.bump(false);
        }
    }

    /// Routes one frame (or the transport's error) from the peer.
    fn step(&self, got: Result<Frame, Error>, accept: Option<&mut Accept>) -> Step {
        let serving = accept.is_some();
        match got {
            Ok(frame) => match self.route(frame, accept) {
                Ok(reply) => Step::Continue(reply),
                Err(status) => Step::Stop(status),
            },
            // One message too large: that call fails, the connection goes on. The server ends
            // it with a status that names the size and the limit; a client cancels its side.
            Err(e) if e.kind() == ErrorKind::MessageTooLarge => {
                let Some(id) = e.stream() else { return Step::Continue(None) };
                let status = Status::from_transport(&e);
                let reply =
                    if serving { Reply::trailers(id, &status) } else { Reply::cancel(id, Code::ResourceExhausted) };
                Step::Continue(self.end_broken(id, status, reply))
            }
            Err(e) => Step::Stop(Status::from_transport(&e)),
        }
    }

    fn route(&self, f: Frame, mut accept: Option<&mut Accept>) -> Result<Option<Reply>, Status> {
        let serving = accept.is_some();
        if let Some(acc) = accept.as_deref_mut() {
            if !acc.bare.is_empty() && matches!(f.kind, Kind::Message | Kind::Trailers | Kind::Cancel) {
                acc.bare.retain(|&id| id != f.stream);
            }
        }
        if !matches!(f.kind, Kind::Window | Kind::Ping) {
            self.credit_only.store(false, Ordering::Relaxed);
        }
        let internal = |e: wire::WireError| Status::new(Code::Internal, format!("malformed frame from the peer: {e}"));
        let with_message = f.flags & wire::WITH_MESSAGE != 0;
        if with_message && !(self.one_frame() && matches!(f.kind, Kind::Headers | Kind::Trailers)) {
            let what = format!("{:?} with a message inside, which this connection did not agree to", f.kind);
            return Err(internal(wire::bad(what)));
        }
        match f.kind {
            Kind::Headers => match accept {
                Some(_) if self.draining.load(Ordering::Acquire) => {
                    // A call that crossed our GOAWAY: refuse it so the client retries elsewhere.
                    let refused = Status::new(Code::Unavailable, "the server is shutting down and takes no new calls");
                    return Ok(Some(Reply::trailers(f.stream, &refused)));
                }
                Some(_) if self.open_streams() >= self.stream_limit => {
                    let refused = Status::new(
                        Code::ResourceExhausted,
                        format!(
                            "the server's limit of {} concurrent calls per connection is reached",
                            self.stream_limit
                        ),
                    );
                    return Ok(Some(Reply::trailers(f.stream, &refused)));
                }
                Some(accept) => {
                    let end = f.flags & flags::END_STREAM != 0;
                    let (head, request) = if with_message {
                        let (head, at) = wire::RequestHead::decode_prefix(&f.body).map_err(internal)?;
                        if !end {
                            return Err(internal(wire::bad("HEADERS with a request but no END_STREAM")));
                        }
                        // Too large for this side: the call fails as it would have on a MESSAGE
                        // frame, before its handler starts, and the connection goes on.
                        if let Err(e) = self.sender.received_inside(f.stream, f.body.len() - at) {
                            self.last_stream.fetch_max(f.stream, Ordering::AcqRel);
                            return Ok(Some(Reply::trailers(f.stream, &Status::from_transport(&e))));
                        }
                        (head, Some(tail(f.body, at)))
                    } else {
                        (wire::RequestHead::decode(&f.body).map_err(internal)?, None)
                    };
                    self.last_stream.fetch_max(f.stream, Ordering::AcqRel);
                    let one_frame = request.is_some();
                    let stream = self.register_entry(f.stream, true, request, end)?;
                    let call = (accept.make)(Incoming { head, stream });
                    accept.batch.push(call);
                    if !end && !one_frame {
                        accept.bare.push(f.stream);
                    }
                }
                None if with_message => {
                    return Err(internal(wire::bad("a server's HEADERS with a message inside")));
                }
                None => {
                    let metadata = wire::ResponseHead::decode(&f.body).map_err(internal)?.metadata;
                    return Ok(self.deliver_headers(f.stream, metadata));
                }
            },
            Kind::Message => return Ok(self.deliver_message(f.stream, f.body, f.flags & flags::END_STREAM != 0)),
            // From the client, TRAILERS (empty) is a half-close without a message.
            Kind::Trailers if serving && with_message => {
                return Err(internal(wire::bad("a client's TRAILERS with a message inside")));
            }
            Kind::Trailers if serving => self.half_close(f.stream),
            // A one-frame call's end: its last response, then its status.
            Kind::Trailers if with_message => {
                let (status, at) = wire::decode_trailers_prefix(&f.body).map_err(internal)?;
                // No flow control to keep: the call ends with this message.
                let end = match self.sender.received_inside(f.stream, f.body.len() - at) {
                    Ok(()) => Event::Final(tail(f.body, at), status),
                    // Too large for this side: the call fails RESOURCE_EXHAUSTED, as it would
                    // have on a MESSAGE frame; the server has ended it, so no CANCEL.
                    Err(e) => Event::End(Status::from_transport(&e)),
                };
                self.deliver(f.stream, end);
            }
            Kind::Trailers => self.deliver(f.stream, Event::End(wire::decode_trailers(&f.body).map_err(internal)?)),
            Kind::Cancel => {
                // A CANCEL that says OK would end a call cut short as a success (a stream's
                // missing messages unnoticed): a cancelled call is CANCELLED whatever it says.
                let code = match wire::decode_cancel(&f.body).map_err(internal)? {
                    Code::Ok => Code::Cancelled,
                    code => code,
                };
                self.deliver(f.stream, Event::End(Status::new(code, "the call was cancelled by the peer")));
            }
            Kind::Window => {
                let n = wire::decode_window(&f.body).map_err(internal)?;
                // Granted with the table unlocked: it wakes the stream's writer.
                let shared = self.streams.lock().ok().and_then(|s| s.get(&f.stream).map(|e| e.shared.clone()));
                if let Some(shared) = shared {
                    shared.send_window.grant(n);
                }
            }
            Kind::Ping if f.flags & flags::ACK == 0 => {
                return Ok(Some(Reply { kind: Kind::Ping, flags: flags::ACK, stream: f.stream, body: f.body.to_vec() }))
            }
            Kind::Ping => {}
            // Only a server sends GOAWAY (protocol 13.7): from a client it would have ended
            // every call of the connection as if the server were going away.
            Kind::GoAway if serving => return Err(internal(wire::bad("a client's GOAWAY, which only a server sends"))),
            Kind::GoAway => {
                let g = wire::GoAway::decode(&f.body).map_err(internal)?;
                self.set_dead(Status::new(Code::Unavailable, format!("the server is going away: {}", g.message)));
            }
        }
        Ok(None)
    }
}

/// The message inside a frame's body, from `at` on (a one-frame call's request or response):
/// the body advanced to it, not sliced, since a slice of a buffer not yet shared allocates to
/// share it.
fn tail(mut body: Bytes, at: usize) -> Bytes {
    bytes::Buf::advance(&mut body, at);
    body
}

impl Reply {
    fn trailers(stream: u64, status: &Status) -> Reply {
        Reply {
            kind: Kind::Trailers,
            flags: flags::END_STREAM,
            stream,
            body: wire::encode_trailers(status).into_owned(),
        }
    }

    fn cancel(stream: u64, code: Code) -> Reply {
        Reply { kind: Kind::Cancel, flags: 0, stream, body: wire::encode_cancel(code).to_vec() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_a_peer_chooses_alike_spread_over_the_table() {
        // Ids that differ only in a few high bits, or only in low ones: the multiply-shift this
        // hasher replaced put the first kind in one bucket of any table under 65,536, and one
        // keyed multiply put it in as few as a third of the buckets. 4,096 random picks of 4,096
        // buckets find about 2,590 of them; each pattern must find more than 2,048, with the
        // keys of any of 20 tables.
        let patterns: [fn(u64) -> u64; 4] = [|j| j << 45, |j| j << 16, |j| j, |j| (j << 52) | 1];
        for _ in 0..20 {
            let keys = IdKeys::default();
            for (p, pattern) in patterns.iter().enumerate() {
                let buckets: std::collections::HashSet<u64> =
                    (1..=4096u64).map(|j| keys.hash_one(pattern(j)) & 4095).collect();
                assert!(buckets.len() > 2048, "pattern {p}: 4,096 ids in {} buckets of 4,096", buckets.len());
                let tags: std::collections::HashSet<u64> =
                    (1..=4096u64).map(|j| keys.hash_one(pattern(j)) >> 57).collect();
                assert_eq!(tags.len(), 128, "pattern {p}: the top 7 bits take every value");
            }
        }
        let (one, other) = (IdKeys::default(), IdKeys::default());
        assert!((1..=64u64).any(|id| one.hash_one(id) != other.hash_one(id)), "each table has a key of its own");
    }
}
