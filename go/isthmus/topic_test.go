package isthmus_test

import (
	"context"
	"errors"
	"io"
	"path/filepath"
	"testing"

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
	target := "shm://" + filepath.Join(t.TempDir(), "topic.sock")
	topic, err := isthmus.NewTopic("echoes", isthmus.TopicCapacity(8))
	if err != nil {
		t.Fatal(err)
	}
	s := isthmus.NewServer()
	s.ServeTopic("/conformance.Echo/ServerStream", topic)
	if err := s.Start(target); err != nil {
		t.Fatal(err)
	}
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

func mustMarshal(t *testing.T, m *pb.EchoReply) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
