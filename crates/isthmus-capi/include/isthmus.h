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
 *   ISTHMUS_INVALID_ARGUMENT instead of crashing. (Handle values come from address space the
 *   library reserves; in a process whose address space is too limited for 4 GiB more, they are
 *   the objects' addresses, and a handle freed twice after its address went to a new object of
 *   its type reaches that one.)
 * - Errors. Fallible functions return an isthmus_code_t: ISTHMUS_OK (0) or a gRPC status code.
 *   Where a function takes `isthmus_status_t **status` and it is not NULL, a failure stores a
 *   status there (code, message, details, trailers) for the caller to free with
 *   isthmus_status_free; success stores NULL. No panic crosses the boundary (ISTHMUS_INTERNAL
 *   instead).
 * - Memory. Byte arguments are (pointer, length) pairs, copied or sent before the function
 *   returns. Strings are NUL-terminated UTF-8. Pointers into an object (a message's bytes, a
 *   block's bytes, a status's message or details, a metadata entry) stay valid until that object
 *   is freed.
 * - Threads. Every function may be called from any thread; a call's sending side and its
 *   receiving side may be used from two threads at once. Each function's comment has a
 *   "Thread-safety:" line: what it allows beside that, what it blocks, and which of its
 *   pointers another thread's free or change ends.
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
// calling thread never waits (for an event loop's own thread). On a streaming call
// (`isthmus_call_start_async`) it lets the call's receives read the connection on the thread
// that waits (`isthmus_call_recv_spin`), rather than only through the library's reader: a
// stream's message then costs no hand-over between threads.
#define ISTHMUS_CALL_SPIN 2

// Call flag: compress the request messages with gzip over HTTP/2 (`unix://`, `http://`,
// `https://`), as gRPC's `grpc-encoding: gzip`; a server that does not read gzip fails the
// call UNIMPLEMENTED. Over `shm://` messages cross no wire and go as they are.
#define ISTHMUS_CALL_COMPRESS_GZIP 4

// Call flag: as `ISTHMUS_CALL_COMPRESS_GZIP` with `deflate` (a zlib stream). Both flags
// together are INVALID_ARGUMENT.
#define ISTHMUS_CALL_COMPRESS_DEFLATE 8

// Channel flag: calls to an HTTP/2 address move to shared memory when its server is a local
// isthmus server that offers it (ADR 0013), even where the environment variable
// `ISTHMUS_UPGRADE=0` turns that off for the process.
#define ISTHMUS_CHANNEL_UPGRADE 1

// Channel flag: calls to an HTTP/2 address stay on HTTP/2, whatever the server offers.
// Without either flag, the process's default holds: on, unless `ISTHMUS_UPGRADE` is `0`,
// `off` or `false`.
#define ISTHMUS_CHANNEL_NO_UPGRADE 2

// Channel flag: keepalive PINGs (`keepalive_time_ms`) go out while no call is open too (gRPC's
// `keepalive_permit_without_calls`).
#define ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS 4

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

// `isthmus_proto_method_streams`: the client sends a stream of requests.
#define ISTHMUS_PROTO_CLIENT_STREAMING 1

// `isthmus_proto_method_streams`: the server sends a stream of responses.
#define ISTHMUS_PROTO_SERVER_STREAMING 2

// Server flag: the handlers' replies to HTTP/2 calls go compressed with gzip, to each client
// whose `grpc-accept-encoding` lists it (grpc's clients do); others get them as they are.
// Replies over `shm://` cross no wire and go as they are.
#define ISTHMUS_SERVER_COMPRESS_GZIP 1

// Server flag: as `ISTHMUS_SERVER_COMPRESS_GZIP` with `deflate`. Both flags together fail
// `isthmus_server_start` with INVALID_ARGUMENT.
#define ISTHMUS_SERVER_COMPRESS_DEFLATE 2

// Receive flag: if the call has sent nothing yet and must wait for a request, send its
// (empty) initial metadata first. A client that sends its first request only once the
// response has opened (tonic's generated streaming clients do) is then not left waiting on a
// handler that waits for that request; initial metadata can no longer be sent once it has
// (`isthmus_server_call_headers_sent`). A receive that finds its request in sends nothing.
#define ISTHMUS_RECV_FLUSH_HEADERS 1

// Receive flag for `isthmus_server_call_recv_async` with a `now` event: a request that comes
// within 50 µs (a fixed bound) is taken on the calling thread and returned in `now`, without
// the two wake-ups a trip through the queue costs (as `isthmus_call_recv_spin` on the
// client's side). The thread spins, yielding its core between looks after the first
// microseconds; over `shm://`, while its call is the only one open on the connection, it reads
// the connection itself meanwhile, so the request needs no hand-over from the library's reader.
#define ISTHMUS_RECV_SPIN 2

// Topic flag: a subscriber whose queue is full has its call ended RESOURCE_EXHAUSTED. Without
// it, its oldest queued message is dropped (counted in `isthmus_topic_stats_t.dropped`) and it
// goes on with the newer ones.
#define ISTHMUS_TOPIC_CANCEL_SLOW 1

// Topic flag: when a subscriber's queue overflowed (messages were dropped for it), the messages
// still queued for it are dropped too and the topic's state (`isthmus_topic_publish_state`) is
// sent in their place, a resync. With no state, or one a plain `isthmus_topic_publish` came
// after (sent again, it would take the subscriber back past those messages), the queued
// messages are sent as they are.
#define ISTHMUS_TOPIC_RESYNC_STATE 2

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
// nothing uses it. A queue is its process's: in a child forked after it was made, operations
// started on it fail `ISTHMUS_FAILED_PRECONDITION`, polls find nothing, `isthmus_cq_fd` gives
// -1, and freeing it only forgets it (its descriptor and operations are the parent's); the
// child makes its own.
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

// A gRPC status: code, message, binary details and trailing metadata.
typedef struct isthmus_status_t isthmus_status_t;

// A topic: publish to it from any thread; a server serves it at a method path
// (`isthmus_server_add_topic`).
typedef struct isthmus_topic_t isthmus_topic_t;

// A gRPC status code: 0 is OK.
typedef int32_t isthmus_code_t;

// TLS settings of a channel (`isthmus_channel_options_t.tls`) or a server
// (`isthmus_server_options_t.tls`). Zero-initialise it, then set what you need. Every string is
// NUL-terminated PEM text (or a name), copied before the function that takes it returns.
typedef struct {
  // Certificates to trust. A channel: the CAs that sign the server's certificate (NULL: the
  // system's roots). A server: the CAs that sign its clients' certificates, which it then
  // asks clients for (mutual TLS; NULL: it asks none).
  const char *root_certs_pem;
  // This side's certificate chain, leaf first, with `private_key_pem`. A server needs one;
  // a channel gives one for mutual TLS (NULL: none).
  const char *cert_chain_pem;
  // The private key of `cert_chain_pem` (PKCS#8, PKCS#1 or SEC1 PEM).
  const char *private_key_pem;
  // A channel: the name the server's certificate must carry, in place of the target's host
  // (grpc's `ssl_target_name_override`); NULL for the host. A server: must be NULL.
  const char *server_name;
  // A server with `root_certs_pem`: 1 refuses a client without a certificate signed by them
  // (grpc's `require_client_auth`); 0 lets it in without one. A channel: must be 0.
  uint32_t require_client_cert;
} isthmus_tls_options_t;

