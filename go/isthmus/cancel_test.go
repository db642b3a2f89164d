package isthmus_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// Waits that happen inside the C library (for arena room, for a server with WaitForReady)
// end when the call's context is cancelled, deadline or not, as grpc-go's waits do.

// endsCanceled runs call with a context (from parent) that is cancelled 100 ms in, and
// fails t unless the call then ends with codes.Canceled (within 10 s: a generous bound, the
// test is not about speed) having waited until the cancel.
func endsCanceled(t *testing.T, parent context.Context, what string, call func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	began := time.Now()
	stop := time.AfterFunc(100*time.Millisecond, cancel)
	defer stop.Stop()
	done := make(chan error, 1)
	go func() { done <- call(ctx) }()
	select {
	case err := <-done:
		if status.Code(err) != codes.Canceled {
			t.Fatalf("%s: %v after %v, want Canceled", what, err, time.Since(began))
		}
		if el := time.Since(began); el < 100*time.Millisecond {
			t.Fatalf("%s: ended after %v, before its context was cancelled", what, el)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: still waiting 10 s after its context was cancelled", what)
	}
}

// fillArena takes blocks with alloc until none is left (blocks of each size, largest first,
// until one more is still not there when a short deadline passes) and returns them.
func fillArena(t *testing.T, alloc func(context.Context, int) (*isthmus.Block, error)) []*isthmus.Block {
	t.Helper()
	var held []*isthmus.Block
	t.Cleanup(func() {
		for _, b := range held {
			b.Release()
		}
	})
	for _, size := range []int{16 << 20, 4 << 10} {
		for i := 0; ; i++ {
			if i == 4096 {
				t.Fatalf("%d blocks of %d bytes and the arena is not full", i, size)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			b, err := alloc(ctx, size)
			// Not there by the deadline (a raw stream's says Canceled: its context ended).
			full := status.Code(err) == codes.DeadlineExceeded || err != nil && ctx.Err() != nil
			cancel()
			if full {
				break
			}
			if err != nil {
				t.Fatalf("filling the arena: a block of %d bytes: %v", size, err)
			}
			held = append(held, b)
		}
	}
	if len(held) == 0 {
		t.Fatal("no block could be taken")
	}
	return held
}

func TestACancelledContextEndsTheWaitForArenaRoom(t *testing.T) {
	shm, _ := fresh(t, "arena-cancel")
	startPeer(t, goPeerBin, shm)
	conn := dial(t, shm)
	c := pb.NewEchoClient(conn)
	held := fillArena(t, conn.Alloc)
	large := echo.Pattern(1<<20, 5) // marshalled straight into shared memory: needs a block

	bg := context.Background()
	later, cancelLater := context.WithTimeout(bg, time.Minute) // a deadline far off changes nothing
	defer cancelLater()
	for _, parent := range []context.Context{bg, later} {
		endsCanceled(t, parent, "Alloc", func(ctx context.Context) error {
			b, err := conn.Alloc(ctx, 4<<10)
			if b != nil {
				b.Release()
			}
			return err
		})
		endsCanceled(t, parent, "a large unary call", func(ctx context.Context) error {
			_, err := c.Unary(ctx, &pb.EchoRequest{Payload: large})
			return err
		})
		endsCanceled(t, parent, "a large unary call with WaitForReady", func(ctx context.Context) error {
			_, err := c.Unary(ctx, &pb.EchoRequest{Payload: large}, grpc.WaitForReady(true))
			return err
		})
	}
	// A raw stream's blocks come from the queue's connection, not Alloc's: its arena is
	// filled with blocks of streams of its own.
	streamAlloc := func(ctx context.Context, size int) (*isthmus.Block, error) {
		s, err := conn.StartRaw(ctx, "/raw.Raw/Stream")
		if err != nil {
			return nil, err
		}
		return s.Alloc(size)
	}
	held = append(held, fillArena(t, streamAlloc)...)
	for _, parent := range []context.Context{bg, later} {
		endsCanceled(t, parent, "RawStream.Alloc", func(ctx context.Context) error {
			b, err := streamAlloc(ctx, 4<<10)
			if b != nil {
				b.Release()
			}
			return err
		})
	}

	// A deadline still ends the wait with DeadlineExceeded.
	short, cancelShort := context.WithTimeout(bg, 150*time.Millisecond)
	defer cancelShort()
	if b, err := conn.Alloc(short, 4<<10); status.Code(err) != codes.DeadlineExceeded {
		if b != nil {
			b.Release()
		}
		t.Fatalf("Alloc past its deadline: %v, want DeadlineExceeded", err)
	}

	// Room again: the next calls work.
	for _, b := range held {
		b.Release()
	}
	ctx, cancel := context.WithTimeout(bg, 30*time.Second)
	defer cancel()
	r, err := c.Unary(ctx, &pb.EchoRequest{Payload: large})
	if err != nil || echo.FirstMismatch(r.Payload, 5) >= 0 {
		t.Fatalf("a large call once there is room: %v", err)
	}
	b, err := conn.Alloc(ctx, 16<<20)
	if err != nil {
		t.Fatalf("Alloc once there is room: %v", err)
	}
	want := pattern(16<<20, 3)
	copy(b.Bytes(), want)
	m, err := conn.CallRawBlock(ctx, "/raw.Raw/Echo", b)
	if err != nil || string(m.Bytes()) != string(want) {
		t.Fatalf("CallRawBlock once there is room: %v", err)
	}
	m.Release()
}

func TestACancelledContextEndsAWaitForReadyWithNoServer(t *testing.T) {
	shm, _ := fresh(t, "wfr-cancel")
	c := pb.NewEchoClient(dial(t, shm))
	large := echo.Pattern(1<<20, 11) // marshalled straight into shared memory
	bg := context.Background()
	later, cancelLater := context.WithTimeout(bg, time.Minute)
	defer cancelLater()
	for _, parent := range []context.Context{bg, later} {
		endsCanceled(t, parent, "a large call with WaitForReady", func(ctx context.Context) error {
			_, err := c.Unary(ctx, &pb.EchoRequest{Payload: large}, grpc.WaitForReady(true))
			return err
		})
		endsCanceled(t, parent, "a small call with WaitForReady", func(ctx context.Context) error {
			_, err := c.Unary(ctx, &pb.EchoRequest{Payload: []byte("small")}, grpc.WaitForReady(true))
			return err
		})
	}
	short, cancelShort := context.WithTimeout(bg, 300*time.Millisecond)
	defer cancelShort()
	if _, err := c.Unary(short, &pb.EchoRequest{Payload: large}, grpc.WaitForReady(true)); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a large call with WaitForReady past its deadline: %v, want DeadlineExceeded", err)
	}

	// A server comes: a call waiting for it goes through.
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(bg, time.Minute)
		defer cancel()
		r, err := c.Unary(ctx, &pb.EchoRequest{Payload: large}, grpc.WaitForReady(true))
		if err == nil && echo.FirstMismatch(r.Payload, 11) >= 0 {
			err = status.Error(codes.DataLoss, "the reply differs")
		}
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	startPeer(t, goPeerBin, shm)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("a large call with WaitForReady once a server is there: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call did not end once the server was up")
	}
}

