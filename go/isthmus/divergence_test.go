package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
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

// Behaviours where isthmus's Go binding differed from grpc-go's; each test runs the same
// scenario against grpc-go's server and client over TCP and isthmus's over shm://, and expects
// grpc-go's result.

// emptyHeaderBidi sends its initial metadata at once with md (nil or empty), then reads until
// the client's end.
type emptyHeaderBidi struct {
	echo.Service
	md metadata.MD
}

func (h emptyHeaderBidi) Bidi(stream pb.Echo_BidiServer) error {
	if err := stream.SendHeader(h.md); err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); err != nil {
			return nil
		}
	}
}

// SendHeader with no metadata sends the initial metadata all the same: the client's Header
// returns at once. It sent nothing (marking the header sent), and Header waited for the first
// response or the end.
func TestSendHeaderWithNoMetadataSendsTheHeader(t *testing.T) {
	for _, md := range []metadata.MD{nil, {}} {
		for name, conn := range besideGrpcGoServing(t, "empty-send-header", emptyHeaderBidi{md: md}) {
			label := fmt.Sprintf("%s, SendHeader(%#v)", name, md)
			ctx, cancel := context.WithCancel(testContext(t))
			stream, err := pb.NewEchoClient(conn).Bidi(ctx)
			if err != nil {
				t.Fatalf("%s: %v", label, err)
			}
			type header struct {
				md  metadata.MD
				err error
			}
			got := make(chan header, 1)
			go func() {
				md, err := stream.Header()
				got <- header{md, err}
			}()
			select {
			case h := <-got:
				if h.err != nil || h.md == nil {
					t.Errorf("%s: Header gave %v, %v", label, h.md, h.err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("%s: Header still waits 10 s after the handler's SendHeader", label)
				cancel() // ends the Header still waiting
				within(t, got, label+": Header after the cancel")
			}
			cancel()
		}
	}
}

// endBlocker is a client stats handler whose End waits, once entered, until released.
type endBlocker struct {
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func newEndBlocker() *endBlocker {
	return &endBlocker{entered: make(chan struct{}), release: make(chan struct{})}
}

func (b *endBlocker) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (b *endBlocker) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (b *endBlocker) HandleConn(context.Context, stats.ConnStats) {}
func (b *endBlocker) HandleRPC(_ context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.End); !ok || !s.IsClient() {
		return
	}
	b.once.Do(func() { close(b.entered) })
	select {
	case <-b.release:
	case <-time.After(10 * time.Second):
	}
}

// A stream whose context ends is finished before any of its operations returns that end:
// grpc.Trailer and grpc.Peer are filled in, and the stats handlers have heard End, when
// RecvMsg returns the context's error, as grpc-go's finish does under its stream's lock. The
// finish ran from the context's watcher while RecvMsg, having seen the stream ended, returned
// at once (a data race on the trailer and the peer, with the peer still empty).
func TestAStreamsEndIsCompleteWhenRecvMsgReturnsIt(t *testing.T) {
	end := map[string]*endBlocker{"grpc-go": newEndBlocker(), "isthmus": newEndBlocker()}
	conns := map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, startGrpcServer(t), grpc.WithStatsHandler(end["grpc-go"])),
		"isthmus": dialWith(t, startEchoServer(t, "end-complete"), isthmus.WithStatsHandler(end["isthmus"])),
	}
	for name, conn := range conns {
		b := end[name]
		md := metadata.Pairs("x-before", "the end")
		var p grpcpeer.Peer
		ctx, cancel := context.WithCancel(testContext(t))
		stream, err := pb.NewEchoClient(conn).Bidi(ctx, grpc.Trailer(&md), grpc.Peer(&p))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		cancel()
		within(t, b.entered, name+": End after the cancel")
		recvd := make(chan error, 1)
		go func() {
			_, err := stream.Recv()
			recvd <- err
		}()
		select {
		case err := <-recvd:
			t.Errorf("%s: Recv returned %v while the stream's end was still being reported", name, err)
			close(b.release)
		case <-time.After(300 * time.Millisecond):
			close(b.release)
			if err := within(t, recvd, name+": Recv"); status.Code(err) != codes.Canceled {
				t.Errorf("%s: Recv gave %v, want Canceled", name, err)
			}
		}
		if p.Addr == nil {
			t.Errorf("%s: grpc.Peer is empty once Recv has returned the end", name)
		}
		if md.Get("x-before") != nil {
			t.Errorf("%s: grpc.Trailer is not set once Recv has returned the end: %v", name, md)
		}
	}
}

// The same with the context ending a moment after the stream starts, RecvMsg waiting or not:
// reading what grpc.Header, grpc.Trailer and grpc.Peer filled in once RecvMsg has returned is
// no data race (go test -race).
func TestCallOptionsAreSetBeforeACancelledStreamsRecvReturns(t *testing.T) {
	conns := map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, startGrpcServer(t)),
		"isthmus": dial(t, startEchoServer(t, "cancel-race")),
	}
	for name, conn := range conns {
		client := pb.NewEchoClient(conn)
		for i := 0; i < 50; i++ {
			var header, trailer metadata.MD
			var p grpcpeer.Peer
			ctx, cancel := context.WithCancel(testContext(t))
			stream, err := client.Bidi(ctx, grpc.Header(&header), grpc.Trailer(&trailer), grpc.Peer(&p))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			stop := time.AfterFunc(time.Millisecond, cancel)
			if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
				t.Fatalf("%s: Recv gave %v, want Canceled", name, err)
			}
			if trailer == nil {
				t.Fatalf("%s: a cancelled stream's grpc.Trailer is nil, want an empty map", name)
			}
			_ = fmt.Sprint(header, trailer, p.Addr)
			stop.Stop()
			cancel()
		}
	}
}

