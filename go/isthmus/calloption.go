package isthmus

import (
	"crypto/tls"
	"net"
	"net/netip"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// WithDefaultCallOptions sets call options for every typed call of the connection, applied
// before the call's own (so a call's own option of the same kind wins), as
// grpc.WithDefaultCallOptions does; interceptors see both. Raw calls (CallRaw, StartRaw…)
// take no call options, these included.
func WithDefaultCallOptions(opts ...grpc.CallOption) DialOption {
	return func(o *dialOptions) { o.callOptions = append(o.callOptions, opts...) }
}

// withDefaults is a call's options after the connection's defaults. It makes a new slice
// only when both have some: defaults is clipped at Dial, so that a caller appending to what
// it is given cannot write into an array other calls share.
func withDefaults(defaults, opts []grpc.CallOption) []grpc.CallOption {
	switch {
	case len(defaults) == 0:
		return opts
	case len(opts) == 0:
		return defaults
	}
	all := make([]grpc.CallOption, 0, len(defaults)+len(opts))
	return append(append(all, defaults...), opts...)
}

// callOptions are the grpc.CallOptions of one typed call that isthmus honours:
//   - Header, Trailer and Peer are filled in as the call ends;
//   - WaitForReady (FailFast) and PerRPCCredentials;
//   - MaxCallSendMsgSize fails a larger request before it is sent, MaxCallRecvMsgSize a
//     larger response once it has arrived (the library itself enforces only the
//     connection's WithMaxMessageSize), both with grpc-go's codes.ResourceExhausted and words;
//   - OnFinish callbacks hear the call's final error;
//   - ForceCodec, ForceCodecV2 and CallCustomCodec marshal messages with their codec, and
//     CallContentSubtype picks a registered one, as long as the content-subtype stays
//     "proto": isthmus sends application/grpc, so a call asking for another one fails with
//     codes.Unimplemented rather than send the server bytes it would read as protobuf;
//   - UseCompressor is checked as grpc-go checks it (an unregistered name fails the call,
//     codes.Internal); "gzip" (and "deflate", once registered) compresses the requests over
//     HTTP/2, and over shm:// messages cross no wire and go as they are. Another registered
//     compressor fails the call with codes.Unimplemented: the library compresses only those.
//
// Others (CallAuthority, MaxRetryRPCBufferSize, StaticMethod…) are ignored.
type callOptions struct {
	header, trailer *metadata.MD
	peer            *peer.Peer
	waitForReady    bool
	creds           credentials.PerRPCCredentials
	// maxSend and maxRecv bound the call's messages where limitSend and limitRecv say so.
	maxSend, maxRecv     int
	limitSend, limitRecv bool
	// codec marshals the call's messages; nil for protobuf by isthmus's own means.
	codec messageCodec
	// compression is the requests' grpc-encoding over HTTP/2: "gzip", "deflate" or "".
	compression string
	// onFinish says that opts hold grpc.OnFinish callbacks, called when the call ends.
	onFinish bool
	opts     []grpc.CallOption
	// err is an option isthmus cannot honour, which fails the call before it starts.
	err error
	// stats reports the call to the connection's stats handlers (nil: there are none).
	stats *rpcStats
}

// parseCallOptions reads opts (allocating nothing unless a codec is forced).
func parseCallOptions(opts []grpc.CallOption) callOptions {
	var co callOptions
	var subtype, forcedName, compressor string
	encoded := false
	for _, o := range opts {
		switch o := o.(type) {
		case grpc.HeaderCallOption:
			co.header = o.HeaderAddr
		case grpc.TrailerCallOption:
			co.trailer = o.TrailerAddr
		case grpc.PeerCallOption:
			co.peer = o.PeerAddr
		case grpc.FailFastCallOption:
			co.waitForReady = !o.FailFast
		case grpc.PerRPCCredsCallOption:
			co.creds = o.Creds
		case grpc.MaxSendMsgSizeCallOption:
			co.maxSend, co.limitSend = o.MaxSendMsgSize, true
		case grpc.MaxRecvMsgSizeCallOption:
			co.maxRecv, co.limitRecv = o.MaxRecvMsgSize, true
		case grpc.OnFinishCallOption:
			co.onFinish, co.opts = true, opts
		case grpc.CompressorCallOption:
			compressor, encoded = o.CompressorType, true
		case grpc.ContentSubtypeCallOption:
			subtype, encoded = o.ContentSubtype, true
		case grpc.ForceCodecCallOption:
			co.codec, forcedName, encoded = bytesCodec{o.Codec}, o.Codec.Name(), true
		case grpc.ForceCodecV2CallOption:
			co.codec, forcedName, encoded = bufferCodec{o.CodecV2}, o.CodecV2.Name(), true
		case grpc.CustomCodecCallOption:
			// grpc-go takes no content-subtype from this deprecated kind of codec.
			co.codec, forcedName, encoded = bytesCodec{o.Codec}, "", true
		}
	}
	if encoded {
		co.err = co.checkEncoding(subtype, forcedName, compressor)
	}
	return co
}

// checkEncoding is why the call's codec and compressor options cannot be honoured (nil if
// they can), grpc-go's errors first.
func (co *callOptions) checkEncoding(subtype, forcedName, compressor string) error {
	if compressor != "" && compressor != encoding.Identity && encoding.GetCompressor(compressor) == nil {
		return status.Errorf(codes.Internal, "grpc: Compressor is not installed for requested grpc-encoding %q", compressor)
	}
	switch compressor {
	case "", encoding.Identity:
		co.compression = ""
	case "gzip", "deflate":
		co.compression = compressor
	default:
		return status.Errorf(codes.Unimplemented, "grpc-encoding %q: isthmus compresses with gzip or deflate only", compressor)
	}
	switch {
	case co.codec != nil && subtype == "":
		subtype = strings.ToLower(forcedName)
	case co.codec == nil && subtype != "" && encoding.GetCodecV2(subtype) == nil:
		return status.Errorf(codes.Internal, "no codec registered for content-subtype %s", subtype)
	}
	if subtype != "" && subtype != "proto" {
		return status.Errorf(codes.Unimplemented, "content-subtype %q: isthmus sends protobuf (application/grpc) only", subtype)
	}
	return nil
}

// finished calls the call's grpc.OnFinish callbacks with its final error, in order.
func (co *callOptions) finished(err error) {
	if !co.onFinish {
		return
	}
	for _, o := range co.opts {
		if f, ok := o.(grpc.OnFinishCallOption); ok {
			f.OnFinish(err)
		}
	}
}

// checkSend fails a request of size bytes over MaxCallSendMsgSize, in grpc-go's words.
func (co *callOptions) checkSend(size int) error {
	if co.limitSend && size > co.maxSend {
		return status.Errorf(codes.ResourceExhausted, "trying to send message larger than max (%d vs. %d)", size, co.maxSend)
	}
	return nil
}

// checkRecv fails a response of size bytes over MaxCallRecvMsgSize, in grpc-go's words.
func (co *callOptions) checkRecv(size int) error {
	if co.limitRecv && size > co.maxRecv {
		return status.Errorf(codes.ResourceExhausted, "grpc: received message larger than max (%d vs. %d)", size, co.maxRecv)
	}
	return nil
}

func (co *callOptions) marshal(m any) ([]byte, error) {
	// An untyped nil is an empty message before any codec sees it, as on grpc-go.
	if co.codec == nil || m == nil {
		return marshal(m)
	}
	b, err := co.codec.marshal(m)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "grpc: error while marshaling: %v", err)
	}
	return b, nil
}

