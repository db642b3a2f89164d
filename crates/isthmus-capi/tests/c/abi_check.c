/*
 * abi_check.c: the C ABI's own tests, through include/isthmus.h and nothing else. tests/c_abi.rs
 * builds it under AddressSanitizer (LeakSanitizer on) and runs it as real processes:
 *
 *   abi_check serve TARGET...   a server with every test handler on each TARGET; prints "ready"
 *                               once it serves, and serves until stdin ends; exit 0 if it then
 *                               shut down and freed every handle.
 *   abi_check client TARGET     every client check, one line each, then "N passed, M failed";
 *                               exit 0 only if all passed. Over a target that is not shm://, the
 *                               zero-copy check expects isthmus_call_alloc's UNIMPLEMENTED.
 *   abi_check peer-gone TARGET  starts a call to Sleep, prints "waiting", and expects UNAVAILABLE
 *                               once the harness has killed the server (SIGKILL).
 *   abi_check second-copy LIBRARY TARGET
 *                               loads LIBRARY (a copy of the library at another path) with
 *                               dlopen and calls TARGET through it and through the linked one.
 *   abi_check serve-tls DIR TARGET...
 *                               `serve` with TLS from DIR (server.crt, server.key, and client-ca.crt
 *                               whose certificates it requires of clients); prints "ready", then
 *                               "address A" for its first HTTP/2 endpoint.
 *   abi_check client-tls DIR ADDRESS
 *                               the TLS checks against a serve-tls server: mutual TLS with DIR's
 *                               ca.crt, client.crt and client.key; a client without a certificate,
 *                               one trusting other-ca.crt, and one expecting another name all fail
 *                               UNAVAILABLE; settings that cannot work are INVALID_ARGUMENT.
 *
 * The handlers, under /isthmus.test.Echo/ (each answers on a thread of its own but Fail, whose
 * answer is at hand, and Queued, which a completion queue delivers to a polling thread):
 *
 *   Unary         echo the request; the client's `x-echo` back as a header and a trailer;
 *                 trailer `x-has-deadline` 1 or 0 (isthmus_server_call_time_remaining_us)
 *   ServerStream  request: u32 LE N; N responses of 4 bytes, each its index; trailer `x-count`
 *   ClientStream  one response: the requests' total size, u64 LE
 *   Bidi          send (empty) headers at once, then echo each request as it comes
 *   Fail          NOT_FOUND "nothing here", trailer `x-why: test`, details FAIL_DETAILS
 *   HeadFail      header `x-head: early`, then fail as Fail does
 *   Sleep         wait until the call is no longer active (5 s at most), then CANCELLED
 *   Block         echo the request through isthmus_server_call_alloc + _send_block
 *   Queued        echo every request through the _async functions on a completion queue
 *   Whoami        "tls=T cert=N peer=P": isthmus_server_call_is_tls, the length of the client's
 *                 certificate (isthmus_server_call_peer_cert) and isthmus_server_call_peer
 *   BadFinish     finish with a freed trailers handle (request "t"), NULL details of length 5
 *                 (request "d") or a message that is not UTF-8: the call must still end
 *                 (INTERNAL) instead of hanging
 *   Reply         answer with isthmus_server_call_reply_async: echo the request (request "L": a
 *                 1 MiB pattern; "C" 4 MiB first, which takes the client's window, then the 1 MiB
 *                 reply, which waits on the queue for credit, its operation cancelled at once,
 *                 and "F" the same with its queue freed), trailer `x-replied: 1`; request "t"
 *                 gives a freed trailers handle and "q" no queue, which must end the call
 *                 INTERNAL; request "?" answers "problems=N", what the earlier Reply calls found
 *                 wrong on the server's side (an event not as promised, a finish after the reply
 *                 not refused)
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "isthmus.h"

#define SVC "/isthmus.test.Echo/"
#define MIB ((size_t)1 << 20)
/* The server's request limit: a 64 MiB message fits, a 65 MiB one does not. */
#define SERVER_LIMIT ((uint64_t)(64 * MIB + 4096))
/* The deadline of every client call that should not wait: a hang fails instead. */
#define CALL_TIMEOUT_US ((int64_t)60 * 1000 * 1000)

/* ---- small helpers ---- */

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {
  }
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* A pattern that differs at every offset a misplaced copy could land on. */
static void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 31u + seed) ^ (i >> 11) ^ (i >> 19));
}

static int bytes_are(const isthmus_message_t *msg, const void *want, size_t want_len) {
  size_t len = 0;
  const uint8_t *data = isthmus_message_data(msg, &len);
  return data != NULL && len == want_len && memcmp(data, want, len) == 0;
}

/* The first value of `key` in `md` (NULL if none), valid until `md` changes or is freed. */
static const uint8_t *md_find(const isthmus_metadata_t *md, const char *key, size_t *len) {
  size_t n = isthmus_metadata_len(md), key_len = strlen(key);
  for (size_t i = 0; i < n; i++) {
    const uint8_t *k = NULL, *v = NULL;
    size_t kl = 0, vl = 0;
    if (isthmus_metadata_get(md, i, &k, &kl, &v, &vl) != ISTHMUS_OK) return NULL;
    if (kl == key_len && memcmp(k, key, kl) == 0) {
      *len = vl;
      return v;
    }
  }
  return NULL;
}

static int md_is(const isthmus_metadata_t *md, const char *key, const char *value) {
  size_t len = 0;
  const uint8_t *v = md_find(md, key, &len);
  return v != NULL && len == strlen(value) && memcmp(v, value, len) == 0;
}

/* Frees whatever handles a completion-queue event carries. */
static void event_free(isthmus_event_t *ev) {
  if (ev->call) isthmus_call_free(ev->call);
  if (ev->server_call) isthmus_server_call_finish(ev->server_call, ISTHMUS_CANCELLED, "dropped", NULL, NULL);
  if (ev->message) isthmus_message_free(ev->message);
  if (ev->metadata) isthmus_metadata_free(ev->metadata);
  if (ev->trailers) isthmus_metadata_free(ev->trailers);
  if (ev->status) isthmus_status_free(ev->status);
  memset(ev, 0, sizeof *ev);
}

/* ---- the server ---- */

typedef void (*run_fn)(isthmus_server_call_t *call);

/* Ends `call` after a failed operation with that operation's code and status (freed). */
static void finish_failed(isthmus_server_call_t *call, isthmus_code_t code, isthmus_status_t *st,
                          const char *otherwise) {
  isthmus_server_call_finish(call, code, st ? isthmus_status_message(st) : otherwise, NULL, NULL);
  if (st) isthmus_status_free(st);
}

static int path_is(isthmus_server_call_t *call, const char *want) {
  size_t len = 0;
  const uint8_t *p = isthmus_server_call_path(call, &len);
  return p != NULL && len == strlen(want) && memcmp(p, want, len) == 0;
}

static void h_unary(isthmus_server_call_t *call) {
  if (!path_is(call, SVC "Unary")) {
    isthmus_server_call_finish(call, ISTHMUS_INTERNAL, "isthmus_server_call_path is wrong", NULL, NULL);
    return;
  }
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  isthmus_metadata_t *in = isthmus_server_call_metadata(call);
  isthmus_metadata_t *headers = isthmus_metadata_new(), *trailers = isthmus_metadata_new();
  size_t echo_len = 0;
  const uint8_t *echo = md_find(in, "x-echo", &echo_len);
  if (echo) {
    isthmus_metadata_add(headers, "x-echo", echo, echo_len, NULL);
    isthmus_metadata_add(trailers, "x-echo", echo, echo_len, NULL);
  }
  const char *deadline = isthmus_server_call_time_remaining_us(call) >= 0 ? "1" : "0";
  isthmus_metadata_add(trailers, "x-has-deadline", (const uint8_t *)deadline, 1, NULL);

  /* The replies' compression (isthmus_server_call_set_compression): taken before any reply
     (over shm:// it changes nothing on the wire), a bad name or NULL refused, too late once
     the reply went. A wrong answer fails the call with what was wrong. */
  const char *wrong = NULL;
  if (isthmus_server_call_set_compression(call, "gzip", NULL) != ISTHMUS_OK)
    wrong = "set_compression: gzip refused before the reply";
  else if (isthmus_server_call_set_compression(call, "zstd", NULL) != ISTHMUS_INVALID_ARGUMENT)
    wrong = "set_compression: zstd taken";
  else if (isthmus_server_call_set_compression(call, NULL, NULL) != ISTHMUS_INVALID_ARGUMENT)
    wrong = "set_compression: NULL taken";
  else if (isthmus_server_call_recv(call, 0x80000000u, &req, NULL) != ISTHMUS_INVALID_ARGUMENT || req != NULL)
    wrong = "recv: an unknown flag taken";

  isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
  if (rc == ISTHMUS_OK && req == NULL) rc = ISTHMUS_INVALID_ARGUMENT;
  if (rc == ISTHMUS_OK && echo) rc = isthmus_server_call_send_headers(call, headers, &st);
  if (rc == ISTHMUS_OK) {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(req, &len);
    rc = isthmus_server_call_send(call, data, len, &st);
  }
  if (rc == ISTHMUS_OK && !wrong &&
      isthmus_server_call_set_compression(call, "identity", NULL) != ISTHMUS_FAILED_PRECONDITION)
    wrong = "set_compression: taken after the reply";
  if (rc == ISTHMUS_OK && wrong)
    isthmus_server_call_finish(call, ISTHMUS_INTERNAL, wrong, NULL, NULL);
  else if (rc == ISTHMUS_OK)
    isthmus_server_call_finish(call, ISTHMUS_OK, NULL, trailers, NULL);
  else
    finish_failed(call, rc, st, "no request");
  if (req) isthmus_message_free(req);
  isthmus_metadata_free(in);
  isthmus_metadata_free(headers);
  isthmus_metadata_free(trailers);
}

static void h_server_stream(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
  if (rc != ISTHMUS_OK || req == NULL || isthmus_message_len(req) != 4) {
    finish_failed(call, rc == ISTHMUS_OK ? ISTHMUS_INVALID_ARGUMENT : rc, st, "the request is no u32");
    if (req) isthmus_message_free(req);
    return;
  }
  uint32_t n = get_u32(isthmus_message_data(req, NULL));
  isthmus_message_free(req);
  for (uint32_t i = 0; i < n; i++) {
    uint8_t b[4];
    put_u32(b, i);
    rc = isthmus_server_call_send(call, b, sizeof b, &st);
    if (rc != ISTHMUS_OK) {
      finish_failed(call, rc, st, "send failed");
      return;
    }
  }
  char count[16];
  snprintf(count, sizeof count, "%" PRIu32, n);
  isthmus_metadata_t *trailers = isthmus_metadata_new();
  isthmus_metadata_add(trailers, "x-count", (const uint8_t *)count, strlen(count), NULL);
  isthmus_server_call_finish(call, ISTHMUS_OK, NULL, trailers, NULL);
  isthmus_metadata_free(trailers);
}

static void h_client_stream(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  uint64_t total = 0;
  for (;;) {
    isthmus_message_t *req = NULL;
    isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
    if (rc != ISTHMUS_OK) {
      finish_failed(call, rc, st, "recv failed");
      return;
    }
    if (req == NULL) break;
    total += isthmus_message_len(req);
    isthmus_message_free(req);
  }
  uint8_t b[8];
  put_u64(b, total);
  isthmus_code_t rc = isthmus_server_call_send(call, b, sizeof b, &st);
  if (rc == ISTHMUS_OK)
    isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
  else
    finish_failed(call, rc, st, "send failed");
}

static void h_bidi(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  /* open the response first: a client may wait for the headers before it sends */
  isthmus_code_t opened = isthmus_server_call_send_headers(call, NULL, &st);
  if (opened != ISTHMUS_OK) {
    finish_failed(call, opened, st, "send_headers failed");
    return;
  }
  for (;;) {
    isthmus_message_t *req = NULL;
    isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
    if (rc == ISTHMUS_OK && req == NULL) break;
    if (rc == ISTHMUS_OK) {
      size_t len = 0;
      const uint8_t *data = isthmus_message_data(req, &len);
      rc = isthmus_server_call_send(call, data, len, &st);
      isthmus_message_free(req);
    }
    if (rc != ISTHMUS_OK) {
      finish_failed(call, rc, st, "echo failed");
      return;
    }
  }
  isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
}

/* Fail's status details: bytes of any value, NUL included (a serialized google.rpc.Status in
 * real use). */
static const uint8_t FAIL_DETAILS[] = {0x08, 0x05, 0x00, 'w', 'h', 'y', 0xff};

static void h_fail(isthmus_server_call_t *call) {
  isthmus_metadata_t *trailers = isthmus_metadata_new();
  isthmus_metadata_add(trailers, "x-why", (const uint8_t *)"test", 4, NULL);
  isthmus_server_call_finish_with_details(call, ISTHMUS_NOT_FOUND, "nothing here", FAIL_DETAILS, sizeof FAIL_DETAILS,
                                          trailers, NULL);
  isthmus_metadata_free(trailers);
}

/* Initial metadata first, then Fail's status: the client keeps both. */
static void h_head_fail(isthmus_server_call_t *call) {
  isthmus_metadata_t *head = isthmus_metadata_new();
  isthmus_metadata_add(head, "x-head", (const uint8_t *)"early", 5, NULL);
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = isthmus_server_call_send_headers(call, head, &st);
  isthmus_metadata_free(head);
  if (rc != ISTHMUS_OK) {
    finish_failed(call, rc, st, "send_headers failed");
    return;
  }
  h_fail(call);
}

/* Whether status `st` carries exactly FAIL_DETAILS. */
static int has_fail_details(const isthmus_status_t *st) {
  size_t n = 0;
  const uint8_t *d = isthmus_status_details(st, &n);
  return d != NULL && n == sizeof FAIL_DETAILS && memcmp(d, FAIL_DETAILS, n) == 0;
}

/* Finishes with a bad argument (request "t": a freed trailers handle; else a message that is
 * not UTF-8): the call must end all the same (INTERNAL), not hang with its handle gone. */
static void h_bad_finish(isthmus_server_call_t *call) {
  isthmus_metadata_t *stale = isthmus_metadata_new();
  isthmus_metadata_free(stale);
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  char kind = isthmus_server_call_recv(call, 0, &req, NULL) == ISTHMUS_OK && req != NULL &&
                       isthmus_message_len(req) == 1
                   ? (char)isthmus_message_data(req, NULL)[0]
                   : 0;
  if (req) isthmus_message_free(req);
  isthmus_code_t rc = kind == 't'   ? isthmus_server_call_finish(call, ISTHMUS_OK, NULL, stale, &st)
                      : kind == 'd' ? isthmus_server_call_finish_with_details(call, ISTHMUS_ABORTED, NULL, NULL, 5, NULL, &st)
                                    : isthmus_server_call_finish(call, ISTHMUS_OK, "\377", NULL, &st);
  if (rc != ISTHMUS_INVALID_ARGUMENT) fprintf(stderr, "serve: BadFinish: finish gave %s\n", isthmus_code_name(rc));
  if (st) isthmus_status_free(st);
}

static atomic_int g_reply_problems;

static void reply_problem(const char *what, isthmus_code_t rc) {
  fprintf(stderr, "serve: Reply: %s (%s)\n", what, isthmus_code_name(rc));
  atomic_fetch_add(&g_reply_problems, 1);
}

/* The reply's event: in `now`, or the next on the queue. */
static void reply_event(isthmus_cq_t *cq, isthmus_event_t *now) {
  struct pollfd p = {isthmus_cq_fd(cq), POLLIN, 0};
  double deadline = now_s() + 30.0;
  while (now->op == 0 && now_s() < deadline)
    if (poll(&p, 1, 200) > 0) isthmus_cq_poll(cq, now, 1);
}

static void h_reply(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  isthmus_cq_t *cq = isthmus_cq_new();
  isthmus_metadata_t *trailers = isthmus_metadata_new(), *stale = isthmus_metadata_new();
  isthmus_metadata_free(stale);
  isthmus_metadata_add(trailers, "x-replied", (const uint8_t *)"1", 1, NULL);
  /* isthmus_server_call_begin: the metadata (NULL: none), the deadline as
     isthmus_server_call_time_remaining_us says, and the request if it is in (it came inside
     the call's HEADERS); else a receive takes it. */
  isthmus_metadata_t *md = NULL;
  int64_t left = -2;
  isthmus_event_t first;
  memset(&first, 0, sizeof first);
  int in = isthmus_server_call_begin(call, &md, &left, &first);
  if (in != 0 && in != 1) reply_problem("begin's answer", (isthmus_code_t)in);
  if (left < -1 || (left >= 0) != (isthmus_server_call_time_remaining_us(call) >= 0))
    reply_problem("begin's deadline", (isthmus_code_t)left);
  if (md) isthmus_metadata_free(md);
  isthmus_code_t rc = ISTHMUS_OK;
  if (in == 1) {
    if (first.op != ISTHMUS_OP_RECV || first.tag != 0) reply_problem("begin's event", (isthmus_code_t)first.op);
    rc = first.code;
    req = first.message;
    st = first.status;
  } else {
    rc = isthmus_server_call_recv(call, 0, &req, &st);
  }
  if (rc == ISTHMUS_OK && req != NULL && !isthmus_server_call_half_closed(call)) {
    /* A unary call: the client's half-close, if it did not come with the request, comes
       next, and then the call says so (isthmus_server_call_half_closed). */
    isthmus_message_t *more = NULL;
    isthmus_status_t *more_st = NULL;
    isthmus_code_t more_rc = isthmus_server_call_recv(call, 0, &more, &more_st);
    if (more_rc != ISTHMUS_OK || more != NULL || !isthmus_server_call_half_closed(call))
      reply_problem("the half-close after the request", more_rc);
    if (more) isthmus_message_free(more);
    if (more_st) isthmus_status_free(more_st);
  }
  if (cq == NULL || rc != ISTHMUS_OK || req == NULL) {
    finish_failed(call, rc == ISTHMUS_OK ? ISTHMUS_INTERNAL : rc, st, "no request or no queue");
  } else {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(req, &len);
    char kind = len == 1 ? (char)data[0] : 0, answer[32];
    uint8_t *big = NULL;
    if ((kind == 'L' || kind == 'C' || kind == 'F') && (big = malloc(MIB)) != NULL) {
      fill_pattern(big, MIB, 3);
      data = big;
      len = MIB;
    } else if (kind == '?') {
      len = (size_t)snprintf(answer, sizeof answer, "problems=%d", atomic_load(&g_reply_problems));
      data = (const uint8_t *)answer;
    }
    int bad = kind == 't' || kind == 'q';
    if (kind == 'C' || kind == 'F') {
      /* First a message that takes the client's whole window (4 MiB): the reply then waits
         on the queue for credit, which comes only once the client has read it. */
      uint8_t *fill = calloc(1, 4 * MIB);
      if (fill == NULL || isthmus_server_call_send(call, fill, 4 * MIB, &st) != ISTHMUS_OK)
        reply_problem("the 4 MiB message before the reply", ISTHMUS_INTERNAL);
      free(fill);
    }
    isthmus_event_t now;
    memset(&now, 0, sizeof now);
    rc = isthmus_server_call_reply_async(call, data, len, kind == 't' ? stale : trailers, kind == 'q' ? NULL : cq, 7,
                                         &now, &st);
    if (rc != (bad ? ISTHMUS_INVALID_ARGUMENT : ISTHMUS_OK)) reply_problem("reply_async's code", rc);
    if (rc == ISTHMUS_OK && kind == 'F' && now.op == 0) {
      /* The queue freed under the reply: the call must still end (CANCELLED), not wait for
         its deadline with no handle left to finish it. */
      isthmus_cq_free(cq);
      cq = NULL;
    } else if (rc == ISTHMUS_OK && kind == 'C' && now.op == 0 && isthmus_cq_cancel(cq, 7) == ISTHMUS_OK) {
      /* The same with the reply's operation cancelled; no event comes for it. */
    } else if (rc == ISTHMUS_OK) {
      reply_event(cq, &now);
      if (now.op != ISTHMUS_OP_SEND || now.tag != 7 || now.code != ISTHMUS_OK) reply_problem("the event", now.code);
      event_free(&now);
    }
    /* the handle is gone, whatever the reply's outcome */
    isthmus_code_t again = isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
    if (again != ISTHMUS_INVALID_ARGUMENT) reply_problem("a finish after the reply", again);
    free(big);
  }
  if (st) isthmus_status_free(st);
  if (req) isthmus_message_free(req);
  isthmus_metadata_free(trailers);
  if (cq) isthmus_cq_free(cq);
}

static void h_whoami(isthmus_server_call_t *call) {
  size_t peer_len = 0, cert_len = 0;
  const uint8_t *peer = isthmus_server_call_peer(call, &peer_len);
  const uint8_t *cert = isthmus_server_call_peer_cert(call, &cert_len);
  char reply[512];
  int n = snprintf(reply, sizeof reply, "tls=%d cert=%zu peer=%.*s", isthmus_server_call_is_tls(call),
                   cert ? cert_len : 0, peer ? (int)peer_len : 0, peer ? (const char *)peer : "");
  isthmus_code_t rc = isthmus_server_call_send(call, (const uint8_t *)reply, (size_t)n, NULL);
  isthmus_server_call_finish(call, rc, rc == ISTHMUS_OK ? NULL : "send failed", NULL, NULL);
}

/* The server serve() runs, for the Stats handler. */
static isthmus_server_t *g_server;

/* The topic the server serves at Watch; Publish publishes its request to it (PublishState as
 * the topic's state) and answers "reached=N". */
static isthmus_topic_t *g_topic;