// closableConn is a connection of either kind, to close.
type closableConn interface {
	grpc.ClientConnInterface
	Close() error
}

// connsToClose starts a grpc-go server and an isthmus echo server (on shm://name), makes one
// call first, so that what the process keeps for good is counted in the baseline, and gives a
// connection of each kind by name, and the live handles before them.
func connsToClose(t *testing.T, name string) (map[string]closableConn, int) {
	grpcAddress, shm := startGrpcServer(t), startEchoServer(t, name)
	if _, err := pb.NewEchoClient(dial(t, shm)).Unary(testContext(t), &pb.EchoRequest{}); err != nil {
		t.Fatal(err)
	}
	before := isthmus.LiveHandles()
	return map[string]closableConn{"grpc-go": newGrpcClient(t, grpcAddress), "isthmus": dial(t, shm)}, before
}

// Closing a connection finishes its open streams, as grpc-go's does (ErrClientConnClosing):
// one never read again is told (grpc.OnFinish) and frees its handle, one waiting in RecvMsg
// gets the error, and later operations say the stream is over. The never-read stream kept its
// handle for ever, and OnFinish never came.
func TestClosingTheConnectionFinishesItsStreams(t *testing.T) {
	conns, before := connsToClose(t, "close-streams")
	for name, conn := range conns {
		client := pb.NewEchoClient(conn)
		finished := make(chan error, 1)
		left, err := client.Bidi(context.Background(), grpc.OnFinish(func(err error) { finished <- err }))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := left.Send(&pb.EchoRequest{Seq: 1}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r, err := left.Recv(); err != nil || r.Seq != 1 {
			t.Fatalf("%s: %v, %v", name, r, err)
		}
		reading, err := client.Bidi(context.Background())
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		recvd := make(chan error, 1)
		go func() {
			_, err := reading.Recv()
			recvd <- err
		}()
		if err := conn.Close(); err != nil {
			t.Fatalf("%s: Close: %v", name, err)
		}
		closing := func(what string, err error) {
			if s := status.Convert(err); s.Code() != codes.Canceled || s.Message() != "grpc: the client connection is closing" {
				t.Errorf("%s: %s gave %v, want Canceled, the connection is closing", name, what, err)
			}
		}
		closing("OnFinish of the stream left", within(t, finished, name+": OnFinish"))
		closing("the waiting Recv", within(t, recvd, name+": the waiting Recv"))
		_, err = left.Recv()
		closing("Recv after Close", err)
		if err := left.Send(&pb.EchoRequest{}); err != io.EOF {
			t.Errorf("%s: Send after Close gave %v, want io.EOF", name, err)
		}
	}
	eventually(t, "the streams' handles freed", func() bool { return isthmus.LiveHandles() <= before })
}

// Close while streams end by themselves (their contexts cancelled, their receives under way)
// finishes each stream once, deadlocks on none, and frees every handle.
func TestCloseWhileStreamsEndFinishesEachOnce(t *testing.T) {
	conns, before := connsToClose(t, "close-while-ending")
	for name, conn := range conns {
		client := pb.NewEchoClient(conn)
		const n = 40
		var finishes sync.WaitGroup
		var counts [n]atomic.Int32
		var cancels []context.CancelFunc
		finishes.Add(n)
		for i := 0; i < n; i++ {
			ctx, cancel := context.WithCancel(context.Background())
			cancels = append(cancels, cancel)
			stream, err := client.Bidi(ctx, grpc.OnFinish(func(error) {
				if counts[i].Add(1) == 1 {
					finishes.Done()
				}
			}))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if i%2 == 0 {
				go stream.Recv()
			}
		}
		start := make(chan struct{})
		var ending sync.WaitGroup
		for i, cancel := range cancels {
			if i%4 < 2 {
				ending.Add(1)
				go func() {
					defer ending.Done()
					<-start
					cancel()
				}()
			}
		}
		close(start)
		closed := make(chan error, 1)
		go func() { closed <- conn.Close() }()
		if err := within(t, closed, name+": Close"); err != nil {
			t.Errorf("%s: Close: %v", name, err)
		}
		ending.Wait()
		all := make(chan struct{})
		go func() {
			finishes.Wait()
			close(all)
		}()
		within(t, all, name+": every stream's OnFinish")
		for i := range counts {
			if c := counts[i].Load(); c != 1 {
				t.Errorf("%s: stream %d finished %d times", name, i, c)
			}
		}
		for _, cancel := range cancels {
			cancel()
		}
	}
	eventually(t, "the streams' handles freed", func() bool { return isthmus.LiveHandles() <= before })
}

// stuckBidi never reads its requests: a client that sends enough waits for flow control.
type stuckBidi struct{ echo.Service }

func (stuckBidi) Bidi(stream pb.Echo_BidiServer) error {
	<-stream.Context().Done()
	return stream.Context().Err()
}

// A SendMsg whose wait for flow control the stream's context ends returns io.EOF, as grpc-go's
// does for every failed write; RecvMsg gives the status. It returned Canceled.
func TestASendInterruptedByItsContextSaysEOF(t *testing.T) {
	for name, conn := range besideGrpcGoServing(t, "send-interrupted", stuckBidi{}) {
		ctx, cancel := context.WithCancel(testContext(t))
		stream, err := pb.NewEchoClient(conn).Bidi(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		sent := make(chan struct{}, 1)
		failed := make(chan error, 1)
		go func() {
			req := &pb.EchoRequest{Payload: make([]byte, 64<<10)}
			for {
				if err := stream.Send(req); err != nil {
					failed <- err
					return
				}
				select {
				case sent <- struct{}{}:
				default:
				}
			}
		}()
		// Sends go until the windows are full; one that has waited a second waits for credit.
		give := time.After(30 * time.Second)
	waiting:
		for {
			select {
			case <-sent:
			case err := <-failed:
				t.Fatalf("%s: a send failed before the cancel: %v", name, err)
			case <-time.After(time.Second):
				break waiting
			case <-give:
				t.Fatalf("%s: sends still go through after 30 s", name)
			}
		}
		cancel()
		if err := within(t, failed, name+": the waiting send"); err != io.EOF {
			t.Errorf("%s: a send its context interrupted gave %v, want io.EOF", name, err)
		}
		if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
			t.Errorf("%s: Recv gave %v, want Canceled", name, err)
		}
	}
}

// A server-streaming call whose SendMsg finds it over (its context ended) gives nil there, as
// grpc-go's does, and the status from RecvMsg: the generated client returns SendMsg's error
// from the call itself, and isthmus's io.EOF made the call return io.EOF, status Unknown.
func TestASendOfAServerStreamingCallThatIsOverGivesNilAsOnGrpcGo(t *testing.T) {
	desc := &grpc.StreamDesc{ServerStreams: true}
	for name, conn := range besideGrpcGo(t, "one-request-over") {
		ctx, cancel := context.WithCancel(testContext(t))
		stream, err := conn.NewStream(ctx, desc, "/conformance.Echo/ServerStream")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		cancel()
		if err := stream.SendMsg(&pb.StreamRequest{Count: 1}); err != nil {
			t.Errorf("%s: SendMsg on a call that is over gave %v, want nil", name, err)
		}
		if err := stream.RecvMsg(&pb.EchoReply{}); status.Code(err) != codes.Canceled {
			t.Errorf("%s: RecvMsg gave %v, want Canceled", name, err)
		}
	}
}

// ignoresFailedSends sends a response, then one over the server's send limit, then another,
// ignoring both errors, and returns nil.
type ignoresFailedSends struct{ echo.Service }

func (ignoresFailedSends) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	_ = stream.Send(&pb.EchoReply{Seq: 1})
	_ = stream.Send(&pb.EchoReply{Seq: 2, Payload: make([]byte, 2000)})
	_ = stream.Send(&pb.EchoReply{Seq: 3})
	return nil
}

