package isthmus

import (
	"context"
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

// outgoingRaw (a linkname into grpc's metadata package, which no compiler checks) gives the
// outgoing metadata with the keys as the caller wrote them, and the pairs appended since
// (AppendToOutgoingContext lowercases those).
func TestOutgoingRawReadsTheCallersKeys(t *testing.T) {
	ctx := metadata.NewOutgoingContext(context.Background(), metadata.MD{"Key": {"v"}})
	ctx = metadata.AppendToOutgoingContext(ctx, "Added", "w")
	md, added, ok := outgoingRaw(ctx)
	if !ok || len(md["Key"]) != 1 || md["Key"][0] != "v" {
		t.Fatalf("got %v, %v: want the literal's key as written", md, ok)
	}
	if len(added) != 1 || len(added[0]) != 2 || added[0][0] != "added" || added[0][1] != "w" {
		t.Fatalf("added %v: want [[added w]]", added)
	}
	if _, _, ok := outgoingRaw(context.Background()); ok {
		t.Fatal("a context with no outgoing metadata has some")
	}
}
