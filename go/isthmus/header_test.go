package isthmus_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
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

// firstRequestHeader is a request-streaming handler that reads its first request, then sends
// initial metadata made from it, as a handler that authenticates by the first message does.
// It reads only once the client has sent (sent is closed), and a moment later, so that the
// request is in; with waits, at once, so that its read waits for the request.
type firstRequestHeader struct {
	pb.UnimplementedEchoServer
	sent  chan struct{}
	waits bool
}

func (h firstRequestHeader) ClientStream(s grpc.ClientStreamingServer[pb.EchoRequest, pb.Summary]) error {
	if !h.waits {
		select {
		case <-h.sent:
		case <-s.Context().Done():
			return s.Context().Err()
		}
		time.Sleep(100 * time.Millisecond)
	}
	r, err := s.Recv()
	if err != nil {
		return err
	}
	if err := s.SendHeader(metadata.Pairs("x-first", fmt.Sprint(r.Seq))); err != nil {
		return err
	}
	n := uint64(1)
	for {
		if _, err := s.Recv(); err == io.EOF {
			break
		} else if err != nil {
			return err
		}
		n++
	}
	return s.SendAndClose(&pb.Summary{Count: n})
}

// A request-streaming handler that has read a request can still send its initial metadata, on
// isthmus's server as on grpc-go's, whether the request was in or its read waited for it. It
// could not: a read that waited sent empty metadata first (for tonic's clients, which wait for
// the response to open before they send), and the handler's SendHeader failed
// "WriteHeader was already called"; before that, asking the receive to do so counted the
// metadata as sent either way.
func TestAHandlerSendsHeadersAfterReadingARequestThatWasIn(t *testing.T) {
	servers := map[string]func(t *testing.T, h firstRequestHeader) pb.EchoClient{
		"grpc-go": func(t *testing.T, h firstRequestHeader) pb.EchoClient {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			s := grpc.NewServer()
			pb.RegisterEchoServer(s, h)
			go s.Serve(l)
			t.Cleanup(s.Stop)
			conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			return pb.NewEchoClient(conn)
		},
		"isthmus": func(t *testing.T, h firstRequestHeader) pb.EchoClient {
			shm, _ := fresh(t, "header-after-recv")
			s := isthmus.NewServer()
			pb.RegisterEchoServer(s, h)
			if err := s.Start(shm); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Stop)
			return pb.NewEchoClient(dial(t, shm))
		},
	}
	for name, start := range servers {
		for _, waits := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/waits=%v", name, waits), func(t *testing.T) {
				h := firstRequestHeader{sent: make(chan struct{}), waits: waits}
				client := start(t, h)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				stream, err := client.ClientStream(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if waits {
					time.Sleep(200 * time.Millisecond) // the handler's read waits meanwhile
				}
				for _, seq := range []uint64{7, 8} {
					if err := stream.Send(&pb.EchoRequest{Seq: seq}); err != nil {
						t.Fatal(err)
					}
				}
				close(h.sent)
				summary, err := stream.CloseAndRecv()
				if err != nil || summary.GetCount() != 2 {
					t.Fatalf("%v, %v", summary, err)
				}
				header, err := stream.Header()
				if err != nil || fmt.Sprint(header.Get("x-first")) != "[7]" {
					t.Fatalf("header %v, %v", header, err)
				}
			})
		}
	}
}

// failingAfterHeader sets initial metadata, then fails: a unary call and a server stream
// (with bare, a stream that fails with no metadata at all), and a unary call whose trailer
// key is invalid.
type failingAfterHeader struct{ pb.UnimplementedEchoServer }

func (failingAfterHeader) Unary(ctx context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	if r.GetSeq() == 1 {
		grpc.SetTrailer(ctx, metadata.MD{"X-Up": {"v"}})
		return &pb.EchoReply{}, nil
	}
	grpc.SetHeader(ctx, metadata.Pairs("x-h", "1"))
	return nil, status.Error(codes.NotFound, "after a header")
}

func (failingAfterHeader) ServerStream(r *pb.StreamRequest, s grpc.ServerStreamingServer[pb.EchoReply]) error {
	if r.GetCount() == 0 {
		return status.Error(codes.NotFound, "bare")
	}
	s.SetHeader(metadata.Pairs("x-h", "2"))
	return status.Error(codes.NotFound, "after a header")
}

