/*
 * isthmus.h: the isthmus C ABI (typed RPC between processes on one machine, at shared-memory
 * speed; standard gRPC over HTTP/2 beyond it). Generated from crates/isthmus-capi by cbindgen:
 * do not edit.
 *
 * The rules every function keeps:
 *
 * - Handles. Every object is an opaque pointer made by a _new/_connect/_start function (or
 *   handed out in an event) and released by exactly one _free/_close/_finish. A NULL, a handle
 *   freed already, or a pointer that is no handle of that type is refused with
 *   ISTHMUS_INVALID_ARGUMENT instead of crashing.
 * - Errors. Fallible functions return an isthmus_code_t: ISTHMUS_OK (0) or a gRPC status code.
 *   Where a function takes `isthmus_status_t **status` and it is not NULL, a failure stores a
 *   status there (code, message, trailers) for the caller to free with isthmus_status_free;
 *   success stores NULL. No panic crosses the boundary (ISTHMUS_INTERNAL instead).
 * - Memory. Byte arguments are (pointer, length) pairs, copied or sent before the function
 *   returns. Strings are NUL-terminated UTF-8. Pointers into an object (a message's bytes, a
 *   block's bytes, a status's message, a metadata entry) stay valid until that object is freed.
 * - Threads. Every function may be called from any thread; a call's sending side and its
 *   receiving side may be used from two threads at once.
 * - Blocking. Functions without _async block until done (bounded by the call's timeout). Each
 *   _async function returns at once and its result arrives as an isthmus_event_t on a completion
 *   queue whose file descriptor an event loop watches (isthmus_cq_fd, isthmus_cq_poll).
 * - Versions. ISTHMUS_ABI_VERSION changes when a function or struct changes incompatibly;
 *   compare it with isthmus_abi_version() at load time.
 */

#ifndef ISTHMUS_H
#define ISTHMUS_H

#include <stddef.h>
#include <stdint.h>

// The version of this ABI. It changes when a function or a struct changes incompatibly;
// functions are added without a change. See `docs/capi.md`.
#define ISTHMUS_ABI_VERSION 1

// Call flag: if no server is reachable, keep trying until the deadline instead of failing at
// once with UNAVAILABLE (gRPC's `wait_for_ready`).
#define ISTHMUS_CALL_WAIT_FOR_READY 1

// Call flag for `_async` calls given a `now` event: the operation may wait for its reply on
// the calling thread for up to the connection's spin bound (50 µs by default) before it
// returns, so that a fast reply comes back in `now` with no wake-up at all. Without it the
// calling thread never waits (for an event loop's own thread).
#define ISTHMUS_CALL_SPIN 2

// Connectivity states (`isthmus_channel_state`), numbered as gRPC numbers them (grpc-go's
// `connectivity.State`, grpcio's `ChannelConnectivity`): no connection and none being made.
#define ISTHMUS_STATE_IDLE 0

// A connection is being made.
#define ISTHMUS_STATE_CONNECTING 1

// A connection is up: calls go out at once.
#define ISTHMUS_STATE_READY 2

// The last attempt to connect failed.
#define ISTHMUS_STATE_TRANSIENT_FAILURE 3

// The channel was closed.
#define ISTHMUS_STATE_SHUTDOWN 4

// `isthmus_proto_method_type`: the request's type.
#define ISTHMUS_PROTO_REQUEST 0

// `isthmus_proto_method_type`: the response's type.
#define ISTHMUS_PROTO_RESPONSE 1

// Receive flag: if the call has sent nothing yet and must wait for a request, send its
// (empty) initial metadata first. A client that sends its first request only once the
// response has opened (tonic's generated streaming clients do) is then not left waiting on a
// handler that waits for that request; initial metadata can no longer be sent after it.
#define ISTHMUS_RECV_FLUSH_HEADERS 1

// Receive flag for `isthmus_server_call_recv_async` with a `now` event: a request that comes
// within 50 µs (a fixed bound) is taken on the calling thread and returned in `now`, without
// the two wake-ups a trip through the queue costs (as `isthmus_call_recv_spin` on the
// client's side). The thread spins, yielding its core between looks after the first
// microseconds.
#define ISTHMUS_RECV_SPIN 2

// A writable block in this side's shared memory, from `isthmus_call_alloc` or
// `isthmus_server_call_alloc`: fill it, then send it without a copy.
typedef struct isthmus_block_t isthmus_block_t;

// One client call of any shape. Its sending side (`send`, `close_send`, `alloc`,
// `send_block`) and its receiving side (`recv`, `headers`) may be used from two threads at
// once.
typedef struct isthmus_call_t isthmus_call_t;

// A channel to one server: `shm://NAME` or `shm:///path.sock` (shared memory), or
// `unix:///path.sock` and `http://host:port` (standard gRPC over HTTP/2). Connects on its
// first call and again after the server went away.
typedef struct isthmus_channel_t isthmus_channel_t;

// A completion queue (see the module's documentation). Free it with `isthmus_cq_free` once
// nothing uses it.
typedef struct isthmus_cq_t isthmus_cq_t;

// A received message. Over `shm://` a large one is a view into the sender's shared memory,
// not a copy: holding it keeps that memory from the sender, so free it when done.
typedef struct isthmus_message_t isthmus_message_t;

