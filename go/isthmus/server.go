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
	"math"
	"reflect"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/grpclog"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Server serves gRPC services registered by generated code (it implements
// grpc.ServiceRegistrar) on shm://, unix:// and http:// targets at once. Each call runs its
// handler on a goroutine.
type Server struct {
	opts    serverOptions
	r       *reactor
	mu      sync.Mutex
	methods map[string]*method
	// srvs are the library's servers, one per Start (as grpc-go serves each listener given
	// to a Serve of its own), in the order they started.
	srvs     []*libServer
	serving  chan struct{} // closed when Serve should return
	stopOnce sync.Once
	// stopping is set by the first shutdown; later ones (under mu) join cutting, which the
	// first waits for before it frees srvs.
	stopping bool
	cutting  sync.WaitGroup
	// queued are the reactor's tags of the methods whose calls come through its queue.
	queued []uint64
	// services describe what RegisterService registered, for GetServiceInfo.
	services map[string]grpc.ServiceInfo
	// running counts the handlers running now (an atomic: every call's path counts); once
	// awaiting is set, the handler that brings it to zero closes idle, which GracefulStop
	// waits for, as grpc-go's waits for its handlers.
	running  atomic.Int64
	awaiting atomic.Bool
	hmu      sync.Mutex
	idle     chan struct{}
	// awaitingHandlers (under mu): a GracefulStop has shut the library down and waits for
	// handlers only; a Stop then has nothing left to stop, and does not wait with it. cut: a
	// shutdown with less grace (a Stop) came while the first drained, and nobody waits for
	// handlers.
	awaitingHandlers, cut bool
	// inlineWaits (under hmu) are the InlineUnary handlers running now that asked when their
	// call ends (ctx.Done or Err). The thread that would tell them is the one they run on, their
	// connection's reader, so a shutdown tells them itself once the library's grace is over
	// (endInlineWaits), rather than wait for them for ever as it frees the library's server.
	// inlineCut: that has happened, and a handler that asks later is told at once.
	inlineWaits map[*serverStream]struct{}
	inlineCut   bool
}

// handlerStarted counts a handler in (running); handlerEnded counts it out.
func (s *Server) handlerStarted() { s.running.Add(1) }

func (s *Server) handlerEnded() {
	if s.running.Add(-1) != 0 || !s.awaiting.Load() {
		return
	}
	s.hmu.Lock()
	if s.idle != nil && s.running.Load() == 0 {
		close(s.idle)
		s.idle = nil
	}
	s.hmu.Unlock()
}

// handlersEnded returns once no handler runs. The library's graceful shutdown ends when the
// calls have, and a call ends without its handler when its client cancels it or its deadline
// passes: a handler that went on regardless (a commit that ignores its context) ran on past
// GracefulStop, and past a main that returned after it.
func (s *Server) handlersEnded() {
	s.hmu.Lock()
	idle := make(chan struct{})
	s.idle = idle
	s.awaiting.Store(true)
	s.hmu.Unlock()
	// A handler that ended before awaiting was set closed nothing: look once more.
	if s.running.Load() == 0 {
		return
	}
	<-idle
}

var _ grpc.ServiceRegistrar = (*Server)(nil)

// libServer is one Start's server in the library, and what goes when it is freed.
type libServer struct {
	c *C.isthmus_server_t
	// addresses are its HTTP/2 endpoints as clients reach them, copied as it starts: the
	// library's strings go with its shutdown, which may run while HTTPAddresses reads.
	addresses []string
	// inline is the user data of its inline handlers (inlineTarget).
	inline []unsafe.Pointer
}

// free frees the library's server (shut down, or never started), then its handlers' data.
func (l *libServer) free() {
	C.isthmus_server_free(l.c)
	for _, p := range l.inline {
		freeInlineTarget(p)
	}
}

type method struct {
	impl   any
	unary  *grpc.MethodDesc
	stream *grpc.StreamDesc
	raw    RawHandler
	// rawUnary answers unary calls by method path (HandleRawUnary).
	rawUnary RawUnaryHandler
	// topic subscribes calls to it (ServeTopic).
	topic *Topic
	name  string // full path, /package.Service/Method
	// services, on the method that takes every path the others do not (Start's), are the
	// services that have methods here: its answer names the service or the method unknown,
	// as grpc-go's server does.
	services map[string]bool
}

// streams says whether the method's requests and replies are streams, as stats.Begin does; a
// raw handler's calls may be either, and count as both.
func (m *method) streams() (client, server bool) {
	switch {
	case m.stream != nil:
		return m.stream.ClientStreams, m.stream.ServerStreams
	case m.raw != nil:
		return true, true
	}
	return false, false
}

// ServerOption configures a Server.
type ServerOption func(*serverOptions)

type serverOptions struct {
	maxMessageSize       uint64
	maxSendMessageSize   uint64 // 0: none
	maxConcurrentStreams uint32
	unary                grpc.UnaryServerInterceptor
	stream               grpc.StreamServerInterceptor
	chainUnary           []grpc.UnaryServerInterceptor
	chainStream          []grpc.StreamServerInterceptor
	inline               bool
	tls                  *ServerTLSConfig
	compression          string
	stats                []stats.Handler
	keepalive            keepalive.ServerParameters
}

// KeepaliveParams turns on HTTP/2 keepalive for the server's HTTP/2 endpoints, as
// grpc.KeepaliveParams does: a client connection from which nothing came for kp.Time gets a
// PING, and if its answer does not come within kp.Timeout (20 s if zero) the connection
// closes and its calls are cancelled, so handlers stop waiting on a client that vanished. A
// zero kp.Time turns it off (grpc-go's default is 2 hours). shm:// needs none: a client that
// dies there is seen at once.
//
// kp.MaxConnectionAge sends an HTTP/2 connection that old a GOAWAY: its client opens a new
// connection for its next calls, and those in progress finish on the old one, until
// kp.MaxConnectionAgeGrace (for ever if zero) closes it and cancels them. grpc-go adds ±10%
// jitter to the age; isthmus adds none. shm:// connections have no age limit.
// MaxConnectionIdle is not supported and is ignored.
func KeepaliveParams(kp keepalive.ServerParameters) ServerOption {
	return func(o *serverOptions) { o.keepalive = kp }
}

// MaxMessageSize sets the largest request message accepted on every target, in bytes, as
// grpc.MaxRecvMsgSize does on a grpc-go server; a larger one fails its call with
// codes.ResourceExhausted and the server goes on. Unset, shm:// takes up to 4 GiB and HTTP/2
// up to 4 MiB (grpc-go's default), where a request is gathered in memory before its handler
// sees it.
func MaxMessageSize(n uint64) ServerOption {
	return func(o *serverOptions) { o.maxMessageSize = n }
}

// MaxSendMessageSize sets the largest response message a handler may send, in bytes, as
// grpc.MaxSendMsgSize does on a grpc-go server (default: no limit but the transport's); a
// larger one fails its call with codes.ResourceExhausted, in grpc-go's words, and is not sent.
func MaxSendMessageSize(n uint64) ServerOption {
	return func(o *serverOptions) { o.maxSendMessageSize = n }
}

