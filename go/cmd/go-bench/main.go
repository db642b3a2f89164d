// Command go-bench measures Go over isthmus beside grpc-go over a Unix socket, each client and
// server in its own process, and writes the records into docs/bench/results.json:
//
//	go-isthmus-shm   a protoc-gen-go-grpc client → a Go server on isthmus.NewServer, shm://,
//	                 whose unary handlers run on the connection's reader (InlineUnary)
//	go-isthmus-shm-goroutines  the same with NewServer's defaults: each handler on a
//	                 goroutine, as grpc-go runs them (64 B and 1 KiB)
//	go-isthmus-raw   the raw tier: the request written into an allocated block, read by the
//	                 server as a view; the reply written into a block, read by the client as a
//	                 view (a raw unary call: Alloc, CallRawBlock, HandleRawUnary)
//	go-isthmus-raw-stream  the same echo as a raw stream (StartRaw, SendBlock, Recv; 64 B and
//	                 1 KiB)
//	go-grpc-uds      grpc-go client → grpc-go server over a Unix socket, at its best
//	                 documented settings (64 MiB stream and connection windows, 1 MiB read
//	                 and write buffers)
//	go-memcpy        one copy of the payload within this process (Go's copy, a memmove)
//	go-cgo-call      one empty cgo call (size 0, p50_us is its cost)
//	go-client-engine-server  the go-isthmus-shm client against the Rust engine's echo server
//	                 (isthmus-bench serve-isthmus, found in target/release beside this
//	                 binary's directory, or at $ISTHMUS_BENCH; skipped if neither is there):
//	                 a Go-to-Go figure's client side alone (64 B and 1 KiB)
//
// Usage: go-bench run [-quick] [-rounds N] [-out results.json]; the serve-* modes are the
// server processes it starts itself. go-bench load SYSTEM SIZE INFLIGHT SECONDS runs one
// system alone, for a profiler (perf, pprof) to watch; it prints the record and writes none.
// A SYSTEM ending in -deadline gives each of its calls a deadline, as run does for those rows.
// With GO_BENCH_SERVER_CPUPROFILE=FILE a Go server it starts writes its CPU profile there when
// it stops (go tool pprof -top target/go-bin-release/go-bench FILE): meant for load, which
// starts one server; under run each server's profile replaces the last one's.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

const (
	rawEcho       = "/bench.Raw/Echo"
	rawEchoStream = "/bench.Raw/EchoStream"
)

// The settings grpc-go documents for throughput: large flow-control windows (set, they also
// turn off its BDP estimation) and large read and write buffers.
const (
	grpcWindow = 64 << 20
	grpcBuffer = 1 << 20
	maxMessage = 64 << 20
)

type echoServer struct{ pb.UnimplementedEchoServer }

func (echoServer) Unary(_ context.Context, r *pb.EchoRequest) (*pb.EchoReply, error) {
	return &pb.EchoReply{Payload: r.Payload, Seq: r.Seq}, nil
}

func waitForSignal() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	// A server's CPU profile, for pprof, when $GO_BENCH_SERVER_CPUPROFILE names a file.
	if path := os.Getenv("GO_BENCH_SERVER_CPUPROFILE"); path != "" {
		if f, err := os.Create(path); err == nil {
			defer f.Close()
			if pprof.StartCPUProfile(f) == nil {
				defer pprof.StopCPUProfile() // before the Close above
			}
		}
	}
	<-ch
}

// serveIsthmus serves the echo; inline runs its unary handlers on the connection's reader
// (InlineUnary), else they run on goroutines as NewServer's do by default.
func serveIsthmus(target string, inline bool) {
	opts := []isthmus.ServerOption{isthmus.MaxMessageSize(maxMessage)}
	if inline {
		// Its handlers answer at once, what InlineUnary is for (see its documentation).
		opts = append(opts, isthmus.InlineUnary())
	}
	s := isthmus.NewServer(opts...)
	pb.RegisterEchoServer(s, echoServer{})
	s.HandleRawUnary(rawEcho, echo.RawEcho)
	s.HandleRaw(rawEchoStream, echo.RawEchoStream)
	if err := s.Start(target); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println("READY")
	waitForSignal()
	s.Stop()
}

