package isthmus_test

import (
	"context"
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
	c := pb.NewEchoClient(dial(b, shm))
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