static void h_publish(isthmus_server_call_t *call) {
  isthmus_message_t *req = NULL;
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
  if (rc != ISTHMUS_OK || req == NULL) {
    finish_failed(call, rc == ISTHMUS_OK ? ISTHMUS_INVALID_ARGUMENT : rc, st, "no request");
    return;
  }
  size_t len = 0, reached = 0;
  const uint8_t *data = isthmus_message_data(req, &len);
  rc = path_is(call, SVC "PublishState") ? isthmus_topic_publish_state(g_topic, data, len, &reached, NULL)
                                         : isthmus_topic_publish(g_topic, data, len, &reached, NULL);
  isthmus_message_free(req);
  char reply[64];
  int n = snprintf(reply, sizeof reply, "reached=%zu", reached);
  if (rc == ISTHMUS_OK) rc = isthmus_server_call_send(call, (const uint8_t *)reply, (size_t)n, NULL);
  isthmus_server_call_finish(call, rc, rc == ISTHMUS_OK ? NULL : "publish failed", NULL, NULL);
}

/* Replies with the server's counters as text: what a client cannot see from its side. */
static void h_stats(isthmus_server_call_t *call) {
  isthmus_stats_t s;
  memset(&s, 0, sizeof s);
  isthmus_code_t rc = isthmus_server_stats(g_server, &s, sizeof s);
  char reply[512];
  int n = snprintf(reply, sizeof reply,
                   "connections=%llu started=%llu in_flight=%llu ok=%llu not_found=%llu received=%llu "
                   "accept_errors=%llu handshakes_failed=%llu",
                   (unsigned long long)s.connections, (unsigned long long)s.calls_started,
                   (unsigned long long)s.calls_in_flight, (unsigned long long)s.calls_finished[ISTHMUS_OK],
                   (unsigned long long)s.calls_finished[ISTHMUS_NOT_FOUND], (unsigned long long)s.bytes_received,
                   (unsigned long long)s.accept_errors, (unsigned long long)s.handshakes_failed);
  if (rc == ISTHMUS_OK) rc = isthmus_server_call_send(call, (const uint8_t *)reply, (size_t)n, NULL);
  isthmus_server_call_finish(call, rc, rc == ISTHMUS_OK ? NULL : "isthmus_server_stats failed", NULL, NULL);
}

/* How Sleep calls ended: when their call did (cancel, deadline, shutdown), or after 5 s; and
 * how many began. */
static atomic_int g_sleep_ended_early, g_sleep_ran_out, g_sleep_began;

static void h_sleep(isthmus_server_call_t *call) {
  atomic_fetch_add(&g_sleep_began, 1);
  double end = now_s() + 5.0;
  while (isthmus_server_call_is_active(call) && now_s() < end) sleep_ms(5);
  atomic_fetch_add(isthmus_server_call_is_active(call) ? &g_sleep_ran_out : &g_sleep_ended_early, 1);
  isthmus_server_call_finish(call, ISTHMUS_CANCELLED, "slept", NULL, NULL);
}

static void h_block(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  isthmus_block_t *block = NULL;
  isthmus_code_t rc = isthmus_server_call_recv(call, 0, &req, &st);
  if (rc != ISTHMUS_OK || req == NULL || isthmus_message_len(req) == 0) {
    finish_failed(call, rc == ISTHMUS_OK ? ISTHMUS_INVALID_ARGUMENT : rc, st, "no request");
    if (req) isthmus_message_free(req);
    return;
  }
  size_t len = 0, block_len = 0;
  const uint8_t *data = isthmus_message_data(req, &len);
  rc = isthmus_server_call_alloc(call, len, &block, &st);
  if (rc == ISTHMUS_OK) {
    uint8_t *dst = isthmus_block_data(block, &block_len);
    if (dst == NULL || block_len != len) {
      isthmus_block_free(block);
      isthmus_message_free(req);
      isthmus_server_call_finish(call, ISTHMUS_INTERNAL, "isthmus_block_data is wrong", NULL, NULL);
      return;
    }
    memcpy(dst, data, len);
    rc = isthmus_server_call_send_block(call, block, &st);
  }
  isthmus_message_free(req);
  if (rc == ISTHMUS_OK)
    isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
  else
    finish_failed(call, rc, st, "block failed");
}

/* Handler threads: one per call, joined once done (and all of them at shutdown). */
typedef struct worker {
  pthread_t tid;
  run_fn run;
  isthmus_server_call_t *call;
  atomic_int done;
  struct worker *next;
} worker_t;

static pthread_mutex_t g_workers_mu = PTHREAD_MUTEX_INITIALIZER;
static worker_t *g_workers;

static void *worker_main(void *arg) {
  worker_t *w = arg;
  w->run(w->call);
  atomic_store(&w->done, 1);
  return NULL;
}

/* Joins the workers that are done (all of them with `all`, waiting for each). */
static void reap_workers(int all) {
  pthread_mutex_lock(&g_workers_mu);
  for (worker_t **w = &g_workers; *w;) {
    if (all || atomic_load(&(*w)->done)) {
      worker_t *gone = *w;
      *w = gone->next;
      pthread_join(gone->tid, NULL);
      free(gone);
    } else {
      w = &(*w)->next;
    }
  }
  pthread_mutex_unlock(&g_workers_mu);
}

typedef struct {
  const char *path;
  run_fn run;
  int own_thread; /* 0: answered in the callback itself (it does not block) */
} handler_t;

/* g_handlers' index of Sleep, for a server of the client's own. */
#define SLEEP_HANDLER 5

static handler_t g_handlers[] = {
    {SVC "Unary", h_unary, 1},     {SVC "ServerStream", h_server_stream, 1},
    {SVC "ClientStream", h_client_stream, 1}, {SVC "Bidi", h_bidi, 1},
    {SVC "Fail", h_fail, 0},       {SVC "Sleep", h_sleep, 1},
    {SVC "HeadFail", h_head_fail, 1},
    {SVC "Block", h_block, 1},     {SVC "BadFinish", h_bad_finish, 1},
    {SVC "Whoami", h_whoami, 0},   {SVC "Reply", h_reply, 1},
    {SVC "Stats", h_stats, 0},     {SVC "Publish", h_publish, 1},
    {SVC "PublishState", h_publish, 1},
};

/* The callback every handler path shares: hands the call to a thread (callbacks must not block). */
static void on_call(void *user_data, isthmus_server_call_t *call) {
  const handler_t *h = user_data;
  if (!h->own_thread) {
    h->run(call);
    return;
  }
  reap_workers(0);
  worker_t *w = calloc(1, sizeof *w);
  if (w == NULL) {
    isthmus_server_call_finish(call, ISTHMUS_RESOURCE_EXHAUSTED, "out of memory", NULL, NULL);
    return;
  }
  w->run = h->run;
  w->call = call;
  pthread_mutex_lock(&g_workers_mu);
  if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
    pthread_mutex_unlock(&g_workers_mu);
    free(w);
    isthmus_server_call_finish(call, ISTHMUS_RESOURCE_EXHAUSTED, "no thread", NULL, NULL);
    return;
  }
  w->next = g_workers;
  g_workers = w;
  pthread_mutex_unlock(&g_workers_mu);
}

/* The Queued path: calls arrive as ISTHMUS_OP_NEW_CALL events on a queue that one thread polls;
 * each is echoed one request at a time (recv_async, then send_async, then recv_async again). */
#define TAG_NEW_CALL 1

typedef struct qcall {
  isthmus_server_call_t *call;
  struct qcall *prev, *next;
} qcall_t;

typedef struct {
  isthmus_cq_t *cq;
  int stop_fd; /* readable: stop */
  qcall_t *calls;
} queue_server_t;

static void qcall_end(queue_server_t *qs, qcall_t *q, isthmus_code_t code, isthmus_status_t *st) {
  if (code == ISTHMUS_OK)
    isthmus_server_call_finish(q->call, ISTHMUS_OK, NULL, NULL, NULL);
  else
    finish_failed(q->call, code, st, "queued call failed");
  if (q->prev) q->prev->next = q->next; else qs->calls = q->next;
  if (q->next) q->next->prev = q->prev;
  free(q);
}

static void queue_event(queue_server_t *qs, isthmus_event_t *ev);

/* A request waited for on this thread first (ISTHMUS_RECV_SPIN): one that came within the
 * spin is handled at once, from `now`; otherwise its event comes on the queue. */
static void qcall_recv(queue_server_t *qs, qcall_t *q) {
  isthmus_status_t *st = NULL;
  isthmus_event_t now;
  memset(&now, 0, sizeof now);
  isthmus_code_t rc =
      isthmus_server_call_recv_async(q->call, ISTHMUS_RECV_SPIN, qs->cq, (uint64_t)(uintptr_t)q, &now, &st);
  if (rc != ISTHMUS_OK) {
    qcall_end(qs, q, rc, st);
  } else if (now.op != 0) {
    queue_event(qs, &now);
    event_free(&now);
  }
}

static void queue_event(queue_server_t *qs, isthmus_event_t *ev) {
  isthmus_status_t *st = NULL;
  if (ev->op == ISTHMUS_OP_NEW_CALL) {
    qcall_t *q = calloc(1, sizeof *q);
    if (q == NULL) return; /* event_free below finishes the call */
    q->call = ev->server_call;
    ev->server_call = NULL;
    q->next = qs->calls;
    if (q->next) q->next->prev = q;
    qs->calls = q;
    qcall_recv(qs, q);
    return;
  }
  qcall_t *q = (qcall_t *)(uintptr_t)ev->tag;
  if (ev->code != ISTHMUS_OK) {
    qcall_end(qs, q, ev->code, ev->status);
    ev->status = NULL;
  } else if (ev->op == ISTHMUS_OP_RECV && ev->message == NULL) {
    qcall_end(qs, q, ISTHMUS_OK, NULL);
  } else if (ev->op == ISTHMUS_OP_RECV) {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(ev->message, &len);
    isthmus_code_t rc = isthmus_server_call_send_async(q->call, data, len, qs->cq, ev->tag, NULL, &st);
    if (rc != ISTHMUS_OK) qcall_end(qs, q, rc, st);
  } else if (ev->op == ISTHMUS_OP_SEND) {
    qcall_recv(qs, q);
  }
}

static void *queue_main(void *arg) {
  queue_server_t *qs = arg;
  struct pollfd fds[2] = {{isthmus_cq_fd(qs->cq), POLLIN, 0}, {qs->stop_fd, POLLIN, 0}};
  for (;;) {
    if (poll(fds, 2, 1000) < 0 && errno != EINTR) break;
    if (fds[1].revents) break;
    if (!(fds[0].revents & POLLIN)) continue;
    isthmus_event_t evs[8];
    size_t n = isthmus_cq_poll(qs->cq, evs, 8);
    for (size_t i = 0; i < n; i++) {
      queue_event(qs, &evs[i]);
      event_free(&evs[i]);
    }
  }
  while (qs->calls) qcall_end(qs, qs->calls, ISTHMUS_CANCELLED, NULL);
  return NULL;
}

static void print_status(const char *what, isthmus_code_t rc, isthmus_status_t *st) {
  fprintf(stderr, "%s: %s: %s\n", what, isthmus_code_name(rc), st ? isthmus_status_message(st) : "");
  if (st) isthmus_status_free(st);
}

