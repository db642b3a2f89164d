package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// ClientConn is a connection to one server that grpc-go's generated clients run on: it
// implements grpc.ClientConnInterface. It connects on its first call, and again after the
// server went away. Safe for concurrent use; Close it when done.
type ClientConn struct {
	ch     *C.isthmus_channel_t
	r      *reactor
	target string
	closed atomic.Bool
	// uses counts the references to ch: one of the connection's own, which Close drops, and
	// one per cgo call in progress that passes it. ch is freed when the count reaches 0, so
	// that no call passes a handle freed under it (the library would refuse it as no channel,
	// INVALID_ARGUMENT, where the call should end with the connection's closing).
	uses  atomic.Int64
	freed sync.Once
	// shm: the target is shared memory, where large requests are written in place.
	shm bool
	// invoker and streamer run the interceptors (nil without any), composed at Dial.
	invoker  grpc.UnaryInvoker
	streamer grpc.Streamer
	perRPC   perRPC
	// defaults are WithDefaultCallOptions', applied before each typed call's own.
	defaults []grpc.CallOption
	// peer is what grpc.Peer gives, worked out once (serverPeer).
	peerOnce sync.Once
	peer     peer.Peer
	// stats are WithStatsHandler's handlers; connStats reports the connection to them.
	stats     []stats.Handler
	connStats *connStats
	// readerReads: streams leave the reading to the library's reader, as before ADR 0029
	// (set by tests only, for a baseline).
	readerReads bool
	// streams are the streams open on the connection, which Close finishes (as grpc-go's
	// does); streamsClosed is set once Close has taken them.
	streamsMu     sync.Mutex
	streams       map[*clientStream]struct{}
	streamsClosed bool
}

// Messages up to inPlaceMax bytes are marshalled straight into shared memory (one copy)
// instead of into Go memory and then copied there: a unary call's request and reply from
// largeUnary, a stream's messages from largeMessage. Below its bound a message in Go memory
// grows the heap the collector must keep up with (at 64 KiB it ran every ~25 calls). A
// stream's message keeps the higher bound: one in Go memory is sent through the completion
// queue, where a send waiting for a slow client holds no thread and ends with its context,
// while a block is sent by a blocking cgo call. Past inPlaceMax a block might not fit the
// arena (64 MiB by default; larger messages travel in pieces).
const (
	largeUnary   = 16 << 10
	largeMessage = 256 << 10
	inPlaceMax   = 16 << 20
)

// inPlace says whether a message of size bytes, of a unary call or not, is marshalled into
// shared memory.
func inPlace(size int, unary bool) bool {
	from := largeMessage
	if unary {
		from = largeUnary
	}
	return size >= from && size <= inPlaceMax
}

// blockingCalls bounds the unary calls that may wait in a cgo call (holding their thread) at
// once; the others wait on the completion queue.
// They are at most half the Ps: a goroutine in a cgo call keeps its P until the runtime's
// monitor takes it back (after up to 10 ms when idle), so Ps all held by waiting calls
// stalled the goroutines their replies had woken (measured: p99 11 ms at 32 in flight).
var blockingCalls = int32(max(runtime.GOMAXPROCS(0)/2, 1))

// held counts this process's calls waiting in a cgo call now, each holding its thread: unary
// calls on the blocking fast path, and receives (clients' and handlers') waiting on their
// thread first. One count for the process, since they all hold the same Ps.
var held atomic.Int32

// hold takes one of the blockingCalls threads that may wait in a cgo call; false if none is
// left. Give it back with release.
func hold() bool {
	if held.Add(1) <= blockingCalls {
		return true
	}
	held.Add(-1)
	return false
}

func release() { held.Add(-1) }

var _ grpc.ClientConnInterface = (*ClientConn)(nil)

// DialOption configures a ClientConn.
type DialOption func(*dialOptions)

type dialOptions struct {
	maxMessageSize  uint64
	tls             *TLSConfig
	unaryInt        grpc.UnaryClientInterceptor
	chainUnaryInts  []grpc.UnaryClientInterceptor
	streamInt       grpc.StreamClientInterceptor
	chainStreamInts []grpc.StreamClientInterceptor
	perRPC          []credentials.PerRPCCredentials
	callOptions     []grpc.CallOption
	stats           []stats.Handler
	// upgrade is the channel's ISTHMUS_CHANNEL_*UPGRADE flag (0: the process's default).
	upgrade   C.uint32_t
	keepalive keepalive.ClientParameters
	userAgent string
	authority string
	// connectTimeout bounds a connection's coming up (0: the library's 20 s).
	connectTimeout time.Duration
}

// millis is d in whole milliseconds, rounded up (a keepalive time or timeout under a
// millisecond is not none); 0, the library's "none" or "default", for d <= 0.
func millis(d time.Duration) C.uint64_t {
	if d <= 0 {
		return 0
	}
	// Rounded up without adding first: grpc-go's "infinity" is math.MaxInt64.
	ms := d / time.Millisecond
	if d%time.Millisecond != 0 {
		ms++
	}
	return C.uint64_t(ms)
}

// WithKeepaliveParams turns on HTTP/2 keepalive, as grpc.WithKeepaliveParams does: after
// kp.Time in which nothing came from the server, the connection sends a PING, and if its
// answer does not come within kp.Timeout (20 s if zero) it closes, and its calls fail with
// codes.Unavailable instead of waiting for their deadlines (a host gone, a flow dropped on the
// way). It pings only while a call is open, unless kp.PermitWithoutStream. A zero kp.Time
// turns it off. Unlike grpc-go, a Time under 10 s is not raised to 10 s: mind the server's
// ping policy. shm:// needs none: a server that dies there is seen at once.
func WithKeepaliveParams(kp keepalive.ClientParameters) DialOption {
	return func(o *dialOptions) { o.keepalive = kp }
}