// Options of a channel. Zero-initialise it, then set what you need; NULL means defaults.
typedef struct {
  // The largest message this side accepts, in bytes; 0 for the default (4 GiB).
  uint64_t max_message_size;
  // TLS settings for a TCP target (`https://host:port`, `host:port`, `dns:`, `ipv4:`…;
  // INVALID_ARGUMENT for any other); copied. NULL: plaintext, except that `https://`
  // trusts the system's roots.
  const isthmus_tls_options_t *tls;
  // `ISTHMUS_CHANNEL_*` flags ORed together, or 0.
  uint32_t flags;
  // HTTP/2 keepalive (gRPC's `keepalive_time`): a PING after this many milliseconds in
  // which nothing arrived, while a call is open (always, with
  // `ISTHMUS_CHANNEL_KEEPALIVE_WITHOUT_CALLS`); 0: none. If its answer does not come within
  // `keepalive_timeout_ms`, the connection closes and its calls end `ISTHMUS_UNAVAILABLE`.
  // `shm://` needs none: a peer that dies there is seen at once.
  uint64_t keepalive_time_ms;
  // How long a keepalive PING's answer may take, in milliseconds; 0 for gRPC's 20 s.
  uint64_t keepalive_timeout_ms;
  // The user agent the channel's calls name (gRPC's `user-agent`, which a server's handlers
  // see in their metadata), NUL-terminated, copied; NULL: none. Printable ASCII, at most
  // 1 KiB (`ISTHMUS_INVALID_ARGUMENT` otherwise). Over HTTP/2 the library's own agent
  // follows it; over `shm://` it goes as it is.
  const char *user_agent;
  // The `:authority` the calls send over HTTP/2 in place of the target's (grpc-go's
  // `WithAuthority`, grpcio's `grpc.default_authority`), `host[:port]`, NUL-terminated,
  // copied; NULL: the target's. TLS then checks the server's certificate against its host,
  // unless `tls` names another. `ISTHMUS_INVALID_ARGUMENT` if it is no `host[:port]`.
  // `shm://` sends none.
  const char *authority;
  // How long an HTTP/2 connection may take to come up (its connect, TLS handshake and the
  // server's SETTINGS), in milliseconds; 0 for gRPC's 20 s (grpc-go's
  // `ConnectParams.MinConnectTimeout`). Past it the calls waiting on that connection fail
  // `ISTHMUS_UNAVAILABLE` instead of waiting for a host that drops packets or a server that
  // never answers. `shm://` has its handshake's own bound.
  uint64_t connect_timeout_ms;
} isthmus_channel_options_t;

// Which operation an event completes.
typedef int32_t isthmus_op_t;

// One finished operation. Every non-NULL handle in it belongs to the caller, who frees it.
typedef struct {
  // The tag the operation was started with. A tag names one operation: starting one with
  // the tag of another still pending on the same queue fails `ISTHMUS_INVALID_ARGUMENT`.
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
  // The message's length; `ISTHMUS_OP_STATE`: the channel's state.
  size_t message_len;
  // `ISTHMUS_OP_HEADERS`, `ISTHMUS_OP_UNARY`: the initial metadata (of a failed unary
  // call too, when the server sent them before it failed it); NULL when there is none.
  isthmus_metadata_t *metadata;
  // `ISTHMUS_OP_UNARY`: the trailing metadata; NULL when there is none.
  isthmus_metadata_t *trailers;
  // On failure: the status (code, message, details, trailers).
  isthmus_status_t *status;
} isthmus_event_t;

// Options of one call. Zero-initialise it, then set what you need; a NULL
// `isthmus_call_options_t*` means all defaults.
typedef struct {
  // The call's deadline, in microseconds from its start; 0 or less for none.
  int64_t timeout_us;
  // Initial metadata to send (NULL for none). Copied; the caller still frees it.
  const isthmus_metadata_t *metadata;
  // `ISTHMUS_CALL_*` flags ORed together, or 0; any other bit fails the call
  // `ISTHMUS_INVALID_ARGUMENT`.
  uint32_t flags;
} isthmus_call_options_t;

// Options of a server. Zero-initialise it, then set what you need; NULL means defaults.
typedef struct {
  // The largest request message accepted on every target, in bytes; 0 for the defaults:
  // 4 GiB over `shm://`, 4 MiB over HTTP/2 (as gRPC's servers), where a request is gathered
  // in memory before its handler sees it. A larger one fails its call with
  // RESOURCE_EXHAUSTED and the server goes on.
  uint64_t max_message_size;
  // Calls one client connection may have open at once; 0 for no limit. Over `shm://` a call
  // over the limit is refused with RESOURCE_EXHAUSTED; an HTTP/2 connection is told the limit
  // in its settings (SETTINGS_MAX_CONCURRENT_STREAMS), and its client waits for a place.
  uint32_t max_concurrent_streams;
  // TLS settings for the server's TCP targets (`https://host:port`, `host:port`,
  // `[::]:port`…; an `http://` target stays plaintext): its certificate and key, and for
  // mutual TLS the CAs of its clients' certificates. Copied; checked by
  // `isthmus_server_start`. NULL: no TLS (an `https://` target then fails to start).
  const isthmus_tls_options_t *tls;
  // `ISTHMUS_SERVER_*` flags ORed together, or 0; any other bit fails
  // `isthmus_server_start` `ISTHMUS_INVALID_ARGUMENT`.
  uint32_t flags;
  // HTTP/2 keepalive (gRPC's server `keepalive_time`): a PING to a client connection of an
  // HTTP/2 endpoint after this many milliseconds in which nothing arrived from it; 0: none.
  // If its answer does not come within `keepalive_timeout_ms`, the connection closes and its
  // calls are cancelled. `shm://` needs none: a client that dies there is seen at once.
  uint64_t keepalive_time_ms;
  // How long a keepalive PING's answer may take, in milliseconds; 0 for gRPC's 20 s.
  uint64_t keepalive_timeout_ms;
  // The longest an HTTP/2 connection may live, in milliseconds (gRPC's
  // `MAX_CONNECTION_AGE`); 0: no limit. At that age it gets a GOAWAY: its client opens a new
  // connection for its next calls, and those in progress finish on the old one. `shm://`
  // connections have no age limit.
  uint64_t max_connection_age_ms;
  // How long calls in progress may go on after that GOAWAY, in milliseconds (gRPC's
  // `MAX_CONNECTION_AGE_GRACE`): then the connection closes and they are cancelled, their
  // clients seeing UNAVAILABLE. 0: for ever (grpc-go's zero value too).
  uint64_t max_connection_age_grace_ms;
} isthmus_server_options_t;

// A handler callback: called on one of the library's threads for each new call on its path,
// with the `user_data` given at registration. It must not block for long: hand the call to
// your own thread or loop, and finish it there (or here, if the answer is at hand). That
// thread may be the one reading the call's connection, so a blocking library function that
// waits for the connection (a `recv` whose request is not in, a `send` waiting for the
// client's credit, `isthmus_server_shutdown` or `_free`) called from the callback waits on
// itself, and the connection stalls: use the `_async` forms there, or another thread.
typedef void (*isthmus_handler_fn)(void *user_data,
                                   isthmus_server_call_t *call);

