package isthmus_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/grpclog"
	"google.golang.org/grpc/status"

	"example.invalid/isthmus/go/internal/conformance"
	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/internal/echo"
	"example.invalid/isthmus/go/isthmus"
)

// The tests start real server processes: go-peer (built here from ./cmd/go-peer) and, when
// ISTHMUS_TONIC_PEER names it, the Rust tonic-peer; clients talk to them through real shared
// memory and sockets.

var goPeerBin string

func TestMain(m *testing.M) {
	// What the package logs at ERROR goes to stderr, as with grpclog's default logger, and
	// into errorLog, for tests to read.
	grpclog.SetLoggerV2(grpclog.NewLoggerV2(io.Discard, io.Discard, io.MultiWriter(os.Stderr, &errorLog)))
	dir, err := os.MkdirTemp("", "isthmus-go-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	goPeerBin = filepath.Join(dir, "go-peer")
	if os.Getenv("ISTHMUS_TEST_UPGRADE_TARGET") != "" {
		// A child of TestWithUpgradeOverrulesTheProcessDefault: its server runs already.
		code := m.Run()
		os.RemoveAll(dir)
		os.Exit(code)
	}
	build := exec.Command("go", "build", "-o", goPeerBin, "example.invalid/isthmus/go/cmd/go-peer")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building go-peer:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	removeShmSockets()
	os.Exit(code)
}

// removeShmSockets removes the sockets of the shm:// names fresh gave: a server killed with
// SIGKILL leaves its socket in the runtime directory (where isthmus_shm::runtime_dir says).
func removeShmSockets() {
	names.Range(func(name, _ any) bool {
		os.Remove(filepath.Join(runtimeDir(), name.(string)+".sock"))
		return true
	})
}

// runtimeDir is where shm:// sockets live, as isthmus_shm::runtime_dir chooses it.
func runtimeDir() string {
	if xdg := os.Getenv("XDG_RUNTIME_DIR"); xdg != "" {
		return filepath.Join(xdg, "isthmus")
	}
	return fmt.Sprintf("/tmp/isthmus-%d", os.Getuid())
}

// removeLoopbacksOf removes the private loopback sockets of server process pid, which is gone:
// one killed with SIGKILL cannot remove them itself.
func removeLoopbacksOf(pid int) {
	found, _ := filepath.Glob(filepath.Join(runtimeDir(), fmt.Sprintf("isthmus-loopback-%d-*.sock", pid)))
	for _, f := range found {
		os.Remove(f)
	}
}

// peer is a server process; its HTTP/2 addresses as it announced them.
type peer struct {
	cmd       *exec.Cmd
	addresses []string
	lines     chan string
}

// names are the shm:// names fresh gave, whose sockets TestMain removes at the end.
var names sync.Map

// fresh returns a shm:// target and a unix:// socket path no other test uses.
func fresh(t testing.TB, tag string) (shm, unix string) {
	n := fmt.Sprintf("go-%s-%d-%d", tag, os.Getpid(), time.Now().UnixNano())
	names.Store(n, true)
	return "shm://" + n, "unix://" + filepath.Join(t.TempDir(), tag+".sock")
}

// serving starts s on targets, stopped when the test ends.
func serving(t testing.TB, s *isthmus.Server, targets ...string) {
	t.Helper()
	if err := s.Start(targets...); err != nil {
		t.Fatalf("start %v: %v", targets, err)
	}
	t.Cleanup(s.Stop)
}

// startPeer starts bin with targets and waits (30 s at most) for READY and one LISTENING
// line per HTTP/2 target. The process is killed when the test ends.
func startPeer(t testing.TB, bin string, targets ...string) *peer {
	t.Helper()
	cmd := exec.Command(bin, targets...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	p := &peer{cmd: cmd, lines: make(chan string)}
	done := make(chan struct{})
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		removeLoopbacksOf(cmd.Process.Pid)
		close(done)
	})
	// The peer's lines queue here however many nobody reads: a peer blocked on its stdout (it
	// prints a line per bidi call that ends) would stall the test.
	scanned := make(chan string)
	go func() {
		s := bufio.NewScanner(out)
		for s.Scan() {
			select {
			case scanned <- s.Text():
			case <-done:
				return
			}
		}
		close(scanned)
	}()
	go func() {
		var queue []string
		for in := scanned; in != nil || len(queue) > 0; {
			var out chan string
			var next string
			if len(queue) > 0 {
				out, next = p.lines, queue[0]
			}
			select {
			case line, ok := <-in:
				if !ok {
					in = nil
					continue
				}
				queue = append(queue, line)
			case out <- next:
				queue = queue[1:]
			case <-done:
				return
			}
		}
		close(p.lines)
	}()
	p.expect(t, "READY")
	for _, target := range targets {
		if !strings.HasPrefix(target, "shm://") {
			line := p.expect(t, "LISTENING ")
			p.addresses = append(p.addresses, strings.TrimPrefix(line, "LISTENING "))
		}
	}
	return p
}