// SendCompressed compresses the replies to HTTP/2 calls with "gzip" or "deflate", for each
// client whose grpc-accept-encoding lists it (grpc's clients do); the others, and every call
// over shm://, get them as they are. Another name fails Start with codes.InvalidArgument.
// A handler chooses otherwise for its own call with SetSendCompressor.
func SendCompressed(name string) ServerOption {
	return func(o *serverOptions) { o.compression = name }
}

// MaxConcurrentStreams limits the calls one client connection may have open at once: over
// shm:// one more is refused with codes.ResourceExhausted; an HTTP/2 connection is told the
// limit in its settings, as grpc-go's MaxConcurrentStreams does, and its client waits for a
// place.
func MaxConcurrentStreams(n uint32) ServerOption {
	return func(o *serverOptions) { o.maxConcurrentStreams = n }
}

// UnaryInterceptor installs an interceptor for unary calls, as grpc.UnaryInterceptor does:
// it runs before those of ChainUnaryInterceptor.
func UnaryInterceptor(i grpc.UnaryServerInterceptor) ServerOption {
	return func(o *serverOptions) { o.unary = i }
}

// StreamInterceptor installs an interceptor for streaming calls, as grpc.StreamInterceptor
// does: it runs before those of ChainStreamInterceptor.
func StreamInterceptor(i grpc.StreamServerInterceptor) ServerOption {
	return func(o *serverOptions) { o.stream = i }
}

// InlineUnary runs unary handlers (and raw unary ones, HandleRawUnary) on the thread that reads their client's connection, the
// moment their request is in, as the Rust engine runs its handlers: no goroutine is started
// and no thread woken per call, which saves tens of microseconds on machines where waking a
// thread is slow. Only for handlers that answer at once: a handler that waits (on a lock, a
// database, another call) holds up every other call of its connection meanwhile. Streaming
// handlers, and calls whose request (or whose client's half-close after it) has not arrived
// yet, run on goroutines as always.
func InlineUnary() ServerOption {
	return func(o *serverOptions) { o.inline = true }
}

// NewServer returns a server with no services.
func NewServer(opts ...ServerOption) *Server {
	s := &Server{methods: make(map[string]*method), serving: make(chan struct{})}
	for _, f := range opts {
		f(&s.opts)
	}
	// From here on unary and stream are all the interceptors, composed.
	s.opts.unary = chainUnaryServer(withFirst(s.opts.unary, s.opts.unary != nil, s.opts.chainUnary))
	s.opts.stream = chainStreamServer(withFirst(s.opts.stream, s.opts.stream != nil, s.opts.chainStream))
	return s
}

// RegisterService registers a service and its implementation (grpc.ServiceRegistrar), as
// generated Register...Server functions call it. Before Serve only, and once per service.
func (s *Server) RegisterService(desc *grpc.ServiceDesc, impl any) {
	if impl != nil {
		ht := reflect.TypeOf(desc.HandlerType).Elem()
		if st := reflect.TypeOf(impl); !st.Implements(ht) {
			panic(fmt.Sprintf("isthmus: Server.RegisterService found the handler of type %v that does not satisfy %v", st, ht))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.srvs) > 0 {
		panic("isthmus: Server.RegisterService after Serve")
	}
	if _, ok := s.services[desc.ServiceName]; ok {
		// grpc-go's words; it exits the process (log.Fatalf) where this panics.
		panic(fmt.Sprintf("isthmus: Server.RegisterService found duplicate service registration for %q", desc.ServiceName))
	}
	info := grpc.ServiceInfo{Metadata: desc.Metadata}
	for i := range desc.Methods {
		m := &desc.Methods[i]
		name := "/" + desc.ServiceName + "/" + m.MethodName
		s.methods[name] = &method{impl: impl, unary: m, name: name}
		info.Methods = append(info.Methods, grpc.MethodInfo{Name: m.MethodName})
	}
	for i := range desc.Streams {
		d := &desc.Streams[i]
		name := "/" + desc.ServiceName + "/" + d.StreamName
		s.methods[name] = &method{impl: impl, stream: d, name: name}
		info.Methods = append(info.Methods, grpc.MethodInfo{
			Name: d.StreamName, IsClientStream: d.ClientStreams, IsServerStream: d.ServerStreams,
		})
	}
	if s.services == nil {
		s.services = make(map[string]grpc.ServiceInfo)
	}
	s.services[desc.ServiceName] = info
}

// GetServiceInfo returns the services RegisterService registered, by name, as grpc-go's
// Server does: what reflection.Register needs to list them (reflection.ServiceInfoProvider).
func (s *Server) GetServiceInfo() map[string]grpc.ServiceInfo {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]grpc.ServiceInfo, len(s.services))
	for name, info := range s.services {
		out[name] = info
	}
	return out
}