// WithConnectParams takes, of grpc.WithConnectParams's settings, MinConnectTimeout: how long
// an HTTP/2 connection may take to come up, its TLS handshake and the server's SETTINGS
// included (20 s if zero, as grpc-go's). Past it the calls waiting on it fail with
// codes.Unavailable, where they would wait for their deadlines on a host that drops packets
// or a server that never answers. The backoff between attempts is the library's (100 ms, x1.6,
// at most 5 s), not cp.Backoff. shm:// has its handshake's own bound.
func WithConnectParams(cp grpc.ConnectParams) DialOption {
	return func(o *dialOptions) { o.connectTimeout = cp.MinConnectTimeout }
}

// WithUserAgent names the connection's calls' user agent, as grpc.WithUserAgent does: a
// server's handlers see it as "user-agent" in their incoming metadata, grpc-go's, grpcio's and
// isthmus's alike. Over HTTP/2 the library's own agent follows it ("AGENT tonic/…", where
// grpc-go's says "AGENT grpc-go/…"); over shm:// it goes as it is. Printable ASCII, at most
// 1 KiB: Dial fails with codes.InvalidArgument otherwise. "" names none, as with grpc-go.
func WithUserAgent(s string) DialOption {
	return func(o *dialOptions) { o.userAgent = s }
}

// WithAuthority names the :authority the connection's HTTP/2 calls send in place of the
// target's, as grpc.WithAuthority does: for a proxy or a server that routes by host. As in
// grpc-go, TLS then checks the server's certificate against its host, per-RPC credentials are
// given it in their uri, and Dial refuses a WithTLS ServerName that differs from it.
// HOST[:PORT]: Dial fails with codes.InvalidArgument otherwise. shm:// sends no :authority.
// "" is the target's.
func WithAuthority(s string) DialOption {
	return func(o *dialOptions) { o.authority = s }
}

// WithUpgrade says whether calls to an HTTP/2 address move to shared memory when its server is
// a local isthmus server that offers it (docs/adr/0013): true moves them even where the
// environment variable ISTHMUS_UPGRADE=0 turns that off for the process, false keeps them on
// HTTP/2. Without it the process's default holds: on, unless ISTHMUS_UPGRADE is 0, off or
// false. A connection that moved counts its calls in TransportStats.
func WithUpgrade(on bool) DialOption {
	return func(o *dialOptions) {
		o.upgrade = C.ISTHMUS_CHANNEL_NO_UPGRADE
		if on {
			o.upgrade = C.ISTHMUS_CHANNEL_UPGRADE
		}
	}
}

// WithMaxMessageSize sets the largest message the connection accepts, in bytes (default
// 4 GiB); a larger reply fails its call with codes.ResourceExhausted. The library enforces it
// as the message arrives; grpc.MaxCallRecvMsgSize can set a lower limit for a typed call,
// checked once the message is there.
func WithMaxMessageSize(n uint64) DialOption {
	return func(o *dialOptions) { o.maxMessageSize = n }
}

// Dial returns a connection to target: "shm://NAME" or "shm:///path.sock" for shared memory,
// "unix:///path.sock" or "http://host:port" for standard gRPC over HTTP/2 (any gRPC server),
// "https://host:port" for the same over TLS (see WithTLS). It does not wait for the server: a
// target or TLS settings that do not parse fail here (codes.InvalidArgument); an unreachable
// server, or a refused TLS handshake, fails calls with codes.Unavailable. Per-RPC credentials
// that need a secure connection fail it on a plaintext one (WithPerRPCCredentials).
func Dial(target string, opts ...DialOption) (*ClientConn, error) {
	var o dialOptions
	for _, f := range opts {
		f(&o)
	}
	if o.authority != "" && o.tls != nil && o.tls.ServerName != "" && o.tls.ServerName != o.authority {
		// As grpc-go's NewClient refuses the two when they differ.
		return nil, status.Errorf(codes.InvalidArgument,
			"the authority from the TLS settings (%q) and from WithAuthority (%q) don't match", o.tls.ServerName, o.authority)
	}
	creds, err := newPerRPC(&o, target)
	if err != nil {
		return nil, err
	}
	r, err := getReactor()
	if err != nil {
		return nil, err
	}
	if err := noNUL("target", target); err != nil {
		return nil, err
	}
	ct := C.CString(target)
	defer C.free(unsafe.Pointer(ct))
	copts := C.isthmus_channel_options_t{max_message_size: C.uint64_t(o.maxMessageSize), flags: o.upgrade}
	copts.keepalive_time_ms, copts.keepalive_timeout_ms = millis(o.keepalive.Time), millis(o.keepalive.Timeout)
	copts.connect_timeout_ms = millis(o.connectTimeout)
	if o.keepalive.PermitWithoutStream {
		copts.flags |= C.ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS
	}
	if o.tls != nil {
		t, err := clientTLS(o.tls)
		defer t.free()
		if err != nil {
			return nil, err
		}
		copts.tls = t.opts
	}
	if o.userAgent != "" {
		if strings.IndexByte(o.userAgent, 0) >= 0 {
			// C would end the string there: refused, as the library refuses any control byte.
			return nil, status.Errorf(codes.InvalidArgument, "user agent %q must be printable ASCII", o.userAgent)
		}
		copts.user_agent = C.CString(o.userAgent)
		defer C.free(unsafe.Pointer(copts.user_agent))
	}
	if o.authority != "" {
		if err := noNUL("authority", o.authority); err != nil {
			return nil, err
		}
		copts.authority = C.CString(o.authority)
		defer C.free(unsafe.Pointer(copts.authority))
	}
	var ch *C.isthmus_channel_t
	var st *C.isthmus_status_t
	if code := C.isthmus_channel_new(ct, &copts, &ch, &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return nil, err
	}
	cc := &ClientConn{ch: ch, r: r, target: target, shm: strings.HasPrefix(target, "shm:"), perRPC: creds,
		defaults: slices.Clip(o.callOptions), stats: slices.Clip(o.stats)}
	cc.uses.Store(1) // the connection's own reference, which Close drops
	if len(cc.stats) > 0 {
		cc.connStats = beginConn(cc.stats, cc.serverPeer().Addr)
	}
	cc.invoker = unaryInvoker(withFirst(o.unaryInt, o.unaryInt != nil, o.chainUnaryInts),
		func(ctx context.Context, method string, req, reply any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
			return cc.invoke(ctx, method, req, reply, opts...)
		})
	cc.streamer = streamer(withFirst(o.streamInt, o.streamInt != nil, o.chainStreamInts),
		func(ctx context.Context, desc *grpc.StreamDesc, _ *grpc.ClientConn, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return cc.newClientStream(ctx, desc, method, opts)
		})
	return cc, nil
}

