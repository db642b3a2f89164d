package isthmus_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	_ "google.golang.org/grpc/encoding/gzip" // registers "gzip" for UseCompressor
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// grpc-go's call options on an isthmus ClientConn, over shm:// and unix:// to an isthmus
// server in this process, each checked against a plain grpc-go client of the same server's
// unix socket: the same codes, the same words.

// optionService is the Echo service counting the unary calls that reach it and telling how
// each Bidi call ended.
type optionService struct {
	echo.Service
	unary atomic.Int32
	ended chan string
}

func (s *optionService) Unary(ctx context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	s.unary.Add(1)
	return s.Service.Unary(ctx, req)
}

// optionClient is one client of the optionService: an isthmus ClientConn or grpc-go's.
type optionClient struct {
	label string
	conn  grpc.ClientConnInterface
}

// startOptionServer serves an optionService on a fresh shm:// target and unix socket.
func startOptionServer(t *testing.T, tag string) (svc *optionService, shm, unix string) {
	t.Helper()
	shm, unix = fresh(t, tag)
	svc = &optionService{ended: make(chan string, 16)}
	svc.BidiEnded = func(how string) { svc.ended <- how }
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, svc)
	if err := s.Start(shm, unix); err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(s.Stop)
	return svc, shm, unix
}

// optionClients are isthmus clients of shm and unix with opts, and a grpc-go client of unix
// with grpcOpts, last: the reference.
func optionClients(t *testing.T, shm, unix string, opts []isthmus.DialOption, grpcOpts ...grpc.DialOption) []optionClient {
	return []optionClient{
		{"isthmus shm", dialWith(t, shm, opts...)},
		{"isthmus unix", dialWith(t, unix, opts...)},
		{"grpc-go unix", newGrpcClient(t, unix, grpcOpts...)},
	}
}

// sameErrors fails t unless every client's error (by label, in clients' order) has code want
// and grpc-go's message, the last one's.
func sameErrors(t *testing.T, what string, clients []optionClient, errs []error, want codes.Code) {
	t.Helper()
	ref := status.Convert(errs[len(errs)-1])
	for i, err := range errs {
		st := status.Convert(err)
		switch {
		case st.Code() != want:
			t.Errorf("%s: %s: %v, want %v", clients[i].label, what, err, want)
		case st.Message() != ref.Message():
			t.Errorf("%s: %s: %q, grpc-go says %q", clients[i].label, what, st.Message(), ref.Message())
		}
	}
}

// nextEnd is how the server's next Bidi call ended.
func nextEnd(t *testing.T, svc *optionService) string {
	t.Helper()
	select {
	case how := <-svc.ended:
		return how
	case <-time.After(10 * time.Second):
		t.Fatal("the server's Bidi handler did not end within 10 s")
		return ""
	}
}

// A request over MaxCallSendMsgSize fails ResourceExhausted in grpc-go's words before
// anything is sent: a unary call never reaches the handler (one written in place into shared
// memory included), and a stream's SendMsg fails and ends the stream.
func TestMaxCallSendMsgSizeFailsBeforeSending(t *testing.T) {
	svc, shm, unix := startOptionServer(t, "maxsend")
	clients := optionClients(t, shm, unix, nil)
	ctx := testContext(t)
	for _, size := range []int{1000, 64 << 10} { // 64 KiB: in place over shm://
		var errs []error
		for _, c := range clients {
			before := svc.unary.Load()
			_, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, size)},
				grpc.MaxCallSendMsgSize(size-1))
			errs = append(errs, err)
			if n := svc.unary.Load() - before; n != 0 {
				t.Errorf("%s: a %d-byte request over the limit reached the handler", c.label, size)
			}
			if _, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, size)},
				grpc.MaxCallSendMsgSize(size+16)); err != nil {
				t.Errorf("%s: a %d-byte request under the limit: %v", c.label, size, err)
			}
		}
		sameErrors(t, fmt.Sprintf("unary, %d bytes", size), clients, errs, codes.ResourceExhausted)
	}
	if msg := status.Convert(errsOf(t, clients, func(c optionClient) error {
		_, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 1000)}, grpc.MaxCallSendMsgSize(100))
		return err
	})[0]).Message(); msg != "trying to send message larger than max (1003 vs. 100)" {
		t.Errorf("the message: %q", msg)
	}

	var sendErrs, recvErrs []error
	for _, c := range clients {
		s, err := pb.NewEchoClient(c.conn).Bidi(ctx, grpc.MaxCallSendMsgSize(100))
		if err != nil {
			t.Fatalf("%s: Bidi: %v", c.label, err)
		}
		if err := s.Send(&pb.EchoRequest{Payload: make([]byte, 10)}); err != nil {
			t.Fatalf("%s: a small message: %v", c.label, err)
		}
		if _, err := s.Recv(); err != nil {
			t.Fatalf("%s: its echo: %v", c.label, err)
		}
		sendErrs = append(sendErrs, s.Send(&pb.EchoRequest{Payload: make([]byte, 1000)}))
		_, err = s.Recv()
		recvErrs = append(recvErrs, err)
		if how := nextEnd(t, svc); how != "Canceled" {
			t.Errorf("%s: the server's stream ended %q, want Canceled", c.label, how)
		}
	}
	sameErrors(t, "stream send", clients, sendErrs, codes.ResourceExhausted)
	for i, err := range recvErrs {
		if err == nil || errors.Is(err, io.EOF) {
			t.Errorf("%s: Recv after the failed send: %v, want the call's end", clients[i].label, err)
		}
	}
}

