package isthmus_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// With WithKeepaliveParams, a call on an HTTP/2 connection that goes silent fails with
// codes.Unavailable long before its deadline, and the next call goes through a new connection;
// without it the call waits for its deadline. The server is plain grpc-go's, behind the proxy.
func TestKeepaliveEndsACallOnAConnectionGoneSilent(t *testing.T) {
	inHandler := make(chan struct{}, 8)
	gs := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		inHandler <- struct{}{}
		return h(ctx, req)
	}))
	pb.RegisterEchoServer(gs, &echo.Service{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(ln)
	defer gs.Stop()
	proxy := newCountingProxy(t, ln.Addr().String())

	kp := keepalive.ClientParameters{Time: 200 * time.Millisecond, Timeout: 500 * time.Millisecond}
	conn, err := isthmus.Dial("http://"+proxy.l.Addr().String(), isthmus.WithUpgrade(false), isthmus.WithKeepaliveParams(kp))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := pb.NewEchoClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := client.Unary(ctx, &pb.EchoRequest{Payload: []byte("before")}); err != nil {
		t.Fatal(err)
	}
	<-inHandler

	ended := make(chan error, 1)
	go func() {
		// Its handler sleeps for a minute: only keepalive ends it before the deadline.
		_, err := client.Unary(ctx, &pb.EchoRequest{SleepMs: 60_000})
		ended <- err
	}()
	<-inHandler
	proxy.frozen.Store(true)
	select {
	case err := <-ended:
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "keep-alive") {
			t.Fatalf("the call on the silent connection ended with %v; want Unavailable, saying keep-alive", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call on the silent connection is still waiting after 30 s")
	}

	proxy.frozen.Store(false)
	reply, err := client.Unary(ctx, &pb.EchoRequest{Payload: []byte("after")})
	if err != nil || string(reply.GetPayload()) != "after" {
		t.Fatalf("the call after the silence: %v, %v", reply, err)
	}
}

// With KeepaliveParams, an isthmus server PINGs a quiet HTTP/2 client, and when the PING goes
// unanswered it closes the connection and cancels the client's calls: the handler's context
// ends instead of the handler waiting out its sleep. The client is plain grpc-go's, with no
// keepalive of its own, behind a proxy that goes silent.
func TestServerKeepaliveCancelsTheCallsOfAClientGoneSilent(t *testing.T) {
	entered, cancelled := make(chan struct{}, 1), make(chan error, 1)
	kp := keepalive.ServerParameters{Time: 200 * time.Millisecond, Timeout: 500 * time.Millisecond}
	s := isthmus.NewServer(isthmus.KeepaliveParams(kp),
		isthmus.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			entered <- struct{}{}
			reply, err := h(ctx, req)
			cancelled <- ctx.Err()
			return reply, err
		}))
	pb.RegisterEchoServer(s, &echo.Service{})
	shm, _ := fresh(t, "keepalive")
	serving(t, s, shm, "http://127.0.0.1:0")
	proxy := newCountingProxy(t, strings.TrimPrefix(s.HTTPAddresses()[0], "http://"))

	conn, err := grpc.NewClient(proxy.l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	go pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{SleepMs: 60_000}) //nolint:errcheck // its end is the handler's
	<-entered
	proxy.frozen.Store(true)
	select {
	case err := <-cancelled:
		if err == nil {
			t.Fatal("the handler ended with its context still live")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler of the silent client's call still runs after 30 s")
	}
}

// With WithConnectParams, a call to a server that accepts and never says a word (a listener
// nobody accepts on: the kernel completes the connect) fails with codes.Unavailable after
// MinConnectTimeout, not at its deadline a minute away.
func TestAServerThatNeverAnswersFailsTheCallAfterMinConnectTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	params := grpc.ConnectParams{MinConnectTimeout: 300 * time.Millisecond}
	conn, err := isthmus.Dial("http://"+ln.Addr().String(), isthmus.WithUpgrade(false), isthmus.WithConnectParams(params))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	began := time.Now()
	_, err = pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{Payload: []byte("x")})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "connect timeout") {
		t.Fatalf("got %v, want Unavailable naming the connect timeout", err)
	}
	// Well before the deadline, and before the 20 s default.
	if took := time.Since(began); took > 10*time.Second {
		t.Fatalf("failed after %v", took)
	}
}
