package isthmus_test

import (
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// Interceptors on both sides, over shm:// and unix:// between an isthmus client and server in
// this process, and the same interceptors between a plain grpc-go client and server, which
// must run them in the same order.

// events records what interceptors did, in order.
type events struct {
	mu   sync.Mutex
	list []string
}

func (e *events) add(s string) {
	e.mu.Lock()
	e.list = append(e.list, s)
	e.mu.Unlock()
}

// take is what was recorded since the last take.
func (e *events) take() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	l := e.list
	e.list = nil
	return l
}

// Each interceptor records "name>" on the way in and "<name" on the way out.

func unaryClientRec(e *events, name string) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		e.add(name + ">")
		err := invoker(ctx, method, req, reply, cc, opts...)
		e.add("<" + name)
		return err
	}
}

func streamClientRec(e *events, name string) grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		e.add(name + ">")
		s, err := streamer(ctx, desc, cc, method, opts...)
		e.add("<" + name)
		return s, err
	}
}

func unaryServerRec(e *events, name string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		e.add(name + ">")
		reply, err := handler(ctx, req)
		e.add("<" + name)
		return reply, err
	}
}

func streamServerRec(e *events, name string) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		e.add(name + ">")
		err := handler(srv, ss)
		e.add("<" + name)
		return err
	}
}

// startGrpcServer serves the Echo service with grpc-go on 127.0.0.1 until the test ends; its
// address is host:port.
func startGrpcServer(t *testing.T, opts ...grpc.ServerOption) string {
	t.Helper()
	return startGrpcServing(t, &echo.Service{}, opts...)
}

// startGrpcServing starts a grpc-go server of impl on a free local port: its address.
func startGrpcServing(t *testing.T, impl pb.EchoServer, opts ...grpc.ServerOption) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(opts...)
	pb.RegisterEchoServer(s, impl)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// besideGrpcGo is a client of grpc-go's Echo server and one of isthmus's (started under tag),
// by name: for tests that run the same code against both and expect the same.
func besideGrpcGo(t *testing.T, tag string) map[string]grpc.ClientConnInterface {
	t.Helper()
	return besideGrpcGoServing(t, tag, &echo.Service{})
}

// besideGrpcGoServing is besideGrpcGo with impl as both servers' Echo service.
func besideGrpcGoServing(t *testing.T, tag string, impl pb.EchoServer) map[string]grpc.ClientConnInterface {
	t.Helper()
	return map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, startGrpcServing(t, impl)),
		"isthmus": dial(t, startIsthmusServing(t, tag, impl)),
	}
}