// Metadata: an ordered list of (key, value) entries under gRPC's rules (lower-case keys;
// keys ending in `-bin` carry bytes, others printable ASCII).
typedef struct isthmus_metadata_t isthmus_metadata_t;

// Message types and services loaded from `.proto` files or a descriptor set. Free it with
// `isthmus_proto_free`.
typedef struct isthmus_proto_t isthmus_proto_t;

// The server's side of one call, handed to a handler. The handler ends it with
// `isthmus_server_call_finish`, exactly once, which also frees the handle; until then its
// operations may be used from any thread. A call the client cancelled, or whose deadline
// passed, stays a valid handle whose operations fail with `ISTHMUS_CANCELLED`: finish it
// all the same.
typedef struct isthmus_server_call_t isthmus_server_call_t;

// A server: handlers by method path, served on one or more targets at once.
typedef struct isthmus_server_t isthmus_server_t;

// A gRPC status: code, message and trailing metadata.
typedef struct isthmus_status_t isthmus_status_t;

// A gRPC status code: 0 is OK.
typedef int32_t isthmus_code_t;

// Options of a channel. Zero-initialise it, then set what you need; NULL means defaults.
typedef struct {
  // The largest message this side accepts, in bytes; 0 for the default (4 GiB).
  uint64_t max_message_size;
} isthmus_channel_options_t;

// Options of one call. Zero-initialise it, then set what you need; a NULL
// `isthmus_call_options_t*` means all defaults.
typedef struct {
  // The call's deadline, in microseconds from its start; 0 or less for none.
  int64_t timeout_us;
  // Initial metadata to send (NULL for none). Copied; the caller still frees it.
  const isthmus_metadata_t *metadata;
  // `ISTHMUS_CALL_WAIT_FOR_READY`, or 0.
  uint32_t flags;
} isthmus_call_options_t;

// Which operation an event completes.
typedef int32_t isthmus_op_t;

// One finished operation. Every non-NULL handle in it belongs to the caller, who frees it.
typedef struct {
  // The tag the operation was started with.
  uint64_t tag;
  // Which operation (`ISTHMUS_OP_*`).
  isthmus_op_t op;
  // `ISTHMUS_OK`, or the failure's code (then `status` says why).
  isthmus_code_t code;
  // `ISTHMUS_OP_START`: the started call.
  isthmus_call_t *call;
  // `ISTHMUS_OP_NEW_CALL`: the call for the handler, to finish with
  // `isthmus_server_call_finish`.
  isthmus_server_call_t *server_call;
  // `ISTHMUS_OP_RECV`, `ISTHMUS_OP_UNARY`: the message; NULL at the end of the stream.
  isthmus_message_t *message;
  // The message's bytes (as `isthmus_message_data` gives them), valid until it is freed.
  const uint8_t *message_data;
  // The message's length.
  size_t message_len;
  // `ISTHMUS_OP_HEADERS`, `ISTHMUS_OP_UNARY`: the initial metadata; NULL when there is
  // none.
  isthmus_metadata_t *metadata;
  // `ISTHMUS_OP_UNARY`: the trailing metadata; NULL when there is none.
  isthmus_metadata_t *trailers;
  // On failure: the status (code, message, trailers).
  isthmus_status_t *status;
} isthmus_event_t;

// Options of a server. Zero-initialise it, then set what you need; NULL means defaults.
typedef struct {
  // The largest request message accepted, in bytes; 0 for the default (4 GiB). A larger
  // one fails its call with RESOURCE_EXHAUSTED and the server goes on.
  uint64_t max_message_size;
  // Calls one client connection may have open at once; 0 for no limit. A call over the
  // limit is refused with RESOURCE_EXHAUSTED.
  uint32_t max_concurrent_streams;
} isthmus_server_options_t;

// A handler callback: called on one of the library's threads for each new call on its path,
// with the `user_data` given at registration. It must not block for long: hand the call to
// your own thread or loop, and finish it there (or here, if the answer is at hand).
typedef void (*isthmus_handler_fn)(void *user_data,
                                   isthmus_server_call_t *call);

// The call succeeded.
#define ISTHMUS_OK 0

// The operation was cancelled.
#define ISTHMUS_CANCELLED 1

// An error of no other kind.
#define ISTHMUS_UNKNOWN 2

// The caller gave an invalid argument (a NULL, a freed handle, a bad target or path).
#define ISTHMUS_INVALID_ARGUMENT 3

// The deadline passed before the operation completed.
#define ISTHMUS_DEADLINE_EXCEEDED 4

// Nothing is registered at the method path.
#define ISTHMUS_NOT_FOUND 5

// What the caller tried to create exists.
#define ISTHMUS_ALREADY_EXISTS 6

// The caller may not do this.
#define ISTHMUS_PERMISSION_DENIED 7

// A limit was hit (a message larger than the peer accepts, too many calls).
#define ISTHMUS_RESOURCE_EXHAUSTED 8

// The system is not in a state the operation needs.
#define ISTHMUS_FAILED_PRECONDITION 9

// The operation was aborted.
#define ISTHMUS_ABORTED 10

// Out of range.
#define ISTHMUS_OUT_OF_RANGE 11

// Not implemented (by this transport, or by the server).
#define ISTHMUS_UNIMPLEMENTED 12

