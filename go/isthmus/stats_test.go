package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// Stats handlers (what otelgrpc plugs in) on both sides, the same recorder between an
// isthmus client and server over shm:// and unix:// and between a plain grpc-go client and
// server: each call must produce the same events. grpc-go reports some events from its
// transport's goroutine (a reply's trailers can be reported before the application reads its
// last message), so the order is compared where grpc-go fixes it (Begin or the request's
// headers first, End last) and the rest as a multiset.

type tagKey struct{}

// statsRecorder is a stats.Handler that records each call's events by kind, checks that
// every event comes with the context its TagRPC returned, and (on a client) adds metadata to
// the outgoing context there, as tracing handlers do.
type statsRecorder struct {
	client bool
	mu     sync.Mutex
	events []string
	errs   []string
}

func (r *statsRecorder) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if r.client {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-stats-tag", "tagged")
	}
	return context.WithValue(ctx, tagKey{}, info.FullMethodName)
}

func (r *statsRecorder) HandleRPC(ctx context.Context, s stats.RPCStats) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ctx.Value(tagKey{}) == nil {
		r.errs = append(r.errs, fmt.Sprintf("%T came without the tagged context", s))
	}
	if s.IsClient() != r.client {
		r.errs = append(r.errs, fmt.Sprintf("%T says client=%v", s, s.IsClient()))
	}
	// A server's handlers learn the client from the context, as grpc-go gives it (per-client
	// metrics and logs); isthmus's held no peer.
	if p, ok := grpcpeer.FromContext(ctx); !r.client && (!ok || p.Addr == nil) {
		r.errs = append(r.errs, fmt.Sprintf("%T came without the client's peer", s))
	}
	name := strings.TrimPrefix(fmt.Sprintf("%T", s), "*stats.")
	switch s := s.(type) {
	case *stats.End:
		name += ":" + status.Code(s.Error).String()
		if s.BeginTime.IsZero() || s.EndTime.Before(s.BeginTime) {
			r.errs = append(r.errs, "End's times are wrong")
		}
	case *stats.OutPayload:
		if m, ok := s.Payload.(proto.Message); !ok || proto.Size(m) != s.Length {
			r.errs = append(r.errs, fmt.Sprintf("OutPayload of %d bytes for %v", s.Length, s.Payload))
		}
	case *stats.InPayload:
		if m, ok := s.Payload.(proto.Message); !ok || proto.Size(m) != s.Length {
			r.errs = append(r.errs, fmt.Sprintf("InPayload of %d bytes for %v", s.Length, s.Payload))
		}
	case *stats.InHeader:
		if !r.client {
			if s.FullMethod == "" || len(s.Header.Get("x-stats-tag")) == 0 {
				r.errs = append(r.errs, fmt.Sprintf("the server's InHeader lacks the method or the client's tag: %q %v", s.FullMethod, s.Header))
			}
		}
	case *stats.OutHeader:
		if r.client && (s.FullMethod == "" || len(s.Header.Get("x-stats-tag")) == 0) {
			r.errs = append(r.errs, fmt.Sprintf("the client's OutHeader lacks the method or its tag: %q %v", s.FullMethod, s.Header))
		}
	}
	r.events = append(r.events, name)
}

func (r *statsRecorder) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}

func (r *statsRecorder) HandleConn(context.Context, stats.ConnStats) {}

// take waits (up to 10 s) for a call's End, then gives the events since the last take.
func (r *statsRecorder) take(t *testing.T, label string) []string {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		r.mu.Lock()
		done := slices.ContainsFunc(r.events, func(e string) bool { return strings.HasPrefix(e, "End") })
		if done || time.Now().After(deadline) {
			ev, errs := r.events, r.errs
			r.events, r.errs = nil, nil
			r.mu.Unlock()
			for _, e := range errs {
				t.Errorf("%s: %s", label, e)
			}
			return ev
		}
		r.mu.Unlock()
		time.Sleep(time.Millisecond)
	}
}

// sameEvents compares two calls' events: the same first and last event, the same multiset.
func sameEvents(got, want []string) bool {
	if len(got) == 0 || len(got) != len(want) || got[0] != want[0] || got[len(got)-1] != want[len(want)-1] {
		return false
	}
	g, w := slices.Clone(got), slices.Clone(want)
	slices.Sort(g)
	slices.Sort(w)
	return slices.Equal(g, w)
}

