//! Per-connection counters, cheap enough to keep on the hot path.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one connection (relaxed atomics; read with [`Stats::snapshot`]).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) frames_sent: AtomicU64,
    pub(crate) frames_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) doorbells_rung: AtomicU64,
    pub(crate) sleeps: AtomicU64,
    pub(crate) spin_hits: AtomicU64,
    pub(crate) ring_full_waits: AtomicU64,
    pub(crate) arena_full_waits: AtomicU64,
    pub(crate) arena_high_water: AtomicU64,
    pub(crate) shared_sent: AtomicU64,
}

impl Stats {
    pub(crate) fn add(&self, c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn max(&self, c: &AtomicU64, n: u64) {
        c.fetch_max(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> Counters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            frames_sent: g(&self.frames_sent),
            frames_received: g(&self.frames_received),
            bytes_sent: g(&self.bytes_sent),
            bytes_received: g(&self.bytes_received),
            doorbells_rung: g(&self.doorbells_rung),
            sleeps: g(&self.sleeps),
            spin_hits: g(&self.spin_hits),
            ring_full_waits: g(&self.ring_full_waits),
            arena_full_waits: g(&self.arena_full_waits),
            arena_high_water: g(&self.arena_high_water),
            arena_in_use: 0,
            shared_sent: g(&self.shared_sent),
        }
    }
}

/// A snapshot of a connection's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counters {
    /// Frames this side wrote into its ring.
    pub frames_sent: u64,
    /// Frames this side read from the peer's ring.
    pub frames_received: u64,
    /// Message payload bytes sent (inline and arena).
    pub bytes_sent: u64,
    /// Message payload bytes received.
    pub bytes_received: u64,
    /// Doorbell system calls made to wake the peer.
    pub doorbells_rung: u64,
    /// Times a waiter on this side went to sleep on its doorbell.
    pub sleeps: u64,
    /// Waits that ended while spinning, without a sleep.
    pub spin_hits: u64,
    /// Sends that found the frame ring full and waited.
    pub ring_full_waits: u64,
    /// Allocations that found the arena full and waited.
    pub arena_full_waits: u64,
    /// Most arena bytes this side had out at once.
    pub arena_high_water: u64,
    /// Arena bytes this side has out now: blocks being built, or sent and not yet released by
    /// the peer ([`Sender::counters`](crate::Sender::counters) takes in the peer's releases
    /// first). It returns to zero once neither side holds a message of this side's.
    pub arena_in_use: u64,
    /// Messages sent by reference to a block of the listener's shared arena
    /// ([`crate::SharedArena`]).
    pub shared_sent: u64,
}

impl Counters {
    /// The counters of several connections as one: sums, but the largest high-water mark (one
    /// connection's arena is one arena).
    pub fn merged(self, other: Counters) -> Counters {
        Counters {
            frames_sent: self.frames_sent + other.frames_sent,
            frames_received: self.frames_received + other.frames_received,
            bytes_sent: self.bytes_sent + other.bytes_sent,
            bytes_received: self.bytes_received + other.bytes_received,
            doorbells_rung: self.doorbells_rung + other.doorbells_rung,
            sleeps: self.sleeps + other.sleeps,
            spin_hits: self.spin_hits + other.spin_hits,
            ring_full_waits: self.ring_full_waits + other.ring_full_waits,
            arena_full_waits: self.arena_full_waits + other.arena_full_waits,
            arena_high_water: self.arena_high_water.max(other.arena_high_water),
            arena_in_use: self.arena_in_use + other.arena_in_use,
            shared_sent: self.shared_sent + other.shared_sent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_counters_sum_but_keep_the_largest_high_water_mark() {
        let a = Counters { frames_sent: 3, arena_high_water: 100, arena_in_use: 7, ..Counters::default() };
        let b = Counters { frames_sent: 4, arena_high_water: 60, arena_in_use: 5, ..Counters::default() };
        let m = a.merged(b);
        assert_eq!((m.frames_sent, m.arena_high_water, m.arena_in_use), (7, 100, 12));
    }
}
