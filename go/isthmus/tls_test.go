package isthmus_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	pb "example.invalid/isthmus/go/internal/conformancepb"
	"example.invalid/isthmus/go/isthmus"
)

// TLS between real sockets on 127.0.0.1, with certificates made here: mutual TLS and TLS
// alone, refusals (no client certificate where one is required, an unknown CA, the wrong
// name), settings that do not parse, and grpc-go's TLS credentials on the other side.

const clientCN = "isthmus-test-client"

// pki is a CA and, signed by it, a server certificate (localhost, 127.0.0.1, ::1) and a
// client certificate (clientCN); PEM as isthmus takes it, tls.Certificate as grpc-go does.
type pki struct {
	caPEM                   []byte
	pool                    *x509.CertPool
	serverPEM, serverKeyPEM []byte
	clientPEM, clientKeyPEM []byte
	serverCert, clientCert  tls.Certificate
	// clientTLSWith trusts the CA and shows the client certificate.
	clientTLSWith isthmus.TLSConfig
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	now := time.Now()
	serial := int64(0)
	issue := func(tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey, []byte, []byte) {
		t.Helper()
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		serial++
		tmpl.SerialNumber = big.NewInt(serial)
		tmpl.NotBefore, tmpl.NotAfter = now.Add(-time.Hour), now.Add(time.Hour)
		if parent == nil { // self-signed
			parent, parentKey = tmpl, key
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
		if err != nil {
			t.Fatal(err)
		}
		cert, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return cert, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
			pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	}
	ca, caKey, caPEM, _ := issue(&x509.Certificate{
		Subject:               pkix.Name{CommonName: "isthmus test CA"},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}, nil, nil)
	_, _, serverPEM, serverKeyPEM := issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "localhost"},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, caKey)
	_, _, clientPEM, clientKeyPEM := issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: clientCN},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, ca, caKey)
	p := &pki{caPEM: caPEM, pool: x509.NewCertPool(), serverPEM: serverPEM, serverKeyPEM: serverKeyPEM, clientPEM: clientPEM, clientKeyPEM: clientKeyPEM}
	p.pool.AddCert(ca)
	var err error
	if p.serverCert, err = tls.X509KeyPair(serverPEM, serverKeyPEM); err != nil {
		t.Fatal(err)
	}
	if p.clientCert, err = tls.X509KeyPair(clientPEM, clientKeyPEM); err != nil {
		t.Fatal(err)
	}
	p.clientTLSWith = isthmus.TLSConfig{RootCAs: caPEM, Certificate: clientPEM, Key: clientKeyPEM}
	return p
}

// server is the ServerTLSConfig of p's server certificate; clients' certificates are asked for
// (and checked against p's CA) when asks, required when requires.
func (p *pki) server(asks, requires bool) isthmus.ServerTLSConfig {
	c := isthmus.ServerTLSConfig{Certificate: p.serverPEM, Key: p.serverKeyPEM, RequireClientCert: requires}
	if asks {
		c.ClientCAs = p.caPEM
	}
	return c
}

// startTLSServer serves a peerService over TLS on 127.0.0.1 from this process; its address is
// "https://127.0.0.1:PORT".
func startTLSServer(t *testing.T, c isthmus.ServerTLSConfig) (string, *peerService) {
	t.Helper()
	// The suite's 64 MiB messages: over HTTP/2 a server takes 4 MiB unless told otherwise, as
	// grpc-go's (its counterpart below sets grpc.MaxRecvMsgSize).
	s, svc := startPeerServer(t, []string{"https://127.0.0.1:0"}, isthmus.ServerTLS(c), isthmus.MaxMessageSize(128<<20))
	addresses := s.HTTPAddresses()
	if len(addresses) != 1 || !strings.HasPrefix(addresses[0], "https://127.0.0.1:") {
		t.Fatalf("the server's addresses: %v", addresses)
	}
	return addresses[0], svc
}

