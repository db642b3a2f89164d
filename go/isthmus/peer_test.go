package isthmus_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// peerService is the conformance suite's Echo service that also keeps what
// peer.FromContext gave its last Unary and ServerStream calls, for the test to look at.
type peerService struct {
	echo.Service
	mu   sync.Mutex
	last *grpcpeer.Peer
}

func (s *peerService) keep(ctx context.Context) error {
	p, ok := grpcpeer.FromContext(ctx)
	if !ok {
		return status.Error(codes.Internal, "no peer in the handler's context")
	}
	s.mu.Lock()
	s.last = p
	s.mu.Unlock()
	return nil
}

func (s *peerService) Unary(ctx context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	if err := s.keep(ctx); err != nil {
		return nil, err
	}
	return s.Service.Unary(ctx, req)
}

func (s *peerService) ServerStream(req *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	if err := s.keep(stream.Context()); err != nil {
		return err
	}
	return s.Service.ServerStream(req, stream)
}

// peerOfCalls makes a unary and a server-streaming call on conn and returns the peer the
// handler saw for each (of the server behind conn, whose service is svc).
func peerOfCalls(t *testing.T, label string, conn grpc.ClientConnInterface, svc *peerService) []*grpcpeer.Peer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := pb.NewEchoClient(conn)
	take := func() *grpcpeer.Peer {
		svc.mu.Lock()
		defer svc.mu.Unlock()
		p := svc.last
		svc.last = nil
		return p
	}
	var out []*grpcpeer.Peer
	if _, err := c.Unary(ctx, &pb.EchoRequest{}); err != nil {
		t.Fatalf("%s: Unary: %v", label, err)
	}
	out = append(out, take())
	st, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 1})
	if err == nil {
		_, err = st.Recv()
	}
	if err != nil {
		t.Fatalf("%s: ServerStream: %v", label, err)
	}
	out = append(out, take())
	return out
}

// startPeerServer serves a peerService on targets from this process until the test ends.
func startPeerServer(t *testing.T, targets []string, opts ...isthmus.ServerOption) (*isthmus.Server, *peerService) {
	t.Helper()
	svc := &peerService{}
	s := isthmus.NewServer(opts...)
	pb.RegisterEchoServer(s, svc)
	if err := s.Start(targets...); err != nil {
		t.Fatalf("start %v: %v", targets, err)
	}
	t.Cleanup(s.Stop)
	return s, svc
}

// A handler's peer.FromContext names its client as grpc-go's does: over shm:// the client's
// process (an *isthmus.ShmAddr), over unix:// a *net.UnixAddr, over TCP a *net.TCPAddr; with
// no AuthInfo, since none of these is TLS. Inline unary handlers see the same.
func TestPeerFromContextNamesTheClientOnEveryTransport(t *testing.T) {
	for _, inline := range []bool{false, true} {
		var opts []isthmus.ServerOption
		if inline {
			opts = append(opts, isthmus.InlineUnary())
		}
		shm, unix := fresh(t, fmt.Sprintf("peer%v", inline))
		_, svc := startPeerServer(t, []string{shm}, opts...)
		for i, p := range peerOfCalls(t, shm, dial(t, shm), svc) {
			label := fmt.Sprintf("inline=%v %s call %d", inline, shm, i)
			a, ok := p.Addr.(*isthmus.ShmAddr)
			if !ok {
				t.Fatalf("%s: Addr is %T %v, want *isthmus.ShmAddr", label, p.Addr, p.Addr)
			}
			want := fmt.Sprintf("shm:pid=%d,uid=%d", os.Getpid(), os.Getuid())
			if a.PID != os.Getpid() || int(a.UID) != os.Getuid() || a.Network() != "shm" || a.String() != want {
				t.Errorf("%s: Addr %+v (%s %s), want %s", label, a, a.Network(), a, want)
			}
			if p.AuthInfo != nil {
				t.Errorf("%s: AuthInfo %v over shm://", label, p.AuthInfo)
			}
		}

		// A server of its own, with no shm:// endpoint to move its HTTP/2 clients to.
		targets := []string{unix, "http://127.0.0.1:0"}
		if l, err := net.Listen("tcp6", "[::1]:0"); err == nil {
			l.Close()
			targets = append(targets, "http://[::1]:0")
		}
		s, svc := startPeerServer(t, targets, opts...)
		for _, address := range s.HTTPAddresses() {
			for i, p := range peerOfCalls(t, address, dial(t, address), svc) {
				label := fmt.Sprintf("inline=%v %s call %d", inline, address, i)
				if p.AuthInfo != nil {
					t.Errorf("%s: AuthInfo %v without TLS", label, p.AuthInfo)
				}
				switch a := p.Addr.(type) {
				case *net.UnixAddr:
					if !strings.HasPrefix(address, "unix:") || a.Network() != "unix" {
						t.Errorf("%s: Addr %s %v", label, a.Network(), a)
					}
				case *net.TCPAddr:
					if !a.IP.IsLoopback() || a.Port == 0 || strings.Contains(address, "[::1]") != (a.IP.To4() == nil) {
						t.Errorf("%s: Addr %v", label, a)
					}
				default:
					t.Errorf("%s: Addr is %T %v", label, p.Addr, p.Addr)
				}
			}
		}
	}
}

