package isthmus

/*
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TLSConfig is a ClientConn's TLS settings (WithTLS), copied by Dial.
type TLSConfig struct {
	// RootCAs are the PEM certificates (one or more) of the CAs that sign the server's
	// certificate; nil trusts the system's roots. (A *x509.CertPool cannot be read back,
	// hence PEM.)
	RootCAs []byte
	// Certificate is the client's certificate chain in PEM, leaf first, shown to a server that
	// asks for one (mutual TLS); nil for none. Key is its private key (PKCS#8, PKCS#1 or SEC1
	// PEM). CertificatePEM gives both from a tls.Certificate.
	Certificate, Key []byte
	// ServerName is the name the server's certificate must carry, in place of the target's
	// host, as tls.Config.ServerName does for grpc-go's credentials.NewTLS; "" for the host.
	ServerName string
}

// ServerTLSConfig is a Server's TLS settings (ServerTLS), copied by Start.
type ServerTLSConfig struct {
	// Certificate is the server's certificate chain in PEM, leaf first; Key is its private
	// key (PKCS#8, PKCS#1 or SEC1 PEM). Both are needed.
	Certificate, Key []byte
	// ClientCAs are the PEM certificates of the CAs that sign clients' certificates. With
	// them the server asks each client for a certificate (mutual TLS); nil asks none.
	ClientCAs []byte
	// RequireClientCert refuses a client without a certificate signed by ClientCAs, as
	// tls.RequireAndVerifyClientCert does; false lets it in without one (a certificate it
	// shows must still verify). Needs ClientCAs.
	RequireClientCert bool
}

// WithTLS makes the connection to a TCP target ("https://host:port", "host:port", "dns:",
// "ipv4:"…) use TLS with c. Without it, "https://" trusts the system's roots and other
// targets are plaintext; with it, Dial refuses shm://, unix:// and http:// targets
// (codes.InvalidArgument), as it does PEM that does not parse.
func WithTLS(c TLSConfig) DialOption {
	return func(o *dialOptions) { o.tls = &c }
}

// ServerTLS makes the server's TCP targets ("https://host:port", "host:port", "[::]:port"…)
// serve TLS with c; "http://" targets stay plaintext, and shm:// and unix:// ones are local
// (shm:// clients are known by their process credentials instead). Start reports settings that
// do not work with codes.InvalidArgument. Without it an "https://" target does not start.
func ServerTLS(c ServerTLSConfig) ServerOption {
	return func(o *serverOptions) { o.tls = &c }
}

// CertificatePEM encodes c, as tls.LoadX509KeyPair or tls.X509KeyPair give it, into the PEM
// chain and key that TLSConfig and ServerTLSConfig take. The key must be one
// x509.MarshalPKCS8PrivateKey knows (RSA, ECDSA, Ed25519): a key that only signs (in a
// hardware module, say) cannot be handed to the library.
func CertificatePEM(c tls.Certificate) (chain, key []byte, err error) {
	if len(c.Certificate) == 0 {
		return nil, nil, errors.New("isthmus: the tls.Certificate has no certificate")
	}
	der, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		return nil, nil, fmt.Errorf("isthmus: the certificate's private key: %w", err)
	}
	for _, cert := range c.Certificate {
		chain = append(chain, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert})...)
	}
	return chain, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// cTLS is TLS settings as the C ABI takes them, in C memory (cgo lets no Go pointer be
// passed inside the options): free releases them once the function given them has returned,
// since it copies them.
type cTLS struct {
	opts    *C.isthmus_tls_options_t
	strings []*C.char
}

// pemField is one string of the C settings: where it goes, its value, and its name for errors.
type pemField struct {
	dst  **C.char
	b    []byte
	what string
}

// newCTLS is empty C settings: every field NULL or 0.
func newCTLS() *cTLS {
	return &cTLS{opts: (*C.isthmus_tls_options_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.isthmus_tls_options_t{}))))}
}

// set fills the settings' strings with fields (empty ones stay NULL).
func (t *cTLS) set(fields ...pemField) error {
	for _, f := range fields {
		if len(f.b) == 0 {
			continue
		}
		// C would take a NUL byte for the string's end and read less than was given.
		if bytes.IndexByte(f.b, 0) >= 0 {
			return status.Errorf(codes.InvalidArgument, "%s holds a NUL byte", f.what)
		}
		*f.dst = C.CString(string(f.b))
		t.strings = append(t.strings, *f.dst)
	}
	return nil
}

func (t *cTLS) free() {
	for _, s := range t.strings {
		C.free(unsafe.Pointer(s))
	}
	C.free(unsafe.Pointer(t.opts))
}

// pairErr says what is missing when one of a certificate and its key is given without the
// other (the library would say it in its C names); nil if not.
func pairErr(cert, key []byte, kind string) error {
	switch {
	case len(cert) > 0 && len(key) == 0:
		return status.Errorf(codes.InvalidArgument, "%s.Certificate needs its private key, %[1]s.Key", kind)
	case len(cert) == 0 && len(key) > 0:
		return status.Errorf(codes.InvalidArgument, "%s.Key needs its certificate, %[1]s.Certificate", kind)
	}
	return nil
}

// clientTLS is c in C; the caller frees it (also after an error).
func clientTLS(c *TLSConfig) (*cTLS, error) {
	t := newCTLS()
	if err := pairErr(c.Certificate, c.Key, "TLSConfig"); err != nil {
		return t, err
	}
	o := t.opts
	return t, t.set(
		pemField{&o.root_certs_pem, c.RootCAs, "TLSConfig.RootCAs"},
		pemField{&o.cert_chain_pem, c.Certificate, "TLSConfig.Certificate"},
		pemField{&o.private_key_pem, c.Key, "TLSConfig.Key"},
		pemField{&o.server_name, []byte(c.ServerName), "TLSConfig.ServerName"},
	)
}

// serverTLS is c in C; the caller frees it (also after an error).
func serverTLS(c *ServerTLSConfig) (*cTLS, error) {
	t := newCTLS()
	if len(c.Certificate) == 0 && len(c.Key) == 0 {
		return t, status.Error(codes.InvalidArgument, "a server's TLS needs its certificate and key, ServerTLSConfig.Certificate and .Key")
	}
	if err := pairErr(c.Certificate, c.Key, "ServerTLSConfig"); err != nil {
		return t, err
	}
	if c.RequireClientCert && len(c.ClientCAs) == 0 {
		return t, status.Error(codes.InvalidArgument, "ServerTLSConfig.RequireClientCert needs ServerTLSConfig.ClientCAs to check clients' certificates with")
	}
	o := t.opts
	if c.RequireClientCert {
		o.require_client_cert = 1
	}
	return t, t.set(
		pemField{&o.root_certs_pem, c.ClientCAs, "ServerTLSConfig.ClientCAs"},
		pemField{&o.cert_chain_pem, c.Certificate, "ServerTLSConfig.Certificate"},
		pemField{&o.private_key_pem, c.Key, "ServerTLSConfig.Key"},
	)
}
