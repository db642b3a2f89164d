//! Sizes, limits and policies of a connection. The size rules live here because the handshake
//! shares them: both sides validate the four agreed sizes before anything is mapped.
//!
//! [`SpinPolicy`] bounds how long a wait spins before it sleeps on its doorbell: purely for
//! `yield_after` (default 2 µs), then yielding the CPU after every batch of checks, until `max`
//! (default 50 µs). The numbers come from the 2-vCPU machine the project is built on. A wake-up
//! from sleep on another core costs 5 to 65 µs, set by how long an idle vCPU takes to wake, while
//! two processes spinning on one shared word hand over in 0.13 µs: a short spin wins whenever the
//! reply comes within tens of µs. But when the scheduler puts both processes on one core, a spinner
//! only delays the peer it waits for; yielding after 2 µs hands the core over at once, so a 64 B
//! round trip on one core takes 12 µs, against 25 µs when the first 10 µs of the spin were pure
//! (the earlier policy). The benchmark run of 2026-11-22T07:18 agrees: 0.12 µs for two spinning
//! processes, 61 µs p50 for an eventfd ping-pong, 74 µs for a 64 B round trip that never spins,
//! 0.43 µs with the default spin, 12 µs on one core.
//!
//! The spin stays bounded, so an idle connection sleeps after `max` and costs no CPU.
//! `SpinPolicy { max: Duration::ZERO, .. }` sleeps at once. The benchmark systems
//! `isthmus-shm-transport-nospin` and `-samecore` measure both regimes.

use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::layout::{ARENA_GRANULE, FRAME_HEADER_LEN};

/// Who may connect to a server.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Only processes running as the server's own uid (the default).
    #[default]
    SameUid,
    /// The server's own uid plus these.
    Uids(Vec<u32>),
    /// Anyone who can reach the socket (its directory's permissions still apply).
    Any,
}

impl PeerPolicy {
    pub(crate) fn allows(&self, own_uid: u32, peer_uid: u32) -> bool {
        match self {
            PeerPolicy::SameUid => peer_uid == own_uid,
            PeerPolicy::Uids(list) => peer_uid == own_uid || list.contains(&peer_uid),
            PeerPolicy::Any => true,
        }
    }
}

/// How long a waiter spins before it sleeps on the doorbell.
///
/// Spinning answers in well under a microsecond where a sleep and wake-up costs 5–65 µs (more
/// when the sleeper's CPU has gone idle), but a spinner holds a core the peer may need. So the
/// spin is bounded by time, and after `yield_after` every iteration yields the CPU: a peer that
/// shares this core gets it at once instead of waiting out the spin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpinPolicy {
    /// Upper bound on spinning per wait; zero sleeps at once.
    pub max: Duration,
    /// Pure spinning before each iteration starts to yield the CPU.
    pub yield_after: Duration,
}

impl Default for SpinPolicy {
    fn default() -> SpinPolicy {
        SpinPolicy { max: Duration::from_micros(50), yield_after: Duration::from_micros(2) }
    }
}

/// Extra spin per KiB the peer has yet to read: 0.25 µs, a copy at 4 GB/s, a quarter of the
/// speed of a cross-core copy on the machines measured (ADR 0014).
const OWED_SPIN_PER_KIB: Duration = Duration::from_nanos(250);
/// Above this (about 8 MiB owed) the extension is not made: the work then dwarfs a sleep and a
/// wake-up, and a longer spin would only hold a core.
const OWED_SPIN_CAP: Duration = Duration::from_millis(2);

impl SpinPolicy {
    /// The policy for a blocking wait whose peer still has `owed` bytes of ours to read before
    /// it can answer. A reply to a large message cannot come before the peer has read it, and a
    /// sleep that starts before it does costs a wake-up (4–65 µs, set by the host) on top of
    /// the work: so the spin lasts as long as that reading plausibly takes, on top of `max`, up
    /// to a cap. A spin of zero stays zero. Async waits do not use it: they spin on a runtime's
    /// worker, which other tasks need (ADR 0014).
    pub fn owing(self, owed: u64) -> SpinPolicy {
        if self.max.is_zero() || owed < 1024 {
            return self;
        }
        let extra = copy_time(owed);
        if extra > OWED_SPIN_CAP {
            return self;
        }
        SpinPolicy { max: self.max.saturating_add(extra), ..self }
    }