/* The whole of DIR/NAME as a NUL-terminated string (the caller frees it); NULL if unreadable. */
static char *read_file(const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  size_t cap = 4096, len = 0;
  char *text = malloc(cap);
  size_t n;
  while (text != NULL && (n = fread(text + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) {
      char *more = realloc(text, cap *= 2);
      if (more == NULL) free(text);
      text = more;
    }
  }
  fclose(f);
  if (text != NULL) text[len] = 0;
  return text;
}

/* Serves `targets`; with `tls_dir`, with TLS from its files (see the top of this file). */
static int serve(int count, char **targets, const char *tls_dir) {
  isthmus_status_t *st = NULL;
  isthmus_server_options_t opts;
  isthmus_tls_options_t tls;
  memset(&opts, 0, sizeof opts);
  memset(&tls, 0, sizeof tls);
  opts.max_message_size = SERVER_LIMIT;
  /* Its replies over HTTP/2 go gzipped (every check's client reads them); shm:// as they are. */
  opts.flags = ISTHMUS_SERVER_COMPRESS_GZIP;
  if (tls_dir != NULL) {
    tls.cert_chain_pem = read_file(tls_dir, "server.crt");
    tls.private_key_pem = read_file(tls_dir, "server.key");
    tls.root_certs_pem = read_file(tls_dir, "client-ca.crt");
    tls.require_client_cert = 1;
    if (!tls.cert_chain_pem || !tls.private_key_pem || !tls.root_certs_pem) {
      fprintf(stderr, "serve: cannot read the TLS files in %s\n", tls_dir);
      return 1;
    }
    opts.tls = &tls;
  }
  isthmus_server_t *server = isthmus_server_new(&opts);
  g_server = server;
  /* The server copied the settings. */
  free((char *)tls.cert_chain_pem);
  free((char *)tls.private_key_pem);
  free((char *)tls.root_certs_pem);
  isthmus_cq_t *cq = isthmus_cq_new();
  if (server == NULL || cq == NULL) {
    fprintf(stderr, "serve: isthmus_server_new or isthmus_cq_new failed\n");
    return 1;
  }
  for (size_t i = 0; i < sizeof g_handlers / sizeof g_handlers[0]; i++) {
    isthmus_code_t rc = isthmus_server_add_handler(server, g_handlers[i].path, on_call, &g_handlers[i], &st);
    if (rc != ISTHMUS_OK) {
      print_status("serve: isthmus_server_add_handler", rc, st);
      return 1;
    }
  }
  isthmus_code_t rc = isthmus_server_add_handler_cq(server, SVC "Queued", cq, TAG_NEW_CALL, &st);
  if (rc != ISTHMUS_OK) {
    print_status("serve: isthmus_server_add_handler_cq", rc, st);
    return 1;
  }
  isthmus_topic_options_t topic_opts = {4, 0}; /* a small queue: a subscriber that reads nothing drops */
  if ((rc = isthmus_topic_new("watch", &topic_opts, &g_topic, &st)) != ISTHMUS_OK ||
      (rc = isthmus_server_add_topic(server, SVC "Watch", g_topic, &st)) != ISTHMUS_OK) {
    print_status("serve: the topic", rc, st);
    return 1;
  }
  int stop[2];
  if (pipe(stop) != 0) {
    perror("serve: pipe");
    return 1;
  }
  queue_server_t qs = {cq, stop[0], NULL};
  pthread_t queue_thread;
  if (pthread_create(&queue_thread, NULL, queue_main, &qs) != 0) {
    fprintf(stderr, "serve: pthread_create failed\n");
    return 1;
  }
  rc = isthmus_server_start(server, (const char *const *)targets, (size_t)count, &st);
  if (rc != ISTHMUS_OK) {
    print_status("serve: isthmus_server_start", rc, st);
    return 1;
  }
  printf("ready\n");
  /* Every HTTP/2 endpoint as clients reach it (port 0 resolved), then a line of its own. */
  for (size_t i = 0; isthmus_server_http_address(server, i) != NULL; i++)
    printf("address %s\n", isthmus_server_http_address(server, i));
  printf("addresses end\n");
  fflush(stdout);

  char buf[256];
  ssize_t r;
  while ((r = read(STDIN_FILENO, buf, sizeof buf)) != 0) {
    if (r < 0 && errno != EINTR) break;
  }

  int failed = 0;
  rc = isthmus_server_shutdown(server, 1000);
  if (rc != ISTHMUS_OK) {
    fprintf(stderr, "serve: isthmus_server_shutdown: %s\n", isthmus_code_name(rc));
    failed = 1;
  }
  if (write(stop[1], "x", 1) != 1) failed = 1;
  pthread_join(queue_thread, NULL);
  reap_workers(1);
  if (isthmus_server_free(server) != ISTHMUS_OK || isthmus_cq_free(cq) != ISTHMUS_OK) failed = 1;
  if (isthmus_topic_free(g_topic) != ISTHMUS_OK || isthmus_topic_free(g_topic) != ISTHMUS_INVALID_ARGUMENT) failed = 1;
  close(stop[0]);
  close(stop[1]);
  fprintf(stderr, "serve: Sleep calls ended with their call: %d, after 5 s: %d\n",
          atomic_load(&g_sleep_ended_early), atomic_load(&g_sleep_ran_out));
  size_t live = isthmus_live_handles();
  if (live != 0) {
    fprintf(stderr, "serve: %zu handles were never freed\n", live);
    failed = 1;
  }
  return failed;
}

/* ---- the client's checks ---- */

typedef struct {
  const char *target;
  int shm; /* the target is shm:// (zero-copy blocks work) */
  isthmus_channel_t *ch;
} ctx_t;

static char g_why[1024];

static int failf(int line, const char *fmt, ...) {
  int n = snprintf(g_why, sizeof g_why, "line %d: ", line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_why + n, sizeof g_why - (size_t)n, fmt, ap);
  va_end(ap);
  return 0;
}

/* "CODE: message" for a failure report; frees the status. */
static const char *describe(isthmus_code_t rc, isthmus_status_t *st) {
  static char text[512];
  snprintf(text, sizeof text, "%s: %s", isthmus_code_name(rc), st ? isthmus_status_message(st) : "(no status)");
  if (st) isthmus_status_free(st);
  return text;
}

/* In a check: `cond` or fail it. */
#define REQUIRE(cond, ...)                                         \
  do {                                                             \
    if (!(cond)) return failf(__LINE__, "not " #cond ": " __VA_ARGS__); \
  } while (0)

/* In a check with a local `isthmus_status_t *st`: `expr` returns `want` (its status stays in
 * `st` for the check to read and free), or the check fails. */
#define EXPECT(expr, want)                                                                        \
  do {                                                                                            \
    st = NULL;                                                                                    \
    isthmus_code_t rc_ = (expr);                                                                  \
    if (rc_ != (want))                                                                            \
      return failf(__LINE__, "%s gave %s, not %s", #expr, describe(rc_, st), isthmus_code_name(want)); \
  } while (0)

#define MUST(expr) EXPECT(expr, ISTHMUS_OK)

/* `expr` is refused with INVALID_ARGUMENT (its status, if any, freed). */
#define INVALID(expr)                      \
  do {                                     \
    EXPECT(expr, ISTHMUS_INVALID_ARGUMENT); \
    if (st) isthmus_status_free(st);       \
  } while (0)

static isthmus_call_options_t timeout_opts(int64_t timeout_us) {
  isthmus_call_options_t o;
  memset(&o, 0, sizeof o);
  o.timeout_us = timeout_us;
  return o;
}

static int check_abi_version(ctx_t *c) {
  (void)c;
  REQUIRE(isthmus_abi_version() == ISTHMUS_ABI_VERSION, "library %u, header %u", isthmus_abi_version(),
          ISTHMUS_ABI_VERSION);
  return 1;
}

static int check_code_names(ctx_t *c) {
  (void)c;
  static const struct {
    isthmus_code_t code;
    const char *name;
  } t[] = {{ISTHMUS_OK, "OK"}, {ISTHMUS_CANCELLED, "CANCELLED"}, {ISTHMUS_INVALID_ARGUMENT, "INVALID_ARGUMENT"},
           {ISTHMUS_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"}, {ISTHMUS_NOT_FOUND, "NOT_FOUND"},
           {ISTHMUS_RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"}, {ISTHMUS_UNIMPLEMENTED, "UNIMPLEMENTED"},
           {ISTHMUS_UNAVAILABLE, "UNAVAILABLE"}, {ISTHMUS_UNAUTHENTICATED, "UNAUTHENTICATED"},
           {17, "UNKNOWN"}, {-1, "UNKNOWN"}, {INT32_MAX, "UNKNOWN"}, {INT32_MIN, "UNKNOWN"}};
  for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
    const char *name = isthmus_code_name(t[i].code);
    REQUIRE(name != NULL && strcmp(name, t[i].name) == 0, "code %d is %s", t[i].code, name ? name : "NULL");
  }
  return 1;
}

static void on_nothing(void *user_data, isthmus_server_call_t *call) {
  (void)user_data;
  isthmus_server_call_finish(call, ISTHMUS_INTERNAL, "not served", NULL, NULL);
}

static int check_null_arguments(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_channel_t *ch = NULL;
  isthmus_call_t *call = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_metadata_t *md = NULL;
  isthmus_block_t *block = NULL;
  isthmus_event_t ev[2];
  const uint8_t data[4] = {1, 2, 3, 4}, *k = NULL, *v = NULL;
  size_t len = 7, kl = 0, vl = 0;
  const char *path = SVC "Unary";
  const char *no_target[1] = {NULL};
  isthmus_cq_t *cq = isthmus_cq_new();
  isthmus_server_t *server = isthmus_server_new(NULL);
  REQUIRE(cq != NULL && server != NULL, "cq or server");

  /* channels */
  EXPECT(isthmus_channel_new(NULL, NULL, &ch, &st), ISTHMUS_INVALID_ARGUMENT);
  REQUIRE(st != NULL && strstr(isthmus_status_message(st), "target") != NULL, "the status names the target");
  isthmus_status_free(st);
  REQUIRE(ch == NULL, "no channel");
  INVALID(isthmus_channel_new(c->target, NULL, NULL, &st));
  INVALID(isthmus_channel_new(NULL, NULL, &ch, NULL));
  INVALID(isthmus_channel_close(NULL));

  /* unary calls */
  INVALID(isthmus_unary(NULL, path, data, 4, NULL, &msg, NULL, NULL, &st));
  REQUIRE(msg == NULL, "no reply");
  INVALID(isthmus_unary(c->ch, NULL, data, 4, NULL, &msg, NULL, NULL, &st));
  INVALID(isthmus_unary(c->ch, path, NULL, 4, NULL, &msg, NULL, NULL, &st));
  INVALID(isthmus_unary(c->ch, path, data, 4, NULL, NULL, NULL, NULL, &st));
  INVALID(isthmus_unary_async(NULL, path, data, 4, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_unary_async(c->ch, NULL, data, 4, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_unary_async(c->ch, path, NULL, 4, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_unary_async(c->ch, path, data, 4, NULL, NULL, 1, NULL, &st));

  /* calls, no call */
  INVALID(isthmus_call_start(NULL, path, NULL, &call, &st));
  INVALID(isthmus_call_start(c->ch, NULL, NULL, &call, &st));
  INVALID(isthmus_call_start(c->ch, path, NULL, NULL, &st));
  INVALID(isthmus_call_start_async(NULL, path, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_call_start_async(c->ch, NULL, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_call_start_async(c->ch, path, NULL, NULL, 1, NULL, &st));
  INVALID(isthmus_call_send(NULL, data, 4, 0, &st));
  INVALID(isthmus_call_send_async(NULL, data, 4, 0, cq, 1, NULL, &st));
  INVALID(isthmus_call_close_send(NULL));
  INVALID(isthmus_call_close_send_async(NULL, cq, 1, NULL, &st));
  INVALID(isthmus_call_recv(NULL, &msg, &st));
  INVALID(isthmus_call_recv_async(NULL, cq, 1, NULL, &st));
  INVALID(isthmus_call_recv_spin(NULL, cq, 1, NULL, &st));
  INVALID(isthmus_call_headers(NULL, &md, &st));
  INVALID(isthmus_call_headers_async(NULL, cq, 1, NULL, &st));
  REQUIRE(isthmus_call_trailers(NULL) == NULL, "trailers of NULL");
  INVALID(isthmus_call_alloc(NULL, 16, &block, &st));
  INVALID(isthmus_call_send_block(NULL, NULL, 1, &st));
  INVALID(isthmus_call_cancel(NULL));
  INVALID(isthmus_call_free(NULL));

  /* a live call, NULL arguments */
  MUST(isthmus_call_start(c->ch, SVC "Bidi", NULL, &call, &st));
  INVALID(isthmus_call_send(call, NULL, 4, 0, &st));
  INVALID(isthmus_call_send_async(call, data, 4, 0, NULL, 1, NULL, &st));
  INVALID(isthmus_call_close_send_async(call, NULL, 1, NULL, &st));
  INVALID(isthmus_call_recv(call, NULL, &st));
  INVALID(isthmus_call_recv_async(call, NULL, 1, NULL, &st));
  INVALID(isthmus_call_recv_spin(call, NULL, 1, NULL, &st));
  INVALID(isthmus_call_headers(call, NULL, &st));
  INVALID(isthmus_call_headers_async(call, NULL, 1, NULL, &st));
  INVALID(isthmus_call_alloc(call, 16, NULL, &st));
  INVALID(isthmus_call_send_block(call, NULL, 1, &st));
  MUST(isthmus_call_free(call));

  /* completion queues; none of the refused operations queued anything */
  REQUIRE(isthmus_cq_fd(NULL) == -1, "fd of NULL");
  REQUIRE(isthmus_cq_poll(NULL, ev, 2) == 0, "poll of NULL");
  REQUIRE(isthmus_cq_poll(cq, NULL, 2) == 0, "poll into NULL");
  REQUIRE(isthmus_cq_wait(NULL, ev, 2, 0, 0) == 0, "wait on NULL");
  REQUIRE(isthmus_cq_wait(cq, ev, 2, 0, 0) == 0, "an event from a refused operation");
  INVALID(isthmus_cq_free(NULL));

  /* messages and blocks */
  REQUIRE(isthmus_message_data(NULL, &len) == NULL && len == 0, "data of NULL");
  REQUIRE(isthmus_message_data(NULL, NULL) == NULL, "data of NULL, no length");
  REQUIRE(isthmus_message_len(NULL) == 0, "length of NULL");
  INVALID(isthmus_message_free(NULL));
  len = 7;
  REQUIRE(isthmus_block_data(NULL, &len) == NULL && len == 0, "block data of NULL");
  INVALID(isthmus_block_write(NULL, 0, data, 1, &st));
  INVALID(isthmus_block_truncate(NULL, 0, &st));
  INVALID(isthmus_block_free(NULL));

  /* metadata */
  md = isthmus_metadata_new();
  REQUIRE(md != NULL, "metadata_new");
  INVALID(isthmus_metadata_add(NULL, "x-a", data, 1, &st));
  INVALID(isthmus_metadata_add(md, NULL, data, 1, &st));
  INVALID(isthmus_metadata_add(md, "x-a", NULL, 1, &st));
  MUST(isthmus_metadata_add(md, "x-empty", NULL, 0, &st)); /* NULL with length 0 is no bytes */
  REQUIRE(isthmus_metadata_len(NULL) == 0, "length of NULL");
  INVALID(isthmus_metadata_get(NULL, 0, &k, &kl, &v, &vl));
  MUST(isthmus_metadata_get(md, 0, NULL, NULL, NULL, NULL));
  EXPECT(isthmus_metadata_get(md, 1, &k, &kl, &v, &vl), ISTHMUS_OUT_OF_RANGE);
  INVALID(isthmus_metadata_free(NULL));
  MUST(isthmus_metadata_free(md));

  /* statuses */
  REQUIRE(isthmus_status_code(NULL) == ISTHMUS_INVALID_ARGUMENT, "code of NULL");
  REQUIRE(isthmus_status_message(NULL) != NULL && isthmus_status_message(NULL)[0] == 0, "message of NULL");
  size_t details_len = 1;
  REQUIRE(isthmus_status_details(NULL, &details_len) == NULL && details_len == 0, "details of NULL");
  REQUIRE(isthmus_status_trailers(NULL) == NULL, "trailers of NULL");
  INVALID(isthmus_status_free(NULL));

  /* servers (this one is never started) */
  INVALID(isthmus_server_add_handler(NULL, path, on_nothing, NULL, &st));
  INVALID(isthmus_server_add_handler(server, path, NULL, NULL, &st));
  INVALID(isthmus_server_add_handler_cq(NULL, path, cq, 1, &st));
  INVALID(isthmus_server_add_handler_cq(server, path, NULL, 1, &st));
  /* a path no call can name, and one served twice: refused (the second replaced the first) */
  INVALID(isthmus_server_add_handler(server, "no.Service/Method", on_nothing, NULL, &st));
  INVALID(isthmus_server_add_handler_cq(server, "/no.Service/", cq, 1, &st));
  INVALID(isthmus_server_add_handler(server, "/Echo", on_nothing, NULL, &st));
  isthmus_server_t *twice_served = isthmus_server_new(NULL);
  REQUIRE(twice_served != NULL, "a server to register a path twice on");
  MUST(isthmus_server_add_handler(twice_served, "/once.Service/M", on_nothing, NULL, &st));
  EXPECT(isthmus_server_add_handler_cq(twice_served, "/once.Service/M", cq, 1, &st), ISTHMUS_ALREADY_EXISTS);
  REQUIRE(st != NULL && strstr(isthmus_status_message(st), "/once.Service/M") != NULL, "which path is taken");
  isthmus_status_free(st);
  st = NULL;
  MUST(isthmus_server_add_handler(twice_served, NULL, on_nothing, NULL, &st));
  EXPECT(isthmus_server_add_handler(twice_served, "", on_nothing, NULL, &st), ISTHMUS_ALREADY_EXISTS);
  isthmus_status_free(st);
  st = NULL;
  MUST(isthmus_server_free(twice_served));
  INVALID(isthmus_server_start(NULL, (const char *const *)&c->target, 1, &st));
  INVALID(isthmus_server_start(server, NULL, 1, &st));
  INVALID(isthmus_server_start(server, (const char *const *)&c->target, 0, &st));
  /* a count no array holds: refused before any entry is read (it aborted reserving room) */
  INVALID(isthmus_server_start(server, (const char *const *)&c->target, (size_t)1 << 60, &st));
  INVALID(isthmus_server_start(server, no_target, 1, &st));
  INVALID(isthmus_server_shutdown(NULL, 0));
  INVALID(isthmus_server_free(NULL));
  isthmus_server_options_t both_ways = {0};
  both_ways.flags = ISTHMUS_SERVER_COMPRESS_GZIP | ISTHMUS_SERVER_COMPRESS_DEFLATE;
  isthmus_server_t *twice = isthmus_server_new(&both_ways);
  REQUIRE(twice != NULL, "a server with two compressions");
  INVALID(isthmus_server_start(twice, (const char *const *)&c->target, 1, &st));
  MUST(isthmus_server_free(twice));
  isthmus_server_options_t unknown_flag = {0};
  unknown_flag.flags = 1u << 30; /* a newer header's flag: refused, not dropped */
  isthmus_server_t *newer = isthmus_server_new(&unknown_flag);
  REQUIRE(newer != NULL, "a server with an unknown flag");
  INVALID(isthmus_server_start(newer, (const char *const *)&c->target, 1, &st));
  MUST(isthmus_server_free(newer));
  /* shut down before it started: it never starts (it served, as if never shut down) */
  isthmus_server_t *stopped = isthmus_server_new(NULL);
  REQUIRE(stopped != NULL, "a server to shut down before its start");
  MUST(isthmus_server_shutdown(stopped, 0));
  EXPECT(isthmus_server_start(stopped, (const char *const *)&c->target, 1, &st), ISTHMUS_FAILED_PRECONDITION);
  REQUIRE(st != NULL && strstr(isthmus_status_message(st), "shut down") != NULL, "why the start failed");
  isthmus_status_free(st);
  MUST(isthmus_server_free(stopped));

  /* the server's side of a call */
  len = 7;
  REQUIRE(isthmus_server_call_path(NULL, &len) == NULL && len == 0, "path of NULL");
  REQUIRE(isthmus_server_call_metadata(NULL) == NULL, "metadata of NULL");
  REQUIRE(isthmus_server_call_time_remaining_us(NULL) == -1, "time remaining of NULL");
  {
    isthmus_metadata_t *md = NULL;
    int64_t left = 0;
    isthmus_event_t ev;
    REQUIRE(isthmus_server_call_begin(NULL, &md, &left, &ev) == -1 && md == NULL, "begin of NULL");
  }
  REQUIRE(isthmus_server_call_is_active(NULL) == 0, "NULL is active");
  REQUIRE(isthmus_server_call_half_closed(NULL) == 0, "NULL half-closed");
  REQUIRE(isthmus_server_call_headers_sent(NULL) == 0, "NULL sent headers");
  INVALID(isthmus_server_call_recv(NULL, 0, &msg, &st));
  INVALID(isthmus_server_call_recv_async(NULL, 0, cq, 1, NULL, &st));
  INVALID(isthmus_server_call_recv_async(NULL, ISTHMUS_RECV_SPIN, cq, 1, NULL, &st));
  INVALID(isthmus_server_call_send(NULL, data, 4, &st));
  INVALID(isthmus_server_call_send_async(NULL, data, 4, cq, 1, NULL, &st));
  INVALID(isthmus_server_call_send_headers(NULL, NULL, &st));
  INVALID(isthmus_server_call_send_headers_async(NULL, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_server_call_set_compression(NULL, "gzip", &st));
  INVALID(isthmus_server_call_alloc(NULL, 16, &block, &st));
  INVALID(isthmus_server_call_send_block(NULL, NULL, &st));
  INVALID(isthmus_server_call_reply_async(NULL, data, 4, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_server_call_finish(NULL, ISTHMUS_OK, NULL, NULL, &st));
  INVALID(isthmus_server_call_finish_with_details(NULL, ISTHMUS_ABORTED, NULL, FAIL_DETAILS, 1, NULL, &st));
  INVALID(isthmus_server_call_done_async(NULL, cq, 1, &st));
  len = 7;
  REQUIRE(isthmus_server_call_peer(NULL, &len) == NULL && len == 0, "peer of NULL");
  len = 7;
  REQUIRE(isthmus_server_call_peer_cert(NULL, &len) == NULL && len == 0, "peer certificate of NULL");
  REQUIRE(isthmus_server_call_is_tls(NULL) == 0, "NULL came over TLS");
  REQUIRE(isthmus_server_http_address(NULL, 0) == NULL, "HTTP address of NULL");
  REQUIRE(isthmus_server_http_address(server, 0) == NULL, "HTTP address of a server never started");

  /* the rest of the surface: nginx's bell, the spin, blocks sent async, topics, protos */
  char bell[256];
  INVALID(isthmus_channel_set_spin(NULL, 10));
  INVALID(isthmus_cq_cancel(NULL, 1));
  INVALID(isthmus_cq_wake(NULL));
  INVALID(isthmus_cq_bell_listen(NULL, bell, sizeof bell, &st));
  INVALID(isthmus_cq_bell_listen(cq, NULL, sizeof bell, &st));
  INVALID(isthmus_cq_bell_accept(NULL, &st));
  INVALID(isthmus_unary_block_async(NULL, path, NULL, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_unary_block_async(c->ch, path, NULL, NULL, cq, 1, NULL, &st));
  INVALID(isthmus_topic_clear_state(NULL));
  INVALID(isthmus_topic_close(NULL));
  INVALID(isthmus_topic_stats(NULL, NULL, 0));
  INVALID(isthmus_topic_free(NULL));
  isthmus_proto_t *proto = NULL;
  const char *no_file[1] = {NULL};
  INVALID(isthmus_proto_load(NULL, 1, NULL, 0, &proto, &st));
  INVALID(isthmus_proto_load(no_file, 1, NULL, 0, &proto, &st));
  INVALID(isthmus_proto_load_descriptor_set(NULL, 4, &proto, &st));
  INVALID(isthmus_proto_load_descriptor_set(data, 4, NULL, &st));
  REQUIRE(proto == NULL, "no proto");
  REQUIRE(isthmus_proto_method_type(NULL, path, ISTHMUS_PROTO_REQUEST) == NULL, "method type of NULL");
  REQUIRE(isthmus_proto_method_streams(NULL, path) == -1, "method streams of NULL");
  INVALID(isthmus_proto_encode(NULL, "x.Y", data, 2, &msg, &st));
  INVALID(isthmus_proto_decode(NULL, "x.Y", data, 4, &msg, &st));
  REQUIRE(msg == NULL, "no message");
  INVALID(isthmus_proto_free(NULL));

  REQUIRE(isthmus_cq_poll(cq, ev, 2) == 0, "an event from a refused operation");
  MUST(isthmus_server_free(server));
  MUST(isthmus_cq_free(cq));
  return 1;
}

static int check_double_free(ctx_t *c) {
  isthmus_status_t *st = NULL, *failure = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_channel_t *ch = NULL;
  isthmus_call_t *call = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);

  MUST(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)"x", 1, &opts, &msg, NULL, NULL, &st));
  MUST(isthmus_message_free(msg));
  INVALID(isthmus_message_free(msg));
  REQUIRE(isthmus_message_len(msg) == 0 && isthmus_message_data(msg, NULL) == NULL, "a freed message reads");

  EXPECT(isthmus_channel_new("bogus://x", NULL, &ch, &failure), ISTHMUS_INVALID_ARGUMENT);
  REQUIRE(failure != NULL, "a status");
  MUST(isthmus_status_free(failure));
  INVALID(isthmus_status_free(failure));
  REQUIRE(isthmus_status_code(failure) == ISTHMUS_INVALID_ARGUMENT, "a freed status reads");

  isthmus_metadata_t *md = isthmus_metadata_new();
  MUST(isthmus_metadata_free(md));
  INVALID(isthmus_metadata_free(md));
  INVALID(isthmus_metadata_add(md, "x-a", (const uint8_t *)"b", 1, &st));

  /* freed twice with another made in between, which the allocator would have given the same
   * address: the second free is refused and the new handle is left alone */
  isthmus_metadata_t *first = isthmus_metadata_new();
  MUST(isthmus_metadata_free(first));
  isthmus_metadata_t *second = isthmus_metadata_new();
  REQUIRE(second != first, "a freed handle's value handed out again at once");
  INVALID(isthmus_metadata_free(first));
  MUST(isthmus_metadata_add(second, "x-a", (const uint8_t *)"b", 1, &st));
  MUST(isthmus_metadata_free(second));

  MUST(isthmus_call_start(c->ch, SVC "Bidi", &opts, &call, &st));
  MUST(isthmus_call_free(call));
  INVALID(isthmus_call_free(call));
  INVALID(isthmus_call_cancel(call));

  MUST(isthmus_channel_new(c->target, NULL, &ch, &st));
  MUST(isthmus_channel_close(ch));
  INVALID(isthmus_channel_close(ch));
  INVALID(isthmus_unary(ch, SVC "Unary", (const uint8_t *)"x", 1, NULL, &msg, NULL, NULL, &st));

  isthmus_cq_t *cq = isthmus_cq_new();
  MUST(isthmus_cq_free(cq));
  INVALID(isthmus_cq_free(cq));
  REQUIRE(isthmus_cq_fd(cq) == -1, "a freed queue has a descriptor");

  isthmus_server_t *server = isthmus_server_new(NULL);
  MUST(isthmus_server_free(server));
  INVALID(isthmus_server_free(server));

  /* a handle of another type is no handle of this one, and is left alone */
  md = isthmus_metadata_new();
  INVALID(isthmus_message_free((isthmus_message_t *)md));
  INVALID(isthmus_status_free((isthmus_status_t *)md));
  INVALID(isthmus_call_free((isthmus_call_t *)md));
  MUST(isthmus_metadata_free(md));
  return 1;
}

static int check_metadata_rules(ctx_t *c) {
  (void)c;
  isthmus_status_t *st = NULL;
  isthmus_metadata_t *md = isthmus_metadata_new();
  static const char *bad_keys[] = {"grpc-x", "X-Upper", "content-type", "", "sp ace"};
  for (size_t i = 0; i < sizeof bad_keys / sizeof bad_keys[0]; i++) {
    EXPECT(isthmus_metadata_add(md, bad_keys[i], (const uint8_t *)"v", 1, &st), ISTHMUS_INVALID_ARGUMENT);
    REQUIRE(st != NULL && isthmus_status_code(st) == ISTHMUS_INVALID_ARGUMENT, "a status");
    REQUIRE(strstr(isthmus_status_message(st), bad_keys[i]) != NULL, "'%s' named in '%s'", bad_keys[i],
            isthmus_status_message(st));
    isthmus_status_free(st);
  }
  INVALID(isthmus_metadata_add(md, "x-text", (const uint8_t *)"a\nb", 3, &st));
  MUST(isthmus_metadata_add(md, "x-text", (const uint8_t *)"plain", 5, &st));
  MUST(isthmus_metadata_add(md, "x-data-bin", (const uint8_t *)"\0\377\n", 3, &st));
  REQUIRE(isthmus_metadata_len(md) == 2, "%zu entries", isthmus_metadata_len(md));
  size_t len = 0;
  const uint8_t *v = md_find(md, "x-data-bin", &len);
  REQUIRE(v != NULL && len == 3 && memcmp(v, "\0\377\n", 3) == 0, "the binary value");
  MUST(isthmus_metadata_free(md));
  return 1;
}

static int check_unary_metadata(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_metadata_t *headers = NULL, *trailers = NULL, *md = isthmus_metadata_new();
  MUST(isthmus_metadata_add(md, "x-echo", (const uint8_t *)"hello-capi", 10, &st));
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  opts.metadata = md;
  const char *req = "ping-1234";

  MUST(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)req, strlen(req), &opts, &reply, &headers, &trailers, &st));
  REQUIRE(bytes_are(reply, req, strlen(req)), "the echo");
  REQUIRE(md_is(headers, "x-echo", "hello-capi"), "x-echo in the headers");
  REQUIRE(md_is(trailers, "x-echo", "hello-capi"), "x-echo in the trailers");
  REQUIRE(md_is(trailers, "x-has-deadline", "1"), "the server saw the deadline");
  isthmus_message_free(reply);
  isthmus_metadata_free(headers);
  isthmus_metadata_free(trailers);

  /* compressed requests (over HTTP/2; shm:// sends them as they are) reach the server; the
   * two compressions at once are refused */
  for (uint32_t flag = ISTHMUS_CALL_COMPRESS_GZIP; flag <= ISTHMUS_CALL_COMPRESS_DEFLATE; flag <<= 1) {
    isthmus_call_options_t compressed = opts;
    compressed.flags = flag;
    MUST(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)req, strlen(req), &compressed, &reply, NULL, NULL, &st));
    REQUIRE(bytes_are(reply, req, strlen(req)), "the echo of a compressed request");
    isthmus_message_free(reply);
  }
  isthmus_call_options_t both = opts;
  both.flags = ISTHMUS_CALL_COMPRESS_GZIP | ISTHMUS_CALL_COMPRESS_DEFLATE;
  INVALID(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)req, strlen(req), &both, &reply, NULL, NULL, &st));
  isthmus_call_options_t newer = opts;
  newer.flags = 1u << 30; /* a newer header's flag: refused, not dropped */
  INVALID(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)req, strlen(req), &newer, &reply, NULL, NULL, &st));

  /* the same as a call of any shape, without a deadline: headers, then trailers at the end */
  isthmus_call_t *call = NULL;
  opts.timeout_us = 0;
  MUST(isthmus_call_start(c->ch, SVC "Unary", &opts, &call, &st));
  MUST(isthmus_metadata_free(md)); /* the call copied it */
  REQUIRE(isthmus_call_trailers(call) == NULL, "trailers while the call runs");
  /* the handler now waits in recv before the request comes: its send_headers after recv
   * must still carry x-echo (recv sends no headers of its own) */
  sleep_ms(50);
  MUST(isthmus_call_send(call, (const uint8_t *)req, strlen(req), 1, &st));
  MUST(isthmus_call_headers(call, &headers, &st));
  REQUIRE(md_is(headers, "x-echo", "hello-capi"), "x-echo in the headers");
  MUST(isthmus_call_recv(call, &reply, &st));
  REQUIRE(bytes_are(reply, req, strlen(req)), "the echo");
  isthmus_message_free(reply);
  MUST(isthmus_call_recv(call, &reply, &st));
  REQUIRE(reply == NULL, "the end");
  trailers = isthmus_call_trailers(call);
  REQUIRE(md_is(trailers, "x-echo", "hello-capi"), "x-echo in the trailers");
  REQUIRE(md_is(trailers, "x-has-deadline", "0"), "no deadline");
  isthmus_metadata_free(headers);
  isthmus_metadata_free(trailers);
  MUST(isthmus_call_free(call));
  return 1;
}

static int check_unary_64mib(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  size_t n = 64 * MIB;
  uint8_t *req = malloc(n);
  REQUIRE(req != NULL, "64 MiB");
  fill_pattern(req, n, 64);
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  MUST(isthmus_unary(c->ch, SVC "Unary", req, n, &opts, &reply, NULL, NULL, &st));
  int same = bytes_are(reply, req, n);
  free(req);
  isthmus_message_free(reply);
  REQUIRE(same, "the 64 MiB echo differs");
  return 1;
}

static int check_too_large(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  size_t n = 65 * MIB;
  uint8_t *req = malloc(n);
  REQUIRE(req != NULL, "65 MiB");
  fill_pattern(req, n, 65);
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  st = NULL;
  isthmus_code_t rc = isthmus_unary(c->ch, SVC "Unary", req, n, &opts, &reply, NULL, NULL, &st);
  free(req);
  REQUIRE(rc == ISTHMUS_RESOURCE_EXHAUSTED, "65 MiB gave %s", describe(rc, st));
  REQUIRE(reply == NULL && st != NULL, "no reply, a status");
  isthmus_status_free(st);

  /* the channel goes on */
  MUST(isthmus_unary(c->ch, SVC "Unary", (const uint8_t *)"after", 5, &opts, &reply, NULL, NULL, &st));
  REQUIRE(bytes_are(reply, "after", 5), "the echo after");
  isthmus_message_free(reply);
  return 1;
}

static int check_server_stream(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_t *call = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  uint8_t req[4];
  put_u32(req, 1000);
  MUST(isthmus_call_start(c->ch, SVC "ServerStream", &opts, &call, &st));
  MUST(isthmus_call_send(call, req, sizeof req, 1, &st));
  for (uint32_t i = 0; i < 1000; i++) {
    MUST(isthmus_call_recv(call, &msg, &st));
    REQUIRE(msg != NULL, "message %u: the stream ended", i);
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(msg, &len);
    uint32_t got = len == 4 ? get_u32(data) : UINT32_MAX;
    isthmus_message_free(msg);
    REQUIRE(got == i, "message %u: got %u (length %zu)", i, got, len);
  }
  MUST(isthmus_call_recv(call, &msg, &st));
  REQUIRE(msg == NULL, "an OK end after 1000");
  isthmus_metadata_t *trailers = isthmus_call_trailers(call);
  REQUIRE(md_is(trailers, "x-count", "1000"), "x-count in the trailers");
  isthmus_metadata_free(trailers);
  MUST(isthmus_call_free(call));
  return 1;
}

/* Publishes `text` through the server's Publish (or PublishState) handler; how many
 * subscribers it reached, or -1 (g_why says why). */
static long publish(ctx_t *c, const char *path, const char *text) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_code_t rc = isthmus_unary(c->ch, path, (const uint8_t *)text, strlen(text), &opts, &reply, NULL, NULL, &st);
  if (rc != ISTHMUS_OK) return failf(__LINE__, "%s: %s", path, describe(rc, st)) - 1;
  size_t len = 0;
  const uint8_t *data = isthmus_message_data(reply, &len);
  long reached = -1;
  char buf[64];
  snprintf(buf, sizeof buf, "%.*s", (int)len, (const char *)data);
  isthmus_message_free(reply);
  if (sscanf(buf, "reached=%ld", &reached) != 1) return failf(__LINE__, "'%s'", buf) - 1;
  return reached;
}

