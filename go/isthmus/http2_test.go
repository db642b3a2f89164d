package isthmus_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// countsCalls is an Echo service that counts the unary calls its handler runs.
type countsCalls struct {
	pb.UnimplementedEchoServer
	calls *atomic.Int32
}

func (s countsCalls) Unary(_ context.Context, req *pb.EchoRequest) (*pb.EchoReply, error) {
	s.calls.Add(1)
	return &pb.EchoReply{Payload: req.Payload}, nil
}

// An HTTP/2 request that is not a gRPC call (a method other than POST; a content type other
// than application/grpc, +codec or ;parameters) is refused before any handler runs, with
// grpc-go's HTTP status, gRPC code and words: 405 INTERNAL, 415 INVALID_ARGUMENT. isthmus's
// server ran the handler for a PUT, or a POST of text/plain (a browser's cross-site form
// sends one) or of no content type at all, and answered 200.
func TestRequestsThatAreNotGrpcCallsAreRefusedAsGrpcGoRefusesThem(t *testing.T) {
	var isthmusCalls, grpcCalls atomic.Int32
	s := isthmus.NewServer()
	pb.RegisterEchoServer(s, countsCalls{calls: &isthmusCalls})
	if err := s.Start("http://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	servers := map[string]string{
		"isthmus": grpcTarget(s.HTTPAddresses()[0]),
		"grpc-go": startGrpcServing(t, countsCalls{calls: &grpcCalls}),
	}
	client := &http.Client{Transport: &http2.Transport{AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}}}
	t.Cleanup(client.CloseIdleConnections)
	message := []byte{0, 0, 0, 0, 2, 10, 0} // one EchoRequest with an empty payload
	cases := []struct{ method, contentType, want string }{
		{"POST", "application/grpc", "200 status 0 words "},
		{"POST", "application/grpc+proto", "200 status 0 words "},
		{"POST", "application/grpc;charset=utf-8", "200 status 0 words "},
		{"PUT", "application/grpc", `405 status 13 words Received a HEADERS frame with :method "PUT" which should be POST`},
		{"GET", "application/grpc", `405 status 13 words Received a HEADERS frame with :method "GET" which should be POST`},
		{"POST", "text/plain", `415 status 3 words invalid gRPC request content-type "text/plain"`},
		{"POST", "", `415 status 3 words invalid gRPC request content-type ""`},
		{"POST", "application/grpc-web", `415 status 3 words invalid gRPC request content-type "application/grpc-web"`},
		// Both wrong (a stray GET from curl or a browser): the content type counts first.
		{"GET", "", `415 status 3 words invalid gRPC request content-type ""`},
	}
	for name, address := range servers {
		for _, c := range cases {
			var body io.Reader = bytes.NewReader(message)
			if c.method == "GET" {
				body = nil
			}
			request, err := http.NewRequestWithContext(testContext(t), c.method, "http://"+address+pb.Echo_Unary_FullMethodName, body)
			if err != nil {
				t.Fatal(err)
			}
			if c.contentType != "" {
				request.Header.Set("content-type", c.contentType)
			}
			request.Header.Set("te", "trailers")
			response, err := client.Do(request)
			if err != nil {
				t.Fatalf("%s: %s %q: %v", name, c.method, c.contentType, err)
			}
			io.Copy(io.Discard, response.Body)
			response.Body.Close()
			field := func(key string) string { return response.Header.Get(key) + response.Trailer.Get(key) }
			got := fmt.Sprintf("%d status %s words %s", response.StatusCode, field("grpc-status"), field("grpc-message"))
			if got != c.want {
				t.Errorf("%s: %s %q: %q, want %q", name, c.method, c.contentType, got, c.want)
			}
		}
	}
	if got := isthmusCalls.Load(); got != 3 {
		t.Errorf("isthmus's handler ran %d times, want 3 (the gRPC calls only)", got)
	}
	if got := grpcCalls.Load(); got != 3 {
		t.Errorf("grpc-go's handler ran %d times, want 3", got)
	}
}

// A header block that names one 4,000-byte field of the client's table 60,000 times (a 62 KB
// block that decodes to 240 MB, an HPACK "bomb") fails its own call RESOURCE_EXHAUSTED, costs the
// server no more than the bound it advertises, and the connection serves on. Before, the
// server's peak memory rose from 6 to 477 MB, and 1 MiB of such a block took ~4 GB.
func TestAHeaderBlockThatDecodesPastTheBoundFailsItsCallAndCostsNothing(t *testing.T) {
	p := startPeer(t, tonicPeer(t), "http://127.0.0.1:0")
	addr := strings.TrimPrefix(p.addresses[0], "http://")
	pid := fmt.Sprint(p.cmd.Process.Pid)
	before := procStatus(t, pid, "VmHWM") // KiB
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, f := range []hpack.HeaderField{
		{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "http"}, {Name: ":path", Value: "/conformance.Echo/Unary"},
		{Name: ":authority", Value: "x"}, {Name: "content-type", Value: "application/grpc"},
	} {
		enc.WriteField(f)
	}
	big := hpack.HeaderField{Name: "x-big", Value: strings.Repeat("a", 4000)}
	for range 60_001 { // into the table once, then by its index
		enc.WriteField(big)
	}
	c.Write([]byte(http2.ClientPreface))
	fr := http2.NewFramer(c, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.WriteSettings()
	rest := block.Bytes()
	first := rest[:16384]
	rest = rest[16384:]
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: first})
	for len(rest) > 0 {
		n := min(16384, len(rest))
		fr.WriteContinuation(1, n == len(rest), rest[:n])
		rest = rest[n:]
	}
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	answered := false
	for !answered {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("the connection ended (or said nothing) after the call's header block: %v", err)
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok && h.StreamID == 1 {
			if got := h.PseudoValue("status"); got != "200" {
				t.Fatalf(":status %q", got)
			}
			fields := map[string]string{}
			for _, f := range h.RegularFields() {
				fields[f.Name] = f.Value
			}
			if got := fields["grpc-status"]; got != "8" {
				t.Fatalf("grpc-status %q (%q), want 8 (RESOURCE_EXHAUSTED)", got, fields["grpc-message"])
			}
			answered = true
		}
	}
	// The connection goes on: a PING is answered on it.
	fr.WritePing(false, [8]byte{7})
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("no PING answer: %v", err)
		}
		if ping, ok := f.(*http2.PingFrame); ok && ping.IsAck() && ping.Data == [8]byte{7} {
			break
		}
	}
	if grew := procStatus(t, pid, "VmHWM") - before; grew > 64<<10 {
		t.Fatalf("the server's peak memory grew by %d KiB for one 62 KB header block", grew)
	}
	// The server serves on.
	conn := newGrpcClient(t, addr)
	if _, err := pb.NewEchoClient(conn).Unary(testContext(t), &pb.EchoRequest{Seq: 1}); err != nil {
		t.Fatalf("a call after the bomb: %v", err)
	}
}