    /// How much longer than `max` a wait for the peer's next frame may spin while the peer
    /// says it is writing `composing` bytes of messages for us (`layout::CTL_COMPOSING`): the
    /// same 0.25 µs per KiB as [`owing`](Self::owing), up to `COMPOSING_SPIN_CAP`. The word
    /// is the peer's to write, so it only ever bounds a spin; below `COMPOSING_MIN` nothing
    /// is added (the base spin covers such a copy). A spin of zero stays zero (ADR 0026).
    pub(crate) fn composing_extra(self, composing: u64) -> Duration {
        if self.max.is_zero() || composing < COMPOSING_MIN as u64 {
            return Duration::ZERO;
        }
        copy_time(composing).min(COMPOSING_SPIN_CAP)
    }
}

/// How long a peer plausibly takes to copy `bytes`, at [`OWED_SPIN_PER_KIB`]; saturating.
fn copy_time(bytes: u64) -> Duration {
    OWED_SPIN_PER_KIB.saturating_mul(u32::try_from(bytes / 1024).unwrap_or(u32::MAX))
}

/// A block at least this large is announced to the peer while it is written
/// (`layout::CTL_COMPOSING`), and the announcement wakes a sleeping peer: writing it takes
/// longer (25–100 µs on the machines measured) than the peer's base spin, or its wake-up.
pub(crate) const COMPOSING_MIN: usize = 256 << 10;
/// The longest a wait spins for a message the peer announced: 16 MiB at 0.25 µs per KiB.
pub(crate) const COMPOSING_SPIN_CAP: Duration = Duration::from_millis(4);

/// Configuration of one side of a connection.
///
/// The ring and arena sizes a side configures are the ones it *sends* through: the client's
/// values size the client→server direction, the server's the server→client direction. The
/// server clamps a client's request to [`Config::max_ring_size`] and [`Config::max_arena_size`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Bytes of frame ring this side sends into. A power of two, 4 KiB to 64 MiB.
    pub ring_size: usize,
    /// Bytes of payload arena this side allocates from. A multiple of 64 KiB, up to 4 GiB.
    pub arena_size: usize,
    /// Messages up to this many bytes travel inline in the ring; larger ones through the arena.
    /// At most a quarter of the ring.
    pub inline_max: usize,
    /// Largest message this side accepts; a larger one is refused with
    /// [`ErrorKind::MessageTooLarge`] and the connection goes on.
    pub max_message_size: u64,
    /// Bytes this side holds at once, across all streams, of messages still arriving in pieces
    /// (messages over half the peer's arena); `None` (the default) for `max_message_size`. A
    /// piece that would go past it fails its own message with [`ErrorKind::MessageTooLarge`]: the
    /// bytes copied so far are dropped, its later pieces handed back uncopied, and the
    /// connection goes on. So messages a peer starts and never finishes cannot take more memory
    /// than this.
    pub max_reassembly: Option<u64>,
    /// Spinning before sleeping.
    pub spin: SpinPolicy,
    /// How long the server waits for a client's hello, and each side for each handshake read
    /// or write, before giving up on the connection.
    pub handshake_timeout: Duration,
    /// Who may be at the other end. A server checks the connecting client's uid; a client
    /// checks the server's (root is always accepted as a server).
    pub peer_policy: PeerPolicy,
    /// Server only: the largest ring a client may ask for.
    pub max_ring_size: usize,
    /// Server only: the largest arena a client may ask for.
    pub max_arena_size: usize,
    /// Server only: bytes of the listener's shared arena, from which one block is sent to many
    /// connections (publish/subscribe, ADR 0016). Zero for none. A multiple of 64 KiB, up to
    /// 4 GiB; memory is used only as blocks are written. Every client can read all of it, so a
    /// listener whose `peer_policy` admits other users has none, whatever this says.
    pub shared_arena_size: usize,
    /// The optional protocol features this side takes part in ([`crate::features`]; those of
    /// `features::ALL` by default): a client offers these, a server grants those of the client's
    /// it has here. Turning one off makes a connection behave as with a peer that lacks it.
    pub features: u16,
    /// `Some(limit)`: copy each message that arrives in an arena block into this process's
    /// memory as it arrives, and give the block back at once, while the copies not yet dropped
    /// hold fewer than `limit` bytes; past it, messages are read in place. `None` (the default):
    /// read in place. For a receiver that may hold messages a long time on behalf of others, as
    /// a server's bridge to its own handlers does for every HTTP/2 client (ADR 0036): one slow
    /// reader then holds its windows' worth of memory, not the arena every stream of the
    /// connection needs, and the limit bounds that memory. Costs one copy per message larger
    /// than `inline_max`.
    pub copy_received: Option<u64>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            ring_size: 1 << 20,
            arena_size: 64 << 20,
            inline_max: 8 << 10,
            max_message_size: 4 << 30,
            max_reassembly: None,
            spin: SpinPolicy::default(),
            handshake_timeout: Duration::from_secs(5),
            peer_policy: PeerPolicy::default(),
            max_ring_size: 64 << 20,
            max_arena_size: 4 << 30,
            shared_arena_size: 64 << 20,
            features: crate::features::ALL,
            copy_received: None,
        }
    }
}