/* The next message of a subscription, as a string ("" at its end); 0 on failure. */
static int next_published(isthmus_call_t *call, char *out, size_t cap) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_code_t rc = isthmus_call_recv(call, &msg, &st);
  if (rc != ISTHMUS_OK) return failf(__LINE__, "recv: %s", describe(rc, st));
  out[0] = 0;
  if (msg != NULL) {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(msg, &len);
    snprintf(out, cap, "%.*s", (int)len, (const char *)data);
    isthmus_message_free(msg);
  }
  return 1;
}

/* A topic served by a C server: a subscriber gets the state first, then what is published while
 * it is subscribed, in order; a second subscriber is reached too; the topic's handles follow the
 * ABI's rules. */
static int check_topic(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  char got[256];
  REQUIRE(publish(c, SVC "PublishState", "state-1") >= 0, "PublishState: %s", g_why);
  isthmus_call_t *subs[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    MUST(isthmus_call_start(c->ch, SVC "Watch", &opts, &subs[i], &st));
    MUST(isthmus_call_send(subs[i], (const uint8_t *)"", 0, 1, &st));
    /* The state comes first, once the server has the subscription. */
    if (!next_published(subs[i], got, sizeof got)) return 0;
    REQUIRE(strcmp(got, "state-1") == 0, "subscriber %d's first message: '%s'", i, got);
  }
  long reached = publish(c, SVC "Publish", "one");
  REQUIRE(reached == 2, "'one' reached %ld subscribers, not 2 (%s)", reached, g_why);
  REQUIRE(publish(c, SVC "Publish", "two") == 2, "'two'");
  for (int i = 0; i < 2; i++) {
    for (const char *want = "one"; want != NULL; want = strcmp(want, "one") == 0 ? "two" : NULL) {
      if (!next_published(subs[i], got, sizeof got)) return 0;
      REQUIRE(strcmp(got, want) == 0, "subscriber %d: '%s', not '%s'", i, got, want);
    }
  }
  /* A subscriber that leaves is gone from the topic at once. */
  MUST(isthmus_call_cancel(subs[0]));
  MUST(isthmus_call_free(subs[0]));
  double end = now_s() + 30;
  while ((reached = publish(c, SVC "Publish", "three")) == 2 && now_s() < end) sleep_ms(5);
  REQUIRE(reached == 1, "after one subscriber left, 'three' reached %ld", reached);
  /* The other gets it (as it got each 'three' published before the first had left). */
  if (!next_published(subs[1], got, sizeof got)) return 0;
  REQUIRE(strcmp(got, "three") == 0, "the remaining subscriber: '%s'", got);
  MUST(isthmus_call_cancel(subs[1]));
  MUST(isthmus_call_free(subs[1]));

  /* Handles: a topic of the client's own, refused arguments, a double free. */
  isthmus_topic_t *t = NULL;
  isthmus_topic_options_t bad = {0, 8};
  INVALID(isthmus_topic_new("x", &bad, &t, &st));
  REQUIRE(t == NULL, "no topic for unknown flags");
  INVALID(isthmus_topic_new(NULL, NULL, &t, &st));
  isthmus_topic_options_t resync = {2, ISTHMUS_TOPIC_RESYNC_STATE | ISTHMUS_TOPIC_CANCEL_SLOW};
  MUST(isthmus_topic_new("resync", &resync, &t, &st));
  MUST(isthmus_topic_free(t));
  MUST(isthmus_topic_new("mine", NULL, &t, &st));
  size_t n = 99;
  MUST(isthmus_topic_publish(t, (const uint8_t *)"x", 1, &n, &st));
  REQUIRE(n == 0, "no subscriber, reached %zu", n);
  INVALID(isthmus_topic_publish(t, NULL, 5, &n, &st));
  INVALID(isthmus_topic_publish(NULL, (const uint8_t *)"x", 1, &n, &st));
  isthmus_topic_stats_t ts;
  memset(&ts, 0xff, sizeof ts);
  MUST(isthmus_topic_stats(t, &ts, sizeof ts));
  REQUIRE(ts.published == 1 && ts.subscribers == 0 && ts.bytes == 1, "stats: %llu published, %llu subscribers",
          (unsigned long long)ts.published, (unsigned long long)ts.subscribers);
  MUST(isthmus_topic_clear_state(t));
  MUST(isthmus_topic_close(t));
  MUST(isthmus_topic_publish(t, (const uint8_t *)"x", 1, &n, &st));
  REQUIRE(n == 0, "a closed topic publishes nothing");
  isthmus_server_t *srv = isthmus_server_new(NULL);
  INVALID(isthmus_server_add_topic(srv, "", t, &st));
  INVALID(isthmus_server_add_topic(srv, SVC "T", NULL, &st));
  MUST(isthmus_server_add_topic(srv, SVC "T", t, &st));
  isthmus_server_free(srv);
  MUST(isthmus_topic_free(t));
  INVALID(isthmus_topic_free(t));
  INVALID(isthmus_topic_close(t));
  return 1;
}

static int check_client_stream(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_t *call = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  static uint8_t buf[50 * 97 + 1];
  uint64_t total = 0;
  MUST(isthmus_call_start(c->ch, SVC "ClientStream", &opts, &call, &st));
  for (size_t i = 0; i < 50; i++) {
    size_t len = i * 97 + 1;
    MUST(isthmus_call_send(call, buf, len, 0, &st));
    total += len;
  }
  MUST(isthmus_call_close_send(call));
  MUST(isthmus_call_recv(call, &msg, &st));
  REQUIRE(msg != NULL && isthmus_message_len(msg) == 8, "an 8-byte reply");
  uint64_t got = get_u64(isthmus_message_data(msg, NULL));
  isthmus_message_free(msg);
  REQUIRE(got == total, "sum %" PRIu64 ", sent %" PRIu64, got, total);
  MUST(isthmus_call_recv(call, &msg, &st));
  REQUIRE(msg == NULL, "an OK end");
  MUST(isthmus_call_free(call));
  return 1;
}

#define BIDI_COUNT 500
#define BIDI_SIZE 1024

typedef struct {
  isthmus_call_t *call;
  isthmus_code_t rc;
  char why[256];
} sender_t;

static void *bidi_sender(void *arg) {
  sender_t *s = arg;
  uint8_t msg[BIDI_SIZE];
  for (uint32_t i = 0; i < BIDI_COUNT; i++) {
    fill_pattern(msg, sizeof msg, i);
    put_u32(msg, i);
    isthmus_status_t *st = NULL;
    s->rc = isthmus_call_send(s->call, msg, sizeof msg, 0, &st);
    if (s->rc != ISTHMUS_OK) {
      snprintf(s->why, sizeof s->why, "send %u: %s", i, describe(s->rc, st));
      return NULL;
    }
  }
  s->rc = isthmus_call_close_send(s->call);
  return NULL;
}

static int check_bidi_threads(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  sender_t s;
  memset(&s, 0, sizeof s);
  MUST(isthmus_call_start(c->ch, SVC "Bidi", &opts, &s.call, &st));
  pthread_t sender;
  REQUIRE(pthread_create(&sender, NULL, bidi_sender, &s) == 0, "a thread");
  uint8_t want[BIDI_SIZE];
  uint32_t i = 0;
  isthmus_code_t rc = ISTHMUS_OK;
  for (; i < BIDI_COUNT; i++) {
    isthmus_message_t *msg = NULL;
    st = NULL;
    rc = isthmus_call_recv(s.call, &msg, &st);
    if (rc != ISTHMUS_OK || msg == NULL) break;
    fill_pattern(want, sizeof want, i);
    put_u32(want, i);
    int same = bytes_are(msg, want, sizeof want);
    isthmus_message_free(msg);
    if (!same) break;
  }
  pthread_join(sender, NULL);
  REQUIRE(s.rc == ISTHMUS_OK, "the sender: %s", s.why);
  REQUIRE(i == BIDI_COUNT, "echo %u of %d: %s", i, BIDI_COUNT, rc == ISTHMUS_OK ? "wrong or missing" : describe(rc, st));
  isthmus_message_t *end = NULL;
  MUST(isthmus_call_recv(s.call, &end, &st));
  REQUIRE(end == NULL, "an OK end");
  MUST(isthmus_call_free(s.call));
  return 1;
}

typedef struct {
  isthmus_call_t *call;
  isthmus_code_t rc;
  int got_end;
} receiver_t;

/* One blocking receive of `r->call`. */
static void *receiver(void *arg) {
  receiver_t *r = arg;
  isthmus_message_t *msg = NULL;
  isthmus_status_t *st = NULL;
  r->rc = isthmus_call_recv(r->call, &msg, &st);
  r->got_end = msg == NULL;
  if (msg) isthmus_message_free(msg);
  if (st) isthmus_status_free(st);
  return NULL;
}

/* The server's initial metadata are given while another thread waits in a receive for a message
 * that has not come (Bidi sends them first, then reads). Before, the headers waited for the
 * receive to return: a client waiting for them before it sends waited for its deadline. */
static int check_headers_beside_a_receive(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  receiver_t r;
  memset(&r, 0, sizeof r);
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  MUST(isthmus_call_start(c->ch, SVC "Bidi", &opts, &r.call, &st));
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, receiver, &r) == 0, "a thread");
  sleep_ms(100); /* in its receive by now, most likely; if not, the check passes anyway */
  isthmus_event_t ev;
  int ok = 1;
  isthmus_code_t rc = isthmus_call_headers_async(r.call, cq, 1, &ev, &st);
  if (rc != ISTHMUS_OK) ok = failf(__LINE__, "headers_async: %s", describe(rc, st));
  size_t n = ok && ev.op != 0;
  for (double end = now_s() + 20; ok && n == 0 && now_s() < end;) n = isthmus_cq_wait(cq, &ev, 1, 0, 100000);
  if (ok && (n != 1 || ev.op != ISTHMUS_OP_HEADERS || ev.code != ISTHMUS_OK))
    ok = failf(__LINE__, "no headers in 20 s while a receive waited (%zu events)", n);
  if (n == 1) event_free(&ev);
  isthmus_call_close_send(r.call);
  pthread_join(t, NULL);
  if (ok && (r.rc != ISTHMUS_OK || !r.got_end))
    ok = failf(__LINE__, "the receive ended %s, %s", isthmus_code_name(r.rc), r.got_end ? "at the end" : "with a message");
  if (ok && isthmus_cq_cancel(cq, 1) == ISTHMUS_OK) ok = failf(__LINE__, "the headers were still pending");
  isthmus_call_free(r.call);
  isthmus_cq_free(cq);
  return ok;
}

static int check_fail(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  EXPECT(isthmus_unary(c->ch, SVC "Fail", (const uint8_t *)"x", 1, &opts, &reply, NULL, NULL, &st), ISTHMUS_NOT_FOUND);
  REQUIRE(reply == NULL && st != NULL, "no reply, a status");
  REQUIRE(isthmus_status_code(st) == ISTHMUS_NOT_FOUND, "the status's code");
  REQUIRE(strcmp(isthmus_status_message(st), "nothing here") == 0, "message '%s'", isthmus_status_message(st));
  isthmus_metadata_t *trailers = isthmus_status_trailers(st);
  REQUIRE(md_is(trailers, "x-why", "test"), "x-why in the status's trailers");
  isthmus_metadata_free(trailers);
  REQUIRE(has_fail_details(st), "the status's details");
  isthmus_status_free(st);

  /* the initial metadata a server sent before it failed the call are the caller's; none else */
  isthmus_metadata_t *head = NULL;
  EXPECT(isthmus_unary(c->ch, SVC "HeadFail", (const uint8_t *)"x", 1, &opts, &reply, &head, NULL, &st),
         ISTHMUS_NOT_FOUND);
  REQUIRE(reply == NULL && md_is(head, "x-head", "early"), "the initial metadata before the failure");
  trailers = isthmus_status_trailers(st);
  REQUIRE(md_is(trailers, "x-why", "test"), "x-why in the status's trailers, apart");
  isthmus_metadata_free(trailers);
  isthmus_metadata_free(head);
  isthmus_status_free(st);
  EXPECT(isthmus_unary(c->ch, SVC "Fail", (const uint8_t *)"x", 1, &opts, &reply, &head, NULL, &st), ISTHMUS_NOT_FOUND);
  /* (over HTTP/2 the server's `date` header may come all the same) */
  size_t len = 0;
  REQUIRE(md_find(head, "x-head", &len) == NULL, "no handler's initial metadata where it sent none");
  if (head != NULL) isthmus_metadata_free(head);
  isthmus_status_free(st);

  /* as a call of any shape: recv gives the status, and the call its trailers */
  isthmus_call_t *call = NULL;
  MUST(isthmus_call_start(c->ch, SVC "Fail", &opts, &call, &st));
  EXPECT(isthmus_call_recv(call, &reply, &st), ISTHMUS_NOT_FOUND);
  REQUIRE(reply == NULL && st != NULL && strcmp(isthmus_status_message(st), "nothing here") == 0, "the status");
  REQUIRE(has_fail_details(st), "the call's status's details");
  isthmus_status_free(st);
  trailers = isthmus_call_trailers(call);
  REQUIRE(md_is(trailers, "x-why", "test"), "x-why in the call's trailers");
  isthmus_metadata_free(trailers);
  MUST(isthmus_call_free(call));
  return 1;
}

/* The channel's counters count its shm:// calls by their code (and no HTTP/2 call); the
 * server's, read by its Stats handler, its connections and calls; an older caller's smaller
 * struct gets only the fields it knows. */
static int check_stats(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_stats_t before, after;
  memset(&before, 0xff, sizeof before);
  MUST(isthmus_channel_stats(c->ch, &before, sizeof before));
  uint8_t payload[100];
  fill_pattern(payload, sizeof payload, 7);
  for (int i = 0; i < 3; i++) {
    MUST(isthmus_unary(c->ch, SVC "Unary", payload, sizeof payload, &opts, &reply, NULL, NULL, &st));
    isthmus_message_free(reply);
  }
  EXPECT(isthmus_unary(c->ch, SVC "Fail", (const uint8_t *)"x", 1, &opts, &reply, NULL, NULL, &st), ISTHMUS_NOT_FOUND);
  isthmus_status_free(st);
  MUST(isthmus_channel_stats(c->ch, &after, sizeof after));
  if (c->shm) {
    REQUIRE(after.calls_started - before.calls_started == 4, "%llu calls started, not 4",
            (unsigned long long)(after.calls_started - before.calls_started));
    REQUIRE(after.calls_finished[ISTHMUS_OK] - before.calls_finished[ISTHMUS_OK] == 3, "3 OK");
    REQUIRE(after.calls_finished[ISTHMUS_NOT_FOUND] - before.calls_finished[ISTHMUS_NOT_FOUND] == 1, "1 NOT_FOUND");
    REQUIRE(after.bytes_sent - before.bytes_sent >= 3 * sizeof payload + 1, "the requests' bytes");
    REQUIRE(after.bytes_received - before.bytes_received >= 3 * sizeof payload, "the replies' bytes");
    REQUIRE(after.frames_sent > before.frames_sent && after.frames_received > before.frames_received, "frames");
    REQUIRE(after.connections == 0 && after.accept_errors == 0, "a channel's server-only fields are 0");
  } else {
    REQUIRE(after.calls_started == 0 && after.bytes_sent == 0, "HTTP/2 calls counted: %llu",
            (unsigned long long)after.calls_started);
  }

  /* A caller built against a header whose struct had two fields. */
  uint64_t old[3] = {UINT64_MAX, UINT64_MAX, UINT64_MAX};
  MUST(isthmus_channel_stats(c->ch, (isthmus_stats_t *)(void *)old, 2 * sizeof(uint64_t)));
  REQUIRE(old[0] == after.calls_started && old[1] == after.calls_in_flight && old[2] == UINT64_MAX,
          "the old struct: %llu %llu %llu", (unsigned long long)old[0], (unsigned long long)old[1],
          (unsigned long long)old[2]);
  INVALID(isthmus_channel_stats(c->ch, NULL, sizeof after));
  INVALID(isthmus_channel_stats(NULL, &after, sizeof after));
  INVALID(isthmus_server_stats(NULL, &after, sizeof after));

  /* A server not started has counted nothing. */
  isthmus_server_t *fresh = isthmus_server_new(NULL);
  REQUIRE(fresh != NULL, "isthmus_server_new");
  memset(&after, 0xff, sizeof after);
  isthmus_code_t rc = isthmus_server_stats(fresh, &after, sizeof after);
  isthmus_server_free(fresh);
  REQUIRE(rc == ISTHMUS_OK && after.calls_started == 0 && after.connections == 0 && after.arena_high_water == 0,
          "an unstarted server's stats: %s", isthmus_code_name(rc));

  /* The server's side. */
  MUST(isthmus_unary(c->ch, SVC "Stats", (const uint8_t *)"", 0, &opts, &reply, NULL, NULL, &st));
  size_t len = 0;
  const uint8_t *data = isthmus_message_data(reply, &len);
  char text[512];
  snprintf(text, sizeof text, "%.*s", (int)len, (const char *)data);
  isthmus_message_free(reply);
  unsigned long long connections, started, in_flight, ok, not_found, received, accept_errors, handshakes_failed;
  REQUIRE(sscanf(text,
                 "connections=%llu started=%llu in_flight=%llu ok=%llu not_found=%llu received=%llu "
                 "accept_errors=%llu handshakes_failed=%llu",
                 &connections, &started, &in_flight, &ok, &not_found, &received, &accept_errors,
                 &handshakes_failed) == 8,
          "'%s'", text);
  REQUIRE(accept_errors == 0 && handshakes_failed == 0, "'%s': no failed accept or handshake", text);
  if (c->shm) {
    /* This call is one in flight; the channel's connection (or two) are the server's. */
    REQUIRE(connections >= 1 && in_flight >= 1 && started >= 5 && ok >= 3 && not_found >= 1 &&
                received >= 3 * sizeof payload,
            "'%s'", text);
  }
  return 1;
}

static int check_deadline(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(200000);
  EXPECT(isthmus_unary(c->ch, SVC "Sleep", (const uint8_t *)"z", 1, &opts, &reply, NULL, NULL, &st),
         ISTHMUS_DEADLINE_EXCEEDED);
  REQUIRE(reply == NULL, "no reply");
  if (st) isthmus_status_free(st);
  return 1;
}