func serveGrpc(path string) {
	os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	s := grpc.NewServer(
		grpc.InitialWindowSize(grpcWindow), grpc.InitialConnWindowSize(grpcWindow),
		grpc.ReadBufferSize(grpcBuffer), grpc.WriteBufferSize(grpcBuffer),
		grpc.MaxRecvMsgSize(maxMessage+1024), grpc.MaxSendMsgSize(maxMessage+1024),
	)
	pb.RegisterEchoServer(s, echoServer{})
	go s.Serve(l)
	fmt.Println("READY")
	waitForSignal()
	s.Stop()
}

// record is one row of results.json.
type record struct {
	System   string  `json:"system"`
	Size     int     `json:"size"`
	Inflight int     `json:"inflight"`
	P50      float64 `json:"p50_us"`
	P99      float64 `json:"p99_us"`
	RPS      float64 `json:"rps"`
	Round    int     `json:"round"`
}

// caller makes one echo of a payload and checks it.
type caller func(ctx context.Context, payload []byte) error

func protoCaller(c pb.EchoClient) caller {
	return func(ctx context.Context, payload []byte) error {
		r, err := c.Unary(ctx, &pb.EchoRequest{Payload: payload})
		if err == nil && len(r.Payload) != len(payload) {
			err = fmt.Errorf("reply of %d bytes for %d", len(r.Payload), len(payload))
		}
		return err
	}
}

// toEngineEcho carries a generated client's unary calls to the Rust engine's echo
// (isthmus-bench's `/bench.Echo/Unary`), which returns a request's bytes as they came: an
// EchoRequest's payload comes back as an EchoReply's, the same field.
type toEngineEcho struct{ *isthmus.ClientConn }

func (c toEngineEcho) Invoke(ctx context.Context, _ string, args, reply any, opts ...grpc.CallOption) error {
	return c.ClientConn.Invoke(ctx, "/bench.Echo/Unary", args, reply, opts...)
}

// system is a named way to make one echo.
type system struct {
	name string
	call caller
}

// withDeadline gives each call a context with a 10 s deadline, as most real code does: a
// context that can be cancelled takes isthmus's non-blocking path.
func withDeadline(call caller) caller {
	return func(ctx context.Context, payload []byte) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return call(ctx, payload)
	}
}

// memcpyCaller copies the payload once into a buffer kept between calls (warm, as a copy into
// an arena block is).
func memcpyCaller() caller {
	var dst []byte
	return func(_ context.Context, payload []byte) error {
		if len(dst) < len(payload) {
			dst = make([]byte, len(payload))
		}
		copy(dst, payload)
		return nil
	}
}

// rawCaller writes the request into a block of shared memory and reads the reply where it
// lies (a raw unary call).
func rawCaller(conn *isthmus.ClientConn) caller {
	return func(ctx context.Context, payload []byte) error {
		b, err := conn.Alloc(ctx, len(payload))
		if err != nil {
			return err
		}
		if _, err := b.WriteAt(payload, 0); err != nil {
			b.Release()
			return err
		}
		m, err := conn.CallRawBlock(ctx, rawEcho, b)
		if err != nil {
			return err
		}
		n := len(m.Bytes())
		m.Release()
		if n != len(payload) {
			return fmt.Errorf("reply of %d bytes for %d", n, len(payload))
		}
		return nil
	}
}

// rawStreamCaller makes the same echo as a raw stream (StartRaw, Alloc, SendBlock, Recv).
func rawStreamCaller(conn *isthmus.ClientConn) caller {
	return func(ctx context.Context, payload []byte) error {
		s, err := conn.StartRaw(ctx, rawEchoStream)
		if err != nil {
			return err
		}
		b, err := s.Alloc(len(payload))
		if err != nil {
			return err
		}
		if _, err := b.WriteAt(payload, 0); err != nil {
			b.Release()
			return err
		}
		if err := s.SendBlock(b, true); err != nil {
			return err
		}
		m, err := s.Recv()
		if err != nil {
			return err
		}
		n := len(m.Bytes())
		m.Release()
		if _, err := s.Recv(); err != io.EOF {
			return fmt.Errorf("after the reply: %v", err)
		}
		if n != len(payload) {
			return fmt.Errorf("reply of %d bytes for %d", n, len(payload))
		}
		return nil
	}
}

func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p * float64(len(sorted)-1))
	return float64(sorted[i].Nanoseconds()) / 1000
}

