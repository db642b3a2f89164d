package isthmus_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	_ "google.golang.org/grpc/encoding/gzip" // clients then read gzip, servers send it
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// compressible is a large reply that gzip makes a few hundred bytes of.
var compressible = bytes.Repeat([]byte("a compressible reply "), 12_000)

// choosingService answers every call with compressible, compressed as the request's metadata
// `want` asks through isthmus.SetSendCompressor: "gzip", "identity", or "late" (gzip asked
// for after the initial metadata went, which must fail).
type choosingService struct{ pb.UnimplementedEchoServer }

func choose(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	want := md.Get("want")
	if len(want) == 0 {
		return nil
	}
	if want[0] == "late" {
		if err := grpc.SendHeader(ctx, metadata.Pairs("x-sent", "1")); err != nil {
			return err
		}
		if isthmus.SetSendCompressor(ctx, "gzip") == nil {
			return status.Error(codes.Internal, "SetSendCompressor was taken after the initial metadata")
		}
		return nil
	}
	if err := isthmus.SetSendCompressor(ctx, want[0]); err != nil {
		return status.Errorf(codes.FailedPrecondition, "SetSendCompressor(%q): %v", want[0], err)
	}
	return nil
}

func (choosingService) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	if err := choose(ctx); err != nil {
		return nil, err
	}
	return &pb.EchoReply{Payload: compressible}, nil
}

func (choosingService) Bidi(stream grpc.BidiStreamingServer[pb.EchoRequest, pb.EchoReply]) error {
	if err := choose(stream.Context()); err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
		if err := stream.Send(&pb.EchoReply{Payload: compressible}); err != nil {
			return err
		}
	}
}

// countingProxy passes TCP connections on to upstream and counts the bytes the server sends.
// Frozen, it drops what either side sends and keeps every socket open, so to both ends the
// connection is up and the other side silent, as a dropped network flow makes it.
type countingProxy struct {
	l      net.Listener
	sent   atomic.Int64
	frozen atomic.Bool
	wg     sync.WaitGroup
	mu     sync.Mutex
	open   []net.Conn
}

func newCountingProxy(t *testing.T, upstream string) *countingProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &countingProxy{l: l}
	p.wg.Add(1)
	go p.accept(upstream)
	t.Cleanup(p.close)
	return p
}

func (p *countingProxy) accept(upstream string) {
	defer p.wg.Done()
	for {
		client, err := p.l.Accept()
		if err != nil {
			return // closed
		}
		server, err := net.Dial("tcp", upstream)
		if err != nil {
			client.Close()
			continue
		}
		p.mu.Lock()
		p.open = append(p.open, client, server)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pump(server, client, false)
		go p.pump(client, server, true)
	}
}

// pump copies from src to dst; counted bytes are counted before they are passed on, so the
// client never has a byte not counted yet.
func (p *countingProxy) pump(dst, src net.Conn, counted bool) {
	defer p.wg.Done()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.frozen.Load() {
			if counted {
				p.sent.Add(int64(n))
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if tcp, ok := dst.(*net.TCPConn); ok {
				tcp.CloseWrite()
			}
			return
		}
	}
}

func (p *countingProxy) close() {
	p.l.Close()
	p.mu.Lock()
	for _, c := range p.open {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// A handler's SetSendCompressor compresses its own replies over HTTP/2, unary and streamed,
// on isthmus's server as grpc.SetSendCompressor does on grpc-go's (the same service runs on
// both), and fails once the initial metadata went; what the server sends is counted by a
// proxy between a grpc-go client and the server.
func TestAHandlerChoosesTheCompressionOfItsReplies(t *testing.T) {
	servers := map[string]func(t *testing.T) string{
		"grpc-go": func(t *testing.T) string {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			s := grpc.NewServer()
			pb.RegisterEchoServer(s, choosingService{})
			go s.Serve(l)
			t.Cleanup(s.Stop)
			return l.Addr().String()
		},
		"isthmus": func(t *testing.T) string {
			s := isthmus.NewServer()
			pb.RegisterEchoServer(s, choosingService{})
			if err := s.Start("http://127.0.0.1:0"); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Stop)
			return grpcTarget(s.HTTPAddresses()[0])
		},
	}
	for name, start := range servers {
		t.Run(name, func(t *testing.T) {
			proxy := newCountingProxy(t, start(t))
			for _, want := range []string{"", "gzip", "identity", "late"} {
				conn, err := grpc.NewClient(proxy.l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				if want != "" {
					ctx = metadata.AppendToOutgoingContext(ctx, "want", want)
				}
				client := pb.NewEchoClient(conn)
				before := proxy.sent.Load()
				reply, err := client.Unary(ctx, &pb.EchoRequest{})
				if err != nil || !bytes.Equal(reply.GetPayload(), compressible) {
					t.Fatalf("want %q: unary: %v", want, err)
				}
				unary := proxy.sent.Load() - before
				before = proxy.sent.Load()
				stream, err := client.Bidi(ctx)
				if err != nil {
					t.Fatal(err)
				}
				for i := 0; i < 2; i++ {
					if err := stream.Send(&pb.EchoRequest{}); err != nil {
						t.Fatal(err)
					}
					r, err := stream.Recv()
					if err != nil || !bytes.Equal(r.GetPayload(), compressible) {
						t.Fatalf("want %q: bidi: %v", want, err)
					}
				}
				stream.CloseSend()
				if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
					t.Fatalf("want %q: bidi ended with %v", want, err)
				}
				streamed := proxy.sent.Load() - before
				cancel()
				conn.Close()
				small := int64(len(compressible) / 10)
				if compressed := want == "gzip"; (unary < small) != compressed || (streamed < small) != compressed {
					t.Errorf("want %q: the server sent %d bytes for the unary reply and %d for two streamed (compressed: %v)",
						want, unary, streamed, compressed)
				}
			}
		})
	}
}