// A response over MaxSendMsgSize ends the call ResourceExhausted at once, as grpc-go's SendMsg
// writes its status: a handler that ignores the error and returns nil does not end it OK, and
// what it sends after goes nowhere. isthmus's ended the call OK with the third message.
func TestAFailedSendEndsTheCallAsOnGrpcGo(t *testing.T) {
	shm, _ := fresh(t, "failed-send")
	s := isthmus.NewServer(isthmus.MaxSendMessageSize(1000))
	pb.RegisterEchoServer(s, ignoresFailedSends{})
	serving(t, s, shm)
	conns := map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, startGrpcServing(t, ignoresFailedSends{}, grpc.MaxSendMsgSize(1000))),
		"isthmus": dial(t, shm),
	}
	for name, conn := range conns {
		stream, err := pb.NewEchoClient(conn).ServerStream(testContext(t), &pb.StreamRequest{})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if m, err := stream.Recv(); err != nil || m.Seq != 1 {
			t.Fatalf("%s: want seq 1, got %v, %v", name, m, err)
		}
		m, err := stream.Recv()
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "larger than max") {
			t.Errorf("%s: after the failed send got %v, %v; want ResourceExhausted", name, m, err)
		}
	}
}

// ignoresBadRequests counts the requests it could read, skipping those that fail.
type ignoresBadRequests struct{ echo.Service }

func (ignoresBadRequests) ClientStream(stream grpc.ClientStreamingServer[pb.EchoRequest, pb.Summary]) error {
	var n uint64
	for {
		_, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&pb.Summary{Count: n})
		}
		if err == nil {
			n++
		}
		if status.Code(err) == codes.Canceled {
			return err
		}
	}
}

