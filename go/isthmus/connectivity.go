package isthmus

/*
#include "isthmus.h"
*/
import "C"

import (
	"context"

	"google.golang.org/grpc/connectivity"
)

// GetState returns the connection's connectivity state, as grpc-go's ClientConn.GetState:
// Idle until the first call (or Connect), Ready while a connection to the server is up,
// TransientFailure after an attempt to connect failed, Shutdown once closed.
func (cc *ClientConn) GetState() connectivity.State {
	return cc.state(false)
}

// Connect makes an Idle or failed connection start connecting in the background, retrying
// with backoff until it is Ready, as grpc-go's ClientConn.Connect. It does not wait.
func (cc *ClientConn) Connect() {
	cc.state(true)
}

func (cc *ClientConn) state(tryToConnect bool) connectivity.State {
	if !cc.use() {
		return connectivity.Shutdown
	}
	defer cc.unuse()
	try := C.int32_t(0)
	if tryToConnect {
		try = 1
	}
	var s C.uint32_t
	if C.isthmus_channel_state(cc.ch, try, &s) != C.ISTHMUS_OK {
		return connectivity.Shutdown // closed meanwhile: the handle is gone
	}
	return connectivity.State(s)
}

// WaitForStateChange waits until the connection's state is not sourceState, as grpc-go's
// ClientConn.WaitForStateChange: true when it changed, false if ctx ended first.
func (cc *ClientConn) WaitForStateChange(ctx context.Context, sourceState connectivity.State) bool {
	for {
		// The state first, as grpc-go's: a change already made is reported even if ctx is done.
		if cc.GetState() != sourceState {
			return true
		}
		if cc.closed.Load() {
			<-ctx.Done() // Shutdown is final
			return false
		}
		if ctx.Err() != nil {
			return false
		}
		// Waited for in the library through the reactor, with no thread held: any number of
		// goroutines may wait, and ctx's end abandons the wait at once.
		ev, ok := cc.r.do(ctx, func(cq *C.isthmus_cq_t, tag C.uint64_t, now *C.isthmus_event_t) (C.isthmus_code_t, *C.isthmus_status_t) {
			if !cc.use() {
				return C.ISTHMUS_CANCELLED, nil
			}
			defer cc.unuse()
			var st *C.isthmus_status_t
			return C.isthmus_channel_wait_state_async(cc.ch, C.uint32_t(sourceState), -1, cq, tag, now, &st), st
		})
		if !ok {
			return false // ctx ended first
		}
		if ev.status != nil {
			C.isthmus_status_free(ev.status)
		}
		switch ev.code {
		case C.ISTHMUS_OK:
			return true
		default:
			// Refused: the handle is gone (closed meanwhile; the next turn sees it), or
			// sourceState is no state, which the connection's then is not.
			if !cc.closed.Load() {
				return true
			}
		}
	}
}
