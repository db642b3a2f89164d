// Package conformance is the conformance suite's client side in Go: one set of checks that
// any Echo server (tests/proto/conformance.proto) must pass over any transport, run by the Go
// tests and by cmd/go-conformance for the other languages' tests.
package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
)

// Check is one named check.
type Check struct {
	Name string
	Run  func(ctx context.Context, c pb.EchoClient) error
}

// LargeSize is the payload of the large-message check: 64 MiB less room for the protobuf
// framing, under the peers' 64 MiB limits.
const LargeSize = 64<<20 - 1024

// Checks is the suite. callOpts are added to every call (a plain grpc-go client needs its
// receive limit raised for the large message).
func Checks(callOpts ...grpc.CallOption) []Check {
	return []Check{
		{"unary with metadata both ways", func(ctx context.Context, c pb.EchoClient) error {
			ctx = metadata.AppendToOutgoingContext(ctx, "x-echo", "hello", "x-echo-bin", string([]byte{0, 1, 255}))
			var header, trailer metadata.MD
			r, err := c.Unary(ctx, &pb.EchoRequest{Payload: []byte("hello"), Seq: 7}, append(callOpts, grpc.Header(&header), grpc.Trailer(&trailer))...)
			if err != nil {
				return err
			}
			if string(r.Payload) != "hello" || r.Seq != 7 {
				return fmt.Errorf("reply %q seq %d", r.Payload, r.Seq)
			}
			// Every peer echoes into the initial metadata; some (Go, Python) into the trailers too.
			mds := []metadata.MD{header}
			if len(trailer) > 0 {
				mds = append(mds, trailer)
			}
			for _, md := range mds {
				if got := md.Get("x-echo"); len(got) != 1 || got[0] != "hello" {
					return fmt.Errorf("x-echo came back as %q (headers %v, trailers %v)", got, header, trailer)
				}
				if got := md.Get("x-echo-bin"); len(got) != 1 || got[0] != string([]byte{0, 1, 255}) {
					return fmt.Errorf("x-echo-bin came back as %q", got)
				}
			}
			return nil
		}},
		{"every status code with its message and trailers", func(ctx context.Context, c pb.EchoClient) error {
			for code := 1; code <= 16; code++ {
				msg := fmt.Sprintf("failure %d ✓", code)
				var trailer metadata.MD
				_, err := c.Unary(ctx, &pb.EchoRequest{FailWith: int32(code), FailMessage: msg}, append(callOpts, grpc.Trailer(&trailer))...)
				s, _ := status.FromError(err)
				if s.Code() != codes.Code(code) || s.Message() != msg {
					return fmt.Errorf("code %d: got %v", code, err)
				}
				if got := trailer.Get("x-failed"); len(got) != 1 || got[0] != "yes" {
					return fmt.Errorf("code %d: trailers %v", code, trailer)
				}
			}
			return nil
		}},
		{"the deadline travels and ends a slow call", func(ctx context.Context, c pb.EchoClient) error {
			in, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			r, err := c.Unary(in, &pb.EchoRequest{}, callOpts...)
			if err != nil {
				return err
			}
			if r.TimeLeftMs < 1 || r.TimeLeftMs > 30000 {
				return fmt.Errorf("the server saw %d ms left", r.TimeLeftMs)
			}
			short, cancel2 := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel2()
			start := time.Now()
			_, err = c.Unary(short, &pb.EchoRequest{SleepMs: 10000}, callOpts...)
			if status.Code(err) != codes.DeadlineExceeded {
				return fmt.Errorf("a call past its deadline gave %v", err)
			}
			if el := time.Since(start); el > 5*time.Second {
				return fmt.Errorf("the deadline ended the call after %v", el)
			}
			return nil
		}},
		{"server streaming", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 100, Size: 1000}, callOpts...)
			if err != nil {
				return err
			}
			for i := uint64(0); ; i++ {
				r, err := s.Recv()
				if errors.Is(err, io.EOF) {
					if i != 100 {
						return fmt.Errorf("%d replies", i)
					}
					return nil
				}
				if err != nil {
					return err
				}
				if r.Seq != i || echo.FirstMismatch(r.Payload, i) >= 0 || len(r.Payload) != 1000 {
					return fmt.Errorf("reply %d corrupted", i)
				}
			}
		}},
		{"client streaming", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.ClientStream(ctx, callOpts...)
			if err != nil {
				return err
			}
			for i := uint64(0); i < 50; i++ {
				if err := s.Send(&pb.EchoRequest{Payload: echo.Pattern(4096, i), Seq: i}); err != nil {
					return err
				}
			}
			sum, err := s.CloseAndRecv()
			if err != nil {
				return err
			}
			if sum.Count != 50 || sum.Bytes != 50*4096 {
				return fmt.Errorf("summary %v", sum)
			}
			return nil
		}},
		{"bidirectional streaming, sending and receiving at once", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.Bidi(ctx, callOpts...)
			if err != nil {
				return err
			}
			const n = 200
			sent := make(chan error, 1)
			go func() {
				for i := uint64(0); i < n; i++ {
					if err := s.Send(&pb.EchoRequest{Payload: echo.Pattern(512, i), Seq: i}); err != nil {
						sent <- err
						return
					}
				}
				sent <- s.CloseSend()
			}()
			for i := uint64(0); ; i++ {
				r, err := s.Recv()
				if errors.Is(err, io.EOF) {
					if i != n {
						return fmt.Errorf("%d replies", i)
					}
					break
				}
				if err != nil {
					return err
				}
				if r.Seq != i || echo.FirstMismatch(r.Payload, i) >= 0 {
					return fmt.Errorf("reply %d corrupted", i)
				}
			}
			return <-sent
		}},
		{"a cancelled stream ends with Canceled", func(ctx context.Context, c pb.EchoClient) error {
			in, cancel := context.WithCancel(ctx)
			s, err := c.Bidi(in, callOpts...)
			if err != nil {
				cancel()
				return err
			}
			if err := s.Send(&pb.EchoRequest{Payload: []byte("x")}); err != nil {
				cancel()
				return err
			}
			if _, err := s.Recv(); err != nil {
				cancel()
				return err
			}
			cancel()
			_, err = s.Recv()
			if status.Code(err) != codes.Canceled {
				return fmt.Errorf("after cancel: %v", err)
			}
			return nil
		}},
		{"a 64 MiB message", func(ctx context.Context, c pb.EchoClient) error {
			payload := echo.Pattern(LargeSize, 42)
			r, err := c.Unary(ctx, &pb.EchoRequest{Payload: payload, Seq: 42}, callOpts...)
			if err != nil {
				return err
			}
			if !bytes.Equal(r.Payload, payload) {
				return fmt.Errorf("the reply differs (first bad byte %d)", echo.FirstMismatch(r.Payload, 42))
			}
			return nil
		}},
		{"an unknown method is Unimplemented", func(ctx context.Context, c pb.EchoClient) error {
			return nil // replaced in Run, which has the connection
		}},
		{"many calls at once", func(ctx context.Context, c pb.EchoClient) error {
			const n = 256
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					r, err := c.Unary(ctx, &pb.EchoRequest{Payload: echo.Pattern(64, uint64(i)), Seq: uint64(i)}, callOpts...)
					if err == nil && (r.Seq != uint64(i) || echo.FirstMismatch(r.Payload, uint64(i)) >= 0) {
						err = fmt.Errorf("call %d got another's reply", i)
					}
					errs <- err
				}(i)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					return err
				}
			}
			return nil
		}},
	}
}

