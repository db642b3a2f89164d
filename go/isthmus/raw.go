package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"io"
	"math"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The raw tier: calls by method path with bytes, no protobuf and no copy. A request can be
// written straight into shared memory (Alloc, then SendBlock) and a reply read where it lies
// (a Message's Bytes view the sender's shared memory over shm://).

// Message is a received message. Over shm:// its bytes are a view of the sender's shared
// memory, not a copy: they stay valid until Release, which gives that memory back. Release it
// when done; a Message is not safe for concurrent use.
type Message struct {
	h    *C.isthmus_message_t
	data []byte
}

func newMessage(h *C.isthmus_message_t, data *C.uint8_t, n C.size_t) *Message {
	return &Message{h: h, data: messageBytes(data, n)}
}

// Bytes is the message's content, valid until Release.
func (m *Message) Bytes() []byte { return m.data }

// Release gives the message's memory back; a second Release does nothing. A slice taken
// from Bytes must not be used after: over shm:// it points into the sender's shared memory,
// which the sender reuses for later messages and which goes away with the connection, so
// reading it may give other bytes or crash the process. Copy what you keep (bytes.Clone)
// before Release.
func (m *Message) Release() {
	if m.h != nil {
		C.isthmus_message_free(m.h)
		m.h, m.data = nil, nil
	}
}

// Block is a writable block of memory for one message, filled in place: Bytes, then a send
// (SendBlock, CallRawBlock) that consumes it. Over shm:// it lies in this side's shared memory
// and is handed over with no copy; on other transports it is Go memory, copied once into the
// call. Release a block that is not sent. A block is for one goroutine at a time: one writing
// it while another sends it may write into a message already on its way.
type Block struct {
	h    *C.isthmus_block_t // nil for a block of Go memory
	data []byte
	// spent: sent or released. The first to set it (a send's take, a Release, or the
	// release of a handler's unsent blocks) owns h.
	spent atomic.Bool
}

func newBlock(h *C.isthmus_block_t) *Block {
	var n C.size_t
	p := C.isthmus_block_data(h, &n)
	return &Block{h: h, data: unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n))}
}

// allocated is the block an alloc entry point gave, a block of Go memory where the transport
// has no shared memory (codes.Unimplemented), or the failure.
func allocated(code C.isthmus_code_t, h *C.isthmus_block_t, st *C.isthmus_status_t, n int) (*Block, error) {
	if n < 0 {
		if h != nil {
			C.isthmus_block_free(h)
		}
		if st != nil {
			C.isthmus_status_free(st)
		}
		return nil, negativeSize(n)
	}
	switch code {
	case C.ISTHMUS_OK:
		return newBlock(h), nil
	case C.ISTHMUS_UNIMPLEMENTED:
		if st != nil {
			C.isthmus_status_free(st)
		}
		return goBlock(n)
	}
	err, _ := statusError(code, st)
	return nil, err
}

func negativeSize(n int) error {
	return status.Errorf(codes.InvalidArgument, "a block of %d bytes", n)
}

// goBlock is a block of n bytes of Go memory, for a transport with no shared memory. Past the
// largest message gRPC sends (grpc-go's default send limit, 2 GiB - 1) it is refused
// RESOURCE_EXHAUSTED, naming both, as shm:// refuses a block larger than its arena: make
// panicked on a size past the address space, and aborted the process on one past its memory.
func goBlock(n int) (*Block, error) {
	if int64(n) > math.MaxInt32 {
		return nil, status.Errorf(codes.ResourceExhausted, "trying to send message larger than max (%d vs. %d)", n, math.MaxInt32)
	}
	return &Block{data: make([]byte, n)}, nil
}

// Bytes is the block's memory to write, valid until it is sent or released.
func (b *Block) Bytes() []byte { return b.data }

