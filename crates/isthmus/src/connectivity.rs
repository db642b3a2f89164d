//! A channel's connectivity in gRPC's five states, as grpc-core reports them: what
//! `grpc.channel_ready_future`, grpc.aio's `channel_ready` and `get_state` read.
//!
//! - A channel starts IDLE and stays so until a call, or a caller asking to connect
//!   (`try_to_connect`), makes it connect: CONNECTING, then READY, or TRANSIENT_FAILURE if the
//!   attempt failed. A connection that ends (the server went away) or takes no more calls
//!   (GOAWAY) takes the channel back to IDLE, as grpc-core's does; the next call or request to
//!   connect connects again. Over HTTP/2 a connection counts from the server's first frame, if it
//!   is a SETTINGS, as in grpc-go; one whose server sends none within the connect timeout ends
//!   then, and its attempt failed.
//! - The states come from the connections themselves: over `shm://` from the engine's connect
//!   and the connection's reader task, which ends the moment the peer's socket closes; over
//!   HTTP/2 from the connector under tonic's channel, whose stream is dropped when hyper drops
//!   the connection. Nothing polls.
//! - Asking to connect starts one background attempt (never a second while one runs) that
//!   retries with backoff while it fails (100 ms, × 1.6, at most 5 s, as grpc-core backs off),
//!   until the channel is READY or every handle on it is gone. Over HTTP/2 an attempt is one
//!   `grpc.health.v1.Health/Check` call: tonic opens its connection only for a request, and any
//!   answer, UNIMPLEMENTED included, says the connection is up.
//! - `close` makes a channel SHUTDOWN for good: no attempt connects it again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

/// A channel's connectivity state, gRPC's `grpc_connectivity_state`, numbered as grpcio's
/// `ChannelConnectivity` (`as u8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Connectivity {
    /// No connection, and none being made.
    Idle = 0,
    /// A connection is being made.
    Connecting = 1,
    /// A connection is up: calls go out at once.
    Ready = 2,
    /// The last attempt to connect failed.
    TransientFailure = 3,
    /// The channel was closed (`Channel::close`): final.
    Shutdown = 4,
}

/// How long an attempt started by a request to connect waits after a failure before the next.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// One channel's state, shared by its clones and its connections.
#[derive(Debug)]
pub(crate) struct Tracker {
    state: watch::Sender<Connectivity>,
    /// Bumped by each connection that comes up (inside the state's lock), so that only the
    /// newest one's end counts.
    generation: AtomicU64,
    /// A background attempt to connect is running.
    attempting: AtomicBool,
    /// How many connections have closed: a call's attempt watches it (`http::retry`).
    ends: watch::Sender<u64>,
}

impl Default for Tracker {
    fn default() -> Tracker {
        Tracker {
            state: watch::Sender::new(Connectivity::Idle),
            generation: AtomicU64::new(0),
            attempting: AtomicBool::new(false),
            ends: watch::Sender::new(0),
        }
    }
}

impl Tracker {
    pub(crate) fn get(&self) -> Connectivity {
        *self.state.borrow()
    }

    /// Moves from a state `from` accepts to `to`, in the state's lock; SHUTDOWN is final.
    fn shift(&self, from: impl Fn(Connectivity) -> bool, to: Connectivity) {
        self.state.send_if_modified(|s| {
            let moves = *s != to && *s != Connectivity::Shutdown && from(*s);
            if moves {
                *s = to;
            }
            moves
        });
    }

    /// An attempt to connect begins. A channel that has a connection stays READY (a second
    /// connection is being made beside it).
    pub(crate) fn connecting(&self) {
        self.shift(|s| s != Connectivity::Ready, Connectivity::Connecting);
    }

    /// An attempt to connect failed. A channel that still has a connection stays READY.
    pub(crate) fn failed(&self) {
        self.shift(|s| s != Connectivity::Ready, Connectivity::TransientFailure);
    }

    /// A connection is up: READY until the [`Live`] it gives is dropped, unless a newer
    /// connection came up meanwhile.
    pub(crate) fn connected(self: &Arc<Tracker>) -> Live {
        let mut generation = 0;
        self.state.send_if_modified(|s| {
            generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
            let moves = *s != Connectivity::Ready && *s != Connectivity::Shutdown;
            if moves {
                *s = Connectivity::Ready;
            }
            moves
        });
        Live { tracker: self.clone(), generation }
    }

    /// A child forked since the channel was made begins its own connection (ADR 0030): IDLE,
    /// unless closed, with no attempt running (the parent's ran on a runtime the child does not
    /// have), and the parent's connections no longer count.
    pub(crate) fn forked(&self) {
        self.state.send_if_modified(|s| {
            self.generation.fetch_add(1, Ordering::AcqRel);
            let moves = *s != Connectivity::Idle && *s != Connectivity::Shutdown;
            if moves {
                *s = Connectivity::Idle;
            }
            moves
        });
        self.attempting.store(false, Ordering::Release);
    }