// A request that does not unmarshal ends the call Internal at once, as grpc-go's RecvMsg
// writes its status (stream.go: a RecvMsg error other than io.EOF): a handler that ignores
// the error does not end the call OK. (A raw client sends the bytes; grpc-go's client has no
// raw tier, so the test runs on isthmus only.)
func TestARequestThatDoesNotUnmarshalEndsTheCall(t *testing.T) {
	conn := dial(t, startIsthmusServing(t, "bad-request", ignoresBadRequests{}))
	stream, err := conn.StartRaw(testContext(t), "/conformance.Echo/ClientStream")
	if err != nil {
		t.Fatal(err)
	}
	good, _ := proto.Marshal(&pb.EchoRequest{Seq: 1})
	for _, b := range [][]byte{{0xff, 0xff, 0xff}, good} {
		if err := stream.Send(b, false); err != nil && err != io.EOF {
			t.Fatal(err)
		}
	}
	_ = stream.CloseSend()
	m, err := stream.Recv()
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "unmarshal") {
		t.Errorf("got %v, %v; want Internal, failed to unmarshal", m, err)
	}
	if m != nil {
		m.Release()
	}
}

// The one request of a call whose client does not stream goes with the half-close, as with
// grpc-go: a second SendMsg fails (and ends the call) as one after CloseSend does. It went to
// the server.
func TestASecondRequestWhereOneIsDueFailsAsOnGrpcGo(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "second-request") {
		desc := &grpc.StreamDesc{ServerStreams: true}
		stream, err := conn.NewStream(testContext(t), desc, pb.Echo_ServerStream_FullMethodName)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := stream.SendMsg(&pb.StreamRequest{Count: 1}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		err = stream.SendMsg(&pb.StreamRequest{Count: 1})
		if s := status.Convert(err); s.Code() != codes.Internal || s.Message() != "SendMsg called after CloseSend" {
			t.Errorf("%s: a second SendMsg gave %v", name, err)
		}
		if err := stream.RecvMsg(&pb.EchoReply{}); status.Code(err) != codes.Internal {
			t.Errorf("%s: RecvMsg after it: %v, want Internal", name, err)
		}
	}
}

// headerAfterSent checks what its streams' SetHeader and SetTrailer say once the header went,
// and what grpc.SetHeader and grpc.SetTrailer say once a unary call is over.
type headerAfterSent struct {
	echo.Service
	saw   chan []error
	after chan struct{}
}

func (h headerAfterSent) Bidi(stream pb.Echo_BidiServer) error {
	if err := stream.SendHeader(metadata.Pairs("x-h", "1")); err != nil {
		return err
	}
	h.saw <- []error{stream.SetHeader(nil), stream.SetHeader(metadata.MD{}), stream.SetHeader(metadata.Pairs("x-late", "1"))}
	return nil
}

func (h headerAfterSent) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	go func() {
		<-h.after // the client has the reply: the call is over
		h.saw <- []error{
			grpc.SetTrailer(ctx, metadata.MD{}),
			grpc.SetTrailer(ctx, metadata.Pairs("x-late", "1")),
			grpc.SetHeader(ctx, metadata.Pairs("x-late", "1")),
		}
	}()
	return &pb.EchoReply{}, nil
}

// Empty metadata given to SetHeader once the header went is no error, as on grpc-go (it was
// Internal); metadata given to grpc.SetTrailer or grpc.SetHeader once the call is over fails
// with grpc-go's error (nil before).
func TestHeadersAndTrailersGivenLateAreAnsweredAsOnGrpcGo(t *testing.T) {
	h := headerAfterSent{saw: make(chan []error, 1), after: make(chan struct{})}
	late := status.Error(codes.Internal, "transport: SendHeader called multiple times")
	for name, conn := range besideGrpcGoServing(t, "late-metadata", h) {
		client := pb.NewEchoClient(conn)
		ctx := testContext(t)
		stream, err := client.Bidi(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := stream.Recv(); err != io.EOF {
			t.Fatalf("%s: %v", name, err)
		}
		check := func(what string, got []error, want ...error) {
			for i := range want {
				if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) {
					t.Errorf("%s: %s #%d gave %v, want %v", name, what, i, got[i], want[i])
				}
			}
		}
		check("a stream's SetHeader after SendHeader", within(t, h.saw, name), nil, nil, late)
		if _, err := client.Unary(ctx, &pb.EchoRequest{}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		h.after <- struct{}{}
		check("grpc.SetTrailer, grpc.SetHeader after the call", within(t, h.saw, name), nil, late, late)
	}
}

// Header gives a copy of the initial metadata each time, apart from grpc.Header's, as grpc-go
// does: a caller that changes what it got changes nobody else's. It gave the map it kept.
func TestAStreamsHeaderIsACopy(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "header-copy") {
		var option metadata.MD
		ctx := metadata.AppendToOutgoingContext(testContext(t), "x-echo-stream", "v")
		stream, err := pb.NewEchoClient(conn).Bidi(ctx, grpc.Header(&option))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		first, err := stream.Header()
		if err != nil || fmt.Sprint(first.Get("x-echo-stream")) != "[v]" {
			t.Fatalf("%s: Header %v, %v", name, first, err)
		}
		first.Set("x-echo-stream", "changed")
		first.Set("x-added", "1")
		second, _ := stream.Header()
		if fmt.Sprint(second.Get("x-echo-stream")) != "[v]" || second.Get("x-added") != nil {
			t.Errorf("%s: a change to what Header gave shows in the next Header: %v", name, second)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != io.EOF {
			t.Fatalf("%s: %v", name, err)
		}
		second.Set("x-echo-stream", "changed")
		if fmt.Sprint(option.Get("x-echo-stream")) != "[v]" || option.Get("x-added") != nil {
			t.Errorf("%s: a change to what Header gave shows in grpc.Header's: %v", name, option)
		}
	}
}

// sendsHeaderThenReads sends its initial metadata at once, then waits for requests.
type sendsHeaderThenReads struct{ echo.Service }

func (sendsHeaderThenReads) Bidi(stream pb.Echo_BidiServer) error {
	if err := stream.SendHeader(metadata.Pairs("x-h", "1")); err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); err != nil {
			return nil
		}
	}
}