// Start binds every target ("shm://NAME", "unix:///path.sock", "http://host:port", and
// "https://host:port" with ServerTLS) and serves them in the background; clients can connect
// as soon as it returns. It may be called again with other targets, as grpc-go's Serve is
// called once per listener; Stop and GracefulStop stop them all.
func (s *Server) Start(targets ...string) error {
	r, err := getReactor()
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		// As grpc-go's Serve after Stop: a Stop that ran before a `go s.Serve(...)` began.
		return grpc.ErrServerStopped
	}
	// The process's one reactor: set by the first start only, so that handlers of an earlier
	// start, which read it without the lock, race with no write.
	if s.r == nil {
		s.r = r
	}
	for name := range s.methods {
		if err := noNUL("method path", name); err != nil {
			return err
		}
	}
	for _, t := range targets {
		if err := noNUL("target", t); err != nil {
			return err
		}
		// The library refuses this too, but names its Rust setting where a Go user needs
		// ServerTLS.
		if s.opts.tls == nil && strings.HasPrefix(t, "https://") {
			return status.Errorf(codes.InvalidArgument, "%s needs the server's TLS settings (ServerTLS)", t)
		}
	}
	opts := C.isthmus_server_options_t{
		max_message_size:            C.uint64_t(s.opts.maxMessageSize),
		max_concurrent_streams:      C.uint32_t(s.opts.maxConcurrentStreams),
		keepalive_time_ms:           millis(s.opts.keepalive.Time),
		keepalive_timeout_ms:        millis(s.opts.keepalive.Timeout),
		max_connection_age_ms:       millis(s.opts.keepalive.MaxConnectionAge),
		max_connection_age_grace_ms: millis(s.opts.keepalive.MaxConnectionAgeGrace),
	}
	switch s.opts.compression {
	case "":
	case "gzip":
		opts.flags = C.ISTHMUS_SERVER_COMPRESS_GZIP
	case "deflate":
		opts.flags = C.ISTHMUS_SERVER_COMPRESS_DEFLATE
	default:
		return status.Errorf(codes.InvalidArgument, "SendCompressed(%q): isthmus compresses with gzip or deflate", s.opts.compression)
	}
	if s.opts.tls != nil {
		t, err := serverTLS(s.opts.tls)
		defer t.free()
		if err != nil {
			return err
		}
		opts.tls = t.opts
	}
	srv := C.isthmus_server_new(&opts)
	if srv == nil {
		return errors.New("isthmus: cannot make a server")
	}
	l := &libServer{c: srv}
	// The reactor's tags of this server's queued methods: forgotten if it does not start.
	var tags []uint64
	fail := func(err error) error {
		l.free()
		forgetTags(r, tags)
		return err
	}
	queue := func(cname *C.char, m *method, st **C.isthmus_status_t) C.isthmus_code_t {
		// A new call's tag stays registered: the reactor keeps NEW_CALL tags after delivery.
		tag := r.tag(func(ev C.isthmus_event_t) { go s.serveFrom(m, ev.server_call) })
		queuedMethods.Store(tag, &inlineEntry{s: s, m: m})
		tags = append(tags, tag)
		return C.isthmus_server_add_handler_cq(srv, cname, r.cq, C.uint64_t(tag), st)
	}
	services := make(map[string]bool)
	for name := range s.services {
		services[name] = true // with no methods, as grpc-go's: "unknown method"
	}
	for name, m := range s.methods {
		if service, _, ok := splitPath(name); ok {
			services[service] = true
		}
		cname := C.CString(name)
		if m.topic != nil {
			err := addTopic(srv, cname, m.topic, s.opts.maxSendMessageSize)
			C.free(unsafe.Pointer(cname))
			if err != nil {
				return fail(err)
			}
			continue
		}
		var st *C.isthmus_status_t
		var code C.isthmus_code_t
		if s.opts.inline && (m.unary != nil || m.rawUnary != nil) {
			code = addInlineHandler(l, cname, s, m, &st)
		} else {
			code = queue(cname, m, &st)
		}
		C.free(unsafe.Pointer(cname))
		if code != C.ISTHMUS_OK {
			err, _ := statusError(code, st)
			return fail(err)
		}
	}
	// Every other path (a NULL one) comes here to be refused in grpc-go's words: the library's
	// own answer is "method … is not implemented by this server".
	var cst *C.isthmus_status_t
	if code := queue(nil, &method{services: services}, &cst); code != C.ISTHMUS_OK {
		err, _ := statusError(code, cst)
		return fail(err)
	}
	ctargets := make([]*C.char, len(targets))
	for i, t := range targets {
		ctargets[i] = C.CString(t)
	}
	defer func() {
		for _, c := range ctargets {
			C.free(unsafe.Pointer(c))
		}
	}()
	if len(targets) == 0 {
		return fail(errors.New("isthmus: no target to serve"))
	}
	arr := (**C.char)(C.malloc(C.size_t(len(targets)) * C.size_t(unsafe.Sizeof((*C.char)(nil)))))
	defer C.free(unsafe.Pointer(arr))
	copy(unsafe.Slice(arr, len(targets)), ctargets)
	var st *C.isthmus_status_t
	if code := C.isthmus_server_start(srv, arr, C.size_t(len(targets)), &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return fail(err)
	}
	for i := 0; ; i++ {
		a := C.isthmus_server_http_address(srv, C.size_t(i))
		if a == nil {
			break
		}
		l.addresses = append(l.addresses, C.GoString(a))
	}
	s.srvs = append(s.srvs, l)
	s.queued = append(s.queued, tags...)
	return nil
}

// HTTPAddresses are the server's HTTP/2 endpoints as clients reach them ("unix:///path",
// "http://host:port" with the port the system chose for port 0), in the order given to Start
// (and of the Starts).
func (s *Server) HTTPAddresses() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, l := range s.srvs {
		out = append(out, l.addresses...)
	}
	return out
}

// Serve binds and serves every target (see Start) until Stop or GracefulStop. Like grpc-go's,
// it may be called once for each set of targets (a goroutine each); all return on the stop.
func (s *Server) Serve(targets ...string) error {
	if err := s.Start(targets...); err != nil {
		return err
	}
	<-s.serving
	return nil
}

// Stop stops the server at once: listeners close and calls in progress end (their clients
// see codes.Unavailable).
func (s *Server) Stop() { s.shutdown(0) }

// GracefulStop stops taking calls and waits for those in progress to finish, however long they
// take, and then for their handlers to return (one whose call ended under it, cancelled by
// its client, runs on until it returns), as grpc-go's does; a Stop meanwhile ends the calls
// now, and does not wait for their handlers.
func (s *Server) GracefulStop() { s.shutdown(untilFinished) }

// GracefulStopTimeout is GracefulStop that waits at most grace for the calls in progress.
func (s *Server) GracefulStopTimeout(grace time.Duration) { s.shutdown(uint64(millis(grace))) }

// untilFinished is the grace, in milliseconds, that lets the calls in progress finish: one too
// long for the engine's clock, which it takes as no cut-off (isthmus::stop_by).
const untilFinished = math.MaxUint64

// shutdownStarted, if set (by tests), hears the grace of each shutdown, in milliseconds.
var shutdownStarted func(graceMs uint64)

func (s *Server) shutdown(graceMs uint64) {
	if shutdownStarted != nil {
		shutdownStarted(graceMs)
	}
	ms := C.uint64_t(graceMs)
	s.mu.Lock()
	if s.awaitingHandlers {
		s.mu.Unlock()
		return
	}
	srvs, later := s.srvs, s.stopping
	s.stopping = true
	if later && len(srvs) > 0 {
		s.cutting.Add(1)
	}
	if later && graceMs != untilFinished {
		s.cut = true
	}
	s.mu.Unlock()
	if later && len(srvs) > 0 {
		// A shutdown is under way (GracefulStop's, say): the library ends its grace now if
		// this one's ends sooner, as grpc-go's Stop does to a GracefulStop.
		shutdownAll(srvs, ms)
		s.cutting.Done()
	}
	s.stopOnce.Do(func() {
		if len(srvs) > 0 {
			shutdownAll(srvs, ms)
			s.mu.Lock()
			s.srvs = nil // no later shutdown joins cutting from here on
			s.mu.Unlock()
			s.cutting.Wait()
			s.endInlineWaits()
			s.mu.Lock()
			s.awaitingHandlers = graceMs == untilFinished && !s.cut
			wait := s.awaitingHandlers
			s.mu.Unlock()
			if wait {
				s.handlersEnded()
			}
			for _, l := range srvs {
				l.free()
			}
			s.mu.Lock()
			s.forgetQueued()
			s.mu.Unlock()
		}
		close(s.serving)
	})
}

// waitInline lists st, an InlineUnary handler's stream that asked when its call ends, for a
// shutdown to tell (endInlineWaits); false if that has happened already.
func (s *Server) waitInline(st *serverStream) bool {
	s.hmu.Lock()
	defer s.hmu.Unlock()
	if s.inlineCut {
		return false
	}
	if s.inlineWaits == nil {
		s.inlineWaits = make(map[*serverStream]struct{})
	}
	s.inlineWaits[st] = struct{}{}
	return true
}

// endInlineWaits ends the contexts of the InlineUnary handlers that wait for them, once the
// library's servers have shut down: their calls are over (the library ended them when its grace
// did), but the thread that would have told them is the one they hold.
func (s *Server) endInlineWaits() {
	s.hmu.Lock()
	waits := s.inlineWaits
	s.inlineWaits, s.inlineCut = nil, true
	s.hmu.Unlock()
	for st := range waits {
		st.cancel()
	}
}