// WriteAt copies p into the block at offset off (io.WriterAt). Over shm:// a large p is copied
// the way the library fills the blocks it copies into itself: past a quarter of the
// last-level cache with stores that bypass the cache, since the reader is another process,
// reading p ahead across page boundaries (ADR 0022, 0023); for 4 MiB and more that is faster
// than Go's copy into Bytes. Nothing is written, and the error is codes.InvalidArgument, when
// p does not fit at off or the block was sent or released.
func (b *Block) WriteAt(p []byte, off int64) (int, error) {
	if b.spent.Load() {
		return 0, status.Error(codes.InvalidArgument, "the block was sent or released already")
	}
	if off < 0 || off > int64(len(b.data)) || int64(len(p)) > int64(len(b.data))-off {
		return 0, status.Errorf(codes.InvalidArgument, "a write of %d bytes at offset %d does not fit the block's %d bytes", len(p), off, len(b.data))
	}
	// A cgo call costs more than a small copy.
	if b.h == nil || len(p) < 64<<10 {
		return copy(b.data[off:], p), nil
	}
	var st *C.isthmus_status_t
	code := C.isthmus_block_write(b.h, C.size_t(off), (*C.uint8_t)(unsafe.Pointer(&p[0])), C.size_t(len(p)), &st)
	if code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return 0, err
	}
	return len(p), nil
}

// Truncate shortens the block to its first n bytes, for a message written short of what was
// allocated: a send then carries those n bytes, and Bytes gives them. A block never grows: n
// below 0 or above its length, or a block sent or released, is codes.InvalidArgument, the
// block unchanged.
func (b *Block) Truncate(n int) error {
	if b.spent.Load() {
		return status.Error(codes.InvalidArgument, "the block was sent or released already")
	}
	if n < 0 || n > len(b.data) {
		return status.Errorf(codes.InvalidArgument, "cannot cut a block of %d bytes to %d", len(b.data), n)
	}
	if b.h != nil {
		var st *C.isthmus_status_t
		if code := C.isthmus_block_truncate(b.h, C.size_t(n), &st); code != C.ISTHMUS_OK {
			err, _ := statusError(code, st)
			return err
		}
	}
	b.data = b.data[:n]
	return nil
}

// Release frees a block that will not be sent; after a send, or a second time, it does
// nothing. A slice taken from Bytes must not be used after Release or a send: the memory
// goes back to this side's shared memory for later messages (and away with the connection),
// so a write through it may change another message or crash the process.
func (b *Block) Release() {
	if !b.spent.Swap(true) {
		if b.h != nil {
			C.isthmus_block_free(b.h)
		}
		b.h, b.data = nil, nil
	}
}

// take hands the block to a send: its handle (nil for Go memory) and its bytes. The block is
// spent either way.
func (b *Block) take() (*C.isthmus_block_t, []byte, error) {
	if b.spent.Swap(true) {
		return nil, nil, status.Error(codes.InvalidArgument, "the block was sent or released already")
	}
	h, data := b.h, b.data
	b.h, b.data = nil, nil
	return h, data, nil
}

// RawStream is one call by method path with bytes, of any shape. Send and Recv may be used
// from two goroutines at once.
type RawStream struct {
	cs *clientStream
}

// StartRaw starts a call by method path (`/package.Service/Method`).
func (cc *ClientConn) StartRaw(ctx context.Context, method string) (*RawStream, error) {
	if cc.closed.Load() {
		return nil, errClosing()
	}
	s, err := cc.newStream(ctx, &rawDesc, method, callOptions{})
	if err != nil {
		return nil, err
	}
	return &RawStream{cs: s}, nil
}

var rawDesc = grpc.StreamDesc{ServerStreams: true, ClientStreams: true}

// Alloc returns a writable block of n bytes for the next request: shared memory over shm://,
// Go memory on other transports.
func (r *RawStream) Alloc(n int) (*Block, error) {
	call, ok := r.cs.begin()
	if !ok {
		// Over; ended by its context (which finishes the stream with the context's error), it
		// says why, as below; ended otherwise, io.EOF, as a send says.
		if err := r.cs.over(); err != nil && r.cs.ctx.Err() != nil {
			return nil, err
		}
		return nil, io.EOF
	}
	defer r.cs.end()
	var h *C.isthmus_block_t
	var st *C.isthmus_status_t
	b, err := allocated(C.isthmus_call_alloc(call, C.size_t(n), &h, &st), h, st, n)
	if err != nil && r.cs.ctx.Err() != nil {
		// The library ends a call its context ended as cancelled; say why, as grpc-go does.
		return nil, ctxError(r.cs.ctx)
	}
	return b, err
}

