package isthmus_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
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
	ended := sleepingCall(t, pb.NewEchoClient(conn))
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
	endedByStop(t, ended)
	t.Logf("both stops returned within %v", time.Since(began))
}

// sleepingCall makes a call whose handler sleeps for a minute unless its call ends first, once
// a first call has gone through, and returns once it is in its handler (if not, it is
// refused): its error comes on the channel.
func sleepingCall(t *testing.T, client pb.EchoClient) chan error {
	t.Helper()
	if _, err := client.Unary(context.Background(), &pb.EchoRequest{}); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		_, err := client.Unary(context.Background(), &pb.EchoRequest{SleepMs: 60_000})
		ended <- err
	}()
	time.Sleep(200 * time.Millisecond)
	return ended
}

// endedByStop checks that the call of sleepingCall ended, Unavailable or Canceled, within 30 s.
func endedByStop(t *testing.T, ended chan error) {
	t.Helper()
	select {
	case err := <-ended:
		if c := status.Code(err); c != codes.Unavailable && c != codes.Canceled {
			t.Errorf("the call in progress ended with %v, want Unavailable or Canceled", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call in progress still runs 30 s after Stop")
	}
}

// A Stop that runs before Serve (a signal handler's, before `go s.Serve(...)` began) leaves
// nothing serving: Serve returns grpc.ErrServerStopped, as grpc-go's does. Before, it served
// with nothing left to stop it.
func TestServeAfterStopServesNothing(t *testing.T) {
	shm, unix := fresh(t, "stopfirst")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	s.Stop()
	if err := s.Serve(shm, unix); !errors.Is(err, grpc.ErrServerStopped) {
		t.Fatalf("Serve after Stop: %v", err)
	}
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "g.sock"))
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	g.Stop()
	if err := g.Serve(l); !errors.Is(err, grpc.ErrServerStopped) {
		t.Fatalf("grpc-go's own Serve after Stop: %v", err)
	}
	conn, err := isthmus.Dial(shm)
	if err == nil {
		defer conn.Close()
		ctx := testContext(t)
		if _, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{}); err == nil {
			t.Fatal("a call reached a server that was stopped before it served")
		}
	}
}

// waitingService's handlers wait for their call to end, telling started when they begin and
// ended when their context is done.
type waitingService struct {
	pb.UnimplementedEchoServer
	started, ended chan string
}

func (w waitingService) Unary(ctx context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	w.started <- "unary"
	<-ctx.Done()
	w.ended <- "unary"
	return nil, ctx.Err()
}

func (w waitingService) ServerStream(r *pb.StreamRequest, s grpc.ServerStreamingServer[pb.EchoReply]) error {
	w.started <- "stream"
	<-s.Context().Done()
	w.ended <- "stream"
	return s.Context().Err()
}

// Close ends the calls in progress at once with codes.Canceled "grpc: the client connection
// is closing", as grpc-go's does, and their handlers see them end: a unary call that nothing
// else could cancel (context.Background: the blocking path), one with a deadline, and a server
// stream waiting in Recv. Before, they ran on until the server ended them (a stream for ever).
func TestCloseEndsTheCallsInProgress(t *testing.T) {
	shm, unix := fresh(t, "close-calls")
	w := waitingService{started: make(chan string, 8), ended: make(chan string, 8)}
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, w)
	serving(t, s, shm, unix)
	for _, target := range []string{shm, unix} {
		conn, err := isthmus.Dial(target)
		if err != nil {
			t.Fatal(err)
		}
		client := pb.NewEchoClient(conn)
		deadline, cancel := context.WithTimeout(context.Background(), time.Minute)
		const calls = 5
		results := make(chan error, calls)
		go func() {
			_, err := client.Unary(context.Background(), &pb.EchoRequest{})
			results <- err
		}()
		// The raw tier's calls, waiting each way (they said Unavailable).
		for _, ctx := range []context.Context{context.Background(), deadline} {
			go func() {
				_, err := conn.CallRaw(ctx, pb.Echo_Unary_FullMethodName, nil)
				results <- err
			}()
		}
		go func() {
			_, err := client.Unary(deadline, &pb.EchoRequest{})
			results <- err
		}()
		stream, err := client.ServerStream(deadline, &pb.StreamRequest{Count: 1})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			_, err := stream.Recv()
			results <- err
		}()
		for range calls {
			within(t, w.started, "a handler to start")
		}
		conn.Close()
		for range calls {
			err := within(t, results, "a call to end after Close")
			if status.Code(err) != codes.Canceled || status.Convert(err).Message() != "grpc: the client connection is closing" {
				t.Errorf("%s: a call in progress at Close: %v", target, err)
			}
		}
		for range calls {
			within(t, w.ended, "a handler to see its call end")
		}
		cancel()
		if _, err := client.Unary(context.Background(), &pb.EchoRequest{}); status.Code(err) != codes.Canceled {
			t.Errorf("%s: a call after Close: %v", target, err)
		}
	}
}