// Counters of a channel's or a server's `shm://` connections (calls over HTTP/2 are not
// counted): sums over the connections, but the largest high-water mark. A channel's counts start
// afresh when it reconnects; a server's cover its live connections, and its listeners' failures
// since it started. Every field is a `uint64_t`; fields are only ever appended (see
// `isthmus_channel_stats` for how an older caller's smaller struct is filled).
typedef struct {
  // Calls started (a channel) or accepted (a server).
  uint64_t calls_started;
  // Calls started and not finished yet.
  uint64_t calls_in_flight;
  // Calls finished, by their final code: `calls_finished[ISTHMUS_UNAVAILABLE]` ended
  // UNAVAILABLE.
  uint64_t calls_finished[17];
  // Frames this side wrote into its rings.
  uint64_t frames_sent;
  // Frames this side read from the peers' rings.
  uint64_t frames_received;
  // Message bytes sent.
  uint64_t bytes_sent;
  // Message bytes received.
  uint64_t bytes_received;
  // Doorbell system calls made to wake a peer.
  uint64_t doorbells_rung;
  // Times a wait on this side went to sleep on its doorbell.
  uint64_t sleeps;
  // Waits that ended while spinning, with no sleep.
  uint64_t spin_hits;
  // Sends that found a frame ring full and waited.
  uint64_t ring_full_waits;
  // Allocations that found an arena full and waited.
  uint64_t arena_full_waits;
  // Bytes of this side's arenas allocated now: blocks being filled, or sent and still held
  // by the peer. It returns to 0 once neither side holds a message of this side's (the raw
  // tier's leak check).
  uint64_t arena_in_use;
  // The most bytes of one connection's arena ever allocated at once.
  uint64_t arena_high_water;
  // Messages a server sent by reference from its listener's shared arena (a topic's one
  // write for every subscriber, ADR 0016); a raw block sent in place is not counted here.
  uint64_t shared_sent;
  // Answers to the peer (to its PINGs, say) dropped because it read nothing of ours while
  // 1,024 of them, or 4 MiB, waited for room; each is also logged.
  uint64_t answers_dropped;
  // A server's live `shm://` connections (0 for a channel).
  uint64_t connections;
  // A server's failed accepts on its `shm://` listeners (out of file descriptors, say);
  // each is logged, and the listener pauses before it accepts again (0 for a channel).
  uint64_t accept_errors;
  // A server's `shm://` clients whose handshake failed: a client that hung up, a version or
  // user refused, no descriptors left for the segment (0 for a channel).
  uint64_t handshakes_failed;
} isthmus_stats_t;

// Options of a topic. Zero-initialise it, then set what you need; NULL means defaults.
typedef struct {
  // Messages queued per subscriber before its queue counts as full; 0 for the default (64).
  uint32_t capacity;
  // `ISTHMUS_TOPIC_*` flags ORed together, or 0.
  uint32_t flags;
} isthmus_topic_options_t;

// A topic's counters (`isthmus_topic_stats`); fields are only ever appended.
typedef struct {
  // Subscribers now.
  uint64_t subscribers;
  // Messages published.
  uint64_t published;
  // Payload bytes published, each message counted once however many it reached.
  uint64_t bytes;
  // Messages sent to subscribers, one per subscriber reached.
  uint64_t delivered;
  // Messages dropped from full queues.
  uint64_t dropped;
  // Subscribers ended for falling behind (`ISTHMUS_TOPIC_CANCEL_SLOW`).
  uint64_t cancelled;
} isthmus_topic_stats_t;

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

// `isthmus_channel_wait_state_async`: the channel's state (`ISTHMUS_STATE_*`) in
// `message_len`; `ISTHMUS_OK` if it changed, `ISTHMUS_DEADLINE_EXCEEDED` if the time ran out.
#define ISTHMUS_OP_STATE 10

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The ABI version of the loaded library ([`ISTHMUS_ABI_VERSION`] when it was built): compare
// with the header's before use.
//
// Thread-safety: any thread.
uint32_t isthmus_abi_version(void);

// Microseconds on a monotonic clock, counted from an arbitrary moment fixed for the process:
// for a caller with no clock of its own (LuaJIT outside nginx) to bound a wait made of several
// `isthmus_cq_wait`s, which may return before their time (the operations woken have not
// finished yet).
//
// Thread-safety: any thread.
int64_t isthmus_clock_us(void);

// The gRPC name of `code` (`"UNAVAILABLE"`), static and NUL-terminated; `"UNKNOWN"` for a
// number that is no code.
//
// Thread-safety: any thread; the string is static.
const char *isthmus_code_name(isthmus_code_t code);

// The number of handles made and not yet freed, of every type. A handle lives in this
// library's registry until it is freed, so a leak checker (LeakSanitizer, valgrind) sees one
// never freed as reachable, not leaked: a test that wants to know it freed everything compares
// this with its value before (or with 0 at the end).
//
// Thread-safety: any thread; the count of that moment, which calls on other threads change.
size_t isthmus_live_handles(void);

// The status's code (`ISTHMUS_INVALID_ARGUMENT` for an invalid handle).
//
// Thread-safety: any thread; several may read one status at once.
isthmus_code_t isthmus_status_code(const isthmus_status_t *status);

// The status's message, NUL-terminated, valid until the status is freed ("" for an invalid
// handle).
//
// Thread-safety: any thread; the string goes with `isthmus_status_free`, so do not free the status
// on another thread while it is in use.
const char *isthmus_status_message(const isthmus_status_t *status);

// The status's binary details: a serialized `google.rpc.Status` as the server sent it (gRPC's
// `grpc-status-details-bin`, whose code and message should match the status's own), their
// length in `*len`. Valid until the status is freed. NULL (and length 0) when the status has
// none, or for an invalid handle.
//
// Thread-safety: any thread; the bytes go with `isthmus_status_free`, so do not free the
// status on another thread while they are in use.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_status_details(const isthmus_status_t *status,
                                      size_t *len);

// Frees a status.
//
// Thread-safety: any thread, once; pointers into the status (message, details) that other threads
// hold die with it.
isthmus_code_t isthmus_status_free(isthmus_status_t *status);

// Makes a channel to `target`. It connects on its first call, so this fails only for a
// target it cannot parse, or options it cannot take (bad TLS settings, unknown flags, both
// upgrade flags): `ISTHMUS_INVALID_ARGUMENT`. Close it with `isthmus_channel_close`.
//
// Thread-safety: any thread.
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
//
// Thread-safety: any thread, once; calls in progress on other threads go on, and their later uses
// of the handle fail `ISTHMUS_INVALID_ARGUMENT`.
isthmus_code_t isthmus_channel_close(isthmus_channel_t *channel);

// Ends a channel's calls in progress now with status `code` (a gRPC code other than OK) and
// `message` (NULL: none), as grpc-go's `ClientConn.Close` ("grpc: the client connection is
// closing", CANCELLED) and grpcio's `close` do: blocking calls return it, queued operations
// complete with it, and the server's handlers see their calls end. The channel's `shm://`
// connections close; later calls on it fail (UNAVAILABLE over `shm://`, `code` over HTTP/2).
// The handle stays valid until `isthmus_channel_close`.
//
// Thread-safety: any thread; calls in progress on other threads end.
//
// # Safety
//
// `message` is NULL or NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_channel_shutdown(const isthmus_channel_t *channel,
                                        isthmus_code_t code,
                                        const char *message,
                                        isthmus_status_t **status);

// Sets how long a unary call started with `ISTHMUS_CALL_SPIN` on this channel waits for its
// reply on the calling thread before it leaves the reply to the completion queue, in µs (the
// default is the connection's spin bound, 50 µs). An event loop that has other work when
// replies are slow (nginx under load) waits less; with 0 the request is still sent on the
// calling thread, and a thread of the library's pool waits for the reply. A request over
// 1 KiB waits longer by the time the server needs to read it: 0.25 µs per KiB, at most 50 µs
// more (a spin of 0 stays 0).
//
// Thread-safety: any thread; calls started after it use the new value.
isthmus_code_t isthmus_channel_set_spin(const isthmus_channel_t *channel,
                                        uint32_t spin_us);

// The channel's connectivity state (`ISTHMUS_STATE_*`) into `*state`. With `try_to_connect`
// not 0, an IDLE or failed channel starts connecting in the background (retrying with
// backoff until it is READY), as grpc-go's `Connect` and grpcio's `try_to_connect`; the
// calling thread never waits for it. On an error (a handle that is no channel) `*state` is
// `ISTHMUS_STATE_SHUTDOWN`.
//
// Thread-safety: any thread, an event loop's included: it never waits.
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
// `WaitForStateChange`). Closing the channel from another thread moves it to SHUTDOWN. On
// an error (a handle that is no channel, a `last` that is no state) `*state` is
// `ISTHMUS_STATE_SHUTDOWN`.
//
// Thread-safety: any thread, which it blocks; closing the channel on another thread ends the wait.
//
// # Safety
//
// `state` is writable.
isthmus_code_t isthmus_channel_wait_state(const isthmus_channel_t *channel,
                                          uint32_t last,
                                          uint32_t timeout_ms,
                                          uint32_t *state);