// SendBlock sends a block from Alloc as one request, with no copy; last half-closes with it.
func (r *RawStream) SendBlock(b *Block, last bool) error {
	h, data, err := b.take()
	if err != nil {
		return err
	}
	if h == nil {
		return r.cs.sendBytes(data, last)
	}
	call, ok := r.cs.begin()
	if !ok {
		C.isthmus_block_free(h)
		return io.EOF
	}
	defer r.cs.end()
	var st *C.isthmus_status_t
	l := C.int32_t(0)
	if last {
		l = 1
	}
	if code := C.isthmus_call_send_block(call, h, l, &st); code != C.ISTHMUS_OK {
		// Not half-closed (a block of another connection is refused and the call goes on):
		// a CloseSend after this must still send the half-close.
		return sendFailed(code, st)
	}
	if last {
		r.cs.sent.Store(true)
	}
	return nil
}

// Send sends one request (copied into shared memory over shm://); last half-closes with it.
func (r *RawStream) Send(data []byte, last bool) error { return r.cs.sendBytes(data, last) }

// CloseSend half-closes.
func (r *RawStream) CloseSend() error { return r.cs.CloseSend() }

// Recv returns the next response (Release it when done), io.EOF at an OK end, or the call's
// status error.
func (r *RawStream) Recv() (*Message, error) {
	call, ok := r.cs.begin()
	if !ok {
		return nil, endError(r.cs.over())
	}
	defer r.cs.end()
	ev, ok := r.cs.cc.recvCall(r.cs.ctx, call)
	if !ok {
		// Cancelled before the finish, as clientStream.recv does.
		r.cs.cancel()
		return nil, endError(r.cs.finish(ctxError(r.cs.ctx), nil))
	}
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		r.cs.keepHeader(call)
		return nil, endError(r.cs.finish(r.cs.cc.callError(r.cs.ctx, err), nil))
	}
	if ev.message == nil {
		r.cs.keepHeader(call)
		return nil, endError(r.cs.finish(nil, nil))
	}
	if !r.cs.gotMessage {
		// As the typed stream's: Header and grpc.Header keep what came, however it ends.
		r.cs.gotMessage = true
		r.cs.keepHeader(call)
	}
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// Header is the server's initial metadata, waiting for it.
func (r *RawStream) Header() (metadata.MD, error) { return r.cs.Header() }

// Trailer is the server's trailing metadata, once the call has ended.
func (r *RawStream) Trailer() metadata.MD { return r.cs.Trailer() }

// CallRaw makes a unary call by method path: request bytes in (copied once, into shared
// memory over shm://), the reply as a Message viewing the server's memory. It waits for the
// reply as Invoke does.
func (cc *ClientConn) CallRaw(ctx context.Context, method string, request []byte) (*Message, error) {
	if cc.closed.Load() {
		return nil, errClosing()
	}
	copts, err := cc.cCallOptions(ctx, method, callOptions{}, 0)
	if err != nil {
		return nil, err
	}
	path, done := cString(method)
	ev, ok := cc.unaryBytes(ctx, path, request, &copts)
	done()
	return cc.rawReply(ctx, ev, ok)
}

// Alloc returns a writable block of n bytes for the request of a CallRawBlock, to fill in
// place: the connection's shared memory over shm:// (sent with no copy), Go memory on other
// transports. Over shm:// it waits while the connection's arena is full, until ctx ends: past
// its deadline it fails with codes.DeadlineExceeded, cancelled with codes.Canceled.
func (cc *ClientConn) Alloc(ctx context.Context, n int) (*Block, error) {
	if cc.closed.Load() {
		return nil, errClosing()
	}
	if n < 0 {
		return nil, negativeSize(n)
	}
	if !cc.shm {
		return goBlock(n)
	}
	copts, err := cc.cCallOptions(ctx, "", callOptions{}, 0)
	if err != nil {
		return nil, err
	}
	defer freeMetadata(copts.metadata)
	return cc.allocBlock(ctx, n, &copts)
}

