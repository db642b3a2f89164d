package isthmus_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// Per-RPC credentials (WithPerRPCCredentials, and grpc.PerRPCCredentials per call): their
// metadata reaches the server over shm://, unix:// and TLS; their errors fail calls as
// grpc-go's client fails them; credentials that need a secure connection are refused on
// plaintext TCP, as grpc-go refuses them.

// tokenCreds gives md (or err) to every call and keeps what it was asked with.
type tokenCreds struct {
	md     map[string]string
	err    error
	secure bool

	mu    sync.Mutex
	uris  []string
	infos []credentials.RequestInfo
}

func (c *tokenCreds) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	ri, _ := credentials.RequestInfoFromContext(ctx)
	c.mu.Lock()
	c.uris = append(c.uris, uri...)
	c.infos = append(c.infos, ri)
	c.mu.Unlock()
	return c.md, c.err
}

func (c *tokenCreds) RequireTransportSecurity() bool { return c.secure }

// asked is what GetRequestMetadata was given since the last asked.
func (c *tokenCreds) asked() ([]string, []credentials.RequestInfo) {
	c.mu.Lock()
	defer c.mu.Unlock()
	uris, infos := c.uris, c.infos
	c.uris, c.infos = nil, nil
	return uris, infos
}

// seenMD keeps the incoming metadata of the server's last call, through its interceptors.
type seenMD struct {
	mu sync.Mutex
	md metadata.MD
}

func (s *seenMD) keep(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	s.mu.Lock()
	s.md = md
	s.mu.Unlock()
}

func (s *seenMD) take() metadata.MD {
	s.mu.Lock()
	defer s.mu.Unlock()
	md := s.md
	s.md = nil
	return md
}

func (s *seenMD) options() []isthmus.ServerOption {
	return []isthmus.ServerOption{
		isthmus.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			s.keep(ctx)
			return handler(ctx, req)
		}),
		isthmus.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			s.keep(ss.Context())
			return handler(srv, ss)
		}),
	}
}

// checkCredentialsArrive makes a unary call with call credentials and outgoing metadata, and
// a server-streaming one with neither, on conn (dialled with dial's credentials), and checks
// what the server saw and what the credentials were asked with: uri is the one expected,
// level the connection's security level.
func checkCredentialsArrive(t *testing.T, label string, conn grpc.ClientConnInterface, dial *tokenCreds, seen *seenMD, uri string, level credentials.SecurityLevel) {
	t.Helper()
	ctx := testContext(t)
	c := pb.NewEchoClient(conn)
	call := &tokenCreds{md: map[string]string{"X-Call-Token": "call", "authorization": "Bearer call"}, secure: true}
	out := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer context")
	if _, err := c.Unary(out, &pb.EchoRequest{}, grpc.PerRPCCredentials(call)); err != nil {
		t.Fatalf("%s: Unary: %v", label, err)
	}
	md := seen.take()
	// The connection's credentials first, then the call's, then the context's, as grpc-go
	// sends them; keys lower case.
	if got, want := md.Get("authorization"), []string{"Bearer dial", "Bearer call", "Bearer context"}; !slices.Equal(got, want) {
		t.Errorf("%s: the server saw authorization %q, want %q", label, got, want)
	}
	if got := md.Get("x-call-token"); !slices.Equal(got, []string{"call"}) {
		t.Errorf("%s: the server saw x-call-token %q, want [call]", label, got)
	}
	st, err := c.ServerStream(ctx, &pb.StreamRequest{Count: 1})
	if err == nil {
		_, err = st.Recv()
	}
	if err != nil {
		t.Fatalf("%s: ServerStream: %v", label, err)
	}
	md = seen.take()
	if got := md.Get("authorization"); !slices.Equal(got, []string{"Bearer dial"}) {
		t.Errorf("%s: a stream's server saw authorization %q, want [Bearer dial]", label, got)
	}
	if got := md.Get("x-call-token"); len(got) != 0 {
		t.Errorf("%s: a call without the call option sent its credentials: %q", label, got)
	}
	uris, infos := dial.asked()
	callURIs, _ := call.asked()
	if want := []string{uri, uri}; !slices.Equal(uris, want) || !slices.Equal(callURIs, want[:1]) {
		t.Errorf("%s: the credentials were given %q (the call's %q), want %q each call", label, uris, callURIs, uri)
	}
	for i, want := range []string{pb.Echo_Unary_FullMethodName, pb.Echo_ServerStream_FullMethodName} {
		if i >= len(infos) {
			break
		}
		ri := infos[i]
		if ri.Method != want {
			t.Errorf("%s: RequestInfo.Method %q, want %q", label, ri.Method, want)
		}
		if ri.AuthInfo == nil || credentials.CheckSecurityLevel(ri.AuthInfo, level) != nil {
			t.Errorf("%s: RequestInfo.AuthInfo %#v, want security level %v", label, ri.AuthInfo, level)
		}
	}
}

