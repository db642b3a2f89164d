package isthmus

import (
	"math"
	"testing"
	"time"
)

// A deadline further than a time.Duration reaches (shm:// carries up to 584 years) is as far
// as one goes, not a time in the past: multiplied out, it overflowed, and the handler's
// context was done at once.
func TestAFarDeadlineIsNotInThePast(t *testing.T) {
	for _, us := range []int64{math.MaxInt64/1000 + 1, 1 << 60, math.MaxInt64} {
		if left := time.Until(deadlineIn(us)); left < 290*365*24*time.Hour {
			t.Errorf("%d µs: %v left", us, left)
		}
	}
	if left := time.Until(deadlineIn(1_500_000)); left <= 0 || left > 1500*time.Millisecond {
		t.Errorf("1.5 s: %v left", left)
	}
}