// expect waits for a line starting with prefix.
func (p *peer) expect(t testing.TB, prefix string) string {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				t.Fatalf("the peer exited before printing %q", prefix)
			}
			if strings.HasPrefix(line, prefix) {
				return line
			}
		case <-timeout:
			t.Fatalf("the peer did not print %q within 30 s", prefix)
		}
	}
}

// runSuite runs the conformance checks on conn and fails t for each that fails.
func runSuite(t *testing.T, label string, conn grpc.ClientConnInterface, opts ...grpc.CallOption) {
	t.Helper()
	passed, failed := conformance.Run(context.Background(), conn, func(name string, err error) {
		if err != nil {
			t.Errorf("%s: %s: %v", label, name, err)
		}
	}, opts...)
	if failed > 0 || passed == 0 {
		t.Errorf("%s: %d passed, %d failed", label, passed, failed)
	}
}

func dial(t testing.TB, target string, opts ...isthmus.DialOption) *isthmus.ClientConn {
	t.Helper()
	conn, err := isthmus.Dial(target, opts...)
	if err != nil {
		t.Fatalf("dial %s: %v", target, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestGeneratedClientAgainstTheGoServerOnEveryTransport(t *testing.T) {
	shm, unix := fresh(t, "conf")
	p := startPeer(t, goPeerBin, shm, unix, "http://127.0.0.1:0")
	for _, target := range append([]string{shm}, p.addresses...) {
		runSuite(t, target, dial(t, target))
	}
}

// Metadata both ways on streams (SetHeader, SendHeader, SetTrailer at the server; Header and
// Trailer at the client), through isthmus's client on every transport and grpc-go's over
// HTTP/2.
func TestStreamMetadataBothWays(t *testing.T) {
	shm, unix := fresh(t, "stream-md")
	p := startPeer(t, goPeerBin, shm, unix, "http://127.0.0.1:0")
	run := func(label string, conn grpc.ClientConnInterface) {
		passed, failed := conformance.RunStreamMetadata(context.Background(), conn, func(name string, err error) {
			if err != nil {
				t.Errorf("%s: %s: %v", label, name, err)
			}
		})
		if failed > 0 || passed == 0 {
			t.Errorf("%s: %d passed, %d failed", label, passed, failed)
		}
	}
	for _, target := range append([]string{shm}, p.addresses...) {
		run(target, dial(t, target))
	}
	for _, address := range p.addresses[1:] { // http://
		conn, err := grpc.NewClient(grpcTarget(address), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		run("grpc-go → "+address, conn)
		conn.Close()
	}
}

func TestInlineUnaryHandlersPassTheSuite(t *testing.T) {
	shm, unix := fresh(t, "inline")
	t.Setenv("GO_PEER_INLINE", "1")
	p := startPeer(t, goPeerBin, shm, unix)
	for _, target := range append([]string{shm}, p.addresses...) {
		runSuite(t, "inline "+target, dial(t, target))
	}
}

// grpcTarget is how grpc-go names an isthmus HTTP/2 address.
func grpcTarget(address string) string {
	return strings.TrimPrefix(address, "http://")
}

func TestPlainGrpcGoClientAgainstTheGoServer(t *testing.T) {
	plainGrpcGoClient(t, goPeerBin)
}

func TestPlainGrpcGoClientAgainstTheRustServer(t *testing.T) {
	plainGrpcGoClient(t, tonicPeer(t))
}

// plainGrpcGoClient runs the suite with grpc-go's own client against server bin's HTTP/2
// addresses: the way out to and in from standard gRPC.
func plainGrpcGoClient(t *testing.T, bin string) {
	_, unix := fresh(t, "plain")
	p := startPeer(t, bin, unix, "http://127.0.0.1:0")
	if len(p.addresses) != 2 {
		t.Fatalf("the server listens on %v, not on its Unix socket and TCP port", p.addresses)
	}
	for _, address := range p.addresses {
		conn, err := grpc.NewClient(grpcTarget(address), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		runSuite(t, "grpc-go → "+address, conn, grpc.MaxCallRecvMsgSize(128<<20), grpc.MaxCallSendMsgSize(128<<20))
		conn.Close()
	}
}

// tonicPeer is the Rust tonic-peer that ISTHMUS_TONIC_PEER names; the test is skipped without
// it (failed, with ISTHMUS_REQUIRE_PEERS).
func tonicPeer(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("ISTHMUS_TONIC_PEER")
	if bin == "" {
		if os.Getenv("ISTHMUS_REQUIRE_PEERS") != "" {
			t.Fatal("ISTHMUS_TONIC_PEER is not set (make test sets it)")
		}
		t.Skip("ISTHMUS_TONIC_PEER is not set: run through make test")
	}
	return bin
}

func TestGeneratedClientAgainstTheRustServer(t *testing.T) {
	bin := tonicPeer(t)
	shm, unix := fresh(t, "rust")
	p := startPeer(t, bin, shm, unix, "http://127.0.0.1:0")
	for _, target := range append([]string{shm}, p.addresses...) {
		runSuite(t, "tonic-peer "+target, dial(t, target))
	}
}

// A call in its handler when the server is killed (SIGKILL: no goodbye) ends Unavailable
// promptly, over shared memory and over HTTP/2 on a Unix socket and on TCP; the Go server's
// and the Rust one's (tonic-peer; the Python servers' in tests/tests/suite/go_peers.rs).
func TestAKilledServerFailsItsCallsUnavailable(t *testing.T) {
	t.Run("go", func(t *testing.T) { killedServerFailsCallsUnavailable(t, goPeerBin) })
	t.Run("rust", func(t *testing.T) { killedServerFailsCallsUnavailable(t, tonicPeer(t)) })
}

func killedServerFailsCallsUnavailable(t *testing.T, bin string) {
	for _, transport := range []string{"shm", "unix", "tcp"} {
		shm, unix := fresh(t, "kill-"+transport)
		target := map[string]string{"shm": shm, "unix": unix, "tcp": "http://127.0.0.1:0"}[transport]
		p := startPeer(t, bin, target)
		if transport != "shm" {
			target = p.addresses[0]
		}
		c := pb.NewEchoClient(dial(t, target))
		if _, err := c.Unary(context.Background(), &pb.EchoRequest{}); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := c.Unary(context.Background(), &pb.EchoRequest{Seq: 7, SleepMs: 60000})
			done <- err
		}()
		p.expect(t, "UNARY-SLEEPING 7") // in its handler: in flight
		killed := time.Now()
		p.cmd.Process.Signal(syscall.SIGKILL)
		select {
		case err := <-done:
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("%s: got %v, want Unavailable", transport, err)
			}
			if el := time.Since(killed); el > 5*time.Second {
				t.Fatalf("%s: Unavailable came %v after the kill", transport, el)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: the call did not end after its server was killed", transport)
		}
		// The next call fails at once too: nobody listens.
		if _, err := c.Unary(context.Background(), &pb.EchoRequest{}); status.Code(err) != codes.Unavailable {
			t.Fatalf("%s: a call to no server gave %v", transport, err)
		}
	}
}

func threads(t *testing.T) int {
	return threadsOf(t, "self")
}

// threadsOf is the thread count of process pid ("self" for this one).
func threadsOf(t *testing.T, pid string) int {
	return procStatus(t, pid, "Threads")
}

// procStatus is the number a field of /proc/PID/status gives ("Threads", "VmHWM" in KiB).
func procStatus(t *testing.T, pid, field string) int {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if n, ok := strings.CutPrefix(line, field+":"); ok {
			var v int
			fmt.Sscan(strings.TrimSpace(n), &v)
			return v
		}
	}
	return 0
}

func TestThousandsOfCallsAtOnceHoldNoThreadEach(t *testing.T) {
	shm, _ := fresh(t, "many")
	startPeer(t, goPeerBin, shm)
	c := pb.NewEchoClient(dial(t, shm))
	const n = 3000
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	peak := threads(t)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			// Each call waits at the server long enough for all to be in flight together.
			r, err := c.Unary(context.Background(), &pb.EchoRequest{Payload: echo.Pattern(32, uint64(i)), Seq: uint64(i), SleepMs: 300})
			if err == nil && (r.Seq != uint64(i) || echo.FirstMismatch(r.Payload, uint64(i)) >= 0) {
				err = fmt.Errorf("call %d got another's reply", i)
			}
			errs <- err
		}(i)
	}
	close(start)
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				if n := threads(t); n > peak {
					peak = n
				}
			}
		}
	}()
	wg.Wait()
	close(stop)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if peak > 200 {
		t.Fatalf("%d calls in flight took the process to %d threads", n, peak)
	}
}