// shutdownAll shuts the library's servers down at once, each with the grace ms, and returns
// when all have (isthmus_server_shutdown blocks until its server has).
func shutdownAll(srvs []*libServer, ms C.uint64_t) {
	if len(srvs) == 1 {
		C.isthmus_server_shutdown(srvs[0].c, ms)
		return
	}
	var wg sync.WaitGroup
	for _, l := range srvs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			C.isthmus_server_shutdown(l.c, ms)
		}()
	}
	wg.Wait()
}

// queuedMethods maps the tag of each method whose calls come through the reactor's queue to
// its server and method, for the calls a handler's goroutine takes itself (serveFrom).
var queuedMethods sync.Map // uint64 → *inlineEntry

// takenCalls counts the calls serveFrom took (for tests).
var takenCalls atomic.Int64

// takeSpin is how long a goroutine that has finished a call waits on its thread for the next.
const takeSpin = 50 // µs

// serveFrom runs the call's handler, then takes the process's next new call itself if one
// comes within takeSpin (isthmus_cq_take_call), if a thread may be held (hold), and runs
// that one too. A call that comes while no goroutine waits so goes through the reactor as
// before: a wake-up of the reactor's thread and of a thread for the handler's goroutine,
// 26-72 µs on two vCPUs, against 4.3-6.0 µs for a call taken here (ADR 0028).
func (s *Server) serveFrom(m *method, sc *C.isthmus_server_call_t) {
	for {
		s.handle(m, sc)
		// Without a thread to hold, a wait of zero: it gives back the connection this
		// goroutine's thread may have borrowed, which would otherwise lie unread for a while.
		spin := C.uint32_t(0)
		held := hold()
		if held {
			spin = takeSpin
		}
		var tag C.uint64_t
		var next *C.isthmus_server_call_t
		code := C.isthmus_cq_take_call(s.r.cq, spin, &tag, &next, nil)
		if held {
			release()
		}
		if code != C.ISTHMUS_OK || next == nil {
			return
		}
		e, ok := queuedMethods.Load(uint64(tag))
		if !ok {
			// Its server stopped just now (forgetQueued): every tag is in the map until then.
			msg := C.CString("the server has stopped")
			C.isthmus_server_call_finish(next, C.ISTHMUS_UNAVAILABLE, msg, nil, nil)
			C.free(unsafe.Pointer(msg))
			return
		}
		takenCalls.Add(1)
		target := e.(*inlineEntry)
		s, m, sc = target.s, target.m, next
	}
}

// forgetQueued drops the server's queue tags once it can take no call (under mu): a new
// call's event for one of them then finds nobody, and the call ends CANCELLED.
func (s *Server) forgetQueued() {
	forgetTags(s.r, s.queued)
	s.queued = nil
}

// forgetTags forgets queued methods' tags (forgetQueued), or those of a server that did not
// start.
func forgetTags(r *reactor, tags []uint64) {
	for _, tag := range tags {
		queuedMethods.Delete(tag)
		r.forget(tag)
	}
}

// handle runs one call's handler and ends the call with its outcome.
func (s *Server) handle(m *method, sc *C.isthmus_server_call_t) {
	if m.services != nil {
		unknownPath(m, sc)
		return
	}
	st := newServerStream(s, m, sc)
	defer st.cancel()
	s.handlerStarted()
	defer s.handlerEnded()
	var err error
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = panicked(m.name, p)
			}
		}()
		switch {
		case m.unary != nil:
			err = s.unary(st, m)
		case m.raw != nil:
			call := &RawServerCall{st: st}
			defer call.releaseUnsent() // a panic's too
			err = m.raw(call)
		case m.rawUnary != nil:
			if ev, ok := st.recv(); !ok {
				err = ctxError(st.ctx)
			} else if err = st.onlyRequest(ev); err == nil {
				err = s.runRawUnary(st, m, ev)
			}
		default:
			err = s.streaming(st, m)
		}
	}()
	st.end(err)
}

// unknownPath refuses a call of a path no method has, Unimplemented, as grpc-go's server
// does and in its words; m is the method that takes such paths. No handler runs, and the stats
// handlers hear nothing of it.
func unknownPath(m *method, sc *C.isthmus_server_call_t) {
	var n C.size_t
	path := C.GoStringN((*C.char)(unsafe.Pointer(C.isthmus_server_call_path(sc, &n))), C.int(n))
	var msg string
	switch service, method, ok := splitPath(path); {
	case !ok:
		msg = fmt.Sprintf("malformed method name: %q", path)
	case !m.services[service]:
		msg = "unknown service " + service
	default:
		msg = fmt.Sprintf("unknown method %v for service %v", method, service)
	}
	cmsg := C.CString(statusText(msg))
	C.isthmus_server_call_finish(sc, C.ISTHMUS_UNIMPLEMENTED, cmsg, nil, nil)
	C.free(unsafe.Pointer(cmsg))
}

// splitPath reads a method path as grpc-go's server does: "/service/method", split at its
// last "/".
func splitPath(path string) (service, method string, ok bool) {
	sm, ok := strings.CutPrefix(path, "/")
	i := strings.LastIndexByte(sm, '/')
	if !ok || i < 0 {
		return "", "", false
	}
	return sm[:i], sm[i+1:], true
}

// panicked is the error a call ends with when its handler panicked with p: INTERNAL, as
// grpc-go's recovery interceptors answer. The panic and its stack go to grpclog at ERROR
// (stderr by default), as net/http logs a handler's: grpc-go's server would crash the
// process instead, and a panic a server survives must not go unseen.
func panicked(method string, p any) error {
	logger.Errorf("the handler of %s panicked: %v\n%s", method, p, debug.Stack())
	return status.Errorf(codes.Internal, "the handler panicked: %v", p)
}

// logger is the package's grpclog component.
var logger = grpclog.Component("isthmus")

func (s *Server) unary(st *serverStream, m *method) error {
	ev, ok := st.recv()
	if !ok {
		return ctxError(st.ctx)
	}
	if err := st.onlyRequest(ev); err != nil {
		return err
	}
	reply, err := s.runUnary(st, m, ev)
	if err != nil {
		return err
	}
	return st.sendReply(reply)
}

// sendReply sends a unary call's response (startReply), waiting for it if it must.
func (st *serverStream) sendReply(m any) error {
	wait, err := st.startReply(m)
	if wait != nil {
		wait()
	}
	return err
}

// startReply sends a unary call's response m. A small one also finishes the call OK, in one
// cgo call (reply) that sends it at once when it can; while it waits for flow control instead,
// wait waits for the send to be over (the library finishes the call then). A large one is
// marshalled into shared memory and sent, waiting here if it must (a reading thread is handed
// to the runtime meanwhile), and the call is left for end; so is the call on an error.
func (st *serverStream) startReply(m any) (wait func(), err error) {
	if pm, ok := m.(proto.Message); ok {
		if size := proto.Size(pm); inPlace(size, true) {
			if err := st.checkSend(size); err != nil {
				return nil, err
			}
			err := st.sendLarge(pm, size)
			if err == nil {
				st.stats.outPayload(m, size)
			}
			return nil, err
		}
	}
	b, err := marshal(m)
	if err == nil {
		err = st.checkSend(len(b))
	}
	if err == nil {
		err = st.flushHeader()
	}
	if err != nil {
		return nil, err
	}
	pending, sent, err := st.reply(b)
	if err != nil {
		return nil, err
	}
	if pending == nil {
		st.replied(m, len(b), sent)
		return nil, nil
	}
	return func() { st.replied(m, len(b), pending.awaitReply()) }, nil
}

