//! tonic services answering calls that arrive over `shm://`.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderValue;
use http_body::{Body, Frame};
use tower_service::Service;

use super::codec::{self, Deframer};
use crate::engine::server::{Requests, ServerCall};
use crate::status::{Code, Status};

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
    pub(crate) async fn serve(self, mut call: ServerCall) -> Result<(), Status> {
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
            headers.insert(http::HeaderName::from_static("grpc-timeout"), codec::timeout_value(left));
        }
        codec::metadata_into(call.metadata(), headers);

        let mut service = self.0;
        let _ = std::future::poll_fn(|cx| service.poll_ready(cx)).await;
        let response = match service.call(request).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let (parts, body) = response.into_parts();
        // A trailers-only response: the status is in the headers.
        if let Some(status) = codec::status_from(&parts.headers) {
            return finish(&call, status);
        }
        let metadata = codec::metadata_from(&parts.headers)?;
        let mut body = std::pin::pin!(body);
        // Over HTTP/2 the response headers leave as soon as the service returns, and a client
        // may wait for them before it sends (a bidi call). Send them at once unless the first
        // message is ready too, which then carries empty metadata implicitly.
        let first = {
            let mut first = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx));
            match super::tonic_client::poll_once(&mut first).await {
                Some(frame) => {
                    if !metadata.is_empty() {
                        call.send_headers(metadata).await?;
                    }
                    frame
                }
                None => {
                    call.send_headers(metadata).await?;
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
                    while let Some(m) = deframer.next()? {
                        call.send(&m).await?;
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

/// Ends the call with the service's status: OK carries its metadata as trailers.
fn finish(call: &ServerCall, status: Status) -> Result<(), Status> {
    if status.code() == Code::Ok {
        call.set_trailers(status.metadata().clone());
        Ok(())
    } else {
        Err(status)
    }
}
