package isthmus

/*
#include "isthmus.h"
*/
import "C"

import (
	"unsafe"

	"google.golang.org/grpc/codes"
)

// TransportStats are the counters of a connection's or a server's shm:// connections, as the
// library keeps them (calls over HTTP/2 are not counted): sums over the connections, but the
// largest high-water mark. A ClientConn's start afresh when it reconnects; a Server's cover
// its live connections, and its listeners' failures since it started. They are the figures
// Python's TransportStats and Rust's ConnectionCounters give.
type TransportStats struct {
	// CallsStarted counts calls started (a ClientConn) or accepted (a Server).
	CallsStarted uint64
	// CallsInFlight counts calls started and not finished yet.
	CallsInFlight uint64
	// CallsFinished counts finished calls by their final code (see Finished).
	CallsFinished [17]uint64
	// FramesSent and FramesReceived count the frames written into and read from the rings.
	FramesSent, FramesReceived uint64
	// BytesSent and BytesReceived count message bytes.
	BytesSent, BytesReceived uint64
	// DoorbellsRung counts the system calls made to wake a peer; Sleeps, the waits that went
	// to sleep on this side's doorbell; SpinHits, the waits that ended while spinning.
	DoorbellsRung, Sleeps, SpinHits uint64
	// RingFullWaits and ArenaFullWaits count sends that found a ring full, and allocations
	// that found an arena full, and waited.
	RingFullWaits, ArenaFullWaits uint64
	// ArenaInUse is this side's shared memory allocated now: blocks being filled, or sent and
	// still held by the peer (a Message it has not released). It returns to 0 once neither
	// side holds a message of this side's: the raw tier's leak check.
	ArenaInUse uint64
	// ArenaHighWater is the most bytes of one connection's arena ever allocated at once.
	ArenaHighWater uint64
	// SharedSent counts messages a Server sent by reference from its listener's shared arena
	// (a topic's one write for every subscriber); a raw block sent in place is not counted here.
	SharedSent uint64
	// AnswersDropped counts answers to the peer (to its PINGs, say) dropped because it read
	// nothing of this side's while 1,024 of them, or 4 MiB, waited for room; each is logged.
	AnswersDropped uint64
	// Connections counts a Server's live shm:// connections (0 for a ClientConn).
	Connections uint64
	// AcceptErrors counts a Server's failed accepts on its shm:// listeners (out of file
	// descriptors, say); each is logged, and the listener pauses before it accepts again.
	AcceptErrors uint64
	// HandshakesFailed counts a Server's shm:// clients whose handshake failed: a client that
	// hung up or spoke another version, a user refused, no descriptors left for the segment.
	HandshakesFailed uint64
}

// Finished is how many calls finished with code c.
func (s TransportStats) Finished(c codes.Code) uint64 {
	if int(c) < len(s.CallsFinished) {
		return s.CallsFinished[c]
	}
	return 0
}

func transportStats(c *C.isthmus_stats_t) TransportStats {
	s := TransportStats{
		CallsStarted:     uint64(c.calls_started),
		CallsInFlight:    uint64(c.calls_in_flight),
		FramesSent:       uint64(c.frames_sent),
		FramesReceived:   uint64(c.frames_received),
		BytesSent:        uint64(c.bytes_sent),
		BytesReceived:    uint64(c.bytes_received),
		DoorbellsRung:    uint64(c.doorbells_rung),
		Sleeps:           uint64(c.sleeps),
		SpinHits:         uint64(c.spin_hits),
		RingFullWaits:    uint64(c.ring_full_waits),
		ArenaFullWaits:   uint64(c.arena_full_waits),
		ArenaInUse:       uint64(c.arena_in_use),
		ArenaHighWater:   uint64(c.arena_high_water),
		SharedSent:       uint64(c.shared_sent),
		AnswersDropped:   uint64(c.answers_dropped),
		Connections:      uint64(c.connections),
		AcceptErrors:     uint64(c.accept_errors),
		HandshakesFailed: uint64(c.handshakes_failed),
	}
	for i := range s.CallsFinished {
		s.CallsFinished[i] = uint64(c.calls_finished[i])
	}
	return s
}

// TransportStats returns the counters of the connection's shm:// connections: for a target
// over HTTP/2, of the shm:// connection it moved to (WithUpgrade), if it has; all zero
// otherwise, and once it is closed.
func (cc *ClientConn) TransportStats() TransportStats {
	var c C.isthmus_stats_t
	if !cc.use() {
		return TransportStats{}
	}
	defer cc.unuse()
	if C.isthmus_channel_stats(cc.ch, &c, C.size_t(unsafe.Sizeof(c))) != C.ISTHMUS_OK {
		return TransportStats{}
	}
	return transportStats(&c)
}

// TransportStats returns the counters of the server's shm:// connections and listeners, of
// every Start (all zero before Start and once it has stopped).
func (s *Server) TransportStats() TransportStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	var sum TransportStats
	// Under mu: the shutdown that frees srvs first sets them to nil under mu.
	for _, l := range s.srvs {
		var c C.isthmus_stats_t
		if C.isthmus_server_stats(l.c, &c, C.size_t(unsafe.Sizeof(c))) == C.ISTHMUS_OK {
			sum.add(transportStats(&c))
		}
	}
	return sum
}

// add adds o's counts to s (sums, but the larger high-water mark), as the library sums a
// server's connections.
func (s *TransportStats) add(o TransportStats) {
	s.CallsStarted += o.CallsStarted
	s.CallsInFlight += o.CallsInFlight
	for i := range s.CallsFinished {
		s.CallsFinished[i] += o.CallsFinished[i]
	}
	s.FramesSent += o.FramesSent
	s.FramesReceived += o.FramesReceived
	s.BytesSent += o.BytesSent
	s.BytesReceived += o.BytesReceived
	s.DoorbellsRung += o.DoorbellsRung
	s.Sleeps += o.Sleeps
	s.SpinHits += o.SpinHits
	s.RingFullWaits += o.RingFullWaits
	s.ArenaFullWaits += o.ArenaFullWaits
	s.ArenaInUse += o.ArenaInUse
	s.ArenaHighWater = max(s.ArenaHighWater, o.ArenaHighWater)
	s.SharedSent += o.SharedSent
	s.AnswersDropped += o.AnswersDropped
	s.Connections += o.Connections
	s.AcceptErrors += o.AcceptErrors
	s.HandshakesFailed += o.HandshakesFailed
}