// An invariant broke (malformed data from a peer; a panic caught at the boundary).
#define ISTHMUS_INTERNAL 13

// The peer is not reachable or went away.
#define ISTHMUS_UNAVAILABLE 14

// Unrecoverable data loss.
#define ISTHMUS_DATA_LOSS 15

// The caller did not authenticate.
#define ISTHMUS_UNAUTHENTICATED 16

// `isthmus_unary_async`.
#define ISTHMUS_OP_UNARY 1

// `isthmus_call_start_async`.
#define ISTHMUS_OP_START 2

// `isthmus_call_send_async`, `isthmus_server_call_send_async`.
#define ISTHMUS_OP_SEND 3

// `isthmus_call_close_send_async`.
#define ISTHMUS_OP_CLOSE_SEND 4

// `isthmus_call_recv_async`, `isthmus_server_call_recv_async`.
#define ISTHMUS_OP_RECV 5

// `isthmus_call_headers_async`.
#define ISTHMUS_OP_HEADERS 6

// A new call for a handler registered with `isthmus_server_add_handler_cq`.
#define ISTHMUS_OP_NEW_CALL 7

// `isthmus_server_call_send_headers_async`.
#define ISTHMUS_OP_SEND_HEADERS 8

// `isthmus_server_call_done_async`: the call is over (finished, cancelled by its client, or
// past its deadline).
#define ISTHMUS_OP_DONE 9

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The ABI version of the loaded library ([`ISTHMUS_ABI_VERSION`] when it was built): compare
// with the header's before use.
uint32_t isthmus_abi_version(void);

// The gRPC name of `code` (`"UNAVAILABLE"`), static and NUL-terminated; `"UNKNOWN"` for a
// number that is no code.
const char *isthmus_code_name(isthmus_code_t code);

// The number of handles made and not yet freed, of every type. A handle lives in this
// library's registry until it is freed, so a leak checker (LeakSanitizer, valgrind) sees one
// never freed as reachable, not leaked: a test that wants to know it freed everything compares
// this with its value before (or with 0 at the end).
size_t isthmus_live_handles(void);

// The status's code (`ISTHMUS_INVALID_ARGUMENT` for an invalid handle).
isthmus_code_t isthmus_status_code(const isthmus_status_t *status);

// The status's message, NUL-terminated, valid until the status is freed ("" for an invalid
// handle).
const char *isthmus_status_message(const isthmus_status_t *status);

// Frees a status.
isthmus_code_t isthmus_status_free(isthmus_status_t *status);

// Makes a channel to `target`. It connects on its first call, so this fails only for a
// target it cannot parse (`ISTHMUS_INVALID_ARGUMENT`). Close it with `isthmus_channel_close`.
//
// # Safety
//
// `target` is a NUL-terminated string; `opts` is NULL or valid; `out` is writable; `status`
// is NULL or writable.
isthmus_code_t isthmus_channel_new(const char *target,
                                   const isthmus_channel_options_t *opts,
                                   isthmus_channel_t **out,
                                   isthmus_status_t **status);

// Closes a channel and frees its handle. Calls in progress go on until they end; new calls
// on a closed handle are not possible (the handle is gone).
isthmus_code_t isthmus_channel_close(isthmus_channel_t *channel);

// Sets how long a unary call started with `ISTHMUS_CALL_SPIN` on this channel waits for its
// reply on the calling thread before it leaves the reply to the completion queue, in µs (the
// default is the connection's spin bound, 50 µs). An event loop that has other work when
// replies are slow (nginx under load) waits less; with 0 the request is still sent on the
// calling thread, and a thread of the library's pool waits for the reply. A request over
// 1 KiB waits longer by the time the server needs to read it: 0.25 µs per KiB, at most 50 µs
// more (a spin of 0 stays 0).
isthmus_code_t isthmus_channel_set_spin(const isthmus_channel_t *channel,
                                        uint32_t spin_us);

// The channel's connectivity state (`ISTHMUS_STATE_*`) into `*state`. With `try_to_connect`
// not 0, an IDLE or failed channel starts connecting in the background (retrying with
// backoff until it is READY), as grpc-go's `Connect` and grpcio's `try_to_connect`; the
// calling thread never waits for it.
//
// # Safety
//
// `state` is writable.
isthmus_code_t isthmus_channel_state(const isthmus_channel_t *channel,
                                     int32_t try_to_connect,
                                     uint32_t *state);

// Blocks until the channel's state is not `last` (an `ISTHMUS_STATE_*`), for at most
// `timeout_ms` milliseconds: `ISTHMUS_OK` with the new state in `*state`, or
// `ISTHMUS_DEADLINE_EXCEEDED` with the state, still `last`, if the time ran out (grpc-go's
// `WaitForStateChange`). Closing the channel from another thread moves it to SHUTDOWN.
//
// # Safety
//
// `state` is writable.
isthmus_code_t isthmus_channel_wait_state(const isthmus_channel_t *channel,
                                          uint32_t last,
                                          uint32_t timeout_ms,
                                          uint32_t *state);