// Credentials that require a secure connection are sent over shm:// and unix:// (local, as
// grpc-go's local credentials count a unix socket) and over TLS, with grpc-go's uri; a plain
// grpc-go client over TLS gives its credentials the same uri.
func TestPerRPCCredentialsReachTheServer(t *testing.T) {
	var seen seenMD
	shm, unix := fresh(t, "creds")
	startPeerServer(t, []string{shm, unix}, seen.options()...)
	for _, target := range []string{shm, unix} {
		dial := &tokenCreds{md: map[string]string{"Authorization": "Bearer dial"}, secure: true}
		conn := dialWith(t, target, isthmus.WithPerRPCCredentials(dial))
		checkCredentialsArrive(t, target, conn, dial, &seen, "https://localhost/conformance.Echo", credentials.PrivacyAndIntegrity)
	}

	p := newPKI(t)
	s, _ := startPeerServer(t, []string{"https://127.0.0.1:0"}, append(seen.options(), isthmus.ServerTLS(p.server(false, false)))...)
	address := s.HTTPAddresses()[0]
	uri := address + "/conformance.Echo" // https://127.0.0.1:PORT/…
	dial := &tokenCreds{md: map[string]string{"Authorization": "Bearer dial"}, secure: true}
	conn := dialWith(t, address, isthmus.WithTLS(isthmus.TLSConfig{RootCAs: p.caPEM}), isthmus.WithPerRPCCredentials(dial))
	checkCredentialsArrive(t, address, conn, dial, &seen, uri, credentials.PrivacyAndIntegrity)

	dial = &tokenCreds{md: map[string]string{"Authorization": "Bearer dial"}, secure: true}
	gconn, err := grpc.NewClient(strings.TrimPrefix(address, "https://"),
		grpc.WithTransportCredentials(credentials.NewClientTLSFromCert(p.pool, "")),
		grpc.WithPerRPCCredentials(dial))
	if err != nil {
		t.Fatal(err)
	}
	defer gconn.Close()
	checkCredentialsArrive(t, "grpc-go → "+address, gconn, dial, &seen, uri, credentials.PrivacyAndIntegrity)
}

