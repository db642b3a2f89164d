package isthmus

/*
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// ShmAddr is the address of a client that called over shared memory (shm://): its process,
// as the kernel named it when the client connected (SO_PEERCRED), so a handler can trust it.
// A handler finds it as peer.FromContext(ctx).Addr.
type ShmAddr struct {
	// PID is the client's process id.
	PID int
	// UID is the user id the client's process ran as.
	UID uint32
}

// Network is "shm".
func (a *ShmAddr) Network() string { return "shm" }

// String is the library's name for the client: "shm:pid=PID,uid=UID".
func (a *ShmAddr) String() string { return fmt.Sprintf("shm:pid=%d,uid=%d", a.PID, a.UID) }

// otherAddr is an address with no type of its own, its text: a client address in a form
// parseAddr does not know ("unknown" when the library could not learn it), or a server's
// shm:// target (targetAddr). Its Network is the text before the first colon.
type otherAddr string

func (a otherAddr) Network() string {
	if network, _, ok := strings.Cut(string(a), ":"); ok {
		return network
	}
	return string(a)
}

func (a otherAddr) String() string { return string(a) }

// unescapeAddr undoes grpc-core's URI form, which escapes the brackets of an IPv6 address (and
// the % of a zone).
var unescapeAddr = strings.NewReplacer("%5B", "[", "%5D", "]", "%25", "%")

// parseAddr is the net.Addr of a client address in the library's (gRPC's) forms:
// "ipv4:127.0.0.1:5000" and "ipv6:%5B::1%5D:5000" (or with plain brackets) are *net.TCPAddr,
// "unix:" and "unix:/path" *net.UnixAddr, "shm:pid=P,uid=U" *ShmAddr.
func parseAddr(s string) net.Addr {
	network, rest, _ := strings.Cut(s, ":")
	switch network {
	case "ipv4", "ipv6":
		rest = unescapeAddr.Replace(rest)
		if ap, err := netip.ParseAddrPort(rest); err == nil {
			return net.TCPAddrFromAddrPort(ap)
		}
	case "unix":
		return &net.UnixAddr{Name: strings.TrimPrefix(rest, "//"), Net: "unix"}
	case "shm":
		pid, uid, _ := strings.Cut(rest, ",")
		p, perr := strconv.Atoi(strings.TrimPrefix(pid, "pid="))
		u, uerr := strconv.ParseUint(strings.TrimPrefix(uid, "uid="), 10, 32)
		if perr == nil && uerr == nil {
			return &ShmAddr{PID: p, UID: uint32(u)}
		}
	}
	return otherAddr(s)
}

// peerKey is the key peer.FromContext looks its value up with (unexported by grpc-go),
// learned once by asking a context that keeps the key it is asked for.
var peerKey = func() any {
	var probe keyProbe
	peer.FromContext(&probe)
	return probe.key
}()

// keyProbe is a context that remembers the last key its Value was asked for.
type keyProbe struct {
	context.Context
	key any
}

func (p *keyProbe) Value(key any) any {
	p.key = key
	return nil
}

// peerOf is the client of sc as grpc-go's peer.FromContext gives it to handlers: its address,
// and for a call over TLS a credentials.TLSInfo. Read when the call arrives: the library's
// strings go with the call's finish.
func peerOf(sc *C.isthmus_server_call_t) *peer.Peer {
	var n C.size_t
	addr := C.GoStringN((*C.char)(unsafe.Pointer(C.isthmus_server_call_peer(sc, &n))), C.int(n))
	p := &peer.Peer{Addr: parseAddr(addr)}
	// A call over shm:// is never TLS: asking would cost the most common calls a cgo call
	// each for nothing.
	if !strings.HasPrefix(addr, "shm:") && C.isthmus_server_call_is_tls(sc) != 0 {
		p.AuthInfo = tlsInfo(sc)
	}
	return p
}

// tlsInfo is what grpc-go's TLS credentials tell a handler of its client: privacy and
// integrity, and under mutual TLS the client's certificate. The library does not give the rest
// of the handshake (version, cipher suite, verified chains), which stays zero.
func tlsInfo(sc *C.isthmus_server_call_t) credentials.TLSInfo {
	info := credentials.TLSInfo{
		State:          tls.ConnectionState{HandshakeComplete: true},
		CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
	}
	var n C.size_t
	der := C.isthmus_server_call_peer_cert(sc, &n)
	if der != nil && n > 0 {
		if cert := parseCert(unsafe.Slice((*byte)(unsafe.Pointer(der)), int(n))); cert != nil {
			info.State.PeerCertificates = []*x509.Certificate{cert}
		}
	}
	return info
}

// certs are the parsed certificates of recent mutual-TLS clients, by DER: every call of a
// connection brings the same one, which grpc-go parses once per connection and which would
// cost each call microseconds to parse again. The map is emptied when full, which bounds it
// whatever the number of clients.
var certs struct {
	sync.Mutex
	byDER map[string]*x509.Certificate
}

const maxCerts = 64

// parseCert is the certificate der (a view the caller keeps valid) encodes, shared with other
// calls by the same client; nil if it does not parse, which the library's TLS would not have
// let through.
func parseCert(der []byte) *x509.Certificate {
	certs.Lock()
	defer certs.Unlock()
	if c, ok := certs.byDER[string(der)]; ok {
		return c
	}
	c, err := x509.ParseCertificate(append([]byte(nil), der...))
	if err != nil {
		return nil
	}
	if len(certs.byDER) >= maxCerts || certs.byDER == nil {
		certs.byDER = make(map[string]*x509.Certificate)
	}
	certs.byDER[string(der)] = c
	return c
}