// statsCalls makes a unary call, a failing one, a server stream and a bidirectional stream
// on conn, and gives the events each side recorded for each.
func statsCalls(t *testing.T, label string, conn grpc.ClientConnInterface, client, server *statsRecorder) map[string][2][]string {
	t.Helper()
	ctx := testContext(t)
	c := pb.NewEchoClient(conn)
	got := map[string][2][]string{}
	record := func(what string) {
		got[what] = [2][]string{client.take(t, label+" client "+what), server.take(t, label+" server "+what)}
	}
	// A first call finds grpc-go still connecting, which it reports (DelayedPickComplete, an
	// event of its load balancer that isthmus has not): calls are compared once it is up.
	for _, what := range []string{"warm-up", "unary"} {
		if _, err := c.Unary(ctx, &pb.EchoRequest{Payload: []byte("stats")}); err != nil {
			t.Fatalf("%s: Unary: %v", label, err)
		}
		record(what)
	}
	_, err := c.Unary(ctx, &pb.EchoRequest{FailWith: int32(codes.NotFound), FailMessage: "no"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("%s: a failing Unary gave %v", label, err)
	}
	record("unary error")
	serverStreamToTheEnd(t, ctx, label, c)
	record("server stream")
	bidi, err := c.Bidi(ctx)
	if err != nil {
		t.Fatalf("%s: Bidi: %v", label, err)
	}
	for i := range 2 {
		if err := bidi.Send(&pb.EchoRequest{Seq: uint64(i + 1)}); err != nil {
			t.Fatalf("%s: Bidi send: %v", label, err)
		}
		if _, err := bidi.Recv(); err != nil {
			t.Fatalf("%s: Bidi recv: %v", label, err)
		}
	}
	if err := bidi.CloseSend(); err != nil {
		t.Fatalf("%s: CloseSend: %v", label, err)
	}
	if _, err := bidi.Recv(); err != io.EOF {
		t.Fatalf("%s: Bidi end: %v", label, err)
	}
	record("bidi")
	return got
}

// Every call reports the same events to the client's and the server's stats handlers as it
// does with grpc-go, over every transport; TagRPC's context goes with every event, and the
// metadata it adds reaches the server.
func TestStatsHandlersSeeWhatGrpcGoReports(t *testing.T) {
	client, server := &statsRecorder{client: true}, &statsRecorder{}
	address := startGrpcServer(t, grpc.StatsHandler(server))
	want := statsCalls(t, "grpc-go", newGrpcClient(t, address, grpc.WithStatsHandler(client)), client, server)

	delete(want, "warm-up")
	// Unary handlers on goroutines, and inline on the library's reading thread.
	for _, opts := range [][]isthmus.ServerOption{nil, {isthmus.InlineUnary()}} {
		shm, unix := fresh(t, "stats")
		s := isthmus.NewServer(append(opts, isthmus.StatsHandler(server))...)
		pb.RegisterEchoServer(s, &echo.Service{})
		if err := s.Start(shm, unix); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		for _, target := range []string{shm, unix} {
			label := fmt.Sprintf("%s (inline %v)", target, opts != nil)
			got := statsCalls(t, label, dialWith(t, target, isthmus.WithStatsHandler(client)), client, server)
			for what, w := range want {
				for side, name := range []string{"client", "server"} {
					if !sameEvents(got[what][side], w[side]) {
						t.Errorf("%s: %s %s: events %v, grpc-go's %v", label, what, name, got[what][side], w[side])
					}
				}
			}
		}
	}
}

// sleepsThroughEchoService answers Unary after its sleep_ms whatever its context says.
type sleepsThroughEchoService struct{ echo.Service }

func (sleepsThroughEchoService) Unary(_ context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	time.Sleep(time.Duration(req.SleepMs) * time.Millisecond)
	return &pb.EchoReply{Seq: req.Seq}, nil
}

// A unary reply whose client went away while the handler ran (its deadline passed) is
// reported to the server's stats handlers as grpc-go reports it: End with an error, and no
// OutPayload. They heard of it as sent, End OK. (An InlineUnary handler holds the thread that
// reads its connection, so the client's cancel is read only after its reply went: sent.)
func TestAReplyWhoseClientLeftIsNoSentReply(t *testing.T) {
	server := &statsRecorder{}
	shm, _ := fresh(t, "stats-left")
	s := isthmus.NewServer(isthmus.StatsHandler(server))
	pb.RegisterEchoServer(s, sleepsThroughEchoService{})
	serving(t, s, shm)
	conn := dialWith(t, shm, isthmus.WithStatsHandler(&statsRecorder{client: true}))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	// The handler outlasts the deadline by far: the cancel is read long before its reply.
	_, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{SleepMs: 1000})
	cancel()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatal(err)
	}
	events := server.take(t, "the server")
	if slices.Contains(events, "OutPayload") || slices.Contains(events, "End:OK") {
		t.Errorf("a reply nobody got was reported sent: %v", events)
	}
	if !slices.ContainsFunc(events, func(e string) bool { return strings.HasPrefix(e, "End:") }) {
		t.Errorf("no End: %v", events)
	}
}