// A raw stream whose deadline has passed says so: DeadlineExceeded, as grpc-go's streams do,
// not the Canceled the library reports for a call its context ended.
func TestARawStreamPastItsDeadlineSaysDeadlineExceeded(t *testing.T) {
	shm, _ := fresh(t, "raw-deadline")
	startPeer(t, goPeerBin, shm)
	conn := dial(t, shm)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	s, err := conn.StartRaw(ctx, "/raw.Raw/Stream")
	if err != nil {
		t.Fatalf("StartRaw: %v", err)
	}
	<-ctx.Done()
	// The call's end reaches the library a moment after the context's: ask until it has.
	for give := time.Now().Add(10 * time.Second); ; {
		b, err := s.Alloc(64)
		if err != nil {
			if status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("Alloc after the deadline: %v, want DeadlineExceeded", err)
			}
			return
		}
		b.Release()
		if time.Now().After(give) {
			t.Fatalf("Alloc still succeeds 10 s after the stream's deadline")
		}
		time.Sleep(time.Millisecond)
	}
}

// pollingEcho's handlers poll their context with look (ctx.Err, or context.Cause), never
// calling Done, until it reports an error (30 s at most), and hand what they saw to saw.
type pollingEcho struct {
	echo.Service
	look    func(context.Context) error
	started chan struct{}
	saw     chan error
}

