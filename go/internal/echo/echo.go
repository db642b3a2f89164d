// Package echo is the conformance suite's Echo service (tests/proto/conformance.proto) in Go,
// written as any grpc-go user writes it, a raw echo (RawEcho), and the payload pattern every
// peer of the suite agrees on (tests/src/lib.rs).
package echo

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// Mix is splitmix64, as the Rust peers use it.
func Mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Fill writes the pattern for seed into b.
func Fill(b []byte, seed uint64) {
	n := len(b) / 8
	for i := 0; i < n; i++ {
		binary.LittleEndian.PutUint64(b[i*8:], Mix(seed^uint64(i)*0x1000000001b3))
	}
	var tail [8]byte
	binary.LittleEndian.PutUint64(tail[:], Mix(^seed))
	copy(b[n*8:], tail[:])
}

// Pattern is a fresh n-byte payload with the pattern for seed.
func Pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	Fill(b, seed)
	return b
}

// FirstMismatch is the index of the first byte of b that breaks the pattern for seed, or -1.
func FirstMismatch(b []byte, seed uint64) int {
	n := len(b) / 8
	for i := 0; i < n; i++ {
		if binary.LittleEndian.Uint64(b[i*8:]) != Mix(seed^uint64(i)*0x1000000001b3) {
			return i * 8
		}
	}
	var tail [8]byte
	binary.LittleEndian.PutUint64(tail[:], Mix(^seed))
	for i := n * 8; i < len(b); i++ {
		if b[i] != tail[i-n*8] {
			return n * 8
		}
	}
	return -1
}

// Service implements pb.EchoServer.
type Service struct {
	pb.UnimplementedEchoServer
	// BidiEnded, if set, hears how each Bidi call ended: "half-close" or an error's code.
	BidiEnded func(string)
	// UnarySleeping, if set, hears the seq of each Unary call that is about to sleep (its
	// sleep_ms): the call is in its handler, so a test that kills the server has a call in flight.
	UnarySleeping func(seq uint64)
}

func timeLeft(ctx context.Context) int64 {
	if d, ok := ctx.Deadline(); ok {
		return time.Until(d).Milliseconds()
	}
	return -1
}

// FailureDetail is the detail a failure asked for in a request (fail_with) carries: its
// status's details (status.WithDetails) hold this one message, for the clients' tests of
// details (grpc-status-details-bin) to compare.
func FailureDetail(message string) *errdetails.ErrorInfo {
	return &errdetails.ErrorInfo{Reason: "FAIL_WITH", Domain: "isthmus.test", Metadata: map[string]string{"message": message}}
}

func failure(ctx context.Context, req *pb.EchoRequest) error {
	if req.FailWith == 0 {
		return nil
	}
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-failed", "yes"))
	s := status.New(codes.Code(req.FailWith), req.FailMessage)
	if d, err := s.WithDetails(FailureDetail(req.FailMessage)); err == nil {
		s = d
	}
	return s.Err()
}

