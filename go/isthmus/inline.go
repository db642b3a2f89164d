package isthmus

/*
#include <stdint.h>
#include <stdlib.h>
#include "isthmus.h"
extern void isthmusGoHandle(void *user_data, isthmus_server_call_t *call);

// What isthmus_server_call_begin writes, in C memory (cgo lets no Go pointer sit beside a
// pointer passed to C).
typedef struct {
	isthmus_metadata_t *metadata;
	int64_t left;
	isthmus_event_t now;
} isthmus_go_begin_t;
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// Inline unary handlers (InlineUnary): the library calls isthmusGoHandle on the thread that
// reads the client's connection. The handler runs right there when its request is in and its
// reply can go at once; whatever would wait moves to a goroutine, because the thread it
// would wait on is this one.

type inlineEntry struct {
	s *Server
	m *method
}

// inlineTarget is the user data a method's callback gets: C memory holding a cgo.Handle, as
// C may keep no Go pointer. It lives until its library server is freed (freeInlineTarget).
func inlineTarget(s *Server, m *method) unsafe.Pointer {
	p := C.malloc(C.size_t(unsafe.Sizeof(C.uintptr_t(0))))
	*(*C.uintptr_t)(p) = C.uintptr_t(cgo.NewHandle(&inlineEntry{s: s, m: m}))
	return p
}

// freeInlineTarget frees what inlineTarget made, once no callback can be given it.
func freeInlineTarget(p unsafe.Pointer) {
	cgo.Handle(*(*C.uintptr_t)(p)).Delete()
	C.free(p)
}

// addInlineHandler registers m's path to call isthmusGoHandle; the user data the callback
// gets is the library server's to free (libServer.inline).
func addInlineHandler(l *libServer, path *C.char, s *Server, m *method, st **C.isthmus_status_t) C.isthmus_code_t {
	p := inlineTarget(s, m)
	code := C.isthmus_server_add_handler(l.c, path, C.isthmus_handler_fn(C.isthmusGoHandle), p, st)
	if code != C.ISTHMUS_OK {
		freeInlineTarget(p)
		return code
	}
	l.inline = append(l.inline, p)
	return code
}

//export isthmusGoHandle
func isthmusGoHandle(userData unsafe.Pointer, sc *C.isthmus_server_call_t) {
	e := cgo.Handle(*(*C.uintptr_t)(userData)).Value().(*inlineEntry)
	e.s.handleInline(e.m, sc)
}

// beginBuf is what isthmus_server_call_begin writes, in C memory that its finalizer frees (a
// pool may drop it at any collection).
type beginBuf struct{ c *C.isthmus_go_begin_t }

var beginPool = sync.Pool{New: func() any {
	b := &beginBuf{c: (*C.isthmus_go_begin_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.isthmus_go_begin_t{}))))}
	runtime.SetFinalizer(b, func(b *beginBuf) { C.free(unsafe.Pointer(b.c)) })
	return b
}}

func (s *Server) handleInline(m *method, sc *C.isthmus_server_call_t) {
	// The metadata, the deadline and the request if it is in (it usually is): one cgo call.
	buf := beginPool.Get().(*beginBuf)
	b := buf.c
	in := C.isthmus_server_call_begin(sc, &b.metadata, &b.left, &b.now)
	var st *serverStream
	if in < 0 {
		st = newServerStream(s, m, sc)
	} else {
		st = newServerStreamWith(s, m, sc, b.metadata, int64(b.left))
	}
	st.inline = true
	ev := b.now
	*b = C.isthmus_go_begin_t{}
	beginPool.Put(buf)
	if in != 1 {
		s.receiveInline(st, m, sc)
		return
	}
	s.answerInline(st, m, ev)
}

// receiveInline takes the request that was not in when the handler began: at once if it has
// come since, else on a goroutine that waits for it.
func (s *Server) receiveInline(st *serverStream, m *method, sc *C.isthmus_server_call_t) {
	o := s.r.newOp()
	var cst *C.isthmus_status_t
	code := C.isthmus_server_call_recv_async(sc, 0, s.r.cq, C.uint64_t(o.tag), o.now, &cst)
	ev, now := o.started(code, cst)
	if !now {
		// The request is not in yet: wait for it on a goroutine.
		go func() {
			ev, ok := o.wait(st.ctx)
			o.done()
			if !ok {
				st.end(ctxError(st.ctx))
				st.cancel()
				return
			}
			s.answerWaiting(st, m, ev)
		}()
		return
	}
	o.done()
	s.answerInline(st, m, ev)
}

// answerInline runs the handler on its request event ev (which it consumes) and replies.
func (s *Server) answerInline(st *serverStream, m *method, ev C.isthmus_event_t) {
	if ev.code == C.ISTHMUS_OK && ev.message != nil && C.isthmus_server_call_half_closed(st.sc) != 1 {
		// The client has not half-closed yet: whether a second request comes is waited for on
		// a goroutine, since this thread reads.
		go s.answerWaiting(st, m, ev)
		return
	}
	if m.rawUnary != nil {
		// Its reply is a block: sent with no wait for anything but the client's window.
		st.end(s.runRawUnary(st, m, ev))
		st.cancel()
		return
	}
	reply, err := s.runUnarySafely(st, m, ev)
	if err == nil {
		var wait func()
		if wait, err = st.startReply(reply); wait != nil {
			// Flow control holds the reply back: the library finishes the call once it is
			// sent; its event is awaited on a goroutine, since this thread reads.
			go func() {
				defer st.cancel()
				wait()
			}()
			return
		}
	}
	st.end(err) // a no-op if the reply finished the call
	st.cancel()
}

// answerWaiting is answerInline on a goroutine of its own, for a call whose request came, or
// whose half-close after it may come, only after its handler began: it checks that no second
// request comes (onlyRequest), runs the handler on ev (which it consumes) and replies.
func (s *Server) answerWaiting(st *serverStream, m *method, ev C.isthmus_event_t) {
	defer st.cancel()
	if err := st.onlyRequest(ev); err != nil {
		st.end(err)
		return
	}
	if m.rawUnary != nil {
		st.end(s.runRawUnary(st, m, ev))
		return
	}
	reply, err := s.runUnarySafely(st, m, ev)
	if err == nil {
		err = st.SendMsg(reply)
	}
	st.end(err)
}

// runUnarySafely is runUnary with a handler's panic turned into INTERNAL.
func (s *Server) runUnarySafely(st *serverStream, m *method, ev C.isthmus_event_t) (reply any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = panicked(m.name, p)
		}
	}()
	return s.runUnary(st, m, ev)
}
