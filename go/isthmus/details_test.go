package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
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

// A handler's status of a code gRPC does not define (above 16), with details, reaches every
// client as codes.Unknown with its message and details: the library carries codes 0-16 (as
// tonic does; grpc-go would keep the number). The details said 20 where the status said
// Unknown, and isthmus's and grpc-go's clients alike failed the call Internal "mismatch".
func TestAnUndefinedCodeWithDetailsArrivesUnknownWithThem(t *testing.T) {
	for label, conn := range echoClients(t, "odd-code", echo.Service{}) {
		_, err := pb.NewEchoClient(conn).Unary(context.Background(), &pb.EchoRequest{FailWith: 20, FailMessage: "odd"})
		got := status.Convert(err)
		if got.Code() != codes.Unknown || got.Message() != "odd" || len(got.Details()) != 1 {
			t.Errorf("%s: got %v with details %v, want Unknown \"odd\" with one", label, err, got.Details())
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

// Details that are a google.rpc.Status are read as grpc-go reads them: of the same code, the
// status is theirs, message included (the library's code and message overwrote theirs); of
// another code, the call ends INTERNAL saying so. The same calls through grpc-go's client to
// the same server must end the same.
func TestDetailsOfAStatusAreReadAsGrpcGoReadsThem(t *testing.T) {
	bin := tonicPeer(t)
	shm, unix := fresh(t, "status-details")
	p := startPeer(t, bin, shm, unix, "http://127.0.0.1:0")
	for _, which := range []string{"details same-code", "details other-code"} {
		req := &pb.EchoRequest{FailWith: int32(codes.Aborted), FailMessage: which}
		gconn, err := grpc.NewClient(grpcTarget(p.addresses[0]), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		_, err = pb.NewEchoClient(gconn).Unary(context.Background(), req)
		gconn.Close()
		want := status.Convert(err).Proto()
		if which == "details same-code" && want.GetMessage() != "the details' own message" {
			t.Fatalf("grpc-go read %v: the peer's details are not what this test expects", want)
		}
		for _, target := range append([]string{shm}, p.addresses...) {
			_, err := pb.NewEchoClient(dial(t, target)).Unary(context.Background(), req)
			if got := status.Convert(err).Proto(); !proto.Equal(got, want) {
				t.Errorf("%s, %s: got %v, want grpc-go's %v", target, which, got, want)
			}
		}
	}
}

// echoClients serves impl from a Go server in this process over shm:// and http://, and gives
// clients of it by name: isthmus's over each, HTTP/2 kept, and grpc-go's over HTTP/2.
func echoClients(t *testing.T, name string, impl pb.EchoServer) map[string]grpc.ClientConnInterface {
	shm, _ := fresh(t, name)
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, impl)
	serving(t, s, shm, "http://127.0.0.1:0")
	address := s.HTTPAddresses()[0]
	gconn, err := grpc.NewClient(grpcTarget(address), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gconn.Close() })
	return map[string]grpc.ClientConnInterface{
		"isthmus " + shm: dial(t, shm), "isthmus " + address: dial(t, address, isthmus.WithUpgrade(false)), "grpc-go " + address: gconn,
	}
}

// oddMessages fails each call with the status message its request's seq picks.
type oddMessages struct{ echo.Service }

// oddMessage is the status message of seq, and what a client reads of it.
func oddMessage(seq uint64) (sent, read string) {
	switch seq {
	case 0:
		return "bytes \xff\xfe that are no UTF-8", "bytes \uFFFD\uFFFD that are no UTF-8"
	case 1:
		return "a NUL \x00 inside", "a NUL \uFFFD inside"
	default:
		long := strings.Repeat("a long message ", 1400) // 21 KB, over hyper's 16 KiB of headers
		return long, long
	}
}

func (oddMessages) Unary(ctx context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	if r.Seq == 3 { // the size of a large metadata value the client sent
		md, _ := metadata.FromIncomingContext(ctx)
		return &pb.EchoReply{Seq: uint64(len(strings.Join(md.Get("x-big"), "")))}, nil
	}
	sent, _ := oddMessage(r.Seq)
	return nil, status.Error(codes.NotFound, sent)
}

// A handler's status message of any bytes reaches a client with its code, as from grpc-go's
// server: bytes that are not UTF-8 read as U+FFFD, as there, and a NUL too (grpc-go's clients
// read it back; a C string ends at it) (the library refused both, and the call ended INTERNAL
// in the library's words), and a 21 KB message whole over HTTP/2 (over
// hyper's 16 KiB of headers, the isthmus client's call ended INTERNAL 'h2 protocol error').
// As much metadata the other way reaches the server, as grpc-go's takes up to 16 MiB.
func TestAStatusMessageOfAnyBytesReachesTheClientWithItsCode(t *testing.T) {
	for name, conn := range echoClients(t, "odd-messages", oddMessages{}) {
		for seq := uint64(0); seq < 3; seq++ {
			_, err := pb.NewEchoClient(conn).Unary(context.Background(), &pb.EchoRequest{Seq: seq})
			_, read := oddMessage(seq)
			if s, _ := status.FromError(err); s.Code() != codes.NotFound || s.Message() != read {
				t.Errorf("%s, message %d: got %v %.80q", name, seq, s.Code(), s.Message())
			}
		}
		// And the other way: a 21 KB metadata value reaches the server whole.
		big := strings.Repeat("b", 21000)
		ctx := metadata.AppendToOutgoingContext(context.Background(), "x-big", big)
		if r, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{Seq: 3}); err != nil || r.Seq != 21000 {
			t.Errorf("%s, a 21 KB metadata value: got %v, %v", name, r, err)
		}
	}
}
