package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// firstRequestHeader is a request-streaming handler that reads its first request, then sends
// initial metadata made from it, as a handler that authenticates by the first message does.
// It reads only once the client has sent (sent is closed), and a moment later, so that the
// request is in.
type firstRequestHeader struct {
	pb.UnimplementedEchoServer
	sent chan struct{}
}

func (h firstRequestHeader) ClientStream(s grpc.ClientStreamingServer[pb.EchoRequest, pb.Summary]) error {
	select {
	case <-h.sent:
	case <-s.Context().Done():
		return s.Context().Err()
	}
	time.Sleep(100 * time.Millisecond)
	r, err := s.Recv()
	if err != nil {
		return err
	}
	if err := s.SendHeader(metadata.Pairs("x-first", fmt.Sprint(r.Seq))); err != nil {
		return err
	}
	n := uint64(1)
	for {
		if _, err := s.Recv(); err == io.EOF {
			break
		} else if err != nil {
			return err
		}
		n++
	}
	return s.SendAndClose(&pb.Summary{Count: n})
}

// A request-streaming handler that has read a request that was already in can still send its
// initial metadata, on isthmus's server as on grpc-go's. It could not: asking the receive to
// send the metadata if it had to wait counted them as sent either way. (One that waits for its
// first request sends empty metadata on isthmus, for tonic's clients; not tested here.)
func TestAHandlerSendsHeadersAfterReadingARequestThatWasIn(t *testing.T) {
	servers := map[string]func(t *testing.T, h firstRequestHeader) pb.EchoClient{
		"grpc-go": func(t *testing.T, h firstRequestHeader) pb.EchoClient {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			s := grpc.NewServer()
			pb.RegisterEchoServer(s, h)
			go s.Serve(l)
			t.Cleanup(s.Stop)
			conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			return pb.NewEchoClient(conn)
		},
		"isthmus": func(t *testing.T, h firstRequestHeader) pb.EchoClient {
			shm, _ := fresh(t, "header-after-recv")
			s := isthmus.NewServer()
			pb.RegisterEchoServer(s, h)
			if err := s.Start(shm); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Stop)
			return pb.NewEchoClient(dial(t, shm))
		},
	}
	for name, start := range servers {
		t.Run(name, func(t *testing.T) {
			h := firstRequestHeader{sent: make(chan struct{})}
			client := start(t, h)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			stream, err := client.ClientStream(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, seq := range []uint64{7, 8} {
				if err := stream.Send(&pb.EchoRequest{Seq: seq}); err != nil {
					t.Fatal(err)
				}
			}
			close(h.sent)
			summary, err := stream.CloseAndRecv()
			if err != nil || summary.GetCount() != 2 {
				t.Fatalf("%v, %v", summary, err)
			}
			header, err := stream.Header()
			if err != nil || fmt.Sprint(header.Get("x-first")) != "[7]" {
				t.Fatalf("header %v, %v", header, err)
			}
		})
	}
}