// [`isthmus_channel_wait_state`] without blocking (`ISTHMUS_OP_STATE`: the state in
// `message_len`, with `ISTHMUS_OK` once it is not `last`, or `ISTHMUS_DEADLINE_EXCEEDED` and
// the state, still `last`, after `timeout_ms` milliseconds; a negative `timeout_ms` waits
// without a limit). Give up on it with `isthmus_cq_cancel`. For event loops (nginx, Go's
// netpoller), where a wait must not hold a thread.
//
// Thread-safety: any thread; it never blocks.
//
// # Safety
//
// `now` is NULL or writable; `status` is NULL or writable.
isthmus_code_t isthmus_channel_wait_state_async(const isthmus_channel_t *channel,
                                                uint32_t last,
                                                int64_t timeout_ms,
                                                const isthmus_cq_t *cq,
                                                uint64_t tag,
                                                isthmus_event_t *now,
                                                isthmus_status_t **status);

// A unary call, blocking: sends `request` to `path` (`/package.Service/Method`) and waits
// for the one response. On success `*reply` holds the response message; `*headers` and
// `*trailers` (each out-pointer may be NULL) the server's initial and trailing metadata, or
// NULL when there is none. All are the caller's to free. On failure `*status` (if not NULL) says
// why, `*reply` and `*trailers` are NULL (the status holds the trailers), and `*headers` holds
// the initial metadata the server sent before it failed the call, or NULL.
//
// Thread-safety: any thread, which it blocks (not an event loop's); many threads may call at once
// on one channel.
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
// `trailers` on success; on failure `status`, and `metadata` if the server sent initial
// metadata before it failed the call.
//
// Thread-safety: any thread, many at once on one channel. It does not block; with
// `ISTHMUS_CALL_SPIN` it may wait on the calling thread up to the channel's spin. The event goes
// to whichever thread takes it from `cq`.
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
// Thread-safety: any thread, which it blocks; many at once on one channel. No other thread may
// write the block once it is passed here.
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
// Thread-safety: any thread, many at once on one channel; see above for what it may wait for on
// the calling thread. No other thread may write the block once it is passed here.
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
// Thread-safety: any thread, which it blocks; many at once on one channel.
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
// Thread-safety: any thread; it does not block.
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
// status comes from `isthmus_call_recv`. A send after the half-close (a send with `last`, or
// `isthmus_call_close_send`) fails with `ISTHMUS_INTERNAL`, as grpc-go's `SendMsg` after
// `CloseSend`, and the call goes on.
//
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives. Sends from two threads at once both go, in an order they fix themselves.
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
// if the call was over). The message is copied before this returns. After the half-close it
// fails at once with `ISTHMUS_INTERNAL`, as `isthmus_call_send` does. Abandoned before it
// completes (`isthmus_cq_cancel`, or its queue freed), it cancels the call: part of the
// message may have gone.
//
// Thread-safety: any thread; the call's sending side, usable while another thread receives. Sends
// started from two threads at once go in an order they fix themselves.
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
//
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives.
isthmus_code_t isthmus_call_close_send(const isthmus_call_t *call);

// [`isthmus_call_close_send`] without blocking (`ISTHMUS_OP_CLOSE_SEND`). Abandoned before it
// completes, it cancels the call, as an abandoned send does.
//
// Thread-safety: any thread; the call's sending side, usable while another thread receives.
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
// Thread-safety: any thread, which it blocks; the call's receiving side, usable while another
// thread sends. Receives from two threads take turns, each message going to one of them.
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
// Thread-safety: any thread; the call's receiving side, usable while another thread sends.
// Receives started from two threads take turns.
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
// Thread-safety: any thread, which it may hold for its spin (above); the call's receiving
// side, as `isthmus_call_recv_async`.
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
// Thread-safety: any thread, which it blocks; the call's receiving side (it takes turns with
// receives), usable while another thread sends.
//
// # Safety
//
// `headers` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_call_headers(const isthmus_call_t *call,
                                    isthmus_metadata_t **headers,
                                    isthmus_status_t **status);

// [`isthmus_call_headers`] without blocking (`ISTHMUS_OP_HEADERS`: `metadata`).
//
// Thread-safety: any thread; the call's receiving side, as `isthmus_call_headers`.
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
//
// Thread-safety: any thread; it never waits.
isthmus_metadata_t *isthmus_call_trailers(const isthmus_call_t *call);

// A writable block of `len` bytes in this side's shared memory (`shm://` only), for a
// request built in place: fill it (`isthmus_block_data`), then `isthmus_call_send_block`.
// Blocks while the arena is full.
//
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives.
//
// # Safety
//
// `block` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_call_alloc(const isthmus_call_t *call,
                                  size_t len,
                                  isthmus_block_t **block,
                                  isthmus_status_t **status);

// Sends a block from `isthmus_call_alloc` as one request message, with no copy; `last`
// (non-zero) half-closes with it. The block handle is consumed, sent or not. After the
// half-close it fails as `isthmus_call_send` does; a block of another connection (another
// channel's, `isthmus_channel_alloc`'s, or the call's own from before a reconnect) fails
// `ISTHMUS_INVALID_ARGUMENT`, and the call goes on.
//
// Thread-safety: any thread, which it blocks; the call's sending side, as `isthmus_call_send`. No
// other thread may write the block once it is passed here.
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
//
// Thread-safety: any thread, typically another than the one waiting on the call: that wait ends
// `ISTHMUS_CANCELLED`.
isthmus_code_t isthmus_call_cancel(const isthmus_call_t *call);

// Frees a call; one still running is cancelled.
//
// Thread-safety: any thread, once; operations other threads have under way end (the call is
// cancelled), and their later uses of the handle fail `ISTHMUS_INVALID_ARGUMENT`.
isthmus_code_t isthmus_call_free(isthmus_call_t *call);

// A new completion queue, or NULL if the system refuses an eventfd.
//
// Thread-safety: any thread.
isthmus_cq_t *isthmus_cq_new(void);

// The queue's file descriptor: readable while events wait. Watch it for reading; do not
// read, write or close it. -1 for an invalid handle, and for a queue made before a fork by
// the parent of this process (the descriptor is the parent's too).
//
// Thread-safety: any thread.
int32_t isthmus_cq_fd(const isthmus_cq_t *cq);

// Takes up to `capacity` finished operations into `events`, without blocking; the number
// taken. Runs what the woken operations have left to do, on this thread. Events not taken
// (beyond `capacity`) stay queued and keep the descriptor readable.
//
// Thread-safety: any thread, usually the one loop that watches the queue: threads polling one
// queue at once each get different events. The operations' remaining work runs on the polling
// thread.
//
// # Safety
//
// `events` is valid for writes of `capacity` events.
size_t isthmus_cq_poll(const isthmus_cq_t *cq,
                       isthmus_event_t *events,
                       size_t capacity);

// [`isthmus_cq_poll`], but waits first until an event is ready: spinning for up to
// `spin_us` microseconds, then asleep on the descriptor until `timeout_us` (from the call;
// negative: no limit) has passed. 0 if none came: the time ran out, `isthmus_cq_wake` woke
// it, or the operations woken meanwhile have not finished yet (wait again).
//
// Thread-safety: any thread, which it blocks (up to `timeout_us`); as `isthmus_cq_poll` otherwise.
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
//
// Thread-safety: any thread; if another thread takes the operation's event meanwhile, this gives
// `ISTHMUS_NOT_FOUND`.
isthmus_code_t isthmus_cq_cancel(const isthmus_cq_t *cq,
                                 uint64_t tag);