func (co *callOptions) unmarshal(b []byte, m any) error {
	if co.codec == nil {
		return unmarshal(b, m)
	}
	if err := co.codec.unmarshal(b, m); err != nil {
		return status.Errorf(codes.Internal, "grpc: failed to unmarshal the received message: %v", err)
	}
	return nil
}

// messageCodec is a codec a call option forces. Its unmarshal is given a copy of the bytes:
// the codec may keep them (grpc-go gives a codec its own), and over shm:// they are the
// server's memory until the message is freed.
type messageCodec interface {
	marshal(m any) ([]byte, error)
	unmarshal(b []byte, m any) error
}

// bytesCodec is an encoding.Codec or a grpc.Codec.
type bytesCodec struct {
	c interface {
		Marshal(v any) ([]byte, error)
		Unmarshal(data []byte, v any) error
	}
}

func (c bytesCodec) marshal(m any) ([]byte, error) { return c.c.Marshal(m) }

func (c bytesCodec) unmarshal(b []byte, m any) error {
	return c.c.Unmarshal(append([]byte{}, b...), m)
}

// bufferCodec is an encoding.CodecV2.
type bufferCodec struct{ c encoding.CodecV2 }

func (c bufferCodec) marshal(m any) ([]byte, error) {
	bs, err := c.c.Marshal(m)
	if err != nil {
		return nil, err
	}
	defer bs.Free()
	return bs.Materialize(), nil
}

func (c bufferCodec) unmarshal(b []byte, m any) error {
	return c.c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(append([]byte{}, b...))}, m)
}

// serverPeer is what grpc.Peer gives after a call: the server's address as the target names
// it (targetAddr), and how the connection is secured: over TLS a credentials.TLSInfo (with no
// details of the handshake, which the library does not give), otherwise the AuthInfo that
// per-RPC credentials are given ("local" for shm:// and unix://, "insecure" for plaintext
// TCP). Worked out at the first call that asks, once for the connection.
func (cc *ClientConn) serverPeer() peer.Peer {
	cc.peerOnce.Do(func() {
		cc.peer.Addr = targetAddr(cc.target)
		if cc.perRPC.auth.kind == "tls" {
			cc.peer.AuthInfo = credentials.TLSInfo{
				State:          tls.ConnectionState{HandshakeComplete: true},
				CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
			}
		} else {
			cc.peer.AuthInfo = cc.perRPC.auth
		}
	})
	return cc.peer
}

// targetAddr is the address of the server target names: a *net.UnixAddr for a unix socket;
// a *net.TCPAddr for TCP, its host name resolved here (the first address, which need not be
// the one connected to; an http:// target the library moved to shared memory, ADR 0013,
// still gives it); and for shm://, or a host that does not resolve, the target itself, whose
// Network is its scheme ("shm").
func targetAddr(target string) net.Addr {
	if name, ok := strings.CutPrefix(target, "unix-abstract:"); ok {
		return &net.UnixAddr{Name: "@" + name, Net: "unix"}
	}
	if path, ok := strings.CutPrefix(target, "unix:"); ok {
		return &net.UnixAddr{Name: strings.TrimPrefix(path, "//"), Net: "unix"}
	}
	if strings.HasPrefix(target, "shm:") {
		return otherAddr(target)
	}
	hostport, _, _ := strings.Cut(authority(target, nil), ",") // ipv4:a,b: the first
	if _, _, err := net.SplitHostPort(hostport); err != nil {
		port := "443"
		if strings.HasPrefix(target, "http://") {
			port = "80"
		}
		hostport = net.JoinHostPort(strings.Trim(hostport, "[]"), port)
	}
	if ap, err := netip.ParseAddrPort(hostport); err == nil {
		return net.TCPAddrFromAddrPort(ap)
	}
	if a, err := net.ResolveTCPAddr("tcp", hostport); err == nil {
		return a
	}
	return otherAddr(target)
}