// streamMD is what the stream metadata checks send under echo.StreamEchoKeys.
var streamMD = metadata.Pairs("x-echo-stream", "stream-md", "x-echo-stream-bin", string([]byte{0, 1, 255}))

// reflected fails unless md (what the call's `what` brought back) holds streamMD.
func reflected(what string, md metadata.MD) error {
	for k, want := range streamMD {
		if got := md.Get(k); len(got) != 1 || got[0] != want[0] {
			return fmt.Errorf("%s: %s came back as %q (all: %v)", what, k, got, md)
		}
	}
	return nil
}

// headerReflected fails unless the stream's header holds streamMD.
func headerReflected(s interface{ Header() (metadata.MD, error) }) error {
	header, err := s.Header()
	if err != nil {
		return err
	}
	return reflected("header", header)
}

// StreamMetadataChecks check metadata both ways on streams: the Go Echo service
// (internal/echo) reflects echo.StreamEchoKeys into a stream's header and trailer (set with
// SetHeader on ServerStream and ClientStream, sent with SendHeader before any message on
// Bidi). Only Go's Echo does this, so they are not part of Checks, which every peer passes.
func StreamMetadataChecks(callOpts ...grpc.CallOption) []Check {
	return []Check{
		{"server streaming: header and trailer", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.ServerStream(metadata.NewOutgoingContext(ctx, streamMD), &pb.StreamRequest{Count: 3, Size: 10}, callOpts...)
			if err != nil {
				return err
			}
			if err := headerReflected(s); err != nil {
				return err
			}
			for i := 0; ; i++ {
				_, err := s.Recv()
				if errors.Is(err, io.EOF) {
					if i != 3 {
						return fmt.Errorf("%d replies", i)
					}
					break
				}
				if err != nil {
					return err
				}
			}
			return reflected("trailer", s.Trailer())
		}},
		{"server streaming without the keys: none come back", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 1, Size: 10}, callOpts...)
			if err != nil {
				return err
			}
			header, err := s.Header()
			if err != nil {
				return err
			}
			for {
				if _, err := s.Recv(); errors.Is(err, io.EOF) {
					break
				} else if err != nil {
					return err
				}
			}
			for k := range streamMD {
				if len(header.Get(k)) > 0 || len(s.Trailer().Get(k)) > 0 {
					return fmt.Errorf("%s came back unasked (header %v, trailer %v)", k, header, s.Trailer())
				}
			}
			return nil
		}},
		{"client streaming: header and trailer", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.ClientStream(metadata.NewOutgoingContext(ctx, streamMD), callOpts...)
			if err != nil {
				return err
			}
			for i := uint64(0); i < 3; i++ {
				if err := s.Send(&pb.EchoRequest{Payload: echo.Pattern(64, i), Seq: i}); err != nil {
					return err
				}
			}
			if _, err := s.CloseAndRecv(); err != nil {
				return err
			}
			if err := headerReflected(s); err != nil {
				return err
			}
			return reflected("trailer", s.Trailer())
		}},
		{"bidirectional streaming: header before any message, and trailer", func(ctx context.Context, c pb.EchoClient) error {
			s, err := c.Bidi(metadata.NewOutgoingContext(ctx, streamMD), callOpts...)
			if err != nil {
				return err
			}
			// The server sends its header before it reads a request: it comes with none sent.
			if err := headerReflected(s); err != nil {
				return err
			}
			for i := uint64(0); i < 3; i++ {
				if err := s.Send(&pb.EchoRequest{Payload: echo.Pattern(64, i), Seq: i}); err != nil {
					return err
				}
				if r, err := s.Recv(); err != nil {
					return err
				} else if r.Seq != i {
					return fmt.Errorf("reply %d has seq %d", i, r.Seq)
				}
			}
			if err := s.CloseSend(); err != nil {
				return err
			}
			if _, err := s.Recv(); !errors.Is(err, io.EOF) {
				return fmt.Errorf("after the half-close: %v, want io.EOF", err)
			}
			return reflected("trailer", s.Trailer())
		}},
	}
}