// agentService's Unary answers with the user-agent values in its handler's incoming metadata.
type agentService struct{ echo.Service }

func (agentService) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	return &pb.EchoReply{Payload: []byte(strings.Join(md.Get("user-agent"), "|"))}, nil
}

type authorityService struct{ echo.Service }

func (authorityService) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	return &pb.EchoReply{Payload: []byte(strings.Join(md.Get(":authority"), "|"))}, nil
}

// WithAuthority is the :authority an isthmus client's calls send, as grpc.WithAuthority is a
// grpc-go client's, read by a grpc-go server (which puts it in a handler's metadata); without
// it both send the target's. One that is no HOST[:PORT] fails Dial with InvalidArgument.
func TestWithAuthorityIsTheAuthorityCallsSendAsGrpcGos(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := startGrpcServing(t, authorityService{})
	seen := func(conn grpc.ClientConnInterface) string {
		reply, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return string(reply.Payload)
	}
	for _, given := range []string{"", "routed.example:8443"} {
		// Per-RPC credentials are told the authority in their uri, by both.
		theirCreds, ourCreds := &tokenCreds{}, &tokenCreds{}
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithPerRPCCredentials(theirCreds)}
		if given != "" {
			opts = append(opts, grpc.WithAuthority(given))
		}
		plain, err := grpc.NewClient(target, opts...)
		if err != nil {
			t.Fatal(err)
		}
		want := seen(plain)
		plain.Close()
		ours := dial(t, target, isthmus.WithAuthority(given), isthmus.WithPerRPCCredentials(ourCreds))
		if got := seen(ours); got != want {
			t.Errorf("authority %q: isthmus sent %q, grpc-go %q", given, got, want)
		}
		if given != "" && want != given {
			t.Errorf("grpc-go sent %q for %q", want, given)
		}
		theirURIs, _ := theirCreds.asked()
		ourURIs, _ := ourCreds.asked()
		if fmt.Sprint(ourURIs) != fmt.Sprint(theirURIs) || len(theirURIs) != 1 {
			t.Errorf("authority %q: credentials told %v, grpc-go's %v", given, ourURIs, theirURIs)
		}
	}
	_, err := isthmus.Dial(target, isthmus.WithAuthority("a b"))
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a bad authority: %v", err)
	}
	// A TLS server name that differs from the authority is refused, as grpc-go refuses it.
	_, err = isthmus.Dial(target, isthmus.WithAuthority("a.example"), isthmus.WithTLS(isthmus.TLSConfig{ServerName: "b.example"}))
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a TLS server name other than the authority: %v", err)
	}
}