// Target is the target the connection was made for.
func (cc *ClientConn) Target() string { return cc.target }

// Close releases the connection. Calls in progress end now with codes.Canceled "grpc: the
// client connection is closing" (their handlers see them end), and new calls fail with it, as
// grpc-go's do; so does a second Close. Open streams are finished with it, read or not: their
// grpc.OnFinish callbacks and stats handlers hear of it, their handles go, their RecvMsg
// returns it and their SendMsg io.EOF.
func (cc *ClientConn) Close() error {
	if cc.closed.Swap(true) {
		return errClosing()
	}
	// ch is still the connection's own reference's here.
	msg := C.CString(closingMessage)
	C.isthmus_channel_shutdown(cc.ch, C.ISTHMUS_CANCELLED, msg, nil)
	C.free(unsafe.Pointer(msg))
	cc.streamsMu.Lock()
	streams := cc.streams
	cc.streams, cc.streamsClosed = nil, true
	cc.streamsMu.Unlock()
	// Without the lock: a stream finishing meanwhile leaves the set (untrack) as it does, and
	// finish waits for it here.
	for s := range streams {
		s.fail(errClosing())
	}
	cc.unuse() // the connection's own reference: ch goes now, or with the last call using it
	cc.connStats.end()
	return nil
}

// track adds an open stream to those Close finishes; false once Close has taken them.
func (cc *ClientConn) track(s *clientStream) bool {
	cc.streamsMu.Lock()
	defer cc.streamsMu.Unlock()
	if cc.streamsClosed {
		return false
	}
	if cc.streams == nil {
		cc.streams = make(map[*clientStream]struct{})
	}
	cc.streams[s] = struct{}{}
	return true
}

// untrack removes a finished stream from those Close finishes.
func (cc *ClientConn) untrack(s *clientStream) {
	cc.streamsMu.Lock()
	delete(cc.streams, s)
	cc.streamsMu.Unlock()
}

// use takes a reference to ch for a cgo call that passes it: false (and none taken) once the
// connection is closed. Each true is followed by unuse when the cgo call has returned.
func (cc *ClientConn) use() bool {
	cc.uses.Add(1)
	if cc.closed.Load() {
		// Close dropped its reference before, or drops it after and sees this one: either
		// way ch is freed exactly when the count reaches 0.
		cc.unuse()
		return false
	}
	return true
}

// unuse drops a reference to ch; the last one frees it.
func (cc *ClientConn) unuse() {
	if cc.uses.Add(-1) == 0 {
		cc.free()
	}
}

func (cc *ClientConn) free() {
	cc.freed.Do(func() { C.isthmus_channel_close(cc.ch) })
}

// closedEvent is the outcome of a call that found the connection closed as it started.
func closedEvent() C.isthmus_event_t {
	return C.isthmus_event_t{op: C.ISTHMUS_OP_UNARY, code: C.ISTHMUS_CANCELLED}
}

// closingMessage is grpc-go's, for calls that a closed connection ends.
const closingMessage = "grpc: the client connection is closing"

func errClosing() error {
	return status.Error(codes.Canceled, closingMessage)
}

// closingError is err, or errClosing for an Unavailable that Close caused: a call that
// started while Close shut the channel, or that waited for a server (WaitForReady).
func (cc *ClientConn) closingError(err error) error {
	// Unavailable: the library's end of a call Close cut; Canceled: a call that found the
	// connection closed as it started (its start gives CANCELLED).
	if c := status.Code(err); (c == codes.Unavailable || c == codes.Canceled) && cc.closed.Load() {
		return errClosing()
	}
	return err
}

// cCallOptions builds the C options of a call of method from its context, with the metadata
// of its per-RPC credentials; method "" is no call (Alloc): no credentials are asked. The
// caller frees the metadata handle in it.
func (cc *ClientConn) cCallOptions(ctx context.Context, method string, co callOptions, flags C.uint32_t) (C.isthmus_call_options_t, error) {
	var o C.isthmus_call_options_t
	if err := noNUL("method path", method); err != nil {
		return o, err
	}
	if err := setTimeout(ctx, &o); err != nil {
		return o, err
	}
	if err := ctx.Err(); err != nil {
		return o, status.FromContextError(err).Err()
	}
	md, ok := metadata.FromOutgoingContext(ctx)
	if method != "" {
		if err := validateOutgoing(ctx); err != nil {
			return o, err
		}
		if len(cc.perRPC.creds) > 0 || co.creds != nil {
			var err error
			if md, err = cc.perRPC.requestMetadata(ctx, method, co.creds, md); err != nil {
				return o, err
			}
			ok = true
		}
	}
	if ok {
		h, err := newMetadata(md)
		if err != nil {
			return o, err
		}
		o.metadata = h
	}
	o.flags = flags
	if co.waitForReady {
		o.flags |= C.ISTHMUS_CALL_WAIT_FOR_READY
	}
	switch co.compression {
	case "gzip":
		o.flags |= C.ISTHMUS_CALL_COMPRESS_GZIP
	case "deflate":
		o.flags |= C.ISTHMUS_CALL_COMPRESS_DEFLATE
	}
	return o, nil
}

// setTimeout sets o's timeout to what is left of ctx's deadline (none without one).
func setTimeout(ctx context.Context, o *C.isthmus_call_options_t) error {
	o.timeout_us = 0
	if d, ok := ctx.Deadline(); ok {
		left := time.Until(d)
		if left <= 0 {
			return status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
		}
		o.timeout_us = C.int64_t(max(left.Microseconds(), 1))
	}
	return nil
}