// allocSlice bounds one wait inside isthmus_channel_alloc for a context that can be
// cancelled. The library ends that wait (for arena room; with WaitForReady, for a server)
// only at the call's timeout and offers no way to cancel it, so such a wait is made of slices
// this long, the context looked at between them: cancelling ends it within a slice.
const allocSlice = 50 * time.Millisecond

// allocPauseMax bounds the pause after a slice the library ended early (see allocBlock), as
// its own backoff between connects for WaitForReady is bounded.
const allocPauseMax = 500 * time.Millisecond

// allocBlock is a block of n bytes of the channel's shared memory, waited for until ctx
// ends; copts are the call's options (cCallOptions), whose timeout is changed here.
//
// A context that cannot be cancelled waits in one cgo call, up to copts' timeout. Any other
// waits in slices of allocSlice: a block that is there at once takes the same one cgo call,
// and a slice that ends DEADLINE_EXCEEDED before ctx's deadline is tried again while ctx
// lasts. A slice that ended before its time did so waiting for a server (WaitForReady: the
// library gives up once its next connect would come too late), and is followed by a pause
// here, where ctx is watched, that grows up to allocPauseMax: no busy connecting.
func (cc *ClientConn) allocBlock(ctx context.Context, n int, copts *C.isthmus_call_options_t) (*Block, error) {
	done := ctx.Done()
	if !cc.use() {
		return nil, errClosing()
	}
	defer cc.unuse()
	if done == nil {
		var h *C.isthmus_block_t
		var st *C.isthmus_status_t
		return allocated(C.isthmus_channel_alloc(cc.ch, C.size_t(n), copts, &h, &st), h, st, n)
	}
	deadline, hasDeadline := ctx.Deadline()
	pause := allocSlice
	for {
		slice, last := allocSlice, false
		if hasDeadline {
			left := time.Until(deadline)
			if left <= 0 {
				return nil, status.Error(codes.DeadlineExceeded, context.DeadlineExceeded.Error())
			}
			if left <= slice {
				// The last slice: its DEADLINE_EXCEEDED, if it comes, is the call's.
				slice, last = left, true
			}
		}
		copts.timeout_us = C.int64_t(max(slice.Microseconds(), 1))
		began := time.Now()
		var h *C.isthmus_block_t
		var st *C.isthmus_status_t
		code := C.isthmus_channel_alloc(cc.ch, C.size_t(n), copts, &h, &st)
		if code != C.ISTHMUS_DEADLINE_EXCEEDED || last {
			return allocated(code, h, st, n)
		}
		if h != nil {
			C.isthmus_block_free(h)
		}
		if st != nil {
			C.isthmus_status_free(st)
		}
		if time.Since(began) >= slice {
			if ctx.Err() != nil {
				return nil, ctxError(ctx)
			}
			continue
		}
		t := time.NewTimer(pause)
		select {
		case <-done:
			t.Stop()
			return nil, ctxError(ctx)
		case <-t.C:
		}
		pause = min(2*pause, allocPauseMax)
	}
}

// CallRawBlock makes a unary call by method path whose request is a block from Alloc, sent
// where it lies (the block is spent, whatever the outcome); the reply is a Message viewing the
// server's memory. It waits for the reply as Invoke does.
func (cc *ClientConn) CallRawBlock(ctx context.Context, method string, request *Block) (*Message, error) {
	if cc.closed.Load() {
		request.Release()
		return nil, errClosing()
	}
	copts, err := cc.cCallOptions(ctx, method, callOptions{}, 0)
	if err != nil {
		request.Release()
		return nil, err
	}
	path, done := cString(method)
	ev, ok, err := cc.unaryBlock(ctx, path, request, &copts)
	done()
	if err != nil {
		return nil, err
	}
	return cc.rawReply(ctx, ev, ok)
}