func (p pollingEcho) poll(ctx context.Context) error {
	p.started <- struct{}{}
	for give := time.Now().Add(30 * time.Second); p.look(ctx) == nil && time.Now().Before(give); {
		time.Sleep(time.Millisecond)
	}
	err := p.look(ctx)
	p.saw <- err
	if err == nil {
		return status.Error(codes.Internal, "the context never ended")
	}
	return status.FromContextError(err).Err()
}

func (p pollingEcho) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	return nil, p.poll(ctx)
}

func (p pollingEcho) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	return p.poll(stream.Context())
}

// A handler that only polls ctx.Err() learns that its client cancelled the call, as with
// grpc-go: Err reports context.Canceled once the client's cancel has reached the server.
func TestAHandlerPollingErrSeesTheClientsCancel(t *testing.T) {
	checkPollingSeesCancel(t, "poll-err", context.Context.Err)
}

// So does one that polls only context.Cause(ctx). Cause finds the cancelCtx under the call's
// context through ctx.Value, which starts no watch; it asks ctx.Err first (and older Go fell
// back to Err while there was no cause), and Err starts it.
func TestAHandlerPollingCauseSeesTheClientsCancel(t *testing.T) {
	checkPollingSeesCancel(t, "poll-cause", context.Cause)
}

// checkPollingSeesCancel cancels a unary and a server-streaming call whose handler polls its
// context with look, over shm:// and unix://, and fails t unless look reports
// context.Canceled and the client Canceled.
func checkPollingSeesCancel(t *testing.T, tag string, look func(context.Context) error) {
	shm, unix := fresh(t, tag)
	impl := pollingEcho{look: look, started: make(chan struct{}, 1), saw: make(chan error, 1)}
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, impl)
	if err := s.Start(shm, unix); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	for _, target := range append([]string{shm}, s.HTTPAddresses()...) {
		c := pb.NewEchoClient(dial(t, target))
		calls := []struct {
			what string
			call func(context.Context) error
		}{
			{"unary", func(ctx context.Context) error {
				_, err := c.Unary(ctx, &pb.EchoRequest{})
				return err
			}},
			{"server-streaming", func(ctx context.Context) error {
				st, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 1})
				if err != nil {
					return err
				}
				_, err = st.Recv()
				return err
			}},
		}
		for _, tc := range calls {
			what := target + " " + tc.what
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- tc.call(ctx) }()
			select {
			case <-impl.started:
			case <-time.After(30 * time.Second):
				t.Fatalf("%s: the handler did not start within 30 s", what)
			}
			cancel()
			// The handler gives up polling after 30 s; it should have seen the cancel long before.
			select {
			case err := <-impl.saw:
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("%s: the handler's poll gave %v after the client cancelled, want context.Canceled", what, err)
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("%s: the handler did not end within 60 s", what)
			}
			if err := <-done; status.Code(err) != codes.Canceled {
				t.Fatalf("%s: the client got %v, want Canceled", what, err)
			}
		}
	}
}

// keepingEcho's unary handler hands its context, untouched, to kept and returns at once, or,
// for a request with Seq 1, first sleeps past its deadline and hands on what Err says then.
type keepingEcho struct {
	echo.Service
	kept chan context.Context
	late chan error
}