/// Bounds every ring size must respect.
pub(crate) const MIN_RING: usize = 4 << 10;
pub(crate) const MAX_RING: usize = 64 << 20;
/// Arenas are whole granules and at most 4 GiB so offsets fit comfortably.
pub(crate) const MAX_ARENA: usize = 4 << 30;
pub(crate) const ARENA_MULTIPLE: usize = 64 << 10;

pub(crate) fn check_ring_size(what: &str, n: usize) -> Result<()> {
    if n.is_power_of_two() && (MIN_RING..=MAX_RING).contains(&n) {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("{what} is {n} bytes; it must be a power of two from {MIN_RING} to {MAX_RING}"),
        ))
    }
}

pub(crate) fn check_arena_size(what: &str, n: usize) -> Result<()> {
    if n % ARENA_MULTIPLE == 0 && (ARENA_MULTIPLE..=MAX_ARENA).contains(&n) {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "{what} is {n} bytes; it must be a multiple of {ARENA_MULTIPLE} from {ARENA_MULTIPLE} to {MAX_ARENA}"
            ),
        ))
    }
}

impl Config {
    /// Checks every value; the error names the field, its value and the allowed range.
    pub fn validate(&self) -> Result<()> {
        check_ring_size("ring_size", self.ring_size)?;
        check_arena_size("arena_size", self.arena_size)?;
        check_ring_size("max_ring_size", self.max_ring_size)?;
        check_arena_size("max_arena_size", self.max_arena_size)?;
        if self.shared_arena_size != 0 {
            check_arena_size("shared_arena_size", self.shared_arena_size)?;
        }
        let inline_cap = self.ring_size / 4 - FRAME_HEADER_LEN;
        if self.inline_max > inline_cap {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "inline_max is {} bytes; with a {}-byte ring it may be at most {inline_cap}",
                    self.inline_max, self.ring_size
                ),
            ));
        }
        debug_assert!(self.arena_size >= ARENA_GRANULE);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_spins_longer_while_the_peer_owes_an_answer_to_a_large_message() {
        let base = SpinPolicy::default();
        assert_eq!(base.owing(0), base);
        assert_eq!(base.owing(1023), base);
        // 1 MiB owed: 1024 KiB at 0.25 µs each on top of the base bound.
        assert_eq!(base.owing(1 << 20).max, base.max + Duration::from_micros(256));
        assert_eq!(base.owing(1 << 20).yield_after, base.yield_after);
        // The cap is 2 ms, about 8 MiB owed; beyond it the extension is not made.
        assert_eq!(base.owing(7 << 20).max, base.max + Duration::from_micros(1792));
        assert_eq!(base.owing(8 << 20), base);
        assert_eq!(base.owing(u64::MAX), base);
        // "Spin for ever" stays that, without overflowing.
        let always = SpinPolicy { max: Duration::MAX, ..base };
        assert_eq!(always.owing(1 << 20).max, Duration::MAX);
        // A policy that never spins keeps never spinning.
        let none = SpinPolicy { max: Duration::ZERO, ..base };
        assert_eq!(none.owing(1 << 20), none);
    }

    #[test]
    fn composing_extends_by_the_announced_bytes_up_to_a_cap() {
        let base = SpinPolicy::default();
        assert_eq!(base.composing_extra(0), Duration::ZERO);
        assert_eq!(base.composing_extra(COMPOSING_MIN as u64 - 1), Duration::ZERO);
        assert_eq!(base.composing_extra(1 << 20), Duration::from_micros(256));
        assert_eq!(base.composing_extra(16 << 20), COMPOSING_SPIN_CAP);
        // The peer writes the word: any value only bounds the spin.
        assert_eq!(base.composing_extra(u64::MAX), COMPOSING_SPIN_CAP);
        let never = SpinPolicy { max: Duration::ZERO, ..base };
        assert_eq!(never.composing_extra(1 << 20), Duration::ZERO);
    }
}