// measure runs call with inflight callers for about d (and at least minCalls calls).
func measure(call caller, size, inflight int, d time.Duration, minCalls int) (record, error) {
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = byte(i)
	}
	ctx := context.Background()
	warm := max(minCalls/10, 3)
	for i := 0; i < warm; i++ {
		if err := call(ctx, payload); err != nil {
			return record{}, err
		}
	}
	var mu sync.Mutex
	var all []time.Duration
	var firstErr error
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < inflight; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, 4096)
			for i := 0; time.Since(start) < d || i*inflight < minCalls; i++ {
				t := time.Now()
				if err := call(ctx, payload); err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
					return
				}
				lat = append(lat, time.Since(t))
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return record{}, firstErr
	}
	sort.Slice(all, func(i, j int) bool { return all[i] < all[j] })
	return record{Size: size, Inflight: inflight, P50: percentile(all, 0.5), P99: percentile(all, 0.99), RPS: float64(len(all)) / elapsed.Seconds()}, nil
}

// start starts this binary in a serve mode and waits for READY.
func start(mode, target string) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return startCommand(exec.Command(self, mode, target), mode)
}

// startEngineServer starts the Rust engine's echo server (isthmus-bench serve-isthmus) on
// target and waits for READY.
func startEngineServer(target string) (*exec.Cmd, error) {
	bin := os.Getenv("ISTHMUS_BENCH")
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		bin = filepath.Join(filepath.Dir(self), "..", "release", "isthmus-bench")
	}
	return startCommand(exec.Command(bin, "serve-isthmus", target), "isthmus-bench serve-isthmus")
}

// startCommand starts cmd, a server that prints READY once it serves, and waits for that.
func startCommand(cmd *exec.Cmd, mode string) (*exec.Cmd, error) {
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	buf := make([]byte, 6)
	if _, err := io.ReadFull(out, buf); err != nil || string(buf) != "READY\n" {
		cmd.Process.Kill()
		return nil, fmt.Errorf("%s did not start: %v", mode, err)
	}
	return cmd, nil
}