// errsOf is f's error on each client.
func errsOf(t *testing.T, clients []optionClient, f func(optionClient) error) []error {
	t.Helper()
	var errs []error
	for _, c := range clients {
		errs = append(errs, f(c))
	}
	return errs
}

// A response over MaxCallRecvMsgSize fails ResourceExhausted in grpc-go's words; a stream's
// RecvMsg fails and the call is cancelled (the server's handler sees Canceled).
func TestMaxCallRecvMsgSizeFailsTheCall(t *testing.T) {
	svc, shm, unix := startOptionServer(t, "maxrecv")
	clients := optionClients(t, shm, unix, nil)
	ctx := testContext(t)
	for _, size := range []int{1000, 64 << 10} {
		errs := errsOf(t, clients, func(c optionClient) error {
			_, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, size)},
				grpc.MaxCallRecvMsgSize(size-1))
			return err
		})
		sameErrors(t, fmt.Sprintf("unary, %d bytes", size), clients, errs, codes.ResourceExhausted)
		if !strings.HasPrefix(status.Convert(errs[0]).Message(), "grpc: received message larger than max (") {
			t.Errorf("the message: %v", errs[0])
		}
	}
	errs := errsOf(t, clients, func(c optionClient) error {
		s, err := pb.NewEchoClient(c.conn).Bidi(ctx, grpc.MaxCallRecvMsgSize(100))
		if err != nil {
			return err
		}
		if err := s.Send(&pb.EchoRequest{Payload: make([]byte, 10)}); err != nil {
			return err
		}
		if _, err := s.Recv(); err != nil {
			return fmt.Errorf("a small reply: %w", err)
		}
		if err := s.Send(&pb.EchoRequest{Payload: make([]byte, 1000)}); err != nil {
			return err
		}
		_, err = s.Recv()
		if how := nextEnd(t, svc); how != "Canceled" {
			t.Errorf("%s: the server's stream ended %q, want Canceled", c.label, how)
		}
		if _, again := s.Recv(); again == nil {
			t.Errorf("%s: Recv after the failed one gave a message", c.label)
		}
		return err
	})
	sameErrors(t, "stream", clients, errs, codes.ResourceExhausted)
}

// WithDefaultCallOptions apply to every call before the call's own, which win, and
// interceptors see them, as with grpc-go's.
func TestDefaultCallOptionsComeBeforeTheCallsOwn(t *testing.T) {
	_, shm, unix := startOptionServer(t, "defaults")
	var seen sync.Map // label → the option kinds the interceptor saw
	see := func(label string) grpc.UnaryClientInterceptor {
		return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			var kinds []string
			for _, o := range opts {
				switch o.(type) {
				case grpc.MaxSendMsgSizeCallOption:
					kinds = append(kinds, "send")
				case grpc.MaxRecvMsgSizeCallOption:
					kinds = append(kinds, "recv")
				}
			}
			seen.Store(label, kinds)
			return invoker(ctx, method, req, reply, cc, opts...)
		}
	}
	defaults := []grpc.CallOption{grpc.MaxCallSendMsgSize(100)}
	clients := []optionClient{
		{"isthmus shm", dialWith(t, shm, isthmus.WithDefaultCallOptions(defaults...), isthmus.WithUnaryInterceptor(see("isthmus shm")))},
		{"isthmus unix", dialWith(t, unix, isthmus.WithDefaultCallOptions(defaults...), isthmus.WithUnaryInterceptor(see("isthmus unix")))},
		{"grpc-go unix", newGrpcClient(t, unix, grpc.WithDefaultCallOptions(defaults...), grpc.WithUnaryInterceptor(see("grpc-go unix")))},
	}
	ctx := testContext(t)
	req := &pb.EchoRequest{Payload: make([]byte, 1000)}
	errs := errsOf(t, clients, func(c optionClient) error {
		_, err := pb.NewEchoClient(c.conn).Unary(ctx, req)
		return err
	})
	sameErrors(t, "the default limit", clients, errs, codes.ResourceExhausted)
	for _, c := range clients {
		if _, err := pb.NewEchoClient(c.conn).Unary(ctx, req, grpc.MaxCallRecvMsgSize(1<<20), grpc.MaxCallSendMsgSize(1<<20)); err != nil {
			t.Errorf("%s: the call's own limit: %v", c.label, err)
		}
		kinds, _ := seen.Load(c.label)
		if want := []string{"send", "recv", "send"}; !slices.Equal(kinds.([]string), want) {
			t.Errorf("%s: the interceptor saw %v, want %v", c.label, kinds, want)
		}
		s, err := pb.NewEchoClient(c.conn).Bidi(ctx)
		if err != nil {
			t.Fatalf("%s: Bidi: %v", c.label, err)
		}
		if err := s.Send(req); status.Code(err) != codes.ResourceExhausted {
			t.Errorf("%s: a stream's message over the default limit: %v", c.label, err)
		}
	}
}