// A handler's incoming metadata holds its caller's user-agent, as on grpc-go's server
// (goroutine and inline handlers alike): a grpc-go client's, never one a client claims through
// isthmus's own forwarding header, and an isthmus client's WithUserAgent, over HTTP/2 (tonic's
// agent after it) and over shm:// (alone; none without it).
func TestAHandlerSeesItsCallersUserAgentAsGrpcGos(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A claim in the metadata: an HTTP/2 client's own agent replaces it; over shm:// it is how
	// an agent travels, and the channel's own comes after it.
	claimed := metadata.AppendToOutgoingContext(ctx, "x-isthmus-peer-agent", "claimed/1.0")
	agentOf := func(label string, conn grpc.ClientConnInterface) string {
		reply, err := pb.NewEchoClient(conn).Unary(claimed, &pb.EchoRequest{})
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		return string(reply.Payload)
	}
	plain := func(address string) *grpc.ClientConn {
		conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithUserAgent("agent-test/7.0"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	theirs := grpc.NewServer()
	pb.RegisterEchoServer(theirs, agentService{})
	go theirs.Serve(l)
	defer theirs.Stop()
	want := agentOf("grpc-go's server", plain(l.Addr().String()))
	if !strings.HasPrefix(want, "agent-test/7.0 grpc-go/") {
		t.Fatalf("grpc-go's server saw user-agent %q", want)
	}

	for _, inline := range []bool{false, true} {
		var opts []isthmus.ServerOption
		if inline {
			opts = append(opts, isthmus.InlineUnary())
		}
		shm, _ := fresh(t, fmt.Sprintf("agent%v", inline))
		s := isthmus.NewServer(opts...)
		pb.RegisterEchoServer(s, agentService{})
		if err := s.Start(shm, "http://127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		label := fmt.Sprintf("inline=%v", inline)
		if got := agentOf(label, plain(grpcTarget(s.HTTPAddresses()[0]))); got != want {
			t.Errorf("%s over HTTP/2: user-agent %q, grpc-go's server saw %q", label, got, want)
		}
		if got := agentOf(label, dial(t, shm)); got != "claimed/1.0" {
			t.Errorf("%s over shm://: user-agent %q, want the one in the metadata", label, got)
		}
		reply, err := pb.NewEchoClient(dial(t, shm)).Unary(ctx, &pb.EchoRequest{})
		if err != nil || len(reply.Payload) != 0 {
			t.Errorf("%s over shm:// with no agent: %v, user-agent %q", label, err, reply.GetPayload())
		}
		if got := agentOf(label, dial(t, shm, isthmus.WithUserAgent("go-test/1.0"))); got != "go-test/1.0" {
			t.Errorf("%s over shm:// with WithUserAgent: user-agent %q", label, got)
		}
		named := dial(t, s.HTTPAddresses()[0], isthmus.WithUserAgent("go-test/2.0"), isthmus.WithUpgrade(false))
		if got := agentOf(label, named); !strings.HasPrefix(got, "go-test/2.0 tonic/") {
			t.Errorf("%s over HTTP/2 with WithUserAgent: user-agent %q", label, got)
		}
	}
	for _, bad := range []string{"caf\u00e9", "a\nb", "a\x00b"} {
		if _, err := isthmus.Dial("shm://agent-refused", isthmus.WithUserAgent(bad)); status.Code(err) != codes.InvalidArgument {
			t.Errorf("WithUserAgent(%q): %v, want InvalidArgument", bad, err)
		}
	}
}

// Over shm:// the peer is the client's process, not the server's: a client in a process of
// its own (this test binary again, running TestPeerClientProcess) is named by its pid.
func TestPeerOverShmIsTheClientProcess(t *testing.T) {
	shm, _ := fresh(t, "peer-process")
	_, svc := startPeerServer(t, []string{shm})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestPeerClientProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "ISTHMUS_PEER_CLIENT="+shm)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the client process: %v\n%s", err, out)
	}
	svc.mu.Lock()
	p := svc.last
	svc.mu.Unlock()
	if p == nil {
		t.Fatal("the client process made no call")
	}
	if a, ok := p.Addr.(*isthmus.ShmAddr); !ok || a.PID != cmd.Process.Pid || a.PID == os.Getpid() {
		t.Fatalf("Addr %T %v, want the client's pid %d", p.Addr, p.Addr, cmd.Process.Pid)
	}
}

// TestPeerClientProcess is the client of TestPeerOverShmIsTheClientProcess, run in a process
// of its own: one call to the target ISTHMUS_PEER_CLIENT names.
func TestPeerClientProcess(t *testing.T) {
	target := os.Getenv("ISTHMUS_PEER_CLIENT")
	if target == "" {
		t.Skip("the client process of TestPeerOverShmIsTheClientProcess")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := pb.NewEchoClient(dial(t, target)).Unary(ctx, &pb.EchoRequest{}); err != nil {
		t.Fatal(err)
	}
}