// For event loops that can watch only a socket they connect themselves (nginx's Lua
// cosockets) instead of the queue's descriptor: makes a Unix socket to connect to and writes
// its path, NUL-terminated, into `path` (`capacity` bytes). Connect to it, then call
// `isthmus_cq_bell_accept`; from then on a byte arrives on that connection whenever the
// descriptor becomes readable (read them, then `isthmus_cq_poll`). The socket lives in a fresh
// directory only this user may enter, under `$TMPDIR` (or `/tmp`), removed once accepted.
//
// Thread-safety: any thread (a lock guards the bell).
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
//
// Thread-safety: any thread (a lock guards the bell).
isthmus_code_t isthmus_cq_bell_accept(const isthmus_cq_t *cq,
                                      isthmus_status_t **status);

// Makes the queue's descriptor readable and rings its bell, with no event to take: wakes the
// loop that watches it (nginx's watcher, when its worker is exiting).
//
// Thread-safety: any thread: it is how another thread wakes the queue's loop.
isthmus_code_t isthmus_cq_wake(const isthmus_cq_t *cq);

// Frees a queue. Operations still waiting on it are abandoned: their calls are cancelled and
// their events never come; events not yet taken are freed, and a new call among them (a
// handler's `ISTHMUS_OP_NEW_CALL`) is finished UNAVAILABLE, as one that comes after.
//
// Thread-safety: any thread, once: operations other threads start on it afterwards fail
// `ISTHMUS_INVALID_ARGUMENT`, a thread asleep in `isthmus_cq_wait` on it wakes and gets no
// event, and one in `isthmus_cq_take_call` returns soon with no call.
isthmus_code_t isthmus_cq_free(isthmus_cq_t *cq);

// The message's bytes; their count in `*len`. Valid until the message is freed. NULL (and
// length 0) for an empty message or an invalid handle.
//
// Thread-safety: any thread; several may read the bytes at once. They go with
// `isthmus_message_free`, so do not free the message on another thread while they are in use.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_message_data(const isthmus_message_t *msg,
                                    size_t *len);

// The message's length in bytes (0 for an invalid handle).
//
// Thread-safety: any thread.
size_t isthmus_message_len(const isthmus_message_t *msg);

// Frees a message (over `shm://`, gives its shared memory back to the sender once nothing
// else holds it). `ISTHMUS_INVALID_ARGUMENT` for NULL or a message freed already.
//
// Thread-safety: any thread, once; the bytes that other threads hold from `isthmus_message_data`
// die with it.
isthmus_code_t isthmus_message_free(isthmus_message_t *msg);

// The block's writable bytes; their count in `*len` (after `isthmus_block_truncate`, the
// count it was cut to; NULL and 0 for a block cut to nothing). Valid until the block is sent or
// freed.
//
// Thread-safety: any thread; the bytes are plain memory, so writers on several threads order their
// writes themselves. They go when the block is sent or freed, on any thread.
//
// # Safety
//
// `len` is NULL or writable.
uint8_t *isthmus_block_data(isthmus_block_t *block,
                            size_t *len);

// Copies `len` bytes from `data` into the block at byte `offset`, the way the library fills
// the blocks it copies into: `memcpy` for most sizes, and past a quarter of the last-level
// cache stores that bypass the cache, since the reader is another process (ADR 0022, 0023).
// `data` may lie inside the block itself (the bytes then move as `memmove` moves them).
// `ISTHMUS_INVALID_ARGUMENT`, with nothing written, for a NULL, freed or sent block, a NULL
// `data` with a nonzero `len`, or a range past the block's end (the status says which).
//
// Thread-safety: any thread. Writes to one block from several threads take turns (to fill a
// block from many threads at once, write through `isthmus_block_data`). A send that comes
// while a write runs waits for it, a free lets it finish before the memory goes back, and a
// write after either fails.
//
// # Safety
//
// `data` is NULL or readable for `len` bytes; `status` is NULL or writable.
isthmus_code_t isthmus_block_write(isthmus_block_t *block,
                                   size_t offset,
                                   const uint8_t *data,
                                   size_t len,
                                   isthmus_status_t **status);

// Shortens the block to its first `len` bytes, for a caller that wrote less than it
// allocated: a send then carries those bytes only. The arena space stays the block's until
// the receiver releases the message. `isthmus_block_data` gives the new length after.
// `ISTHMUS_INVALID_ARGUMENT`, the block unchanged, for a NULL, freed or sent block or a `len`
// longer than the block (a block never grows).
//
// Thread-safety: any thread; waits for a write to the block under way (`isthmus_block_write`).
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_block_truncate(isthmus_block_t *block,
                                      size_t len,
                                      isthmus_status_t **status);

// Frees a block that will not be sent (its shared memory goes back to the arena).
//
// Thread-safety: any thread, once; not while another thread still writes the block's bytes.
isthmus_code_t isthmus_block_free(isthmus_block_t *block);

// New empty metadata, to fill with `isthmus_metadata_add` and pass to a call; free it with
// `isthmus_metadata_free` (a call copies what it needs).
//
// Thread-safety: any thread.
isthmus_metadata_t *isthmus_metadata_new(void);

// Appends an entry. The key (NUL-terminated) must be lower-case `0-9 a-z - _ .` and not
// reserved (`grpc-*`, `content-type`, `te`, `user-agent`); keys ending in `-bin` take any
// bytes, others printable ASCII. `ISTHMUS_INVALID_ARGUMENT` with the reason otherwise.
// Entry pointers taken earlier from this metadata are invalid afterwards.
//
// Thread-safety: any thread (a lock guards the entries), but it invalidates the entry pointers
// that `isthmus_metadata_get` gave other threads: do not add while another thread reads entries.
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
//
// Thread-safety: any thread.
size_t isthmus_metadata_len(const isthmus_metadata_t *md);

// Entry `index`: its key (not NUL-terminated) and value (NULL when empty), valid until the
// metadata is changed or freed. `ISTHMUS_OUT_OF_RANGE` past the end; on an error every
// out-pointer is set to NULL or 0.
//
// Thread-safety: any thread; the pointers last until the metadata is changed
// (`isthmus_metadata_add`) or freed, on any thread.
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
//
// Thread-safety: any thread, once; calls given the metadata have copied it already.
isthmus_code_t isthmus_metadata_free(isthmus_metadata_t *md);

// A copy of the status's trailing metadata, which the caller frees; NULL for an invalid
// handle.
//
// Thread-safety: any thread; the copy is the caller's alone.
isthmus_metadata_t *isthmus_status_trailers(const isthmus_status_t *status);

// Compiles `.proto` files (with what they import) at run time. Imports are looked up in the
// `includes` directories, then in the directory of each file neither under nor found in any of
// them (with no `includes`, each file's own directory). A file that does not parse, one whose
// braces nest more than 100 deep, or an import not found, fails with
// `ISTHMUS_INVALID_ARGUMENT` and a message naming the file and line. Free the result with `isthmus_proto_free`.
//
// Thread-safety: any thread, whatever its stack: a caller's thread with less than 1 MiB of
// stack left (4 MiB in a debug build) has the parsing done on a thread of the library's own,
// and so have `isthmus_proto_load_descriptor_set`, `_encode` and `_decode`.
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
// `isthmus_proto_free`. A set that does not decode, or whose files import one another in a
// cycle or more than 100 deep, fails with `ISTHMUS_INVALID_ARGUMENT`.
//
// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`).
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
// Thread-safety: any thread; the string goes with `isthmus_proto_free`, so do not free the proto
// on another thread while it is in use.
//
// # Safety
//
// `path` is a NUL-terminated string.
const char *isthmus_proto_method_type(const isthmus_proto_t *proto,
                                      const char *path,
                                      int32_t which);

