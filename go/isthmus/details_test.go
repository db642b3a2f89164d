package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
)

// A status's details (status.WithDetails: a google.rpc.Status, gRPC's grpc-status-details-bin)
// travel from a Go server's handler to a Go client, as with grpc-go: the Echo service fails a
// request that asks for it with echo.FailureDetail among its details.

// checkDetails fails t unless failing calls of every shape on conn (a unary call, and a
// client-streaming and a bidi call failing mid-stream) give status.FromError(err).Details()
// with the failure's detail, and their code and message.
func checkDetails(t *testing.T, label string, conn grpc.ClientConnInterface) {
	t.Helper()
	c := pb.NewEchoClient(conn)
	ctx := context.Background()
	want := func(what string, err error, code codes.Code, msg string) {
		t.Helper()
		s, _ := status.FromError(err)
		if s.Code() != code || s.Message() != msg {
			t.Errorf("%s: %s: got %v, want %v %q", label, what, err, code, msg)
			return
		}
		d := s.Details()
		if len(d) != 1 {
			t.Errorf("%s: %s: details %v, want one ErrorInfo", label, what, d)
			return
		}
		info, ok := d[0].(*errdetails.ErrorInfo)
		if !ok || !proto.Equal(info, echo.FailureDetail(msg)) {
			t.Errorf("%s: %s: details %v, want %v", label, what, d[0], echo.FailureDetail(msg))
		}
	}

	_, err := c.Unary(ctx, &pb.EchoRequest{FailWith: int32(codes.FailedPrecondition), FailMessage: "unary ✓"})
	want("unary", err, codes.FailedPrecondition, "unary ✓")

	cs, err := c.ClientStream(ctx)
	if err != nil {
		t.Fatalf("%s: ClientStream: %v", label, err)
	}
	if err := cs.Send(&pb.EchoRequest{FailWith: int32(codes.NotFound), FailMessage: "client stream"}); err != nil && err != io.EOF {
		t.Fatalf("%s: ClientStream send: %v", label, err)
	}
	_, err = cs.CloseAndRecv()
	want("client stream", err, codes.NotFound, "client stream")

	bidi, err := c.Bidi(ctx)
	if err != nil {
		t.Fatalf("%s: Bidi: %v", label, err)
	}
	if err := bidi.Send(&pb.EchoRequest{Payload: []byte("a")}); err != nil {
		t.Fatalf("%s: Bidi send: %v", label, err)
	}
	if r, err := bidi.Recv(); err != nil || string(r.Payload) != "a" {
		t.Fatalf("%s: Bidi echo: %v", label, err)
	}
	if err := bidi.Send(&pb.EchoRequest{FailWith: int32(codes.Aborted), FailMessage: "stop"}); err != nil && err != io.EOF {
		t.Fatalf("%s: Bidi send: %v", label, err)
	}
	_, err = bidi.Recv()
	want("bidi", err, codes.Aborted, "stop")
}

func TestStatusDetailsFromTheGoServerReachTheGoClient(t *testing.T) {
	for _, inline := range []bool{false, true} {
		shm, unix := fresh(t, fmt.Sprintf("details%v", inline))
		if inline {
			t.Setenv("GO_PEER_INLINE", "1")
		}
		p := startPeer(t, goPeerBin, shm, unix, "http://127.0.0.1:0")
		for _, target := range append([]string{shm}, p.addresses...) {
			checkDetails(t, fmt.Sprintf("inline=%v %s", inline, target), dial(t, target))
		}
		// grpc-go's own client reads them from the HTTP/2 trailers the Go server sent.
		for _, address := range p.addresses[1:] {
			conn, err := grpc.NewClient(grpcTarget(address), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			checkDetails(t, fmt.Sprintf("inline=%v grpc-go → %s", inline, address), conn)
			conn.Close()
		}
	}
}

// The Go client reads the details a plain grpc-go server sends (grpc-status-details-bin).
func TestStatusDetailsFromAGrpcGoServerReachTheGoClient(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	pb.RegisterEchoServer(s, echo.Service{})
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	checkDetails(t, "grpc-go server", dial(t, "http://"+lis.Addr().String()))
}

// Details that are no google.rpc.Status (tonic-peer sends raw bytes) are left out; the code
// and message stay.
func TestDetailsThatDoNotDecodeAreIgnored(t *testing.T) {
	bin := tonicPeer(t)
	shm, unix := fresh(t, "bad-details")
	p := startPeer(t, bin, shm, unix, "http://127.0.0.1:0")
	for _, target := range append([]string{shm}, p.addresses...) {
		c := pb.NewEchoClient(dial(t, target))
		_, err := c.Unary(context.Background(), &pb.EchoRequest{FailWith: int32(codes.DataLoss), FailMessage: "lost"})
		s, _ := status.FromError(err)
		if s.Code() != codes.DataLoss || s.Message() != "lost" || len(s.Details()) != 0 {
			t.Errorf("%s: got %v with details %v", target, err, s.Details())
		}
	}
}
