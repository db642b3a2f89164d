//! Calls on their way from the engine to the blocking server's Python threads.
//!
//! The engine's reader hands a call over by pushing it here: no GIL, no Python, so a busy
//! interpreter never stalls a connection's frames. Python takes calls on the threads of the
//! server's executor, each running [`CallQueue::next`] in a loop (`Server.serve_calls`): the
//! handler runs on the thread that took the call, with no hop through the executor's queue.
//!
//! Waking a sleeping thread costs a cross-core wake-up (4–65 µs on the machines isthmus is
//! built for), more than a whole call. So the thread that has just finished a call spins a
//! while before it sleeps: at most one thread spins at a time, so idle threads never take both
//! cores. Threads beyond the spinner sleep on a condvar, and a push wakes one only when the
//! spinner cannot take the call.
//!
//! How many threads take calls follows demand: when calls wait and no thread is free, the
//! queue asks the server's dispatcher (a Python thread, so the engine's reader never takes
//! the GIL) to submit one more loop to the executor, up to the executor's size; a loop that
//! sees no call for [`IDLE`] returns its thread to the executor, and so does an idle one that
//! finds other work waiting for the executor's threads (the application's own tasks, or
//! another server's loops, on a shared pool), which grpcio's server, taking a thread per
//! call, never holds up.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use isthmus::binding::{HandedCall, Lender};
use isthmus::{Code, Status};

/// How long the thread that has just finished a call spins for the next one.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// How long calls wait for a busy loop before the dispatcher starts another.
const GRACE: Duration = Duration::from_micros(200);

/// How long a loop waits for a call before it returns its thread to the executor.
pub(crate) const IDLE: Duration = Duration::from_secs(2);

/// How often an idle loop looks whether other work waits for the executor's threads.
const LOOK_FOR_OTHERS: Duration = Duration::from_millis(10);

/// What [`CallQueue::next`] found.
pub(crate) enum Next {
    Call(Arc<HandedCall>),
    /// Nothing came for [`IDLE`]: this loop may end.
    Idle,
    /// The server has stopped.
    Closed,
}

#[derive(Default)]
struct State {
    calls: VecDeque<Arc<HandedCall>>,
    /// Loops waiting in `next` (spinning or asleep).
    idle: usize,
    /// Of those, asleep on `ready`.
    parked: usize,
    /// Loops the dispatcher has been asked for that have not started yet.
    starting: usize,
    /// Loops running (between their start and their end).
    loops: usize,
    closed: bool,
}

/// See the module's documentation.
pub(crate) struct CallQueue {
    state: Mutex<State>,
    /// Loops asleep, waiting for a call.
    ready: Condvar,
    /// The dispatcher, waiting for calls no loop is free to take.
    demand: Condvar,
    /// `state.calls.len()`, for the spinner to watch without the lock.
    queued: AtomicUsize,
    spinning: AtomicBool,
    /// Most loops at once: the executor's size.
    max_loops: usize,
}