// Header returns the initial metadata the handler sent while another goroutine waits in
// RecvMsg, as grpc-go's does. Waits on the engine's fix (the Header waited for the receive).
func TestHeaderReturnsWhileARecvWaits(t *testing.T) {
	for name, conn := range besideGrpcGoServing(t, "header-while-recv", sendsHeaderThenReads{}) {
		ctx, cancel := context.WithCancel(testContext(t))
		stream, err := pb.NewEchoClient(conn).Bidi(ctx)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		recvd := make(chan error, 1)
		go func() {
			_, err := stream.Recv()
			recvd <- err
		}()
		time.Sleep(100 * time.Millisecond) // the Recv waits meanwhile
		got := make(chan error, 1)
		go func() {
			md, err := stream.Header()
			if err == nil && fmt.Sprint(md.Get("x-h")) != "[1]" {
				err = fmt.Errorf("header %v", md)
			}
			got <- err
		}()
		select {
		case err := <-got:
			if err != nil {
				t.Errorf("%s: %v", name, err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s: Header still waits 5 s after the handler's SendHeader, with a Recv waiting", name)
			cancel()
			within(t, got, name+": Header after the cancel")
		}
		cancel()
		within(t, recvd, name+": Recv after the cancel")
	}
}

// GracefulStop, which gives the calls in progress all the time they take, still returns once
// they have finished, and they finish OK.
func TestGracefulStopReturnsOnceTheCallsFinish(t *testing.T) {
	shm, _ := fresh(t, "graceful")
	sleeping := make(chan uint64, 1)
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{UnarySleeping: func(seq uint64) { sleeping <- seq }})
	serving(t, s, shm)
	client, ctx := pb.NewEchoClient(dial(t, shm)), testContext(t)
	ended := make(chan error, 1)
	go func() {
		_, err := client.Unary(ctx, &pb.EchoRequest{Seq: 1, SleepMs: 500})
		ended <- err
	}()
	within(t, sleeping, "the call in its handler")
	stopped := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(stopped)
	}()
	if err := within(t, ended, "the call"); err != nil {
		t.Errorf("the call in progress during GracefulStop: %v", err)
	}
	within(t, stopped, "GracefulStop's return")
}

// endWatcher is a Bidi handler that answers the client's first request, then either reads
// (reads) or sends until its stream fails, and reports what the failure and its context
// said at that moment.
type endWatcher struct {
	echo.Service
	reads bool
	saw   chan streamEnd
}

// streamEnd is what a handler saw when its stream failed.
type streamEnd struct {
	err    error // the failed Recv's or Send's
	ctxErr error // the stream's context's error right then
}

func (h endWatcher) Bidi(stream pb.Echo_BidiServer) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	if err := stream.Send(&pb.EchoReply{}); err != nil {
		return err
	}
	var err error
	for err == nil {
		if h.reads {
			_, err = stream.Recv()
		} else {
			err = stream.Send(&pb.EchoReply{Payload: make([]byte, 1024)})
		}
	}
	h.saw <- streamEnd{err, stream.Context().Err()}
	return err
}

// answered opens a Bidi call on conn and has its first request answered (by endWatcher,
// which then reads or sends until the call ends).
func answered(t *testing.T, label string, conn grpc.ClientConnInterface, ctx context.Context) {
	t.Helper()
	stream, err := pb.NewEchoClient(conn).Bidi(ctx)
	if err == nil {
		err = stream.Send(&pb.EchoRequest{})
	}
	if err == nil {
		_, err = stream.Recv()
	}
	if err != nil {
		t.Fatalf("%s: %v", label, err)
	}
}

// A handler whose Recv or Send fails because its client cancelled finds its context ended
// already, and the error Canceled "context canceled", as on grpc-go, whose handlers commonly
// tell a client that left by ctx.Err() after such an error. Here the context learned of the
// cancel from an event of its own, which came up to a millisecond after the failure (6-17
// in 20 sends, up to 11 in 20 receives found it still live).
func TestAHandlersContextHasEndedWhenItsStreamSaysTheClientCancelled(t *testing.T) {
	for _, reads := range []bool{true, false} {
		h := endWatcher{reads: reads, saw: make(chan streamEnd, 1)}
		for name, conn := range besideGrpcGoServing(t, "client-cancelled", h) {
			label := fmt.Sprintf("%s, the handler's %s", name, map[bool]string{true: "Recv", false: "Send"}[reads])
			for round := 0; round < 20; round++ {
				ctx, cancel := context.WithCancel(testContext(t))
				answered(t, label, conn, ctx)
				cancel()
				end := within(t, h.saw, label)
				if end.ctxErr != context.Canceled {
					t.Fatalf("%s, round %d: the stream failed (%v) with its context's error %v, want context.Canceled", label, round, end.err, end.ctxErr)
				}
				if s := status.Convert(end.err); s.Code() != codes.Canceled || s.Message() != "context canceled" {
					t.Fatalf("%s, round %d: the stream failed %v, want Canceled \"context canceled\"", label, round, end.err)
				}
			}
		}
	}
}

