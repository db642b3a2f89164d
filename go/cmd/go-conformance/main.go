// Command go-conformance runs the Go conformance checks (a protoc-gen-go-grpc client on an
// isthmus connection) against an Echo server at each target given: `go-conformance TARGET…`.
// It prints one line per check and ends with `N passed, M failed`; it exits 1 if any failed.
//
// `go-conformance --killed TARGET…` checks what a server's death does to its calls instead: it
// starts one Unary call that sleeps in its handler (seq 1, 2, … by target) on each target, prints
// READY, and whoever runs it kills the server (SIGKILL) once the server has said that each handler sleeps.
// Each call must then end codes.Unavailable, and a next call on its connection too; how soon
// is for the killer to judge (this waits at most a minute, in case nobody kills).
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"example.invalid/isthmus/go/internal/conformance"
	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

func main() {
	var passed, failed int
	report := func(target, name string, err error) {
		if err != nil {
			fmt.Printf("FAIL %s: %s: %v\n", target, name, err)
			failed++
		} else {
			fmt.Printf("ok   %s: %s\n", target, name)
			passed++
		}
	}
	if len(os.Args) > 1 && os.Args[1] == "--killed" {
		killed(os.Args[2:], report)
	} else {
		for _, target := range os.Args[1:] {
			conn, err := isthmus.Dial(target)
			if err != nil {
				report(target, "dial", err)
				continue
			}
			conformance.Run(context.Background(), conn, func(name string, err error) { report(target, name, err) })
			conn.Close()
		}
	}
	fmt.Printf("%d passed, %d failed\n", passed, failed)
	if failed > 0 || passed == 0 {
		os.Exit(1)
	}
}

// killed is the --killed mode (see the command's documentation).
func killed(targets []string, report func(target, name string, err error)) {
	type inFlight struct {
		target string
		client pb.EchoClient
		ended  chan error
	}
	var calls []inFlight
	for i, target := range targets {
		conn, err := isthmus.Dial(target)
		if err != nil {
			report(target, "dial", err)
			continue
		}
		defer conn.Close()
		c := pb.NewEchoClient(conn)
		if _, err := c.Unary(context.Background(), &pb.EchoRequest{}); err != nil {
			report(target, "a call before the kill", err)
			continue
		}
		ended := make(chan error, 1)
		go func(seq uint64) {
			_, err := c.Unary(context.Background(), &pb.EchoRequest{Seq: seq, SleepMs: 600_000})
			ended <- err
		}(uint64(i + 1))
		calls = append(calls, inFlight{target, c, ended})
	}
	fmt.Println("READY") // the calls are on their way
	for _, call := range calls {
		// A watchdog, not a timing check: the end must come, and soon, not at some timeout.
		var err error
		select {
		case err = <-call.ended:
		case <-time.After(time.Minute):
			err = fmt.Errorf("did not end (was the server killed?)")
		}
		report(call.target, "the call in flight when the server was killed", unavailable(err))
		_, err = call.client.Unary(context.Background(), &pb.EchoRequest{})
		report(call.target, "a call after the kill", unavailable(err))
	}
}

// unavailable is nil if err is codes.Unavailable, else what it is instead.
func unavailable(err error) error {
	if status.Code(err) == codes.Unavailable {
		return nil
	}
	return fmt.Errorf("got %v, want Unavailable", err)
}
