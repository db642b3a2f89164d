package isthmus_test

import (
	"context"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/connectivity"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// reach waits (10 s at most), one change at a time, for conn to reach want; failing if it
// passes through never on the way.
func reach(t *testing.T, conn *isthmus.ClientConn, want, never connectivity.State) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for s := conn.GetState(); s != want; s = conn.GetState() {
		if s == never {
			t.Fatalf("%s on the way to %s", s, want)
		}
		if !conn.WaitForStateChange(ctx, s) {
			t.Fatalf("still %s after 10 s, not %s", s, want)
		}
	}
}

func TestConnectivityFollowsTheServer(t *testing.T) {
	shm, unix := fresh(t, "state")
	p := startPeer(t, goPeerBin, shm, unix)
	for _, target := range append([]string{shm}, p.addresses...) {
		t.Run(target, func(t *testing.T) {
			conn := dial(t, target)
			if s := conn.GetState(); s != connectivity.Idle {
				t.Fatalf("a new connection is %s, not Idle", s)
			}
			// Not asked to connect, it stays Idle: the wait ends with its context.
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			if conn.WaitForStateChange(ctx, connectivity.Idle) {
				t.Fatalf("an idle connection changed by itself, to %s", conn.GetState())
			}
			conn.Connect()
			reach(t, conn, connectivity.Ready, connectivity.Shutdown)
			if _, err := pb.NewEchoClient(conn).Unary(context.Background(), &pb.EchoRequest{}); err != nil {
				t.Fatal(err)
			}
			if s := conn.GetState(); s != connectivity.Ready {
				t.Fatalf("after a call the connection is %s, not Ready", s)
			}
		})
	}

	// The server goes away: the connections leave Ready.
	conns := map[string]*isthmus.ClientConn{}
	for _, target := range append([]string{shm}, p.addresses...) {
		conn := dial(t, target)
		if _, err := pb.NewEchoClient(conn).Unary(context.Background(), &pb.EchoRequest{}); err != nil {
			t.Fatal(err)
		}
		conns[target] = conn
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	p.cmd.Wait()
	for target, conn := range conns {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if conn.GetState() == connectivity.Ready && !conn.WaitForStateChange(ctx, connectivity.Ready) {
			t.Errorf("%s: still Ready 10 s after its server was killed", target)
		}
		cancel()
		if s := conn.GetState(); s == connectivity.Ready || s == connectivity.Shutdown {
			t.Errorf("%s: %s after its server was killed", target, s)
		}
		conn.Close()
		if s := conn.GetState(); s != connectivity.Shutdown {
			t.Errorf("%s: %s after Close, not Shutdown", target, s)
		}
		if !conn.WaitForStateChange(context.Background(), connectivity.Ready) {
			t.Errorf("%s: closed, a wait on Ready did not end", target)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
		if conn.WaitForStateChange(ctx, connectivity.Shutdown) {
			t.Errorf("%s: Shutdown changed", target)
		}
		cancel()
	}
}

func TestConnectingToNobodyIsATransientFailure(t *testing.T) {
	shm, _ := fresh(t, "nobody")
	conn := dial(t, shm)
	conn.Connect()
	reach(t, conn, connectivity.TransientFailure, connectivity.Ready)
}

func TestClosingEndsAWaitForAStateChange(t *testing.T) {
	shm, _ := fresh(t, "closewait")
	conn := dial(t, shm)
	ended := make(chan bool, 1)
	go func() { ended <- conn.WaitForStateChange(context.Background(), connectivity.Idle) }()
	time.Sleep(20 * time.Millisecond) // most likely waiting; the outcome is the same either way
	conn.Close()
	select {
	case changed := <-ended:
		if !changed {
			t.Fatal("the wait said the state did not change")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("closing did not end the wait")
	}
	if s := conn.GetState(); s != connectivity.Shutdown {
		t.Fatalf("%s after Close", s)
	}
}

// Goroutines waiting for a state change hold no OS thread each (they wait in the reactor, as
// calls do): 200 of them start few threads, and all hear the change once it comes. A wait
// inside a cgo call would hold one thread per goroutine.
func TestWaitingForAStateChangeHoldsNoThread(t *testing.T) {
	shm, _ := fresh(t, "waiters") // nobody serves it: the connection stays Idle until asked
	conn := dial(t, shm)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const waiters = 200
	threads := pprof.Lookup("threadcreate")
	before := threads.Count()
	var wg sync.WaitGroup
	var changed, waiting atomic.Int32
	for i := 0; i < waiters; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			waiting.Add(1)
			if conn.WaitForStateChange(ctx, connectivity.Idle) {
				changed.Add(1)
			}
		}()
	}
	for waiting.Load() < waiters {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // into their waits
	if grew := threads.Count() - before; grew > waiters/4 {
		t.Fatalf("%d goroutines waiting for a state change started %d threads", waiters, grew)
	}
	if n := changed.Load(); n != 0 {
		t.Fatalf("%d waits ended with no change", n)
	}
	conn.Connect()
	wg.Wait()
	if n := changed.Load(); n != waiters {
		t.Fatalf("%d of %d waits heard the change", n, waiters)
	}
}