// marshal encodes a message with protobuf. An untyped nil is an empty message, as grpc-go's
// encoding takes it (a typed nil is one to protobuf too). Its errors, and unmarshal's, are in
// the words of grpc-go's proto codec.
func marshal(m any) ([]byte, error) {
	if m == nil {
		return nil, nil
	}
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, status.Errorf(codes.Internal, "grpc: error while marshaling: proto: failed to marshal, message is %T, want proto.Message", m)
	}
	b, err := proto.Marshal(pm)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "grpc: error while marshaling: %v", err)
	}
	return b, nil
}

func unmarshal(b []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return status.Errorf(codes.Internal, "grpc: failed to unmarshal the received message: failed to unmarshal, message is %T, want proto.Message", m)
	}
	if err := proto.Unmarshal(b, pm); err != nil {
		return status.Errorf(codes.Internal, "grpc: failed to unmarshal the received message: %v", err)
	}
	return nil
}

// sendFailed is a client stream's send that the library refused with code (and status, which
// it frees). A call that is over (CANCELLED, UNAVAILABLE) says io.EOF, as grpc-go's SendMsg
// does, and RecvMsg gives the status; a send refused while the call goes on (a block of
// another connection, a send after the half-close) says why, as io.EOF would tell the caller
// to stop reading for a status that is not there.
func sendFailed(code C.isthmus_code_t, st *C.isthmus_status_t) error {
	if code == C.ISTHMUS_CANCELLED || code == C.ISTHMUS_UNAVAILABLE {
		if st != nil {
			C.isthmus_status_free(st)
		}
		return io.EOF
	}
	err, _ := statusError(code, st)
	return err
}

// ctxError is what a call whose context ended returns.
func ctxError(ctx context.Context) error {
	return status.FromContextError(ctx.Err()).Err()
}

// contextual is a call's error as grpc-go gives it once the call's context has ended: the
// context's (DeadlineExceeded "context deadline exceeded", or Canceled), not the library's
// account of the end, which may come first: the cancel that the context's end caused, or
// the library's own deadline, which is the same deadline.
func contextual(ctx context.Context, err error) error {
	code := status.Code(err)
	if (code == codes.Canceled || code == codes.DeadlineExceeded) && ctx.Err() != nil {
		return ctxError(ctx)
	}
	// The library's timer, on the same deadline (rounded down to whole microseconds), can go off
	// before Go's has ended the context.
	if d, ok := ctx.Deadline(); ok && code == codes.DeadlineExceeded && time.Until(d) < time.Millisecond {
		return status.FromContextError(context.DeadlineExceeded).Err()
	}
	return err
}

// callError is a failed call's error as grpc-go gives it: Canceled once Close has cut the
// call (closingError), the context's error once the context has ended (contextual).
func (cc *ClientConn) callError(ctx context.Context, err error) error {
	return contextual(ctx, cc.closingError(err))
}

// Invoke makes a unary call (grpc.ClientConnInterface), through the interceptors if any.
func (cc *ClientConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	opts = withDefaults(cc.defaults, opts)
	if cc.invoker != nil {
		return cc.invoker(ctx, method, args, reply, nil, opts...)
	}
	return cc.invoke(ctx, method, args, reply, opts...)
}

// invoke makes a unary call, the interceptors' invoker.
func (cc *ClientConn) invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	co := parseCallOptions(opts)
	if len(cc.stats) > 0 {
		ctx, co.stats = cc.beginStats(ctx, method, co, false, false)
	}
	err := cc.invokeWith(ctx, method, args, reply, co)
	co.stats.end(err)
	co.finished(err)
	return err
}

// beginStats starts reporting a call to the connection's stats handlers: TagRPC, Begin and
// its outgoing headers (the tagged context's metadata, which the call sends).
func (cc *ClientConn) beginStats(ctx context.Context, method string, co callOptions, clientStream, serverStream bool) (context.Context, *rpcStats) {
	ctx, r := beginRPC(ctx, cc.stats, true, method, !co.waitForReady, clientStream, serverStream)
	md, _ := metadata.FromOutgoingContext(ctx)
	r.outHeader(md, method, cc.serverPeer().Addr)
	return ctx, r
}

// invokeWith makes a unary call with its parsed options.
func (cc *ClientConn) invokeWith(ctx context.Context, method string, args, reply any, co callOptions) error {
	if cc.closed.Load() {
		return errClosing()
	}
	if co.err != nil {
		return co.err
	}
	if pm, ok := args.(proto.Message); ok && cc.shm && co.codec == nil {
		size := proto.Size(pm)
		if err := co.checkSend(size); err != nil {
			return err
		}
		if inPlace(size, true) {
			return cc.invokeLarge(ctx, method, pm, size, reply, co)
		}
	}
	req, err := co.marshal(args)
	if err != nil {
		return err
	}
	if err := co.checkSend(len(req)); err != nil {
		return err
	}
	copts, err := cc.cCallOptions(ctx, method, co, 0)
	if err != nil {
		return err
	}
	co.stats.outPayload(args, len(req))
	path, done := cString(method)
	ev, ok := cc.unaryBytes(ctx, path, req, &copts)
	done()
	return cc.unaryReply(ctx, ev, ok, reply, co)
}

// unaryBytes runs a unary call whose request is req's bytes (copied into the call) the way
// unary does; the metadata handle in copts is freed here.
func (cc *ClientConn) unaryBytes(ctx context.Context, path *C.char, req []byte, copts *C.isthmus_call_options_t) (C.isthmus_event_t, bool) {
	defer runtime.KeepAlive(req)
	return cc.unary(ctx, copts, func(o *C.isthmus_call_options_t) C.isthmus_event_t {
		if !cc.use() {
			return closedEvent()
		}
		defer cc.unuse()
		var msg *C.isthmus_message_t
		var header, trailer *C.isthmus_metadata_t
		var st *C.isthmus_status_t
		code := C.isthmus_unary(cc.ch, path, bytesPtr(req), C.size_t(len(req)), o, &msg, &header, &trailer, &st)
		return unaryEvent(code, msg, header, trailer, st)
	}, func(o *C.isthmus_call_options_t, cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		if !cc.use() {
			return C.ISTHMUS_CANCELLED, nil
		}
		defer cc.unuse()
		var st *C.isthmus_status_t
		return C.isthmus_unary_async(cc.ch, path, bytesPtr(req), C.size_t(len(req)), o, cq, tag, now, &st), st
	})
}