// replied tells the stats handlers how the reply of len n went: sent, or the send's failure
// (the client cancelled meanwhile), with which the library finished the call, as grpc-go's End
// carries it. They heard of every reply as sent.
func (st *serverStream) replied(m any, n int, sent error) {
	if st.stats == nil {
		return
	}
	if sent == nil {
		st.stats.outPayload(m, n)
	}
	st.mu.Lock()
	trailer := st.trailer
	st.mu.Unlock()
	st.stats.finish(trailer, sent)
}

// awaitReply waits for the event of a reply that did not go at once, releases the op, and
// says whether the send failed. The library finishes the call when the send ends, sent or
// failed, so the wait ends with the call (a call that ends ends the wait for credit too) and
// takes no context.
func (o *op) awaitReply() (sent error) {
	if ev, ok := o.wait(context.Background()); ok {
		sent = sendFailure(ev)
	}
	o.done()
	return sent
}

// sendFailure is a reply's send event's failure (nil if it went); the event's status is freed.
func sendFailure(ev C.isthmus_event_t) error {
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		return err
	}
	if ev.status != nil {
		C.isthmus_status_free(ev.status)
	}
	return nil
}

// runUnary runs a unary handler on the request event ev (which it consumes).
func (s *Server) runUnary(st *serverStream, m *method, ev C.isthmus_event_t) (any, error) {
	s.handlerStarted() // inline ones too, which handle does not run
	defer s.handlerEnded()
	dec := func(v any) error {
		if ev.code != C.ISTHMUS_OK {
			err := st.failed(ev.code, ev.status, false)
			ev.status = nil
			return err
		}
		if ev.message == nil {
			return errNoRequest
		}
		err := unmarshal(messageBytes(ev.message_data, ev.message_len), v)
		if err == nil {
			st.stats.inPayload(v, int(ev.message_len))
		}
		C.isthmus_message_free(ev.message)
		ev.message = nil
		return err
	}
	defer func() {
		if ev.message != nil {
			C.isthmus_message_free(ev.message)
		}
		if ev.status != nil {
			C.isthmus_status_free(ev.status)
		}
	}()
	return m.unary.Handler(m.impl, st.ctx, dec, s.opts.unary)
}

func (s *Server) streaming(st *serverStream, m *method) error {
	if s.opts.stream == nil {
		return m.stream.Handler(m.impl, st)
	}
	info := &grpc.StreamServerInfo{FullMethod: m.name, IsClientStream: m.stream.ClientStreams, IsServerStream: m.stream.ServerStreams}
	return s.opts.stream(m.impl, st, info, m.stream.Handler)
}

// serverStream is a call's server side: grpc.ServerStream for streaming handlers, and the
// grpc.ServerTransportStream behind grpc.SetHeader/SendHeader/SetTrailer for unary ones.
type serverStream struct {
	s   *Server
	m   *method
	sc  *C.isthmus_server_call_t
	ctx context.Context
	// call is the handler's context under ctx's last value (one allocation with the stream).
	call callContext

	mu         sync.Mutex
	stop       context.CancelFunc // call's, once a handler asked for it
	over       bool               // the handler returned, or the call ended under it: a context asked for later is done
	header     metadata.MD
	headerSent bool
	trailer    metadata.MD
	finished   bool
	peer       *peer.Peer // once asked for (callContext.Value)
	stats      *rpcStats  // nil without stats handlers (StatsHandler)
	tookOnly   bool       // RecvMsg has taken the one request of a server-streaming call
	inline     bool       // its handler runs on the connection's reader (InlineUnary)
	onlyErr    error      // and failed so: each later RecvMsg says so again, as grpc-go's
}

func newServerStream(s *Server, m *method, sc *C.isthmus_server_call_t) *serverStream {
	left := int64(C.isthmus_server_call_time_remaining_us(sc))
	return newServerStreamWith(s, m, sc, C.isthmus_server_call_metadata(sc), left)
}

// newServerStreamWith is newServerStream given the call's metadata (a handle it frees; nil
// for none) and the microseconds left before its deadline (-1: none).
func newServerStreamWith(s *Server, m *method, sc *C.isthmus_server_call_t, mdh *C.isthmus_metadata_t, left int64) *serverStream {
	st := &serverStream{s: s, m: m, sc: sc}
	parent := context.Background()
	md := takeMetadata(mdh)
	if md == nil {
		md = noMetadata
	} else {
		md["content-type"] = []string{grpcContentType}
	}
	ctx := metadata.NewIncomingContext(parent, md)
	if len(s.opts.stats) > 0 {
		clientStream, serverStream := m.streams()
		st.peer = peerOf(sc) // kept for peer.FromContext: one cgo call and parse per call
		// The stats handlers' context holds the peer too, as grpc-go's does.
		ctx, st.stats = beginRPC(peer.NewContext(ctx, st.peer), s.opts.stats, false, m.name, false, clientStream, serverStream)
		st.stats.inHeader(md, m.name, st.peer.Addr)
		st.stats.serverBegin(clientStream, serverStream)
	}
	st.call.Context, st.call.st = ctx, st
	if left >= 0 {
		st.call.deadline = deadlineIn(left)
	}
	st.ctx = grpc.NewContextWithServerTransportStream(&st.call, transportStream{st})
	return st
}

// deadlineIn is the time us microseconds from now. One too far for a time.Duration (past 292
// years; shm:// carries up to 584, grpc-timeout up to 11,415) is as far as a Duration goes:
// multiplied out, it overflowed into the past, and the handler's context was done at once.
func deadlineIn(us int64) time.Time {
	if us > math.MaxInt64/int64(time.Microsecond) {
		return time.Now().Add(math.MaxInt64)
	}
	return time.Now().Add(time.Duration(us) * time.Microsecond)
}

// statusText is a status message as the library takes it: UTF-8 without NUL. grpc-go sends
// any bytes (percent-encoded), and its clients read each byte that is not UTF-8 as U+FFFD, as
// here; a NUL they read back as one, but a C string ends at it, so here it is U+FFFD too. The
// library refused such a message, and ended the call INTERNAL in its own words instead.
func statusText(msg string) string {
	if utf8.ValidString(msg) && !strings.Contains(msg, "\x00") {
		return msg
	}
	var b strings.Builder
	for i := 0; i < len(msg); {
		r, n := utf8.DecodeRuneInString(msg[i:])
		if r == 0 || (r == utf8.RuneError && n == 1) {
			r = utf8.RuneError
		}
		b.WriteRune(r)
		i += n
	}
	return b.String()
}

// grpcContentType is the content type a handler finds in its incoming metadata, where
// grpc-go's handlers find the one their client sent: shm:// carries none, and the HTTP/2
// side keeps it from handlers (it refuses a request that is not gRPC's, and passes on
// application/grpc+proto or +json without saying which).
const grpcContentType = "application/grpc"

// noMetadata is the incoming metadata of a call that has none of its own. Shared: handlers
// get copies (metadata.FromIncomingContext copies).
var noMetadata = metadata.MD{"content-type": {grpcContentType}}

