package isthmus

/*
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"time"

	"google.golang.org/grpc/connectivity"
)

// stateSlice bounds one wait in the library, so that a cancelled context ends
// WaitForStateChange within it (a cgo call cannot be interrupted).
const stateSlice = 50 * time.Millisecond

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
	if cc.closed.Load() {
		return connectivity.Shutdown
	}
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
		slice := stateSlice
		if d, ok := ctx.Deadline(); ok && time.Until(d) < slice {
			slice = max(time.Until(d), time.Millisecond)
		}
		var s C.uint32_t
		switch C.isthmus_channel_wait_state(cc.ch, C.uint32_t(sourceState), C.uint32_t(slice/time.Millisecond), &s) {
		case C.ISTHMUS_OK:
			return true
		case C.ISTHMUS_DEADLINE_EXCEEDED:
			continue
		default:
			// Refused: the handle is gone (closed meanwhile; the next turn sees it), or
			// sourceState is no state, which the connection's then is not.
			if !cc.closed.Load() {
				return true
			}
		}
	}
}