// A unary call, blocking: sends `request` to `path` (`/package.Service/Method`) and waits
// for the one response. On success `*reply` holds the response message; `*headers` and
// `*trailers` (each out-pointer may be NULL) the server's initial and trailing metadata, or
// NULL when there is none. All are the caller's to free. On failure they are set to NULL and `*status` (if not NULL) says why.
//
// # Safety
//
// `path` is NUL-terminated; `request` is valid for `request_len` bytes; `opts` is NULL or
// valid; each out-pointer is NULL or writable (`reply` must not be NULL).
isthmus_code_t isthmus_unary(const isthmus_channel_t *channel,
                             const char *path,
                             const uint8_t *request,
                             size_t request_len,
                             const isthmus_call_options_t *opts,
                             isthmus_message_t **reply,
                             isthmus_metadata_t **headers,
                             isthmus_metadata_t **trailers,
                             isthmus_status_t **status);

// [`isthmus_unary`] without blocking: returns at once, and the outcome arrives on `cq` as an
// event with `op = ISTHMUS_OP_UNARY` and this `tag`: `message`, `metadata` (initial) and
// `trailers` on success, `status` on failure.
//
// # Safety
//
// As [`isthmus_unary`]; the request is copied before this returns.
isthmus_code_t isthmus_unary_async(const isthmus_channel_t *channel,
                                   const char *path,
                                   const uint8_t *request,
                                   size_t request_len,
                                   const isthmus_call_options_t *opts,
                                   const isthmus_cq_t *cq,
                                   uint64_t tag,
                                   isthmus_event_t *now,
                                   isthmus_status_t **status);

// A writable block of `len` bytes in the channel's shared memory, to fill in place and send
// as a unary request with `isthmus_unary_block` or `isthmus_unary_block_async`, with no copy.
// `shm://` channels only (`ISTHMUS_UNIMPLEMENTED` otherwise). Blocks the calling thread while
// it connects (with `ISTHMUS_CALL_WAIT_FOR_READY`, until a server is there) and while the
// arena is full, at most for `opts`' timeout (no bound without one). `*block` is the caller's: it is consumed by the send, or freed with
// `isthmus_block_free`. If the connection ends before the block is sent, the send fails
// UNAVAILABLE.
//
// Thread-safety: any thread.
//
// # Safety
//
// `opts` is NULL or valid; `block` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_channel_alloc(const isthmus_channel_t *channel,
                                     size_t len,
                                     const isthmus_call_options_t *opts,
                                     isthmus_block_t **block,
                                     isthmus_status_t **status);

// [`isthmus_unary`] whose request is a block from `isthmus_channel_alloc` of the same
// channel, sent where it lies. The block handle is consumed, sent or not.
//
// # Safety
//
// As [`isthmus_unary`].
isthmus_code_t isthmus_unary_block(const isthmus_channel_t *channel,
                                   const char *path,
                                   isthmus_block_t *block,
                                   const isthmus_call_options_t *opts,
                                   isthmus_message_t **reply,
                                   isthmus_metadata_t **headers,
                                   isthmus_metadata_t **trailers,
                                   isthmus_status_t **status);

// [`isthmus_unary_block`] without blocking on the reply, as [`isthmus_unary_async`]. With
// `ISTHMUS_CALL_SPIN` the request is sent where it lies, on the calling thread, which then
// waits up to the channel's spin (see `isthmus_channel_set_spin`) for the reply (it comes
// back in `now`); a thread of the library waits for a slower one, which arrives as an
// `ISTHMUS_OP_UNARY` event. Without the
// flag a block over 64 KiB is sent the same way and waited for by a library thread at once.
// A block up to 64 KiB without the flag, a call with `ISTHMUS_CALL_WAIT_FOR_READY`, and any
// call while 64 slow replies are waited for already are copied to the completion queue's
// connection instead and sent by the runtime. Sending on the calling thread never connects
// (a block whose connection is gone fails UNAVAILABLE) but does wait while the server's ring
// is full, up to the call's deadline. The block handle is consumed, sent or not.
//
// # Safety
//
// As [`isthmus_unary_async`].
isthmus_code_t isthmus_unary_block_async(const isthmus_channel_t *channel,
                                         const char *path,
                                         isthmus_block_t *block,
                                         const isthmus_call_options_t *opts,
                                         const isthmus_cq_t *cq,
                                         uint64_t tag,
                                         isthmus_event_t *now,
                                         isthmus_status_t **status);

// Starts a call of any shape on `path`, blocking until its head is sent (connecting if
// needed). `*call` is the caller's, freed with `isthmus_call_free`.
//
// # Safety
//
// `path` is NUL-terminated; `opts` is NULL or valid; `call` is writable; `status` is NULL or
// writable.
isthmus_code_t isthmus_call_start(const isthmus_channel_t *channel,
                                  const char *path,
                                  const isthmus_call_options_t *opts,
                                  isthmus_call_t **call,
                                  isthmus_status_t **status);

// [`isthmus_call_start`] without blocking: the event (`ISTHMUS_OP_START`) carries the call
// in `call` on success. The call's later operations are best made `_async` on the same queue:
// it is polled by whoever drains that queue.
//
// # Safety
//
// As [`isthmus_call_start`].
isthmus_code_t isthmus_call_start_async(const isthmus_channel_t *channel,
                                        const char *path,
                                        const isthmus_call_options_t *opts,
                                        const isthmus_cq_t *cq,
                                        uint64_t tag,
                                        isthmus_event_t *now,
                                        isthmus_status_t **status);