// RunStreamMetadata runs StreamMetadataChecks against conn (a Go Echo server's), as Run does.
func RunStreamMetadata(ctx context.Context, conn grpc.ClientConnInterface, report func(name string, err error), callOpts ...grpc.CallOption) (passed, failed int) {
	return runChecks(ctx, conn, StreamMetadataChecks(callOpts...), report)
}

// Run runs every check against conn; report gets each check's name and error (nil: passed).
// It returns the numbers passed and failed.
func Run(ctx context.Context, conn grpc.ClientConnInterface, report func(name string, err error), callOpts ...grpc.CallOption) (passed, failed int) {
	checks := Checks(callOpts...)
	for i, check := range checks {
		if strings.HasPrefix(check.Name, "an unknown method") {
			checks[i].Run = func(ctx context.Context, _ pb.EchoClient) error {
				err := conn.Invoke(ctx, "/conformance.Echo/Nope", &pb.EchoRequest{}, &pb.EchoReply{}, callOpts...)
				if status.Code(err) != codes.Unimplemented {
					return fmt.Errorf("got %v", err)
				}
				return nil
			}
		}
	}
	return runChecks(ctx, conn, checks, report)
}

// runChecks runs checks against conn, each within 60 s, and counts the outcomes.
func runChecks(ctx context.Context, conn grpc.ClientConnInterface, checks []Check, report func(name string, err error)) (passed, failed int) {
	c := pb.NewEchoClient(conn)
	for _, check := range checks {
		in, cancel := context.WithTimeout(ctx, 60*time.Second)
		err := check.Run(in, c)
		cancel()
		report(check.Name, err)
		if err != nil {
			failed++
		} else {
			passed++
		}
	}
	return passed, failed
}