// grpc.Peer names the server after a call: a *net.UnixAddr for unix://, the target (network
// "shm") for shm://, a *net.TCPAddr for TCP, with credentials.TLSInfo over TLS; a stream's is
// set when it ends. A call that reached no server leaves it.
func TestPeerCallOptionNamesTheServer(t *testing.T) {
	_, shm, unix := startOptionServer(t, "peeropt")
	ctx := testContext(t)
	peerOf := func(conn grpc.ClientConnInterface) (unary, stream grpcpeer.Peer) {
		t.Helper()
		c := pb.NewEchoClient(conn)
		if _, err := c.Unary(ctx, &pb.EchoRequest{}, grpc.Peer(&unary)); err != nil {
			t.Fatalf("Unary: %v", err)
		}
		s, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 2}, grpc.Peer(&stream))
		if err != nil {
			t.Fatalf("ServerStream: %v", err)
		}
		for {
			if _, err := s.Recv(); err == io.EOF {
				break
			} else if err != nil {
				t.Fatalf("ServerStream: %v", err)
			}
		}
		return unary, stream
	}

	wantUnix, _ := peerOf(newGrpcClient(t, unix))
	u, s := peerOf(dial(t, unix))
	for _, p := range []grpcpeer.Peer{u, s} {
		a, ok := p.Addr.(*net.UnixAddr)
		if !ok || a.Name != strings.TrimPrefix(unix, "unix://") || a.String() != wantUnix.Addr.String() || a.Network() != wantUnix.Addr.Network() {
			t.Errorf("unix: Addr %T %v, grpc-go says %T %v", p.Addr, p.Addr, wantUnix.Addr, wantUnix.Addr)
		}
		if p.AuthInfo == nil || p.AuthInfo.AuthType() != "local" {
			t.Errorf("unix: AuthInfo %v, want local", p.AuthInfo)
		}
	}
	u, s = peerOf(dial(t, shm))
	for _, p := range []grpcpeer.Peer{u, s} {
		if p.Addr == nil || p.Addr.Network() != "shm" || p.Addr.String() != shm {
			t.Errorf("shm: Addr %v, want network shm and %s", p.Addr, shm)
		}
		if p.AuthInfo == nil || p.AuthInfo.AuthType() != "local" {
			t.Errorf("shm: AuthInfo %v, want local", p.AuthInfo)
		}
	}

	pki := newPKI(t)
	target, _ := startTLSServer(t, pki.server(false, false))
	u, s = peerOf(dialTLS(t, target, isthmus.TLSConfig{RootCAs: pki.caPEM}))
	for _, p := range []grpcpeer.Peer{u, s} {
		a, ok := p.Addr.(*net.TCPAddr)
		if !ok || "https://"+a.String() != target {
			t.Errorf("tls: Addr %T %v, want %s", p.Addr, p.Addr, target)
		}
		if info, ok := p.AuthInfo.(credentials.TLSInfo); !ok || info.SecurityLevel != credentials.PrivacyAndIntegrity {
			t.Errorf("tls: AuthInfo %T %v, want credentials.TLSInfo", p.AuthInfo, p.AuthInfo)
		}
	}

	nobody, _ := fresh(t, "peeropt-nobody")
	var p grpcpeer.Peer
	if _, err := pb.NewEchoClient(dial(t, nobody)).Unary(ctx, &pb.EchoRequest{}, grpc.Peer(&p)); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call to nobody: %v", err)
	}
	if p.Addr != nil {
		t.Errorf("a call to nobody named a peer: %v", p.Addr)
	}
}