// Initial metadata a handler set before it failed reaches the client ahead of the status, as
// from grpc-go's server (isthmus sent none: only an explicit SendHeader went); a stream that
// failed with no metadata gives Header() nil and no error, the status coming from Recv, as
// grpc-go's client does (isthmus gave the status); and an invalid trailer key fails the call
// INTERNAL naming the key, in words not wrapped twice. Each beside grpc-go's server and
// client, by the same test.
func TestInitialMetadataSetBeforeAFailureReachesTheClient(t *testing.T) {
	shm, unix := fresh(t, "header-fail")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, failingAfterHeader{})
	serving(t, s, shm, unix)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	pb.RegisterEchoServer(g, failingAfterHeader{})
	go g.Serve(l)
	t.Cleanup(g.Stop)
	clients := map[string]grpc.ClientConnInterface{
		"grpc-go to isthmus over unix": newGrpcClient(t, unix),
		"grpc-go to grpc-go":           newGrpcClient(t, l.Addr().String()),
		"isthmus over shm":             dial(t, shm),
		"isthmus over unix":            dial(t, unix),
		"isthmus to grpc-go":           dial(t, "http://"+l.Addr().String()),
	}
	ctx := testContext(t)
	for name, conn := range clients {
		client := pb.NewEchoClient(conn)
		// A call nothing can cancel waits in one cgo call; one that can be cancelled through
		// the completion queue: both keep the header.
		for _, c := range []context.Context{context.Background(), ctx} {
			var h metadata.MD
			_, err := client.Unary(c, &pb.EchoRequest{}, grpc.Header(&h))
			if status.Code(err) != codes.NotFound || fmt.Sprint(h.Get("x-h")) != "[1]" {
				t.Errorf("%s: unary (cancellable %v): header %v, %v", name, c.Done() != nil, h, err)
			}
		}
		// The header of a failed call is freed whoever asks for it: the raw tier's too.
		if ic, ok := conn.(*isthmus.ClientConn); ok {
			before := isthmus.LiveHandles()
			for _, c := range []context.Context{context.Background(), ctx} {
				if _, err := client.Unary(c, &pb.EchoRequest{}); status.Code(err) != codes.NotFound {
					t.Errorf("%s: unary: %v", name, err)
				}
				if _, err := ic.CallRaw(c, pb.Echo_Unary_FullMethodName, nil); status.Code(err) != codes.NotFound {
					t.Errorf("%s: raw: %v", name, err)
				}
			}
			if n := isthmus.LiveHandles(); n > before { // fewer: an earlier test's freed meanwhile
				t.Errorf("%s: %d handles live after failed calls, %d before", name, n, before)
			}
		}
		stream, err := client.ServerStream(ctx, &pb.StreamRequest{Count: 1})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if h, err := stream.Header(); err != nil || fmt.Sprint(h.Get("x-h")) != "[2]" {
			t.Errorf("%s: stream: header %v, %v", name, h, err)
		}
		if _, err := stream.Recv(); status.Code(err) != codes.NotFound {
			t.Errorf("%s: stream: %v", name, err)
		}
		bare, err := client.ServerStream(ctx, &pb.StreamRequest{})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		// No error; metadata none of the handler's (a server may send empty headers first).
		if h, err := bare.Header(); err != nil || len(h.Get("x-h")) != 0 {
			t.Errorf("%s: a stream that failed bare: header %v, %v", name, h, err)
		}
		if _, err := bare.Recv(); status.Code(err) != codes.NotFound || status.Convert(err).Message() != "bare" {
			t.Errorf("%s: a stream that failed bare: %v", name, err)
		}
		if !strings.HasSuffix(name, "to grpc-go") { // isthmus's server's words
			_, err = client.Unary(ctx, &pb.EchoRequest{Seq: 1})
			msg := status.Convert(err).Message()
			if status.Code(err) != codes.Internal || !strings.Contains(msg, `"X-Up"`) || strings.Contains(msg, "rpc error") {
				t.Errorf("%s: an invalid trailer key: %v", name, err)
			}
		}
	}
}