// unaryBlock runs a unary call whose request is block (spent here; one of Go memory goes as
// bytes) the way unary does; the metadata handle in copts is freed here. err is a block that
// was spent already.
func (cc *ClientConn) unaryBlock(ctx context.Context, path *C.char, block *Block, copts *C.isthmus_call_options_t) (C.isthmus_event_t, bool, error) {
	h, data, err := block.take()
	if err != nil {
		freeMetadata(copts.metadata)
		return C.isthmus_event_t{}, false, err
	}
	if h == nil {
		ev, ok := cc.unaryBytes(ctx, path, data, copts)
		return ev, ok, nil
	}
	ev, ok := cc.unary(ctx, copts, func(o *C.isthmus_call_options_t) C.isthmus_event_t {
		if !cc.use() {
			C.isthmus_block_free(h) // consumed, as a call would
			return closedEvent()
		}
		defer cc.unuse()
		var msg *C.isthmus_message_t
		var header, trailer *C.isthmus_metadata_t
		var st *C.isthmus_status_t
		code := C.isthmus_unary_block(cc.ch, path, h, o, &msg, &header, &trailer, &st)
		return unaryEvent(code, msg, header, trailer, st)
	}, func(o *C.isthmus_call_options_t, cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		if !cc.use() {
			C.isthmus_block_free(h)
			return C.ISTHMUS_CANCELLED, nil
		}
		defer cc.unuse()
		var st *C.isthmus_status_t
		return C.isthmus_unary_block_async(cc.ch, path, h, o, cq, tag, now, &st), st
	})
	return ev, ok, nil
}

// rawReply is a raw unary call's outcome: the reply as a Message, or the call's error.
func (cc *ClientConn) rawReply(ctx context.Context, ev C.isthmus_event_t, ok bool) (*Message, error) {
	if !ok {
		return nil, ctxError(ctx)
	}
	freeMetadata(ev.metadata)
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		return nil, cc.callError(ctx, err)
	}
	freeMetadata(ev.trailers)
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// RawHandler answers calls to one method path with bytes.
type RawHandler func(call *RawServerCall) error

// RawServerCall is the server's side of a raw call.
type RawServerCall struct {
	st *serverStream
	// blocks (under mu) are those Alloc gave: the ones neither sent nor released when the
	// handler returns (it failed, or panicked) are released then (releaseUnsent). Held, each
	// kept its arena space, and the connection's mapping, for the life of the process.
	mu     sync.Mutex
	blocks []*Block
	// compactAt is the length of blocks at which the spent ones are dropped from it: twice
	// what was left at the last compaction, so that a handler holding many unsent blocks does
	// not rescan them on every Alloc.
	compactAt int
}

// HandleRaw registers h for path (`/package.Service/Method`), beside or instead of
// generated services. Before Serve only.
func (s *Server) HandleRaw(path string, h RawHandler) {
	s.register(&method{name: path, raw: h}, "HandleRaw")
}

// RawUnaryHandler answers a unary call by method path. request is the client's message (over
// shm:// a view of the client's memory), valid until the handler returns; the reply is a
// block from call.Alloc, filled in place and sent with no copy over shm://, and spent by the
// send. A handler that fails returns a status error (and the block, or nil); the blocks from
// call.Alloc that no send spent are released when it returns, whichever way it does.
type RawUnaryHandler func(call *RawServerCall, request *Message) (*Block, error)

// HandleRawUnary registers h for unary calls to path (`/package.Service/Method`), beside or
// instead of generated services. With InlineUnary it runs on the thread that read the
// request, as generated unary handlers do. Before Serve only.
func (s *Server) HandleRawUnary(path string, h RawUnaryHandler) {
	s.register(&method{name: path, rawUnary: h}, "HandleRawUnary")
}

// register registers m under its path; before Serve only (caller names the method that asked).
func (s *Server) register(m *method, caller string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.srvs) > 0 {
		panic("isthmus: Server." + caller + " after Serve")
	}
	s.methods[m.name] = m
}