// Sends one request message (copied), blocking while flow control holds it back; `last`
// (non-zero) half-closes with it. A call that is over fails with `ISTHMUS_CANCELLED`: its
// status comes from `isthmus_call_recv`.
//
// # Safety
//
// `data` is valid for `len` bytes; `status` is NULL or writable.
isthmus_code_t isthmus_call_send(const isthmus_call_t *call,
                                 const uint8_t *data,
                                 size_t len,
                                 int32_t last,
                                 isthmus_status_t **status);

// [`isthmus_call_send`] without blocking (`ISTHMUS_OP_SEND`; `code` is `ISTHMUS_CANCELLED`
// if the call was over). The message is copied before this returns.
//
// # Safety
//
// As [`isthmus_call_send`].
isthmus_code_t isthmus_call_send_async(const isthmus_call_t *call,
                                       const uint8_t *data,
                                       size_t len,
                                       int32_t last,
                                       const isthmus_cq_t *cq,
                                       uint64_t tag,
                                       isthmus_event_t *now,
                                       isthmus_status_t **status);

// Half-closes: no more request messages.
isthmus_code_t isthmus_call_close_send(const isthmus_call_t *call);

// [`isthmus_call_close_send`] without blocking (`ISTHMUS_OP_CLOSE_SEND`).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_call_close_send_async(const isthmus_call_t *call,
                                             const isthmus_cq_t *cq,
                                             uint64_t tag,
                                             isthmus_event_t *now,
                                             isthmus_status_t **status);

// Receives the next response message, blocking. `ISTHMUS_OK` with `*message` set: a message
// (the caller's to free); `ISTHMUS_OK` with `*message` NULL: the server ended the call with
// OK (its trailers: `isthmus_call_trailers`); any other code: the call failed, and `*status`
// (if not NULL) holds the server's status with its trailers.
//
// # Safety
//
// `message` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_call_recv(const isthmus_call_t *call,
                                 isthmus_message_t **message,
                                 isthmus_status_t **status);

// [`isthmus_call_recv`] without blocking (`ISTHMUS_OP_RECV`: `message`, NULL at the OK end;
// `status` on failure).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_call_recv_async(const isthmus_call_t *call,
                                       const isthmus_cq_t *cq,
                                       uint64_t tag,
                                       isthmus_event_t *now,
                                       isthmus_status_t **status);

// [`isthmus_call_recv_async`], but a message (or the call's end) that comes within 50 µs is
// taken on the calling thread and returned in `now`, without the two wake-ups a trip through
// the queue costs. The thread spins, yielding its core between looks after the first
// microseconds. The bound is fixed (`isthmus_channel_set_spin` does not change it); a call
// started with `ISTHMUS_CALL_SPIN` also reads the connection while polled, and may wait
// longer. For a caller that can spare its thread that long (Go's streams, within their bound
// on threads held); with a NULL `now` it is [`isthmus_call_recv_async`].
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_call_recv_spin(const isthmus_call_t *call,
                                      const isthmus_cq_t *cq,
                                      uint64_t tag,
                                      isthmus_event_t *now,
                                      isthmus_status_t **status);

// The server's initial metadata, blocking until it arrives (the caller frees `*headers`).
//
// # Safety
//
// `headers` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_call_headers(const isthmus_call_t *call,
                                    isthmus_metadata_t **headers,
                                    isthmus_status_t **status);

// [`isthmus_call_headers`] without blocking (`ISTHMUS_OP_HEADERS`: `metadata`).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_call_headers_async(const isthmus_call_t *call,
                                          const isthmus_cq_t *cq,
                                          uint64_t tag,
                                          isthmus_event_t *now,
                                          isthmus_status_t **status);

// A copy of the server's trailing metadata once the call has ended (the caller frees it);
// NULL while it runs.
isthmus_metadata_t *isthmus_call_trailers(const isthmus_call_t *call);

// A writable block of `len` bytes in this side's shared memory (`shm://` only), for a
// request built in place: fill it (`isthmus_block_data`), then `isthmus_call_send_block`.
// Blocks while the arena is full.
//
// # Safety
//
// `block` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_call_alloc(const isthmus_call_t *call,
                                  size_t len,
                                  isthmus_block_t **block,
                                  isthmus_status_t **status);

// Sends a block from `isthmus_call_alloc` as one request message, with no copy; `last`
// (non-zero) half-closes with it. The block handle is consumed, sent or not.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_call_send_block(const isthmus_call_t *call,
                                       isthmus_block_t *block,
                                       int32_t last,
                                       isthmus_status_t **status);

// Cancels the call: the server sees CANCELLED, and a `recv` waiting in another thread
// returns `ISTHMUS_CANCELLED`. The handle stays valid until freed.
isthmus_code_t isthmus_call_cancel(const isthmus_call_t *call);

// Frees a call; one still running is cancelled.
isthmus_code_t isthmus_call_free(isthmus_call_t *call);

// A new completion queue, or NULL if the system refuses an eventfd.
isthmus_cq_t *isthmus_cq_new(void);

// The queue's file descriptor: readable while events wait. Watch it for reading; do not
// read, write or close it. -1 for an invalid handle.
int32_t isthmus_cq_fd(const isthmus_cq_t *cq);