// A stream's Trailer is an empty map, not nil, before the trailers come, and the trailers
// once the stream has ended; a unary call's grpc.Header and grpc.Trailer are empty maps when
// the server sent none: as on grpc-go.
func TestTrailerIsAnEmptyMapUntilTheTrailersCome(t *testing.T) {
	for name, conn := range besideGrpcGo(t, "trailer-before-end") {
		stream, err := pb.NewEchoClient(conn).Bidi(testContext(t))
		if err != nil {
			t.Fatal(err)
		}
		if md := stream.Trailer(); md == nil || len(md) != 0 {
			t.Errorf("%s: Trailer before the end: %#v, want an empty map", name, md)
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if _, err := stream.Recv(); err != io.EOF {
			t.Fatalf("%s: Recv: %v", name, err)
		}
		if md := stream.Trailer(); md == nil {
			t.Errorf("%s: Trailer after the end is nil", name)
		}
		var header, trailer metadata.MD
		if _, err := pb.NewEchoClient(conn).Unary(testContext(t), &pb.EchoRequest{Seq: 1}, grpc.Header(&header), grpc.Trailer(&trailer)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if header == nil || trailer == nil {
			t.Errorf("%s: a unary call's header %#v, trailer %#v: want maps, empty or not", name, header, trailer)
		}
	}
}

// Metadata grpc-go's client will not send fails the call before it starts, codes.Internal in
// grpc-go's words, for unary and streaming calls alike; the connection goes on.
func TestMetadataGrpcGoRefusesFailsTheCallAsThere(t *testing.T) {
	bad := map[string]metadata.MD{
		"empty key":        {"": {"v"}},
		"key with a space": {"a key": {"v"}},
		"key with a slash": {"a/b": {"v"}},
		"newline in value": {"k": {"a\nb"}},
		"byte 0x7f":        {"k": {"a\x7fb"}},
		"utf-8 in value":   {"k": {"é"}},
	}
	fine := map[string]metadata.MD{
		"binary value":  {"k-bin": {"\x00\xff"}},
		"all it allows": {"0-9_a.z": {" ~"}},
	}
	for name, conn := range besideGrpcGo(t, "metadata-refused") {
		c := pb.NewEchoClient(conn)
		for what, md := range bad {
			ctx := metadata.NewOutgoingContext(testContext(t), md)
			_, uerr := c.Unary(ctx, &pb.EchoRequest{Seq: 1})
			_, serr := c.Bidi(ctx)
			for kind, err := range map[string]error{"unary": uerr, "stream": serr} {
				s := status.Convert(err)
				if s.Code() != codes.Internal || !strings.HasPrefix(s.Message(), "there is an empty key") && !strings.HasPrefix(s.Message(), "header key ") {
					t.Errorf("%s, %s, %s: %v; want Internal in grpc-go's words", name, what, kind, err)
				}
			}
		}
		for what, md := range fine {
			ctx := metadata.NewOutgoingContext(testContext(t), md)
			if _, err := c.Unary(ctx, &pb.EchoRequest{Seq: 2}); err != nil {
				t.Errorf("%s, %s: %v", name, what, err)
			}
		}
	}
}

// The two clients' words for each refusal are the same.
func TestMetadataRefusalsSayWhatGrpcGoSays(t *testing.T) {
	conns := besideGrpcGo(t, "metadata-words")
	for _, md := range []metadata.MD{{"": {"v"}}, {"a key": {"v"}}, {"k": {"a\tb"}}} {
		said := map[string]string{}
		for name, conn := range conns {
			ctx := metadata.NewOutgoingContext(testContext(t), md)
			_, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{Seq: 1})
			said[name] = status.Convert(err).Message()
		}
		if said["grpc-go"] != said["isthmus"] || said["isthmus"] == "" {
			t.Errorf("%v: grpc-go said %q, isthmus %q", md, said["grpc-go"], said["isthmus"])
		}
	}
}

// A method named without its leading slash: grpc-go's client sends it as written and its server
// answers Unimplemented, "malformed method name"; isthmus's refused it InvalidArgument.
func TestAMethodWithoutItsLeadingSlashIsUnimplementedAsOnGrpcGo(t *testing.T) {
	said := map[string]string{}
	for name, conn := range besideGrpcGo(t, "no-slash") {
		const method = "conformance.Echo/Unary"
		err := conn.Invoke(testContext(t), method, &pb.EchoRequest{Seq: 1}, new(pb.EchoReply))
		stream, serr := conn.NewStream(testContext(t), &pb.Echo_ServiceDesc.Streams[0], method)
		if serr == nil {
			serr = stream.RecvMsg(new(pb.EchoReply)) // grpc-go's stream fails at its first read
		}
		for kind, err := range map[string]error{"unary": err, "stream": serr} {
			if c := status.Code(err); c != codes.Unimplemented {
				t.Errorf("%s, %s: %v; want Unimplemented", name, kind, err)
			}
		}
		said[name] = status.Convert(err).Message()
	}
	if said["grpc-go"] != said["isthmus"] {
		t.Errorf("grpc-go said %q, isthmus %q", said["grpc-go"], said["isthmus"])
	}
}

// badHeaders sets metadata grpc-go refuses as a streaming call's header: ServerStream with
// SetHeader, Bidi with SendHeader; each handler ends its call with what that returned.
type badHeaders struct{ echo.Service }

var badHeader = metadata.MD{"a key": {"v"}}

func (badHeaders) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	return stream.SetHeader(badHeader)
}