// An error from GetRequestMetadata fails the call as grpc-go's client fails it, code and
// message: the connection's credentials' with codes.Unauthenticated, the call option's with
// codes.Internal, a status error with its own code unless gRFC A54 keeps that code from the
// control plane; and call credentials that need a secure connection fail a call on a plaintext
// one with codes.Unauthenticated. Both clients call a grpc-go server over plaintext TCP.
func TestPerRPCCredentialsErrorsAreGrpcGos(t *testing.T) {
	address := startGrpcServer(t)
	cases := []struct {
		what string
		dial *tokenCreds // WithPerRPCCredentials
		call *tokenCreds // grpc.PerRPCCredentials
		code codes.Code
	}{
		{what: "an error", dial: &tokenCreds{err: errors.New("the token expired")}, code: codes.Unauthenticated},
		{what: "a status error", dial: &tokenCreds{err: status.Error(codes.PermissionDenied, "not you")}, code: codes.PermissionDenied},
		{what: "a control plane's status", dial: &tokenCreds{err: status.Error(codes.InvalidArgument, "bad")}, code: codes.Internal},
		{what: "the call's error", call: &tokenCreds{err: errors.New("the token expired")}, code: codes.Internal},
		{what: "the call's status error", call: &tokenCreds{err: status.Error(codes.Unavailable, "try later")}, code: codes.Unavailable},
		{what: "the call's secure credentials", call: &tokenCreds{md: map[string]string{"a": "b"}, secure: true}, code: codes.Unauthenticated},
	}
	for _, tc := range cases {
		var errs []*status.Status
		for _, grpcGo := range []bool{false, true} {
			var conn grpc.ClientConnInterface
			switch {
			case grpcGo && tc.dial != nil:
				conn = newGrpcClient(t, address, grpc.WithPerRPCCredentials(tc.dial))
			case grpcGo:
				conn = newGrpcClient(t, address)
			case tc.dial != nil:
				conn = dialWith(t, "http://"+address, isthmus.WithPerRPCCredentials(tc.dial))
			default:
				conn = dialWith(t, "http://"+address)
			}
			var opts []grpc.CallOption
			if tc.call != nil {
				opts = append(opts, grpc.PerRPCCredentials(tc.call))
			}
			_, err := pb.NewEchoClient(conn).Unary(testContext(t), &pb.EchoRequest{}, opts...)
			errs = append(errs, status.Convert(err))
		}
		isthmusErr, grpcErr := errs[0], errs[1]
		if isthmusErr.Code() != tc.code || isthmusErr.Message() != grpcErr.Message() || grpcErr.Code() != tc.code {
			t.Errorf("%s: isthmus %v, grpc-go %v, want code %v and the same message", tc.what, isthmusErr.Err(), grpcErr.Err(), tc.code)
		}
		for _, c := range []*tokenCreds{tc.dial, tc.call} {
			if c == nil {
				continue
			}
			// Both clients ask with the same uri (the secure call credentials are not asked).
			uris, _ := c.asked()
			want := "https://" + address + "/conformance.Echo"
			if !c.secure && (len(uris) != 2 || uris[0] != want || uris[1] != want) {
				t.Errorf("%s: the credentials were given %q, want %q from each client", tc.what, uris, want)
			}
		}
	}
}

// Dial refuses credentials that require a secure connection on plaintext TCP (http://, or
// host:port without WithTLS) as grpc-go's client refuses them without transport security,
// and takes them with TLS, shm:// and unix://; it takes other credentials anywhere.
func TestSecureCredentialsNeedASecureConnection(t *testing.T) {
	secure := isthmus.WithPerRPCCredentials(&tokenCreds{secure: true})
	_, grpcErr := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(&tokenCreds{secure: true}))
	if grpcErr == nil {
		t.Fatal("grpc-go took secure credentials on a plaintext connection")
	}
	for _, target := range []string{"http://127.0.0.1:1", "127.0.0.1:1", "dns:///localhost:1", "ipv4:127.0.0.1:1"} {
		conn, err := isthmus.Dial(target, secure)
		if err == nil {
			conn.Close()
			t.Errorf("%s: Dial took secure credentials on plaintext TCP", target)
			continue
		}
		// grpc-go's words, up to its hint of what to do, which names its options.
		prefix, _, _ := strings.Cut(grpcErr.Error(), " (")
		if status.Code(err) != codes.InvalidArgument || !strings.HasPrefix(status.Convert(err).Message(), prefix) {
			t.Errorf("%s: %v, want InvalidArgument %q… as grpc-go says", target, err, prefix)
		}
	}
	shm, unix := fresh(t, "creds-dial")
	for _, tc := range []struct {
		target string
		opts   []isthmus.DialOption
	}{
		{"https://127.0.0.1:1", []isthmus.DialOption{secure}},
		{"127.0.0.1:1", []isthmus.DialOption{secure, isthmus.WithTLS(isthmus.TLSConfig{})}},
		{shm, []isthmus.DialOption{secure}},
		{unix, []isthmus.DialOption{secure}},
		{"unix:relative.sock", []isthmus.DialOption{secure}},
		{"http://127.0.0.1:1", []isthmus.DialOption{isthmus.WithPerRPCCredentials(&tokenCreds{})}},
	} {
		conn, err := isthmus.Dial(tc.target, tc.opts...)
		if err != nil {
			t.Errorf("%s: %v", tc.target, err)
			continue
		}
		conn.Close()
	}
}