// within is the next value from ch, failing the test if none comes in a minute (a generous
// bound: what it waits for takes milliseconds, and without the change under test, for ever).
func within[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		t.Fatalf("waited a minute for %s", what)
		var zero T
		return zero
	}
}

// A call waiting for a server (WaitForReady) when the connection closes ends Canceled
// "grpc: the client connection is closing", as grpc-go's does (it ended Unavailable, which
// retry policies take as a reason to retry). The sleep only makes it likely that the call is
// waiting by then; a Close before it starts must give the same.
func TestCloseEndsACallWaitingForAServer(t *testing.T) {
	shm, _ := fresh(t, "close-wfr")
	for _, ctx := range []context.Context{context.Background(), testContext(t)} {
		conn, err := isthmus.Dial(shm)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{}, grpc.WaitForReady(true))
			done <- err
		}()
		time.Sleep(100 * time.Millisecond)
		conn.Close()
		err = within(t, done, "the waiting call to end after Close")
		if status.Code(err) != codes.Canceled || status.Convert(err).Message() != "grpc: the client connection is closing" {
			t.Errorf("a call waiting for a server at Close: %v", err)
		}
	}
}

// grpc-go serves each listener given to a Serve of its own, a goroutine each, and stops them
// all at once: the same here, one Serve per set of targets. Before, the second Serve returned
// "the server was started already" at once, and its targets were never served.
func TestEachServeServesItsTargetsAndAStopEndsThemAll(t *testing.T) {
	shm, unix := fresh(t, "serves")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	t.Cleanup(s.Stop)
	served := make(chan error, 3)
	for _, targets := range [][]string{{shm}, {unix}, {"http://127.0.0.1:0"}} {
		go func() { served <- s.Serve(targets...) }()
	}
	ctx := testContext(t)
	// Each Serve's targets, as they come up: shm:// and the Unix socket by name, TCP by the
	// address the system chose (WaitForReady: a Serve may not have bound yet).
	call := func(target string) {
		t.Helper()
		conn := dial(t, target, isthmus.WithUpgrade(false))
		if _, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{}, grpc.WaitForReady(true)); err != nil {
			t.Fatalf("%s: %v", target, err)
		}
	}
	call(shm)
	call(unix)
	var tcp string
	for tcp == "" {
		for _, a := range s.HTTPAddresses() {
			if strings.HasPrefix(a, "http://") {
				tcp = a
			}
		}
		select {
		case err := <-served:
			t.Fatalf("a Serve returned while the others serve: %v", err)
		case <-ctx.Done():
			t.Fatal("the TCP target never came up")
		case <-time.After(10 * time.Millisecond):
		}
	}
	call(tcp)
	if got := s.HTTPAddresses(); len(got) != 2 {
		t.Fatalf("HTTPAddresses %q, want the Unix socket's and the TCP port's", got)
	}
	// Every Serve's counts: HTTP/2 calls reach Go handlers through their server's shm://
	// loopback, so each of the three calls counts once.
	if n := s.TransportStats().CallsStarted; n != 3 {
		t.Fatalf("TransportStats counted %d calls, want 3", n)
	}
	s.GracefulStop()
	for range 3 {
		select {
		case err := <-served:
			if err != nil {
				t.Fatalf("Serve returned %v after GracefulStop, want nil", err)
			}
		case <-ctx.Done():
			t.Fatal("a Serve has not returned after GracefulStop")
		}
	}
	if err := s.Start(shm); !errors.Is(err, grpc.ErrServerStopped) {
		t.Fatalf("Start after GracefulStop: %v", err)
	}
	conn := dial(t, shm)
	if _, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{}); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call after the stop: %v, want Unavailable", err)
	}
}