// Thousands of bidi streams open at once on one connection, each with its handler waiting in
// Recv on the Go server (go-peer), hold no OS thread each on either side: the handlers are
// goroutines, and the client's receives wait in the reactor. Every stream then finishes its
// exchange and ends, and the server sees each half-close.
func TestThousandsOfOpenStreamsHoldNoThreadEachOnEitherSide(t *testing.T) {
	shm, _ := fresh(t, "open-streams")
	p := startPeer(t, goPeerBin, shm)
	c := pb.NewEchoClient(dial(t, shm))
	const n = 2000
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var opened, finished sync.WaitGroup
	opened.Add(n)
	finished.Add(n)
	second := make(chan struct{})
	errs := make(chan error, n)
	exchange := func(s pb.Echo_BidiClient, i, round int) error {
		seq := uint64(i*2 + round)
		if err := s.Send(&pb.EchoRequest{Payload: echo.Pattern(48, seq), Seq: seq}); err != nil {
			return fmt.Errorf("stream %d, send %d: %w", i, round, err)
		}
		r, err := s.Recv()
		if err != nil {
			return fmt.Errorf("stream %d, receive %d: %w", i, round, err)
		}
		if r.Seq != seq || echo.FirstMismatch(r.Payload, seq) >= 0 {
			return fmt.Errorf("stream %d got another's reply (seq %d)", i, r.Seq)
		}
		return nil
	}
	for i := 0; i < n; i++ {
		go func(i int) {
			defer finished.Done()
			s, err := c.Bidi(ctx)
			if err == nil {
				err = exchange(s, i, 0)
			}
			opened.Done()
			if err != nil {
				errs <- err
				return
			}
			<-second
			if err := exchange(s, i, 1); err != nil {
				errs <- err
				return
			}
			if err := s.CloseSend(); err != nil {
				errs <- fmt.Errorf("stream %d: %w", i, err)
				return
			}
			if _, err := s.Recv(); err != io.EOF {
				errs <- fmt.Errorf("stream %d ended with %v", i, err)
			}
		}(i)
	}
	opened.Wait()
	// Every stream is open now, with its server handler waiting for the second message.
	client, server := threads(t), threadsOf(t, fmt.Sprint(p.cmd.Process.Pid))
	close(second)
	finished.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d streams open at once: %d threads in the client, %d in the server", n, client, server)
	if client > 200 || server > 200 {
		t.Fatalf("%d open streams took the client to %d threads and the server to %d", n, client, server)
	}
	for ended := 0; ended < n; ended++ {
		p.expect(t, "BIDI-ENDED half-close")
	}
}