typedef struct {
  isthmus_call_t *call;
  isthmus_code_t rc;
} canceller_t;

static void *cancel_later(void *arg) {
  canceller_t *k = arg;
  sleep_ms(200); /* most likely while recv waits; CANCELLED either way */
  k->rc = isthmus_call_cancel(k->call);
  return NULL;
}

static int check_cancel(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  canceller_t k = {NULL, ISTHMUS_UNKNOWN};
  MUST(isthmus_call_start(c->ch, SVC "Sleep", &opts, &k.call, &st));
  pthread_t thread;
  REQUIRE(pthread_create(&thread, NULL, cancel_later, &k) == 0, "a thread");
  st = NULL;
  isthmus_code_t rc = isthmus_call_recv(k.call, &msg, &st);
  pthread_join(thread, NULL);
  REQUIRE(rc == ISTHMUS_CANCELLED, "recv gave %s", describe(rc, st));
  REQUIRE(msg == NULL, "no message");
  if (st) isthmus_status_free(st);
  REQUIRE(k.rc == ISTHMUS_OK, "cancel gave %s", isthmus_code_name(k.rc));
  MUST(isthmus_call_cancel(k.call)); /* again: nothing happens */
  EXPECT(isthmus_call_send(k.call, (const uint8_t *)"late", 4, 0, &st), ISTHMUS_CANCELLED);
  if (st) isthmus_status_free(st);
  MUST(isthmus_call_free(k.call));
  return 1;
}

/* A send abandoned on its queue (isthmus_cq_cancel) while it waits cancels its call, as the
 * header says of an operation's call: it may have taken flow-control credit for bytes the
 * server never gets, and later sends waited for the call's end. Sleep never reads: the first
 * 16 MiB use up the stream's window (over shm://; over HTTP/2 the server's 4 MiB limit ends
 * the call), so the second send waits. */
static int check_abandoned_send_cancels_its_call(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_call_t *call = NULL;
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  MUST(isthmus_call_start(c->ch, SVC "Sleep", &opts, &call, &st));
  size_t len = (size_t)16 << 20;
  uint8_t *big = calloc(len, 1);
  REQUIRE(big != NULL, "memory");
  isthmus_code_t first = isthmus_call_send(call, big, len, 0, &st);
  if (st) isthmus_status_free(st);
  isthmus_event_t now;
  memset(&now, 0, sizeof now);
  st = NULL;
  isthmus_code_t rc = first == ISTHMUS_OK ? isthmus_call_send_async(call, big, len, 0, cq, 9, &now, &st) : first;
  free(big);
  if (st) isthmus_status_free(st);
  if (rc == ISTHMUS_OK && now.op == 0) { /* it waits for the server's window */
    MUST(isthmus_cq_cancel(cq, 9));
    isthmus_message_t *msg = NULL;
    st = NULL;
    rc = isthmus_call_recv(call, &msg, &st);
    const char *words = st ? isthmus_status_message(st) : "";
    int ran_on = strcmp(words, "slept") == 0;
    if (st) isthmus_status_free(st);
    if (msg) isthmus_message_free(msg);
    REQUIRE(rc == ISTHMUS_CANCELLED, "recv gave %s", isthmus_code_name(rc));
    REQUIRE(!ran_on, "the call ran on to the server's end: the abandoned send did not cancel it");
  } else if (now.op != 0) {
    event_free(&now);
  }
  MUST(isthmus_call_free(call));
  isthmus_cq_free(cq);
  return 1;
}

/* 1 if `p` lies in a mapping of an isthmus shared-memory segment (its memfd's name in
   /proc/self/maps), 0 if in other memory, -1 if the maps cannot be read. */
static int in_segment(const void *p) {
  FILE *maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) return -1;
  char line[512];
  int found = 0;
  while (fgets(line, sizeof line, maps) != NULL) {
    uintptr_t lo = 0, hi = 0;
    if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR, &lo, &hi) == 2 && (uintptr_t)p >= lo && (uintptr_t)p < hi) {
      found = strstr(line, "isthmus-segment") != NULL;
      break;
    }
  }
  fclose(maps);
  return found;
}

static int check_zero_copy(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_t *call = NULL;
  isthmus_block_t *block = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  MUST(isthmus_call_start(c->ch, SVC "Unary", &opts, &call, &st));
  if (!c->shm) {
    EXPECT(isthmus_call_alloc(call, MIB, &block, &st), ISTHMUS_UNIMPLEMENTED);
    REQUIRE(block == NULL && st != NULL, "no block, a status");
    isthmus_status_free(st);
    MUST(isthmus_call_free(call));
    return 1;
  }
  /* a size no arena holds, SIZE_MAX and what a negative int becomes: refused, nothing given */
  for (size_t i = 0; i < 2; i++) {
    size_t huge = i == 0 ? SIZE_MAX : (size_t)-4000;
    EXPECT(isthmus_call_alloc(call, huge, &block, &st), ISTHMUS_RESOURCE_EXHAUSTED);
    REQUIRE(block == NULL && st != NULL, "no block for %zu bytes, a status", huge);
    isthmus_status_free(st);
    st = NULL;
    EXPECT(isthmus_channel_alloc(c->ch, huge, NULL, &block, &st), ISTHMUS_RESOURCE_EXHAUSTED);
    REQUIRE(block == NULL, "no channel block for %zu bytes", huge);
    isthmus_status_free(st);
    st = NULL;
  }
  /* a block not sent goes back */
  MUST(isthmus_call_alloc(call, 4096, &block, &st));
  MUST(isthmus_block_free(block));
  INVALID(isthmus_block_free(block));

  MUST(isthmus_call_alloc(call, MIB, &block, &st));
  size_t len = 0;
  uint8_t *data = isthmus_block_data(block, &len);
  REQUIRE(data != NULL && len == MIB, "a 1 MiB block (%zu)", len);
  REQUIRE(in_segment(data) == 1, "the block is written in place in the shared segment");
  uint8_t *want = malloc(MIB);
  REQUIRE(want != NULL, "1 MiB");
  fill_pattern(want, MIB, 1);
  /* filled by isthmus_block_write in two halves, then a write from the block into itself */
  MUST(isthmus_block_write(block, MIB / 2, want + MIB / 2, MIB / 2, &st));
  MUST(isthmus_block_write(block, 0, want, MIB / 2, &st));
  MUST(isthmus_block_write(block, 1, data, 4096, &st));
  memmove(want + 1, want, 4096);
  MUST(isthmus_block_write(block, MIB, NULL, 0, &st)); /* empty, at the end */
  INVALID(isthmus_block_write(block, MIB, want, 1, &st));
  INVALID(isthmus_block_write(block, SIZE_MAX, want, 2, &st));
  INVALID(isthmus_block_write(block, 0, NULL, 5, &st));
  REQUIRE(memcmp(data, want, MIB) == 0, "the block after the writes");
  /* written short of what it took: the send carries what the block was cut to */
  const size_t SHORT = MIB - 1000;
  INVALID(isthmus_block_truncate(block, MIB + 1, &st)); /* a block never grows */
  MUST(isthmus_block_truncate(block, SHORT, &st));
  REQUIRE(isthmus_block_data(block, &len) == data && len == SHORT, "the cut block's length (%zu)", len);
  INVALID(isthmus_block_write(block, SHORT, want, 1, &st)); /* past its new end */
  INVALID(isthmus_block_truncate(block, SHORT + 1, &st));
  MUST(isthmus_call_send_block(call, block, 1, &st));
  INVALID(isthmus_block_free(block)); /* sent: consumed */
  INVALID(isthmus_block_write(block, 0, want, 1, &st));
  INVALID(isthmus_block_truncate(block, 0, &st));
  st = NULL;
  isthmus_code_t rc = isthmus_call_recv(call, &msg, &st);
  int same = rc == ISTHMUS_OK && bytes_are(msg, want, SHORT);
  free(want);
  REQUIRE(same, "the reply to the block: %s", rc == ISTHMUS_OK ? "differs" : describe(rc, st));
  REQUIRE(in_segment(isthmus_message_data(msg, NULL)) == 1, "the reply is a view of the shared segment, not a copy");
  isthmus_message_free(msg);
  MUST(isthmus_call_recv(call, &msg, &st));
  REQUIRE(msg == NULL, "an OK end");
  MUST(isthmus_call_free(call));
  return 1;
}

static int check_block_reply(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  uint8_t *req = malloc(MIB);
  REQUIRE(req != NULL, "1 MiB");
  fill_pattern(req, MIB, 2);
  st = NULL;
  isthmus_code_t rc = isthmus_unary(c->ch, SVC "Block", req, MIB, &opts, &reply, NULL, NULL, &st);
  int same = rc == ISTHMUS_OK && bytes_are(reply, req, MIB);
  free(req);
  REQUIRE(same, "Block's reply: %s", rc == ISTHMUS_OK ? "differs" : describe(rc, st));
  isthmus_message_free(reply);
  return 1;
}

/* A unary call whose request is a block of the channel's shared memory: blocking, then
 * without blocking (the reply in `now` or on the queue). Declined over HTTP/2. */
static int op_event(isthmus_cq_t *cq, const isthmus_event_t *now, isthmus_event_t *out);

static int check_unary_block(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_block_t *block = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  INVALID(isthmus_channel_alloc(NULL, 16, &opts, &block, &st));
  INVALID(isthmus_channel_alloc(c->ch, 16, &opts, NULL, &st));
  INVALID(isthmus_unary_block(c->ch, SVC "Unary", NULL, &opts, &reply, NULL, NULL, &st));
  if (!c->shm) {
    EXPECT(isthmus_channel_alloc(c->ch, MIB, &opts, &block, &st), ISTHMUS_UNIMPLEMENTED);
    REQUIRE(block == NULL && st != NULL, "no block, a status");
    isthmus_status_free(st);
    return 1;
  }
  /* a block handed to a NULL channel is consumed all the same */
  MUST(isthmus_channel_alloc(c->ch, 16, &opts, &block, &st));
  INVALID(isthmus_unary_block(NULL, SVC "Unary", block, &opts, &reply, NULL, NULL, &st));
  INVALID(isthmus_block_free(block));

  /* a block of another channel (another connection) is refused before anything is sent */
  isthmus_channel_t *other = NULL;
  MUST(isthmus_channel_new(c->target, NULL, &other, &st));
  MUST(isthmus_channel_alloc(c->ch, 16, &opts, &block, &st));
  st = NULL;
  EXPECT(isthmus_unary_block(other, SVC "Unary", block, &opts, &reply, NULL, NULL, &st), ISTHMUS_UNAVAILABLE);
  isthmus_status_free(st);
  INVALID(isthmus_block_free(block));
  MUST(isthmus_channel_close(other));

  uint8_t *want = malloc(MIB);
  REQUIRE(want != NULL, "1 MiB");
  fill_pattern(want, MIB, 3);
  MUST(isthmus_channel_alloc(c->ch, MIB, &opts, &block, &st));
  size_t len = 0;
  uint8_t *data = isthmus_block_data(block, &len);
  REQUIRE(data != NULL && len == MIB, "a 1 MiB block (%zu)", len);
  memcpy(data, want, MIB);
  st = NULL;
  isthmus_code_t rc = isthmus_unary_block(c->ch, SVC "Unary", block, &opts, &reply, NULL, NULL, &st);
  int same = rc == ISTHMUS_OK && bytes_are(reply, want, MIB);
  INVALID(isthmus_block_free(block)); /* sent: consumed */
  if (rc == ISTHMUS_OK) isthmus_message_free(reply);
  if (!same) free(want);
  REQUIRE(same, "the reply to the block: %s", rc == ISTHMUS_OK ? "differs" : describe(rc, st));

  /* without blocking: small (copied to the queue's connection) and large (waited for) */
  isthmus_cq_t *cq = isthmus_cq_new();
  size_t sizes[2] = {100, MIB};
  for (int i = 0; i < 2; i++) {
    for (uint32_t flags = 0; flags <= ISTHMUS_CALL_SPIN; flags += ISTHMUS_CALL_SPIN) {
      isthmus_call_options_t o = timeout_opts(CALL_TIMEOUT_US);
      o.flags = flags;
      MUST(isthmus_channel_alloc(c->ch, sizes[i], &o, &block, &st));
      memcpy(isthmus_block_data(block, &len), want, sizes[i]);
      isthmus_event_t now = {0}, ev = {0};
      MUST(isthmus_unary_block_async(c->ch, SVC "Unary", block, &o, cq, 7, &now, &st));
      int got = op_event(cq, &now, &ev);
      int ok = got && ev.tag == 7 && ev.op == ISTHMUS_OP_UNARY && ev.code == ISTHMUS_OK &&
               ev.message_len == sizes[i] && memcmp(ev.message_data, want, sizes[i]) == 0;
      if (got) event_free(&ev);
      if (!ok) {
        free(want);
        isthmus_cq_free(cq);
      }
      REQUIRE(ok, "the async reply to a block of %zu bytes (flags %u)", sizes[i], flags);
    }
  }
  free(want);
  MUST(isthmus_cq_free(cq));
  return 1;
}

/* Waits (poll(2) on the queue's descriptor, 30 s at most) until `want` events are in `out`. */
static size_t collect(isthmus_cq_t *cq, isthmus_event_t *out, size_t want, size_t capacity) {
  struct pollfd p = {isthmus_cq_fd(cq), POLLIN, 0};
  double deadline = now_s() + 30.0;
  size_t got = 0;
  while (got < want && now_s() < deadline) {
    if (poll(&p, 1, 200) <= 0) continue;
    size_t room = want - got < capacity ? want - got : capacity;
    got += isthmus_cq_poll(cq, out + got, room);
  }
  return got;
}

/* The event of an operation started with `now`: there already, or the next on the queue. */
static int op_event(isthmus_cq_t *cq, const isthmus_event_t *now, isthmus_event_t *out) {
  if (now->op != 0) {
    *out = *now;
    return 1;
  }
  return collect(cq, out, 1, 1) == 1;
}

#define ASYNC_CALLS 100
#define ASYNC_CAPACITY 7 /* fewer than the calls: leftovers stay queued */

static int check_async_unary(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL && isthmus_cq_fd(cq) >= 0, "a queue");
  char req[32];
  for (int i = 0; i < ASYNC_CALLS; i++) {
    int n = snprintf(req, sizeof req, "async-%03d", i);
    MUST(isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)req, (size_t)n, &opts, cq, 1000 + (uint64_t)i, NULL, &st));
  }
  int seen[ASYNC_CALLS] = {0};
  struct pollfd p = {isthmus_cq_fd(cq), POLLIN, 0};
  double deadline = now_s() + 60.0;
  for (int done = 0; done < ASYNC_CALLS;) {
    REQUIRE(now_s() < deadline, "%d of %d events in 60 s", done, ASYNC_CALLS);
    if (poll(&p, 1, 200) <= 0) continue;
    isthmus_event_t evs[ASYNC_CAPACITY];
    size_t n = isthmus_cq_poll(cq, evs, ASYNC_CAPACITY);
    for (size_t j = 0; j < n; j++) {
      isthmus_event_t *ev = &evs[j];
      REQUIRE(ev->op == ISTHMUS_OP_UNARY, "op %d", ev->op);
      REQUIRE(ev->code == ISTHMUS_OK, "tag %" PRIu64 ": %s", ev->tag, describe(ev->code, ev->status));
      REQUIRE(ev->tag >= 1000 && ev->tag < 1000 + ASYNC_CALLS, "tag %" PRIu64, ev->tag);
      int i = (int)(ev->tag - 1000);
      REQUIRE(!seen[i], "tag %" PRIu64 " twice", ev->tag);
      seen[i] = 1;
      int m = snprintf(req, sizeof req, "async-%03d", i);
      REQUIRE(bytes_are(ev->message, req, (size_t)m), "tag %" PRIu64 ": the reply", ev->tag);
      /* the handler sent no x-echo (over HTTP/2 the headers may hold hyper's `date`) */
      size_t echo_len = 0;
      REQUIRE(md_find(ev->metadata, "x-echo", &echo_len) == NULL && md_is(ev->trailers, "x-has-deadline", "1") &&
                  ev->status == NULL &&
                  ev->call == NULL && ev->server_call == NULL,
              "the event's handles: metadata %p trailers %p status %p call %p server_call %p", (void *)ev->metadata,
              (void *)ev->trailers, (void *)ev->status, (void *)ev->call, (void *)ev->server_call);
      event_free(ev);
      done++;
    }
  }
  isthmus_event_t extra;
  REQUIRE(isthmus_cq_poll(cq, &extra, 1) == 0, "an event beyond the %d", ASYNC_CALLS);
  REQUIRE(poll(&p, 1, 0) == 0, "the descriptor stays readable with nothing queued");

  /* A tag names one pending operation: a second started under it is refused (and sends
     nothing), and the cancel stops the first. */
  MUST(isthmus_unary_async(c->ch, SVC "Sleep", (const uint8_t *)"z", 1, &opts, cq, 77, NULL, &st));
  EXPECT(isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)"x", 1, &opts, cq, 77, NULL, &st),
         ISTHMUS_INVALID_ARGUMENT);
  int names = st != NULL && strstr(isthmus_status_message(st), "tag 77") != NULL;
  if (st) isthmus_status_free(st);
  REQUIRE(names, "the refusal names the tag");
  /* A start that fails leaves no event in `now`, not even one a caller left there before. */
  isthmus_event_t stale = {.tag = 5, .op = ISTHMUS_OP_UNARY, .code = ISTHMUS_OK};
  EXPECT(isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)"x", 1, &opts, cq, 77, &stale, &st),
         ISTHMUS_INVALID_ARGUMENT);
  if (st) isthmus_status_free(st);
  REQUIRE(stale.op == 0, "a refused unary start leaves now->op 0 (it was %d)", stale.op);
  stale.op = ISTHMUS_OP_RECV;
  EXPECT(isthmus_call_recv_async(NULL, cq, 78, &stale, &st), ISTHMUS_INVALID_ARGUMENT);
  if (st) isthmus_status_free(st);
  REQUIRE(stale.op == 0, "a refused receive leaves now->op 0 (it was %d)", stale.op);
  MUST(isthmus_cq_cancel(cq, 77));
  EXPECT(isthmus_cq_cancel(cq, 77), ISTHMUS_NOT_FOUND);
  if (st) isthmus_status_free(st);
  REQUIRE(isthmus_cq_poll(cq, &extra, 1) == 0, "no event for a cancelled operation");
  /* Once it is over, the tag is free again. */
  isthmus_event_t now = {0}, ev = {0};
  MUST(isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)"again", 5, &opts, cq, 77, &now, &st));
  REQUIRE(op_event(cq, &now, &ev) && ev.tag == 77 && ev.code == ISTHMUS_OK && bytes_are(ev.message, "again", 5),
          "the tag's next operation");
  event_free(&ev);
  MUST(isthmus_cq_free(cq));
  return 1;
}