// newGrpcClient is a plain grpc-go client of address (plaintext), closed when the test ends.
func newGrpcClient(t *testing.T, address string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(address, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func dialWith(t *testing.T, target string, opts ...isthmus.DialOption) *isthmus.ClientConn {
	t.Helper()
	conn, err := isthmus.Dial(target, opts...)
	if err != nil {
		t.Fatalf("dial %s: %v", target, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// callsOrder makes a unary and a server-streaming call on conn and gives what the client's
// and the server's interceptors recorded for each.
func callsOrder(t *testing.T, label string, conn grpc.ClientConnInterface, client, server *events) (unaryC, unaryS, streamC, streamS []string) {
	t.Helper()
	ctx := testContext(t)
	c := pb.NewEchoClient(conn)
	if _, err := c.Unary(ctx, &pb.EchoRequest{}); err != nil {
		t.Fatalf("%s: Unary: %v", label, err)
	}
	unaryC, unaryS = client.take(), server.take()
	serverStreamToTheEnd(t, ctx, label, c)
	// The stream's end reached the client after the server's interceptors returned.
	return unaryC, unaryS, client.take(), server.take()
}

// serverStreamToTheEnd makes a server-streaming call of two replies and reads it to its OK end.
func serverStreamToTheEnd(t *testing.T, ctx context.Context, label string, c pb.EchoClient) {
	t.Helper()
	st, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 2})
	if err != nil {
		t.Fatalf("%s: ServerStream: %v", label, err)
	}
	for err == nil {
		_, err = st.Recv()
	}
	if err != io.EOF {
		t.Fatalf("%s: ServerStream: %v", label, err)
	}
}

// The interceptor set by WithUnaryInterceptor (UnaryInterceptor on the server) runs first,
// then the chained ones in the order given, on both sides and for both kinds of call, as with
// grpc-go, whose client and server with the same interceptors record the same.
func TestInterceptorsRunInGrpcGoOrder(t *testing.T) {
	var client, server events
	want := []string{"single>", "chain1>", "chain2>", "<chain2", "<chain1", "<single"}
	shm, unix := fresh(t, "intercept-order")
	startPeerServer(t, []string{shm, unix},
		isthmus.ChainUnaryInterceptor(unaryServerRec(&server, "chain1")),
		isthmus.UnaryInterceptor(unaryServerRec(&server, "single")),
		isthmus.ChainUnaryInterceptor(unaryServerRec(&server, "chain2")),
		isthmus.ChainStreamInterceptor(streamServerRec(&server, "chain1"), streamServerRec(&server, "chain2")),
		isthmus.StreamInterceptor(streamServerRec(&server, "single")),
	)
	address := startGrpcServer(t,
		grpc.ChainUnaryInterceptor(unaryServerRec(&server, "chain1")),
		grpc.UnaryInterceptor(unaryServerRec(&server, "single")),
		grpc.ChainUnaryInterceptor(unaryServerRec(&server, "chain2")),
		grpc.ChainStreamInterceptor(streamServerRec(&server, "chain1"), streamServerRec(&server, "chain2")),
		grpc.StreamInterceptor(streamServerRec(&server, "single")),
	)
	conns := map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, address,
			grpc.WithChainUnaryInterceptor(unaryClientRec(&client, "chain1")),
			grpc.WithUnaryInterceptor(unaryClientRec(&client, "single")),
			grpc.WithChainUnaryInterceptor(unaryClientRec(&client, "chain2")),
			grpc.WithChainStreamInterceptor(streamClientRec(&client, "chain1"), streamClientRec(&client, "chain2")),
			grpc.WithStreamInterceptor(streamClientRec(&client, "single")),
		),
	}
	for _, target := range []string{shm, unix} {
		conns[target] = dialWith(t, target,
			isthmus.WithChainUnaryInterceptor(unaryClientRec(&client, "chain1")),
			isthmus.WithUnaryInterceptor(unaryClientRec(&client, "single")),
			isthmus.WithChainUnaryInterceptor(unaryClientRec(&client, "chain2")),
			isthmus.WithChainStreamInterceptor(streamClientRec(&client, "chain1"), streamClientRec(&client, "chain2")),
			isthmus.WithStreamInterceptor(streamClientRec(&client, "single")),
		)
	}
	for label, conn := range conns {
		uc, us, sc, ss := callsOrder(t, label, conn, &client, &server)
		for what, got := range map[string][]string{"unary client": uc, "unary server": us, "stream client": sc, "stream server": ss} {
			if !slices.Equal(got, want) {
				t.Errorf("%s: %s interceptors ran %v, want %v", label, what, got, want)
			}
		}
	}
}

// Interceptors see and change a call's metadata on both sides, and either side's can end a
// call with an error of its own without calling on: the server (or its handler) is not
// reached, and the client gets the error as is.
func TestInterceptorsChangeMetadataAndShortCircuit(t *testing.T) {
	var reached, handled atomic.Int32
	serverOpts := []isthmus.ServerOption{
		isthmus.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			reached.Add(1)
			md, _ := metadata.FromIncomingContext(ctx)
			if len(md.Get("x-deny")) > 0 {
				return nil, status.Error(codes.Unauthenticated, "the server's interceptor says no")
			}
			md = md.Copy()
			if v := md.Get("x-echo"); len(v) > 0 {
				md.Set("x-echo", v[0]+"+server")
			}
			return handler(metadata.NewIncomingContext(ctx, md), req)
		}),
		isthmus.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			handled.Add(1)
			return handler(ctx, req)
		}),
	}
	clientOpts := []isthmus.DialOption{
		isthmus.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if cc != nil {
				return errors.New("an isthmus connection is no *grpc.ClientConn: cc should be nil")
			}
			return invoker(metadata.AppendToOutgoingContext(ctx, "x-echo", "client"), method, req, reply, cc, opts...)
		}),
		isthmus.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if req.(*pb.EchoRequest).Seq == 13 {
				return status.Error(codes.PermissionDenied, "the client's interceptor says no")
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
	}
	shm, unix := fresh(t, "intercept-md")
	startPeerServer(t, []string{shm, unix}, serverOpts...)
	for _, target := range []string{shm, unix} {
		c := pb.NewEchoClient(dialWith(t, target, clientOpts...))
		ctx := testContext(t)
		var header metadata.MD
		if _, err := c.Unary(ctx, &pb.EchoRequest{Seq: 1}, grpc.Header(&header)); err != nil {
			t.Fatalf("%s: Unary: %v", target, err)
		}
		// Added by the client's interceptor, changed by the server's, echoed by the handler.
		if got := header.Get("x-echo"); !slices.Equal(got, []string{"client+server"}) {
			t.Errorf("%s: x-echo %q, want client+server", target, got)
		}
		reached.Store(0)
		handled.Store(0)
		_, err := c.Unary(ctx, &pb.EchoRequest{Seq: 13})
		if s := status.Convert(err); s.Code() != codes.PermissionDenied || s.Message() != "the client's interceptor says no" {
			t.Errorf("%s: the client's interceptor's refusal: %v", target, err)
		}
		if n := reached.Load(); n != 0 {
			t.Errorf("%s: a call the client's interceptor refused reached the server", target)
		}
		_, err = c.Unary(metadata.AppendToOutgoingContext(ctx, "x-deny", "1"), &pb.EchoRequest{Seq: 2})
		if s := status.Convert(err); s.Code() != codes.Unauthenticated || s.Message() != "the server's interceptor says no" {
			t.Errorf("%s: the server's interceptor's refusal: %v", target, err)
		}
		if r, h := reached.Load(), handled.Load(); r != 1 || h != 0 {
			t.Errorf("%s: a call the server's interceptor refused: reached %d times, handled %d, want 1 and 0", target, r, h)
		}
	}
}