// Thousands of short bidi streams one after another on one connection each echo and end, and
// the server sees every half-close (go-peer prints BIDI-ENDED for each: a peer whose lines
// nobody read used to block on its stdout after ~4,000 and stall the test).
func TestThousandsOfShortStreamsEndOneAfterAnother(t *testing.T) {
	shm, _ := fresh(t, "short-streams")
	p := startPeer(t, goPeerBin, shm)
	c := pb.NewEchoClient(dial(t, shm))
	const n = 5000
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for i := 0; i < n; i++ {
		s, err := c.Bidi(ctx)
		if err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		if err := s.Send(&pb.EchoRequest{Seq: uint64(i)}); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		if r, err := s.Recv(); err != nil || r.Seq != uint64(i) {
			t.Fatalf("stream %d: %v, %v", i, r, err)
		}
		if err := s.CloseSend(); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		if _, err := s.Recv(); err != io.EOF {
			t.Fatalf("stream %d ended with %v", i, err)
		}
	}
	for ended := 0; ended < n; ended++ {
		p.expect(t, "BIDI-ENDED half-close")
	}
}

func TestAMessageOverTheLimitIsResourceExhaustedAndTheServerGoesOn(t *testing.T) {
	shm, _ := fresh(t, "limit")
	startPeer(t, goPeerBin, shm) // accepts up to 65 MiB
	c := pb.NewEchoClient(dial(t, shm))
	_, err := c.Unary(context.Background(), &pb.EchoRequest{Payload: make([]byte, 66<<20)})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a 66 MiB request gave %v", err)
	}
	if !strings.Contains(status.Convert(err).Message(), fmt.Sprint(65<<20)) {
		t.Errorf("the message does not name the limit: %v", err)
	}
	if _, err := c.Unary(context.Background(), &pb.EchoRequest{Payload: []byte("after")}); err != nil {
		t.Fatalf("the call after: %v", err)
	}
}