// callContext is a handler's context. Its cancellable part (a context.WithDeadline or
// WithCancel) is made when first asked for (Done or Err, asked for by few unary handlers),
// and only then does it learn of the client's cancel: a call whose handler never looks pays
// for neither, nor for a deadline's timer. Err starts it too: a handler that polls Err and
// never calls Done sees context.Canceled once the client cancels, as with grpc-go.
type callContext struct {
	context.Context // the incoming metadata (and stats) for Value
	st              *serverStream
	deadline        time.Time // zero: none
	once            sync.Once
	inner           context.Context // the cancellable part, once made
	made            atomic.Bool     // inner is set
}

// cancellable makes inner on first use. A handler that has returned gets it done already,
// as grpc-go cancels a call's context when the call ends.
func (c *callContext) cancellable() context.Context {
	c.once.Do(func() {
		var cancel context.CancelFunc
		if c.deadline.IsZero() {
			c.inner, cancel = context.WithCancel(c.Context)
		} else {
			c.inner, cancel = context.WithDeadline(c.Context, c.deadline)
		}
		c.made.Store(true)
		c.st.watch(cancel)
	})
	return c.inner
}

func (c *callContext) Deadline() (time.Time, bool) { return c.deadline, !c.deadline.IsZero() }

func (c *callContext) Done() <-chan struct{} { return c.cancellable().Done() }

func (c *callContext) Err() error { return c.cancellable().Err() }

// Value gives peer.FromContext the client, learned when first asked: most handlers never
// ask, and the cgo call and parse would cost each call for nothing. Once the cancellable part
// exists, other keys go through it, so that a context derived from this one (which asks Done
// first) finds it and is cancelled with it directly, without a goroutine to watch it.
func (c *callContext) Value(key any) any {
	if key == peerKey {
		return c.st.client()
	}
	if c.made.Load() {
		return c.inner.Value(key)
	}
	return c.Context.Value(key)
}

// cancel ends the handler's context, the call being over (its handler returned, or it ended
// under it): now if a handler made it, else when one does.
func (st *serverStream) cancel() {
	st.mu.Lock()
	st.over = true
	stop := st.stop
	st.mu.Unlock()
	if stop != nil {
		stop()
		if st.inline {
			st.s.hmu.Lock()
			delete(st.s.inlineWaits, st)
			st.s.hmu.Unlock()
		}
	}
}

// failed is the error of a receive (sending false) or send whose outcome, code and its status
// (consumed), says the call is over, through endedBy.
func (st *serverStream) failed(code C.isthmus_code_t, cst *C.isthmus_status_t, sending bool) error {
	err, _ := statusError(code, cst)
	return st.endedBy(st.overOr(err), sending)
}

// overOr is err, a failed operation's; or, if the call was finished under its handler (endNow),
// whose handle the operation found gone, grpc-go's error for a stream that is over: its
// context's.
func (st *serverStream) overOr(err error) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		return status.Error(codes.Canceled, context.Canceled.Error())
	}
	return err
}

// endedBy is err, a receive's or a send's (sending), as grpc-go's stream gives it, with the
// handler's context ended first: grpc-go's has ended by the time its stream fails, and a
// handler that looks at ctx.Err() after the error must find it (here the context learned of
// the end through an event of its own, which came up to a millisecond later).
//   - At the deadline (the library tells it as the call being over): once Go's timer, on the
//     same deadline, has ended the context, "context deadline exceeded".
//   - A cancel (the client's, or its connection's end, or Stop): the context is cancelled, and
//     the error is Canceled "context canceled"; for a send that found the connection gone,
//     Unavailable, as grpc-go's "transport is closing".
func (st *serverStream) endedBy(err error, sending bool) error {
	code := status.Code(err)
	if code != codes.Canceled && code != codes.Unavailable && code != codes.DeadlineExceeded {
		return err
	}
	if d, ok := st.call.Deadline(); ok && atDeadline(d) {
		// The library's timer can go off a little before Go's ends the context.
		select {
		case <-st.ctx.Done():
		case <-time.After(time.Until(d) + deadlineSlack):
		}
		return status.FromContextError(context.DeadlineExceeded).Err()
	}
	if code == codes.DeadlineExceeded {
		return err
	}
	st.cancel()
	if sending && code == codes.Unavailable {
		return err
	}
	return status.Error(codes.Canceled, context.Canceled.Error())
}

// deadlineSlack bounds how much earlier than Go's timer the library's may see a deadline
// pass: it rounds the deadline down to whole microseconds, and Go's timer fires late.
const deadlineSlack = 10 * time.Millisecond

// atDeadline is whether a call that ends now ends at its deadline d, as the library sees it.
func atDeadline(d time.Time) bool { return time.Until(d) < deadlineSlack }

// client is the call's peer.Peer. Once the call is finished the library's strings are gone:
// a goroutine that asks only then is told "unknown".
func (st *serverStream) client() *peer.Peer {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.peer == nil {
		if st.finished {
			st.peer = &peer.Peer{Addr: otherAddr("unknown")}
		} else {
			st.peer = peerOf(st.sc)
		}
	}
	return st.peer
}

// watch takes the cancel of the handler's context, just made: it runs when the call ends
// under its handler (the client cancelled or went away, or the deadline passed), or now if
// the handler has returned.
func (st *serverStream) watch(cancel context.CancelFunc) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.over {
		cancel()
		return
	}
	st.stop = cancel
	if st.finished {
		return
	}
	if st.inline && !st.s.waitInline(st) {
		cancel() // the server has stopped: its call is over, or soon will be
		return
	}
	tag := st.s.r.tag(func(C.isthmus_event_t) {
		// At the deadline the call ends too, and the context's own timer, on the same
		// deadline, ends it DeadlineExceeded, as grpc-go's: not cancelled first.
		if d, ok := st.call.Deadline(); !ok || !atDeadline(d) {
			cancel()
		}
	})
	var status *C.isthmus_status_t
	if C.isthmus_server_call_done_async(st.sc, st.s.r.cq, C.uint64_t(tag), &status) != C.ISTHMUS_OK {
		st.s.r.forget(tag)
		if status != nil {
			C.isthmus_status_free(status)
		}
	}
}

// transportStream is a call as grpc.SetHeader, SendHeader and SetTrailer find it in a
// handler's context (grpc.ServerTransportStream, whose SetTrailer returns an error where
// grpc.ServerStream's does not).
type transportStream struct{ *serverStream }

func (t transportStream) Method() string { return t.m.name }

func (t transportStream) SetTrailer(md metadata.MD) error { return t.setTrailer(md) }

func (st *serverStream) Context() context.Context { return st.ctx }

// errHeaderSent is grpc-go's error (transport.ErrIllegalHeaderWrite) for initial metadata, or
// a compressor, given once the initial metadata went.
var errHeaderSent = status.Error(codes.Internal, "transport: SendHeader called multiple times")

// SetHeader and SendHeader refuse metadata grpc-go's refuse (validateMetadata) at once, as
// its streams' do; a header that failed only when it went could be lost with no word. Empty
// metadata given to SetHeader is no error whenever it comes, as on grpc-go; other metadata
// fails once the header went or the call is over.
func (st *serverStream) SetHeader(md metadata.MD) error {
	if md.Len() == 0 {
		return nil
	}
	if err := validateMetadata(md); err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.headerSent || st.finished {
		return errHeaderSent
	}
	st.header = metadata.Join(st.header, md)
	return nil
}