// Stop ends a handler waiting in Recv as grpc-go's does: Canceled "context canceled", with its
// context ended. It said Unavailable "the connection was closed by this side", often with the
// context still live.
func TestStopEndsAHandlerWaitingInRecvWithItsContext(t *testing.T) {
	h := endWatcher{reads: true, saw: make(chan streamEnd, 1)}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterEchoServer(gs, h)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	shm, _ := fresh(t, "stop-in-recv")
	is := isthmus.NewServer()
	pb.RegisterEchoServer(is, h)
	serving(t, is, shm)
	servers := map[string]struct {
		conn grpc.ClientConnInterface
		stop func()
	}{
		"grpc-go": {newGrpcClient(t, lis.Addr().String()), gs.Stop},
		"isthmus": {dial(t, shm), is.Stop},
	}
	for name, s := range servers {
		answered(t, name, s.conn, testContext(t))
		s.stop()
		end := within(t, h.saw, name+": the handler's Recv after Stop")
		if end.ctxErr != context.Canceled {
			t.Errorf("%s: Recv failed (%v) with its context's error %v, want context.Canceled", name, end.err, end.ctxErr)
		}
		if s := status.Convert(end.err); s.Code() != codes.Canceled || s.Message() != "context canceled" {
			t.Errorf("%s: Recv failed %v, want Canceled \"context canceled\"", name, end.err)
		}
	}
}

// A client stream's Context ends once the call is over, as grpc-go's does: whatever waits on
// it to clean up after the stream runs then. It was the caller's context, live until the
// caller's own end.
func TestAClientStreamsContextEndsWithTheCall(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "stream-context") {
		for _, early := range []bool{true, false} {
			label := fmt.Sprintf("%s, Context asked for %s the end", name, map[bool]string{true: "before", false: "after"}[early])
			stream, err := pb.NewEchoClient(conn).ServerStream(testContext(t), &pb.StreamRequest{Count: 2})
			if err != nil {
				t.Fatalf("%s: %v", label, err)
			}
			var ctx context.Context
			if early {
				ctx = stream.Context()
			}
			for err == nil {
				_, err = stream.Recv()
			}
			if err != io.EOF {
				t.Fatalf("%s: the stream ended %v", label, err)
			}
			if !early {
				ctx = stream.Context()
			}
			if ctx.Err() != context.Canceled {
				t.Errorf("%s: the stream's context's error after its end is %v, want context.Canceled", label, ctx.Err())
			}
		}
	}
}

// deadlineWatcher is a ServerStream handler that sends until its stream fails, and reports
// what the failure and its context said then.
type deadlineWatcher struct {
	echo.Service
	saw chan streamEnd
}

func (h deadlineWatcher) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	var err error
	for err == nil {
		err = stream.Send(&pb.EchoReply{Payload: make([]byte, 16<<10)})
	}
	h.saw <- streamEnd{err, stream.Context().Err()}
	return err
}