// pattern is n bytes that differ from position to position (and from call to call by seed).
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) + seed
	}
	return b
}

func TestRawTierOnEveryTransport(t *testing.T) {
	for _, inline := range []bool{false, true} {
		shm, unix := fresh(t, fmt.Sprintf("raw%v", inline))
		if inline {
			t.Setenv("GO_PEER_INLINE", "1")
		}
		p := startPeer(t, goPeerBin, shm, unix)
		for _, target := range append([]string{shm}, p.addresses...) {
			label := fmt.Sprintf("inline=%v %s", inline, target)
			conn := dial(t, target)
			checkRawUnary(t, label, conn)
			checkRawStream(t, label, conn)
		}
	}
}

func checkRawUnary(t *testing.T, label string, conn *isthmus.ClientConn) {
	bg := context.Background()
	cancellable, cancel := context.WithTimeout(bg, time.Minute)
	defer cancel()
	// Both ways a call waits: in one cgo call (nothing can cancel it), and started on the
	// queue with a moment's wait on this thread (a context with a deadline).
	for _, ctx := range []context.Context{bg, cancellable} {
		req := pattern(1000, 1)
		m, err := conn.CallRaw(ctx, "/raw.Raw/Echo", req)
		if err != nil || string(m.Bytes()) != string(req) {
			t.Fatalf("%s: CallRaw: %v", label, err)
		}
		m.Release()
		m.Release() // a second release does nothing
		for _, size := range []int{0, 64, 1 << 20, 16 << 20} {
			want := pattern(size, byte(size))
			// 100 bytes more than it writes: the block is cut to size before it is sent.
			b, err := conn.Alloc(ctx, size+100)
			if err != nil {
				t.Fatalf("%s: Alloc(%d): %v", label, size+100, err)
			}
			// Filled by WriteAt, the second half first (16 MiB takes the streaming copy).
			half := size / 2
			for _, w := range []struct{ from, to int }{{half, size}, {0, half}} {
				if n, err := b.WriteAt(want[w.from:w.to], int64(w.from)); n != w.to-w.from || err != nil {
					t.Fatalf("%s: WriteAt(%d bytes at %d) of %d: %d, %v", label, w.to-w.from, w.from, size, n, err)
				}
			}
			for _, n := range []int{-1, size + 101} {
				if err := b.Truncate(n); status.Code(err) != codes.InvalidArgument {
					t.Fatalf("%s: Truncate(%d) of %d: %v, want InvalidArgument", label, n, size+100, err)
				}
			}
			if err := b.Truncate(size); err != nil || len(b.Bytes()) != size {
				t.Fatalf("%s: Truncate(%d): %v, %d bytes left", label, size, err, len(b.Bytes()))
			}
			for _, off := range []int64{-1, int64(size) + 1} {
				if n, err := b.WriteAt(nil, off); n != 0 || status.Code(err) != codes.InvalidArgument {
					t.Fatalf("%s: WriteAt at %d of %d: %d, %v, want InvalidArgument", label, off, size, n, err)
				}
			}
			if n, err := b.WriteAt([]byte{1}, int64(size)); n != 0 || status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%s: WriteAt past the end of %d: %d, %v, want InvalidArgument", label, size, n, err)
			}
			m, err := conn.CallRawBlock(ctx, "/raw.Raw/Echo", b)
			if err != nil {
				t.Fatalf("%s: CallRawBlock(%d): %v", label, size, err)
			}
			if string(m.Bytes()) != string(want) {
				t.Fatalf("%s: CallRawBlock(%d): the reply differs", label, size)
			}
			m.Release()
			if _, err := conn.CallRawBlock(ctx, "/raw.Raw/Echo", b); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%s: a block sent twice: %v, want InvalidArgument", label, err)
			}
			if _, err := b.WriteAt([]byte{1}, 0); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%s: WriteAt into a sent block: %v, want InvalidArgument", label, err)
			}
			if err := b.Truncate(0); status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%s: Truncate of a sent block: %v, want InvalidArgument", label, err)
			}
		}
		released, err := conn.Alloc(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		released.Release()
		if _, err := conn.CallRawBlock(ctx, "/raw.Raw/Echo", released); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%s: a released block sent: %v, want InvalidArgument", label, err)
		}
		_, err = conn.CallRaw(ctx, "/raw.Raw/Fail", nil)
		if s := status.Convert(err); s.Code() != codes.FailedPrecondition || s.Message() != "raw says no" {
			t.Fatalf("%s: Fail: %v", label, err)
		}
		if _, err := conn.CallRaw(ctx, "/raw.Raw/Panic", nil); status.Code(err) != codes.Internal {
			t.Fatalf("%s: Panic: %v, want Internal", label, err)
		}
	}
	short, cancelShort := context.WithTimeout(bg, 100*time.Millisecond)
	defer cancelShort()
	if _, err := conn.CallRaw(short, "/raw.Raw/Slow", nil); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("%s: Slow with a 100 ms deadline: %v, want DeadlineExceeded", label, err)
	}
	// Many at once, each with a context that can be cancelled: most take the queue's way.
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(bg, 30*time.Second)
			defer cancel()
			want := pattern(100+i, byte(i))
			b, err := conn.Alloc(ctx, len(want))
			if err != nil {
				errs <- err
				return
			}
			copy(b.Bytes(), want)
			m, err := conn.CallRawBlock(ctx, "/raw.Raw/Echo", b)
			if err != nil {
				errs <- err
				return
			}
			if string(m.Bytes()) != string(want) {
				errs <- fmt.Errorf("call %d: the reply differs", i)
			}
			m.Release()
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("%s: concurrent raw calls: %v", label, err)
	}
}

