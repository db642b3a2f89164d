package isthmus_test

import (
	"context"
	"os"
	"testing"

	pb "example.invalid/isthmus/go/internal/conformancepb"
)

// BenchmarkBidiPingPong is one message each way on an open bidi stream over shm://, against
// the Go server (go-peer): the cost of a stream's receive (run with -bench; not part of the
// tests). With a release library: CGO_LDFLAGS="-L$PWD/../target/release
// -Wl,-rpath,$PWD/../target/release" go test -run '^$' -bench BidiPingPong ./isthmus/
func BenchmarkBidiPingPong(b *testing.B) {
	shm, _ := fresh(b, "pingpong")
	startPeer(b, goPeerBin, shm)
	pingPong(b, pb.NewEchoClient(dial(b, shm)))
}

// pingPong sends one message and receives one, b.N times, on one bidi stream.
func pingPong(b *testing.B, c pb.EchoClient) {
	s, err := c.Bidi(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := s.Send(&pb.EchoRequest{Seq: uint64(i)}); err != nil {
			b.Fatal(err)
		}
		if _, err := s.Recv(); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	s.CloseSend()
}

// BenchmarkBidiPingPongTonic is BenchmarkBidiPingPong against the Rust tonic-peer
// (ISTHMUS_TONIC_PEER), whose handler runs on tokio: what the Go client's side costs.
func BenchmarkBidiPingPongTonic(b *testing.B) {
	bin := os.Getenv("ISTHMUS_TONIC_PEER")
	if bin == "" {
		b.Skip("ISTHMUS_TONIC_PEER is not set")
	}
	shm, _ := fresh(b, "pingpong-tonic")
	startPeer(b, bin, shm)
	pingPong(b, pb.NewEchoClient(dial(b, shm)))
}