func (badHeaders) Bidi(stream grpc.BidiStreamingServer[pb.EchoRequest, pb.EchoReply]) error {
	return stream.SendHeader(badHeader)
}

// A streaming handler's SetHeader and SendHeader refuse what grpc-go's refuse, codes.Internal
// in grpc-go's words, at once (isthmus's failed only when the header went, InvalidArgument).
func TestAStreamsHeaderGrpcGoRefusesIsRefusedAsThere(t *testing.T) {
	want := `header key "a key" contains illegal characters not in [0-9a-z-_.]`
	for name, conn := range besideGrpcGoServing(t, "bad-headers", badHeaders{}) {
		c := pb.NewEchoClient(conn)
		ss, err := c.ServerStream(testContext(t), &pb.StreamRequest{})
		if err == nil {
			_, err = ss.Recv()
		}
		bidi, berr := c.Bidi(testContext(t))
		if berr == nil {
			_, berr = bidi.Recv()
		}
		for kind, err := range map[string]error{"SetHeader": err, "SendHeader": berr} {
			if s := status.Convert(err); s.Code() != codes.Internal || s.Message() != want {
				t.Errorf("%s, %s: %v; want Internal %q", name, kind, err, want)
			}
		}
	}
}

// trailersOnly is a server-streaming handler that sends nothing and sets a trailer, so that
// grpc-go's server answers with a trailers-only response: one HEADERS frame that ends the stream.
type trailersOnly struct{ pb.UnimplementedEchoServer }

func (trailersOnly) ServerStream(_ *pb.StreamRequest, s grpc.ServerStreamingServer[pb.EchoReply]) error {
	s.SetTrailer(metadata.Pairs("x-trailer", "t"))
	return nil
}

// A trailers-only OK end from grpc-go's server: its fields are the call's trailer and there is
// no header, for isthmus's client as for grpc-go's. isthmus's gave them as the header and an
// empty trailer.
func TestATrailersOnlyOkEndGivesItsFieldsAsTheTrailer(t *testing.T) {
	address := startGrpcServing(t, trailersOnly{})
	for name, conn := range map[string]grpc.ClientConnInterface{
		"grpc-go": newGrpcClient(t, address),
		"isthmus": dial(t, "http://"+address),
	} {
		t.Run(name, func(t *testing.T) {
			stream, err := pb.NewEchoClient(conn).ServerStream(testContext(t), &pb.StreamRequest{Count: 3})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := stream.Recv(); err != io.EOF {
				t.Fatalf("Recv: %v, want io.EOF", err)
			}
			header, err := stream.Header()
			if err != nil {
				t.Fatal(err)
			}
			if got := header.Get("x-trailer"); len(got) != 0 {
				t.Errorf("header has x-trailer %q; a trailers-only response has no header", got)
			}
			if got := stream.Trailer().Get("x-trailer"); len(got) != 1 || got[0] != "t" {
				t.Errorf("trailer x-trailer = %q, want [t]", got)
			}
		})
	}
}

// headersTwice is a unary handler that sends its initial metadata, then tries to add to it and
// send it again; it answers with the errors it got.
type headersTwice struct{ pb.UnimplementedEchoServer }

func (headersTwice) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	errs := []error{
		grpc.SendHeader(ctx, metadata.Pairs("x-first", "1")),
		grpc.SetHeader(ctx, metadata.Pairs("x-late", "1")),
		grpc.SendHeader(ctx, metadata.Pairs("x-late", "2")),
	}
	var words []string
	for _, err := range errs {
		words = append(words, fmt.Sprint(status.Code(err), ": ", status.Convert(err).Message()))
	}
	return &pb.EchoReply{Payload: []byte(strings.Join(words, "; "))}, nil
}