// grpc.OnFinish hears each call's final error once, as grpc-go's client tells it: unary
// calls that succeed and fail (at the server or before sending), streams read to their end,
// and a stream whose context ends while nobody reads it.
func TestOnFinishHearsHowTheCallEnded(t *testing.T) {
	_, shm, unix := startOptionServer(t, "onfinish")
	clients := optionClients(t, shm, unix, nil)
	ctx := testContext(t)
	var results [][]string
	for _, c := range clients {
		var mu sync.Mutex
		var heard []string
		done := make(chan struct{}, 16)
		onFinish := grpc.OnFinish(func(err error) {
			mu.Lock()
			heard = append(heard, status.Code(err).String())
			mu.Unlock()
			done <- struct{}{}
		})
		wait := func(what string) {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: %s: OnFinish was not called within 10 s", c.label, what)
			}
		}
		e := pb.NewEchoClient(c.conn)
		_, _ = e.Unary(ctx, &pb.EchoRequest{}, onFinish)
		wait("unary")
		_, _ = e.Unary(ctx, &pb.EchoRequest{FailWith: int32(codes.NotFound)}, onFinish)
		wait("failing unary")
		_, _ = e.Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 100)}, onFinish, grpc.MaxCallSendMsgSize(10))
		wait("unary over the limit")
		s, err := e.ServerStream(ctx, &pb.StreamRequest{Count: 2}, onFinish)
		if err != nil {
			t.Fatal(err)
		}
		for err == nil {
			_, err = s.Recv()
		}
		wait("stream")
		sctx, cancel := context.WithCancel(ctx)
		if _, err := e.Bidi(sctx, onFinish); err != nil {
			t.Fatal(err)
		}
		cancel()
		wait("cancelled stream")
		time.Sleep(50 * time.Millisecond) // a second call would come now
		mu.Lock()
		results = append(results, heard)
		mu.Unlock()
	}
	want := results[len(results)-1]
	if !slices.Equal(want, []string{"OK", "NotFound", "ResourceExhausted", "OK", "Canceled"}) {
		t.Errorf("grpc-go's client heard %v", want)
	}
	for i, got := range results {
		if !slices.Equal(got, want) {
			t.Errorf("%s heard %v, grpc-go %v", clients[i].label, got, want)
		}
	}
}

// protoCodec is protobuf under the name it is given, counting its uses.
type protoCodec struct {
	name              string
	marshals, unmarsh *atomic.Int32
}

func (c protoCodec) Marshal(v any) ([]byte, error) {
	c.marshals.Add(1)
	return proto.Marshal(v.(proto.Message))
}

func (c protoCodec) Unmarshal(data []byte, v any) error {
	c.unmarsh.Add(1)
	return proto.Unmarshal(data, v.(proto.Message))
}

func (c protoCodec) Name() string { return c.name }

// ForceCodec is honoured while its content-subtype is "proto"; a codec or content-subtype
// isthmus cannot send fails codes.Unimplemented before the call starts; a content-subtype or
// compressor grpc-go does not know fails as grpc-go's does; gzip is accepted by every client
// and server (TestUseCompressorCompressesOverHTTP2 shows that the requests are compressed).
func TestCodecAndCompressorOptions(t *testing.T) {
	svc, shm, unix := startOptionServer(t, "codec")
	clients := optionClients(t, shm, unix, nil)
	ctx := testContext(t)
	req := &pb.EchoRequest{Payload: []byte("codec"), Seq: 7}
	for _, c := range clients {
		e := pb.NewEchoClient(c.conn)
		codec := protoCodec{name: "proto", marshals: new(atomic.Int32), unmarsh: new(atomic.Int32)}
		reply, err := e.Unary(ctx, req, grpc.ForceCodec(codec))
		if err != nil || reply.Seq != 7 || string(reply.Payload) != "codec" {
			t.Errorf("%s: ForceCodec(proto): %v, %v", c.label, reply, err)
		}
		s, err := e.Bidi(ctx, grpc.ForceCodec(codec))
		if err == nil {
			if err = s.Send(req); err == nil {
				_, err = s.Recv()
			}
			s.CloseSend()
		}
		if err != nil {
			t.Errorf("%s: a stream with ForceCodec(proto): %v", c.label, err)
		}
		if m, u := codec.marshals.Load(), codec.unmarsh.Load(); m != 2 || u != 2 {
			t.Errorf("%s: the forced codec marshalled %d and unmarshalled %d messages, want 2 and 2", c.label, m, u)
		}
		opts := []grpc.CallOption{grpc.CallContentSubtype("proto"), grpc.UseCompressor("identity"), grpc.UseCompressor("gzip")}
		for _, opt := range opts {
			if _, err := e.Unary(ctx, req, opt); err != nil {
				t.Errorf("%s: %#v: %v", c.label, opt, err)
			}
		}
	}
	isthmusOnly := clients[:len(clients)-1]
	for _, opt := range []grpc.CallOption{
		grpc.ForceCodec(protoCodec{name: "json", marshals: new(atomic.Int32), unmarsh: new(atomic.Int32)}),
	} {
		for _, c := range isthmusOnly {
			before := svc.unary.Load()
			_, err := pb.NewEchoClient(c.conn).Unary(ctx, req, opt)
			if status.Code(err) != codes.Unimplemented || !strings.Contains(err.Error(), `"json"`) {
				t.Errorf("%s: a json codec: %v, want Unimplemented naming it", c.label, err)
			}
			if svc.unary.Load() != before {
				t.Errorf("%s: the call reached the server", c.label)
			}
			if _, err := pb.NewEchoClient(c.conn).Bidi(ctx, opt); status.Code(err) != codes.Unimplemented {
				t.Errorf("%s: a stream with a json codec: %v, want Unimplemented", c.label, err)
			}
		}
	}
	for _, opt := range []grpc.CallOption{grpc.CallContentSubtype("nosuch"), grpc.UseCompressor("nosuch")} {
		errs := errsOf(t, clients, func(c optionClient) error {
			_, err := pb.NewEchoClient(c.conn).Unary(ctx, req, opt)
			return err
		})
		sameErrors(t, fmt.Sprintf("%#v", opt), clients, errs, codes.Internal)
	}
}

