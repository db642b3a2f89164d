package isthmus

/*
#cgo CFLAGS: -I${SRCDIR}/../../crates/isthmus-capi/include
#cgo LDFLAGS: -listhmus_capi
#include <stdlib.h>
#include "isthmus.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// This file holds what every other file uses of the C ABI: metadata, statuses, messages and
// the strings that outlive a call.

func init() {
	if v := uint32(C.isthmus_abi_version()); v != C.ISTHMUS_ABI_VERSION {
		panic(fmt.Sprintf("isthmus: libisthmus_capi speaks ABI %d, this package was built for %d", v, C.ISTHMUS_ABI_VERSION))
	}
}

// cStrings interns the C copies of method paths: a path is made once per process, not per
// call, for up to maxInterned paths. A process calls few methods, each many times; a proxy
// that passes on its callers' paths would otherwise grow the cache without end.
var (
	cStrings sync.Map // string -> *C.char
	interned atomic.Int64
)

const maxInterned = 4096

// cString is the C copy of a method path for one call, and what to run once the call has
// taken it: nothing for an interned path, the free of a copy made for this call alone.
func cString(s string) (*C.char, func()) {
	if p, ok := cStrings.Load(s); ok {
		return p.(*C.char), keep
	}
	mine := C.CString(s)
	if interned.Load() >= maxInterned {
		return mine, func() { C.free(unsafe.Pointer(mine)) }
	}
	p, loaded := cStrings.LoadOrStore(s, mine)
	if loaded { // another goroutine interned it first
		C.free(unsafe.Pointer(mine))
	} else {
		interned.Add(1)
	}
	return p.(*C.char), keep
}

func keep() {}

// noNUL refuses a string the library takes as a C string that holds a NUL: C would read it
// cut there (another target, another method).
func noNUL(what, s string) error {
	if strings.IndexByte(s, 0) >= 0 {
		return status.Errorf(codes.InvalidArgument, "%s %q holds a NUL", what, s)
	}
	return nil
}

// bytesPtr is the C view of b's bytes for the duration of one cgo call (nil when empty).
func bytesPtr(b []byte) *C.uint8_t {
	if len(b) == 0 {
		return nil
	}
	return (*C.uint8_t)(unsafe.Pointer(unsafe.SliceData(b)))
}

// reserved reports the keys that isthmus keeps for itself and leaves out of what it sends:
// gRPC's own (grpc-status, grpc-timeout, ...), pseudo-headers, content-type, te and
// user-agent, as grpc-go leaves them out, and every other grpc- key too, which the library
// refuses. grpc-go sends those others (grpc-trace-bin, grpc-previous-rpc-attempts, ...):
// here they are dropped, a known difference.
func reserved(key string) bool {
	return strings.HasPrefix(key, "grpc-") || strings.HasPrefix(key, ":") ||
		key == "content-type" || key == "te" || key == "user-agent"
}

// validateMetadata refuses what grpc-go's client refuses to send, with its code
// (codes.Internal) and words: an empty key, a key with a character outside [0-9a-z-_.] (a
// pseudo-header's ":" aside), and a value of a key not ending in "-bin" with a byte outside
// printable ASCII.
func validateMetadata(md metadata.MD) error {
	for k, vs := range md {
		if err := validatePair(k, vs); err != nil {
			return status.Error(codes.Internal, err.Error())
		}
	}
	return nil
}

// validateOutgoing is validateMetadata of a call's outgoing metadata as grpc-go's client
// checks them: with the keys as the caller wrote them, so that an upper-case key in a
// metadata.MD literal fails the call. metadata.FromOutgoingContext lowercases the keys, and
// such a key went out lowercased.
func validateOutgoing(ctx context.Context) error {
	md, added, _ := outgoingRaw(ctx)
	if err := validateMetadata(md); err != nil {
		return err
	}
	for _, kv := range added {
		for i := 0; i+1 < len(kv); i += 2 {
			if err := validatePair(kv[i], kv[i+1:i+2]); err != nil {
				return status.Error(codes.Internal, err.Error())
			}
		}
	}
	return nil
}

// outgoingRaw is the outgoing metadata of ctx as NewOutgoingContext took it, and the pairs
// AppendToOutgoingContext added since: what grpc-go's client validates, which the metadata
// package gives only to grpc's internal packages (internal.FromOutgoingContextRaw). A grpc
// release without it fails the build here; one that changed its signature would not (a
// linkname is not type-checked): TestOutgoingRawReadsTheCallersKeys pins what it returns.
//
//go:linkname outgoingRaw google.golang.org/grpc/metadata.fromOutgoingContextRaw
func outgoingRaw(ctx context.Context) (md metadata.MD, added [][]string, ok bool)

func validatePair(key string, values []string) error {
	if key == "" {
		return errors.New("there is an empty key in the header")
	}
	if key[0] == ':' {
		return nil
	}
	for i := 0; i < len(key); i++ {
		switch c := key[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			return fmt.Errorf("header key %q contains illegal characters not in [0-9a-z-_.]", key)
		}
	}
	if strings.HasSuffix(key, "-bin") {
		return nil
	}
	for _, v := range values {
		for i := 0; i < len(v); i++ {
			if v[i] < 0x20 || v[i] > 0x7e {
				return fmt.Errorf("header key %q contains value with non-printable ASCII characters", key)
			}
		}
	}
	return nil
}

// newMetadata copies md into a C metadata handle (nil when md has nothing to send); the
// caller frees it.
func newMetadata(md metadata.MD) (*C.isthmus_metadata_t, error) {
	if len(md) == 0 {
		return nil, nil
	}
	var h *C.isthmus_metadata_t
	for k, vs := range md {
		if reserved(k) {
			continue
		}
		if h == nil {
			h = C.isthmus_metadata_new()
		}
		ck := C.CString(k)
		for _, v := range vs {
			var st *C.isthmus_status_t
			code := C.isthmus_metadata_add(h, ck, (*C.uint8_t)(unsafe.Pointer(unsafe.StringData(v))), C.size_t(len(v)), &st)
			if code != C.ISTHMUS_OK {
				C.free(unsafe.Pointer(ck))
				C.isthmus_metadata_free(h)
				err, _ := statusError(code, st)
				return nil, err
			}
		}
		C.free(unsafe.Pointer(ck))
	}
	return h, nil
}

// takeMetadata copies a C metadata handle into Go and frees it (nil for nil).
func takeMetadata(h *C.isthmus_metadata_t) metadata.MD {
	if h == nil {
		return nil
	}
	defer C.isthmus_metadata_free(h)
	n := int(C.isthmus_metadata_len(h))
	md := make(metadata.MD, n)
	for i := 0; i < n; i++ {
		var k, v *C.uint8_t
		var kl, vl C.size_t
		if C.isthmus_metadata_get(h, C.size_t(i), &k, &kl, &v, &vl) != C.ISTHMUS_OK {
			break
		}
		key := C.GoStringN((*C.char)(unsafe.Pointer(k)), C.int(kl))
		md[key] = append(md[key], C.GoStringN((*C.char)(unsafe.Pointer(v)), C.int(vl)))
	}
	return md
}

// freeMetadata frees a handle the caller does not want.
func freeMetadata(h *C.isthmus_metadata_t) {
	if h != nil {
		C.isthmus_metadata_free(h)
	}
}

// liveHandles is the library's count of handles made and not yet freed: what the tests
// compare to see that a call gave back everything it took.
func liveHandles() int { return int(C.isthmus_live_handles()) }

// statusError turns a failure code and its status handle (freed here; may be nil) into a
// status.Status error, with the status's details, and the trailing metadata that came with it.
func statusError(code C.isthmus_code_t, st *C.isthmus_status_t) (error, metadata.MD) {
	if st == nil {
		return status.Error(codes.Code(code), C.GoString(C.isthmus_code_name(code))), nil
	}
	msg := C.GoString(C.isthmus_status_message(st))
	trailers := takeMetadata(C.isthmus_status_trailers(st))
	var n C.size_t
	details := messageBytes(C.isthmus_status_details(st, &n), n)
	err := withDetails(codes.Code(code), msg, details)
	C.isthmus_status_free(st)
	return err, trailers
}

// withDetails is the error of a status with code, msg and the details bytes the server sent
// (a serialized google.rpc.Status, read before the status handle holding them is freed), read
// as grpc-go's client reads grpc-status-details-bin: details of the same code are the status
// whole, their own message included; details of another code make the call INTERNAL, in
// grpc-go's words; details that do not decode are left out.
func withDetails(code codes.Code, msg string, details []byte) error {
	if len(details) == 0 {
		return status.Error(code, msg)
	}
	p := new(spb.Status)
	if err := proto.Unmarshal(details, p); err != nil {
		return status.Error(code, msg)
	}
	if p.Code != int32(code) {
		return status.Errorf(codes.Internal,
			"grpc-status-details-bin mismatch: grpc-status=%v, grpc-message=%q, grpc-status-details-bin=%+v", code, msg, p)
	}
	return status.FromProto(p).Err()
}

// detailsOf is what a server sends as the details of s: s as a serialized google.rpc.Status
// when it carries details (status.WithDetails), else nothing. The library sends a code above
// 16 as UNKNOWN (as tonic does), so the details say UNKNOWN too: details of another code than
// the status's fail the call INTERNAL in every client (withDetails, grpc-go's).
func detailsOf(s *status.Status) []byte {
	p := s.Proto() // a copy
	if len(p.GetDetails()) == 0 {
		return nil
	}
	if uint32(p.Code) > uint32(codes.Unauthenticated) {
		p.Code = int32(codes.Unknown)
	}
	b, err := proto.Marshal(p)
	if err != nil {
		return nil
	}
	return b
}

// messageBytes is a view of a received message's bytes; valid until the message is freed.
func messageBytes(data *C.uint8_t, n C.size_t) []byte {
	if data == nil || n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(data)), int(n))
}

// ABIVersion is the C ABI version of the loaded library (one cgo call: the benchmarks time
// it as the cost of crossing into C).
func ABIVersion() uint32 { return uint32(C.isthmus_abi_version()) }