// Which sides of the method at `path` (`/package.Service/Method`) stream: its
// `ISTHMUS_PROTO_CLIENT_STREAMING` and `ISTHMUS_PROTO_SERVER_STREAMING` bits (0 for a unary
// method); -1 if no loaded service has that method (or for an invalid handle or path). A
// binding that starts a call through a general stream half-closes it after the one request
// of a method whose client does not stream, as generated clients do: a server may wait for
// that half-close before it answers (tonic's does).
//
// Thread-safety: any thread.
//
// # Safety
//
// `path` is a NUL-terminated string.
int32_t isthmus_proto_method_streams(const isthmus_proto_t *proto,
                                     const char *path);

// Encodes a message of type `type_name` (`package.Message`) from its proto3 JSON form: `*out`
// holds the protobuf bytes. JSON that does not fit the type fails with
// `ISTHMUS_INVALID_ARGUMENT` and a message naming the field. What a JSON encoder of Lua
// tables cannot tell apart is taken as the type declares it: an empty object (`{}`) for an
// empty repeated field, and an array for a map field as keys 1..n (a Lua table with keys
// 1..n is an array to any encoder).
//
// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`); several may use one
// proto at once.
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
// the JSON text. Bytes that are not such a message, or whose `google.protobuf.Any` values nest
// more than 100 deep, fail with `ISTHMUS_INVALID_ARGUMENT`.
//
// Thread-safety: any thread, whatever its stack (as `isthmus_proto_load`); several may use one
// proto at once.
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
//
// Thread-safety: any thread, once; not while another thread still uses it or a string from
// `isthmus_proto_method_type`.
isthmus_code_t isthmus_proto_free(isthmus_proto_t *proto);

// A new server with no handlers. Free it with `isthmus_server_free`.
//
// Thread-safety: any thread.
//
// # Safety
//
// `opts` is NULL or valid.
isthmus_server_t *isthmus_server_new(const isthmus_server_options_t *opts);

// Registers `handler` for `path` (NULL or "": every other path), called with `user_data` for
// each new call. Before `isthmus_server_start` only. A path that is no
// `/package.Service/Method` (a leading `/`, and a method after the last `/`, as grpc-go
// routes them) is `ISTHMUS_INVALID_ARGUMENT`; one already registered (by either
// `add_handler` function or a topic), or a second fallback, `ISTHMUS_ALREADY_EXISTS`.
//
// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them). `handler` is
// called on the library's threads, for several calls at once.
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
// `isthmus_server_start` only; paths are checked as `isthmus_server_add_handler`'s. The queue
// should outlive the server: a call that comes once it is freed fails UNAVAILABLE.
//
// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them). The new calls'
// events go to whichever thread takes them from `cq`.
//
// # Safety
//
// `path` is NULL or NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_server_add_handler_cq(const isthmus_server_t *server,
                                             const char *path,
                                             const isthmus_cq_t *cq,
                                             uint64_t tag,
                                             isthmus_status_t **status);

// Waits up to `spin_us` microseconds on the calling thread for a new call of a handler
// registered on `cq` (`isthmus_server_add_handler_cq`), and takes it: `*tag` and `*call` are
// set as its `ISTHMUS_OP_NEW_CALL` event would set them, and that event never comes. `*call`
// is NULL (and `*tag` 0) if none came in time, or at once if another thread waits here
// already (one thread waits at a time), and on an error. Meant for the thread that has just
// finished a call: the next call then reaches it with no wake-up of the queue's waiter. Calls
// that come while nobody waits here go to the queue as before. The thread also reads the
// connection of the latest call meanwhile, so a call on it may start (and a callback handler
// run) on this thread; the connection goes back to its reader when the wait takes nothing. A
// `spin_us` of 0 takes only a call offered already, and gives that connection back: for a
// thread that will not wait again soon. Freeing the queue ends a wait with no call.
//
// Thread-safety: any thread, which it holds for up to `spin_us`, and longer while a callback
// handler runs on it (above).
//
// # Safety
//
// `tag` and `call` are writable; `status` is NULL or writable.
isthmus_code_t isthmus_cq_take_call(const isthmus_cq_t *cq,
                                    uint32_t spin_us,
                                    uint64_t *tag,
                                    isthmus_server_call_t **call,
                                    isthmus_status_t **status);

// Binds every target in `targets` (`count` NUL-terminated strings: `shm://NAME`,
// `unix:///path.sock`, `http://host:port`) and starts serving them in the background.
// Clients can connect as soon as this returns. A server starts once; a start that fails (a
// target that does not parse or bind, TLS settings that do not load) leaves it as it was,
// handlers and options kept, to be started again.
//
// Thread-safety: any thread, which it blocks while it binds; of two calls at once, one starts the
// server and the other fails `ISTHMUS_FAILED_PRECONDITION`.
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
//
// Thread-safety: any thread; the string goes with the shutdown, so do not shut the server down on
// another thread while it is in use.
const char *isthmus_server_http_address(const isthmus_server_t *server,
                                        size_t index);

// Shuts the server down gracefully, blocking until it has: its sockets go, clients are told
// to go away, new calls are refused with UNAVAILABLE, and calls in progress get `grace_ms`
// milliseconds to finish before their connections close. The handle stays valid (free it
// with `isthmus_server_free`). A server shut down before it started never starts:
// `isthmus_server_start` then fails `ISTHMUS_FAILED_PRECONDITION`, as grpc-go's `Serve`
// after `Stop` does.
//
// Thread-safety: any thread, which it blocks. A second call meanwhile (or an
// `isthmus_server_free`) waits for the shutdown to finish, and ends its grace period sooner if
// its own would end sooner (grpc-go's `Stop` during `GracefulStop`). From a handler of this
// server, its own unfinished call holds the shutdown for the whole grace period.
isthmus_code_t isthmus_server_shutdown(const isthmus_server_t *server,
                                       uint64_t grace_ms);

// Frees a server, shutting it down first (with no grace) if it serves. It returns once no
// handler callback of the server runs on another thread, and none starts after: a call that
// comes meanwhile fails UNAVAILABLE. The handlers' user data may be freed then.
//
// Thread-safety: any thread, once, which it blocks while the server stops and its callbacks
// return; as `isthmus_server_shutdown` otherwise.
isthmus_code_t isthmus_server_free(isthmus_server_t *server);

// The call's method path (not NUL-terminated; its length in `*len`), valid until the call
// is finished.
//
// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
// thread while they are in use.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_server_call_path(const isthmus_server_call_t *call,
                                        size_t *len);

// The client's address (not NUL-terminated; its length in `*len`), valid until the call is
// finished: gRPC's forms (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:/path.sock`) over
// HTTP/2, and over `shm://` the client process's credentials (`shm:pid=123,uid=1000`). NULL
// (length 0) for an invalid handle.
//
// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
// thread while they are in use.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_server_call_peer(const isthmus_server_call_t *call,
                                        size_t *len);

// 1 if the call came over TLS, 0 if not (or for an invalid handle).
//
// Thread-safety: any thread.
int32_t isthmus_server_call_is_tls(const isthmus_server_call_t *call);

// The client's certificate, DER-encoded (its length in `*len`), for a call that came over
// mutual TLS; NULL (length 0) for any other call. Valid until the call is finished.
//
// Thread-safety: any thread; the bytes go with the call's finish, so do not finish it on another
// thread while they are in use.
//
// # Safety
//
// `len` is NULL or writable.
const uint8_t *isthmus_server_call_peer_cert(const isthmus_server_call_t *call,
                                             size_t *len);

// A copy of the client's initial metadata (the caller frees it); NULL for an invalid handle.
//
// Thread-safety: any thread; the copy is the caller's alone.
isthmus_metadata_t *isthmus_server_call_metadata(const isthmus_server_call_t *call);