// encodingRecorder is a grpc-go stats handler that records the grpc-encoding of each call's
// received headers (a server's: the request's; a client's: the reply's).
type encodingRecorder struct{ events }

func (r *encodingRecorder) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return ctx
}
func (r *encodingRecorder) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}
func (r *encodingRecorder) HandleConn(context.Context, stats.ConnStats) {}
func (r *encodingRecorder) HandleRPC(_ context.Context, s stats.RPCStats) {
	if h, ok := s.(*stats.InHeader); ok {
		r.add(h.Compression)
	}
}

// UseCompressor("gzip"), per call or as a connection's default, compresses an isthmus
// client's requests to a grpc-go server over unix://, as grpc-go's own client does: the
// server sees grpc-encoding gzip. Without it the requests go uncompressed.
func TestUseCompressorCompressesOverHTTP2(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "grpc.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	rec := &encodingRecorder{}
	srv := grpc.NewServer(grpc.StatsHandler(rec))
	pb.RegisterEchoServer(srv, echo.Service{})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	ctx := testContext(t)
	req := &pb.EchoRequest{Payload: []byte(strings.Repeat("compress me ", 100)), Seq: 3}
	plain := dialWith(t, "unix://"+sock)
	byDefault := dialWith(t, "unix://"+sock, isthmus.WithDefaultCallOptions(grpc.UseCompressor("gzip")))
	for _, c := range []struct {
		label string
		conn  *isthmus.ClientConn
		opts  []grpc.CallOption
		want  string
	}{
		{"no compressor", plain, nil, ""},
		{"UseCompressor(gzip)", plain, []grpc.CallOption{grpc.UseCompressor("gzip")}, "gzip"},
		{"UseCompressor(identity)", plain, []grpc.CallOption{grpc.UseCompressor("identity")}, ""},
		{"gzip by default", byDefault, nil, "gzip"},
		{"gzip by default, identity for the call", byDefault, []grpc.CallOption{grpc.UseCompressor("identity")}, ""},
	} {
		reply, err := pb.NewEchoClient(c.conn).Unary(ctx, req, c.opts...)
		if err != nil || reply.Seq != 3 || !bytes.Equal(reply.Payload, req.Payload) {
			t.Fatalf("%s: %v, %v", c.label, reply, err)
		}
		if seen := rec.take(); len(seen) != 1 || seen[0] != c.want {
			t.Errorf("%s: the server saw grpc-encoding %q, want %q", c.label, seen, c.want)
		}
	}
}

