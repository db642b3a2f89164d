package isthmus

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

// Reading a call's options is on every call's path: it allocates nothing, whatever options
// other than a forced codec the call has.
func TestParsingCallOptionsAllocatesNothing(t *testing.T) {
	var header, trailer metadata.MD
	var p peer.Peer
	for _, opts := range [][]grpc.CallOption{
		nil,
		{grpc.StaticMethod()},
		{grpc.StaticMethod(), grpc.Header(&header), grpc.Trailer(&trailer), grpc.Peer(&p), grpc.WaitForReady(true),
			grpc.MaxCallSendMsgSize(1 << 20), grpc.MaxCallRecvMsgSize(1 << 20), grpc.OnFinish(func(error) {}),
			grpc.CallContentSubtype("proto"), grpc.UseCompressor("identity")},
	} {
		var co callOptions
		if n := testing.AllocsPerRun(100, func() { co = parseCallOptions(opts) }); n != 0 {
			t.Errorf("%d options: %v allocations", len(opts), n)
		}
		if co.err != nil {
			t.Errorf("%d options: %v", len(opts), co.err)
		}
	}
}
