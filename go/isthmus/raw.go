package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"io"
	"runtime"
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

// Release gives the message's memory back. The bytes must not be used after.
func (m *Message) Release() {
	if m.h != nil {
		C.isthmus_message_free(m.h)
		m.h, m.data = nil, nil
	}
}

// Block is a writable block of this side's shared memory (shm:// only): fill Bytes, then send
// it with SendBlock, which hands it over with no copy. Release a block that is not sent.
type Block struct {
	h    *C.isthmus_block_t
	data []byte
}

func newBlock(h *C.isthmus_block_t) *Block {
	var n C.size_t
	p := C.isthmus_block_data(h, &n)
	return &Block{h: h, data: unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n))}
}

// Bytes is the block's memory to write, valid until it is sent or released.
func (b *Block) Bytes() []byte { return b.data }

// Release frees a block that will not be sent.
func (b *Block) Release() {
	if b.h != nil {
		C.isthmus_block_free(b.h)
		b.h, b.data = nil, nil
	}
}

// take hands the block's handle to a send; the block is spent either way.
func (b *Block) take() *C.isthmus_block_t {
	h := b.h
	b.h, b.data = nil, nil
	return h
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

// Alloc returns a writable block of n bytes in shared memory for the next request (shm://
// only; codes.Unimplemented over HTTP/2).
func (r *RawStream) Alloc(n int) (*Block, error) {
	call, ok := r.cs.begin()
	if !ok {
		return nil, io.EOF
	}
	defer r.cs.end()
	var h *C.isthmus_block_t
	var st *C.isthmus_status_t
	if code := C.isthmus_call_alloc(call, C.size_t(n), &h, &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return nil, err
	}
	return newBlock(h), nil
}

// SendBlock sends a block from Alloc as one request, with no copy; last half-closes with it.
func (r *RawStream) SendBlock(b *Block, last bool) error {
	if b.h == nil {
		return status.Error(codes.InvalidArgument, "the block was sent or released already")
	}
	call, ok := r.cs.begin()
	if !ok {
		b.Release()
		return io.EOF
	}
	defer r.cs.end()
	var st *C.isthmus_status_t
	l := C.int32_t(0)
	if last {
		l = 1
		r.cs.sent.Store(true)
	}
	if code := C.isthmus_call_send_block(call, b.take(), l, &st); code != C.ISTHMUS_OK {
		if st != nil {
			C.isthmus_status_free(st)
		}
		return io.EOF
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
		r.cs.mu.Lock()
		defer r.cs.mu.Unlock()
		if r.cs.err != nil {
			return nil, r.cs.err
		}
		return nil, io.EOF
	}
	defer r.cs.end()
	ev, ok := r.cs.cc.r.do(r.cs.ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		return C.isthmus_call_recv_async(call, cq, tag, now, &st), st
	})
	if !ok {
		err := ctxError(r.cs.ctx)
		r.cs.finish(err)
		return nil, err
	}
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		r.cs.finish(err)
		return nil, err
	}
	if ev.message == nil {
		r.cs.finish(nil)
		return nil, io.EOF
	}
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// Header is the server's initial metadata, waiting for it.
func (r *RawStream) Header() (metadata.MD, error) { return r.cs.Header() }

// Trailer is the server's trailing metadata, once the call has ended.
func (r *RawStream) Trailer() metadata.MD { return r.cs.Trailer() }

// CallRaw makes a unary call by method path: request bytes in (copied once, into shared
// memory over shm://), the reply as a Message viewing the server's memory.
func (cc *ClientConn) CallRaw(ctx context.Context, method string, request []byte) (*Message, error) {
	if cc.closed.Load() {
		return nil, errClosing()
	}
	copts, err := cCallOptions(ctx, callOptions{}, 0)
	if err != nil {
		return nil, err
	}
	path := cString(method)
	ev, ok := cc.r.do(ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
		var st *C.isthmus_status_t
		return C.isthmus_unary_async(cc.ch, path, bytesPtr(request), C.size_t(len(request)), &copts, cq, tag, now, &st), st
	})
	freeMetadata(copts.metadata)
	runtime.KeepAlive(request)
	if !ok {
		return nil, ctxError(ctx)
	}
	if ev.code != C.ISTHMUS_OK {
		err, _ := statusError(ev.code, ev.status)
		return nil, err
	}
	freeMetadata(ev.metadata)
	freeMetadata(ev.trailers)
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// RawHandler answers calls to one method path with bytes.
type RawHandler func(call *RawServerCall) error

// RawServerCall is the server's side of a raw call.
type RawServerCall struct {
	st *serverStream
}

// HandleRaw registers h for path (`/package.Service/Method`), beside or instead of
// generated services. Before Serve only.
func (s *Server) HandleRaw(path string, h RawHandler) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srv != nil {
		panic("isthmus: Server.HandleRaw after Serve")
	}
	s.methods[path] = &method{name: path, raw: h}
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
		err, _ := statusError(ev.code, ev.status)
		return nil, err
	}
	if ev.message == nil {
		return nil, io.EOF
	}
	return newMessage(ev.message, ev.message_data, ev.message_len), nil
}

// Send sends one response (copied into shared memory over shm://).
func (c *RawServerCall) Send(data []byte) error { return c.st.sendBytes(data) }

// Alloc returns a writable block of n bytes in the server's shared memory for a reply
// written in place (shm:// only).
func (c *RawServerCall) Alloc(n int) (*Block, error) {
	var h *C.isthmus_block_t
	var st *C.isthmus_status_t
	if code := C.isthmus_server_call_alloc(c.st.sc, C.size_t(n), &h, &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return nil, err
	}
	return newBlock(h), nil
}

// SendBlock sends a block from Alloc as one response, with no copy.
func (c *RawServerCall) SendBlock(b *Block) error {
	if b.h == nil {
		return status.Error(codes.InvalidArgument, "the block was sent or released already")
	}
	if err := c.st.flushHeader(); err != nil {
		b.Release()
		return err
	}
	var st *C.isthmus_status_t
	if code := C.isthmus_server_call_send_block(c.st.sc, b.take(), &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return err
	}
	return nil
}

// SetHeader, SendHeader and SetTrailer work as on grpc.ServerStream.
func (c *RawServerCall) SetHeader(md metadata.MD) error  { return c.st.SetHeader(md) }
func (c *RawServerCall) SendHeader(md metadata.MD) error { return c.st.SendHeader(md) }
func (c *RawServerCall) SetTrailer(md metadata.MD)       { c.st.SetTrailer(md) }
