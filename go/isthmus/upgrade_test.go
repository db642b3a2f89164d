package isthmus_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// shmCallsWithin makes calls on a connection dialled with opts until one goes over shared
// memory (TransportStats counts the calls of the shm:// connection it moved to) or d passes;
// the shm:// calls counted, and how long it took.
func shmCallsWithin(t *testing.T, target string, d time.Duration, opts ...isthmus.DialOption) (uint64, time.Duration) {
	t.Helper()
	conn, err := isthmus.Dial(target, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := pb.NewEchoClient(conn)
	began := time.Now()
	for time.Since(began) < d {
		if _, err := client.Unary(context.Background(), &pb.EchoRequest{Payload: []byte("where")}); err != nil {
			t.Fatalf("%s: %v", target, err)
		}
		if n := conn.TransportStats().CallsStarted; n > 0 {
			return n, time.Since(began)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return 0, time.Since(began)
}

// checkUpgrade checks WithUpgrade against a server on target (an HTTP/2 address of an isthmus
// server that also serves shm://), in a process whose default is defaultOn.
func checkUpgrade(t *testing.T, target string, defaultOn bool) {
	n, took := shmCallsWithin(t, target, 30*time.Second, isthmus.WithUpgrade(true))
	if n == 0 {
		t.Fatalf("WithUpgrade(true): no call over shm:// within %v", took)
	}
	// What never moves is watched for three times as long as moving took, and 1 s more.
	watch := 3*took + time.Second
	if n, _ := shmCallsWithin(t, target, watch, isthmus.WithUpgrade(false)); n != 0 {
		t.Errorf("WithUpgrade(false): %d calls over shm://", n)
	}
	limit := watch
	if defaultOn {
		limit = 30 * time.Second
	}
	if n, _ := shmCallsWithin(t, target, limit); (n > 0) != defaultOn {
		t.Errorf("no option, ISTHMUS_UPGRADE=%q: %d calls over shm://", os.Getenv("ISTHMUS_UPGRADE"), n)
	}
}

// WithUpgrade overrules the process's default both ways: here (make test sets ISTHMUS_UPGRADE=0)
// and in a child process of this test binary with ISTHMUS_UPGRADE=1, both against a Go server
// in a third process. Under ISTHMUS_UPGRADE=0 the child is the test of WithUpgrade(false).
func TestWithUpgradeOverrulesTheProcessDefault(t *testing.T) {
	if target := os.Getenv("ISTHMUS_TEST_UPGRADE_TARGET"); target != "" {
		checkUpgrade(t, target, true)
		return
	}
	shm, unix := fresh(t, "upgrade")
	p := startPeer(t, goPeerBin, shm, unix)
	target := p.addresses[0]
	// As the library reads ISTHMUS_UPGRADE (make test sets 0).
	switch strings.ToLower(os.Getenv("ISTHMUS_UPGRADE")) {
	case "0", "off", "false":
		checkUpgrade(t, target, false)
	default:
		checkUpgrade(t, target, true)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	child := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestWithUpgradeOverrulesTheProcessDefault$", "-test.count=1")
	child.Env = append(os.Environ(), "ISTHMUS_UPGRADE=1", "ISTHMUS_TEST_UPGRADE_TARGET="+target)
	out, err := child.CombinedOutput()
	if err != nil {
		t.Fatalf("the child with ISTHMUS_UPGRADE=1: %v\n%s", err, out)
	}
}

// A connection's first calls go over HTTP/2 while its probe runs, where a server takes 4 MiB
// unless told otherwise (ADR 0034): a unary request larger than that waits for the probe and
// goes over shm:// (it failed codes.ResourceExhausted).
func TestAFirstRequestTooLargeForHTTP2WaitsForTheMove(t *testing.T) {
	shm, unix := fresh(t, "upgrade-large")
	p := startPeer(t, goPeerBin, shm, unix)
	conn, err := isthmus.Dial(p.addresses[0], isthmus.WithUpgrade(true))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	payload := make([]byte, 8<<20)
	for i := range payload {
		payload[i] = byte(i)
	}
	reply, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{Payload: payload})
	if err != nil {
		t.Fatalf("the first call: %v", err)
	}
	if !bytes.Equal(reply.GetPayload(), payload) {
		t.Fatal("the echo differs")
	}
	if n := conn.TransportStats().CallsStarted; n != 1 {
		t.Fatalf("calls over shm://: %d, want 1", n)
	}
}