func stop(cmd *exec.Cmd) {
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

// cgoCall is the cost of one empty cgo call, in µs.
func cgoCall() float64 {
	const n = 2_000_000
	t := time.Now()
	for i := 0; i < n; i++ {
		isthmus.ABIVersion()
	}
	return float64(time.Since(t).Nanoseconds()) / n / 1000
}

func run(quick bool, rounds int, out string) error {
	dir, err := os.MkdirTemp("", "isthmus-go-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	shm := fmt.Sprintf("shm://go-bench-%d", os.Getpid())
	sock := filepath.Join(dir, "grpc.sock")
	isrv, err := start("serve-isthmus", shm)
	if err != nil {
		return err
	}
	defer stop(isrv)
	dshm := shm + "-default"
	dsrv, err := start("serve-isthmus-default", dshm)
	if err != nil {
		return err
	}
	defer stop(dsrv)
	gsrv, err := start("serve-grpc", sock)
	if err != nil {
		return err
	}
	defer stop(gsrv)

	iconn, err := isthmus.Dial(shm, isthmus.WithMaxMessageSize(maxMessage+1024))
	if err != nil {
		return err
	}
	defer iconn.Close()
	dconn, err := isthmus.Dial(dshm)
	if err != nil {
		return err
	}
	defer dconn.Close()
	gconn, err := grpcClient(sock)
	if err != nil {
		return err
	}
	defer gconn.Close()
	// The Go client against the Rust engine's echo server, where isthmus-bench is built.
	var engineCall caller
	// A path in dir, so that the socket goes with it: the Rust server leaves it behind when it
	// is stopped.
	eshm := "shm://" + filepath.Join(dir, "engine.sock")
	if esrv, err := startEngineServer(eshm); err != nil {
		fmt.Fprintln(os.Stderr, "go-bench: no go-client-engine-server:", err)
	} else {
		defer stop(esrv)
		econn, err := isthmus.Dial(eshm)
		if err != nil {
			return err
		}
		defer econn.Close()
		engineCall = protoCaller(pb.NewEchoClient(toEngineEcho{econn}))
	}
	systems := []system{
		{"go-memcpy", memcpyCaller()},
		{"go-isthmus-shm", protoCaller(pb.NewEchoClient(iconn))},
		{"go-isthmus-raw", rawCaller(iconn)},
		{"go-grpc-uds", protoCaller(pb.NewEchoClient(gconn))},
	}
	// 64 B and 1 KiB only: the same unary calls with a deadline on each, the raw echo as a
	// stream, the server with NewServer's defaults, and the client against the engine's echo.
	deadlined := []system{
		{"go-isthmus-shm-deadline", withDeadline(protoCaller(pb.NewEchoClient(iconn)))},
		{"go-grpc-uds-deadline", withDeadline(protoCaller(pb.NewEchoClient(gconn)))},
		{"go-isthmus-raw-stream", rawStreamCaller(iconn)},
		{"go-isthmus-shm-goroutines", protoCaller(pb.NewEchoClient(dconn))},
	}
	if engineCall != nil {
		deadlined = append(deadlined, system{"go-client-engine-server", engineCall})
	}
	sizes := []int{64, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20}
	wide := []int{64, 1 << 10}
	d := 1500 * time.Millisecond
	if quick {
		sizes, d, rounds = []int{64, 64 << 10, 1 << 20, 4 << 20}, 400*time.Millisecond, 1
	}
	var records []record
	for round := 1; round <= rounds; round++ {
		for _, size := range sizes {
			for _, sys := range systems {
				minCalls := 20
				if size >= 1<<20 {
					minCalls = 60
				}
				r, err := measure(sys.call, size, 1, d, minCalls)
				if err != nil {
					return fmt.Errorf("%s at %d B: %w", sys.name, size, err)
				}
				r.System, r.Round = sys.name, round
				records = append(records, r)
				fmt.Printf("round %d  %-15s %9d B  1 in flight: p50 %10.2f µs  p99 %10.2f µs  %10.0f calls/s\n", round, sys.name, size, r.P50, r.P99, r.RPS)
			}
		}
		for _, size := range wide {
			for _, sys := range systems[1:] {
				r, err := measure(sys.call, size, 32, d, 1000)
				if err != nil {
					return fmt.Errorf("%s at %d B × 32: %w", sys.name, size, err)
				}
				r.System, r.Round = sys.name, round
				records = append(records, r)
				fmt.Printf("round %d  %-15s %9d B 32 in flight: p50 %10.2f µs  p99 %10.2f µs  %10.0f calls/s\n", round, sys.name, size, r.P50, r.P99, r.RPS)
			}
		}
		for _, size := range wide {
			for _, sys := range deadlined {
				for _, inflight := range []int{1, 32} {
					r, err := measure(sys.call, size, inflight, d, 1000)
					if err != nil {
						return fmt.Errorf("%s at %d B × %d: %w", sys.name, size, inflight, err)
					}
					r.System, r.Round = sys.name, round
					records = append(records, r)
					fmt.Printf("round %d  %-24s %6d B %2d in flight: p50 %10.2f µs  p99 %10.2f µs  %10.0f calls/s\n", round, sys.name, size, inflight, r.P50, r.P99, r.RPS)
				}
			}
		}
		c := cgoCall()
		records = append(records, record{System: "go-cgo-call", Size: 0, Inflight: 1, P50: c, P99: c, RPS: 1e6 / c, Round: round})
		fmt.Printf("round %d  go-cgo-call: %.3f µs per empty cgo call\n", round, c)
	}
	if out == "" {
		return nil
	}
	return merge(out, records)
}

// grpcClient is grpc-go's client over the Unix socket at sock, at its best documented settings.
func grpcClient(sock string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(grpcWindow), grpc.WithInitialConnWindowSize(grpcWindow),
		grpc.WithReadBufferSize(grpcBuffer), grpc.WithWriteBufferSize(grpcBuffer),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage+1024), grpc.MaxCallSendMsgSize(maxMessage+1024)),
	)
}

