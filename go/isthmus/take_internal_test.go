package isthmus

import (
	"context"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	pb "example.invalid/isthmus/go/internal/conformancepb"
)

// named answers every unary call with its own name, and echoes a bidi stream.
type named struct {
	pb.UnimplementedEchoServer
	name string
}

func (n named) Unary(_ context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	return &pb.EchoReply{Payload: []byte(n.name), Seq: r.Seq}, nil
}

func (n named) Bidi(s pb.Echo_BidiServer) error {
	for {
		r, err := s.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := s.Send(&pb.EchoReply{Payload: []byte(n.name), Seq: r.Seq}); err != nil {
			return err
		}
	}
}

// A handler's goroutine that has finished its call takes the process's next call itself
// (serveFrom): calls of two servers in one process, alternated, unary and streamed, each
// reach its own server's handler, and some are taken so (at least one of up to 5,000; one
// comes within the 50 µs spin unless the machine stalls every time).
func TestAFinishedHandlerTakesTheNextCallItself(t *testing.T) {
	var clients [2]pb.EchoClient
	for i, name := range []string{"a", "b"} {
		s := NewServer()
		pb.RegisterEchoServer(s, named{name: name})
		target := fmt.Sprintf("shm://go-take-%s-%d-%d", name, os.Getpid(), time.Now().UnixNano())
		if err := s.Start(target); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		cc, err := Dial(target)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		clients[i] = pb.NewEchoClient(cc)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := takenCalls.Load()
	for i := 0; i < 5000 && (i < 200 || takenCalls.Load() == before); i++ {
		c, want := clients[i%2], []string{"a", "b"}[i%2]
		if i%10 == 9 {
			s, err := c.Bidi(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Send(&pb.EchoRequest{Seq: uint64(i)}); err != nil {
				t.Fatal(err)
			}
			r, err := s.Recv()
			if err != nil || string(r.Payload) != want || r.Seq != uint64(i) {
				t.Fatalf("stream %d: %v, %v (want %s)", i, r, err, want)
			}
			if err := s.CloseSend(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Recv(); err != io.EOF {
				t.Fatalf("stream %d ended with %v", i, err)
			}
			continue
		}
		r, err := c.Unary(ctx, &pb.EchoRequest{Seq: uint64(i)})
		if err != nil || string(r.Payload) != want || r.Seq != uint64(i) {
			t.Fatalf("call %d: %v, %v (want %s)", i, r, err, want)
		}
	}
	if takenCalls.Load() == before {
		t.Fatal("no call was taken by a handler's goroutine: every one went through the reactor")
	}
}

// The C copies of method paths are interned for the process up to maxInterned paths; past
// that, each call's copy is its own and freed after it, so a process that calls without end
// on new paths (a proxy passing on its callers') does not grow without end.
func TestInternedMethodPathsAreBounded(t *testing.T) {
	// The process's cache, full after this test, would leave every later test of the package
	// a copy per call: it is put back as it was (the copies interned here are left to the
	// test process; a test file cannot call C.free).
	before := map[any]bool{}
	cStrings.Range(func(k, _ any) bool { before[k] = true; return true })
	count := interned.Load()
	t.Cleanup(func() {
		cStrings.Range(func(k, _ any) bool {
			if !before[k] {
				cStrings.Delete(k)
			}
			return true
		})
		interned.Store(count)
	})
	for i := 0; i < maxInterned+100; i++ {
		p, done := cString(fmt.Sprintf("/bounded.Paths/M%d", i))
		if p == nil {
			t.Fatal("no C string")
		}
		done()
	}
	n := 0
	cStrings.Range(func(_, _ any) bool { n++; return true })
	if n > maxInterned || interned.Load() > maxInterned {
		t.Fatalf("%d paths interned (counted %d), at most %d", n, interned.Load(), maxInterned)
	}
	// An interned path is still the same copy.
	a, _ := cString("/bounded.Paths/M0")
	b, _ := cString("/bounded.Paths/M0")
	if a != b {
		t.Error("an interned path was copied again")
	}
}