// SendCompressed("gzip") compresses an isthmus server's replies over unix:// for a client
// that reads gzip: a grpc-go client's stats handler sees the reply's grpc-encoding. Its
// replies reach isthmus's own client too; an encoding the library lacks fails Start.
func TestSendCompressedCompressesReplies(t *testing.T) {
	_, unix := fresh(t, "sendgzip")
	s := isthmus.NewServer(isthmus.SendCompressed("gzip"))
	pb.RegisterEchoServer(s, echo.Service{})
	if err := s.Start(unix); err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(s.Stop)
	ctx := testContext(t)
	req := &pb.EchoRequest{Payload: []byte(strings.Repeat("compress me ", 100)), Seq: 4}
	rec := &encodingRecorder{}
	grpcClient := newGrpcClient(t, unix, grpc.WithStatsHandler(rec))
	for _, conn := range []grpc.ClientConnInterface{grpcClient, dialWith(t, unix)} {
		reply, err := pb.NewEchoClient(conn).Unary(ctx, req)
		if err != nil || reply.Seq != 4 || !bytes.Equal(reply.Payload, req.Payload) {
			t.Fatalf("%T: %v, %v", conn, reply, err)
		}
	}
	if seen := rec.take(); len(seen) != 1 || seen[0] != "gzip" {
		t.Errorf("grpc-go's client saw replies with grpc-encoding %q, want gzip", seen)
	}
	bad := isthmus.NewServer(isthmus.SendCompressed("snappy"))
	if err := bad.Start(unix + "-bad"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("SendCompressed(snappy): %v, want InvalidArgument", err)
	}
}

// A server's MaxSendMessageSize is grpc.MaxSendMsgSize's: a reply over it fails its call
// ResourceExhausted in grpc-go's words and is not sent, a stream's replies before it arrive,
// and the next call goes through; a raw handler's reply block too. The reference is a grpc-go
// server with grpc.MaxSendMsgSize.
func TestMaxSendMessageSizeFailsALargerReply(t *testing.T) {
	const limit = 100
	shm, unix := fresh(t, "srvmaxsend")
	s := isthmus.NewServer(isthmus.MaxSendMessageSize(limit))
	pb.RegisterEchoServer(s, &echo.Service{})
	raw := "/isthmus.test.Raw/Echo"
	s.HandleRawUnary(raw, func(c *isthmus.RawServerCall, req *isthmus.Message) (*isthmus.Block, error) {
		b, err := c.Alloc(len(req.Bytes()))
		if err == nil {
			copy(b.Bytes(), req.Bytes())
		}
		return b, err
	})
	rawStream := "/isthmus.test.Raw/Stream"
	s.HandleRaw(rawStream, func(c *isthmus.RawServerCall) error {
		if err := c.Send([]byte("small")); err != nil {
			return err
		}
		return c.Send(make([]byte, 1000))
	})
	clients := serveToLimitClients(t, s, shm, unix, grpc.MaxSendMsgSize(limit))
	ctx := testContext(t)
	for _, size := range []int{1000, 64 << 10} { // 64 KiB: marshalled in place over shm://
		errs := errsOf(t, clients, func(c optionClient) error {
			_, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, size)})
			return err
		})
		sameErrors(t, fmt.Sprintf("unary, %d bytes", size), clients, errs, codes.ResourceExhausted)
	}
	if msg := status.Convert(errsOf(t, clients[:1], func(c optionClient) error {
		_, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 1000)})
		return err
	})[0]).Message(); !strings.HasPrefix(msg, "trying to send message larger than max (10") || !strings.HasSuffix(msg, " vs. 100)") {
		t.Errorf("the message: %q", msg)
	}
	var recvErrs []error
	for _, c := range clients {
		st, err := pb.NewEchoClient(c.conn).Bidi(ctx)
		if err != nil {
			t.Fatalf("%s: Bidi: %v", c.label, err)
		}
		for _, n := range []int{10, 1000} {
			if err := st.Send(&pb.EchoRequest{Payload: make([]byte, n)}); err != nil {
				t.Fatalf("%s: send %d bytes: %v", c.label, n, err)
			}
		}
		if r, err := st.Recv(); err != nil || len(r.Payload) != 10 {
			t.Fatalf("%s: the small echo: %v, %v", c.label, r, err)
		}
		_, err = st.Recv()
		recvErrs = append(recvErrs, err)
		if r, err := pb.NewEchoClient(c.conn).Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 10)}); err != nil || len(r.Payload) != 10 {
			t.Errorf("%s: a call under the limit after: %v, %v", c.label, r, err)
		}
	}
	sameErrors(t, "stream", clients, recvErrs, codes.ResourceExhausted)
	for _, c := range clients[:2] {
		m, err := c.conn.(*isthmus.ClientConn).CallRaw(ctx, raw, make([]byte, 1000))
		if status.Code(err) != codes.ResourceExhausted {
			t.Errorf("%s: a raw 1000-byte reply: %v", c.label, err)
		}
		if m != nil {
			m.Release()
		}
		// A raw stream's reply over the limit fails its handler's Send, and so the call.
		st, err := c.conn.(*isthmus.ClientConn).StartRaw(ctx, rawStream)
		if err != nil {
			t.Fatalf("%s: StartRaw: %v", c.label, err)
		}
		if err := st.CloseSend(); err != nil {
			t.Fatalf("%s: CloseSend: %v", c.label, err)
		}
		first, err := st.Recv()
		if err != nil || string(first.Bytes()) != "small" {
			t.Fatalf("%s: the raw stream's first reply: %v", c.label, err)
		}
		first.Release()
		if _, err := st.Recv(); status.Code(err) != codes.ResourceExhausted {
			t.Errorf("%s: a raw stream's 1000-byte reply: %v", c.label, err)
		}
	}
}