func (k keepingEcho) Unary(ctx context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	if r.Seq == 1 {
		d, ok := ctx.Deadline()
		if !ok {
			k.late <- errors.New("no deadline")
			return nil, status.Error(codes.Internal, "no deadline")
		}
		time.Sleep(time.Until(d) + 20*time.Millisecond)
		k.late <- ctx.Err() // Err is the first thing asked of the context
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	k.kept <- ctx
	return &pb.EchoReply{}, nil
}

// A handler's context is made when first asked for (no timer or cancel per call otherwise),
// yet behaves as grpc-go's: done once the call is over, however late it is first asked;
// with the client's deadline from the start; and, asked only for Err once that deadline has
// passed, DeadlineExceeded. With inline unary handlers and without.
func TestAHandlersContextIsDoneWhenItsCallIsOverAndKeepsItsDeadline(t *testing.T) {
	for _, inline := range []bool{false, true} {
		shm, _ := fresh(t, "keeping")
		impl := keepingEcho{kept: make(chan context.Context, 1), late: make(chan error, 1)}
		var opts []isthmus.ServerOption
		if inline {
			opts = append(opts, isthmus.InlineUnary())
		}
		s := isthmus.NewServer(opts...)
		pb.RegisterEchoServer(s, impl)
		if err := s.Start(shm); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		c := pb.NewEchoClient(dial(t, shm))

		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if _, err := c.Unary(ctx, &pb.EchoRequest{}); err != nil {
			t.Fatalf("inline %v: %v", inline, err)
		}
		cancel()
		kept := <-impl.kept
		if d, ok := kept.Deadline(); !ok || time.Until(d) > time.Minute || time.Until(d) < 0 {
			t.Fatalf("inline %v: the handler's deadline was %v, %v; want within a minute from the call", inline, d, ok)
		}
		// First asked now, after the call: through a context derived from it, then directly.
		derived, stop := context.WithCancel(kept)
		for i, late := range []context.Context{derived, kept} {
			select {
			case <-late.Done():
			case <-time.After(10 * time.Second):
				t.Fatalf("inline %v: context %d of a finished call is not done 10 s on", inline, i)
			}
			if !errors.Is(late.Err(), context.Canceled) {
				t.Fatalf("inline %v: context %d of a finished call says %v, want context.Canceled", inline, i, late.Err())
			}
		}
		stop()

		ctx, cancel = context.WithTimeout(context.Background(), 200*time.Millisecond)
		_, err := c.Unary(ctx, &pb.EchoRequest{Seq: 1})
		cancel()
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("inline %v: a call past its deadline gave %v", inline, err)
		}
		if late := <-impl.late; !errors.Is(late, context.DeadlineExceeded) {
			t.Fatalf("inline %v: the handler's Err past the deadline was %v, want context.DeadlineExceeded", inline, late)
		}
	}
}

// stallingEcho sends one message on a stream, or none on a unary call, then waits for its
// call's end.
type stallingEcho struct{ pb.UnimplementedEchoServer }

func (stallingEcho) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	<-ctx.Done()
	return nil, status.FromContextError(ctx.Err()).Err()
}

func (stallingEcho) ServerStream(_ *pb.StreamRequest, s grpc.ServerStreamingServer[pb.EchoReply]) error {
	if err := s.Send(&pb.EchoReply{Seq: 1}); err != nil {
		return err
	}
	<-s.Context().Done()
	return status.FromContextError(s.Context().Err()).Err()
}