// countingClientStream counts its SendMsg and RecvMsg calls.
type countingClientStream struct {
	grpc.ClientStream
	sends, recvs *atomic.Int32
}

func (s *countingClientStream) SendMsg(m any) error {
	s.sends.Add(1)
	return s.ClientStream.SendMsg(m)
}

func (s *countingClientStream) RecvMsg(m any) error {
	s.recvs.Add(1)
	return s.ClientStream.RecvMsg(m)
}

// countingServerStream counts its SendMsg and RecvMsg calls.
type countingServerStream struct {
	grpc.ServerStream
	sends, recvs *atomic.Int32
}

func (s *countingServerStream) SendMsg(m any) error {
	s.sends.Add(1)
	return s.ServerStream.SendMsg(m)
}

func (s *countingServerStream) RecvMsg(m any) error {
	s.recvs.Add(1)
	return s.ServerStream.RecvMsg(m)
}

// streamCounts are the calls that the streams the interceptors wrapped saw.
type streamCounts struct {
	clientSends, clientRecvs, serverSends, serverRecvs atomic.Int32
}

func (c *streamCounts) client() isthmus.DialOption {
	return isthmus.WithStreamInterceptor(c.clientInterceptor)
}

func (c *streamCounts) clientInterceptor(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	return &countingClientStream{ClientStream: s, sends: &c.clientSends, recvs: &c.clientRecvs}, nil
}

func (c *streamCounts) serverInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, &countingServerStream{ServerStream: ss, sends: &c.serverSends, recvs: &c.serverRecvs})
}

// bidiCounts runs a Bidi call of three messages each way on conn and gives what the
// interceptors' streams counted: SendMsg and RecvMsg on the client's side and the server's.
func bidiCounts(t *testing.T, label string, conn grpc.ClientConnInterface, c *streamCounts) [4]int32 {
	t.Helper()
	s, err := pb.NewEchoClient(conn).Bidi(testContext(t))
	if err != nil {
		t.Fatalf("%s: Bidi: %v", label, err)
	}
	for i := range 3 {
		if err := s.Send(&pb.EchoRequest{Seq: uint64(i)}); err != nil {
			t.Fatalf("%s: Send: %v", label, err)
		}
		if _, err := s.Recv(); err != nil {
			t.Fatalf("%s: Recv: %v", label, err)
		}
	}
	s.CloseSend()
	if _, err := s.Recv(); err != io.EOF {
		t.Fatalf("%s: the last Recv: %v, want io.EOF", label, err)
	}
	// The server's interceptor returned before the call's end reached the client.
	out := [4]int32{c.clientSends.Swap(0), c.clientRecvs.Swap(0), c.serverSends.Swap(0), c.serverRecvs.Swap(0)}
	return out
}

// Stream interceptors wrap the streams on both sides, and every message goes through the
// wrappers: three sent and three received each way, plus the receive of the end (io.EOF).
// grpc-go's client and server count the same.
func TestStreamInterceptorsWrapTheStreams(t *testing.T) {
	var c streamCounts
	want := [4]int32{3, 4, 3, 4}
	shm, unix := fresh(t, "intercept-stream")
	startPeerServer(t, []string{shm, unix}, isthmus.StreamInterceptor(c.serverInterceptor))
	for _, target := range []string{shm, unix} {
		if got := bidiCounts(t, target, dialWith(t, target, c.client()), &c); got != want {
			t.Errorf("%s: client SendMsg, RecvMsg, server SendMsg, RecvMsg: %v, want %v", target, got, want)
		}
	}
	address := startGrpcServer(t, grpc.StreamInterceptor(c.serverInterceptor))
	conn := newGrpcClient(t, address, grpc.WithStreamInterceptor(c.clientInterceptor))
	if got := bidiCounts(t, "grpc-go", conn, &c); got != want {
		t.Errorf("grpc-go: client SendMsg, RecvMsg, server SendMsg, RecvMsg: %v, want %v", got, want)
	}
}

// BenchmarkUnaryInterceptors is a unary call over shm:// to a server in this process with no
// interceptor, one, and a chain of three (run with -bench; -benchmem shows that a call
// through no interceptor allocates no more than before they existed, and one through them
// makes no closure per call).
func BenchmarkUnaryInterceptors(b *testing.B) {
	pass := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	shm, _ := fresh(b, "intercept-bench")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	if err := s.Start(shm); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Stop)
	for _, bc := range []struct {
		name string
		opts []isthmus.DialOption
	}{
		{"none", nil},
		{"one", []isthmus.DialOption{isthmus.WithUnaryInterceptor(pass)}},
		{"three", []isthmus.DialOption{isthmus.WithUnaryInterceptor(pass), isthmus.WithChainUnaryInterceptor(pass, pass)}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			conn, err := isthmus.Dial(shm, bc.opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			c := pb.NewEchoClient(conn)
			ctx := context.Background()
			req := &pb.EchoRequest{Seq: 1}
			if _, err := c.Unary(ctx, req); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := c.Unary(ctx, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
