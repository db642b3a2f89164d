package isthmus_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// A topic served at a server-streaming method reaches a generated client's stream: the state
// first, then each message published while it is subscribed, in order; a client that leaves is
// gone from the topic; Close ends the others' streams OK.
func TestATopicReachesGeneratedClientsStreams(t *testing.T) {
	target, topic, s := topicServer(t, isthmus.TopicCapacity(8))
	defer s.Stop()
	if _, err := topic.PublishState(mustMarshal(t, &pb.EchoReply{Seq: 1})); err != nil {
		t.Fatal(err)
	}
	client := pb.NewEchoClient(dial(t, target))
	recv := func(stream pb.Echo_ServerStreamClient, want uint64) {
		t.Helper()
		m, err := stream.Recv()
		if err != nil || m.Seq != want {
			t.Fatalf("want seq %d, got %v, %v", want, m, err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first, err := client.ServerStream(ctx, &pb.StreamRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recv(first, 1) // the state: the server has the subscription now
	second, err := client.ServerStream(context.Background(), &pb.StreamRequest{})
	if err != nil {
		t.Fatal(err)
	}
	recv(second, 1)
	for seq := uint64(2); seq <= 4; seq++ {
		if n, err := topic.PublishMessage(&pb.EchoReply{Seq: seq}); n != 2 || err != nil {
			t.Fatalf("seq %d reached %d subscribers (%v), want 2", seq, n, err)
		}
	}
	for seq := uint64(2); seq <= 4; seq++ {
		recv(first, seq)
		recv(second, seq)
	}
	if got := topic.Stats(); got.Subscribers != 2 || got.Published != 4 || got.Delivered < 8 {
		t.Errorf("stats: %+v", got)
	}

	cancel()
	eventually(t, "the cancelled subscriber left", func() bool { return topic.Stats().Subscribers == 1 })
	topic.Close()
	if _, err := second.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("after Close, the stream ended with %v, want io.EOF", err)
	}
	if _, err := topic.Publish([]byte("late")); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Publish after Close: %v", err)
	}
	topic.Close() // a no-op
}

// A subscription never ends on its own, and GracefulStop waited for it for ever. Now the
// server's shutdown ends each subscription codes.Unavailable (go elsewhere) once what was
// published before has been sent, and GracefulStop returns.
func TestGracefulStopEndsSubscriptionsAfterWhatTheyQueued(t *testing.T) {
	target, topic, s := topicServer(t)
	defer s.Stop()
	client := pb.NewEchoClient(dial(t, target))
	stream, err := client.ServerStream(context.Background(), &pb.StreamRequest{})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "subscribed", func() bool { return topic.Stats().Subscribers == 1 })
	for seq := uint64(1); seq <= 3; seq++ {
		if n, err := topic.PublishMessage(&pb.EchoReply{Seq: seq}); n != 1 || err != nil {
			t.Fatalf("seq %d reached %d subscribers (%v), want 1", seq, n, err)
		}
	}
	stopped := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("GracefulStop is still waiting for the subscriber")
	}
	for seq := uint64(1); seq <= 3; seq++ {
		if m, err := stream.Recv(); err != nil || m.Seq != seq {
			t.Fatalf("want seq %d, got %v, %v", seq, m, err)
		}
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("after GracefulStop the stream ended with %v, want codes.Unavailable", err)
	}
	if got := topic.Stats().Subscribers; got != 0 {
		t.Errorf("%d subscribers left", got)
	}
}

// topicServer serves a new topic at the Echo service's ServerStream method on a shm:// target
// of its own; the target, the topic and the server.
// MaxSendMessageSize reaches the messages the library sends a topic's subscribers, as it does
// a handler's sends: a larger message ends the subscriber's call codes.ResourceExhausted with
// the size and the limit. A server with no limit, serving the same topic, gets the message.
// Before, the limited server sent it too.
func TestATopicMessageOverTheServersSendLimitEndsItsSubscriber(t *testing.T) {
	topic, err := isthmus.NewTopic("limited")
	if err != nil {
		t.Fatal(err)
	}
	defer topic.Close()
	serve := func(opts ...isthmus.ServerOption) pb.EchoClient {
		target := "shm://" + filepath.Join(t.TempDir(), "topic.sock")
		s := isthmus.NewServer(opts...)
		s.ServeTopic("/conformance.Echo/ServerStream", topic)
		if err := s.Start(target); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		return pb.NewEchoClient(dial(t, target))
	}
	limited, open := serve(isthmus.MaxSendMessageSize(64)), serve()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var streams []pb.Echo_ServerStreamClient
	for _, client := range []pb.EchoClient{limited, open} {
		stream, err := client.ServerStream(ctx, &pb.StreamRequest{})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, stream)
	}
	eventually(t, "both subscribed", func() bool { return topic.Stats().Subscribers == 2 })
	small, large := mustMarshal(t, &pb.EchoReply{Seq: 1}), mustMarshal(t, &pb.EchoReply{Seq: 2, Payload: make([]byte, 1000)})
	if n, err := topic.Publish(small); n != 2 || err != nil {
		t.Fatalf("the small message reached %d (%v), want 2", n, err)
	}
	if n, err := topic.Publish(large); n != 1 || err != nil {
		t.Fatalf("the large message reached %d (%v), want 1: the server with no limit", n, err)
	}
	for _, stream := range streams {
		if m, err := stream.Recv(); err != nil || m.Seq != 1 {
			t.Fatalf("want seq 1, got %v, %v", m, err)
		}
	}
	_, err = streams[0].Recv()
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), fmt.Sprintf("(%d vs. 64)", len(large))) {
		t.Errorf("the limited server's subscriber ended with %v, want ResourceExhausted naming (%d vs. 64)", err, len(large))
	}
	if m, err := streams[1].Recv(); err != nil || m.Seq != 2 {
		t.Errorf("the other subscriber: want seq 2, got %v, %v", m, err)
	}
	if got := topic.Stats().Subscribers; got != 1 {
		t.Errorf("%d subscribers left, want 1", got)
	}
}