func checkRawStream(t *testing.T, label string, conn *isthmus.ClientConn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := conn.StartRaw(ctx, "/raw.Raw/Stream")
	if err != nil {
		t.Fatalf("%s: StartRaw: %v", label, err)
	}
	for i, size := range []int{1, 5000, 2 << 20} {
		want := pattern(size, byte(i))
		b, err := s.Alloc(size)
		if err != nil {
			t.Fatalf("%s: stream Alloc: %v", label, err)
		}
		copy(b.Bytes(), want)
		if err := s.SendBlock(b, false); err != nil {
			t.Fatalf("%s: stream SendBlock: %v", label, err)
		}
		m, err := s.Recv()
		if err != nil || string(m.Bytes()) != string(want) {
			t.Fatalf("%s: stream Recv %d: %v", label, i, err)
		}
		m.Release()
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Fatalf("%s: stream end: %v, want io.EOF", label, err)
	}
}

func TestWaitForReadyWaitsForTheServerWithALargeRequest(t *testing.T) {
	shm, _ := fresh(t, "wfr")
	c := pb.NewEchoClient(dial(t, shm))
	payload := echo.Pattern(1<<20, 7) // large: marshalled straight into shared memory
	// Nobody serves yet: without WaitForReady the call fails at once.
	if _, err := c.Unary(context.Background(), &pb.EchoRequest{Payload: payload}); status.Code(err) != codes.Unavailable {
		t.Fatalf("with no server: %v, want Unavailable", err)
	}
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r, err := c.Unary(ctx, &pb.EchoRequest{Payload: payload}, grpc.WaitForReady(true))
		if err == nil && len(r.Payload) != len(payload) {
			err = fmt.Errorf("a reply of %d bytes", len(r.Payload))
		}
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("the call ended before there was a server: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	startPeer(t, goPeerBin, shm)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the call did not end once the server was up")
	}
}