// unary runs one unary call the fastest way its context allows, given the two ways to start
// it (each consumes what the call sends; opts may gain flags):
//   - a call nothing can cancel (its context has no Done channel) waits for its reply in one
//     cgo call, which reads it straight from the connection: the fastest way, while few calls
//     do it at once (blockingCalls);
//   - a call that can be cancelled starts without blocking; over shm:// it still waits a
//     moment for a fast reply on this thread (ISTHMUS_CALL_SPIN: the library hands a slow one
//     to a thread of its own and the reply comes through the queue), within the same bound;
//   - beyond the bound, calls go through the completion queue.
//
// ok is false if the context ended first (the call is then cancelled). The metadata handle in
// copts is freed here.
func (cc *ClientConn) unary(ctx context.Context, copts *C.isthmus_call_options_t,
	blocking func(*C.isthmus_call_options_t) C.isthmus_event_t,
	async func(*C.isthmus_call_options_t, *C.isthmus_cq_t, C.uint64_t, *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t),
) (C.isthmus_event_t, bool) {
	defer freeMetadata(copts.metadata)
	if ctx.Done() == nil && hold() {
		ev := blocking(copts)
		release()
		return ev, true
	}
	spin := cc.shm && hold()
	if spin {
		copts.flags |= C.ISTHMUS_CALL_SPIN
	}
	return cc.r.do(ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		code, st := async(copts, cq, tag, now)
		if spin {
			release()
		}
		return code, st
	})
}

// recvCall waits for the next event of a receive on call. Over shared memory, while a
// thread may be held (blockingCalls), the message is first waited for on this thread, up to
// 50 µs (isthmus_call_recv_spin): a trip through the completion queue costs two wake-ups, tens
// of µs each on two vCPUs, for a message that often comes within a few.
func (cc *ClientConn) recvCall(ctx context.Context, call *C.isthmus_call_t) (C.isthmus_event_t, bool) {
	spin := cc.shm && hold()
	return cc.r.do(ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		if !spin {
			return C.isthmus_call_recv_async(call, cq, tag, now, &st), st
		}
		code := C.isthmus_call_recv_spin(call, cq, tag, now, &st)
		release()
		return code, st
	})
}

// unaryEvent is the outcome of a blocking unary call, as the queue would have given it.
func unaryEvent(code C.isthmus_code_t, msg *C.isthmus_message_t, header, trailer *C.isthmus_metadata_t, st *C.isthmus_status_t) C.isthmus_event_t {
	ev := C.isthmus_event_t{op: C.ISTHMUS_OP_UNARY, code: code, message: msg, metadata: header, trailers: trailer, status: st}
	if msg != nil {
		ev.message_data = C.isthmus_message_data(msg, &ev.message_len)
	}
	return ev
}

// noMetadata is grpc-go's grpc.Header and grpc.Trailer after a call that got none: the
// caller's variables do not keep an earlier call's.
func (co callOptions) noMetadata() {
	if co.header != nil {
		*co.header = nil
	}
	if co.trailer != nil {
		*co.trailer = metadata.MD{} // a copy of none, as grpc-go's: a map to Set in
	}
}

// unaryReply unmarshals a unary call's outcome into reply and hands its metadata (and peer)
// to the call options that asked for it; every handle in ev is freed. A reply over
// MaxCallRecvMsgSize fails the call, as grpc-go's would.
func (cc *ClientConn) unaryReply(ctx context.Context, ev C.isthmus_event_t, ok bool, reply any, co callOptions) error {
	if !ok {
		co.noMetadata()
		return ctxError(ctx)
	}
	// A call that failed UNAVAILABLE did not reach a server: grpc-go leaves the peer then.
	if co.peer != nil && ev.code != C.ISTHMUS_UNAVAILABLE {
		*co.peer = cc.serverPeer()
	}
	if ev.code != C.ISTHMUS_OK {
		err, trailers := statusError(ev.code, ev.status)
		// The initial metadata the server sent before it failed the call: grpc-go's
		// grpc.Header gives them too, and nil where there were none (not what the caller's
		// variable held).
		var header metadata.MD
		if ev.metadata != nil {
			header = withContentType(takeMetadata(ev.metadata))
			co.stats.inHeader(header, "", nil)
		}
		if co.header != nil {
			*co.header = header
		}
		if co.trailer != nil {
			*co.trailer = orEmpty(trailers)
		}
		co.stats.inTrailer(trailers)
		return cc.callError(ctx, err)
	}
	var header, trailer metadata.MD
	if co.header != nil || co.stats != nil {
		header = withContentType(takeMetadata(ev.metadata))
	} else {
		freeMetadata(ev.metadata)
	}
	co.stats.inHeader(header, "", nil)
	err := co.checkRecv(int(ev.message_len))
	if err == nil {
		err = co.unmarshal(messageBytes(ev.message_data, ev.message_len), reply)
		if err == nil {
			co.stats.inPayload(reply, int(ev.message_len))
		}
	}
	C.isthmus_message_free(ev.message)
	if co.trailer != nil || co.stats != nil {
		trailer = takeMetadata(ev.trailers)
	} else {
		freeMetadata(ev.trailers)
	}
	if co.header != nil {
		*co.header = header
	}
	// An empty map, not nil, when the server sent none: grpc-go gives a copy of its own.
	if co.trailer != nil {
		*co.trailer = orEmpty(trailer)
	}
	co.stats.inTrailer(trailer)
	return err
}

// withContentType is md, the initial metadata of a response (nil for none), with the
// content-type that grpc-go's client keeps there (Header, grpc.Header and the stats
// handlers' InHeader show it). The library keeps it to itself: isthmus's calls are all
// application/grpc, and so are the responses.
func withContentType(md metadata.MD) metadata.MD {
	if md == nil {
		md = make(metadata.MD, 1)
	}
	md["content-type"] = []string{grpcContentType}
	return md
}