// A call whose context's deadline passes fails DeadlineExceeded "context deadline exceeded",
// as grpc-go's do, every time: a stream's receive sometimes said Canceled "the call was
// cancelled" (the cancel that the context's end caused reached the receive first), and calls
// said "the call's deadline passed".
func TestACallPastItsContextsDeadlineSaysSoEveryTime(t *testing.T) {
	shm, unix := fresh(t, "ctx-deadline")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, stallingEcho{})
	serving(t, s, shm, unix)
	for _, target := range []string{shm, unix} {
		client := pb.NewEchoClient(dial(t, target))
		for i := range 10 {
			want := func(what string, err error) {
				if status.Code(err) != codes.DeadlineExceeded || status.Convert(err).Message() != "context deadline exceeded" {
					t.Errorf("%s: %s %d: %v", target, what, i, err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			stream, err := client.ServerStream(ctx, &pb.StreamRequest{Count: 1})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stream.Recv(); err != nil {
				t.Fatalf("%s: the first message: %v", target, err)
			}
			_, err = stream.Recv()
			want("a stream", err)
			cancel()
			ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
			_, err = client.Unary(ctx, &pb.EchoRequest{})
			want("a unary call", err)
			cancel()
		}
	}
}

// SendMsg after CloseSend fails, and ends the call: the stream's receives give the same error
// from then on, as grpc-go's do (isthmus's went on, the echo and then io.EOF).
func TestSendAfterCloseSendEndsTheStream(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "send-after-close") {
		stream, err := pb.NewEchoClient(conn).Bidi(testContext(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&pb.EchoRequest{Seq: 1}); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		err = stream.Send(&pb.EchoRequest{Seq: 2})
		if status.Code(err) != codes.Internal || status.Convert(err).Message() != "SendMsg called after CloseSend" {
			t.Errorf("%s: Send after CloseSend: %v", name, err)
		}
		if _, err := stream.Recv(); status.Code(err) != codes.Internal {
			t.Errorf("%s: Recv after it: %v", name, err)
		}
	}
}

// waitsForItsEnd is an Echo service whose Unary and ServerStream (after one reply) wait until
// their call ends.
type waitsForItsEnd struct{ pb.UnimplementedEchoServer }

func (waitsForItsEnd) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (waitsForItsEnd) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	if err := stream.Send(&pb.EchoReply{}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return stream.Context().Err()
}

// A call to grpc-go's server that outlives its deadline ends DeadlineExceeded, whether the
// library's timer goes off first or the server's reset at its own copy of the deadline
// (RST_STREAM CANCEL) comes first, as grpc-go's client reads such a reset. The reset won about
// one call in thirty here, and the call ended Unavailable "stream no longer needed". Each of
// these calls ends DeadlineExceeded however the race goes; the old code failed some of them.
func TestACallResetAtItsDeadlineByTheServerIsDeadlineExceeded(t *testing.T) {
	conn := dial(t, "http://"+startGrpcServing(t, waitsForItsEnd{}))
	client := pb.NewEchoClient(conn)
	wrong := map[string]int{}
	for i := 0; i < 600; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		var err error
		if i%2 == 0 {
			_, err = client.Unary(ctx, &pb.EchoRequest{})
		} else if stream, serr := client.ServerStream(ctx, &pb.StreamRequest{}); serr != nil {
			err = serr
		} else if _, err = stream.Recv(); err == nil {
			_, err = stream.Recv()
		}
		cancel()
		if status.Code(err) != codes.DeadlineExceeded {
			wrong[status.Convert(err).String()]++
		}
	}
	if len(wrong) > 0 {
		t.Errorf("calls past their deadline that ended otherwise: %v", wrong)
	}
}

// A method path with a NUL fails InvalidArgument. The C copy of the path ended at the NUL, and
// the call went to another method (here Unimplemented "unknown method Un").
func TestAMethodPathWithANulIsRefused(t *testing.T) {
	for name, conn := range map[string]*isthmus.ClientConn{
		"shm":   dial(t, startIsthmusServing(t, "nul-path", &echo.Service{})),
		"http2": dial(t, "http://"+startGrpcServing(t, &echo.Service{})),
	} {
		err := conn.Invoke(testContext(t), "/conformance.Echo/Un\x00ary", &pb.EchoRequest{}, &pb.EchoReply{})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
		desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
		if _, err := conn.NewStream(testContext(t), desc, "/conformance.Echo/Bi\x00di"); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: a stream: %v, want InvalidArgument", name, err)
		}
	}
}

// A target with a NUL fails InvalidArgument in Dial and in a server's Start: the C copy ended
// at the NUL, and the client connected to another server, the server bound another name.
func TestATargetWithANulIsRefused(t *testing.T) {
	shm, _ := fresh(t, "nul-target")
	if _, err := isthmus.Dial(shm + "\x00more"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Dial: %v, want InvalidArgument", err)
	}
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	t.Cleanup(s.Stop)
	if err := s.Start(shm + "\x00more"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Start: %v, want InvalidArgument", err)
	}
}

