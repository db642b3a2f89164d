package isthmus_test

import (
	"context"
	"io"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"example.invalid/isthmus/go/isthmus"
)

// A raw handler's blocks from Alloc that no send spent are released when it returns, however
// it does (an error, a panic): each was held, with its arena space, for the life of the process.
func TestARawHandlersUnsentBlocksAreReleased(t *testing.T) {
	shm, _ := fresh(t, "raw-unsent")
	s := isthmus.NewServer()
	s.HandleRawUnary("/t.T/Fails", func(c *isthmus.RawServerCall, _ *isthmus.Message) (*isthmus.Block, error) {
		if _, err := c.Alloc(64 << 10); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.FailedPrecondition, "encoding failed")
	})
	s.HandleRawUnary("/t.T/Panics", func(c *isthmus.RawServerCall, _ *isthmus.Message) (*isthmus.Block, error) {
		if _, err := c.Alloc(64 << 10); err != nil {
			return nil, err
		}
		panic("a bug")
	})
	s.HandleRaw("/t.T/Streams", func(c *isthmus.RawServerCall) error {
		if _, err := c.Alloc(64 << 10); err != nil {
			return err
		}
		return status.Error(codes.Aborted, "gave up")
	})
	serving(t, s, shm)
	conn := dial(t, shm)
	ctx := testContext(t)
	before := isthmus.LiveHandles()
	const calls = 10
	for i := 0; i < calls; i++ {
		if _, err := conn.CallRaw(ctx, "/t.T/Fails", nil); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("Fails: %v", err)
		}
		if _, err := conn.CallRaw(ctx, "/t.T/Panics", nil); status.Code(err) != codes.Internal {
			t.Fatalf("Panics: %v", err)
		}
		st, err := conn.StartRaw(ctx, "/t.T/Streams")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); status.Code(err) != codes.Aborted {
			t.Fatalf("Streams: %v", err)
		}
	}
	// Each call held a block (3 × 10) before; the count is the process's, so a few of an
	// earlier test's may come and go meanwhile.
	eventually(t, "the handlers' unsent blocks released", func() bool { return isthmus.LiveHandles() < before+calls })
}

// Alloc over a transport with no shared memory refuses a block no message can be,
// RESOURCE_EXHAUSTED naming its size and the limit, rather than panic in make (or abort the
// process out of memory).
func TestAllocOffSharedMemoryRefusesAnImpossibleSize(t *testing.T) {
	p := startPeer(t, goPeerBin, "http://127.0.0.1:0")
	conn := dial(t, p.addresses[0])
	_, err := conn.Alloc(context.Background(), 1<<62)
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(msg, strconv.Itoa(1<<62)) || !strings.Contains(msg, "2147483647") {
		t.Fatalf("Alloc(1<<62) over HTTP/2: %v", err)
	}
}

// A raw stream: a SendBlock(b, true) the library refuses (a block of another connection)
// leaves the stream open, so a CloseSend after it still half-closes (it did nothing, and the
// call waited for ever); and Header after the end gives the server's initial metadata.
func TestARawStreamsRefusedLastBlockLeavesItOpenAndItsHeaderStays(t *testing.T) {
	shm, _ := fresh(t, "raw-refused")
	s := isthmus.NewServer()
	s.HandleRaw("/t.T/Count", func(c *isthmus.RawServerCall) error {
		if err := c.SendHeader(metadata.Pairs("x-h", "counted")); err != nil {
			return err
		}
		n := 0
		for {
			m, err := c.Recv()
			if err == io.EOF {
				return c.Send([]byte(strconv.Itoa(n)))
			}
			if err != nil {
				return err
			}
			m.Release()
			n++
		}
	})
	serving(t, s, shm)
	conn, other := dial(t, shm), dial(t, shm)
	ctx := testContext(t)
	st, err := conn.StartRaw(ctx, "/t.T/Count")
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send([]byte("one"), false); err != nil {
		t.Fatal(err)
	}
	foreign, err := other.Alloc(ctx, 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.SendBlock(foreign, true); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a block of another connection: %v, want InvalidArgument", err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	m, err := st.Recv()
	if err != nil {
		t.Fatalf("the count: %v", err)
	}
	if got := string(m.Bytes()); got != "1" {
		t.Errorf("the server counted %s messages, want 1", got)
	}
	m.Release()
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("the end: %v", err)
	}
	if h, err := st.Header(); err != nil || len(h.Get("x-h")) != 1 || h.Get("x-h")[0] != "counted" {
		t.Errorf("Header after the end: %v, %v", h, err)
	}
}