// Takes up to `capacity` finished operations into `events`, without blocking; the number
// taken. Runs what the woken operations have left to do, on this thread. Events not taken
// (beyond `capacity`) stay queued and keep the descriptor readable.
//
// # Safety
//
// `events` is valid for writes of `capacity` events.
size_t isthmus_cq_poll(const isthmus_cq_t *cq,
                       isthmus_event_t *events,
                       size_t capacity);

// [`isthmus_cq_poll`], but waits first until an event is ready: spinning for up to
// `spin_us` microseconds, then asleep on the descriptor until `timeout_us` (from the call;
// negative: no limit) has passed. 0 if none came.
//
// # Safety
//
// As [`isthmus_cq_poll`].
size_t isthmus_cq_wait(const isthmus_cq_t *cq,
                       isthmus_event_t *events,
                       size_t capacity,
                       uint32_t spin_us,
                       int64_t timeout_us);

// Abandons the operation started with `tag` on `cq`: it will not complete (a call it was
// making is cancelled) and its event never comes. `ISTHMUS_NOT_FOUND` if it has finished
// already: its event is then queued, or was taken.
isthmus_code_t isthmus_cq_cancel(const isthmus_cq_t *cq,
                                 uint64_t tag);

// For event loops that can watch only a socket they connect themselves (nginx's Lua
// cosockets) instead of the queue's descriptor: makes a Unix socket to connect to and writes
// its path, NUL-terminated, into `path` (`capacity` bytes). Connect to it, then call
// `isthmus_cq_bell_accept`; from then on a byte arrives on that connection whenever the
// descriptor becomes readable (read them, then `isthmus_cq_poll`). The socket lives in a fresh
// directory only this user may enter, under `$TMPDIR` (or `/tmp`), removed once accepted.
//
// # Safety
//
// `path` is valid for writes of `capacity` bytes; `status` is NULL or writable.
isthmus_code_t isthmus_cq_bell_listen(const isthmus_cq_t *cq,
                                      char *path,
                                      size_t capacity,
                                      isthmus_status_t **status);

// Accepts the connection made to the socket of `isthmus_cq_bell_listen` (which must have
// been made already: `ISTHMUS_FAILED_PRECONDITION` otherwise) and rings it from now on, in
// place of an earlier bell. Removes the socket and its directory.
isthmus_code_t isthmus_cq_bell_accept(const isthmus_cq_t *cq,
                                      isthmus_status_t **status);

// Makes the queue's descriptor readable and rings its bell, with no event to take: wakes the
// loop that watches it (nginx's watcher, when its worker is exiting).
isthmus_code_t isthmus_cq_wake(const isthmus_cq_t *cq);

// Frees a queue. Operations still waiting on it are abandoned: their calls are cancelled and
// their events never come; events not yet taken are freed.
isthmus_code_t isthmus_cq_free(isthmus_cq_t *cq);

// The message's bytes; their count in `*len`. Valid until the message is freed. NULL (and
// length 0) for an empty message or an invalid handle.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_message_data(const isthmus_message_t *msg,
                                    size_t *len);

// The message's length in bytes (0 for an invalid handle).
size_t isthmus_message_len(const isthmus_message_t *msg);

// Frees a message (over `shm://`, gives its shared memory back to the sender once nothing
// else holds it). `ISTHMUS_INVALID_ARGUMENT` for NULL or a message freed already.
isthmus_code_t isthmus_message_free(isthmus_message_t *msg);

// The block's writable bytes; their count in `*len`. Valid until the block is sent or freed.
//
// # Safety
//
// `len` is NULL or writable.
uint8_t *isthmus_block_data(isthmus_block_t *block,
                            size_t *len);

// Frees a block that will not be sent (its shared memory goes back to the arena).
isthmus_code_t isthmus_block_free(isthmus_block_t *block);

// New empty metadata, to fill with `isthmus_metadata_add` and pass to a call; free it with
// `isthmus_metadata_free` (a call copies what it needs).
isthmus_metadata_t *isthmus_metadata_new(void);

// Appends an entry. The key (NUL-terminated) must be lower-case `0-9 a-z - _ .` and not
// reserved (`grpc-*`, `content-type`, `te`, `user-agent`); keys ending in `-bin` take any
// bytes, others printable ASCII. `ISTHMUS_INVALID_ARGUMENT` with the reason otherwise.
// Entry pointers taken earlier from this metadata are invalid afterwards.
//
// # Safety
//
// `key` is NULL or NUL-terminated; `value` is valid for `value_len` bytes; `status` is NULL
// or writable.
isthmus_code_t isthmus_metadata_add(isthmus_metadata_t *md,
                                    const char *key,
                                    const uint8_t *value,
                                    size_t value_len,
                                    isthmus_status_t **status);

// The number of entries (0 for an invalid handle).
size_t isthmus_metadata_len(const isthmus_metadata_t *md);

// Entry `index`: its key (not NUL-terminated) and value (NULL when empty), valid until the
// metadata is changed or freed. `ISTHMUS_OUT_OF_RANGE` past the end.
//
// # Safety
//
// Each out-pointer is NULL or writable.
isthmus_code_t isthmus_metadata_get(const isthmus_metadata_t *md,
                                    size_t index,
                                    const uint8_t **key,
                                    size_t *key_len,
                                    const uint8_t **value,
                                    size_t *value_len);

