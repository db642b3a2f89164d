//! tonic services answering calls that arrive over `shm://` (and HTTP/2 calls that reach the
//! server's handlers through the loopback). `add_service` puts a generated server in a
//! `tonic::service::Routes`, the router tonic's own server uses for the HTTP/2 endpoints, and keeps
//! it boxed (`BoxService`) under its `NamedService::NAME`, which also names it to the health
//! service. `ServiceHandler::serve` calls that service directly: it is a handler like any other,
//! run inside the call's future, first polled on the reader task, under the call's span, deadline,
//! cancel signal and `CatchPanic`, and counted.
//!
//! 1. The request is an `http::Request<RequestBody>`: `POST`, HTTP/2, the method path as URI,
//!    `content-type: application/grpc`, `te: trailers`, `grpc-timeout` with the time remaining, and
//!    the call's metadata as headers. `RequestBody` takes the call's request side (a later
//!    `ServerCall::recv` is FAILED_PRECONDITION) and reads it as `recv` does: a message over 1 KiB
//!    becomes its prefix, then the message's own `Bytes` (a view into the client's arena for a
//!    large one); a smaller one is copied behind its prefix into one frame, cheaper than a second
//!    allocation. Credit goes back as for every call. The half-close ends the body; the call's end
//!    is a body error with the same code and message.
//! 2. The deadline is the engine's: `supervise` drops the service's future when it passes
//!    (DEADLINE_EXCEEDED). `grpc-timeout` only tells the service how long it has.
//! 3. A status in the response's headers (trailers-only: an error before any message, or tonic's
//!    UNIMPLEMENTED for a method it lacks) ends the call with it. Otherwise the headers are the
//!    initial metadata. Over HTTP/2 the headers leave as soon as the service's future returns, and
//!    a client may wait for them before it sends, so the bridge polls the body once: if its first
//!    frame is not ready, HEADERS goes at once, even empty; if it is, HEADERS goes only when the
//!    metadata is not empty, else the first MESSAGE implies it.
//! 4. The data frames are deframed (no limit of its own: the service's `max_encoding_message_size`
//!    applies before), each message sliced when it lies whole in one frame, and sent with
//!    `ServerCall::try_send_now` (no wait: a small message, with credit and ring room), else
//!    `ServerCall::send`: one copy, into shared memory. The trailers become the status: OK with its
//!    metadata as trailing metadata, else the code with its message, details and metadata. A body
//!    that fails, or ends without trailers, is INTERNAL ("the service's response failed: …").
//!    A unary response goes in two frames (MESSAGE, then TRAILERS), not inside the TRAILERS as
//!    `send_last` would put it: holding it for the trailers measured 4.6-5.0 µs for a 64 B
//!    `tonic-isthmus-shm` call against 4.2-4.4 µs, since the client's tonic side starts on the
//!    message while the status is on its way (8-12 % more calls/s with 32 in flight, though).
//!
//! The service's own message limits apply over `shm://` as over HTTP/2: tonic decodes at most 4 MiB
//! by default, so raise both limits on the generated server and client for larger messages
//! (`tonic-peer` and the benchmark use 64 MiB).
//!
//! Speed, for whoever works on this path: at 64 B the engine alone costs ~1.9 µs of a tonic call
//! over `shm://`, tonic's client side ~1.2 µs and its service side ~1.2 µs (request and response
//! types, header maps, codec buffers: about 60 allocations per call across both processes),
//! measured with `isthmus-bench profile-rpc` and its split systems. At 16 MiB tonic itself copies
//! each message four times per echo (`EncodeBody` encodes into a fresh `BytesMut` on each side;
//! `Streaming` appends every data frame to its own buffer on each side), ~0.6–0.9 ms each; with the
//! two copies into shared memory that is 3.6–5.4 ms, against the ~3.5–4 ms that 5× tonic-over-UDS
//! allows. Reaching 5× needs tonic to pass a whole message through without copying, not a faster
//! transport.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderValue;
use http_body::{Body, Frame};
use tower_service::Service;

use super::codec::{self, Deframer};
use crate::engine::server::{Requests, ServerCall};
use crate::status::{Code, Status};
use crate::MetadataMap;

/// The request messages of an `shm://` call as a gRPC body for a tonic service: each message's
/// prefix, then the message itself (a view into shared memory for a large one).
struct RequestBody {
    requests: Option<Requests>,
    pending: Option<Bytes>,
}

/// The call's end as tonic's status, so a service reading the request sees CANCELLED, not
/// UNKNOWN, when the client cancels.
fn to_tonic(status: Status) -> tonic::Status {
    tonic::Status::new(tonic::Code::from_i32(status.code() as i32), status.message().to_owned())
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(m) = self.pending.take() {
            return Poll::Ready(Some(Ok(Frame::data(m))));
        }
        let Some(requests) = self.requests.as_mut() else { return Poll::Ready(None) };
        let frame = match ready!(requests.poll_recv(cx)) {
            Ok(Some(m)) => codec::framed(m).map(|(data, rest)| {
                self.pending = rest;
                Frame::data(data)
            }),
            Ok(None) => {
                self.requests = None;
                return Poll::Ready(None);
            }
            Err(status) => {
                self.requests = None;
                Err(status)
            }
        };
        Poll::Ready(Some(frame.map_err(to_tonic)))
    }
}

