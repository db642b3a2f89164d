package isthmus

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
)

// Stats handlers (grpc-go's stats.Handler, as otelgrpc implements it) see each call as
// grpc-go reports it: TagRPC first (its context is the call's from then on, so metadata it
// adds to the outgoing context goes with the request), then Begin, the headers, one event per
// message, the trailers and End. Sizes are the message's own: shared memory adds no framing,
// and what HTTP/2 adds (and compresses) is the library's, which does not report it, so
// WireLength and CompressedLength repeat Length. A client's connection is reported as begun
// at Dial and ended at Close (the library connects and reconnects on its own); a server
// reports no connection events, as its library tells it of none. grpc-go's load-balancer
// event (DelayedPickComplete, for a call that waited for a connection) has no counterpart.

// WithStatsHandler adds a stats handler to every call of the connection, as
// grpc.WithStatsHandler does; several may be added, and each sees every event.
func WithStatsHandler(h stats.Handler) DialOption {
	return func(o *dialOptions) {
		if h != nil {
			o.stats = append(o.stats, h)
		}
	}
}

// StatsHandler adds a stats handler to every call the server takes, as grpc.StatsHandler
// does; several may be added.
func StatsHandler(h stats.Handler) ServerOption {
	return func(o *serverOptions) {
		if h != nil {
			o.stats = append(o.stats, h)
		}
	}
}

// rpcStats reports one call to its stats handlers. A nil *rpcStats reports nothing, so the
// call paths call it unconditionally.
type rpcStats struct {
	hs     []stats.Handler
	ctx    context.Context // as the handlers' TagRPC left it
	client bool
	begin  time.Time
	ended  atomic.Bool
	mu     sync.Mutex
	// trailer is the call's trailers once InTrailer (OutTrailer) reported them, for End.
	trailer metadata.MD
}

// beginRPC tags a call of method with every handler (each gets the context the one before
// returned) and reports its Begin. It returns the tagged context, which the call uses.
func beginRPC(ctx context.Context, hs []stats.Handler, client bool, method string, failFast, clientStream, serverStream bool) (context.Context, *rpcStats) {
	if len(hs) == 0 {
		return ctx, nil
	}
	for _, h := range hs {
		ctx = h.TagRPC(ctx, &stats.RPCTagInfo{FullMethodName: method, FailFast: failFast})
	}
	r := &rpcStats{hs: hs, ctx: ctx, client: client, begin: time.Now()}
	if client {
		r.handle(&stats.Begin{Client: true, BeginTime: r.begin, FailFast: failFast, IsClientStream: clientStream, IsServerStream: serverStream})
	}
	return ctx, r
}

func (r *rpcStats) handle(s stats.RPCStats) {
	for _, h := range r.hs {
		h.HandleRPC(r.ctx, s)
	}
}

// serverBegin is a server's Begin, which grpc-go reports after the request's headers.
func (r *rpcStats) serverBegin(clientStream, serverStream bool) {
	if r != nil {
		r.handle(&stats.Begin{BeginTime: r.begin, IsClientStream: clientStream, IsServerStream: serverStream})
	}
}

func (r *rpcStats) outHeader(md metadata.MD, method string, remote net.Addr) {
	if r != nil {
		r.handle(&stats.OutHeader{Client: r.client, Header: md.Copy(), FullMethod: method, RemoteAddr: remote})
	}
}

func (r *rpcStats) inHeader(md metadata.MD, method string, remote net.Addr) {
	if r != nil {
		r.handle(&stats.InHeader{Client: r.client, Header: md.Copy(), FullMethod: method, RemoteAddr: remote})
	}
}

func (r *rpcStats) outPayload(m any, n int) {
	if r != nil {
		r.handle(&stats.OutPayload{Client: r.client, Payload: m, Length: n, CompressedLength: n, WireLength: n, SentTime: time.Now()})
	}
}

func (r *rpcStats) inPayload(m any, n int) {
	if r != nil {
		r.handle(&stats.InPayload{Client: r.client, Payload: m, Length: n, CompressedLength: n, WireLength: n, RecvTime: time.Now()})
	}
}

func (r *rpcStats) inTrailer(md metadata.MD) {
	if r != nil {
		r.keepTrailer(md)
		r.handle(&stats.InTrailer{Client: r.client, Trailer: md.Copy()})
	}
}

func (r *rpcStats) outTrailer(md metadata.MD) {
	if r != nil {
		r.keepTrailer(md)
		r.handle(&stats.OutTrailer{Client: r.client, Trailer: md.Copy()})
	}
}

func (r *rpcStats) keepTrailer(md metadata.MD) {
	r.mu.Lock()
	r.trailer = md
	r.mu.Unlock()
}

// finish reports a server call's end: its trailers, then End.
func (r *rpcStats) finish(trailer metadata.MD, err error) {
	r.outTrailer(trailer)
	r.end(err)
}

// end reports End, with the trailers reported before it, once; a later end (a stream's
// context ending after its status came) is not reported.
func (r *rpcStats) end(err error) {
	if r == nil || r.ended.Swap(true) {
		return
	}
	r.mu.Lock()
	trailer := r.trailer
	r.mu.Unlock()
	r.handle(&stats.End{Client: r.client, BeginTime: r.begin, EndTime: time.Now(), Trailer: trailer, Error: err})
}

// connStats reports a client connection's begin to every handler; its end goes to the
// contexts they tagged.
type connStats struct {
	hs   []stats.Handler
	ctxs []context.Context
}

func beginConn(hs []stats.Handler, remote net.Addr) *connStats {
	if len(hs) == 0 {
		return nil
	}
	c := &connStats{hs: hs}
	for _, h := range hs {
		ctx := h.TagConn(context.Background(), &stats.ConnTagInfo{RemoteAddr: remote})
		h.HandleConn(ctx, &stats.ConnBegin{Client: true})
		c.ctxs = append(c.ctxs, ctx)
	}
	return c
}

func (c *connStats) end() {
	if c == nil {
		return
	}
	for i, h := range c.hs {
		h.HandleConn(c.ctxs[i], &stats.ConnEnd{Client: true})
	}
}