// Microseconds left before the client's deadline; -1 if it set none.
//
// Thread-safety: any thread.
int64_t isthmus_server_call_time_remaining_us(const isthmus_server_call_t *call);

// What a unary handler asks first, in one call: the client's initial metadata (`*metadata`, a
// copy the caller frees; NULL when there is none: the client's user agent is in it as
// `user-agent` when the client named one), the microseconds left before its
// deadline (`*time_remaining_us`, -1 if it set none), and its request if that is in already:
// then `*now` is written as [`isthmus_server_call_recv_async`] with `flags` 0 would write it
// (`ISTHMUS_OP_RECV`, tag 0: the message, NULL if the client half-closed without one, or the
// failure) and 1 is returned. 0 if the request has not come yet: receive it with
// `isthmus_server_call_recv_async`. -1, with nothing written, for an invalid handle or a NULL
// pointer. For a handler that runs on the connection's reading thread: one crossing of the
// boundary where it would make five.
//
// Thread-safety: any thread; the call's receiving side, as a receive.
//
// # Safety
//
// `metadata`, `time_remaining_us` and `now` are NULL or writable.
int32_t isthmus_server_call_begin(const isthmus_server_call_t *call,
                                  isthmus_metadata_t **metadata,
                                  int64_t *time_remaining_us,
                                  isthmus_event_t *now);

// 1 if the client has half-closed and every request it sent has been taken (received, or
// given by [`isthmus_server_call_begin`]); 0 if not yet, while another thread receives, and
// for an invalid handle. For a handler of a method that takes one request: having taken it,
// 1 says no second one comes, without a receive; 0 asks for one, which gives the end of the
// stream or the second request (gRPC's servers fail such a call INTERNAL, "cardinality
// violation").
//
// Thread-safety: any thread.
int32_t isthmus_server_call_half_closed(const isthmus_server_call_t *call);

// 1 while the call runs (not finished, not cancelled by the client, deadline not passed);
// 0 otherwise.
//
// Thread-safety: any thread.
int32_t isthmus_server_call_is_active(const isthmus_server_call_t *call);

// 1 once the call's initial metadata has gone or is on its way: sent by
// `isthmus_server_call_send_headers`, by a receive with `ISTHMUS_RECV_FLUSH_HEADERS` that had
// to wait (decided by the time `isthmus_server_call_recv_async` returns), or with a first
// response; 0 before, and for an invalid handle. A receive that found its request in sends
// nothing.
//
// Thread-safety: any thread.
int32_t isthmus_server_call_headers_sent(const isthmus_server_call_t *call);

// Receives the next request message, blocking: `ISTHMUS_OK` with `*message` set, or with
// `*message` NULL once the client has half-closed; another code if the call is over. With
// `flags` 0 it sends nothing, so `isthmus_server_call_send_headers` works after it; see
// `ISTHMUS_RECV_FLUSH_HEADERS` for request-streaming handlers. An unknown flag is
// `ISTHMUS_INVALID_ARGUMENT`.
//
// Thread-safety: any thread, which it blocks; the call's receiving side, usable while another
// thread sends (receives from two threads take turns).
//
// # Safety
//
// `message` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_recv(const isthmus_server_call_t *call,
                                        uint32_t flags,
                                        isthmus_message_t **message,
                                        isthmus_status_t **status);

// [`isthmus_server_call_recv`] without blocking (`ISTHMUS_OP_RECV`); an unknown flag is
// `ISTHMUS_INVALID_ARGUMENT`, returned at once.
//
// Thread-safety: any thread, which it holds up to 50 µs with `ISTHMUS_RECV_SPIN` only; the call's
// receiving side, usable while another thread sends.
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
// learns of it this way. An operation like the `_async` ones: `tag` is taken until its event
// is, and `isthmus_cq_cancel` abandons it.
//
// Thread-safety: any thread.
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
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives. Sends from two threads at once take turns, in an order they fix themselves.
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
// Thread-safety: any thread; the call's sending side, usable while another thread receives. Sends
// started from two threads at once go in an order they fix themselves.
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

// A unary handler's whole answer: sends `data` as the response message, then finishes the
// call OK with `trailers` (NULL for none; copied) and frees the handle, as
// [`isthmus_server_call_send_async`] followed by `isthmus_server_call_finish(call, ISTHMUS_OK,
// NULL, trailers, NULL)` would. A small reply that can go at once (the usual case) goes from
// this thread with nothing queued, and the event is in `now`; otherwise the send goes on in
// the queue and the call is finished once it is done. The event (`ISTHMUS_OP_SEND`) says
// whether the message went; a send that failed finished the call with its status.
//
// The handle is freed whatever happens, as by `isthmus_server_call_finish`: a `data` that is
// NULL with a length, a `trailers` or `cq` that is no live handle, a `tag` that names an
// operation still pending on `cq` (`isthmus_server_call_done_async`'s, say: give the reply a
// tag of its own), or a `cq` made before a `fork` still ends the call (INTERNAL, saying which)
// and returns the code that says why (`ISTHMUS_INVALID_ARGUMENT`, or
// `ISTHMUS_FAILED_PRECONDITION` for the fork), with no event.
//
// Thread-safety: any thread, exactly once, in place of `isthmus_server_call_finish`; operations
// other threads start on the call afterwards fail `ISTHMUS_INVALID_ARGUMENT`.
//
// # Safety
//
// `data` is valid for `len` bytes; `now` is NULL or writable; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_reply_async(isthmus_server_call_t *call,
                                               const uint8_t *data,
                                               size_t len,
                                               const isthmus_metadata_t *trailers,
                                               const isthmus_cq_t *cq,
                                               uint64_t tag,
                                               isthmus_event_t *now,
                                               isthmus_status_t **status);

// Sends initial metadata now (otherwise the first message sends empty metadata), blocking.
//
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send_headers(const isthmus_server_call_t *call,
                                                const isthmus_metadata_t *metadata,
                                                isthmus_status_t **status);

// [`isthmus_server_call_send_headers`] without blocking (`ISTHMUS_OP_SEND_HEADERS`).
//
// Thread-safety: any thread; the call's sending side, usable while another thread receives.
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

// Chooses how the call's replies are compressed where they cross a wire, as grpc-go's
// `grpc.SetSendCompressor` and grpcio's `context.set_compression`: `encoding` is `"gzip"`,
// `"deflate"` or `"identity"` (uncompressed, even where the server compresses its replies,
// `ISTHMUS_SERVER_COMPRESS_*`). It applies to calls that came over HTTP/2, for a client whose
// `grpc-accept-encoding` lists the encoding (the others get the replies uncompressed); over
// `shm://` nothing is compressed, and it changes nothing. The choice goes with the initial
// metadata: FAILED_PRECONDITION, and nothing changed, once they or a message have gone or begun
// to go; INVALID_ARGUMENT for a NULL or another name. Made while another thread holds the call
// (an `isthmus_server_call_alloc` waiting for room), the choice waits for the first send.
//
// Thread-safety: any thread; it never blocks.
//
// # Safety
//
// `encoding` is NULL or a NUL-terminated string; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_set_compression(const isthmus_server_call_t *call,
                                                   const char *encoding,
                                                   isthmus_status_t **status);

// A writable block of `len` bytes in the server's shared memory (`shm://` calls only), for a
// reply written in place; send it with `isthmus_server_call_send_block`.
//
// Thread-safety: any thread, which it blocks; the call's sending side, usable while another thread
// receives.
//
// # Safety
//
// `block` is writable; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_alloc(const isthmus_server_call_t *call,
                                         size_t len,
                                         isthmus_block_t **block,
                                         isthmus_status_t **status);