// A handler whose Send fails at its call's deadline (its client reads nothing, so the send
// waits for flow control until then) finds its context ended, and the error says what the
// context's does: grpc-go's says Canceled or DeadlineExceeded as its client's cancel at the
// deadline or its own timer comes first (here, Canceled); isthmus's, whose library tells the
// deadline as the call being over, is DeadlineExceeded once Go's timer has ended the context.
func TestAHandlersSendAtItsDeadlineSaysWhatItsContextSays(t *testing.T) {
	h := deadlineWatcher{saw: make(chan streamEnd, 1)}
	for name, conn := range besideGrpcGoServing(t, "send-deadline", h) {
		ctx, cancel := context.WithTimeout(testContext(t), 300*time.Millisecond)
		if _, err := pb.NewEchoClient(conn).ServerStream(ctx, &pb.StreamRequest{Count: 1}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		end := within(t, h.saw, name+": the handler's failed Send")
		cancel()
		if end.ctxErr == nil {
			t.Fatalf("%s: Send failed (%v) with its context still live", name, end.err)
		}
		if want := status.FromContextError(end.ctxErr); status.Code(end.err) != want.Code() || status.Convert(end.err).Message() != want.Message() {
			t.Errorf("%s: Send failed %v where its context says %v", name, end.err, end.ctxErr)
		}
		if name == "isthmus" && end.ctxErr != context.DeadlineExceeded {
			t.Errorf("%s: the context ended %v at the deadline", name, end.ctxErr)
		}
	}
}

// A call to a service the server does not have, or to a method its service lacks, fails
// Unimplemented in grpc-go's words: the server answers it. The library answered "method
// /nope.Svc/M is not implemented by this server".
func TestAnUnknownServiceOrMethodIsAnsweredInGrpcGosWords(t *testing.T) {
	want := map[string]string{
		"/nope.Svc/M":            "unknown service nope.Svc",
		"/conformance.Echo/Nope": "unknown method Nope for service conformance.Echo",
	}
	for name, conn := range besideGrpcGo(t, "unknown-method") {
		for path, words := range want {
			err := conn.Invoke(testContext(t), path, &pb.EchoRequest{}, &pb.EchoReply{})
			if s := status.Convert(err); s.Code() != codes.Unimplemented || s.Message() != words {
				t.Errorf("%s: a unary call of %s gave %v, want Unimplemented %q", name, path, err, words)
			}
			desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
			stream, err := conn.NewStream(testContext(t), desc, path)
			if err == nil {
				err = stream.RecvMsg(&pb.EchoReply{})
			}
			if s := status.Convert(err); s.Code() != codes.Unimplemented || s.Message() != words {
				t.Errorf("%s: a stream of %s gave %v, want Unimplemented %q", name, path, err, words)
			}
		}
	}
}

// A unary call its context ends leaves no earlier call's metadata in the variables of
// grpc.Header and grpc.Trailer, as grpc-go's does (it sets them after every call): the
// isthmus client returned before it touched them, and a variable reused across calls kept the
// last call's header and trailer.
func TestACallItsContextEndsLeavesNoStaleMetadata(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "stale-metadata") {
		client := pb.NewEchoClient(conn)
		header, trailer := metadata.Pairs("stale", "h"), metadata.Pairs("stale", "t")
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		_, err := client.Unary(ctx, &pb.EchoRequest{SleepMs: 10_000}, grpc.Header(&header), grpc.Trailer(&trailer))
		cancel()
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("%s: %v, want DeadlineExceeded", name, err)
		}
		if len(header) != 0 || len(trailer) != 0 {
			t.Errorf("%s: after the deadline grpc.Header gave %v and grpc.Trailer %v, want neither", name, header, trailer)
		}
		// A map, not nil, as grpc-go's (a copy of the stream's): Set on isthmus's nil panicked.
		if trailer == nil {
			t.Errorf("%s: grpc.Trailer gave nil, want an empty map", name)
		}
	}
}

// The initial metadata a client gets (Header, grpc.Header) hold the response's content-type,
// as grpc-go's do. They lacked it.
func TestTheHeaderHoldsTheContentType(t *testing.T) {
	contentType := func(md metadata.MD) string { return fmt.Sprint(md.Get("content-type")) }
	for name, conn := range besideGrpcGo(t, "header-content-type") {
		client := pb.NewEchoClient(conn)
		ctx := testContext(t)
		var header metadata.MD
		if _, err := client.Unary(ctx, &pb.EchoRequest{}, grpc.Header(&header)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if contentType(header) != "[application/grpc]" {
			t.Errorf("%s: a unary call's grpc.Header is %v", name, header)
		}
		header = nil
		failing := metadata.AppendToOutgoingContext(ctx, "x-echo", "v")
		if _, err := client.Unary(failing, &pb.EchoRequest{FailWith: int32(codes.NotFound)}, grpc.Header(&header)); status.Code(err) != codes.NotFound {
			t.Fatalf("%s: %v", name, err)
		}
		if contentType(header) != "[application/grpc]" || fmt.Sprint(header.Get("x-echo")) != "[v]" {
			t.Errorf("%s: the grpc.Header of a unary call that failed after its header is %v", name, header)
		}
		header = nil
		stream, err := client.ServerStream(ctx, &pb.StreamRequest{Count: 1}, grpc.Header(&header))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		md, err := stream.Header()
		if err != nil || contentType(md) != "[application/grpc]" {
			t.Errorf("%s: a stream's Header gave %v, %v", name, md, err)
		}
		for err == nil {
			_, err = stream.Recv()
		}
		if err != io.EOF {
			t.Fatalf("%s: %v", name, err)
		}
		if contentType(header) != "[application/grpc]" {
			t.Errorf("%s: a stream's grpc.Header is %v", name, header)
		}
	}
}

// A call that fails with no initial metadata sets grpc.Header's to nil, as grpc-go does: a
// variable used for an earlier call keeps nothing of it. It was left as it was.
func TestGrpcHeaderOfACallThatFailedWithoutOneIsNil(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "header-none") {
		client := pb.NewEchoClient(conn)
		ctx := testContext(t)
		header := metadata.Pairs("x-earlier", "1")
		if _, err := client.Unary(ctx, &pb.EchoRequest{FailWith: int32(codes.NotFound)}, grpc.Header(&header)); status.Code(err) != codes.NotFound {
			t.Fatalf("%s: %v", name, err)
		}
		if header != nil {
			t.Errorf("%s: a failed unary call left grpc.Header's %v", name, header)
		}
		header = metadata.Pairs("x-earlier", "1")
		stream, err := client.Bidi(ctx, grpc.Header(&header))
		if err == nil {
			err = stream.Send(&pb.EchoRequest{FailWith: int32(codes.NotFound)})
		}
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := stream.Recv(); status.Code(err) != codes.NotFound {
			t.Fatalf("%s: %v", name, err)
		}
		if header != nil {
			t.Errorf("%s: a failed stream left grpc.Header's %v", name, header)
		}
	}
}