func (st *serverStream) SendHeader(md metadata.MD) error {
	if err := validateMetadata(md); err != nil {
		return err
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		// The handle is gone with the call; grpc-go says the stream's context's error then.
		return status.Error(codes.Canceled, context.Canceled.Error())
	}
	if st.headerSent {
		return errHeaderSent
	}
	st.header = metadata.Join(st.header, md)
	return st.sendHeaderLocked(true)
}

// sendHeaderLocked sends the initial metadata gathered so far: now, even if there are none,
// with always (SendHeader: grpc-go writes the header then, and the client's Header returns);
// otherwise only if there are some (the first response, or the status, carries them anyway).
func (st *serverStream) sendHeaderLocked(always bool) error {
	st.headerSent = true
	st.stats.outHeader(st.header, "", nil)
	if len(st.header) == 0 && !always {
		return nil
	}
	var h *C.isthmus_metadata_t
	if len(st.header) > 0 {
		var err error
		if h, err = newMetadata(st.header); err != nil {
			return err
		}
	}
	var cst *C.isthmus_status_t
	code := C.isthmus_server_call_send_headers(st.sc, h, &cst)
	freeMetadata(h)
	if code != C.ISTHMUS_OK {
		err, _ := statusError(code, cst)
		return err
	}
	return nil
}

// SetSendCompressor chooses how the replies of the call whose handler was given ctx are
// compressed: grpc.SetSendCompressor for this server, which grpc-go's cannot serve (it looks
// for its own transport's stream); on a grpc-go server it calls grpc.SetSendCompressor, so a
// service may call it on either. name is "gzip", "deflate" or "identity" (uncompressed, even
// where SendCompressed compresses the server's replies). It applies to calls that came over
// HTTP/2, for a client whose grpc-accept-encoding lists the encoding: others get the replies
// uncompressed (grpc-go's returns an error then, and refuses a compressor not registered in
// the process, such as deflate by default; this one takes gzip and deflate). Over shm:// nothing is
// compressed, and it changes nothing. It must come before the initial metadata and the first
// reply go, as with grpc-go.
func SetSendCompressor(ctx context.Context, name string) error {
	ts, ok := grpc.ServerTransportStreamFromContext(ctx).(transportStream)
	if !ok {
		return grpc.SetSendCompressor(ctx, name)
	}
	return ts.setSendCompressor(name)
}

func (st *serverStream) setSendCompressor(name string) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.headerSent || st.finished {
		return errHeaderSent
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var cst *C.isthmus_status_t
	if code := C.isthmus_server_call_set_compression(st.sc, cname, &cst); code != C.ISTHMUS_OK {
		err, _ := statusError(code, cst)
		return err
	}
	return nil
}

// SetTrailer sets trailing metadata, as grpc.ServerStream's does: once the call is over they
// are dropped (grpc.SetTrailer says so, setTrailer).
func (st *serverStream) SetTrailer(md metadata.MD) { _ = st.setTrailer(md) }

// setTrailer is SetTrailer with grpc-go's answer (grpc.ServerTransportStream's): nil for empty
// metadata, errHeaderSent (transport.ErrIllegalHeaderWrite) once the call is over.
func (st *serverStream) setTrailer(md metadata.MD) error {
	if md.Len() == 0 {
		return nil
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		return errHeaderSent
	}
	st.trailer = metadata.Join(st.trailer, md)
	return nil
}

// checkSend fails a response of size bytes over MaxSendMessageSize, in grpc-go's words. Every
// way a response goes checks it once: SendMsg (which ends the call on it, as grpc-go's does),
// startReply, and the raw tier's Send and SendBlock.
func (st *serverStream) checkSend(size int) error {
	if limit := st.s.opts.maxSendMessageSize; limit > 0 && uint64(size) > limit {
		return status.Errorf(codes.ResourceExhausted, "trying to send message larger than max (%d vs. %d)", size, limit)
	}
	return nil
}

// SendMsg sends one response. A response that cannot go (it does not marshal, or is over
// MaxSendMessageSize) ends the call with that error at once, as grpc-go's SendMsg writes its
// status: a handler that goes on, or returns nil, does not end it OK.
func (st *serverStream) SendMsg(m any) error {
	if pm, ok := m.(proto.Message); ok {
		if size := proto.Size(pm); inPlace(size, st.m != nil && st.m.unary != nil) {
			if err := st.checkSend(size); err != nil {
				return st.endNow(err)
			}
			err := st.sendLarge(pm, size)
			if err == nil {
				st.stats.outPayload(m, size)
			}
			return err
		}
	}
	b, err := marshal(m)
	if err == nil {
		err = st.checkSend(len(b))
	}
	if err != nil {
		return st.endNow(err)
	}
	if err := st.sendChecked(b); err != nil {
		return err
	}
	st.stats.outPayload(m, len(b))
	return nil
}

// sendLarge marshals a response straight into a block of the server's shared memory (every
// server call is an shm:// one: HTTP/2 calls reach handlers through a loopback) and sends it.
// Its caller has checked its size (checkSend).
func (st *serverStream) sendLarge(m proto.Message, size int) error {
	call := &RawServerCall{st: st}
	b, err := call.Alloc(size)
	if err != nil {
		return st.overOr(err)
	}
	out, err := proto.MarshalOptions{}.MarshalAppend(b.Bytes()[:0], m)
	if err != nil || len(out) != size {
		b.Release()
		if err == nil {
			err = fmt.Errorf("%d bytes for a message of %d", len(out), size)
		}
		return status.Errorf(codes.Internal, "grpc: error while marshaling: %v", err)
	}
	return call.SendBlock(b)
}

// flushHeader sends the initial metadata gathered so far if it has not gone yet: it goes
// before the first message.
func (st *serverStream) flushHeader() error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished && !st.headerSent {
		// Finished under its handler (endNow): nothing more goes, and no stats event follows
		// its end.
		return status.Error(codes.Canceled, context.Canceled.Error())
	}
	if !st.headerSent {
		return st.sendHeaderLocked(false)
	}
	return nil
}

// reply sends b as a unary call's response and finishes the call OK with the trailers set,
// in one cgo call (isthmus_server_call_reply_async), which frees the call's handle: the
// stream is finished from here. pending is the op to await while the send waits, nil once it
// is over; sent is the failure of a send that failed at once, with whose status the library
// finished the call. An error means nothing was sent and the call is still open.
func (st *serverStream) reply(b []byte) (pending *op, sent error, err error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		return nil, nil, status.Error(codes.Internal, "the call was finished before its reply")
	}
	trailers, err := newMetadata(st.trailer)
	if err != nil {
		return nil, nil, err
	}
	st.finished = true
	o := st.s.r.newOp()
	var cst *C.isthmus_status_t
	code := C.isthmus_server_call_reply_async(st.sc, bytesPtr(b), C.size_t(len(b)), trailers, st.s.r.cq, C.uint64_t(o.tag), o.now, &cst)
	runtime.KeepAlive(b)
	freeMetadata(trailers)
	ev, now := o.started(code, cst)
	if !now {
		return o, nil, nil
	}
	o.done()
	return nil, sendFailure(ev), nil
}