    /// The channel was closed: SHUTDOWN, for good.
    pub(crate) fn shutdown(&self) {
        self.state.send_if_modified(|s| std::mem::replace(s, Connectivity::Shutdown) != Connectivity::Shutdown);
    }

    /// The channel says READY, but it has no connection that takes calls (its connection was
    /// found dead, or sent GOAWAY): IDLE, unless a newer connection came up.
    pub(crate) fn not_ready(&self, generation: Option<u64>) {
        self.state.send_if_modified(|s| {
            let newest = generation.is_none_or(|g| g == self.generation.load(Ordering::Acquire));
            let moves = *s == Connectivity::Ready && newest;
            if moves {
                *s = Connectivity::Idle;
            }
            moves
        });
    }

    /// A connection that never came up (its server sent nothing before it closed, or it was
    /// not an HTTP/2 server) closed: its attempt failed, and whoever watches [`ends`](Self::ends)
    /// is told, as of a connection that was up.
    pub(crate) fn ended_unready(&self) {
        self.failed();
        self.ended();
    }

    /// Tells whoever watches [`ends`](Self::ends) that a connection closed.
    fn ended(&self) {
        self.ends.send_modify(|n| *n += 1);
    }

    /// Told of every connection that closes from now on (its `changed` wakes), once the state
    /// says so.
    pub(crate) fn ends(&self) -> watch::Receiver<u64> {
        self.ends.subscribe()
    }

    /// Waits until the state is not `from`, and gives the new one.
    pub(crate) async fn changed(&self, from: Connectivity) -> Connectivity {
        let mut rx = self.state.subscribe();
        // The sender lives in `self`, so it cannot be gone while this borrows it.
        let changed = rx.wait_for(|s| *s != from).await.map(|s| *s);
        changed.unwrap_or_else(|_| self.get())
    }

    /// Starts a background attempt to connect, retried with backoff while it fails, unless
    /// one runs, a connection is up or the channel is closed. `attempt` makes one try
    /// (`true`: connected); it is given the channel back through `upgrade`, so the attempt
    /// ends once every handle on the channel is gone. Needs a tokio runtime (the caller's).
    pub(crate) fn kick<C, F, Fut>(self: &Arc<Tracker>, channel: std::sync::Weak<C>, attempt: F)
    where
        C: Send + Sync + 'static,
        F: Fn(Arc<C>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = bool> + Send + 'static,
    {
        let settled = |s| matches!(s, Connectivity::Ready | Connectivity::Shutdown);
        if settled(self.get()) || self.attempting.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            self.attempting.store(false, Ordering::Release);
            return;
        };
        // Cleared however the attempt ends, its runtime shutting down under it included.
        let attempting = Attempting(self.clone());
        handle.spawn(async move {
            let mut backoff = FIRST_BACKOFF;
            loop {
                let Some(channel) = channel.upgrade() else { break };
                if settled(attempting.0.get()) || attempt(channel).await {
                    break;
                }
                tokio::time::sleep(backoff).await;
                backoff = backoff.mul_f64(1.6).min(MAX_BACKOFF);
            }
        });
    }
}

/// A background attempt to connect runs while this lives.
struct Attempting(Arc<Tracker>);

impl Drop for Attempting {
    fn drop(&mut self) {
        self.0.attempting.store(false, Ordering::Release);
    }
}

/// Holds a channel READY for as long as the connection it stands for is up.
#[derive(Debug)]
pub(crate) struct Live {
    tracker: Arc<Tracker>,
    generation: u64,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.tracker.not_ready(Some(self.generation));
        // After the state, which whoever this wakes looks at.
        self.tracker.ended();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_holds_ready_until_it_ends_and_only_the_newest_counts() {
        let t = Arc::new(Tracker::default());
        assert_eq!(t.get(), Connectivity::Idle);
        t.connecting();
        assert_eq!(t.get(), Connectivity::Connecting);
        t.failed();
        assert_eq!(t.get(), Connectivity::TransientFailure);
        let first = t.connected();
        assert_eq!(t.get(), Connectivity::Ready);
        // A second attempt beside a live connection, failed or not, leaves it READY.
        t.connecting();
        t.failed();
        assert_eq!(t.get(), Connectivity::Ready);
        let second = t.connected();
        drop(first);
        assert_eq!(t.get(), Connectivity::Ready, "an older connection's end does not count");
        drop(second);
        assert_eq!(t.get(), Connectivity::Idle);
        let third = t.connected();
        t.shutdown();
        t.connecting();
        drop(third);
        let _fourth = t.connected();
        assert_eq!(t.get(), Connectivity::Shutdown, "SHUTDOWN is final");
    }
}