// A connection's WithMaxMessageSize holds what it receives, over shm:// and HTTP/2: a larger
// reply fails its call ResourceExhausted naming the size and the limit (grpc-core's words,
// "CLIENT: Received message larger than max (N vs. M)"; grpc-go has no such connection-wide
// option), a larger request goes, and the connection serves on.
func TestWithMaxMessageSizeHoldsReplies(t *testing.T) {
	replySize := regexp.MustCompile(`\b20\d\d\b`)
	shm, unix := fresh(t, "connmax")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	serving(t, s, shm, unix)
	ctx := testContext(t)
	for _, target := range []string{shm, unix} {
		client := pb.NewEchoClient(dialWith(t, target, isthmus.WithMaxMessageSize(1000)))
		_, err := client.Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 2000)})
		// The reply's size depends on its time-left field, so any 20xx-byte size will do.
		if msg := status.Convert(err).Message(); status.Code(err) != codes.ResourceExhausted ||
			!strings.HasPrefix(msg, "CLIENT: Received message larger than max (") ||
			!strings.HasSuffix(msg, " vs. 1000)") || !replySize.MatchString(msg) {
			t.Errorf("%s: a 2000-byte echo: %v", target, err)
		}
		st, err := client.ClientStream(ctx)
		if err != nil {
			t.Fatalf("%s: %v", target, err)
		}
		if err := st.Send(&pb.EchoRequest{Payload: echo.Pattern(5000, 0)}); err != nil {
			t.Fatalf("%s: send: %v", target, err)
		}
		if sum, err := st.CloseAndRecv(); err != nil || sum.Bytes != 5000 {
			t.Errorf("%s: a 5000-byte request: %v, %v", target, sum, err)
		}
		if r, err := client.Unary(ctx, &pb.EchoRequest{Payload: []byte("after")}); err != nil || string(r.Payload) != "after" {
			t.Errorf("%s: the call after: %v", target, err)
		}
	}
}

// serveToLimitClients starts s on shm and unix (stopped when the test ends) and gives clients
// of it on both, grpc-go's over the socket, and last a grpc-go client of a grpc-go server made
// with the reference option.
func serveToLimitClients(t *testing.T, s *isthmus.Server, shm, unix string, reference grpc.ServerOption) []optionClient {
	t.Helper()
	if err := s.Start(shm, unix); err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(s.Stop)
	return []optionClient{
		{"isthmus shm", dialWith(t, shm)},
		{"isthmus unix", dialWith(t, unix)},
		{"grpc-go unix", newGrpcClient(t, unix)},
		{"grpc-go → grpc-go", newGrpcClient(t, startGrpcServer(t, reference))},
	}
}

// A server's MaxMessageSize is grpc.MaxRecvMsgSize's: a request over it fails
// ResourceExhausted naming the limit, and it holds what the server receives, not what it sends:
// a reply over it arrives, over HTTP/2 too (handlers answer HTTP/2 through the server's
// loopback, which held replies to the server's limit before). The reference is a grpc-go server
// with grpc.MaxRecvMsgSize.
func TestMaxMessageSizeHoldsRequestsNotReplies(t *testing.T) {
	const limit = 1000
	shm, unix := fresh(t, "srvmaxrecv")
	s := isthmus.NewServer(isthmus.MaxMessageSize(limit))
	pb.RegisterEchoServer(s, &echo.Service{})
	clients := serveToLimitClients(t, s, shm, unix, grpc.MaxRecvMsgSize(limit))
	ctx := testContext(t)
	for _, c := range clients {
		client := pb.NewEchoClient(c.conn)
		_, err := client.Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 1500)})
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), fmt.Sprint(limit)) {
			t.Errorf("%s: a 1500-byte request: %v", c.label, err)
		}
		st, err := client.ServerStream(ctx, &pb.StreamRequest{Count: 1, Size: 5000})
		if err != nil {
			t.Fatalf("%s: %v", c.label, err)
		}
		r, err := st.Recv()
		if err != nil || len(r.Payload) != 5000 {
			t.Errorf("%s: a 5000-byte reply: %v", c.label, err)
			continue
		}
		if _, err := st.Recv(); err != io.EOF {
			t.Errorf("%s: the stream ended with %v", c.label, err)
		}
	}
}

