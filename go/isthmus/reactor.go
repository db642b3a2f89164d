package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// The reactor is how a goroutine waits for isthmus without holding an OS thread. Each
// operation starts with a short cgo call that runs it as far as it can (one that finishes
// there, a request sent or a reply already in, comes back at once in `now`); one that must
// wait completes later as an event on the process's completion queue. One goroutine takes
// those events and hands each to the goroutine waiting for it; when the queue is empty it
// parks in Go's netpoller on the queue's eventfd. It does not spin: on two cores a spinning
// goroutine took the CPU the peer needed, and measured slower than parking.

// eventCapacity is how many events one poll takes.
const eventCapacity = 256

type reactor struct {
	cq     *C.isthmus_cq_t
	file   *os.File // a dup of the queue's eventfd, in the netpoller
	events *C.isthmus_event_t

	mu      sync.Mutex
	waiting map[uint64]func(C.isthmus_event_t)
	next    atomic.Uint64
}

var (
	theReactor     *reactor
	theReactorOnce sync.Once
	theReactorErr  error
)

// getReactor returns the process's reactor, starting it on first use.
func getReactor() (*reactor, error) {
	theReactorOnce.Do(func() {
		cq := C.isthmus_cq_new()
		if cq == nil {
			theReactorErr = os.NewSyscallError("isthmus_cq_new", syscall.EMFILE)
			return
		}
		fd, err := syscall.Dup(int(C.isthmus_cq_fd(cq)))
		if err != nil {
			theReactorErr = os.NewSyscallError("dup", err)
			return
		}
		if err := syscall.SetNonblock(fd, true); err != nil {
			theReactorErr = os.NewSyscallError("setnonblock", err)
			return
		}
		r := &reactor{
			cq:      cq,
			file:    os.NewFile(uintptr(fd), "isthmus-completions"),
			events:  (*C.isthmus_event_t)(C.calloc(eventCapacity, C.size_t(unsafe.Sizeof(C.isthmus_event_t{})))),
			waiting: make(map[uint64]func(C.isthmus_event_t)),
		}
		go r.run()
		theReactor = r
	})
	return theReactor, theReactorErr
}

// tag reserves a tag whose event goes to deliver.
func (r *reactor) tag(deliver func(C.isthmus_event_t)) uint64 {
	t := r.next.Add(1)
	r.mu.Lock()
	r.waiting[t] = deliver
	r.mu.Unlock()
	return t
}

// forget drops a tag whose event will not come (the operation completed at once, or failed
// to start, or was abandoned).
func (r *reactor) forget(t uint64) {
	r.mu.Lock()
	delete(r.waiting, t)
	r.mu.Unlock()
}

func (r *reactor) run() {
	var buf [8]byte
	for {
		if n := int(C.isthmus_cq_poll(r.cq, r.events, eventCapacity)); n > 0 {
			r.dispatch(n)
			continue
		}
		// Parks this goroutine (not its thread) until the eventfd is signalled.
		if _, err := r.file.Read(buf[:]); err != nil && err != syscall.EAGAIN {
			time.Sleep(time.Millisecond)
		}
	}
}

func (r *reactor) dispatch(n int) {
	events := unsafe.Slice(r.events, n)
	for i := range events {
		ev := events[i]
		r.mu.Lock()
		deliver, ok := r.waiting[uint64(ev.tag)]
		if ok && ev.op != C.ISTHMUS_OP_NEW_CALL {
			delete(r.waiting, uint64(ev.tag))
		}
		r.mu.Unlock()
		if !ok {
			freeEvent(ev)
			continue
		}
		deliver(ev)
	}
}

// freeEvent releases every handle in an event nobody waits for.
func freeEvent(ev C.isthmus_event_t) {
	if ev.call != nil {
		C.isthmus_call_free(ev.call)
	}
	if ev.server_call != nil {
		C.isthmus_server_call_finish(ev.server_call, C.ISTHMUS_CANCELLED, nil, nil, nil)
	}
	if ev.message != nil {
		C.isthmus_message_free(ev.message)
	}
	freeMetadata(ev.metadata)
	freeMetadata(ev.trailers)
	if ev.status != nil {
		C.isthmus_status_free(ev.status)
	}
}

// op is one operation a goroutine waits for.
type op struct {
	r   *reactor
	tag uint64
	ch  chan C.isthmus_event_t
	// deliver sends an event to ch: the reactor's entry for tag, made with ch rather than for
	// every operation (it holds ch, not the op, which a finalizer must be able to collect).
	deliver func(C.isthmus_event_t)
	// now is C memory: the C call writes an immediate result there, and cgo lets no Go
	// pointer sit beside a pointer passed to C.
	now *C.isthmus_event_t
}

// opPool's ops free their C memory when collected: a pool may drop what it holds at any
// collection.
var opPool = sync.Pool{New: func() any {
	o := &op{now: (*C.isthmus_event_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.isthmus_event_t{}))))}
	o.newChan()
	runtime.SetFinalizer(o, func(o *op) { C.free(unsafe.Pointer(o.now)) })
	return o
}}

// newChan gives the op a channel of its own, and deliver for it.
func (o *op) newChan() {
	ch := make(chan C.isthmus_event_t, 1)
	o.ch, o.deliver = ch, func(ev C.isthmus_event_t) { ch <- ev }
}

// newOp reserves a tag for one operation.
func (r *reactor) newOp() *op {
	o := opPool.Get().(*op)
	o.r = r
	*o.now = C.isthmus_event_t{}
	o.tag = r.tag(o.deliver)
	return o
}

// started is what the cgo call that starts the operation returned: on failure the tag is
// forgotten and the failure returned as an event.
func (o *op) started(code C.isthmus_code_t, st *C.isthmus_status_t) (C.isthmus_event_t, bool) {
	if code != C.ISTHMUS_OK {
		o.r.forget(o.tag)
		return C.isthmus_event_t{op: -1, code: code, status: st}, true
	}
	if o.now.op != 0 {
		o.r.forget(o.tag)
		return *o.now, true
	}
	return C.isthmus_event_t{}, false
}

// wait returns the operation's event, or ctx's end first: then the operation is abandoned
// (its call cancelled) and ok is false.
func (o *op) wait(ctx context.Context) (ev C.isthmus_event_t, ok bool) {
	select {
	case ev = <-o.ch:
		return ev, true
	case <-ctx.Done():
		if C.isthmus_cq_cancel(o.r.cq, C.uint64_t(o.tag)) == C.ISTHMUS_OK {
			o.r.forget(o.tag)
			// The library promises no event for the tag now; a channel of its own all the
			// same, so that nothing late could ever reach the next call that takes this op.
			o.newChan()
			return ev, false
		}
		// It finished meanwhile: its event is on the way.
		return <-o.ch, true
	}
}

// done returns the op to the pool.
func (o *op) done() {
	o.r = nil
	opPool.Put(o)
}

// do runs one operation: start starts it (given the queue, the tag and where to put an
// immediate result) and returns the cgo call's code and status.
func (r *reactor) do(ctx context.Context, start func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t)) (C.isthmus_event_t, bool) {
	o := r.newOp()
	defer o.done()
	code, st := start(r.cq, C.uint64_t(o.tag), o.now)
	if ev, ok := o.started(code, st); ok {
		return ev, true
	}
	return o.wait(ctx)
}