// runRawUnary runs a raw unary handler on the request event ev (consumed here) and sends its
// reply; a panic in the handler fails the call INTERNAL.
func (s *Server) runRawUnary(st *serverStream, m *method, ev C.isthmus_event_t) (err error) {
	s.handlerStarted() // inline ones too, which handle does not run
	defer s.handlerEnded()
	if ev.code != C.ISTHMUS_OK {
		return st.failed(ev.code, ev.status, false)
	}
	if ev.message == nil {
		return errNoRequest
	}
	request := newMessage(ev.message, ev.message_data, ev.message_len)
	defer request.Release()
	call := &RawServerCall{st: st}
	defer call.releaseUnsent()
	var reply *Block
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = panicked(m.name, p)
			}
		}()
		reply, err = m.rawUnary(call, request)
	}()
	switch {
	case err != nil:
		if reply != nil {
			reply.Release()
		}
		return err
	case reply == nil:
		return status.Error(codes.Internal, m.name+": the handler returned no reply")
	}
	return call.SendBlock(reply)
}

// Context is the call's context: its deadline, its metadata (metadata.FromIncomingContext),
// and cancelled when the client cancels.
func (c *RawServerCall) Context() context.Context { return c.st.ctx }

// Recv returns the next request (Release it when done; over shm:// it views the client's
// memory), or io.EOF once the client has half-closed.
func (c *RawServerCall) Recv() (*Message, error) {
	ev, ok := c.st.recv()
	if !ok {
		return nil, ctxError(c.st.ctx)
	}
	if ev.code != C.ISTHMUS_OK {
		return nil, c.st.failed(ev.code, ev.status, false)
	}
	if ev.message == nil {
		return nil, io.EOF
	}
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// Send sends one response (copied into shared memory over shm://).
func (c *RawServerCall) Send(data []byte) error { return c.st.sendBytes(data) }

// Alloc returns a writable block of n bytes for a reply written in place: the server's shared
// memory over shm://, Go memory on other transports. A block that no send spends is released
// when the handler returns.
func (c *RawServerCall) Alloc(n int) (*Block, error) {
	var h *C.isthmus_block_t
	var st *C.isthmus_status_t
	b, err := allocated(C.isthmus_server_call_alloc(c.st.sc, C.size_t(n), &h, &st), h, st, n)
	if err != nil {
		// The call's end as a send tells it: the handler's context done first.
		return nil, c.st.endedBy(c.st.overOr(err), true)
	}
	if b.h != nil {
		c.mu.Lock()
		if len(c.blocks) >= max(c.compactAt, 64) {
			// A streaming handler sends block after block: the spent ones go from the list.
			kept := c.blocks[:0]
			for _, old := range c.blocks {
				if !old.spent.Load() {
					kept = append(kept, old)
				}
			}
			clear(c.blocks[len(kept):]) // the dropped ones are not held by the array
			c.blocks = kept
			c.compactAt = 2 * len(kept)
		}
		c.blocks = append(c.blocks, b)
		c.mu.Unlock()
	}
	return b, nil
}

// releaseUnsent releases the blocks from Alloc that no send spent, once the handler returned.
func (c *RawServerCall) releaseUnsent() {
	c.mu.Lock()
	blocks := c.blocks
	c.blocks = nil
	c.mu.Unlock()
	for _, b := range blocks {
		b.Release()
	}
}

// SendBlock sends a block from Alloc as one response, with no copy over shm://.
func (c *RawServerCall) SendBlock(b *Block) error {
	h, data, err := b.take()
	if err != nil {
		return err
	}
	if h == nil {
		return c.st.sendBytes(data)
	}
	if err := c.st.checkSend(len(data)); err != nil {
		C.isthmus_block_free(h)
		return err
	}
	if err := c.st.flushHeader(); err != nil {
		C.isthmus_block_free(h)
		return err
	}
	var st *C.isthmus_status_t
	if code := C.isthmus_server_call_send_block(c.st.sc, h, &st); code != C.ISTHMUS_OK {
		return c.st.failed(code, st, true)
	}
	return nil
}

// SetHeader, SendHeader and SetTrailer work as on grpc.ServerStream.
func (c *RawServerCall) SetHeader(md metadata.MD) error  { return c.st.SetHeader(md) }
func (c *RawServerCall) SendHeader(md metadata.MD) error { return c.st.SendHeader(md) }
func (c *RawServerCall) SetTrailer(md metadata.MD)       { c.st.SetTrailer(md) }
