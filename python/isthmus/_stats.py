"""Counters of a channel's or a server's shared-memory connections."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransportStats:
    """What `Channel.stats()` and `Server.stats()` report about the `shm://` connections
    (HTTP/2 calls are not counted). Sums over the connections, except the high-water mark.

    `arena_in_use` is the leak check for the raw tier: this side's shared memory that is
    allocated now, in blocks being filled, or sent and still held by the peer (a `Message`
    view it keeps, say). It returns to zero once neither side holds a message of this side's.
    """

    calls_started: int
    """Calls started (a channel) or accepted (a server)."""
    calls_in_flight: int
    """Calls started and not finished."""
    bytes_sent: int
    """Message bytes sent."""
    bytes_received: int
    """Message bytes received."""
    arena_in_use: int
    """Bytes of this side's arena allocated now."""
    arena_high_water: int
    """The most bytes of one connection's arena ever allocated at once."""
    frames_sent: int = 0
    """Frames written into this side's rings (a 64 B unary call is one each way)."""
    frames_received: int = 0
    """Frames read from the peer's rings."""
    doorbells_rung: int = 0
    """System calls made to wake a peer that had gone to sleep on its doorbell."""
    sleeps: int = 0
    """Waits on this side that went to sleep on the doorbell after their bounded spin."""
    spin_hits: int = 0
    """Waits that ended while spinning, with no sleep and no wake-up."""
    ring_full_waits: int = 0
    """Sends that found a frame ring full and waited."""
    arena_full_waits: int = 0
    """Allocations that found the arena full and waited."""
    shared_sent: int = 0
    """Messages a server sent by reference from its listener's shared arena (a `Topic`'s one
    write for every subscriber); a raw block sent in place is not counted here."""
    answers_dropped: int = 0
    """Answers to the peer (to its PINGs, say) dropped because it read nothing of ours while
    1,024 of them, or 4 MiB, waited for room; each is also logged."""
    accept_errors: int = 0
    """A server's failed accepts on its `shm://` listeners (out of file descriptors, say); each
    is logged, and the listener pauses (5 ms, doubling to 1 s) before it accepts again."""
    handshakes_failed: int = 0
    """A server's `shm://` clients whose handshake failed (a client that hung up, a version or
    user refused, no descriptors left for the segment)."""