// Initial metadata given once it went fails in grpc-go's words on isthmus's server as on
// grpc-go's ("transport: SendHeader called multiple times"; isthmus's gave the words of an
// older grpc-go), and the first metadata reaches the client alone.
func TestHeadersGivenAfterTheyWentFailInGrpcGosWords(t *testing.T) {
	replies := map[string]string{}
	for name, conn := range besideGrpcGoServing(t, "headers-twice", headersTwice{}) {
		var header metadata.MD
		r, err := pb.NewEchoClient(conn).Unary(testContext(t), &pb.EchoRequest{}, grpc.Header(&header))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := header.Get("x-first"); len(got) != 1 || len(header.Get("x-late")) != 0 {
			t.Errorf("%s: header %v, want x-first alone", name, header)
		}
		replies[name] = string(r.Payload)
	}
	want := "OK: ; Internal: transport: SendHeader called multiple times; Internal: transport: SendHeader called multiple times"
	for name, got := range replies {
		if got != want {
			t.Errorf("%s's handler got %q, want %q", name, got, want)
		}
	}
}

// contentTypeSeen answers each call with the content types its handler found in its incoming
// metadata.
type contentTypeSeen struct{ pb.UnimplementedEchoServer }

func contentTypes(ctx context.Context) []byte {
	return []byte(strings.Join(metadata.ValueFromIncomingContext(ctx, "content-type"), ","))
}

func (contentTypeSeen) Unary(ctx context.Context, _ *pb.EchoRequest) (*pb.EchoReply, error) {
	return &pb.EchoReply{Payload: contentTypes(ctx)}, nil
}

func (contentTypeSeen) ServerStream(_ *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.EchoReply]) error {
	return stream.Send(&pb.EchoReply{Payload: contentTypes(stream.Context())})
}

// A grpc-go handler finds the call's content type in its incoming metadata, with or without
// metadata of the caller's, in unary and streaming calls; the same here, over shm:// and over
// HTTP/2 (a grpc-go client). Before, a handler found none.
func TestHandlersFindTheContentTypeInTheirMetadata(t *testing.T) {
	conns := besideGrpcGoServing(t, "content-type", contentTypeSeen{})
	_, unix := fresh(t, "content-type-http2")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, contentTypeSeen{})
	serving(t, s, unix)
	conns["grpc-go to isthmus over HTTP/2"] = newGrpcClient(t, unix)
	for name, conn := range conns {
		c := pb.NewEchoClient(conn)
		for _, md := range []metadata.MD{nil, metadata.Pairs("x-a", "1")} {
			ctx := metadata.NewOutgoingContext(testContext(t), md)
			r, err := c.Unary(ctx, &pb.EchoRequest{})
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			stream, err := c.ServerStream(ctx, &pb.StreamRequest{})
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			s, err := stream.Recv()
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if got := []string{string(r.Payload), string(s.Payload)}; got[0] != "application/grpc" || got[1] != "application/grpc" {
				t.Errorf("%s, metadata %v: the handlers found content types %q, want application/grpc", name, md, got)
			}
		}
	}
}

// sendRequests calls method as a client that streams, sending n requests, and gives the
// call's outcome: its replies' sequence numbers, then its final status.
func sendRequests(ctx context.Context, conn grpc.ClientConnInterface, method string, n int) []string {
	stream, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, method)
	if err != nil {
		return []string{status.Convert(err).String()}
	}
	for i := range n {
		if stream.SendMsg(&pb.EchoRequest{Seq: uint64(i + 1)}) != nil {
			break
		}
	}
	stream.CloseSend()
	var out []string
	for {
		var r pb.EchoReply
		switch err := stream.RecvMsg(&r); err {
		case nil:
			out = append(out, fmt.Sprint(r.Seq))
		case io.EOF:
			return append(out, "OK")
		default:
			return append(out, status.Convert(err).String())
		}
	}
}

