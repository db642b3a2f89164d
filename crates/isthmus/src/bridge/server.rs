//! tonic services answering calls that arrive over `shm://`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderValue;
use http_body::{Body, Frame};
use tower_service::Service;

use super::codec::{self, Deframer};
use crate::flow::Consumed;
use crate::mux::{Event, Mux, StreamShared};
use crate::server::ServerCall;
use crate::status::{Code, Status};
use crate::wire;

/// The request messages of an `shm://` call as a gRPC body for a tonic service.
struct RequestBody {
    shared: Arc<StreamShared>,
    mux: Arc<Mux>,
    id: u64,
    consumed: Consumed,
    pending: Option<Bytes>,
    done: bool,
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
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let event = ready!(self.shared.inbox.poll_recv(cx));
            match event {
                Some(Event::Message(m)) => {
                    let this = &mut *self;
                    if let Some(grant) = this.consumed.take(m.len(), &this.shared.recv_window) {
                        let body = wire::encode_window(grant);
                        let now = Some(std::time::Instant::now());
                        if this.mux.sender.send(isthmus_shm::Kind::Window, 0, this.id, &body, now).is_err() {
                            this.consumed.undo(grant, &this.shared.recv_window);
                        }
                    }
                    let prefix = match codec::prefix(m.len()) {
                        Ok(p) => p,
                        Err(status) => return Poll::Ready(Some(Err(to_tonic(status)))),
                    };
                    self.pending = Some(m);
                    return Poll::Ready(Some(Ok(Frame::data(prefix))));
                }
                Some(Event::HalfClose) => self.done = true,
                Some(Event::Headers(_)) => {}
                Some(Event::End(status)) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(to_tonic(status))));
                }
                None => {
                    self.done = true;
                    return Poll::Ready(Some(Err(tonic::Status::cancelled("the call was cancelled"))));
                }
            }
        }
    }
}

/// Answers `shm://` calls with the tonic services registered on a server.
#[derive(Clone)]
pub(crate) struct RoutesHandler(pub(crate) tonic::service::Routes);

impl RoutesHandler {
    /// Runs one call through the services: the call's request becomes an `http::Request` as
    /// gRPC over HTTP/2 would deliver it, and the response's messages and trailers go back as
    /// the call's messages and status.
    pub(crate) async fn serve(self, mut call: ServerCall) -> Result<(), Status> {
        let body = RequestBody {
            shared: call.stream.shared.clone(),
            mux: call.mux.clone(),
            id: call.stream.id,
            consumed: Consumed::default(),
            pending: None,
            done: false,
        };
        let mut request = http::Request::new(body);
        *request.method_mut() = http::Method::POST;
        *request.version_mut() = http::Version::HTTP_2;
        *request.uri_mut() = http::Uri::try_from(call.path())
            .map_err(|e| Status::new(Code::InvalidArgument, format!("method path {:?}: {e}", call.path())))?;
        let headers = request.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Some(left) = call.time_remaining() {
            headers.insert("grpc-timeout", codec::timeout_value(left));
        }
        codec::metadata_into(call.metadata(), headers);

        let mut routes = self.0;
        let _ = std::future::poll_fn(|cx| Service::<http::Request<RequestBody>>::poll_ready(&mut routes, cx)).await;
        let response = match routes.call(request).await {
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
            match super::client::poll_once(&mut first).await {
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