// sendBytes sends one response message (the raw tier's Send).
func (st *serverStream) sendBytes(b []byte) error {
	if err := st.checkSend(len(b)); err != nil {
		return err
	}
	return st.sendChecked(b)
}

// sendChecked is sendBytes of a message whose size has been checked.
func (st *serverStream) sendChecked(b []byte) error {
	if err := st.flushHeader(); err != nil {
		return err
	}
	ev, ok := st.s.r.do(st.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var cst *C.isthmus_status_t
		return C.isthmus_server_call_send_async(st.sc, bytesPtr(b), C.size_t(len(b)), cq, tag, now, &cst), cst
	})
	runtime.KeepAlive(b)
	if !ok {
		return ctxError(st.ctx)
	}
	if ev.code != C.ISTHMUS_OK {
		return st.failed(ev.code, ev.status, true)
	}
	return nil
}

// recv waits for the next request's event; false if the context ended first. While a thread
// may be held (hold), the request is first waited for on this one, up to 50 µs, as a
// client's receive is (ClientConn.recvCall). Over every transport: the library does not tell
// a handler which one its call came by.
//
// A receive sends no initial metadata, as grpc-go's does not: a handler may set them after it
// has read requests. (A client that waits for the response to open before it sends its first
// request, as a tonic client awaiting its call does, waits on a handler that reads first, as it
// would on grpc-go's server.)
func (st *serverStream) recv() (C.isthmus_event_t, bool) {
	var flags C.uint32_t
	spin := hold()
	if spin {
		flags |= C.ISTHMUS_RECV_SPIN
	}
	return st.s.r.do(st.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var cst *C.isthmus_status_t
		code := C.isthmus_server_call_recv_async(st.sc, flags, cq, tag, now, &cst)
		if spin {
			release()
		}
		return code, cst
	})
}

func (st *serverStream) RecvMsg(m any) error {
	// A method whose client sends one request (server-streaming) takes it as grpc-go's does:
	// followed by the half-close, else the call fails (onlyRequest) at once; later calls give
	// io.EOF, or the first one's error again where none came (errNoRequest) or the call failed
	// first (the client went, the context ended): an EOF there read as a clean end of input.
	only := st.m.stream != nil && !st.m.stream.ClientStreams
	if only && st.tookOnly {
		if st.onlyErr != nil {
			return st.onlyErr
		}
		return io.EOF
	}
	ev, ok := st.recv()
	if !ok {
		err := ctxError(st.ctx)
		if only {
			st.tookOnly, st.onlyErr = true, err
		}
		return err
	}
	if only {
		st.tookOnly = true
		if ev.code == C.ISTHMUS_OK && ev.message == nil {
			st.onlyErr = errNoRequest
			return st.endNow(errNoRequest)
		}
		if err := st.onlyRequest(ev); err != nil {
			return st.endNow(err) // later calls give io.EOF, as grpc-go's (or its context's error)
		}
		if ev.code != C.ISTHMUS_OK {
			// The call failed before its request came (the client cancelled): said again.
			st.onlyErr = st.decode(ev, m)
			return st.onlyErr
		}
	}
	return st.decode(ev, m)
}

// endNow finishes the call with err, a failure of this side (its one request's, a request that
// does not unmarshal, a response that cannot go), and ends the handler's context, as grpc-go's
// RecvMsg and SendMsg send their client such a failure at once: a handler that goes on finds
// the call over, and what it returns is not sent.
func (st *serverStream) endNow(err error) error {
	st.end(err)
	st.cancel()
	return err
}

// decode consumes a received event ev: its message unmarshalled into m, io.EOF at the end
// of the client's stream, or the call's failure.
func (st *serverStream) decode(ev C.isthmus_event_t, m any) error {
	if ev.code != C.ISTHMUS_OK {
		return st.failed(ev.code, ev.status, false)
	}
	if ev.message == nil {
		return io.EOF
	}
	err := unmarshal(messageBytes(ev.message_data, ev.message_len), m)
	if err == nil {
		st.stats.inPayload(m, int(ev.message_len))
	}
	C.isthmus_message_free(ev.message)
	if err != nil {
		// A request that does not unmarshal ends the call at once, as grpc-go's RecvMsg
		// writes its status.
		return st.endNow(err)
	}
	return nil
}

// errNoRequest and errManyRequests end a call whose client sent no request, or more than
// one, where its method takes one: grpc-go's code and words.
var (
	errNoRequest    = status.Error(codes.Internal, "cardinality violation: received no request message from non-client-streaming RPC")
	errManyRequests = status.Error(codes.Internal, "cardinality violation: received multiple request messages for non-client-streaming RPC")
)

// onlyRequest checks, as grpc-go does for a method that takes one request (unary or
// server-streaming) before its handler has that request, that the client sends nothing after
// its request ev (a received event, which is left alone unless it is a message):
// at once if the client has half-closed, else by waiting for its next event. On a second
// request (errManyRequests) or a failure it frees ev's message and fails.
func (st *serverStream) onlyRequest(ev C.isthmus_event_t) error {
	if ev.code != C.ISTHMUS_OK || ev.message == nil || C.isthmus_server_call_half_closed(st.sc) == 1 {
		return nil
	}
	next, ok := st.recv()
	var err error
	switch {
	case !ok:
		err = ctxError(st.ctx)
	case next.code != C.ISTHMUS_OK:
		err = st.failed(next.code, next.status, false)
	case next.message == nil:
		return nil
	default:
		C.isthmus_message_free(next.message)
		err = errManyRequests
	}
	C.isthmus_message_free(ev.message)
	return err
}

// end finishes the call with the handler's outcome.
func (st *serverStream) end(err error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.finished {
		return
	}
	st.finished = true
	code, msg := C.isthmus_code_t(C.ISTHMUS_OK), ""
	var details []byte
	if err != nil {
		s, _ := status.FromError(err)
		if errors.Is(err, context.Canceled) {
			s = status.New(codes.Canceled, err.Error())
		} else if errors.Is(err, context.DeadlineExceeded) {
			s = status.New(codes.DeadlineExceeded, err.Error())
		}
		code, msg, details = C.isthmus_code_t(s.Code()), s.Message(), detailsOf(s)
	}
	if !st.headerSent && len(st.header) > 0 {
		// Set and not sent (an error before any reply, or a stream with none): grpc-go sends
		// it ahead of the status too. A call already over takes none, which is no loss.
		_ = st.sendHeaderLocked(false)
	}
	trailers, terr := newMetadata(st.trailer)
	if terr != nil {
		code, msg, details = C.isthmus_code_t(codes.Internal), status.Convert(terr).Message(), nil
	}
	if st.stats != nil {
		if terr != nil {
			err = status.Error(codes.Internal, status.Convert(terr).Message())
		}
		st.stats.finish(st.trailer, err)
	}
	cmsg := (*C.char)(nil)
	if msg != "" {
		cmsg = C.CString(statusText(msg))
		defer C.free(unsafe.Pointer(cmsg))
	}
	if len(details) == 0 {
		C.isthmus_server_call_finish(st.sc, code, cmsg, trailers, nil)
	} else {
		C.isthmus_server_call_finish_with_details(st.sc, code, cmsg, bytesPtr(details), C.size_t(len(details)), trailers, nil)
		runtime.KeepAlive(details)
	}
	freeMetadata(trailers)
}