// Frees metadata.
isthmus_code_t isthmus_metadata_free(isthmus_metadata_t *md);

// A copy of the status's trailing metadata, which the caller frees; NULL for an invalid
// handle.
isthmus_metadata_t *isthmus_status_trailers(const isthmus_status_t *status);

// Compiles `.proto` files (with what they import) at run time. Imports are looked up in the
// `includes` directories; with none, in each file's own directory. A file that does not parse,
// or an import not found, fails with `ISTHMUS_INVALID_ARGUMENT` and a message naming the file
// and line. Free the result with `isthmus_proto_free`.
//
// # Safety
//
// `files` holds `nfiles` NUL-terminated paths and `includes` `nincludes` (either may be NULL
// when its count is 0); `out` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_proto_load(const char *const *files,
                                  size_t nfiles,
                                  const char *const *includes,
                                  size_t nincludes,
                                  isthmus_proto_t **out,
                                  isthmus_status_t **status);

// Loads a serialized `google.protobuf.FileDescriptorSet` (what `protoc --include_imports
// --descriptor_set_out` writes, or a server's reflection gives). Free the result with
// `isthmus_proto_free`.
//
// # Safety
//
// `data` is valid for `len` bytes; `out` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_proto_load_descriptor_set(const uint8_t *data,
                                                 size_t len,
                                                 isthmus_proto_t **out,
                                                 isthmus_status_t **status);

// The full name of the request (`which` = `ISTHMUS_PROTO_REQUEST`) or response
// (`ISTHMUS_PROTO_RESPONSE`) type of the method at `path` (`/package.Service/Method`),
// NUL-terminated and valid until the proto is freed; NULL if no loaded service has that method
// (or for an invalid handle).
//
// # Safety
//
// `path` is a NUL-terminated string.
const char *isthmus_proto_method_type(const isthmus_proto_t *proto,
                                      const char *path,
                                      int32_t which);

// Encodes a message of type `type_name` (`package.Message`) from its proto3 JSON form: `*out`
// holds the protobuf bytes. JSON that does not fit the type fails with
// `ISTHMUS_INVALID_ARGUMENT` and a message naming the field.
//
// # Safety
//
// `type_name` is NUL-terminated; `json` is valid for `json_len` bytes; `out` is writable;
// `status` is NULL or writable.
isthmus_code_t isthmus_proto_encode(const isthmus_proto_t *proto,
                                    const char *type_name,
                                    const uint8_t *json,
                                    size_t json_len,
                                    isthmus_message_t **out,
                                    isthmus_status_t **status);

// Decodes protobuf bytes of type `type_name` into its proto3 JSON form, with the field names
// the `.proto` file gives (`time_left_ms`, not `timeLeftMs`; encoding takes either): fields at
// their default value left out, 64-bit integers as strings, `bytes` in base64. `*out` holds
// the JSON text. Bytes that are not such a message fail with `ISTHMUS_INVALID_ARGUMENT`.
//
// # Safety
//
// `type_name` is NUL-terminated; `data` is valid for `len` bytes; `out` is writable; `status`
// is NULL or writable.
isthmus_code_t isthmus_proto_decode(const isthmus_proto_t *proto,
                                    const char *type_name,
                                    const uint8_t *data,
                                    size_t len,
                                    isthmus_message_t **out,
                                    isthmus_status_t **status);

// Frees a proto.
isthmus_code_t isthmus_proto_free(isthmus_proto_t *proto);

// A new server with no handlers. Free it with `isthmus_server_free`.
//
// # Safety
//
// `opts` is NULL or valid.
isthmus_server_t *isthmus_server_new(const isthmus_server_options_t *opts);

// Registers `handler` for `path` (NULL or "": every other path), called with `user_data` for
// each new call. Before `isthmus_server_start` only.
//
// # Safety
//
// `path` is NULL or NUL-terminated; `handler` and `user_data` stay valid until the server is
// freed; `status` is NULL or writable.
isthmus_code_t isthmus_server_add_handler(const isthmus_server_t *server,
                                          const char *path,
                                          isthmus_handler_fn handler,
                                          void *user_data,
                                          isthmus_status_t **status);

// Registers `path` (NULL or "": every other path) to deliver its calls as events on `cq`
// (`ISTHMUS_OP_NEW_CALL`, with `tag` and the call in `server_call`). Before
// `isthmus_server_start` only. The queue must outlive the server.
//
// # Safety
//
// `path` is NULL or NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_server_add_handler_cq(const isthmus_server_t *server,
                                             const char *path,
                                             const isthmus_cq_t *cq,
                                             uint64_t tag,
                                             isthmus_status_t **status);

// Binds every target in `targets` (`count` NUL-terminated strings: `shm://NAME`,
// `unix:///path.sock`, `http://host:port`) and starts serving them in the background.
// Clients can connect as soon as this returns. A server starts once.
//
// # Safety
//
// `targets` is valid for `count` NUL-terminated strings; `status` is NULL or writable.
isthmus_code_t isthmus_server_start(const isthmus_server_t *server,
                                    const char *const *targets,
                                    size_t count,
                                    isthmus_status_t **status);