// A server with no MaxMessageSize takes requests of up to 4 MiB over HTTP/2, grpc-go's default:
// a 5 MiB one fails ResourceExhausted naming the limit, as on a grpc-go server with none set,
// since there a request is gathered, and a compressed one inflated, in memory before its
// handler sees it. Over shm:// it takes 4 GiB.
func TestAServerTakesFourMiBOverHTTP2UnlessToldOtherwise(t *testing.T) {
	shm, unix := fresh(t, "srvdefaultrecv")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, &echo.Service{})
	clients := serveToLimitClients(t, s, shm, unix, grpc.EmptyServerOption{})
	ctx := testContext(t)
	for _, c := range clients {
		client := pb.NewEchoClient(c.conn)
		r, err := client.Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 4<<20-64)})
		if err != nil || len(r.Payload) != 4<<20-64 {
			t.Errorf("%s: a request just under 4 MiB: %v", c.label, err)
		}
		_, err = client.Unary(ctx, &pb.EchoRequest{Payload: make([]byte, 5<<20)}, grpc.MaxCallRecvMsgSize(8<<20))
		switch {
		case c.label == "isthmus shm" && err != nil:
			t.Errorf("%s: a 5 MiB request: %v", c.label, err)
		case c.label != "isthmus shm" && (status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), "4194304")):
			t.Errorf("%s: a 5 MiB request: %v", c.label, err)
		}
	}
}

// nilFirst's Bidi reads one request and answers it with an untyped nil message.
type nilFirst struct{ echo.Service }

func (nilFirst) Bidi(stream pb.Echo_BidiServer) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	return stream.SendMsg(nil)
}

// An untyped nil message goes as an empty one, as on grpc-go, whose encoding of a message
// takes nil for empty before any codec sees it: a client's request (Invoke, SendMsg) and a
// server's response (SendMsg). isthmus failed each Internal, "<nil> is not a proto.Message".
func TestAnUntypedNilMessageGoesAsAnEmptyOne(t *testing.T) {
	for name, conn := range besideGrpcGoServing(t, "nil-message", nilFirst{}) {
		ctx := testContext(t)
		reply := &pb.EchoReply{Seq: 7}
		if err := conn.Invoke(ctx, pb.Echo_Unary_FullMethodName, nil, reply); err != nil || reply.Seq != 0 {
			t.Errorf("%s: Invoke with a nil request: %v, reply %v", name, err, reply)
		}
		desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
		stream, err := conn.NewStream(ctx, desc, pb.Echo_Bidi_FullMethodName)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := stream.SendMsg(nil); err != nil {
			t.Errorf("%s: SendMsg(nil): %v", name, err)
		}
		reply = &pb.EchoReply{Seq: 7}
		if err := stream.RecvMsg(reply); err != nil || reply.Seq != 0 {
			t.Errorf("%s: the server's nil response: %v, reply %v", name, err, reply)
		}
		if err := stream.RecvMsg(reply); err != io.EOF {
			t.Errorf("%s: after the response: %v, want io.EOF", name, err)
		}
	}
}

// A message that is not a proto.Message fails the call in the words of grpc-go's codec, to
// send (Invoke's request) and to receive (a reply of another type), and a second Close of a
// connection fails as grpc-go's does. isthmus's said "string is not a proto.Message", and its
// second Close gave nil.
func TestWrongMessagesAndASecondCloseFailAsOnGrpcGo(t *testing.T) {
	got := map[string][]string{}
	for name, conn := range besideGrpcGoServing(t, "wrong-message", nilFirst{}) {
		ctx := testContext(t)
		for _, call := range []struct{ req, reply any }{
			{"not a message", &pb.EchoReply{}},
			{&pb.EchoRequest{}, nil},
			{&pb.EchoRequest{}, "not a message"},
		} {
			err := conn.Invoke(ctx, pb.Echo_Unary_FullMethodName, call.req, call.reply)
			got[name] = append(got[name], fmt.Sprint(status.Code(err), ": ", status.Convert(err).Message()))
		}
		closer := conn.(interface{ Close() error })
		if err := closer.Close(); err != nil {
			t.Errorf("%s: first Close: %v", name, err)
		}
		err := closer.Close()
		got[name] = append(got[name], fmt.Sprint(status.Code(err), ": ", status.Convert(err).Message()))
	}
	if fmt.Sprint(got["isthmus"]) != fmt.Sprint(got["grpc-go"]) {
		t.Errorf("isthmus:\n%q\ngrpc-go:\n%q", got["isthmus"], got["grpc-go"])
	}
	if want := "Canceled: grpc: the client connection is closing"; got["grpc-go"][3] != want {
		t.Errorf("grpc-go's second Close: %q, want %q", got["grpc-go"][3], want)
	}
}
