package isthmus_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// errorLog holds what the package logged at ERROR (TestMain sends grpclog's errors here too).
var errorLog lockedBuffer

// lockedBuffer is a bytes.Buffer written and read from many goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// panicking is an Echo service whose Unary handler panics with its request's payload.
type panicking struct{ echo.Service }

func (panicking) Unary(_ context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	panicNow(string(req.Payload))
	return nil, nil
}

// panicNow is a frame of its own, for the logged stack to name.
func panicNow(what string) { panic(what) }

// A handler that panics ends its call INTERNAL and the server goes on (grpc-go's server
// would crash the process), and the panic is logged through grpclog with its stack, as
// net/http logs a handler's: it went unseen, the handler's broken state with it.
func TestAHandlersPanicIsLoggedWithItsStack(t *testing.T) {
	for _, inline := range []bool{false, true} {
		var opts []isthmus.ServerOption
		if inline {
			opts = append(opts, isthmus.InlineUnary())
		}
		shm, _ := fresh(t, "panic")
		s := isthmus.NewServer(opts...)
		pb.RegisterEchoServer(s, panicking{})
		serving(t, s, shm)
		client := pb.NewEchoClient(dial(t, shm))
		what := fmt.Sprintf("boom-%v-%d", inline, len(errorLog.String()))
		_, err := client.Unary(testContext(t), &pb.EchoRequest{Payload: []byte(what)})
		if st := status.Convert(err); st.Code() != codes.Internal || !strings.Contains(st.Message(), what) {
			t.Fatalf("inline %v: the call ended %v, want Internal naming the panic", inline, err)
		}
		if _, err := client.Unary(testContext(t), &pb.EchoRequest{Payload: []byte("again")}); status.Code(err) != codes.Internal {
			t.Fatalf("inline %v: the next call ended %v: the server should go on", inline, err)
		}
		logged := errorLog.String()
		at := strings.Index(logged, what)
		if at < 0 {
			t.Fatalf("inline %v: the panic %q is not in the log:\n%s", inline, what, logged)
		}
		if rest := logged[at:]; !strings.Contains(rest, pb.Echo_Unary_FullMethodName) || !strings.Contains(rest, "panicNow") {
			t.Errorf("inline %v: the log names neither the method nor the panic's stack:\n%s", inline, rest)
		}
	}
}