// orEmpty is md, or an empty map for nil.
func orEmpty(md metadata.MD) metadata.MD {
	if md == nil {
		return metadata.MD{}
	}
	return md
}

// invokeLarge makes a unary call whose request is marshalled straight into a block of shared
// memory, and whose reply is unmarshalled from where it lies in the server's. The wait for the
// block (arena room; with WaitForReady, a server) ends with ctx, as the call's own wait does.
func (cc *ClientConn) invokeLarge(ctx context.Context, method string, args proto.Message, size int, reply any, co callOptions) error {
	copts, err := cc.cCallOptions(ctx, method, co, 0)
	if err != nil {
		return err
	}
	b, err := cc.allocBlock(ctx, size, &copts)
	if err == nil {
		// The call's deadline is what is left of ctx's once the block is there.
		if err = setTimeout(ctx, &copts); err != nil {
			b.Release()
		}
	}
	if err != nil {
		// As any call's failure: in the context's words once it ended, Canceled "closing"
		// after Close, and no metadata left from an earlier call.
		freeMetadata(copts.metadata)
		co.noMetadata()
		return cc.callError(ctx, err)
	}
	out, err := proto.MarshalOptions{}.MarshalAppend(b.Bytes()[:0], args)
	if err != nil || len(out) != size {
		b.Release()
		freeMetadata(copts.metadata)
		if err == nil {
			err = fmt.Errorf("%d bytes for a message of %d", len(out), size)
		}
		return status.Errorf(codes.Internal, "grpc: error while marshaling: %v", err)
	}
	co.stats.outPayload(args, size)
	path, done := cString(method)
	ev, ok, err := cc.unaryBlock(ctx, path, b, &copts)
	done()
	if err != nil {
		return err
	}
	return cc.unaryReply(ctx, ev, ok, reply, co)
}

// NewStream starts a streaming call (grpc.ClientConnInterface), through the interceptors if
// any.
func (cc *ClientConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	opts = withDefaults(cc.defaults, opts)
	var s grpc.ClientStream
	var err error
	if cc.streamer != nil {
		s, err = cc.streamer(ctx, desc, nil, method, opts...)
	} else {
		s, err = cc.newClientStream(ctx, desc, method, opts)
	}
	if err != nil || desc.ClientStreams {
		return s, err
	}
	return oneRequestStream{s}, nil
}

// oneRequestStream is, as grpc-go's clientStreamWrapper, the stream of a call whose client
// sends one request (a server-streaming call): a SendMsg that finds the call over gives nil,
// not io.EOF, and RecvMsg gives the status. The generated client returns SendMsg's error from
// the call itself, where io.EOF (status Unknown) read as a stream that ended cleanly.
type oneRequestStream struct{ grpc.ClientStream }

func (s oneRequestStream) SendMsg(m any) error {
	if err := s.ClientStream.SendMsg(m); err != io.EOF {
		return err
	}
	return nil
}

// newClientStream starts a streaming call, the interceptors' streamer.
func (cc *ClientConn) newClientStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts []grpc.CallOption) (grpc.ClientStream, error) {
	co := parseCallOptions(opts)
	err := co.err
	if cc.closed.Load() {
		err = errClosing()
	}
	if err == nil && len(cc.stats) > 0 {
		ctx, co.stats = cc.beginStats(ctx, method, co, desc.ClientStreams, desc.ServerStreams)
	}
	var s *clientStream
	if err == nil {
		s, err = cc.newStream(ctx, desc, method, co)
	}
	if err != nil {
		co.stats.end(err)
		co.finished(err)
		return nil, err // not a nil *clientStream in a non-nil interface
	}
	return s, nil
}

func (cc *ClientConn) newStream(ctx context.Context, desc *grpc.StreamDesc, method string, co callOptions) (*clientStream, error) {
	// Over shm:// the stream's receives read the connection themselves while they wait (on
	// the receiving goroutine's thread, within the bound of threads held): a reader on another
	// thread would take turns with it for the core, and a ping-pong message took 25-55 µs so.
	var flags C.uint32_t
	if cc.shm && !cc.readerReads {
		flags = C.ISTHMUS_CALL_SPIN
	}
	copts, err := cc.cCallOptions(ctx, method, co, flags)
	if err != nil {
		return nil, err
	}
	path, done := cString(method)
	defer done()
	ev, ok := cc.r.do(ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		if !cc.use() {
			return C.ISTHMUS_CANCELLED, nil
		}
		defer cc.unuse()
		var st *C.isthmus_status_t
		code := C.isthmus_call_start_async(cc.ch, path, &copts, cq, tag, now, &st)
		return code, st
	})
	freeMetadata(copts.metadata)
	if !ok {
		return nil, ctxError(ctx)
	}
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		return nil, cc.callError(ctx, err)
	}
	s := &clientStream{cc: cc, call: ev.call, ctx: ctx, desc: desc, opts: co, done: make(chan struct{})}
	if !cc.track(s) {
		// Close came meanwhile, and finished the streams it knew: this one ends as they did.
		C.isthmus_call_cancel(ev.call)
		C.isthmus_call_free(ev.call)
		return nil, errClosing()
	}
	// Under the lock: a context done already runs ctxEnded at once, on a goroutine of its own,
	// and finish reads stop.
	stop := context.AfterFunc(ctx, s.ctxEnded)
	s.mu.Lock()
	s.stop = stop
	ended := s.ended // by a Close that came meanwhile: its finish found no stop
	s.mu.Unlock()
	if ended {
		stop()
	}
	return s, nil
}