// load runs one system at one size and concurrency for a while: go-isthmus-shm,
// go-isthmus-shm-goroutines, go-isthmus-raw, go-isthmus-raw-stream, go-grpc-uds, go-memcpy or
// go-client-engine-server.
func load(args []string) error {
	if len(args) != 4 {
		return fmt.Errorf("usage: go-bench load SYSTEM SIZE INFLIGHT SECONDS")
	}
	var size, inflight, seconds int
	for i, p := range []*int{&size, &inflight, &seconds} {
		if _, err := fmt.Sscan(args[i+1], p); err != nil {
			return fmt.Errorf("%q: %w", args[i+1], err)
		}
	}
	dir, err := os.MkdirTemp("", "isthmus-go-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// SYSTEM-deadline: the same calls, each with a deadline (withDeadline), as run measures them.
	name, deadlined := strings.CutSuffix(args[0], "-deadline")
	var call caller
	switch name {
	case "go-memcpy":
		call = memcpyCaller()
	case "go-isthmus-shm", "go-isthmus-raw", "go-isthmus-shm-goroutines", "go-isthmus-raw-stream", "go-client-engine-server":
		shm := fmt.Sprintf("shm://go-bench-%d", os.Getpid())
		var srv *exec.Cmd
		var err error
		switch name {
		case "go-isthmus-shm-goroutines":
			srv, err = start("serve-isthmus-default", shm)
		case "go-client-engine-server":
			shm = "shm://" + filepath.Join(dir, "engine.sock") // goes with dir, as in run
			srv, err = startEngineServer(shm)
		default:
			srv, err = start("serve-isthmus", shm)
		}
		if err != nil {
			return err
		}
		defer stop(srv)
		conn, err := isthmus.Dial(shm, isthmus.WithMaxMessageSize(maxMessage+1024))
		if err != nil {
			return err
		}
		defer conn.Close()
		switch name {
		case "go-isthmus-raw":
			call = rawCaller(conn)
		case "go-isthmus-raw-stream":
			call = rawStreamCaller(conn)
		case "go-client-engine-server":
			call = protoCaller(pb.NewEchoClient(toEngineEcho{conn}))
		default:
			call = protoCaller(pb.NewEchoClient(conn))
		}
	case "go-grpc-uds":
		sock := filepath.Join(dir, "grpc.sock")
		srv, err := start("serve-grpc", sock)
		if err != nil {
			return err
		}
		defer stop(srv)
		conn, err := grpcClient(sock)
		if err != nil {
			return err
		}
		defer conn.Close()
		call = protoCaller(pb.NewEchoClient(conn))
	default:
		return fmt.Errorf("unknown system %q", args[0])
	}
	if deadlined {
		call = withDeadline(call)
	}
	r, err := measure(call, size, inflight, time.Duration(seconds)*time.Second, 1000)
	if err != nil {
		return err
	}
	fmt.Printf("%s %d B %d in flight: p50 %.2f µs  p99 %.2f µs  %.0f calls/s\n", args[0], size, inflight, r.P50, r.P99, r.RPS)
	return nil
}

// merge replaces the go-* records of results.json with these, keeping everything else.
func merge(path string, records []record) error {
	doc := map[string]any{}
	if b, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(b, &doc); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	var kept []any
	if old, ok := doc["records"].([]any); ok {
		for _, r := range old {
			if m, ok := r.(map[string]any); ok && strings.HasPrefix(fmt.Sprint(m["system"]), "go-") {
				continue
			}
			kept = append(kept, r)
		}
	}
	for _, r := range records {
		kept = append(kept, r)
	}
	doc["records"] = kept
	if h, ok := doc["header"].(map[string]any); ok {
		if v, ok := h["versions"].(map[string]any); ok {
			v["go"] = runtime.Version()
			v["grpc-go"] = grpc.Version
		}
	}
	b, err := json.MarshalIndent(doc, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: go-bench run [-quick] [-rounds N] [-out results.json]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve-isthmus":
		serveIsthmus(os.Args[2], true)
	case "serve-isthmus-default":
		serveIsthmus(os.Args[2], false)
	case "serve-grpc":
		serveGrpc(os.Args[2])
	case "load":
		if err := load(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "go-bench:", err)
			os.Exit(1)
		}
	case "run":
		fs := flag.NewFlagSet("run", flag.ExitOnError)
		quick := fs.Bool("quick", false, "a reduced set, one round")
		rounds := fs.Int("rounds", 3, "rounds, alternating the systems")
		out := fs.String("out", "", "results.json to merge the records into")
		fs.Parse(os.Args[2:])
		if err := run(*quick, *rounds, *out); err != nil {
			fmt.Fprintln(os.Stderr, "go-bench:", err)
			os.Exit(1)
		}
	default:
		fmt.Fprintln(os.Stderr, "go-bench: unknown mode", os.Args[1])
		os.Exit(2)
	}
}