func topicServer(t *testing.T, opts ...isthmus.TopicOption) (string, *isthmus.Topic, *isthmus.Server) {
	t.Helper()
	target := "shm://" + filepath.Join(t.TempDir(), "topic.sock")
	topic, err := isthmus.NewTopic("echoes", opts...)
	if err != nil {
		t.Fatal(err)
	}
	s := isthmus.NewServer()
	s.ServeTopic("/conformance.Echo/ServerStream", topic)
	if err := s.Start(target); err != nil {
		t.Fatal(err)
	}
	return target, topic, s
}

func mustMarshal(t *testing.T, m *pb.EchoReply) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A subscriber that reads nothing while far more is published than its window and queue hold
// loses messages, and goes on with the newer ones. With ResyncWithState too, when the state is
// older than those messages (a plain Publish came after it): sent again in their place, it took
// the subscriber back to seq 1 after messages up to 201.
func TestASlowSubscriberIsNeverResyncedWithAnOlderState(t *testing.T) {
	for _, resync := range []bool{true, false} {
		opts := []isthmus.TopicOption{isthmus.TopicCapacity(1)}
		if resync {
			opts = append(opts, isthmus.ResyncWithState())
		}
		target, topic, s := topicServer(t, opts...)
		if _, err := topic.PublishState(mustMarshal(t, &pb.EchoReply{Seq: 1})); err != nil {
			t.Fatal(err)
		}
		// A deadline, so that a stream that never brings 201 fails the test, not hangs it.
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		stream, err := pb.NewEchoClient(dial(t, target)).ServerStream(ctx, &pb.StreamRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if m, err := stream.Recv(); err != nil || m.Seq != 1 {
			t.Fatalf("the state first: %v, %v", m, err)
		}
		// 200 messages of 64 KiB: three times the 4 MiB window, unread.
		big := make([]byte, 64<<10)
		for seq := uint64(2); seq < 202; seq++ {
			if _, err := topic.PublishMessage(&pb.EchoReply{Seq: seq, Payload: big}); err != nil {
				t.Fatal(err)
			}
		}
		if topic.Stats().Dropped == 0 {
			t.Fatalf("resync %v: nothing dropped: %+v", resync, topic.Stats())
		}
		// Read on: the newest message (201) comes, and the state never again.
		states, last := 0, uint64(0)
		recv := func() {
			m, err := stream.Recv()
			if err != nil {
				t.Fatalf("resync %v: %v after seq %d", resync, err, last)
			}
			switch {
			case m.Seq == 1:
				states++
			case m.Seq <= last:
				t.Fatalf("resync %v: seq %d after %d", resync, m.Seq, last)
			default:
				last = m.Seq
			}
		}
		for last != 201 {
			recv()
		}
		// The stream goes on: a message published now comes next.
		if _, err := topic.PublishMessage(&pb.EchoReply{Seq: 1000}); err != nil {
			t.Fatal(err)
		}
		for last != 1000 {
			recv()
		}
		if states > 0 {
			t.Errorf("resync %v: the state (seq 1) came %d times more, after later messages", resync, states)
		}
		cancel()
		topic.Close()
		s.Stop()
	}
}

// A server asked to serve a closed topic fails to start, saying which path and why, in a
// status of codes.FailedPrecondition. It said only "FAILED_PRECONDITION".
func TestServingAClosedTopicFailsNamingIt(t *testing.T) {
	topic, err := isthmus.NewTopic("closed")
	if err != nil {
		t.Fatal(err)
	}
	topic.Close()
	shm, _ := fresh(t, "closed-topic")
	s := isthmus.NewServer()
	s.ServeTopic("/t.Feed/Watch", topic)
	err = s.Start(shm)
	if err == nil {
		s.Stop()
		t.Fatal("a server of a closed topic started")
	}
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), `ServeTopic("/t.Feed/Watch"): the topic is closed`) {
		t.Errorf("%v", err)
	}
}