// A stream whose context ends before its status comes still reports End, with the
// context's error, once.
func TestStatsHandlersHearOfACancelledStream(t *testing.T) {
	client := &statsRecorder{client: true}
	shm := startEchoServer(t, "stats-cancel")
	conn := dialWith(t, shm, isthmus.WithStatsHandler(client))
	ctx, cancel := context.WithCancel(testContext(t))
	bidi, err := pb.NewEchoClient(conn).Bidi(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := bidi.Send(&pb.EchoRequest{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	cancel()
	events := client.take(t, "cancelled")
	ends := slices.DeleteFunc(slices.Clone(events), func(e string) bool { return !strings.HasPrefix(e, "End") })
	if !slices.Equal(ends, []string{"End:Canceled"}) {
		t.Errorf("a cancelled stream reported %v", events)
	}
	if _, err := bidi.Recv(); status.Code(err) != codes.Canceled {
		t.Errorf("Recv after the cancel: %v", err)
	}
	time.Sleep(10 * time.Millisecond)
	client.mu.Lock()
	defer client.mu.Unlock()
	if len(client.events) != 0 {
		t.Errorf("events after End: %v", client.events)
	}
}

// A stream abandoned by its caller after a cancel (never read again, as a generated client's
// caller often does) gives back its call handle: it was kept until a RecvMsg that never came.
// So does a stream whose reply did not unmarshal (grpc-go ends the call there).
func TestAStreamLeftAfterItsContextEndsFreesItsHandle(t *testing.T) {
	shm := startEchoServer(t, "stream-left")
	conn := dial(t, shm)
	client := pb.NewEchoClient(conn)
	// A call first, so that what the connection itself holds is counted in the baseline.
	if _, err := client.Unary(testContext(t), &pb.EchoRequest{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	before := isthmus.LiveHandles()
	for i := 0; i < 20; i++ {
		ctx, cancel := context.WithCancel(testContext(t))
		stream, err := client.ServerStream(ctx, &pb.StreamRequest{Count: 1000, Size: 16})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
		cancel() // and the stream is never read again
	}
	deadline := time.Now().Add(10 * time.Second)
	for isthmus.LiveHandles() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := isthmus.LiveHandles(); n > before {
		t.Fatalf("%d handles live after 20 abandoned streams, %d before", n, before)
	}
}

// Close while calls are being made from many goroutines: a call either goes through or fails
// Canceled, as on a closed grpc-go connection. Before, one that had passed the closed check
// could hand the library the freed channel handle (INVALID_ARGUMENT, or another channel's if
// a new handle took its address).
func TestCloseUnderCallsInProgressFailsThemCanceledOnly(t *testing.T) {
	shm := startEchoServer(t, "close-under-calls")
	for round := 0; round < 5; round++ {
		conn, err := isthmus.Dial(shm)
		if err != nil {
			t.Fatal(err)
		}
		client := pb.NewEchoClient(conn)
		var wg sync.WaitGroup
		codesSeen := make(chan codes.Code, 64)
		for g := 0; g < 16; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					_, err := client.Unary(testContext(t), &pb.EchoRequest{Seq: 1})
					if err != nil {
						codesSeen <- status.Code(err)
						return
					}
				}
			}()
		}
		time.Sleep(20 * time.Millisecond)
		conn.Close()
		wg.Wait()
		close(codesSeen)
		for c := range codesSeen {
			if c != codes.Canceled {
				t.Fatalf("round %d: a call during Close failed %v, not Canceled", round, c)
			}
		}
	}
}

// startEchoServer serves the echo over a fresh shm:// target until the test ends; the target.
func startEchoServer(t *testing.T, tag string) string {
	t.Helper()
	return startIsthmusServing(t, tag, &echo.Service{})
}

// startIsthmusServing starts an isthmus server of impl on a fresh shm:// name (under tag):
// its target.
func startIsthmusServing(t *testing.T, tag string, impl pb.EchoServer) string {
	t.Helper()
	shm, _ := fresh(t, tag)
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, impl)
	serving(t, s, shm)
	return shm
}

// silentClientStream ends a client-streaming call OK without sending its response.
type silentClientStream struct{ echo.Service }

func (silentClientStream) ClientStream(stream grpc.ClientStreamingServer[pb.EchoRequest, pb.Summary]) error {
	for {
		if _, err := stream.Recv(); err != nil {
			return nil
		}
	}
}

// A client-streaming call that ends OK with no response: CloseAndRecv fails Internal with
// grpc-go's cardinality error, where it returned io.EOF.
func TestCloseAndRecvWithNoResponseIsACardinalityViolation(t *testing.T) {
	shm, _ := fresh(t, "no-response")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, silentClientStream{})
	if err := s.Start(shm); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	stream, err := pb.NewEchoClient(dial(t, shm)).ClientStream(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&pb.EchoRequest{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	_, err = stream.CloseAndRecv()
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "cardinality violation: received no response") {
		t.Fatalf("CloseAndRecv on a call that sent no response: %v", err)
	}
}