// Sends a block from `isthmus_server_call_alloc` as one response message, with no copy. The
// block handle is consumed, sent or not. A block of another connection fails
// `ISTHMUS_INVALID_ARGUMENT`, and the call goes on.
//
// Thread-safety: any thread, which it blocks; the call's sending side, as
// `isthmus_server_call_send`. No other thread may write the block once it is passed here.
//
// # Safety
//
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_send_block(const isthmus_server_call_t *call,
                                              isthmus_block_t *block,
                                              isthmus_status_t **status);

// Ends the call with `code` (`ISTHMUS_OK` or a gRPC code), `message` (NULL for none) and
// trailing metadata (NULL for none; copied), and frees the handle. Exactly once per call. A
// `code` that is no gRPC code ends the call UNKNOWN, as gRPC clients read one. A `message`
// that is not UTF-8 or a `trailers` that is no live handle still ends the call (INTERNAL,
// saying which) and frees the handle, and returns `ISTHMUS_INVALID_ARGUMENT`.
//
// Thread-safety: any thread, exactly once; operations other threads start on the call afterwards
// fail `ISTHMUS_INVALID_ARGUMENT`, and the path from `isthmus_server_call_path` dies.
//
// # Safety
//
// `message` is NULL or NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_server_call_finish(isthmus_server_call_t *call,
                                          isthmus_code_t code,
                                          const char *message,
                                          const isthmus_metadata_t *trailers,
                                          isthmus_status_t **status);

// [`isthmus_server_call_finish`] with binary details: `details_len` bytes at `details` (NULL
// for none when `details_len` is 0; copied), a serialized `google.rpc.Status` whose code and
// message should match `code` and `message`. They reach the client as the status's details
// (`isthmus_status_details`; over HTTP/2, gRPC's `grpc-status-details-bin` trailer). With a
// NULL `details` and a non-zero length the call still ends (INTERNAL, saying why), the
// handle is freed, and this returns `ISTHMUS_INVALID_ARGUMENT`.
//
// Thread-safety: as `isthmus_server_call_finish`.
//
// # Safety
//
// `message` is NULL or NUL-terminated; `details` is NULL or valid for `details_len` bytes;
// `status` is NULL or writable.
isthmus_code_t isthmus_server_call_finish_with_details(isthmus_server_call_t *call,
                                                       isthmus_code_t code,
                                                       const char *message,
                                                       const uint8_t *details,
                                                       size_t details_len,
                                                       const isthmus_metadata_t *trailers,
                                                       isthmus_status_t **status);

// The channel's counters (see `isthmus_stats_t`) into `*out`. `size` is `sizeof(*out)` as the
// caller compiled it, and the library writes exactly that many bytes: a program built against
// an older header gets the fields it knows and nothing past them, one built against a newer
// header reads the fields this library lacks as 0.
//
// Thread-safety: any thread, an event loop's included: it never waits. The counts are of that
// moment; calls on other threads change them.
//
// # Safety
//
// `out` is NULL or writable for `size` bytes.
isthmus_code_t isthmus_channel_stats(const isthmus_channel_t *channel,
                                     isthmus_stats_t *out,
                                     size_t size);

// The server's counters (see `isthmus_stats_t`) into `*out`, `size` as for
// `isthmus_channel_stats`. All zero before the server starts; after a shutdown, its listeners'
// failures stay and its connections are gone.
//
// Thread-safety: any thread: it never waits for calls or connections. The counts are of that
// moment.
//
// # Safety
//
// `out` is NULL or writable for `size` bytes.
isthmus_code_t isthmus_server_stats(const isthmus_server_t *server,
                                    isthmus_stats_t *out,
                                    size_t size);

// Makes a topic named `name` (for logs). Free it with `isthmus_topic_free`; a server that
// serves it keeps it alive meanwhile.
//
// Thread-safety: any thread.
//
// # Safety
//
// `name` is NUL-terminated; `opts` is NULL or valid; `out` is writable; `status` is NULL or
// writable.
isthmus_code_t isthmus_topic_new(const char *name,
                                 const isthmus_topic_options_t *opts,
                                 isthmus_topic_t **out,
                                 isthmus_status_t **status);

// Publishes `len` bytes to every current subscriber and stores how many it reached in
// `*reached` (NULL: not wanted). It never waits: each subscriber's queue takes the message (a
// full one meets the topic's policy). The bytes are copied before it returns. After
// `isthmus_topic_close`, nothing is published (0 reached).
//
// Thread-safety: any thread; publishes from several threads at once are ordered by a lock.
//
// # Safety
//
// `data` is valid for `len` bytes (or `len` is 0); `reached` and `status` are NULL or writable.
isthmus_code_t isthmus_topic_publish(const isthmus_topic_t *topic,
                                     const uint8_t *data,
                                     size_t len,
                                     size_t *reached,
                                     isthmus_status_t **status);

// `isthmus_topic_publish`, also keeping the message as the topic's state: every later
// subscriber gets it first.
//
// Thread-safety: as `isthmus_topic_publish`.
//
// # Safety
//
// As `isthmus_topic_publish`.
isthmus_code_t isthmus_topic_publish_state(const isthmus_topic_t *topic,
                                           const uint8_t *data,
                                           size_t len,
                                           size_t *reached,
                                           isthmus_status_t **status);

// Forgets the topic's state (`isthmus_topic_publish_state`): later subscribers get none.
//
// Thread-safety: any thread.
isthmus_code_t isthmus_topic_clear_state(const isthmus_topic_t *topic);

// Closes the topic: every subscription ends OK after what it has queued, and later subscribers'
// calls end OK at once. The handle stays valid (free it with `isthmus_topic_free`).
//
// Thread-safety: any thread.
isthmus_code_t isthmus_topic_close(const isthmus_topic_t *topic);

// The topic's counters into `*out`; `size` is `sizeof(*out)` as the caller compiled it, and no
// more is written (see `isthmus_channel_stats`).
//
// Thread-safety: any thread; the counts of that moment.
//
// # Safety
//
// `out` is NULL or writable for `size` bytes.
isthmus_code_t isthmus_topic_stats(const isthmus_topic_t *topic,
                                   isthmus_topic_stats_t *out,
                                   size_t size);

// Frees the topic's handle. It does not close the topic: a server that serves it keeps it,
// and its subscribers, until the server is freed.
//
// Thread-safety: any thread, once.
isthmus_code_t isthmus_topic_free(isthmus_topic_t *topic);

// Serves `topic` at `path`: each call to it (a server-streaming call; its request is not read)
// is a subscriber, sent the topic's state if it has one, then every message published while
// it is subscribed, until its client cancels or goes away, or the topic closes (OK), or the
// server starts to shut down (UNAVAILABLE, once what was queued is sent: a graceful shutdown
// does not wait for subscribers). Before `isthmus_server_start` only; `path` is checked as
// `isthmus_server_add_handler`'s (ALREADY_EXISTS for one that has a handler or a topic).
//
// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them).
//
// # Safety
//
// `path` is NUL-terminated; `status` is NULL or writable.
isthmus_code_t isthmus_server_add_topic(const isthmus_server_t *server,
                                        const char *path,
                                        const isthmus_topic_t *topic,
                                        isthmus_status_t **status);

// [`isthmus_server_add_topic`] for a server whose handlers send messages of at most
// `max_send_message_size` bytes (gRPC's `max_send_message_length`; 0: no limit): a message,
// state or resync over it ends that subscriber's call with `ISTHMUS_RESOURCE_EXHAUSTED`,
// naming its size and the limit, as a handler's send of it would fail; the topic's other
// subscribers go on, and the publish counts only those it reached.
//
// Thread-safety: as [`isthmus_server_add_topic`].
//
// # Safety
//
// As [`isthmus_server_add_topic`].
isthmus_code_t isthmus_server_add_topic_limited(const isthmus_server_t *server,
                                                const char *path,
                                                const isthmus_topic_t *topic,
                                                uint64_t max_send_message_size,
                                                isthmus_status_t **status);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* ISTHMUS_H */