func (s Service) Unary(ctx context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	left := timeLeft(ctx)
	md, _ := metadata.FromIncomingContext(ctx)
	if req.SleepMs > 0 {
		if s.UnarySleeping != nil {
			s.UnarySleeping(req.Seq)
		}
		select {
		case <-time.After(time.Duration(req.SleepMs) * time.Millisecond):
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	out := metadata.MD{}
	for _, k := range []string{"x-echo", "x-echo-bin"} {
		if v := md.Get(k); len(v) > 0 {
			out.Set(k, v[0])
		}
	}
	// The header goes ahead of a failure too: the client keeps it (grpc.Header).
	if len(out) > 0 {
		if err := grpc.SetHeader(ctx, out); err != nil {
			return nil, err
		}
	}
	if err := failure(ctx, req); err != nil {
		return nil, err
	}
	if len(out) > 0 {
		grpc.SetTrailer(ctx, out)
	}
	return &pb.EchoReply{Payload: req.Payload, Seq: req.Seq, TimeLeftMs: left}, nil
}

// StreamEchoKeys are the request metadata keys the streaming methods reflect (these keys
// only, so that calls without them go as before): ServerStream and ClientStream set them as
// header (SetHeader: they go with the first response) and trailer; Bidi sends them as header
// at once (SendHeader, before it reads a request) and sets them as trailer.
var StreamEchoKeys = []string{"x-echo-stream", "x-echo-stream-bin"}

// streamEchoed is the metadata of ctx's call under StreamEchoKeys (nil if none).
func streamEchoed(ctx context.Context) metadata.MD {
	md, _ := metadata.FromIncomingContext(ctx)
	var out metadata.MD
	for _, k := range StreamEchoKeys {
		if v := md.Get(k); len(v) > 0 {
			if out == nil {
				out = metadata.MD{}
			}
			out.Set(k, v...)
		}
	}
	return out
}

// setStreamEcho sets the reflected metadata, if any, as header (sent with the first
// response) and trailer.
func setStreamEcho(stream grpc.ServerStream) error {
	out := streamEchoed(stream.Context())
	if out == nil {
		return nil
	}
	if err := stream.SetHeader(out); err != nil {
		return err
	}
	stream.SetTrailer(out)
	return nil
}

func (Service) ServerStream(req *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	if err := setStreamEcho(stream); err != nil {
		return err
	}
	for i := uint64(0); i < uint64(req.Count); i++ {
		if err := stream.Send(&pb.EchoReply{Payload: Pattern(int(req.Size), i), Seq: i, TimeLeftMs: -1}); err != nil {
			return err
		}
	}
	return nil
}

func (Service) ClientStream(stream grpc.ClientStreamingServer[pb.EchoRequest, pb.Summary]) error {
	if err := setStreamEcho(stream); err != nil {
		return err
	}
	var count, n uint64
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&pb.Summary{Count: count, Bytes: n})
		}
		if err != nil {
			return err
		}
		if err := failure(stream.Context(), req); err != nil {
			return err
		}
		if FirstMismatch(req.Payload, req.Seq) >= 0 {
			return status.Errorf(codes.DataLoss, "message %d corrupted", req.Seq)
		}
		count++
		n += uint64(len(req.Payload))
	}
}

func (s Service) Bidi(stream grpc.BidiStreamingServer[pb.EchoRequest, pb.EchoReply]) error {
	if out := streamEchoed(stream.Context()); out != nil {
		if err := stream.SendHeader(out); err != nil {
			return err
		}
		stream.SetTrailer(out)
	}
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			s.ended("half-close")
			return nil
		}
		if err != nil {
			s.ended(fmt.Sprint(status.Code(err)))
			return err
		}
		if err := failure(stream.Context(), req); err != nil {
			return err
		}
		if err := stream.Send(&pb.EchoReply{Payload: req.Payload, Seq: req.Seq, TimeLeftMs: -1}); err != nil {
			return err
		}
	}
}

func (s Service) ended(how string) {
	if s.BidiEnded != nil {
		s.BidiEnded(how)
	}
}

// RawEcho is a raw unary handler that answers with a copy of the request, written in place
// into the server's shared memory.
func RawEcho(call *isthmus.RawServerCall, req *isthmus.Message) (*isthmus.Block, error) {
	reply, err := call.Alloc(len(req.Bytes()))
	if err != nil {
		return nil, err
	}
	if _, err := reply.WriteAt(req.Bytes(), 0); err != nil {
		reply.Release()
		return nil, err
	}
	return reply, nil
}

// RawEchoStream is a raw stream handler that answers each request with a copy written in
// place, until the client half-closes.
func RawEchoStream(call *isthmus.RawServerCall) error {
	for {
		req, err := call.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		reply, err := RawEcho(call, req)
		req.Release()
		if err != nil {
			return err
		}
		if err := call.SendBlock(reply); err != nil {
			return err
		}
	}
}
