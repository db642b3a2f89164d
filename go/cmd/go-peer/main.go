// Command go-peer serves the conformance suite's Echo service on isthmus from Go, as the
// cross-language tests' peer: `go-peer TARGET…` (shm://, unix://, http://). It prints READY
// once clients can connect, then LISTENING <address> for each HTTP/2 endpoint; BIDI-ENDED
// <how> when a Bidi call ends; on SIGTERM it stops gracefully (3 s) and prints SHUTDOWN-DONE.
// GO_PEER_INLINE=1 runs its unary handlers inline (isthmus.InlineUnary). Its streaming methods
// reflect x-echo-stream / x-echo-stream-bin into headers and trailers (echo.StreamEchoKeys),
// as Unary does x-echo / x-echo-bin. Beside Echo it serves the raw tier under /raw.Raw/:
// Echo, Fail, Panic and Slow as raw unary handlers, Stream as a raw stream that echoes each
// request.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

func main() {
	opts := []isthmus.ServerOption{isthmus.MaxMessageSize(65 << 20)}
	if os.Getenv("GO_PEER_INLINE") != "" {
		opts = append(opts, isthmus.InlineUnary())
	}
	s := isthmus.NewServer(opts...)
	pb.RegisterEchoServer(s, echo.Service{
		BidiEnded:     func(how string) { fmt.Println("BIDI-ENDED", how) },
		UnarySleeping: func(seq uint64) { fmt.Println("UNARY-SLEEPING", seq) },
	})
	registerRaw(s)
	if err := s.Start(os.Args[1:]...); err != nil {
		fmt.Fprintln(os.Stderr, "go-peer:", err)
		os.Exit(1)
	}
	fmt.Println("READY")
	for _, a := range s.HTTPAddresses() {
		fmt.Println("LISTENING", a)
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	<-term
	s.GracefulStopTimeout(3 * time.Second)
	fmt.Println("SHUTDOWN-DONE")
}

// registerRaw adds the raw tier's methods.
func registerRaw(s *isthmus.Server) {
	s.HandleRawUnary("/raw.Raw/Echo", echo.RawEcho)
	s.HandleRawUnary("/raw.Raw/Fail", func(*isthmus.RawServerCall, *isthmus.Message) (*isthmus.Block, error) {
		return nil, status.Error(codes.FailedPrecondition, "raw says no")
	})
	s.HandleRawUnary("/raw.Raw/Panic", func(*isthmus.RawServerCall, *isthmus.Message) (*isthmus.Block, error) {
		panic("raw handler panic")
	})
	s.HandleRawUnary("/raw.Raw/Slow", func(call *isthmus.RawServerCall, _ *isthmus.Message) (*isthmus.Block, error) {
		select {
		case <-call.Context().Done():
			return nil, status.FromContextError(call.Context().Err()).Err()
		case <-time.After(2 * time.Second):
			return call.Alloc(0)
		}
	})
	s.HandleRaw("/raw.Raw/Stream", echo.RawEchoStream)
	// A topic: /topic.Topic/Watch subscribes, /topic.Topic/Publish publishes its request and
	// answers how many subscribers it reached (decimal).
	topic, err := isthmus.NewTopic("go-peer")
	if err != nil {
		panic(err)
	}
	s.ServeTopic("/topic.Topic/Watch", topic)
	s.HandleRawUnary("/topic.Topic/Publish", func(call *isthmus.RawServerCall, req *isthmus.Message) (*isthmus.Block, error) {
		n, err := topic.Publish(req.Bytes())
		if err != nil {
			return nil, err
		}
		text := fmt.Sprint(n)
		reply, err := call.Alloc(len(text))
		if err == nil {
			copy(reply.Bytes(), text)
		}
		return reply, err
	})
}