// clientStream is one streaming call (grpc.ClientStream).
type clientStream struct {
	cc   *ClientConn
	ctx  context.Context
	desc *grpc.StreamDesc
	opts callOptions
	stop func() bool

	mu    sync.Mutex // guards call's release against the operations in flight
	call  *C.isthmus_call_t
	ops   int
	ended bool // the call is over: recv saw its end, or it was cancelled
	// done is closed once the first finish has done all it does (the call options filled in,
	// the stats handlers and OnFinish told): whatever returns the call's end waits for it.
	done    chan struct{}
	err     error
	header  metadata.MD
	gotHead bool
	trailer metadata.MD
	sent    atomic.Bool // CloseSend or the last message went
	// gotMessage: a response came (read by the receiving goroutine only, as RecvMsg is).
	gotMessage bool
	// shown is Context's, made when first asked for, and unshow its cancel.
	shown  context.Context
	unshow context.CancelFunc
}

// begin marks an operation on the call in progress; false if the call is over, as it is once
// its context is done, whether or not ctxEnded has run yet on its goroutine (as on grpc-go,
// whose stream's reads and writes look at the context).
func (s *clientStream) begin() (*C.isthmus_call_t, bool) {
	if s.ctx.Err() != nil {
		s.ctxEnded()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return nil, false
	}
	s.ops++
	return s.call, true
}

// end marks an operation over; the call handle goes once the call has ended and nothing
// uses it.
func (s *clientStream) end() {
	s.mu.Lock()
	s.ops--
	s.releaseLocked()
	s.mu.Unlock()
}

func (s *clientStream) releaseLocked() {
	if s.ended && s.ops == 0 && s.call != nil {
		C.isthmus_call_free(s.call)
		s.call = nil
	}
}

// finish records how the call ended; trailers, if not nil, are its trailers (those of its
// error's status) in place of what the call has. The first finish tells the call options and
// stats handlers; a later one only what it brings, and waits until the first is through, so
// that no operation returns the call's end before grpc.Trailer, grpc.Peer and the others are
// filled in (grpc-go fills them in under its stream's lock). It returns the error the call
// ended with (the first finish's).
func (s *clientStream) finish(err error, trailers metadata.MD) error {
	s.mu.Lock()
	first := !s.ended
	if first {
		s.ended = true
		s.err = err
		if s.call != nil {
			s.trailer = takeMetadata(C.isthmus_call_trailers(s.call))
		}
		if s.opts.header != nil && !s.gotHead {
			// The call ended with no initial metadata taken (it failed, or was cancelled):
			// grpc-go's grpc.Header is nil then, not what the caller's variable held. Under
			// the lock, as headerOf writes it, which leaves it alone from now on.
			*s.opts.header = nil
		}
	}
	if trailers != nil {
		s.trailer = trailers
	}
	err, trailers = s.err, s.trailer
	s.releaseLocked()
	stop, unshow := s.stop, s.unshow
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
	if unshow != nil {
		unshow()
	}
	if !first {
		<-s.done
		return err
	}
	defer close(s.done)
	s.cc.untrack(s)
	if s.opts.trailer != nil {
		*s.opts.trailer = orEmpty(trailers)
	}
	if s.opts.stats != nil {
		s.opts.stats.inTrailer(trailers)
		s.opts.stats.end(err)
	}
	s.report(err)
	return err
}

// over is the error the call ended with (nil for an OK end), once its finish is through; for
// an operation that found it ended (begin).
func (s *clientStream) over() error {
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// fail ends the call with err, a failure of this side, as grpc-go's stream does; the error the
// call ended with.
func (s *clientStream) fail(err error) error {
	s.cancel()
	return s.finish(err, nil)
}

// report tells the call options how the call ended (the first finish does, once): grpc.Peer
// gets the server (unless the call failed UNAVAILABLE, reaching none), grpc.OnFinish callbacks
// the error.
func (s *clientStream) report(err error) {
	if !s.opts.onFinish && s.opts.peer == nil {
		return
	}
	if s.opts.peer != nil && status.Code(err) != codes.Unavailable {
		*s.opts.peer = s.cc.serverPeer()
	}
	s.opts.finished(err)
}

// ctxEnded ends the call when its context does, as grpc-go's stream does: the call is
// cancelled on both sides and finished here, so that its handle is freed even if it is never
// read again (it was kept until a RecvMsg that may never come), and the call options and
// stats handlers hear of it now.
func (s *clientStream) ctxEnded() {
	s.cancel()
	s.finish(ctxError(s.ctx), nil)
}

// cancel ends the call when its context does.
func (s *clientStream) cancel() {
	s.mu.Lock()
	if s.call != nil && !s.ended {
		C.isthmus_call_cancel(s.call)
	}
	s.mu.Unlock()
}

// Context is the caller's context, ended once the call is over (its end received, or the call
// cancelled or failed), as grpc-go's stream's is: a goroutine that waits on it to clean up
// after the stream is not left waiting for the caller's context. Made on first use: few
// callers ask.
func (s *clientStream) Context() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shown == nil {
		s.shown, s.unshow = context.WithCancel(s.ctx)
		if s.ended {
			s.unshow()
		}
	}
	return s.shown
}

// Header is a copy of the initial metadata, each time, as grpc-go's: what a caller does to it
// changes nobody else's.
func (s *clientStream) Header() (metadata.MD, error) {
	s.mu.Lock()
	if s.gotHead {
		defer s.mu.Unlock()
		return s.header.Copy(), nil
	}
	s.mu.Unlock()
	call, ok := s.begin()
	if !ok {
		_ = s.over()
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.gotHead {
			return nil, nil
		}
		return s.header.Copy(), nil
	}
	defer s.end()
	if _, err := s.headerOf(call); err != nil {
		// As grpc-go's: a stream that ended without headers gives none and no error here;
		// RecvMsg gives its status. The stream is finished now, as grpc-go's is: its handle,
		// its stats and its call options' end do not wait for a RecvMsg that may never come.
		if s.ctx.Err() != nil {
			s.cancel()
		}
		_ = s.finish(s.cc.callError(s.ctx, err), nil)
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.header.Copy(), nil
}

// headerOf waits for the call's initial metadata (call is held, begin) and keeps it for
// Header and grpc.Header (a copy of its own), the first time.
func (s *clientStream) headerOf(call *C.isthmus_call_t) (metadata.MD, error) {
	ev, ok := s.cc.r.do(s.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		return C.isthmus_call_headers_async(call, cq, tag, now, &st), st
	})
	if !ok {
		return nil, ctxError(s.ctx)
	}
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		return nil, err
	}
	md := withContentType(takeMetadata(ev.metadata))
	s.mu.Lock()
	first := !s.gotHead
	if first {
		s.header, s.gotHead = md, true
		if s.opts.header != nil && !s.ended {
			*s.opts.header = md.Copy()
		}
	}
	md = s.header
	s.mu.Unlock()
	if first {
		s.opts.stats.inHeader(md, "", nil)
	}
	return md, nil
}