// A client that sends no request, or two, to a method that takes one (a stub of another
// shape): grpc-go's server fails the call INTERNAL ("cardinality violation"), and so does the
// Go server now. Before, a server-streaming call sent none ended OK with no replies (the
// handler's io.EOF), and a call sent two was served from the first.
func TestAMethodTakingOneRequestRefusesNoneOrMore(t *testing.T) {
	conns := besideGrpcGoServing(t, "cardinality", &echo.Service{})
	// Unary handlers on the connection's reader too, and HTTP/2's loopback (a grpc-go client).
	shm, unix := fresh(t, "cardinality-inline")
	s := isthmus.NewServer(isthmus.InlineUnary())
	pb.RegisterEchoServer(s, &echo.Service{})
	s.HandleRawUnary("/raw.Echo/Unary", func(call *isthmus.RawServerCall, request *isthmus.Message) (*isthmus.Block, error) {
		return call.Alloc(0)
	})
	serving(t, s, shm, unix)
	conns["isthmus, InlineUnary"] = dial(t, shm)
	conns["grpc-go to isthmus over HTTP/2, InlineUnary"] = newGrpcClient(t, unix)
	for name, conn := range conns {
		for _, c := range []struct {
			method string
			n      int
			want   string
		}{
			{"/conformance.Echo/Unary", 0, "no request message from"},
			{"/conformance.Echo/Unary", 2, "multiple request messages for"},
			{"/conformance.Echo/ServerStream", 0, "no request message from"},
			{"/conformance.Echo/ServerStream", 2, "multiple request messages for"},
			{"/raw.Echo/Unary", 2, "multiple request messages for"},
		} {
			if c.method == "/raw.Echo/Unary" && !strings.Contains(name, "InlineUnary") {
				continue // a raw handler of the InlineUnary server only
			}
			want := status.New(codes.Internal, "cardinality violation: received "+c.want+" non-client-streaming RPC").String()
			if got := sendRequests(testContext(t), conn, c.method, c.n); len(got) != 1 || got[0] != want {
				t.Errorf("%s: %s with %d requests ended %q, want %q", name, c.method, c.n, got, want)
			}
		}
		// One request, its half-close in a frame of its own (the handler waits for it): served.
		if got := sendRequests(testContext(t), conn, "/conformance.Echo/Unary", 1); fmt.Sprint(got) != "[1 OK]" {
			t.Errorf("%s: a unary call sent one request ended %q, want [1 OK]", name, got)
		}
	}
}

// headerThenWait is a server-streaming handler that sends initial metadata and its messages,
// then waits for its call to end.
type headerThenWait struct{ pb.UnimplementedEchoServer }

func (headerThenWait) ServerStream(r *pb.StreamRequest, s grpc.ServerStreamingServer[pb.EchoReply]) error {
	if err := s.SendHeader(metadata.Pairs("x-h", "3")); err != nil {
		return err
	}
	for i := uint32(0); i < r.GetCount(); i++ {
		if err := s.Send(&pb.EchoReply{Seq: uint64(i)}); err != nil {
			return err
		}
	}
	<-s.Context().Done()
	return s.Context().Err()
}

// A stream read in part and then cancelled keeps the initial metadata that came, for Header
// and grpc.Header, as grpc-go's does: isthmus took them only when asked for, or for stats
// handlers, and a cancel before that left both nil.
func TestAStreamCancelledAfterItsMessagesKeepsTheHeaderThatCame(t *testing.T) {
	for name, conn := range besideGrpcGoServing(t, "header-kept", headerThenWait{}) {
		ctx, cancel := context.WithCancel(testContext(t))
		var h metadata.MD
		stream, err := pb.NewEchoClient(conn).ServerStream(ctx, &pb.StreamRequest{Count: 3}, grpc.Header(&h))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for i := 0; i < 3; i++ {
			if _, err := stream.Recv(); err != nil {
				t.Fatalf("%s: message %d: %v", name, i, err)
			}
		}
		cancel()
		if _, err := stream.Recv(); status.Code(err) != codes.Canceled {
			t.Errorf("%s: after the cancel: %v", name, err)
		}
		got, err := stream.Header()
		if err != nil || fmt.Sprint(got.Get("x-h")) != "[3]" {
			t.Errorf("%s: Header after the cancel: %v, %v", name, got, err)
		}
		if fmt.Sprint(h.Get("x-h")) != "[3]" {
			t.Errorf("%s: grpc.Header after the cancel: %v", name, h)
		}
	}
}

// A stream whose Header finds it ended without initial metadata is finished then, as
// grpc-go's is: its handle is freed though nobody reads its status. Before, it was kept until
// a Recv, or the connection's Close.
func TestAStreamEndedBareIsFinishedByHeader(t *testing.T) {
	shm, unix := fresh(t, "header-finishes")
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, failingAfterHeader{})
	serving(t, s, shm, unix)
	conn := dial(t, shm)
	client := pb.NewEchoClient(conn)
	ctx := testContext(t)
	before := isthmus.LiveHandles()
	for i := 0; i < 3; i++ {
		bare, err := client.ServerStream(ctx, &pb.StreamRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if h, err := bare.Header(); err != nil || len(h.Get("x-h")) != 0 {
			t.Errorf("a stream that failed bare: header %v, %v", h, err)
		}
	}
	// More than before: a stream kept. (Fewer is an earlier test's handle freed meanwhile:
	// the count is the process's.)
	if n := isthmus.LiveHandles(); n > before {
		t.Errorf("%d handles live after three streams that ended, %d before", n, before)
	}
}