static int check_async_bidi(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_cq_t *cq = isthmus_cq_new();
  isthmus_event_t ev[2];
  REQUIRE(cq != NULL, "a queue");
  opts.flags = ISTHMUS_CALL_SPIN;
  MUST(isthmus_call_start_async(c->ch, SVC "Bidi", &opts, cq, 1, NULL, &st));
  REQUIRE(collect(cq, ev, 1, 1) == 1, "the start's event");
  REQUIRE(ev[0].op == ISTHMUS_OP_START && ev[0].tag == 1, "op %d tag %" PRIu64, ev[0].op, ev[0].tag);
  REQUIRE(ev[0].code == ISTHMUS_OK && ev[0].call != NULL, "start: %s", describe(ev[0].code, ev[0].status));
  isthmus_call_t *call = ev[0].call;

  MUST(isthmus_call_headers_async(call, cq, 2, NULL, &st));
  REQUIRE(collect(cq, ev, 1, 1) == 1, "the headers' event");
  REQUIRE(ev[0].op == ISTHMUS_OP_HEADERS && ev[0].tag == 2 && ev[0].code == ISTHMUS_OK && ev[0].metadata != NULL,
          "headers: op %d, %s", ev[0].op, describe(ev[0].code, ev[0].status));
  event_free(&ev[0]);

  char msg[32];
  for (uint64_t i = 0; i < 20; i++) {
    int n = snprintf(msg, sizeof msg, "bidi-async-%" PRIu64, i);
    MUST(isthmus_call_send_async(call, (const uint8_t *)msg, (size_t)n, 0, cq, 100 + i, NULL, &st));
    MUST(isthmus_call_recv_async(call, cq, 200 + i, NULL, &st));
    REQUIRE(collect(cq, ev, 2, 2) == 2, "round %" PRIu64 ": two events", i);
    int sent = 0, received = 0;
    for (int j = 0; j < 2; j++) {
      REQUIRE(ev[j].code == ISTHMUS_OK, "round %" PRIu64 ": %s", i, describe(ev[j].code, ev[j].status));
      if (ev[j].op == ISTHMUS_OP_SEND && ev[j].tag == 100 + i) sent++;
      if (ev[j].op == ISTHMUS_OP_RECV && ev[j].tag == 200 + i && bytes_are(ev[j].message, msg, (size_t)n)) received++;
      event_free(&ev[j]);
    }
    REQUIRE(sent == 1 && received == 1, "round %" PRIu64 ": the send and the echo", i);
  }
  /* given `now`: an operation done before the function returns leaves its event there, and
   * nothing on the queue; otherwise now.op is 0 and the event comes on the queue. From round
   * 40 the receive is recv_spin: the same outcome, waited for on this thread first. */
  for (uint64_t i = 20; i < 60; i++) {
    isthmus_code_t (*recv)(const isthmus_call_t *, const isthmus_cq_t *, uint64_t, isthmus_event_t *,
                           isthmus_status_t **) = i < 40 ? isthmus_call_recv_async : isthmus_call_recv_spin;
    int n = snprintf(msg, sizeof msg, "bidi-now-%" PRIu64, i);
    isthmus_event_t now;
    memset(&now, 0, sizeof now);
    now.op = -1;
    MUST(isthmus_call_send_async(call, (const uint8_t *)msg, (size_t)n, 0, cq, 100 + i, &now, &st));
    REQUIRE(now.op != -1, "round %" PRIu64 ": send left `now` alone", i);
    REQUIRE(op_event(cq, &now, &ev[0]), "round %" PRIu64 ": the send's event", i);
    REQUIRE(ev[0].op == ISTHMUS_OP_SEND && ev[0].tag == 100 + i && ev[0].code == ISTHMUS_OK, "round %" PRIu64
            ": send: op %d tag %" PRIu64 " %s", i, ev[0].op, ev[0].tag, describe(ev[0].code, ev[0].status));
    event_free(&ev[0]);
    now.op = -1;
    MUST(recv(call, cq, 200 + i, &now, &st));
    REQUIRE(now.op != -1, "round %" PRIu64 ": recv left `now` alone", i);
    REQUIRE(op_event(cq, &now, &ev[0]), "round %" PRIu64 ": the echo's event", i);
    REQUIRE(ev[0].op == ISTHMUS_OP_RECV && ev[0].tag == 200 + i && ev[0].code == ISTHMUS_OK &&
                bytes_are(ev[0].message, msg, (size_t)n),
            "round %" PRIu64 ": the echo: op %d %s", i, ev[0].op, describe(ev[0].code, ev[0].status));
    event_free(&ev[0]);
  }
  /* recv_spin with nothing to receive (the server echoes only what is sent): the spin ends
   * empty-handed, and the same receive goes on in the queue, where the echo of the next send
   * completes it */
  {
    isthmus_event_t now;
    memset(&now, 0, sizeof now);
    now.op = -1;
    MUST(isthmus_call_recv_spin(call, cq, 260, &now, &st));
    REQUIRE(now.op == 0, "a receive with nothing sent completed at once: op %d", now.op);
    MUST(isthmus_call_send_async(call, (const uint8_t *)"late", 4, 0, cq, 160, NULL, &st));
    REQUIRE(collect(cq, ev, 2, 2) == 2, "the send's and the queued receive's events");
    int sent = 0, received = 0;
    for (int j = 0; j < 2; j++) {
      REQUIRE(ev[j].code == ISTHMUS_OK, "late: %s", describe(ev[j].code, ev[j].status));
      if (ev[j].op == ISTHMUS_OP_SEND && ev[j].tag == 160) sent++;
      if (ev[j].op == ISTHMUS_OP_RECV && ev[j].tag == 260 && bytes_are(ev[j].message, "late", 4)) received++;
      event_free(&ev[j]);
    }
    REQUIRE(sent == 1 && received == 1, "the late send and its echo through the queue");
  }
  MUST(isthmus_call_close_send_async(call, cq, 300, NULL, &st));
  REQUIRE(collect(cq, ev, 1, 1) == 1, "the half-close's event");
  REQUIRE(ev[0].op == ISTHMUS_OP_CLOSE_SEND && ev[0].tag == 300 && ev[0].code == ISTHMUS_OK, "half-close");
  MUST(isthmus_call_recv_spin(call, cq, 400, NULL, &st));
  REQUIRE(collect(cq, ev, 1, 1) == 1, "the end's event");
  REQUIRE(ev[0].op == ISTHMUS_OP_RECV && ev[0].code == ISTHMUS_OK && ev[0].message == NULL, "an OK end: %s",
          describe(ev[0].code, ev[0].status));
  MUST(isthmus_call_free(call));
  MUST(isthmus_cq_free(cq));
  return 1;
}

static int check_queued(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_t *call = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  MUST(isthmus_unary(c->ch, SVC "Queued", (const uint8_t *)"queued-hello", 12, &opts, &msg, NULL, NULL, &st));
  REQUIRE(bytes_are(msg, "queued-hello", 12), "the echo");
  isthmus_message_free(msg);

  static const char *parts[] = {"one", "two", "three"};
  MUST(isthmus_call_start(c->ch, SVC "Queued", &opts, &call, &st));
  for (int i = 0; i < 3; i++) {
    MUST(isthmus_call_send(call, (const uint8_t *)parts[i], strlen(parts[i]), i == 2, &st));
    MUST(isthmus_call_recv(call, &msg, &st));
    REQUIRE(bytes_are(msg, parts[i], strlen(parts[i])), "echo %d", i);
    isthmus_message_free(msg);
  }
  MUST(isthmus_call_recv(call, &msg, &st));
  REQUIRE(msg == NULL, "an OK end");
  MUST(isthmus_call_free(call));
  return 1;
}

static int check_bad_finish(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  /* long enough that a call left unfinished would show as DEADLINE_EXCEEDED, not hang */
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  static const struct {
    const char *req, *named;
  } cases[] = {{"t", "metadata"}, {"d", "details"}, {"m", "UTF-8"}};
  for (size_t i = 0; i < 3; i++) {
    EXPECT(isthmus_unary(c->ch, SVC "BadFinish", (const uint8_t *)cases[i].req, 1, &opts, &reply, NULL, NULL, &st),
           ISTHMUS_INTERNAL);
    REQUIRE(st != NULL && strstr(isthmus_status_message(st), cases[i].named) != NULL, "'%s' names %s",
            st ? isthmus_status_message(st) : "", cases[i].named);
    size_t n = 1;
    REQUIRE(isthmus_status_details(st, &n) == NULL && n == 0, "no details");
    isthmus_status_free(st);
  }
  return 1;
}

/* A handler's whole answer in one call (isthmus_server_call_reply_async): the reply and its
 * trailers arrive, small or large; bad arguments end the call INTERNAL naming them; and the
 * server saw every event as promised. */
static int check_reply(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_metadata_t *trailers = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  MUST(isthmus_unary(c->ch, SVC "Reply", (const uint8_t *)"hello", 5, &opts, &reply, NULL, &trailers, &st));
  REQUIRE(bytes_are(reply, "hello", 5), "the echo");
  REQUIRE(md_is(trailers, "x-replied", "1"), "the trailer x-replied");
  isthmus_message_free(reply);
  isthmus_metadata_free(trailers);

  uint8_t *want = malloc(MIB);
  REQUIRE(want != NULL, "1 MiB");
  fill_pattern(want, MIB, 3);
  isthmus_code_t rc = isthmus_unary(c->ch, SVC "Reply", (const uint8_t *)"L", 1, &opts, &reply, NULL, &trailers, &st);
  int same = rc == ISTHMUS_OK && bytes_are(reply, want, MIB) && md_is(trailers, "x-replied", "1");
  free(want);
  REQUIRE(same, "the 1 MiB reply and its trailer: %s", rc == ISTHMUS_OK ? "differ" : describe(rc, st));
  isthmus_message_free(reply);
  isthmus_metadata_free(trailers);

  /* The reply's operation cancelled ("C"), or its queue freed ("F"), while the 1 MiB reply
     waits for credit: the call ends CANCELLED at once (or the reply came first, whole), never
     at its deadline. */
  for (const char *req = "CF"; *req; req++) {
    isthmus_call_t *call = NULL;
    MUST(isthmus_call_start(c->ch, SVC "Reply", &opts, &call, &st));
    MUST(isthmus_call_send(call, (const uint8_t *)req, 1, 1, &st));
    MUST(isthmus_call_recv(call, &reply, &st));
    int filled = reply != NULL && isthmus_message_len(reply) == 4 * MIB;
    if (reply) isthmus_message_free(reply);
    reply = NULL;
    st = NULL;
    rc = isthmus_call_recv(call, &reply, &st);
    /* Cancelled (nearly always: the client's credit comes long after the cancel), or the
       reply went first and the call ended OK. */
    int fine = rc == ISTHMUS_OK ? reply != NULL && isthmus_message_len(reply) == MIB
                                : rc == ISTHMUS_CANCELLED && st && strstr(isthmus_status_message(st), "before the reply went");
    if (reply) isthmus_message_free(reply);
    if (st) isthmus_status_free(st);
    isthmus_call_free(call);
    REQUIRE(filled && fine, "'%c': the 4 MiB message (%d), then %s", *req, filled, isthmus_code_name(rc));
  }

  static const struct {
    const char *req, *named;
  } cases[] = {{"t", "metadata"}, {"q", "queue"}};
  for (size_t i = 0; i < 2; i++) {
    EXPECT(isthmus_unary(c->ch, SVC "Reply", (const uint8_t *)cases[i].req, 1, &opts, &reply, NULL, NULL, &st),
           ISTHMUS_INTERNAL);
    REQUIRE(st != NULL && strstr(isthmus_status_message(st), cases[i].named) != NULL, "'%s' names %s",
            st ? isthmus_status_message(st) : "", cases[i].named);
    isthmus_status_free(st);
  }
  MUST(isthmus_unary(c->ch, SVC "Reply", (const uint8_t *)"?", 1, &opts, &reply, NULL, NULL, &st));
  REQUIRE(bytes_are(reply, "problems=0", 10), "the server's side of the replies: %.*s", (int)isthmus_message_len(reply),
          (const char *)isthmus_message_data(reply, NULL));
  isthmus_message_free(reply);
  return 1;
}

static int check_unimplemented(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  EXPECT(isthmus_unary(c->ch, SVC "Nope", (const uint8_t *)"x", 1, &opts, &reply, NULL, NULL, &st),
         ISTHMUS_UNIMPLEMENTED);
  REQUIRE(reply == NULL, "no reply");
  if (st) isthmus_status_free(st);
  return 1;
}

static int check_bad_target(ctx_t *c) {
  (void)c;
  isthmus_status_t *st = NULL;
  static const char *bad[] = {"bogus://x", "", "shm://", "shm://../etc", "host:notaport", "ipv4:300.0.0.1:1"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    isthmus_channel_t *ch = NULL;
    EXPECT(isthmus_channel_new(bad[i], NULL, &ch, &st), ISTHMUS_INVALID_ARGUMENT);
    REQUIRE(ch == NULL && st != NULL, "'%s': no channel, a status", bad[i]);
    isthmus_status_free(st);
  }
  return 1;
}

/* Waits up to 10 s, one state change at a time, for `ch` to reach `want`; the states seen on
 * the way must not include `never`. */
static int reach_state(isthmus_channel_t *ch, uint32_t want, uint32_t never) {
  isthmus_status_t *st = NULL;
  uint32_t s = 99;
  MUST(isthmus_channel_state(ch, 0, &s));
  double until = now_s() + 10;
  while (s != want && now_s() < until) {
    REQUIRE(s != never, "state %u on the way to %u", s, want);
    isthmus_code_t rc = isthmus_channel_wait_state(ch, s, 1000, &s);
    REQUIRE(rc == ISTHMUS_OK || rc == ISTHMUS_DEADLINE_EXCEEDED, "wait_state gave %s", isthmus_code_name(rc));
  }
  REQUIRE(s == want, "state %u after 10 s, not %u", s, want);
  return 1;
}

/* The next event on `cq` within 10 s, which must be operation `tag`'s. (A wait may end with
 * none: a woken operation that has not finished yet.) */
static int next_event(isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *ev) {
  double until = now_s() + 10;
  size_t got = 0;
  while (got == 0 && now_s() < until) got = isthmus_cq_wait(cq, ev, 1, 0, 100 * 1000);
  REQUIRE(got == 1, "no event for operation %llu in 10 s", (unsigned long long)tag);
  REQUIRE(ev->tag == tag && ev->op == ISTHMUS_OP_STATE, "event %llu op %d", (unsigned long long)ev->tag, ev->op);
  return 1;
}

/* isthmus_channel_wait_state_async: a wait that ends with the change it waited for, one that
 * runs out of time with the state unchanged, one given up (no event after
 * isthmus_cq_cancel), and bad arguments refused, on a completion queue. */
static int check_state_async(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_channel_t *ch = NULL;
  isthmus_event_t ev, now;
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a completion queue");
  INVALID(isthmus_channel_wait_state_async(NULL, ISTHMUS_STATE_IDLE, -1, cq, 1, NULL, &st));
  INVALID(isthmus_channel_wait_state_async(c->ch, ISTHMUS_STATE_SHUTDOWN + 1, -1, cq, 1, NULL, &st));
  INVALID(isthmus_channel_wait_state_async(c->ch, ISTHMUS_STATE_IDLE, -1, NULL, 1, NULL, &st));

  /* A state that is not the current one: the answer comes at once, in `now`. */
  MUST(isthmus_channel_new(c->target, NULL, &ch, &st));
  memset(&now, 0, sizeof now);
  MUST(isthmus_channel_wait_state_async(ch, ISTHMUS_STATE_READY, -1, cq, 1, &now, &st));
  REQUIRE(now.op == ISTHMUS_OP_STATE && now.code == ISTHMUS_OK && now.message_len == ISTHMUS_STATE_IDLE,
          "at once: op %d code %d state %zu", now.op, now.code, now.message_len);

  /* Out of time: DEADLINE_EXCEEDED, with the state, still IDLE, and a status. */
  MUST(isthmus_channel_wait_state_async(ch, ISTHMUS_STATE_IDLE, 20, cq, 2, NULL, &st));
  if (!next_event(cq, 2, &ev)) return 0;
  REQUIRE(ev.code == ISTHMUS_DEADLINE_EXCEEDED && ev.message_len == ISTHMUS_STATE_IDLE && ev.status != NULL,
          "timed out: code %d state %zu", ev.code, ev.message_len);
  isthmus_status_free(ev.status);

  /* Given up: cancelled, nothing comes. */
  MUST(isthmus_channel_wait_state_async(ch, ISTHMUS_STATE_IDLE, -1, cq, 3, NULL, &st));
  MUST(isthmus_cq_cancel(cq, 3));
  double quiet = now_s() + 0.05;
  while (now_s() < quiet) REQUIRE(isthmus_cq_wait(cq, &ev, 1, 0, 10 * 1000) == 0, "an event for a cancelled wait");

  /* The change: asked to connect, the channel leaves IDLE, and the waiter hears it. */
  MUST(isthmus_channel_wait_state_async(ch, ISTHMUS_STATE_IDLE, -1, cq, 4, NULL, &st));
  uint32_t s = 99;
  MUST(isthmus_channel_state(ch, 1, &s));
  if (!next_event(cq, 4, &ev)) return 0;
  REQUIRE(ev.code == ISTHMUS_OK && ev.message_len != ISTHMUS_STATE_IDLE, "changed: code %d state %zu", ev.code,
          ev.message_len);

  /* Closing the channel ends a wait on any other state: SHUTDOWN. */
  if (!reach_state(ch, ISTHMUS_STATE_READY, ISTHMUS_STATE_SHUTDOWN)) return 0;
  MUST(isthmus_channel_wait_state_async(ch, ISTHMUS_STATE_READY, -1, cq, 5, NULL, &st));
  MUST(isthmus_channel_close(ch));
  if (!next_event(cq, 5, &ev)) return 0;
  REQUIRE(ev.code == ISTHMUS_OK && ev.message_len == ISTHMUS_STATE_SHUTDOWN, "closed: code %d state %zu", ev.code,
          ev.message_len);
  MUST(isthmus_cq_free(cq));
  return 1;
}

/* Connectivity: a new channel is IDLE until asked to connect, then reaches READY in the
 * background; the shared channel is READY after its calls; a channel to nobody fails; a
 * closed handle and bad arguments are refused. */
static int check_connectivity(ctx_t *c) {
  isthmus_status_t *st = NULL;
  isthmus_channel_t *ch = NULL;
  uint32_t s = 99;
  INVALID(isthmus_channel_state(NULL, 0, &s));
  INVALID(isthmus_channel_state(c->ch, 0, NULL));
  INVALID(isthmus_channel_wait_state(NULL, ISTHMUS_STATE_IDLE, 1, &s));
  INVALID(isthmus_channel_wait_state(c->ch, ISTHMUS_STATE_SHUTDOWN + 1, 1, &s));
  INVALID(isthmus_channel_wait_state(c->ch, ISTHMUS_STATE_IDLE, 1, NULL));
  MUST(isthmus_channel_state(c->ch, 0, &s));
  REQUIRE(s == ISTHMUS_STATE_READY, "the shared channel, after its calls, is %u", s);

  MUST(isthmus_channel_new(c->target, NULL, &ch, &st));
  MUST(isthmus_channel_state(ch, 0, &s));
  REQUIRE(s == ISTHMUS_STATE_IDLE, "a new channel is %u", s);
  EXPECT(isthmus_channel_wait_state(ch, ISTHMUS_STATE_IDLE, 20, &s), ISTHMUS_DEADLINE_EXCEEDED);
  REQUIRE(s == ISTHMUS_STATE_IDLE, "not asked to connect, the channel went %u", s);
  MUST(isthmus_channel_state(ch, 1, &s));
  if (!reach_state(ch, ISTHMUS_STATE_READY, ISTHMUS_STATE_SHUTDOWN)) return 0;
  MUST(isthmus_channel_close(ch));
  INVALID(isthmus_channel_state(ch, 0, &s));

  char nobody[64];
  snprintf(nobody, sizeof nobody, "shm://isthmus-nobody-%d", (int)getpid());
  MUST(isthmus_channel_new(nobody, NULL, &ch, &st));
  MUST(isthmus_channel_state(ch, 1, &s));
  if (!reach_state(ch, ISTHMUS_STATE_TRANSIENT_FAILURE, ISTHMUS_STATE_READY)) return 0;
  MUST(isthmus_channel_close(ch));
  return check_state_async(c);
}

/* ---- one thread frees or stops what another waits on ---- */

/* Waits up to `seconds` for `*flag`; its value then. */
static int eventually(atomic_int *flag, double seconds) {
  double end = now_s() + seconds;
  while (!atomic_load(flag) && now_s() < end) sleep_ms(5);
  return atomic_load(flag);
}

typedef struct {
  isthmus_cq_t *cq;
  size_t got;
  atomic_int returned;
} cq_waiter_t;

static void *cq_waiter(void *arg) {
  cq_waiter_t *w = arg;
  isthmus_event_t ev;
  w->got = isthmus_cq_wait(w->cq, &ev, 1, 0, -1);
  atomic_store(&w->returned, 1);
  return NULL;
}

/* A thread asleep in isthmus_cq_wait with no timeout wakes when another frees the queue. */
static int check_cq_free_wakes_a_waiter(ctx_t *c) {
  if (!c->shm) return 1; /* no use of the target: once (over shm://) is enough */
  cq_waiter_t w = {isthmus_cq_new(), 99, 0};
  pthread_t t;
  REQUIRE(w.cq != NULL && pthread_create(&t, NULL, cq_waiter, &w) == 0, "a queue and a thread");
  sleep_ms(100); /* asleep in isthmus_cq_wait by now, most likely; if not, it finds no queue */
  REQUIRE(isthmus_cq_free(w.cq) == ISTHMUS_OK, "the queue freed");
  /* A thread that sleeps on is left behind: the process ends with the checks. */
  REQUIRE(eventually(&w.returned, 10), "isthmus_cq_wait returned once its queue was freed");
  pthread_join(t, NULL);
  REQUIRE(w.got == 0, "no event");
  return 1;
}

/* One unary echo on `cq` under `tag`, its event awaited (60 s at most); 1 if it came back OK with
   its request. */
static int queued_echo(ctx_t *c, isthmus_cq_t *cq, uint64_t tag) {
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  char req[32];
  int n = snprintf(req, sizeof req, "forked-%" PRIu64, tag);
  MUST(isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)req, (size_t)n, &opts, cq, tag, NULL, &st));
  struct pollfd p = {isthmus_cq_fd(cq), POLLIN, 0};
  double deadline = now_s() + 60.0;
  for (;;) {
    REQUIRE(now_s() < deadline, "no event for tag %" PRIu64 " in 60 s", tag);
    if (poll(&p, 1, 200) <= 0) continue;
    isthmus_event_t ev;
    if (isthmus_cq_poll(cq, &ev, 1) == 0) continue;
    int ok = ev.tag == tag && ev.code == ISTHMUS_OK && bytes_are(ev.message, req, (size_t)n);
    uint64_t got = ev.tag;
    isthmus_code_t code = ev.code;
    event_free(&ev);
    REQUIRE(ok, "tag %" PRIu64 " (%s), not an OK echo for %" PRIu64, got, isthmus_code_name(code), tag);
    return 1;
  }
}

/* A queue made before a fork is the parent's: in the child, an operation started on it is
   refused (FAILED_PRECONDITION), a poll finds nothing and it has no descriptor, while a queue
   the child makes carries a call on the channel it inherited; the parent's queue carries its
   calls as before. Before, both processes signalled and read one descriptor, each able to take
   the other's wake-ups. */
