package isthmus_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// eventually polls cond every 10 ms for up to 30 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("not within 30 s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A client's counters count its calls by their code and its bytes, against a server in another
// process.
func TestAClientsTransportStatsCountItsCallsByCodeAndItsBytes(t *testing.T) {
	shm, _ := fresh(t, "counters")
	startPeer(t, goPeerBin, shm)
	conn := dial(t, shm)
	client := pb.NewEchoClient(conn)
	ctx := context.Background()
	payload := []byte(strings.Repeat("x", 1000))
	before := conn.TransportStats()
	for i := 0; i < 3; i++ {
		if _, err := client.Unary(ctx, &pb.EchoRequest{Payload: payload}); err != nil {
			t.Fatal(err)
		}
	}
	_, err := client.Unary(ctx, &pb.EchoRequest{FailWith: int32(codes.NotFound), FailMessage: "none"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("the failing call gave %v", err)
	}
	after := conn.TransportStats()
	if n := after.CallsStarted - before.CallsStarted; n != 4 {
		t.Errorf("%d calls started, want 4", n)
	}
	if ok, nf := after.Finished(codes.OK)-before.Finished(codes.OK), after.Finished(codes.NotFound)-before.Finished(codes.NotFound); ok != 3 || nf != 1 {
		t.Errorf("finished %d OK and %d NOT_FOUND, want 3 and 1", ok, nf)
	}
	if after.BytesSent-before.BytesSent < 3000 || after.BytesReceived-before.BytesReceived < 3000 {
		t.Errorf("bytes sent %d, received %d: want 3,000 or more each way", after.BytesSent-before.BytesSent, after.BytesReceived-before.BytesReceived)
	}
	if after.CallsInFlight != 0 || after.Connections != 0 {
		t.Errorf("in flight %d, connections %d: want 0 and 0", after.CallsInFlight, after.Connections)
	}
	if got := after.Finished(codes.Code(99)); got != 0 {
		t.Errorf("Finished(99) = %d", got)
	}
	conn.Close()
	if s := conn.TransportStats(); s.CallsStarted != 0 {
		t.Errorf("a closed connection's counters: %+v", s)
	}
}

func TestAServerCountsItsConnectionsCallsAndFailedHandshakes(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	target := "shm://" + sock
	s := isthmus.NewServer()
	if got := s.TransportStats(); got != (isthmus.TransportStats{}) {
		t.Errorf("a server not started: %+v", got)
	}
	pb.RegisterEchoServer(s, &echo.Service{})
	if err := s.Start(target); err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	conn := dial(t, target)
	client := pb.NewEchoClient(conn)
	for i := 0; i < 5; i++ {
		if _, err := client.Unary(context.Background(), &pb.EchoRequest{Payload: []byte("hello")}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "5 calls counted OK", func() bool { return s.TransportStats().Finished(codes.OK) >= 5 })
	got := s.TransportStats()
	if got.Connections < 1 || got.CallsStarted < 5 || got.BytesReceived < 25 || got.HandshakesFailed != 0 {
		t.Errorf("after 5 calls: %+v", got)
	}

	// A client that speaks no isthmus: its handshake fails, and the server serves on.
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\n\r\nnot a handshake, and more than one hello's worth of bytes")); err != nil {
		t.Fatal(err)
	}
	c.Close()
	eventually(t, "the failed handshake counted", func() bool { return s.TransportStats().HandshakesFailed == 1 })
	if _, err := client.Unary(context.Background(), &pb.EchoRequest{}); err != nil {
		t.Fatalf("after a failed handshake: %v", err)
	}
	if got := s.TransportStats().AcceptErrors; got != 0 {
		t.Errorf("%d accept errors", got)
	}
	s.Stop()
	if got := s.TransportStats(); got != (isthmus.TransportStats{}) {
		t.Errorf("a stopped server: %+v", got)
	}
}
