package isthmus_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// peerSet records the address each call came from: over TCP, one port per connection.
type peerSet struct {
	mu    sync.Mutex
	addrs map[string]bool
}

func (p *peerSet) interceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if pr, ok := grpcpeer.FromContext(ctx); ok {
		p.mu.Lock()
		p.addrs[pr.Addr.String()] = true
		p.mu.Unlock()
	}
	return h(ctx, req)
}

func (p *peerSet) take() map[string]bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	got := p.addrs
	p.addrs = map[string]bool{}
	return got
}

// With MaxConnectionAge, an isthmus server sends an HTTP/2 connection that old a GOAWAY, and
// its client, grpc-go's or isthmus's, moves its next calls to a new connection without one
// failing, even those that start as their connection closes (at 50 ms, many do). Without it
// (the control), every call comes on one connection.
func TestMaxConnectionAgeMovesCallsToANewConnection(t *testing.T) {
	for _, age := range []time.Duration{50 * time.Millisecond, 0} {
		peers := &peerSet{addrs: map[string]bool{}}
		s := isthmus.NewServer(isthmus.KeepaliveParams(keepalive.ServerParameters{MaxConnectionAge: age}),
			isthmus.UnaryInterceptor(peers.interceptor))
		pb.RegisterEchoServer(s, &echo.Service{})
		shm, _ := fresh(t, "age")
		serving(t, s, shm, "http://127.0.0.1:0")
		addr := s.HTTPAddresses()[0]

		plain, err := grpc.NewClient(addr[len("http://"):], grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		ours, err := isthmus.Dial(addr, isthmus.WithUpgrade(false))
		if err != nil {
			t.Fatal(err)
		}
		defer ours.Close()
		for _, c := range []struct {
			name string
			conn grpc.ClientConnInterface
		}{{"grpc-go", plain}, {"isthmus", ours}} {
			client := pb.NewEchoClient(c.conn)
			end := time.Now().Add(1500 * time.Millisecond)
			for n := 0; time.Now().Before(end); n++ {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_, err := client.Unary(ctx, &pb.EchoRequest{Payload: []byte("x")})
				cancel()
				if err != nil {
					t.Fatalf("age %v, %s client: call %d: %v", age, c.name, n, err)
				}
				time.Sleep(5 * time.Millisecond)
			}
			got := peers.take()
			switch {
			case age > 0 && len(got) < 2:
				t.Errorf("age %v, %s client: every call came on one connection: %v", age, c.name, got)
			case age == 0 && len(got) != 1:
				t.Errorf("no age limit, %s client: calls came on %d connections: %v", c.name, len(got), got)
			}
		}
	}
}

// MaxConnectionAgeGrace ends a call still running on an aged connection: the client sees
// codes.Unavailable, and the handler's context ends instead of it sleeping out its minute.
func TestMaxConnectionAgeGraceCutsOffACallInProgress(t *testing.T) {
	cancelled := make(chan error, 1)
	kp := keepalive.ServerParameters{MaxConnectionAge: 200 * time.Millisecond, MaxConnectionAgeGrace: 300 * time.Millisecond}
	s := isthmus.NewServer(isthmus.KeepaliveParams(kp),
		isthmus.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			reply, err := h(ctx, req)
			cancelled <- ctx.Err()
			return reply, err
		}))
	pb.RegisterEchoServer(s, &echo.Service{})
	shm, _ := fresh(t, "grace")
	serving(t, s, shm, "http://127.0.0.1:0")

	conn, err := grpc.NewClient(s.HTTPAddresses()[0][len("http://"):], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err = pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{SleepMs: 60_000})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a call cut off by the grace: %v", err)
	}
	select {
	case err := <-cancelled:
		if err == nil {
			t.Fatal("the handler ended with its context still live")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the handler still runs 30 s after its call was cut off")
	}
}