// Outgoing metadata whose key has an upper-case letter, as a metadata.MD literal may hold,
// fails the call Internal, as grpc-go's client checks the keys as written. The key went out
// lowercased.
func TestAnUpperCaseOutgoingKeyFailsTheCall(t *testing.T) {
	want := `header key "X-Key" contains illegal characters not in [0-9a-z-_.]`
	for name, conn := range besideGrpcGo(t, "upper-case-key") {
		client := pb.NewEchoClient(conn)
		ctx := metadata.NewOutgoingContext(testContext(t), metadata.MD{"X-Key": {"v"}})
		_, err := client.Unary(ctx, &pb.EchoRequest{})
		if s := status.Convert(err); s.Code() != codes.Internal || s.Message() != want {
			t.Errorf("%s: a unary call gave %v, want Internal %q", name, err, want)
		}
		_, err = client.Bidi(ctx)
		if s := status.Convert(err); s.Code() != codes.Internal || s.Message() != want {
			t.Errorf("%s: a stream gave %v, want Internal %q", name, err, want)
		}
		// The same pair through metadata.Pairs, which lowercases it, goes.
		ok := metadata.NewOutgoingContext(testContext(t), metadata.Pairs("X-Key", "v"))
		if _, err := client.Unary(ok, &pb.EchoRequest{}); err != nil {
			t.Errorf("%s: a key lowercased by metadata.Pairs: %v", name, err)
		}
	}
}

// oneRequestDesc is a method that takes one request and streams replies, whose handler reads
// the request as RecvMsg gives it and reports what its stream says after that.
func oneRequestDesc(saw chan<- []error) *grpc.ServiceDesc {
	type service interface{}
	return &grpc.ServiceDesc{
		ServiceName: "divergence.OneRequest",
		HandlerType: (*service)(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Call", ServerStreams: true, Handler: func(_ any, stream grpc.ServerStream) error {
			first := stream.RecvMsg(&pb.EchoRequest{})
			second := stream.RecvMsg(&pb.EchoRequest{})
			ctxErr := stream.Context().Err()
			sent := stream.SendMsg(&pb.EchoReply{Seq: 1})
			saw <- []error{first, second, ctxErr, sent}
			return status.Error(codes.Aborted, "what the handler returned")
		}}},
	}
}

// A method that takes one request, called with none or two: RecvMsg's cardinality failure ends
// the call at once, as grpc-go's does, so the client gets it whatever the handler does next;
// a second RecvMsg says it again where none came, and io.EOF after two (on grpc-go, the
// context's error when the failure closed the stream before the client's half-close came);
// the handler's context has ended, and its SendMsg fails Canceled. The call went on: RecvMsg
// said io.EOF, the reply went, and the client got the handler's status.
func TestACardinalityFailureOfRecvMsgEndsTheCall(t *testing.T) {
	saw := make(chan []error, 1)
	desc := oneRequestDesc(saw)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	gs.RegisterService(desc, struct{}{})
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	shm, _ := fresh(t, "one-request")
	is := isthmus.NewServer()
	is.RegisterService(desc, struct{}{})
	serving(t, is, shm)
	conns := map[string]grpc.ClientConnInterface{"grpc-go": newGrpcClient(t, lis.Addr().String()), "isthmus": dial(t, shm)}
	none := status.Error(codes.Internal, "cardinality violation: received no request message from non-client-streaming RPC")
	many := status.Error(codes.Internal, "cardinality violation: received multiple request messages for non-client-streaming RPC")
	canceled := status.Error(codes.Canceled, "context canceled")
	for name, conn := range conns {
		for requests, want := range map[int][][]error{
			0: {{none}, {none}, {context.Canceled}, {canceled}},
			2: {{many}, {io.EOF, canceled}, {context.Canceled}, {canceled}},
		} {
			label := fmt.Sprintf("%s, %d requests", name, requests)
			// The client's side streams, so that it may send other than one request.
			stream, err := conn.NewStream(testContext(t), &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/divergence.OneRequest/Call")
			if err != nil {
				t.Fatalf("%s: %v", label, err)
			}
			for i := 0; i < requests; i++ {
				if err := stream.SendMsg(&pb.EchoRequest{}); err != nil {
					t.Fatalf("%s: %v", label, err)
				}
			}
			if err := stream.CloseSend(); err != nil {
				t.Fatalf("%s: %v", label, err)
			}
			got := within(t, saw, label+": the handler")
			for i, what := range []string{"RecvMsg", "a second RecvMsg", "the context", "SendMsg"} {
				if !slices.ContainsFunc(want[i], func(e error) bool { return fmt.Sprint(e) == fmt.Sprint(got[i]) }) {
					t.Errorf("%s: %s gave %v, want one of %v", label, what, got[i], want[i])
				}
			}
			if err := stream.RecvMsg(&pb.EchoReply{}); fmt.Sprint(err) != fmt.Sprint(want[0][0]) {
				t.Errorf("%s: the client got %v, want %v", label, err, want[0][0])
			}
		}
	}
}