/// A tonic service (a generated `FooServer`, the health or the reflection service), boxed.
pub(crate) type BoxService = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    std::convert::Infallible,
>;

/// Answers `shm://` calls with one tonic service.
#[derive(Clone)]
pub(crate) struct ServiceHandler(pub(crate) BoxService);

impl ServiceHandler {
    /// Runs one call through the service: the call's request becomes an `http::Request` as
    /// gRPC over HTTP/2 would deliver it, and the response's messages and trailers go back as
    /// the call's messages and status.
    ///
    /// The future is allocated per call: nothing large (the request, the response's parts) is
    /// held across an await, so that it stays small.
    pub(crate) async fn serve(self, mut call: ServerCall) -> Result<(), Status> {
        let mut service = self.0;
        let _ = std::future::poll_fn(|cx| service.poll_ready(cx)).await;
        let response = match service.call(http_request(&mut call)?).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let (metadata, body) = match split_response(response)? {
            Answer::Messages(metadata, body) => (metadata, body),
            Answer::TrailersOnly(status) => return finish(&call, status),
        };
        let mut body = std::pin::pin!(body);
        // Over HTTP/2 the response headers leave as soon as the service returns, and a client
        // may wait for them before it sends (a bidi call). Send them at once unless the first
        // message is ready too, which then carries empty metadata implicitly.
        let first = {
            let mut first = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx));
            match super::tonic_client::poll_once(&mut first).await {
                Some(frame) => {
                    if !metadata.is_empty() {
                        Box::pin(call.send_headers(metadata)).await?;
                    }
                    frame
                }
                None => {
                    Box::pin(call.send_headers(metadata)).await?;
                    first.await
                }
            }
        };
        let mut deframer = Deframer::new(usize::MAX);
        let mut next = first;
        while let Some(frame) = next.take() {
            let frame = frame.map_err(|e: tonic::Status| {
                Status::new(Code::Internal, format!("the service's response failed: {e}"))
            })?;
            match frame.into_data() {
                Ok(data) => {
                    deframer.push(data);
                    // Straight onto the ring when that takes no wait (a small message, credit,
                    // room): the future of a send that waits, boxed, keeps every call's small.
                    while let Some(m) = deframer.next()? {
                        if !call.try_send_now(&m) {
                            Box::pin(call.send(&m)).await?;
                        }
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let status = codec::status_from(&trailers).unwrap_or_else(|| {
                            Status::new(Code::Internal, "the service's trailers have no grpc-status")
                        });
                        return finish(&call, status);
                    }
                }
            }
            next = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
        }
        Err(Status::new(Code::Internal, "the service's response ended without a status"))
    }
}

/// The call's request as gRPC over HTTP/2 would deliver it to the service.
fn http_request(call: &mut ServerCall) -> Result<http::Request<tonic::body::Body>, Status> {
    let body = tonic::body::Body::new(RequestBody { requests: call.take_requests(), pending: None });
    let mut request = http::Request::new(body);
    *request.method_mut() = http::Method::POST;
    *request.version_mut() = http::Version::HTTP_2;
    *request.uri_mut() = http::Uri::try_from(call.path())
        .map_err(|e| Status::new(Code::InvalidArgument, format!("method path {:?}: {e}", call.path())))?;
    let headers = request.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
    if let Some(left) = call.time_remaining() {
        headers.insert(codec::GRPC_TIMEOUT, codec::timeout_value(left));
    }
    codec::metadata_into(call.metadata(), headers);
    // The caller's agent, which the metadata keeps from being sent on, is this request's own
    // header, as over HTTP/2.
    if let Some(agent) = call.metadata().get_bin("user-agent").and_then(|a| HeaderValue::from_bytes(a).ok()) {
        headers.insert(http::header::USER_AGENT, agent);
    }
    Ok(request)
}

/// How a service's response begins.
enum Answer {
    /// Initial metadata, then a body of messages and trailers.
    Messages(MetadataMap, tonic::body::Body),
    /// A trailers-only response: the status is in the headers.
    TrailersOnly(Status),
}

fn split_response(response: http::Response<tonic::body::Body>) -> Result<Answer, Status> {
    let (parts, body) = response.into_parts();
    if let Some(status) = codec::status_from(&parts.headers) {
        return Ok(Answer::TrailersOnly(status));
    }
    Ok(Answer::Messages(codec::metadata_from(&parts.headers)?, body))
}

/// Ends the call with the service's status: OK carries its metadata as trailers; tonic's
/// refusal of a message over the service's limit (OUT_OF_RANGE) goes as gRPC's
/// RESOURCE_EXHAUSTED, in tonic's words, which name the size and the limit.
fn finish(call: &ServerCall, status: Status) -> Result<(), Status> {
    if status.code() == Code::Ok {
        call.set_trailers(status.metadata().clone());
        Ok(())
    } else {
        Err(codec::too_large_code(status))
    }
}