static int check_fork_keeps_queues_apart(ctx_t *c) {
  if (!c->shm) return 1; /* once is enough */
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  REQUIRE(queued_echo(c, cq, 1), "a call before the fork");
  fflush(NULL);
  pid_t pid = fork();
  REQUIRE(pid >= 0, "fork: %s", strerror(errno));
  if (pid == 0) {
    alarm(60); /* a child that hangs dies, and the parent sees it */
    isthmus_status_t *st = NULL;
    isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
    int refused = isthmus_unary_async(c->ch, SVC "Unary", (const uint8_t *)"x", 1, &opts, cq, 2, NULL, &st) ==
                  ISTHMUS_FAILED_PRECONDITION;
    if (st) isthmus_status_free(st);
    isthmus_event_t ev;
    int empty = isthmus_cq_poll(cq, &ev, 1) == 0 && isthmus_cq_fd(cq) == -1;
    isthmus_cq_t *own = isthmus_cq_new();
    int served = own != NULL && queued_echo(c, own, 3);
    int freed = isthmus_cq_free(cq) == ISTHMUS_OK && (own == NULL || isthmus_cq_free(own) == ISTHMUS_OK);
    if (!(refused && empty && served && freed))
      fprintf(stderr, "fork child: refused %d, empty %d, served %d, freed %d\n", refused, empty, served, freed);
    _exit(refused && empty && served && freed ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid, "waitpid: %s", strerror(errno));
  REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child ended with status %#x", status);
  REQUIRE(queued_echo(c, cq, 4), "the parent's queue after the fork");
  REQUIRE(isthmus_cq_free(cq) == ISTHMUS_OK, "the queue freed");
  return 1;
}

typedef struct {
  isthmus_server_t *server;
  uint64_t grace_ms;
} stopper_t;

static void *stopper(void *arg) {
  stopper_t *s = arg;
  isthmus_server_shutdown(s->server, s->grace_ms);
  return NULL;
}

/* A unary call on a thread of its own: `request` to `path` over `ch`; its code and the reply's
 * text (up to 63 bytes). */
typedef struct {
  isthmus_channel_t *ch;
  const char *path;
  const char *request;
  isthmus_code_t rc;
  char reply[64];
} caller_t;

static void *unary_caller(void *arg) {
  caller_t *t = arg;
  isthmus_message_t *reply = NULL;
  isthmus_status_t *st = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  t->rc = isthmus_unary(t->ch, t->path, (const uint8_t *)t->request, strlen(t->request), &opts, &reply, NULL, NULL,
                        &st);
  if (reply != NULL) {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(reply, &len);
    snprintf(t->reply, sizeof t->reply, "%.*s", (int)len, (const char *)data);
    isthmus_message_free(reply);
  }
  if (st) isthmus_status_free(st);
  return NULL;
}

/* Shuts a server down with `first_ms` of grace on one thread while a call holds it, then with
 * `second_ms` on this one: how long (s) the second took, from the first's start; < 0 on failure
 * (`g_why` says why). */
static double shutdown_twice(uint64_t first_ms, uint64_t second_ms) {
  isthmus_status_t *st = NULL;
  static atomic_int servers;
  char target[96];
  snprintf(target, sizeof target, "shm://abi-shutdown-%ld-%d", (long)getpid(), atomic_fetch_add(&servers, 1));
  const char *targets[] = {target};
  isthmus_server_t *server = isthmus_server_new(NULL);
  caller_t call = {NULL, SVC "Sleep", "z", ISTHMUS_UNKNOWN, ""};
  isthmus_code_t rc = isthmus_server_add_handler(server, SVC "Sleep", on_call, &g_handlers[SLEEP_HANDLER], &st);
  if (rc == ISTHMUS_OK) rc = isthmus_server_start(server, targets, 1, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_channel_new(target, NULL, &call.ch, &st);
  if (rc != ISTHMUS_OK) {
    isthmus_server_free(server);
    return failf(__LINE__, "a server and a channel: %s", describe(rc, st)) - 1;
  }
  int began = atomic_load(&g_sleep_began);
  pthread_t caller, first;
  pthread_create(&caller, NULL, unary_caller, &call);
  double end = now_s() + 30;
  while (atomic_load(&g_sleep_began) == began && now_s() < end) sleep_ms(5);
  int reached = atomic_load(&g_sleep_began) > began;

  stopper_t graceful = {server, first_ms};
  double start = now_s();
  pthread_create(&first, NULL, stopper, &graceful);
  sleep_ms(100); /* the first shutdown is under way (were it not, this one is first) */
  rc = isthmus_server_shutdown(server, second_ms);
  double took = now_s() - start;
  pthread_join(first, NULL);
  pthread_join(caller, NULL);
  reap_workers(1);
  isthmus_channel_close(call.ch);
  isthmus_server_free(server);
  if (!reached) return failf(__LINE__, "the Sleep call never reached its handler") - 1;
  if (rc != ISTHMUS_OK) return failf(__LINE__, "the second shutdown: %s", isthmus_code_name(rc)) - 1;
  return took;
}

/* A second shutdown while one is under way waits for it to finish (it used to return at once),
 * and its own grace cuts the first one's short if it ends sooner, never longer. */
static int check_shutdown_twice_at_once(ctx_t *c) {
  if (!c->shm) return 1; /* servers of its own: once (over shm://) is enough */
  double took = shutdown_twice(2000, 60000);
  if (took < 0) return 0;
  REQUIRE(took >= 1.0 && took < 30, "a longer second grace: it took %.3f s, not the first one's 2 s", took);
  took = shutdown_twice(60000, 0);
  if (took < 0) return 0;
  REQUIRE(took < 30, "a second shutdown with no grace took %.3f s: the first one's 60 s ran on", took);
  return 1;
}

typedef struct {
  isthmus_cq_t *cq;
  atomic_int started;
  double seconds;
  isthmus_server_call_t *call;
  isthmus_code_t rc;
} take_waiter_t;

/* Waits 20 s in isthmus_cq_take_call; how long it took. */
static void *take_waiter(void *arg) {
  take_waiter_t *w = arg;
  uint64_t tag = 0;
  atomic_store(&w->started, 1);
  double start = now_s();
  w->rc = isthmus_cq_take_call(w->cq, 20 * 1000 * 1000, &tag, &w->call, NULL);
  w->seconds = now_s() - start;
  return NULL;
}

/* Answers a call of the Taken handler with its request; 1 if it was one. */
static int answer_taken(isthmus_server_call_t *call) {
  isthmus_status_t *st = NULL;
  isthmus_message_t *req = NULL;
  if (!path_is(call, SVC "Taken") || isthmus_server_call_recv(call, 0, &req, &st) != ISTHMUS_OK || req == NULL) {
    if (st) isthmus_status_free(st);
    isthmus_server_call_finish(call, ISTHMUS_INTERNAL, "not the Taken call", NULL, NULL);
    return 0;
  }
  size_t len = 0;
  const uint8_t *data = isthmus_message_data(req, &len);
  isthmus_code_t rc = isthmus_server_call_send(call, data, len, &st);
  isthmus_message_free(req);
  if (st) isthmus_status_free(st);
  isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
  return rc == ISTHMUS_OK;
}

/* A thread spinning in isthmus_cq_take_call takes a queue handler's next call, whose event then
 * never comes; with nobody spinning the call goes to the queue; nothing coming leaves the
 * taker empty-handed after its spin. */
static int check_take_call(ctx_t *c) {
  if (!c->shm) return 1; /* a server of its own: once (over shm://) is enough */
  enum { TAKEN_TAG = 77 };
  isthmus_status_t *st = NULL;
  char target[96];
  snprintf(target, sizeof target, "shm://abi-take-%ld", (long)getpid());
  const char *targets[] = {target};
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  isthmus_server_t *server = isthmus_server_new(NULL);
  caller_t caller = {NULL, SVC "Taken", "taken", ISTHMUS_UNKNOWN, ""};
  isthmus_code_t rc = isthmus_server_add_handler_cq(server, SVC "Taken", cq, TAKEN_TAG, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_server_start(server, targets, 1, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_channel_new(target, NULL, &caller.ch, &st);
  if (rc != ISTHMUS_OK) {
    isthmus_server_free(server);
    isthmus_cq_free(cq);
    return failf(__LINE__, "a server and a channel: %s", describe(rc, st));
  }
  int ok = 1;
  uint64_t tag = 5;
  isthmus_server_call_t *call = (isthmus_server_call_t *)&tag;

  /* Nothing comes: empty-handed after the spin. */
  MUST(isthmus_cq_take_call(cq, 1000, &tag, &call, &st));
  if (call != NULL || tag != 0) ok = failf(__LINE__, "a call taken where none came (tag %llu)", (unsigned long long)tag);

  /* A call that comes while this thread spins is taken here, not queued. One that came in the
   * moment between two spins went to the queue, rightly: answered, and the next call tried. */
  int taken = 0;
  for (int attempt = 0; ok && !taken && attempt < 5; attempt++) {
    pthread_t t;
    caller.rc = ISTHMUS_UNKNOWN;
    caller.reply[0] = 0;
    pthread_create(&t, NULL, unary_caller, &caller);
    int queued = 0;
    call = NULL;
    for (double end = now_s() + 30; ok && call == NULL && !queued && now_s() < end;) {
      MUST(isthmus_cq_take_call(cq, 100000, &tag, &call, &st));
      isthmus_event_t ev[2];
      size_t n = isthmus_cq_poll(cq, ev, 2);
      for (size_t i = 0; i < n; i++) {
        if (ev[i].op == ISTHMUS_OP_NEW_CALL) {
          queued = 1;
          if (!answer_taken(ev[i].server_call)) ok = failf(__LINE__, "a queued call could not be answered");
        } else {
          event_free(&ev[i]);
        }
      }
    }
    if (call != NULL) {
      taken = 1;
      if (tag != TAKEN_TAG) ok = failf(__LINE__, "the taken call's tag is %llu", (unsigned long long)tag);
      if (!answer_taken(call)) ok = failf(__LINE__, "the taken call could not be answered");
    }
    pthread_join(t, NULL);
    if (ok && (caller.rc != ISTHMUS_OK || strcmp(caller.reply, "taken") != 0))
      ok = failf(__LINE__, "the caller got %s, '%s'", isthmus_code_name(caller.rc), caller.reply);
  }
  if (ok && !taken) ok = failf(__LINE__, "no call of 5 was taken by the spinning thread");
  isthmus_event_t ev[2];
  if (ok && isthmus_cq_poll(cq, ev, 2) != 0) ok = failf(__LINE__, "an event for the taken call");

  /* Nobody spins: the next call is an event on the queue. */
  caller.request = "queued";
  pthread_t t;
  pthread_create(&t, NULL, unary_caller, &caller);
  size_t n = 0;
  for (double end = now_s() + 30; ok && n == 0 && now_s() < end;) n = isthmus_cq_wait(cq, ev, 1, 0, 100000);
  if (ok && (n != 1 || ev[0].op != ISTHMUS_OP_NEW_CALL || ev[0].tag != TAKEN_TAG))
    ok = failf(__LINE__, "no NEW_CALL event with the handler's tag (%zu events)", n);
  if (n == 1 && ev[0].op == ISTHMUS_OP_NEW_CALL && !answer_taken(ev[0].server_call))
    ok = failf(__LINE__, "the queued call could not be answered");
  pthread_join(t, NULL);
  if (ok && (caller.rc != ISTHMUS_OK || strcmp(caller.reply, "queued") != 0))
    ok = failf(__LINE__, "the queued caller got %s, '%s'", isthmus_code_name(caller.rc), caller.reply);

  INVALID(isthmus_cq_take_call(NULL, 0, &tag, &call, &st));
  INVALID(isthmus_cq_take_call(cq, 0, NULL, &call, &st));
  INVALID(isthmus_cq_take_call(cq, 0, &tag, NULL, &st));
  isthmus_channel_close(caller.ch);
  isthmus_server_free(server);

  /* Freeing the queue ends a thread's wait in it (of 20 s) soon, with no call. */
  take_waiter_t w = {cq, 0, 0, NULL, ISTHMUS_UNKNOWN};
  pthread_create(&t, NULL, take_waiter, &w);
  while (!atomic_load(&w.started)) sleep_ms(1);
  sleep_ms(100);
  isthmus_cq_free(cq);
  pthread_join(t, NULL);
  if (ok && (w.seconds > 10 || w.call != NULL))
    ok = failf(__LINE__, "a wait in a freed queue took %.3f s (call %p)", w.seconds, (void *)w.call);
  return ok;
}

/* A server of this process on a fresh shm:// name, with `handler` (or, if NULL, `cq` and `tag`)
 * for every path, and a channel to it; 0 (and `g_why` says why) if either failed. */
static int own_server(const char *name, isthmus_handler_fn handler, void *user_data, isthmus_cq_t *cq, uint64_t tag,
                      isthmus_server_t **server, isthmus_channel_t **ch) {
  isthmus_status_t *st = NULL;
  char target[96];
  snprintf(target, sizeof target, "shm://abi-%s-%ld", name, (long)getpid());
  const char *targets[] = {target};
  *server = isthmus_server_new(NULL);
  *ch = NULL;
  isthmus_code_t rc = handler ? isthmus_server_add_handler(*server, NULL, handler, user_data, &st)
                              : isthmus_server_add_handler_cq(*server, NULL, cq, tag, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_server_start(*server, targets, 1, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_channel_new(target, NULL, ch, &st);
  if (rc != ISTHMUS_OK) {
    isthmus_server_free(*server);
    return failf(__LINE__, "a server and a channel on %s: %s", target, describe(rc, st));
  }
  return 1;
}

typedef struct {
  atomic_int entered, returned;
} slow_callback_t;

/* A callback that takes 300 ms, then finishes its call. */
static void on_slow(void *user_data, isthmus_server_call_t *call) {
  slow_callback_t *s = user_data;
  atomic_store(&s->entered, 1);
  sleep_ms(300);
  isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
  atomic_store(&s->returned, 1);
}

/* isthmus_server_free returns only once a handler callback under way has returned: its user
 * data may be freed then. Before, the free returned at once (no grace) with the callback still
 * running, which then used freed memory. */
static int check_free_waits_for_callbacks(ctx_t *c) {
  if (!c->shm) return 1; /* a server of its own: once (over shm://) is enough */
  slow_callback_t *s = calloc(1, sizeof *s);
  isthmus_server_t *server;
  caller_t caller = {NULL, SVC "Slow", "slow", ISTHMUS_UNKNOWN, ""};
  if (!own_server("slow", on_slow, s, NULL, 0, &server, &caller.ch)) {
    free(s);
    return 0;
  }
  pthread_t t;
  pthread_create(&t, NULL, unary_caller, &caller);
  int ok = eventually(&s->entered, 30) || failf(__LINE__, "the callback was not called in 30 s");
  REQUIRE(isthmus_server_free(server) == ISTHMUS_OK, "the server freed");
  if (ok && !atomic_load(&s->returned)) ok = failf(__LINE__, "isthmus_server_free returned with its callback running");
  pthread_join(t, NULL);
  isthmus_channel_close(caller.ch);
  free(s); /* the user data, as a C program frees it once the server is */
  return ok;
}

/* Events of `cq` for up to `seconds`, or until `enough` had `tag`: how many had it (each freed;
 * a NEW_CALL's call finished UNIMPLEMENTED). */
static int events_with_tag(isthmus_cq_t *cq, uint64_t tag, double seconds, int enough) {
  int found = 0;
  for (double end = now_s() + seconds; now_s() < end && (enough == 0 || found < enough);) {
    isthmus_event_t ev;
    if (isthmus_cq_wait(cq, &ev, 1, 0, 50000) == 0) continue;
    found += ev.tag == tag;
    if (ev.op == ISTHMUS_OP_NEW_CALL)
      isthmus_server_call_finish(ev.server_call, ISTHMUS_UNIMPLEMENTED, NULL, NULL, NULL);
    else
      event_free(&ev);
  }
  return found;
}

/* isthmus_server_call_done_async is an operation of its queue like the others: its tag is taken
 * until its event is (another operation with it is refused), and isthmus_cq_cancel abandons
 * it: no event comes. Before, the tag was free for another operation meanwhile, and the cancel
 * said NOT_FOUND while the event still came. */
static int check_done_async_takes_its_tag(ctx_t *c) {
  if (!c->shm) return 1; /* a server of its own: once (over shm://) is enough */
  enum { CALLS = 1, DONE = 7 };
  isthmus_status_t *st = NULL;
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  isthmus_server_t *server;
  caller_t caller = {NULL, SVC "Done", "done", ISTHMUS_UNKNOWN, ""};
  if (!own_server("done", NULL, NULL, cq, CALLS, &server, &caller.ch)) {
    isthmus_cq_free(cq);
    return 0;
  }
  int ok = 1;
  for (int round = 0; ok && round < 2; round++) {
    pthread_t t;
    pthread_create(&t, NULL, unary_caller, &caller);
    isthmus_event_t ev;
    size_t n = 0;
    for (double end = now_s() + 30; n == 0 && now_s() < end;) n = isthmus_cq_wait(cq, &ev, 1, 0, 100000);
    if (n != 1 || ev.op != ISTHMUS_OP_NEW_CALL) {
      ok = failf(__LINE__, "no new call in 30 s");
      if (n == 1) event_free(&ev);
      pthread_join(t, NULL);
      break;
    }
    isthmus_server_call_t *call = ev.server_call;
    isthmus_code_t rc = isthmus_server_call_done_async(call, cq, DONE, &st);
    if (rc != ISTHMUS_OK) ok = failf(__LINE__, "done_async: %s", describe(rc, st));
    st = NULL;
    isthmus_event_t now;
    rc = isthmus_server_call_recv_async(call, 0, cq, DONE, &now, &st);
    if (ok && rc != ISTHMUS_INVALID_ARGUMENT)
      ok = failf(__LINE__, "a receive under done_async's pending tag: %s", isthmus_code_name(rc));
    if (st) isthmus_status_free(st);
    st = NULL;
    if (rc == ISTHMUS_OK && now.op != 0) event_free(&now);
    if (round == 0 && ok && isthmus_cq_cancel(cq, DONE) != ISTHMUS_OK)
      ok = failf(__LINE__, "done_async's operation could not be cancelled");
    isthmus_server_call_finish(call, ISTHMUS_OK, NULL, NULL, NULL);
    pthread_join(t, NULL);
    /* Cancelled: no event. Not cancelled: one, and the tag is free again for another use. */
    int events = round == 0 ? events_with_tag(cq, DONE, 0.5, 0) : events_with_tag(cq, DONE, 30, 1);
    if (ok && events != (round == 0 ? 0 : 1))
      ok = failf(__LINE__, "round %d: %d DONE events after the call ended", round, events);
  }
  isthmus_channel_close(caller.ch);
  isthmus_server_free(server);
  isthmus_cq_free(cq);
  return ok;
}

/* A call to a handler whose completion queue was freed fails UNAVAILABLE at once. Before, it
 * waited in the dead queue for its deadline. */
static int check_freed_queue_refuses_calls(ctx_t *c) {
  if (!c->shm) return 1; /* a server of its own: once (over shm://) is enough */
  isthmus_cq_t *cq = isthmus_cq_new();
  REQUIRE(cq != NULL, "a queue");
  isthmus_server_t *server;
  isthmus_channel_t *ch;
  if (!own_server("freedq", NULL, NULL, cq, 1, &server, &ch)) {
    isthmus_cq_free(cq);
    return 0;
  }
  isthmus_cq_free(cq);
  isthmus_status_t *st = NULL;
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(20 * 1000 * 1000);
  double start = now_s();
  isthmus_code_t rc = isthmus_unary(ch, SVC "Nobody", (const uint8_t *)"x", 1, &opts, &reply, NULL, NULL, &st);
  double took = now_s() - start;
  int ok = 1;
  if (rc != ISTHMUS_UNAVAILABLE || took > 10)
    ok = failf(__LINE__, "a call to a freed queue's handler: %s after %.3f s", describe(rc, st), took);
  if (st) isthmus_status_free(st);
  if (reply) isthmus_message_free(reply);
  isthmus_channel_close(ch);
  isthmus_server_free(server);
  return ok;
}

/* Whoami's reply over `ch`, NUL-terminated, into `out`; the call's code. */
static isthmus_code_t whoami(isthmus_channel_t *ch, char *out, size_t cap, isthmus_status_t **st) {
  isthmus_message_t *reply = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  out[0] = 0;
  isthmus_code_t rc = isthmus_unary(ch, SVC "Whoami", NULL, 0, &opts, &reply, NULL, NULL, st);
  if (reply != NULL) {
    size_t len = 0;
    const uint8_t *data = isthmus_message_data(reply, &len);
    snprintf(out, cap, "%.*s", (int)len, (const char *)data);
    isthmus_message_free(reply);
  }
  return rc;
}

/* A handler learns who called: over shm:// the client's pid and uid, over unix:// the socket,
 * over http:// the client's address and port; no TLS and no certificate. */
static int check_whoami(ctx_t *c) {
  isthmus_status_t *st = NULL;
  char got[512], want[128];
  MUST(whoami(c->ch, got, sizeof got, &st));
  if (c->shm)
    snprintf(want, sizeof want, "tls=0 cert=0 peer=shm:pid=%ld,uid=%ld", (long)getpid(), (long)getuid());
  else if (strncmp(c->target, "http://127.0.0.1:", 17) == 0)
    snprintf(want, sizeof want, "tls=0 cert=0 peer=ipv4:127.0.0.1:");
  else
    snprintf(want, sizeof want, "tls=0 cert=0 peer=unix:");
  REQUIRE(strncmp(got, want, strlen(want)) == 0, "'%s' starts with '%s'", got, want);
  return 1;
}

/* A channel to `target` with `opts`; NULL (and `g_why` says why) if refused. */
static isthmus_channel_t *channel_with(const char *target, const isthmus_channel_options_t *opts) {
  isthmus_channel_t *ch = NULL;
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = isthmus_channel_new(target, opts, &ch, &st);
  if (rc != ISTHMUS_OK) failf(__LINE__, "channel_new: %s", describe(rc, st));
  return ch;
}

/* Calls Whoami on a channel with `flags` until its calls come over shm:// (a handler sees a pid)
 * or `seconds` pass: 1 if they moved, 0 if not, -1 on a failed call. */
static int moves_to_shm(const char *target, uint32_t flags, double seconds, unsigned long long *shm_calls) {
  isthmus_channel_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.flags = flags;
  isthmus_channel_t *ch = channel_with(target, &opts);
  if (ch == NULL) return -1;
  isthmus_status_t *st = NULL;
  char got[512];
  int moved = 0;
  for (double end = now_s() + seconds; !moved && now_s() < end;) {
    isthmus_code_t rc = whoami(ch, got, sizeof got, &st);
    if (rc != ISTHMUS_OK) {
      failf(__LINE__, "Whoami with flags %u: %s", flags, describe(rc, st));
      isthmus_channel_close(ch);
      return -1;
    }
    moved = strstr(got, "peer=shm:pid=") != NULL;
    if (!moved) sleep_ms(5);
  }
  isthmus_stats_t stats;
  memset(&stats, 0, sizeof stats);
  isthmus_channel_stats(ch, &stats, sizeof stats);
  *shm_calls = (unsigned long long)stats.calls_started;
  isthmus_channel_close(ch);
  return moved;
}

/* Whether this process's channels move to shared memory unless told: as the library reads
 * ISTHMUS_UPGRADE. */
static int upgrade_on_by_default(void) {
  const char *v = getenv("ISTHMUS_UPGRADE");
  return !(v && (strcmp(v, "0") == 0 || strcasecmp(v, "off") == 0 || strcasecmp(v, "false") == 0));
}

/* A channel's flags decide whether its HTTP/2 address moves to the server's shm:// endpoint,
 * whatever ISTHMUS_UPGRADE says; without one, the variable decides. A channel that moved counts
 * its calls over shm:// in its stats. */
static int check_upgrade_flags(ctx_t *c) {
  isthmus_channel_options_t opts;
  memset(&opts, 0, sizeof opts);
  isthmus_channel_t *ch = NULL;
  isthmus_status_t *st = NULL;
  opts.flags = ISTHMUS_CHANNEL_UPGRADE | ISTHMUS_CHANNEL_NO_UPGRADE;
  INVALID(isthmus_channel_new(c->target, &opts, &ch, &st));
  opts.flags = 1u << 30; /* a newer header's flag: refused, not dropped */
  INVALID(isthmus_channel_new(c->target, &opts, &ch, &st));
  REQUIRE(ch == NULL, "no channel for refused flags");
  if (c->shm) return 1; /* nothing to move */

  double began = now_s();
  unsigned long long shm_calls = 0;
  int moved = moves_to_shm(c->target, ISTHMUS_CHANNEL_UPGRADE, 20.0, &shm_calls);
  if (moved < 0) return 0;
  REQUIRE(moved == 1, "ISTHMUS_CHANNEL_UPGRADE: still on HTTP/2 after 20 s");
  REQUIRE(shm_calls >= 1, "a moved channel's stats count its shm:// calls");
  /* What never moves is watched for three times as long as moving took, and 1 s more. */
  double watch = (now_s() - began) * 3 + 1.0;
  moved = moves_to_shm(c->target, ISTHMUS_CHANNEL_NO_UPGRADE, watch, &shm_calls);
  if (moved < 0) return 0;
  REQUIRE(moved == 0 && shm_calls == 0, "ISTHMUS_CHANNEL_NO_UPGRADE: moved to shm://");
  moved = moves_to_shm(c->target, 0, upgrade_on_by_default() ? 20.0 : watch, &shm_calls);
  if (moved < 0) return 0;
  REQUIRE(moved == upgrade_on_by_default(), "no flag, ISTHMUS_UPGRADE=%s: moved %d",
          getenv("ISTHMUS_UPGRADE") ? getenv("ISTHMUS_UPGRADE") : "(unset)", moved);
  return 1;
}

typedef struct {
  const char *name;
  int (*run)(ctx_t *c);
} check_t;

static const check_t CHECKS[] = {
    {"abi_version", check_abi_version},
    {"code_names", check_code_names},
    {"null_arguments", check_null_arguments},
    {"double_free", check_double_free},
    {"metadata_rules", check_metadata_rules},
    {"stats", check_stats},
    {"upgrade_flags", check_upgrade_flags},
    {"topic", check_topic},
    {"unary_metadata", check_unary_metadata},
    {"unary_64mib", check_unary_64mib},
    {"too_large", check_too_large},
    {"server_stream_1000", check_server_stream},
    {"client_stream", check_client_stream},
    {"bidi_two_threads", check_bidi_threads},
    {"headers_beside_a_receive", check_headers_beside_a_receive},
    {"fail_status", check_fail},
    {"deadline", check_deadline},
    {"cancel", check_cancel},
    {"abandoned_send_cancels_its_call", check_abandoned_send_cancels_its_call},
    {"zero_copy_block", check_zero_copy},
    {"block_reply", check_block_reply},
    {"reply", check_reply},
    {"unary_block", check_unary_block},
    {"async_unary_100", check_async_unary},
    {"async_bidi", check_async_bidi},
    {"queued", check_queued},
    {"bad_finish", check_bad_finish},
    {"unimplemented", check_unimplemented},
    {"bad_target", check_bad_target},
    {"connectivity", check_connectivity},
    {"whoami", check_whoami},
    {"cq_free_wakes_waiter", check_cq_free_wakes_a_waiter},
    {"fork_keeps_queues_apart", check_fork_keeps_queues_apart},
    {"shutdown_twice", check_shutdown_twice_at_once},
    {"take_call", check_take_call},
    {"free_waits_for_callbacks", check_free_waits_for_callbacks},
    {"done_async_takes_its_tag", check_done_async_takes_its_tag},
    {"freed_queue_refuses_calls", check_freed_queue_refuses_calls},
};


/* ---- TLS ---- */

/* The TLS files of `client-tls`, and the address of the serve-tls server. */
static const char *g_tls_dir, *g_tls_address;

/* A channel to the TLS server with `tls`'s settings; NULL (and `g_why` says why) if refused. */
static isthmus_channel_t *tls_channel(const isthmus_tls_options_t *tls) {
  isthmus_channel_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.tls = tls;
  return channel_with(g_tls_address, &opts);
}

/* The settings of a client that trusts `ca` and, with `cert`, shows that certificate. */
typedef struct {
  isthmus_tls_options_t tls;
  char *files[3];
} tls_files_t;

static int tls_files(tls_files_t *t, const char *ca, const char *cert, const char *key) {
  memset(t, 0, sizeof *t);
  const char *names[3] = {ca, cert, key};
  for (int i = 0; i < 3; i++) {
    if (names[i] != NULL && (t->files[i] = read_file(g_tls_dir, names[i])) == NULL)
      return failf(__LINE__, "cannot read %s/%s", g_tls_dir, names[i]);
  }
  t->tls.root_certs_pem = t->files[0];
  t->tls.cert_chain_pem = t->files[1];
  t->tls.private_key_pem = t->files[2];
  return 1;
}

static void tls_files_free(tls_files_t *t) {
  for (int i = 0; i < 3; i++) free(t->files[i]);
}

/* With the server's CA and a client certificate it trusts, calls succeed, and the handler sees
 * TLS, the certificate and the client's address. */
static int check_tls_mutual(ctx_t *c) {
  (void)c;
  tls_files_t t;
  if (!tls_files(&t, "ca.crt", "client.crt", "client.key")) return 0;
  isthmus_channel_t *ch = tls_channel(&t.tls);
  tls_files_free(&t); /* the channel copied them */
  if (ch == NULL) return 0;
  isthmus_status_t *st = NULL;
  char got[512];
  isthmus_code_t rc = whoami(ch, got, sizeof got, &st);
  isthmus_channel_close(ch);
  if (rc != ISTHMUS_OK) return failf(__LINE__, "Whoami: %s", describe(rc, st));
  unsigned cert = 0;
  REQUIRE(sscanf(got, "tls=1 cert=%u peer=ipv4:127.0.0.1:", &cert) == 1 && cert > 100 &&
              strstr(got, "peer=ipv4:127.0.0.1:") != NULL,
          "'%s': TLS, a certificate, the client's address", got);
  return 1;
}

/* A call over `tls` fails UNAVAILABLE, and its message contains `why`. */
static int tls_call_fails(const isthmus_tls_options_t *tls, const char *why) {
  isthmus_channel_t *ch = tls_channel(tls);
  if (ch == NULL) return 0;
  isthmus_status_t *st = NULL;
  char got[512];
  isthmus_code_t rc = whoami(ch, got, sizeof got, &st);
  isthmus_channel_close(ch);
  const char *message = st ? isthmus_status_message(st) : "";
  int ok = rc == ISTHMUS_UNAVAILABLE && strstr(message, why) != NULL;
  if (!ok) failf(__LINE__, "%s: %s, not UNAVAILABLE naming '%s'", got, describe(rc, st), why);
  else if (st) isthmus_status_free(st);
  return ok;
}

static int check_tls_no_client_cert(ctx_t *c) {
  (void)c;
  tls_files_t t;
  if (!tls_files(&t, "ca.crt", NULL, NULL)) return 0;
  int ok = tls_call_fails(&t.tls, "");
  tls_files_free(&t);
  return ok;
}

static int check_tls_wrong_ca(ctx_t *c) {
  (void)c;
  tls_files_t t;
  if (!tls_files(&t, "other-ca.crt", "client.crt", "client.key")) return 0;
  int ok = tls_call_fails(&t.tls, "certificate");
  tls_files_free(&t);
  return ok;
}

static int check_tls_server_name(ctx_t *c) {
  (void)c;
  tls_files_t t;
  if (!tls_files(&t, "ca.crt", "client.crt", "client.key")) return 0;
  t.tls.server_name = "elsewhere.example";
  int ok = tls_call_fails(&t.tls, "certificate");
  tls_files_free(&t);
  return ok;
}

/* A channel to `target` with `tls` is refused INVALID_ARGUMENT, with `named` (unless NULL) in
 * the status's message (else `g_why` says what it got). */
static int channel_refused(const char *target, const isthmus_tls_options_t *tls, const char *what,
                           const char *named) {
  isthmus_channel_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.tls = tls;
  isthmus_channel_t *ch = NULL;
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = isthmus_channel_new(target, &opts, &ch, &st);
  if (ch != NULL) isthmus_channel_close(ch);
  if (rc != ISTHMUS_INVALID_ARGUMENT || st == NULL) return failf(__LINE__, "%s: %s", what, describe(rc, st));
  int ok = named == NULL || strstr(isthmus_status_message(st), named) != NULL;
  if (!ok) failf(__LINE__, "%s: '%s' does not name %s", what, isthmus_status_message(st), named);
  isthmus_status_free(st);
  return ok;
}

/* A server with `tls` fails to start INVALID_ARGUMENT, with `named` (unless NULL) in the
 * status's message. */
static int server_refused(const isthmus_tls_options_t *tls, const char *what, const char *named) {
  const char *target = "https://127.0.0.1:0";
  isthmus_server_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.tls = tls;
  isthmus_server_t *server = isthmus_server_new(&opts);
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = isthmus_server_start(server, &target, 1, &st);
  int ok = rc == ISTHMUS_INVALID_ARGUMENT && st != NULL;
  if (!ok) {
    failf(__LINE__, "%s: start gave %s", what, describe(rc, st));
  } else {
    ok = named == NULL || strstr(isthmus_status_message(st), named) != NULL;
    if (!ok) failf(__LINE__, "%s: '%s' does not name %s", what, isthmus_status_message(st), named);
    isthmus_status_free(st);
  }
  if (rc == ISTHMUS_OK) isthmus_server_shutdown(server, 0);
  isthmus_server_free(server);
  return ok;
}

/* Settings that cannot work are refused when given (a server's when it starts), not at the
 * first call. */
static int check_tls_bad_settings(ctx_t *c) {
  (void)c;
  tls_files_t t;
  if (!tls_files(&t, "ca.crt", "client.crt", "client.key")) return 0;
  isthmus_tls_options_t not_pem = t.tls, no_key = t.tls, server_only = t.tls, no_identity = t.tls,
                        client_only = t.tls, bad_base64 = t.tls, bad_key = t.tls;
  not_pem.root_certs_pem = "not a certificate";
  no_key.private_key_pem = NULL;
  server_only.require_client_cert = 1;
  no_identity.cert_chain_pem = no_identity.private_key_pem = NULL;
  client_only.server_name = "localhost";
  bad_base64.cert_chain_pem = "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n";
  bad_key.private_key_pem = "not a key";
  int ok = channel_refused(g_tls_address, &not_pem, "roots that are no PEM", "tls.root_certs_pem") &&
           channel_refused(g_tls_address, &no_key, "a certificate without its key", NULL) &&
           channel_refused(g_tls_address, &bad_key, "a key that is no PEM", "tls.private_key_pem") &&
           channel_refused(g_tls_address, &server_only, "require_client_cert on a channel", NULL) &&
           channel_refused("shm://tls-makes-no-sense", &t.tls, "TLS over shm://", NULL) &&
           channel_refused("unix:///tmp/tls-makes-no-sense.sock", &t.tls, "TLS over unix://", NULL) &&
           server_refused(&no_identity, "a server without a certificate", NULL) &&
           server_refused(&client_only, "server_name on a server", NULL) &&
           server_refused(&bad_base64, "a certificate that is no base64", "tls.cert_chain_pem");
  tls_files_free(&t);
  return ok;
}

static const check_t TLS_CHECKS[] = {
    {"tls_mutual", check_tls_mutual},
    {"tls_no_client_cert", check_tls_no_client_cert},
    {"tls_wrong_ca", check_tls_wrong_ca},
    {"tls_server_name", check_tls_server_name},
    {"tls_bad_settings", check_tls_bad_settings},
};

/* Runs `checks` over a channel to `target` (no channel for TLS checks, which make their own). */
static int run_checks(const char *target, const check_t *checks, size_t count, int own_channel) {
  ctx_t c = {target, strncmp(target, "shm:", 4) == 0, NULL};
  int passed = 0, failed = 0;
  isthmus_status_t *st = NULL;
  isthmus_code_t rc = own_channel ? isthmus_channel_new(target, NULL, &c.ch, &st) : ISTHMUS_OK;
  if (rc != ISTHMUS_OK) {
    printf("FAIL channel_new: %s\n0 passed, 1 failed\n", describe(rc, st));
    return 1;
  }
  for (size_t i = 0; i < count; i++) {
    const check_t *check = &checks[i];
    size_t before = isthmus_live_handles();
    double start = now_s();
    g_why[0] = 0;
    int ok = check->run(&c);
    size_t after = isthmus_live_handles();
    if (ok && after != before) {
      snprintf(g_why, sizeof g_why, "%zu handles left behind", after - before);
      ok = 0;
    }
    if (ok) {
      passed++;
      printf("ok   %-20s %.3f s\n", check->name, now_s() - start);
    } else {
      failed++;
      printf("FAIL %-20s %s\n", check->name, g_why);
    }
    fflush(stdout);
  }
  /* every handle freed: the channel last */
  rc = own_channel ? isthmus_channel_close(c.ch) : ISTHMUS_OK;
  size_t live = isthmus_live_handles();
  if (rc == ISTHMUS_OK && live == 0) {
    passed++;
    printf("ok   %-20s\n", "all_handles_freed");
  } else {
    failed++;
    printf("FAIL %-20s close: %s, %zu handles live\n", "all_handles_freed", isthmus_code_name(rc), live);
  }
  printf("%d passed, %d failed\n", passed, failed);
  fflush(stdout);
  return failed != 0;
}

/* The call the harness's SIGKILL of the server must end with UNAVAILABLE. */
static int peer_gone(const char *target) {
  isthmus_status_t *st = NULL;
  isthmus_channel_t *ch = NULL;
  isthmus_call_t *call = NULL;
  isthmus_message_t *msg = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_code_t rc = isthmus_channel_new(target, NULL, &ch, &st);
  if (rc == ISTHMUS_OK) rc = isthmus_call_start(ch, SVC "Sleep", &opts, &call, &st);
  if (rc != ISTHMUS_OK) {
    printf("peer-gone: no call: %s\n", describe(rc, st));
    return 1;
  }
  printf("waiting\n");
  fflush(stdout);
  double start = now_s();
  st = NULL;
  rc = isthmus_call_recv(call, &msg, &st);
  double waited = now_s() - start;
  printf("peer-gone: %s after %.3f s\n", describe(rc, st), waited);
  fflush(stdout);
  if (msg) isthmus_message_free(msg);
  isthmus_call_free(call);
  isthmus_channel_close(ch);
  size_t live = isthmus_live_handles();
  if (live != 0) printf("peer-gone: %zu handles live\n", live);
  return rc != ISTHMUS_UNAVAILABLE || live != 0;
}

/* One unary echo of `text` through `unary` (the linked library's or a loaded copy's). */
typedef isthmus_code_t (*unary_fn)(const isthmus_channel_t *, const char *, const uint8_t *, size_t,
                                   const isthmus_call_options_t *, isthmus_message_t **, isthmus_metadata_t **,
                                   isthmus_metadata_t **, isthmus_status_t **);

/* The library loaded a second time from another path (`copy`, with RTLD_LOCAL, as a plugin
   host loads a library two plugins ship): each copy has its own runtime, handles and queues,
   and calls through both, interleaved, work; handles of one are not the other's. */
static int second_copy(const char *copy, const char *target) {
  void *lib = dlopen(copy, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    printf("second-copy: dlopen: %s\n", dlerror());
    return 1;
  }
  isthmus_code_t (*channel_new)(const char *, const isthmus_channel_options_t *, isthmus_channel_t **,
                                isthmus_status_t **);
  isthmus_code_t (*channel_close)(isthmus_channel_t *);
  unary_fn unary2;
  size_t (*message_len)(const isthmus_message_t *);
  isthmus_code_t (*message_free)(isthmus_message_t *);
  size_t (*live_handles)(void);
  *(void **)&channel_new = dlsym(lib, "isthmus_channel_new");
  *(void **)&channel_close = dlsym(lib, "isthmus_channel_close");
  *(void **)&unary2 = dlsym(lib, "isthmus_unary");
  *(void **)&message_len = dlsym(lib, "isthmus_message_len");
  *(void **)&message_free = dlsym(lib, "isthmus_message_free");
  *(void **)&live_handles = dlsym(lib, "isthmus_live_handles");
  if (!channel_new || !channel_close || !unary2 || !message_len || !message_free || !live_handles) {
    printf("second-copy: a symbol is missing: %s\n", dlerror());
    return 1;
  }
  if ((void *)unary2 == (void *)isthmus_unary) {
    printf("second-copy: %s resolved to the linked library, not a copy\n", copy);
    return 1;
  }
  isthmus_status_t *st = NULL;
  isthmus_channel_t *mine = NULL, *theirs = NULL;
  isthmus_call_options_t opts = timeout_opts(CALL_TIMEOUT_US);
  isthmus_code_t rc = isthmus_channel_new(target, NULL, &mine, &st);
  if (rc == ISTHMUS_OK) rc = channel_new(target, NULL, &theirs, &st);
  if (rc != ISTHMUS_OK) {
    printf("second-copy: no channel: %s\n", describe(rc, st));
    return 1;
  }
  int failed = 0;
  for (int i = 0; i < 20 && !failed; i++) {
    isthmus_message_t *a = NULL, *b = NULL;
    rc = isthmus_unary(mine, SVC "Unary", (const uint8_t *)"linked", 6, &opts, &a, NULL, NULL, &st);
    if (rc == ISTHMUS_OK) rc = unary2(theirs, SVC "Unary", (const uint8_t *)"copy!!!", 7, &opts, &b, NULL, NULL, &st);
    if (rc != ISTHMUS_OK) {
      printf("second-copy: call %d: %s\n", i, describe(rc, st));
      failed = 1;
    } else if (isthmus_message_len(a) != 6 || message_len(b) != 7) {
      printf("second-copy: call %d: replies of %zu and %zu bytes\n", i, isthmus_message_len(a), message_len(b));
      failed = 1;
    }
    if (a) isthmus_message_free(a);
    if (b) message_free(b);
  }
  /* A handle of the copy means nothing to the linked library (its registry is its own). */
  if (!failed && isthmus_channel_close(theirs) != ISTHMUS_INVALID_ARGUMENT) {
    printf("second-copy: the linked library closed the copy's channel\n");
    failed = 1;
  }
  if (channel_close(theirs) != ISTHMUS_OK || isthmus_channel_close(mine) != ISTHMUS_OK) failed = 1;
  if (live_handles() != 0 || isthmus_live_handles() != 0) {
    printf("second-copy: handles live: %zu in the copy, %zu linked\n", live_handles(), isthmus_live_handles());
    failed = 1;
  }
  /* Not dlclose'd: the copy's runtime threads run its code until the process exits. */
  printf(failed ? "second-copy: FAIL\n" : "second-copy: ok\n");
  return failed;
}

static int client(const char *target) { return run_checks(target, CHECKS, sizeof CHECKS / sizeof CHECKS[0], 1); }

static const check_t UPGRADE_CHECKS[] = {{"upgrade_flags", check_upgrade_flags}};

static int client_tls(const char *dir, const char *address) {
  g_tls_dir = dir;
  g_tls_address = address;
  return run_checks(address, TLS_CHECKS, sizeof TLS_CHECKS / sizeof TLS_CHECKS[0], 0);
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "serve") == 0) return serve(argc - 2, argv + 2, NULL);
  if (argc >= 4 && strcmp(argv[1], "serve-tls") == 0) return serve(argc - 3, argv + 3, argv[2]);
  if (argc == 3 && strcmp(argv[1], "client") == 0) return client(argv[2]);
  if (argc == 4 && strcmp(argv[1], "client-tls") == 0) return client_tls(argv[2], argv[3]);
  if (argc == 3 && strcmp(argv[1], "client-upgrade") == 0)
    return run_checks(argv[2], UPGRADE_CHECKS, sizeof UPGRADE_CHECKS / sizeof UPGRADE_CHECKS[0], 0);
  if (argc == 3 && strcmp(argv[1], "peer-gone") == 0) return peer_gone(argv[2]);
  if (argc == 4 && strcmp(argv[1], "second-copy") == 0) return second_copy(argv[2], argv[3]);
  fprintf(stderr, "usage: %s serve TARGET... | client TARGET | client-upgrade TARGET | peer-gone TARGET | "
                  "second-copy LIBRARY TARGET | serve-tls DIR TARGET... | client-tls DIR ADDRESS\n", argv[0]);
  return 2;
}
