//! Counters a C caller can read: what `isthmus_channel_stats` and `isthmus_server_stats` give,
//! the same counts as the engine's `ConnectionCounters` and `ServerStats` (and Python's
//! `TransportStats`), summed over a channel's or a server's `shm://` connections.

use isthmus::{ConnectionCounters, ServerStats};

use crate::abi::{entry, invalid, isthmus_code_t};
use crate::client::{isthmus_channel_t, CHANNELS};
use crate::server::{isthmus_server_t, SERVERS};

/// Counters of a channel's or a server's `shm://` connections (calls over HTTP/2 are not
/// counted): sums over the connections, but the largest high-water mark. A channel's counts start
/// afresh when it reconnects; a server's cover its live connections, and its listeners' failures
/// since it started. Every field is a `uint64_t`; fields are only ever appended (see
/// `isthmus_channel_stats` for how an older caller's smaller struct is filled).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct isthmus_stats_t {
    /// Calls started (a channel) or accepted (a server).
    pub calls_started: u64,
    /// Calls started and not finished yet.
    pub calls_in_flight: u64,
    /// Calls finished, by their final code: `calls_finished[ISTHMUS_UNAVAILABLE]` ended
    /// UNAVAILABLE.
    pub calls_finished: [u64; 17],
    /// Frames this side wrote into its rings.
    pub frames_sent: u64,
    /// Frames this side read from the peers' rings.
    pub frames_received: u64,
    /// Message bytes sent.
    pub bytes_sent: u64,
    /// Message bytes received.
    pub bytes_received: u64,
    /// Doorbell system calls made to wake a peer.
    pub doorbells_rung: u64,
    /// Times a wait on this side went to sleep on its doorbell.
    pub sleeps: u64,
    /// Waits that ended while spinning, with no sleep.
    pub spin_hits: u64,
    /// Sends that found a frame ring full and waited.
    pub ring_full_waits: u64,
    /// Allocations that found an arena full and waited.
    pub arena_full_waits: u64,
    /// Bytes of this side's arenas allocated now: blocks being filled, or sent and still held
    /// by the peer. It returns to 0 once neither side holds a message of this side's (the raw
    /// tier's leak check).
    pub arena_in_use: u64,
    /// The most bytes of one connection's arena ever allocated at once.
    pub arena_high_water: u64,
    /// Messages a server sent by reference from its listener's shared arena (a topic's one
    /// write for every subscriber, ADR 0016); a raw block sent in place is not counted here.
    pub shared_sent: u64,
    /// Answers to the peer (to its PINGs, say) dropped because it read nothing of ours while
    /// 1,024 of them, or 4 MiB, waited for room; each is also logged.
    pub answers_dropped: u64,
    /// A server's live `shm://` connections (0 for a channel).
    pub connections: u64,
    /// A server's failed accepts on its `shm://` listeners (out of file descriptors, say);
    /// each is logged, and the listener pauses before it accepts again (0 for a channel).
    pub accept_errors: u64,
    /// A server's `shm://` clients whose handshake failed: a client that hung up, a version or
    /// user refused, no descriptors left for the segment (0 for a channel).
    pub handshakes_failed: u64,
}

impl isthmus_stats_t {
    /// `counters` as one (see the type's documentation).
    pub(crate) fn of(counters: impl IntoIterator<Item = ConnectionCounters>) -> isthmus_stats_t {
        let c = ConnectionCounters::total(counters);
        let t = c.transport;
        isthmus_stats_t {
            calls_started: c.calls_started,
            calls_in_flight: c.in_flight(),
            calls_finished: c.calls_finished,
            frames_sent: t.frames_sent,
            frames_received: t.frames_received,
            bytes_sent: t.bytes_sent,
            bytes_received: t.bytes_received,
            doorbells_rung: t.doorbells_rung,
            sleeps: t.sleeps,
            spin_hits: t.spin_hits,
            ring_full_waits: t.ring_full_waits,
            arena_full_waits: t.arena_full_waits,
            arena_in_use: t.arena_in_use,
            arena_high_water: t.arena_high_water,
            shared_sent: t.shared_sent,
            answers_dropped: c.answers_dropped,
            ..isthmus_stats_t::default()
        }
    }