// keepHeader takes the initial metadata of a call that has just ended (call is held, begin)
// if nobody asked for it yet: the call's handle goes with its end, and grpc-go's Header (and
// grpc.Header) still give a finished stream's header. The library has it at once by then.
func (s *clientStream) keepHeader(call *C.isthmus_call_t) {
	s.mu.Lock()
	got := s.gotHead
	s.mu.Unlock()
	if !got {
		_, _ = s.headerOf(call)
	}
}

// Trailer is a copy of the trailing metadata: empty, not nil, before they come, as on
// grpc-go.
func (s *clientStream) Trailer() metadata.MD {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.trailer.Copy()
}

func (s *clientStream) SendMsg(m any) error {
	if s.sent.Load() {
		// A misuse that ends the call, as on grpc-go: its receives then give this error too.
		err := status.Error(codes.Internal, "SendMsg called after CloseSend")
		s.fail(err)
		return err
	}
	b, err := s.opts.marshal(m)
	if err == nil {
		err = s.opts.checkSend(len(b))
	}
	if err != nil {
		s.fail(err)
		return err
	}
	// A client that does not stream sends its one request with the half-close, as grpc-go's
	// does: a second one fails above.
	if err := s.sendBytes(b, !s.desc.ClientStreams); err != nil {
		return err
	}
	s.opts.stats.outPayload(m, len(b))
	return nil
}

// sendBytes sends one request message; last half-closes with it.
func (s *clientStream) sendBytes(b []byte, last bool) error {
	call, ok := s.begin()
	if !ok {
		return io.EOF
	}
	defer s.end()
	l := C.int32_t(0)
	if last {
		l = 1
		s.sent.Store(true)
	}
	ev, ok := s.cc.r.do(s.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		return C.isthmus_call_send_async(call, bytesPtr(b), C.size_t(len(b)), l, cq, tag, now, &st), st
	})
	runtime.KeepAlive(b)
	if !ok {
		// The context ended the wait (for flow control): the call is over with it, and as
		// grpc-go's does for any failed write, SendMsg says io.EOF and RecvMsg gives why.
		return io.EOF
	}
	if ev.code != C.ISTHMUS_OK {
		return sendFailed(ev.code, ev.status)
	}
	return nil
}

func (s *clientStream) CloseSend() error {
	if s.sent.Swap(true) {
		return nil
	}
	call, ok := s.begin()
	if !ok {
		return nil
	}
	defer s.end()
	ev, _ := s.cc.r.do(s.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		return C.isthmus_call_close_send_async(call, cq, tag, now, &st), st
	})
	if ev.status != nil {
		C.isthmus_status_free(ev.status)
	}
	return nil
}

// endError is what a receive gives for a call that ended with err: err, or io.EOF at an OK end.
func endError(err error) error {
	if err == nil {
		return io.EOF
	}
	return err
}

// recv takes the next message into m: nil, io.EOF at an OK end, or the call's error. The end
// it gives is the call's, as the first finish recorded it (a Close, a cancel, a failure of this
// side may come first), once that finish is through.
func (s *clientStream) recv(m any) error {
	call, ok := s.begin()
	if !ok {
		return endError(s.over())
	}
	defer s.end()
	ev, ok := s.cc.recvCall(s.ctx, call)
	if !ok {
		// Cancelled before the finish: after it, ctxEnded's cancel would find the call ended
		// and leave it running at the server, and a send waiting beside this receive with it.
		s.cancel()
		return endError(s.finish(ctxError(s.ctx), nil))
	}
	if ev.code != C.ISTHMUS_OK {
		err, trailers := statusError(ev.code, ev.status)
		err = s.cc.callError(s.ctx, err)
		s.keepHeader(call)
		return endError(s.finish(err, trailers))
	}
	if ev.message == nil {
		s.keepHeader(call)
		if !s.desc.ServerStreams && !s.gotMessage {
			// An OK end with no response, where one was due: grpc-go's error (from 1.66),
			// which the call ends with.
			err := status.Error(codes.Internal, "cardinality violation: received no response message from non-server-streaming RPC")
			return endError(s.finish(err, nil))
		}
		return endError(s.finish(nil, nil))
	}
	first := !s.gotMessage
	s.gotMessage = true
	if first {
		// The initial metadata came with or before it: kept now, a cancel, a Close or a
		// failure that ends the stream later leaves Header and grpc.Header what came, as
		// grpc-go's do. Once per stream, and at once (the library has them).
		s.keepHeader(call)
	}
	if err := s.opts.checkRecv(int(ev.message_len)); err != nil {
		C.isthmus_message_free(ev.message)
		return endError(s.fail(err))
	}
	err := s.opts.unmarshal(messageBytes(ev.message_data, ev.message_len), m)
	C.isthmus_message_free(ev.message)
	if err != nil {
		// The call ends with it, as grpc-go's does: it is cancelled and its handle freed.
		return endError(s.fail(err))
	}
	s.opts.stats.inPayload(m, int(ev.message_len))
	return nil
}

func (s *clientStream) RecvMsg(m any) error {
	err := s.recv(m)
	if err != nil || s.desc.ServerStreams {
		return err
	}
	// One response only: the call must end after it, as grpc-go checks.
	switch err := s.recv(m); {
	case err == nil:
		e := status.Error(codes.Internal, "cardinality violation: expected <EOF> for non server-streaming RPCs, but received another message")
		return endError(s.fail(e))
	case errors.Is(err, io.EOF):
		return nil
	default:
		return err
	}
}