func dialTLS(t *testing.T, target string, c isthmus.TLSConfig) *isthmus.ClientConn {
	t.Helper()
	conn, err := isthmus.Dial(target, isthmus.WithTLS(c))
	if err != nil {
		t.Fatalf("dial %s: %v", target, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// checkTLSPeer fails t unless p is a TLS client's on 127.0.0.1 as grpc-go's TLS credentials
// describe it: privacy and integrity, and the client's certificate if it gave one (cn).
func checkTLSPeer(t *testing.T, label string, p *grpcpeer.Peer, cn string) {
	t.Helper()
	if a, ok := p.Addr.(*net.TCPAddr); !ok || !a.IP.Equal(net.IPv4(127, 0, 0, 1)) || a.Port == 0 {
		t.Errorf("%s: Addr %T %v, want a *net.TCPAddr on 127.0.0.1", label, p.Addr, p.Addr)
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		t.Fatalf("%s: AuthInfo %T %v, want credentials.TLSInfo", label, p.AuthInfo, p.AuthInfo)
	}
	if info.SecurityLevel != credentials.PrivacyAndIntegrity || info.AuthType() != "tls" {
		t.Errorf("%s: security level %v, auth type %q", label, info.SecurityLevel, info.AuthType())
	}
	certs := info.State.PeerCertificates
	switch {
	case cn == "" && len(certs) != 0:
		t.Errorf("%s: a client with no certificate shows %q", label, certs[0].Subject.CommonName)
	case cn != "" && (len(certs) == 0 || certs[0].Subject.CommonName != cn):
		t.Errorf("%s: the client's certificates %v, want one for %q", label, certs, cn)
	}
}

// callCode is the code of one unary call on conn (within 30 s).
func callCode(conn grpc.ClientConnInterface) (codes.Code, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := pb.NewEchoClient(conn).Unary(ctx, &pb.EchoRequest{})
	return status.Code(err), err
}

// Mutual TLS between the isthmus Go client and server passes the conformance suite, and the
// handler sees the client's certificate; the client's identity comes from a tls.Certificate
// (CertificatePEM).
func TestMutualTLSBetweenTheGoClientAndServer(t *testing.T) {
	p := newPKI(t)
	address, svc := startTLSServer(t, p.server(true, true))
	chain, key, err := isthmus.CertificatePEM(p.clientCert)
	if err != nil {
		t.Fatal(err)
	}
	conn := dialTLS(t, address, isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: chain, Key: key})
	runSuite(t, "mTLS "+address, conn)
	for _, pr := range peerOfCalls(t, address, conn, svc) {
		checkTLSPeer(t, address, pr, clientCN)
	}
	// The same through "host:port", gRPC's other name for a TCP target.
	hostPort := dialTLS(t, strings.TrimPrefix(address, "https://"), p.clientTLSWith)
	for _, pr := range peerOfCalls(t, "host:port", hostPort, svc) {
		checkTLSPeer(t, "host:port", pr, clientCN)
	}
}

// TLS with no client certificate: to a server that asks none, and to one that asks but does
// not require one; a client that gives one to the latter is known by it.
func TestTLSWithoutAClientCertificate(t *testing.T) {
	p := newPKI(t)
	for _, asks := range []bool{false, true} {
		address, svc := startTLSServer(t, p.server(asks, false))
		conn := dialTLS(t, address, isthmus.TLSConfig{RootCAs: p.caPEM})
		for _, pr := range peerOfCalls(t, address, conn, svc) {
			checkTLSPeer(t, address, pr, "")
		}
		if asks {
			with := dialTLS(t, address, p.clientTLSWith)
			for _, pr := range peerOfCalls(t, address, with, svc) {
				checkTLSPeer(t, address+" with a certificate", pr, clientCN)
			}
		}
	}
}

// Refused handshakes fail calls with codes.Unavailable, as grpc-go's do, and the server goes on.
func TestRefusedTLSHandshakesAreUnavailable(t *testing.T) {
	p, other := newPKI(t), newPKI(t)
	address, _ := startTLSServer(t, p.server(true, true))
	for _, tc := range []struct {
		what string
		tls  isthmus.TLSConfig
	}{
		{"no client certificate where one is required", isthmus.TLSConfig{RootCAs: p.caPEM}},
		{"a client certificate of another CA", isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: other.clientPEM, Key: other.clientKeyPEM}},
		{"a server certificate of an unknown CA", isthmus.TLSConfig{RootCAs: other.caPEM, Certificate: p.clientPEM, Key: p.clientKeyPEM}},
		{"the system's roots only", isthmus.TLSConfig{Certificate: p.clientPEM, Key: p.clientKeyPEM}},
		{"a name the certificate does not carry", isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: p.clientPEM, Key: p.clientKeyPEM, ServerName: "elsewhere.example"}},
	} {
		if code, err := callCode(dialTLS(t, address, tc.tls)); code != codes.Unavailable {
			t.Errorf("%s: %v, want Unavailable", tc.what, err)
		}
	}
	// ServerName replaces the target's host in the check: "localhost" is on the certificate.
	named := p.clientTLSWith
	named.ServerName = "localhost"
	if _, err := callCode(dialTLS(t, address, named)); err != nil {
		t.Errorf("ServerName localhost: %v", err)
	}
}

