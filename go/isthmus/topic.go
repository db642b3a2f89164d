package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Topic pushes messages to many subscribers (docs/adr/0016): a server serves it at a method
// path (Server.ServeTopic), each server-streaming call to that path is a subscriber, and
// Publish reaches every current one with one write into shared memory. Publish never waits for
// a subscriber: each has a queue (TopicCapacity), and one whose queue is full loses its oldest
// message (counted in TopicStats.Dropped; ResyncWithState sends it the state then), or its call
// (CancelSlowSubscribers). Safe for concurrent use.
type Topic struct {
	mu     sync.RWMutex // Close takes it to free h while no publish uses it
	h      *C.isthmus_topic_t
	closed bool
}

// TopicOption configures a Topic.
type TopicOption func(*C.isthmus_topic_options_t)

// TopicCapacity sets how many messages each subscriber's queue holds (default 64); n of 0 or
// less keeps the default.
func TopicCapacity(n int) TopicOption {
	return func(o *C.isthmus_topic_options_t) {
		if n > 0 {
			o.capacity = C.uint32_t(min(n, 1<<31))
		}
	}
}

// CancelSlowSubscribers ends the call of a subscriber whose queue is full with
// codes.ResourceExhausted, instead of dropping its oldest message.
func CancelSlowSubscribers() TopicOption {
	return func(o *C.isthmus_topic_options_t) { o.flags |= C.ISTHMUS_TOPIC_CANCEL_SLOW }
}

// ResyncWithState makes a subscriber whose queue overflowed (messages were dropped for it)
// drop what is still queued for it and receive the topic's state (PublishState) in its place,
// a resync. With no state, or one a plain Publish came after (sent again, it would take the
// subscriber back past those messages), it goes on with what is queued.
func ResyncWithState() TopicOption {
	return func(o *C.isthmus_topic_options_t) { o.flags |= C.ISTHMUS_TOPIC_RESYNC_STATE }
}

// TopicStats are a topic's counters.
type TopicStats struct {
	// Subscribers counts the subscribers now.
	Subscribers uint64
	// Published counts the messages published, and Bytes their bytes (each message once).
	Published, Bytes uint64
	// Delivered counts the messages sent to subscribers, one per subscriber reached.
	Delivered uint64
	// Dropped counts the messages dropped from full queues.
	Dropped uint64
	// Cancelled counts the subscribers ended for falling behind (CancelSlowSubscribers).
	Cancelled uint64
}

// NewTopic makes a topic; name is for logs. Close it when done.
func NewTopic(name string, opts ...TopicOption) (*Topic, error) {
	var o C.isthmus_topic_options_t
	for _, f := range opts {
		f(&o)
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	t := &Topic{}
	var st *C.isthmus_status_t
	if code := C.isthmus_topic_new(cname, &o, &t.h, &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return nil, err
	}
	// A topic dropped unclosed frees its handle; a server that serves it keeps serving it.
	runtime.SetFinalizer(t, func(t *Topic) { C.isthmus_topic_free(t.h) })
	return t, nil
}

// Publish sends p to every current subscriber and returns how many it reached. p is copied
// before it returns. A closed topic publishes nothing and returns an error.
func (t *Topic) Publish(p []byte) (int, error) { return t.publish(p, false) }

// PublishState is Publish that also keeps p as the topic's state, which every later
// subscriber gets first.
func (t *Topic) PublishState(p []byte) (int, error) { return t.publish(p, true) }

// PublishMessage is Publish of m marshalled: what a generated client's stream receives.
func (t *Topic) PublishMessage(m proto.Message) (int, error) {
	p, err := proto.Marshal(m)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "marshalling the message: %v", err)
	}
	return t.publish(p, false)
}

func (t *Topic) publish(p []byte, keep bool) (int, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return 0, status.Error(codes.FailedPrecondition, "isthmus: the topic is closed")
	}
	var reached C.size_t
	var st *C.isthmus_status_t
	var code C.isthmus_code_t
	if keep {
		code = C.isthmus_topic_publish_state(t.h, bytesPtr(p), C.size_t(len(p)), &reached, &st)
	} else {
		code = C.isthmus_topic_publish(t.h, bytesPtr(p), C.size_t(len(p)), &reached, &st)
	}
	runtime.KeepAlive(p)
	if code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return 0, err
	}
	return int(reached), nil
}

// ClearState forgets the topic's state: later subscribers get none.
func (t *Topic) ClearState() {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if !t.closed {
		C.isthmus_topic_clear_state(t.h)
	}
}

// Close ends every subscription with OK after what it has queued (later subscribers' calls end
// OK at once) and frees the topic. Closing twice is a no-op.
func (t *Topic) Close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	t.closed = true
	runtime.SetFinalizer(t, nil)
	C.isthmus_topic_close(t.h)
	C.isthmus_topic_free(t.h)
}

// Stats returns the topic's counters (zero once it is closed).
func (t *Topic) Stats() TopicStats {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var c C.isthmus_topic_stats_t
	if t.closed || C.isthmus_topic_stats(t.h, &c, C.size_t(unsafe.Sizeof(c))) != C.ISTHMUS_OK {
		return TopicStats{}
	}
	return TopicStats{
		Subscribers: uint64(c.subscribers),
		Published:   uint64(c.published),
		Bytes:       uint64(c.bytes),
		Delivered:   uint64(c.delivered),
		Dropped:     uint64(c.dropped),
		Cancelled:   uint64(c.cancelled),
	}
}

// ServeTopic serves t at path (`/package.Service/Method`, a server-streaming method): each
// call to it subscribes, gets the topic's state if it has one, then every message published
// while it is subscribed, until its client cancels or goes away, or the topic closes, or the
// server stops: a GracefulStop ends each subscription codes.Unavailable once what was queued
// for it is sent, and does not wait for subscribers. A message over the server's
// MaxSendMessageSize ends that subscriber's call codes.ResourceExhausted, and only that one.
// The request is not read. The library serves these calls itself: server interceptors and
// stats handlers do not see them. Before Serve only.
func (s *Server) ServeTopic(path string, t *Topic) {
	s.register(&method{name: path, topic: t}, "ServeTopic")
}

// addTopic registers m's topic with the library's server, whose MaxSendMessageSize (0: none)
// the library applies to the messages it sends the topic's subscribers. A closed topic (its
// handle freed) fails Start, naming the path: it said only "FAILED_PRECONDITION".
func addTopic(srv *C.isthmus_server_t, path *C.char, t *Topic, maxSend uint64) error {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return status.Errorf(codes.FailedPrecondition, "isthmus: ServeTopic(%q): the topic is closed", C.GoString(path))
	}
	var st *C.isthmus_status_t
	if code := C.isthmus_server_add_topic_limited(srv, path, t.h, C.uint64_t(maxSend), &st); code != C.ISTHMUS_OK {
		err, _ := statusError(code, st)
		return err
	}
	return nil
}