    /// A server's counters: its connections', and its listeners' failures.
    pub(crate) fn of_server(stats: &ServerStats) -> isthmus_stats_t {
        let connections = stats.connections();
        let n = connections.len() as u64;
        isthmus_stats_t {
            connections: n,
            accept_errors: stats.accept_errors(),
            handshakes_failed: stats.handshakes_failed(),
            ..isthmus_stats_t::of(connections)
        }
    }
}

/// Stores `value`, a plain struct of counters (`repr(C)`, all `u64`: no padding), into the
/// caller's `out` of `size` bytes: the first `size` bytes of it, and zeros past its end, so that
/// a caller built against an older header, whose struct lacks the newer fields at its end, gets
/// the fields it knows, and one built against a newer header reads those this library lacks
/// as 0.
///
/// # Safety
///
/// `out` is NULL or writable for `size` bytes.
pub(crate) unsafe fn store<T: Copy>(out: *mut T, size: usize, value: T) -> Result<(), isthmus::Status> {
    if out.is_null() {
        return Err(invalid("the stats out-pointer is NULL"));
    }
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `value` is a local of `size_of::<T>() >= n` bytes; `out` is writable for
    // `size >= n` bytes (the caller's promise); a local and the caller's memory never overlap.
    unsafe { std::ptr::copy_nonoverlapping(std::ptr::from_ref(&value).cast::<u8>(), out.cast::<u8>(), n) };
    // A caller built against a newer header, whose struct has fields this library lacks, reads
    // them as 0 rather than as whatever its memory held.
    // SAFETY: `out` is writable for `size` bytes (the caller's promise), of which `n` are written.
    unsafe { std::ptr::write_bytes(out.cast::<u8>().add(n), 0, size - n) };
    Ok(())
}

/// The channel's counters (see `isthmus_stats_t`) into `*out`. `size` is `sizeof(*out)` as the
/// caller compiled it, and the library writes exactly that many bytes: a program built against
/// an older header gets the fields it knows and nothing past them, one built against a newer
/// header reads the fields this library lacks as 0.
///
/// Thread-safety: any thread, an event loop's included: it never waits. The counts are of that
/// moment; calls on other threads change them.
///
/// # Safety
///
/// `out` is NULL or writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn isthmus_channel_stats(
    channel: *const isthmus_channel_t,
    out: *mut isthmus_stats_t,
    size: usize,
) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let stats = isthmus_stats_t::of(CHANNELS.get(channel)?.counters());
        // SAFETY: the caller's promise, passed on.
        unsafe { store(out, size, stats) }
    })
}

/// The server's counters (see `isthmus_stats_t`) into `*out`, `size` as for
/// `isthmus_channel_stats`. All zero before the server starts; after a shutdown, its listeners'
/// failures stay and its connections are gone.
///
/// Thread-safety: any thread: it never waits for calls or connections. The counts are of that
/// moment.
///
/// # Safety
///
/// `out` is NULL or writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_stats(
    server: *const isthmus_server_t,
    out: *mut isthmus_stats_t,
    size: usize,
) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let stats = SERVERS.get(server)?.stats().map(|s| isthmus_stats_t::of_server(&s)).unwrap_or_default();
        // SAFETY: the caller's promise, passed on.
        unsafe { store(out, size, stats) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_callers_smaller_struct_gets_only_the_fields_it_knows() {
        let stats =
            isthmus_stats_t { calls_started: 7, calls_in_flight: 2, handshakes_failed: 9, ..Default::default() };
        let mut old = [u64::MAX; 3];
        // SAFETY: `old` is writable for its 24 bytes.
        unsafe { store(old.as_mut_ptr().cast(), std::mem::size_of_val(&old), stats) }.expect("stored");
        assert_eq!(old, [7, 2, 0]);
        // A caller's struct larger than the library's (a newer header): the library's part, and
        // zeros past it.
        let mut newer = [u64::MAX; 64];
        let size = std::mem::size_of_val(&newer);
        // SAFETY: `newer` is writable for its 512 bytes.
        unsafe { store(newer.as_mut_ptr().cast(), size, stats) }.expect("stored");
        let fields = std::mem::size_of::<isthmus_stats_t>() / 8;
        assert_eq!((newer[0], newer[fields - 1]), (7, 9));
        assert!(newer[fields..].iter().all(|&w| w == 0), "zeros past the library's fields");
        // SAFETY: NULL is refused before anything is written.
        assert!(unsafe { store(std::ptr::null_mut(), 8, stats) }.is_err());
    }
}
