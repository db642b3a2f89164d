package isthmus

import (
	"math"
	"testing"
	"time"
)

// GracefulStop lets the calls in progress finish however long they take, as grpc-go's does:
// it asks the engine for the grace it takes as none (it gave them an hour, then cut them off).
// GracefulStopTimeout gives what it is told, a negative grace none (it wrapped to ~584 million
// years).
func TestGracefulStopWaitsForTheCallsWithoutALimit(t *testing.T) {
	var graces []uint64
	shutdownStarted = func(ms uint64) { graces = append(graces, ms) }
	t.Cleanup(func() { shutdownStarted = nil })
	NewServer().GracefulStop()
	NewServer().GracefulStopTimeout(1500 * time.Millisecond)
	NewServer().GracefulStopTimeout(-time.Second)
	want := []uint64{math.MaxUint64, 1500, 0}
	if len(graces) != len(want) {
		t.Fatalf("graces %v, want %v", graces, want)
	}
	for i := range want {
		if graces[i] != want[i] {
			t.Errorf("graces %v, want %v", graces, want)
			break
		}
	}
}