// Settings that cannot work fail Dial and Start with codes.InvalidArgument and a message that
// says what is wrong.
func TestBadTLSSettingsAreInvalidArguments(t *testing.T) {
	p := newPKI(t)
	shm, unix := fresh(t, "badtls")
	dials := []struct {
		what, target string
		tls          isthmus.TLSConfig
	}{
		{"roots that are no PEM", "https://127.0.0.1:1", isthmus.TLSConfig{RootCAs: []byte("not a certificate")}},
		{"a certificate without its key", "https://127.0.0.1:1", isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: p.clientPEM}},
		{"a key that is no PEM", "https://127.0.0.1:1", isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: p.clientPEM, Key: []byte("not a key")}},
		{"a key that is not the certificate's", "https://127.0.0.1:1", isthmus.TLSConfig{RootCAs: p.caPEM, Certificate: p.clientPEM, Key: p.serverKeyPEM}},
		{"a NUL byte", "https://127.0.0.1:1", isthmus.TLSConfig{RootCAs: append([]byte{0}, p.caPEM...)}},
		{"TLS to shm://", shm, isthmus.TLSConfig{RootCAs: p.caPEM}},
		{"TLS to unix://", unix, isthmus.TLSConfig{RootCAs: p.caPEM}},
		{"TLS to http://", "http://127.0.0.1:1", isthmus.TLSConfig{RootCAs: p.caPEM}},
	}
	for _, tc := range dials {
		conn, err := isthmus.Dial(tc.target, isthmus.WithTLS(tc.tls))
		if err == nil {
			conn.Close()
			t.Errorf("Dial with %s: no error", tc.what)
			continue
		}
		if s := status.Convert(err); s.Code() != codes.InvalidArgument || s.Message() == "" {
			t.Errorf("Dial with %s: %v, want InvalidArgument", tc.what, err)
		}
		t.Logf("Dial with %s: %v", tc.what, err)
	}

	starts := []struct {
		what string
		opts []isthmus.ServerOption
	}{
		{"no key", []isthmus.ServerOption{isthmus.ServerTLS(isthmus.ServerTLSConfig{Certificate: p.serverPEM})}},
		{"no certificate", []isthmus.ServerOption{isthmus.ServerTLS(isthmus.ServerTLSConfig{ClientCAs: p.caPEM})}},
		{"a key that is not the certificate's", []isthmus.ServerOption{isthmus.ServerTLS(isthmus.ServerTLSConfig{Certificate: p.serverPEM, Key: p.clientKeyPEM})}},
		{"a certificate that is no PEM", []isthmus.ServerOption{isthmus.ServerTLS(isthmus.ServerTLSConfig{Certificate: []byte("no"), Key: p.serverKeyPEM})}},
		{"client certificates required with no CA", []isthmus.ServerOption{isthmus.ServerTLS(isthmus.ServerTLSConfig{Certificate: p.serverPEM, Key: p.serverKeyPEM, RequireClientCert: true})}},
		{"an https:// target without TLS settings", nil},
	}
	for _, tc := range starts {
		s := isthmus.NewServer(tc.opts...)
		pb.RegisterEchoServer(s, &peerService{})
		err := s.Start("https://127.0.0.1:0")
		if err == nil {
			s.Stop()
			t.Errorf("Start with %s: no error", tc.what)
			continue
		}
		if s := status.Convert(err); s.Code() != codes.InvalidArgument || s.Message() == "" {
			t.Errorf("Start with %s: %v, want InvalidArgument", tc.what, err)
		}
		t.Logf("Start with %s: %v", tc.what, err)
	}
}

// The isthmus Go client with mutual TLS against a plain grpc-go server with credentials.NewTLS:
// the suite passes and grpc-go's handler sees the client's certificate.
func TestTheGoClientWithTLSAgainstAGrpcGoServer(t *testing.T) {
	p := newPKI(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{p.serverCert},
		ClientCAs:    p.pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
	})
	s := grpc.NewServer(grpc.Creds(creds), grpc.MaxRecvMsgSize(128<<20), grpc.MaxSendMsgSize(128<<20))
	svc := &peerService{}
	pb.RegisterEchoServer(s, svc)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	address := "https://" + lis.Addr().String()
	conn := dialTLS(t, address, p.clientTLSWith)
	runSuite(t, "grpc-go server "+address, conn)
	for _, pr := range peerOfCalls(t, "grpc-go server", conn, svc) {
		checkTLSPeer(t, "grpc-go server", pr, clientCN)
	}
	// Without a client certificate grpc-go refuses the handshake.
	if code, err := callCode(dialTLS(t, address, isthmus.TLSConfig{RootCAs: p.caPEM})); code != codes.Unavailable {
		t.Errorf("no client certificate: %v, want Unavailable", err)
	}
}

// A plain grpc-go client with TLS credentials against the isthmus Go server with mutual TLS:
// the suite passes and the isthmus handler sees the client's certificate.
func TestAGrpcGoClientWithTLSAgainstTheGoServer(t *testing.T) {
	p := newPKI(t)
	address, svc := startTLSServer(t, p.server(true, true))
	creds := credentials.NewTLS(&tls.Config{RootCAs: p.pool, Certificates: []tls.Certificate{p.clientCert}})
	conn, err := grpc.NewClient(strings.TrimPrefix(address, "https://"), grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	runSuite(t, "grpc-go client → "+address, conn, grpc.MaxCallRecvMsgSize(128<<20), grpc.MaxCallSendMsgSize(128<<20))
	for _, pr := range peerOfCalls(t, "grpc-go client", conn, svc) {
		checkTLSPeer(t, "grpc-go client", pr, clientCN)
	}
	// One without a certificate is refused.
	bare, err := grpc.NewClient(strings.TrimPrefix(address, "https://"), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: p.pool})))
	if err != nil {
		t.Fatal(err)
	}
	defer bare.Close()
	if code, err := callCode(bare); code != codes.Unavailable {
		t.Errorf("a grpc-go client with no certificate: %v, want Unavailable", err)
	}
}