impl CallQueue {
    pub(crate) fn new(max_loops: usize) -> CallQueue {
        CallQueue {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
            demand: Condvar::new(),
            queued: AtomicUsize::new(0),
            spinning: AtomicBool::new(false),
            max_loops: max_loops.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding it; a poisoned lock still holds consistent counts.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands a call to Python (on the engine's reader: never blocks, never takes the GIL).
    pub(crate) fn push(&self, call: Arc<HandedCall>) {
        let mut st = self.lock();
        if st.closed {
            drop(st);
            call.finish(Status::new(Code::Unavailable, "the server is shutting down"));
            return;
        }
        st.calls.push_back(call);
        self.queued.store(st.calls.len(), Ordering::Release);
        // A spinner (an idle loop that is not asleep) takes one call without being woken.
        let awake = st.idle - st.parked;
        if st.parked > 0 && st.calls.len() > awake {
            self.ready.notify_one();
        }
        if st.calls.len() > st.idle + st.starting && st.loops + st.starting < self.max_loops {
            self.demand.notify_one();
        }
    }

    fn pop(&self, st: &mut State) -> Option<Arc<HandedCall>> {
        while let Some(call) = st.calls.pop_front() {
            self.queued.store(st.calls.len(), Ordering::Release);
            // One whose client gave up, or whose deadline passed, while it waited: no handler.
            if call.is_active() {
                return Some(call);
            }
        }
        None
    }

    /// Counts a loop in (`started`) or out.
    pub(crate) fn loop_running(&self, started: bool) {
        let mut st = self.lock();
        if started {
            st.starting = st.starting.saturating_sub(1);
            st.loops += 1;
        } else {
            st.loops = st.loops.saturating_sub(1);
            // Calls may be waiting for a loop this one's end makes room for.
            if st.calls.len() > st.idle + st.starting {
                self.demand.notify_one();
            }
        }
    }

    /// The next call, for a loop; spins for up to `spin` first if no other loop spins. The
    /// spinner reads `connection` meanwhile (that of the loop's last call, ADR 0020), so that
    /// a call coming on it is this thread's without a reader in between.
    pub(crate) fn next(
        &self,
        spin: Duration,
        connection: Option<&Lender>,
        others_wait: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Next {
        let mut st = self.lock();
        if let Some(call) = self.pop(&mut st) {
            return Next::Call(call);
        }
        if st.closed {
            return Next::Closed;
        }
        st.idle += 1;
        if !spin.is_zero() && !self.spinning.swap(true, Ordering::AcqRel) {
            drop(st);
            // Every look yields the core: on two cores the client and the connection's reader
            // must run for the next call to come, and this loop must not hold them up. Measured
            // against 2 µs of pure spin first (`py-py-isthmus` 64 B, 16 runs each, one host):
            // 84 k against 71-74 k calls/s one in flight, p50 12.2 against 12.5-12.8 µs.
            let start = Instant::now();
            if let Some(connection) = connection {
                // A panic there ends that connection (its reader finds the lent receiver
                // poisoned); this queue's counts must stay right for the other calls.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    connection.serve_here(spin, || self.queued.load(Ordering::Acquire) > 0);
                }));
            }
            while self.queued.load(Ordering::Acquire) == 0 && start.elapsed() < spin {
                std::thread::yield_now();
            }
            self.spinning.store(false, Ordering::Release);
            st = self.lock();
        }
        let until = Instant::now() + IDLE;
        let mut look = Instant::now() + LOOK_FOR_OTHERS;
        let next = loop {
            if let Some(call) = self.pop(&mut st) {
                break Next::Call(call);
            }
            if st.closed {
                break Next::Closed;
            }
            let mut now = Instant::now();
            if now >= until {
                break Next::Idle;
            }
            if let Some(others_wait) = others_wait.filter(|_| now >= look) {
                // Without the queue's lock: the look takes the GIL.
                drop(st);
                let yields = others_wait();
                st = self.lock();
                if yields {
                    break self.pop(&mut st).map_or(Next::Idle, Next::Call);
                }
                now = Instant::now();
                look = now + LOOK_FOR_OTHERS;
            }
            let wake = if others_wait.is_some() { until.min(look) } else { until };
            st.parked += 1;
            st = self
                .ready
                .wait_timeout(st, wake.saturating_duration_since(now))
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
            st.parked -= 1;
        };
        st.idle -= 1;
        next
    }

    /// For the dispatcher: waits until calls wait that no loop is free to take, and reserves
    /// the loop it will submit. False once the server has stopped.
    ///
    /// A loop that has just finished a call is not yet back in `next` when the client's next
    /// call arrives (its handler is still returning): the dispatcher looks again after
    /// [`GRACE`] before it takes a thread of the executor for a call that loop will take.
    pub(crate) fn wait_demand(&self) -> bool {
        let wanted = |st: &State| st.calls.len() > st.idle + st.starting && st.loops + st.starting < self.max_loops;
        let mut st = self.lock();
        loop {
            if st.closed {
                return false;
            }
            if wanted(&st) {
                st = self.demand.wait_timeout(st, GRACE).map_or_else(|p| p.into_inner().0, |(g, _)| g);
                if st.closed {
                    return false;
                }
                if wanted(&st) {
                    st.starting += 1;
                    return true;
                }
                continue;
            }
            st = self.demand.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The dispatcher could not submit the loop it reserved (the executor was shut down):
    /// every call waiting, and every later one, fails UNAVAILABLE.
    pub(crate) fn refuse(&self, why: &str) {
        {
            let mut st = self.lock();
            st.starting = st.starting.saturating_sub(1);
        }
        self.shut(why);
    }

    /// The server has stopped: loops and the dispatcher end.
    pub(crate) fn close(&self) {
        self.shut("the server has stopped");
    }

    /// Loops and the dispatcher end; calls waiting, and every later one, fail UNAVAILABLE.
    pub(crate) fn shut(&self, why: &str) {
        let calls: Vec<_> = {
            let mut st = self.lock();
            st.closed = true;
            self.queued.store(0, Ordering::Release);
            st.calls.drain(..).collect()
        };
        self.ready.notify_all();
        self.demand.notify_all();
        for call in calls {
            call.finish(Status::new(Code::Unavailable, why.to_owned()));
        }
    }
}