// The `index`th HTTP/2 endpoint of a serving server as clients reach it (`unix:///path`,
// `http://host:port` with the port the system chose for port 0), NUL-terminated and valid
// until the server is shut down; NULL past the last one or if it does not serve.
const char *isthmus_server_http_address(const isthmus_server_t *server,
                                        size_t index);

// Shuts the server down gracefully, blocking until it has: its sockets go, clients are told
// to go away, new calls are refused with UNAVAILABLE, and calls in progress get `grace_ms`
// milliseconds to finish before their connections close. The handle stays valid (free it
// with `isthmus_server_free`).
isthmus_code_t isthmus_server_shutdown(const isthmus_server_t *server,
                                       uint64_t grace_ms);

// Frees a server, shutting it down first (with no grace) if it serves.
isthmus_code_t isthmus_server_free(isthmus_server_t *server);

// The call's method path (not NUL-terminated; its length in `*len`), valid until the call
// is finished.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_server_call_path(const isthmus_server_call_t *call,
                                        size_t *len);

// A copy of the client's initial metadata (the caller frees it); NULL for an invalid handle.
isthmus_metadata_t *isthmus_server_call_metadata(const isthmus_server_call_t *call);

// Microseconds left before the client's deadline; -1 if it set none.
int64_t isthmus_server_call_time_remaining_us(const isthmus_server_call_t *call);

// 1 while the call runs (not finished, not cancelled by the client, deadline not passed);
// 0 otherwise.
int32_t isthmus_server_call_is_active(const isthmus_server_call_t *call);

// Receives the next request message, blocking: `ISTHMUS_OK` with `*message` set, or with
// `*message` NULL once the client has half-closed; another code if the call is over. With
// `flags` 0 it sends nothing, so `isthmus_server_call_send_headers` works after it; see
// `ISTHMUS_RECV_FLUSH_HEADERS` for request-streaming handlers.
//
// # Safety
//
// `message` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_recv(const isthmus_server_call_t *call,
                                        uint32_t flags,
                                        isthmus_message_t **message,
                                        isthmus_status_t **status);

// [`isthmus_server_call_recv`] without blocking (`ISTHMUS_OP_RECV`).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_recv_async(const isthmus_server_call_t *call,
                                              uint32_t flags,
                                              const isthmus_cq_t *cq,
                                              uint64_t tag,
                                              isthmus_event_t *now,
                                              isthmus_status_t **status);

// Asks for an event (`ISTHMUS_OP_DONE`, with `tag`) on `cq` when the call is over: finished,
// cancelled by its client (or its connection's end), or past its deadline. If it is over
// already, the event is queued at once. A handler that works on after its client gave up
// learns of it this way.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_done_async(const isthmus_server_call_t *call,
                                              const isthmus_cq_t *cq,
                                              uint64_t tag,
                                              isthmus_status_t **status);

// Sends one response message (copied), blocking while flow control holds it back.
//
// # Safety
//
// `data` is valid for `len` bytes; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send(const isthmus_server_call_t *call,
                                        const uint8_t *data,
                                        size_t len,
                                        isthmus_status_t **status);

// [`isthmus_server_call_send`] without blocking (`ISTHMUS_OP_SEND`); the message is copied
// before this returns.
//
// # Safety
//
// As [`isthmus_server_call_send`].
isthmus_code_t isthmus_server_call_send_async(const isthmus_server_call_t *call,
                                              const uint8_t *data,
                                              size_t len,
                                              const isthmus_cq_t *cq,
                                              uint64_t tag,
                                              isthmus_event_t *now,
                                              isthmus_status_t **status);

// Sends initial metadata now (otherwise the first message sends empty metadata), blocking.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send_headers(const isthmus_server_call_t *call,
                                                const isthmus_metadata_t *metadata,
                                                isthmus_status_t **status);

// [`isthmus_server_call_send_headers`] without blocking (`ISTHMUS_OP_SEND_HEADERS`).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send_headers_async(const isthmus_server_call_t *call,
                                                      const isthmus_metadata_t *metadata,
                                                      const isthmus_cq_t *cq,
                                                      uint64_t tag,
                                                      isthmus_event_t *now,
                                                      isthmus_status_t **status);

// A writable block of `len` bytes in the server's shared memory (`shm://` calls only), for a
// reply written in place; send it with `isthmus_server_call_send_block`.
//
// # Safety
//
// `block` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_alloc(const isthmus_server_call_t *call,
                                         size_t len,
                                         isthmus_block_t **block,
                                         isthmus_status_t **status);

// Sends a block from `isthmus_server_call_alloc` as one response message, with no copy. The
// block handle is consumed, sent or not.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send_block(const isthmus_server_call_t *call,
                                              isthmus_block_t *block,
                                              isthmus_status_t **status);

// Ends the call with `code` (`ISTHMUS_OK` or a gRPC code), `message` (NULL for none) and
// trailing metadata (NULL for none; copied), and frees the handle. Exactly once per call. A
// `message` that is not UTF-8 or a `trailers` that is no live handle still ends the call
// (INTERNAL, saying which) and frees the handle, and returns `ISTHMUS_INVALID_ARGUMENT`.
//
// # Safety
//
// `message` is NULL or NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_finish(isthmus_server_call_t *call,
                                          isthmus_code_t code,
                                          const char *message,
                                          const isthmus_metadata_t *trailers,
                                          isthmus_status_t **status);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* ISTHMUS_H */