// A server's Alloc that waits for room in its arena, full of replies its client holds (views
// it has not released), ends when the client cancels the call: Canceled, and the handler
// returns. It waited until the client let go of memory, for ever here, holding its thread and
// the call's other sends.
func TestAnAllocWaitingForArenaRoomEndsWithItsCall(t *testing.T) {
	shm, _ := fresh(t, "alloc-ends")
	s := isthmus.NewServer()
	allocErr := make(chan error, 1)
	s.HandleRaw("/t.T/Fill", func(c *isthmus.RawServerCall) error {
		for {
			b, err := c.Alloc(1 << 20)
			if err != nil {
				allocErr <- err
				return err
			}
			if err := c.SendBlock(b); err != nil {
				allocErr <- fmt.Errorf("a send failed first: %w", err)
				return err
			}
		}
	})
	serving(t, s, shm)
	defer s.Stop()
	conn := dial(t, shm)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := conn.StartRaw(ctx, "/t.T/Fill")
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var received atomic.Int64
	reading := make(chan []*isthmus.Message)
	go func() {
		var held []*isthmus.Message // every reply, kept: the server's arena fills
		defer func() { reading <- held }()
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			held = append(held, m)
			received.Add(1)
		}
	}()
	defer func() {
		for _, m := range <-reading {
			m.Release()
		}
	}()
	// The replies stop once the arena is full (not a timer the test depends on: cancelled
	// earlier, the Alloc ends Canceled all the same).
	for last := int64(-1); received.Load() != last; time.Sleep(300 * time.Millisecond) {
		last = received.Load()
	}
	cancel()
	select {
	case err := <-allocErr:
		if status.Code(err) != codes.Canceled {
			t.Errorf("the waiting Alloc ended with %v, want Canceled", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the Alloc still waits 20 s after its call was cancelled (%d replies held)", received.Load())
	}
	t.Logf("%d replies of 1 MiB held", received.Load())
}

// A raw stream cancelled while one goroutine waits in Recv and another in SendBlock (out of
// credit: the server reads nothing) is cancelled at the server, and the send returns. When
// Recv's end of the wait finished the stream before the context's own hook ran, the hook found
// it ended and cancelled nothing: the send waited in cgo, and the handler ran on, until the
// connection closed. A race the old code seldom lost here: this test passed on it in 15
// rounds; it holds the behaviour, and fails when the race goes the other way.
func TestARawStreamCancelledDuringRecvAndSendEndsBoth(t *testing.T) {
	shm, _ := fresh(t, "raw-cancel-both")
	s := isthmus.NewServer()
	handlerSaw := make(chan error, 8)
	s.HandleRaw("/t.T/Deaf", func(c *isthmus.RawServerCall) error {
		<-c.Context().Done()
		handlerSaw <- c.Context().Err()
		return c.Context().Err()
	})
	serving(t, s, shm)
	defer s.Stop()
	conn := dial(t, shm)
	for round := 0; round < 5; round++ {
		ctx, cancel := context.WithCancel(context.Background())
		stream, err := conn.StartRaw(ctx, "/t.T/Deaf")
		if err != nil {
			t.Fatal(err)
		}
		sent := make(chan int, 64)
		sendDone := make(chan error, 1)
		go func() {
			for {
				b, err := stream.Alloc(1 << 20)
				if err == nil {
					err = stream.SendBlock(b, false)
				}
				if err != nil {
					sendDone <- err
					return
				}
				sent <- 1
			}
		}()
		recvDone := make(chan error, 1)
		go func() {
			_, err := stream.Recv()
			recvDone <- err
		}()
		// The 4 MiB window's worth: the next send waits for credit that never comes.
		for i := 0; i < 4; i++ {
			select {
			case <-sent:
			case err := <-sendDone:
				t.Fatalf("round %d: send %d: %v", round, i, err)
			case <-time.After(30 * time.Second):
				t.Fatalf("round %d: send %d took 30 s", round, i)
			}
		}
		cancel()
		for what, done := range map[string]chan error{"Recv": recvDone, "SendBlock": sendDone} {
			select {
			case err := <-done:
				if err == nil {
					t.Errorf("round %d: %s ended without an error", round, what)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("round %d: %s still waits 30 s after the cancel", round, what)
			}
		}
		select {
		case <-handlerSaw:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: the handler never saw the cancel", round)
		}
	}
}
