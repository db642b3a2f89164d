package isthmus_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// Stop during a GracefulStop ends the calls still in progress now, as grpc-go's does, instead of
// waiting with them for the graceful one (an hour).
func TestStopCutsAGracefulStopShort(t *testing.T) {
	shm, _ := fresh(t, "stop")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	if err := s.Start(shm); err != nil {
		t.Fatal(err)
	}
	conn, err := isthmus.Dial(shm)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := pb.NewEchoClient(conn)
	if _, err := client.Unary(context.Background(), &pb.EchoRequest{}); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		// Its handler sleeps for a minute, unless its call ends first.
		_, err := client.Unary(context.Background(), &pb.EchoRequest{SleepMs: 60_000})
		ended <- err
	}()
	time.Sleep(200 * time.Millisecond) // the call is in its handler by now (if not, it is refused)

	graceful := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(graceful)
	}()
	time.Sleep(100 * time.Millisecond) // the graceful stop is under way (if not, Stop goes first)
	began := time.Now()
	stopped := make(chan struct{})
	go func() {
		s.Stop()
		close(stopped)
	}()
	for what, done := range map[string]chan struct{}{"Stop": stopped, "GracefulStop": graceful} {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s has not returned 30 s after Stop began", what)
		}
	}
	select {
	case err := <-ended:
		if c := status.Code(err); c != codes.Unavailable && c != codes.Canceled {
			t.Errorf("the call in progress ended with %v, want Unavailable or Canceled", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call in progress still runs 30 s after Stop")
	}
	t.Logf("both stops returned within %v", time.Since(began))
}
