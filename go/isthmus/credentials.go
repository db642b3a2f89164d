package isthmus

import (
	"context"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// WithPerRPCCredentials adds credentials whose GetRequestMetadata is asked before each call
// of the connection (typed and raw) for metadata to send with it, as
// grpc.WithPerRPCCredentials does; the grpc.PerRPCCredentials call option adds more for one
// call. Credentials that RequireTransportSecurity need a connection that protects them: TLS
// (https://, or WithTLS), or a local one, shm:// or unix:// (as grpc-go's local credentials
// count a unix socket); Dial refuses them with codes.InvalidArgument on plaintext TCP
// (http://, or host:port without WithTLS), where grpc-go's Dial refuses them too.
//
// GetRequestMetadata is given grpc-go's uri, "https://" + the connection's authority + the
// service ("https://example.com/pkg.Service", a :443 port left out); the authority is
// WithAuthority's if set, else the target's host:port, WithTLS's ServerName if set, and
// "localhost" for shm:// and unix:// targets, as grpc-go names a unix socket's. Its context has
// a credentials.RequestInfo with the method and an AuthInfo of the connection's security level
// ("tls" or "local" with credentials.PrivacyAndIntegrity, "insecure" with
// credentials.NoSecurity).
// An error from it fails the call as grpc-go's does: a status error with its own code (one of
// the codes gRFC A54 keeps from the control plane becomes codes.Internal), another error
// with codes.Unauthenticated (codes.Internal from the call option's credentials).
func WithPerRPCCredentials(c credentials.PerRPCCredentials) DialOption {
	return func(o *dialOptions) { o.perRPC = append(o.perRPC, c) }
}

// security is how a connection protects what it carries: "tls", "local" (shared memory or a
// unix socket, whose ends are processes of this machine) or "insecure" (plaintext TCP), as
// grpc-go's TLS, local and insecure credentials call theirs. An http:// target that the
// library moves to shared memory (ADR 0013) counts as insecure: that is known only later.
func security(target string, withTLS bool) string {
	switch {
	case strings.HasPrefix(target, "shm:"), strings.HasPrefix(target, "unix:"), strings.HasPrefix(target, "unix-abstract:"):
		return "local"
	case strings.HasPrefix(target, "https://"):
		return "tls"
	case strings.HasPrefix(target, "http://"):
		return "insecure"
	case withTLS:
		return "tls"
	}
	return "insecure"
}

// callAuthority is the :authority the connection's calls carry as grpc-go gives it:
// WithAuthority's if set, else authority's.
func (o *dialOptions) callAuthority(target string) string {
	if o.authority != "" {
		return o.authority
	}
	return authority(target, o.tls)
}

// authority is the :authority grpc-go would give a connection to target: WithTLS's
// ServerName if set, "localhost" for local sockets, and otherwise the target's endpoint
// (host:port, or the address list of ipv4: and ipv6:), for the per-RPC credentials' uri.
func authority(target string, tls *TLSConfig) string {
	if tls != nil && tls.ServerName != "" {
		return tls.ServerName
	}
	if security(target, false) == "local" {
		return "localhost"
	}
	rest := target
	for _, scheme := range []string{"https://", "http://", "dns:", "ipv4:", "ipv6:"} {
		if r, ok := strings.CutPrefix(target, scheme); ok {
			rest = r
			break
		}
	}
	if r, ok := strings.CutPrefix(rest, "//"); ok { // dns://resolver/host:port
		if _, host, ok := strings.Cut(r, "/"); ok {
			rest = host
		}
	}
	rest = strings.TrimSuffix(rest, "/")
	if strings.HasPrefix(rest, ":") {
		return "localhost" + rest
	}
	return rest
}

// errCredentialsNeedSecurity is Dial's refusal of credentials that RequireTransportSecurity
// on a plaintext connection: grpc-go's words, with isthmus's ways to secure it.
var errCredentialsNeedSecurity = status.Error(codes.InvalidArgument,
	"grpc: the credentials require transport level security (use isthmus.WithTLS or an https://, shm:// or unix:// target)")

// callAuth is the AuthInfo per-RPC credentials find in their credentials.RequestInfo.
type callAuth struct {
	credentials.CommonAuthInfo
	kind string
}

// AuthType is the connection's security (see security).
func (a callAuth) AuthType() string { return a.kind }

// perRPC is a connection's per-RPC credentials and what they are told of it.
type perRPC struct {
	creds    []credentials.PerRPCCredentials
	secure   bool // TLS or local: call options' credentials that RequireTransportSecurity may go
	auth     callAuth
	audience string // "https://" + authority, the service to be added
}

func newPerRPC(o *dialOptions, target string) (perRPC, error) {
	sec := security(target, o.tls != nil)
	level := credentials.PrivacyAndIntegrity
	if sec == "insecure" {
		level = credentials.NoSecurity
		for _, c := range o.perRPC {
			if c.RequireTransportSecurity() {
				return perRPC{}, errCredentialsNeedSecurity
			}
		}
	}
	return perRPC{
		creds:    o.perRPC,
		secure:   sec != "insecure",
		auth:     callAuth{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: level}, kind: sec},
		audience: "https://" + strings.TrimSuffix(o.callAuthority(target), ":443"),
	}, nil
}

// requestMetadata is the metadata a call of method sends: its credentials' (the
// connection's, then call's, the call option's) ahead of out, the context's, as grpc-go
// sends them. out itself is not changed.
func (p *perRPC) requestMetadata(ctx context.Context, method string, call credentials.PerRPCCredentials, out metadata.MD) (metadata.MD, error) {
	if call != nil && call.RequireTransportSecurity() && !p.secure {
		return nil, status.Error(codes.Unauthenticated, "transport: cannot send secure credentials on an insecure connection")
	}
	service := method
	if i := strings.LastIndexByte(method, '/'); i >= 0 {
		service = method[:i]
	}
	uri := p.audience + service
	ctx = credentials.NewContextWithRequestInfo(ctx, credentials.RequestInfo{Method: method, AuthInfo: p.auth})
	md := metadata.MD{}
	// The connection's credentials make one set, a later one's key replacing an earlier's;
	// the call option's are added to them, as grpc-go makes one header of each.
	conn := map[string]string{}
	for _, c := range p.creds {
		data, err := c.GetRequestMetadata(ctx, uri)
		if err != nil {
			return nil, credentialsError(err, codes.Unauthenticated)
		}
		for k, v := range data {
			conn[strings.ToLower(k)] = v
		}
	}
	for k, v := range conn {
		md[k] = append(md[k], v)
	}
	if call != nil {
		data, err := call.GetRequestMetadata(ctx, uri)
		if err != nil {
			return nil, credentialsError(err, codes.Internal)
		}
		one := make(map[string]string, len(data))
		for k, v := range data {
			one[strings.ToLower(k)] = v
		}
		for k, v := range one {
			md[k] = append(md[k], v)
		}
	}
	for k, vs := range out {
		md[k] = append(md[k], vs...)
	}
	return md, nil
}

// credentialsError is how GetRequestMetadata's err fails a call in grpc-go: a status keeps
// its code unless gRFC A54 keeps that code from the control plane; another error gets code.
func credentialsError(err error, code codes.Code) error {
	if st, ok := status.FromError(err); ok {
		switch st.Code() {
		case codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition,
			codes.Aborted, codes.OutOfRange, codes.DataLoss:
			return status.Errorf(codes.Internal, "transport: received per-RPC creds error with illegal status: %v", err)
		}
		return err
	}
	return status.Errorf(code, "transport: per-RPC creds failed due to error: %v", err)
}