// A service registered twice is a mistake grpc-go stops the process for (log.Fatalf); here it
// panics with grpc-go's words. Before, the second registration replaced the first silently.
func TestAServiceRegisteredTwicePanics(t *testing.T) {
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	defer func() {
		want := `isthmus: Server.RegisterService found duplicate service registration for "conformance.Echo"`
		if got := recover(); got != want {
			t.Fatalf("the second registration panicked with %v, want %q", got, want)
		}
	}()
	pb.RegisterEchoServer(s, &echo.Service{})
}

// deafEcho's Unary tells started when it runs, then waits for its context's end and for
// release, ignoring the end as a handler that commits what it began does.
type deafEcho struct {
	pb.UnimplementedEchoServer
	started, release chan struct{}
	finished         *atomic.Bool
}

func (d deafEcho) Unary(ctx context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	d.started <- struct{}{}
	<-ctx.Done()
	<-d.release
	d.finished.Store(true)
	return &pb.EchoReply{}, nil
}

// GracefulStop returns once the handlers have returned, as grpc-go's does, not only once the
// calls have ended: a handler whose client cancelled its call ran on past GracefulStop (and
// past a main that returned after it).
func TestGracefulStopWaitsForHandlersWhoseCallsEnded(t *testing.T) {
	shm, _ := fresh(t, "graceful-handlers")
	s := isthmus.NewServer()
	d := deafEcho{started: make(chan struct{}, 1), release: make(chan struct{}), finished: new(atomic.Bool)}
	pb.RegisterEchoServer(s, d)
	if err := s.Start(shm); err != nil {
		t.Fatal(err)
	}
	client := pb.NewEchoClient(dial(t, shm))
	ctx, cancel := context.WithCancel(context.Background())
	called := make(chan error, 1)
	go func() {
		_, err := client.Unary(ctx, &pb.EchoRequest{})
		called <- err
	}()
	select {
	case <-d.started:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler did not start")
	}
	cancel()
	if err := <-called; status.Code(err) != codes.Canceled {
		t.Fatalf("the cancelled call: %v", err)
	}
	stopped := make(chan bool, 1)
	go func() {
		s.GracefulStop()
		stopped <- d.finished.Load()
	}()
	select {
	case <-stopped:
		t.Fatal("GracefulStop returned while the handler still ran")
	case <-time.After(500 * time.Millisecond):
	}
	close(d.release)
	select {
	case finished := <-stopped:
		if !finished {
			t.Error("GracefulStop returned before the handler did")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("GracefulStop has not returned 30 s after the handler could")
	}
}

// A Go health service (grpc-go's health.Server) answers health checks over every transport:
// over HTTP/2 the library's own answered first, SERVING while the Go one said NOT_SERVING.
func TestAGoHealthServiceAnswersOverEveryTransport(t *testing.T) {
	shm, unix := fresh(t, "health")
	s := isthmus.NewServer()
	h := health.NewServer()
	healthpb.RegisterHealthServer(s, h)
	h.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	serving(t, s, shm, unix)
	for _, target := range append([]string{shm}, s.HTTPAddresses()...) {
		got, err := healthpb.NewHealthClient(dial(t, target)).Check(testContext(t), &healthpb.HealthCheckRequest{})
		if err != nil || got.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Errorf("%s: %v, %v", target, got, err)
		}
	}
}

// Stop ends a call whose InlineUnary handler waits for its context: the handler runs on the
// thread that reads its connection, and that thread's cancel must still reach it.
func TestStopEndsAnInlineHandlerWaitingForItsContext(t *testing.T) {
	shm, _ := fresh(t, "stop-inline")
	s := isthmus.NewServer(isthmus.InlineUnary())
	pb.RegisterEchoServer(s, &echo.Service{})
	if err := s.Start(shm); err != nil {
		t.Fatal(err)
	}
	ended := sleepingCall(t, pb.NewEchoClient(dial(t, shm)))
	stopped := make(chan struct{})
	go func() {
		s.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("Stop has not returned 30 s after it began")
	}
	endedByStop(t, ended)
}
