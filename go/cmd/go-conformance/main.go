// Command go-conformance runs the Go conformance checks (a protoc-gen-go-grpc client on an
// isthmus connection) against an Echo server at each target given: `go-conformance TARGET…`.
// It prints one line per check and ends with `N passed, M failed`; it exits 1 if any failed.
package main

import (
	"context"
	"fmt"
	"os"

	"example.invalid/isthmus/go/internal/conformance"
	"example.invalid/isthmus/go/isthmus"
)

func main() {
	var passed, failed int
	for _, target := range os.Args[1:] {
		conn, err := isthmus.Dial(target)
		if err != nil {
			fmt.Printf("FAIL %s: dial: %v\n", target, err)
			failed++
			continue
		}
		p, f := conformance.Run(context.Background(), conn, func(name string, err error) {
			if err != nil {
				fmt.Printf("FAIL %s: %s: %v\n", target, name, err)
			} else {
				fmt.Printf("ok   %s: %s\n", target, name)
			}
		})
		passed, failed = passed+p, failed+f
		conn.Close()
	}
	fmt.Printf("%d passed, %d failed\n", passed, failed)
	if failed > 0 || passed == 0 {
		os.Exit(1)
	}
}
