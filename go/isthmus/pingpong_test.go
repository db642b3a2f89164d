package isthmus_test

import (
	"context"
	"fmt"
	"testing"

	pb "example.invalid/isthmus/go/internal/conformancepb"
)

// A bidi stream alone on its connection, one message each way at a time: the client's receives
// read the connection themselves (ADR 0029), so its reader never waits on the doorbell for
// them. With the reader doing the reading, as before, it waited about once per message, and
// a message each way cost 25-55 µs instead of 5-8.
func TestAPingPongStreamReadsItsOwnMessages(t *testing.T) {
	shm, _ := fresh(t, "pingpong-own")
	startPeer(t, goPeerBin, shm)
	conn := dial(t, shm)
	s, err := pb.NewEchoClient(conn).Bidi(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	exchange := func(i int) {
		payload := []byte(fmt.Sprintf("message %d", i))
		if err := s.Send(&pb.EchoRequest{Seq: uint64(i), Payload: payload}); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		r, err := s.Recv()
		if err != nil {
			t.Fatalf("recv %d: %v", i, err)
		}
		if r.Seq != uint64(i) || string(r.Payload) != string(payload) {
			t.Fatalf("message %d came back as %d %q", i, r.Seq, r.Payload)
		}
	}
	exchange(0)
	waits := func() uint64 { st := conn.TransportStats(); return st.SpinHits + st.Sleeps }
	before := waits()
	const n = 2000
	for i := 1; i <= n; i++ {
		exchange(i)
	}
	// A thread that loses its core for over a millisecond lets the reader take the connection
	// back (and wait once): far from once per message all the same.
	if w := waits() - before; w >= n/4 {
		t.Errorf("the client's reader waited on the doorbell %d times in %d round trips", w, n)
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err == nil {
		t.Fatal("the stream did not end after the half-close")
	}
}
