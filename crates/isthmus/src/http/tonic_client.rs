//! [`Channel`] as a tower service: the transport under tonic-generated clients. It is a
//! `Service<http::Request<B>>` for any body of `Bytes`; the response is
//! `http::Response<ResponseBody>` and the error `Infallible`: every failure arrives as a gRPC
//! status in the response, as from a server. `poll_ready` is always ready; the generated client's
//! own settings (its message limits, say) stay tonic's.
//!
//! Over `shm://` a request becomes an engine call:
//!
//! 1. Its metadata and `grpc-timeout` become the `CallOptions` (`wait_for_ready` off); the URI's
//!    path is the method. A header that does not decode gives a response carrying only its status.
//! 2. `Begun::read` takes what the body has ready (at most two frames, deframed with no limit
//!    of this side's: a channel's `max_message_size` is on what it receives, and tonic's
//!    encoder has its own; the server's bridge holds requests to the server's limit). A unary
//!    request, which tonic hands over whole, is one
//!    message and then the end: `Channel::start_shm_with` connects if need be and sends it inside
//!    the call's HEADERS, with what is left of the deadline (one frame, ADR 0025; a request too
//!    large for that frame goes after it). A body that fails before the call starts fails it
//!    CANCELLED ("the request stream failed: …") and the server never sees it. (A call an
//!    upgraded channel may hand back to HTTP/2 reads nothing first: its body must stay whole.)
//! 3. Otherwise `pump` sends the rest of the body from where that stopped: it holds one message
//!    back until it knows whether another follows, so the last goes with END_STREAM in one frame;
//!    a body that ends with none held half-closes with an empty TRAILERS. It is polled once right
//!    there, on the caller's task. If it must wait (a streaming request, or no credit) it
//!    continues as a spawned task sending through a `SendHalf`. A body that fails ends the call on
//!    both sides CANCELLED ("the request stream failed: …"); one that ends inside a message
//!    INTERNAL (`Mux::abandon`). If the call ends first, the pump stops, and drops the body even
//!    while it waits for the application's next request.
//! 4. The response is returned once the server's initial metadata arrives (a HEADERS, or the first
//!    MESSAGE), with `content-type: application/grpc` and the metadata. A call that fails before
//!    then gives a trailers-only response: the status in its headers, and an empty body.
//! 5. [`ResponseBody`] yields for each message a data frame with the 5-byte prefix, then the
//!    message's own `Bytes` (for a large one a view into the server's arena; tonic's decoder copies
//!    it), and at the end the status as trailers (none after a trailers-only response). It
//!    reads through `ShmCall::poll_recv`, so deadline and WINDOW grants work as for any call.
//!    Dropping it before the end drops the call, which sends CANCEL. Its `Source` is `Shm` (the
//!    call), `Http` (tonic's body, with its `CancelOnDrop`) or `Done`.
//!
//! Over `unix://` and `http://` the service passes each request to tonic's channel unchanged and
//! wraps the response body; a request its connection never carried to the server goes again
//! (`retry.rs`). tonic enforces the deadline only until the response's headers; the
//! body ends DEADLINE_EXCEEDED if it has not ended when `grpc-timeout` runs out, and is dropped,
//! which resets the stream (below). tonic's client's `TimeoutExpired`, and
//! a plain tonic server's trailers-only CANCELLED "Timeout expired", are both reported
//! DEADLINE_EXCEEDED ("Deadline Exceeded", grpc-core's words). Other transport errors get
//! `tonic::Status::from_error`'s code (a refused connection: UNAVAILABLE), but for a connection
//! that breaks under a response body (the server died), which tonic calls UNKNOWN: UNAVAILABLE
//! here, as gRPC names it. Once the deadline has passed, any failure is DEADLINE_EXCEEDED
//! (`passed`): the server's reset at its own copy of the deadline (grpc-go's CANCEL, which
//! grpc-go's client reads so too) may come before the timer here fires, and whatever broke
//! after the deadline, the call had run out of time. `counters()` are zero.
//!
//! Cancelling over HTTP/2: hyper resets a stream only once both halves are dropped, so a response
//! dropped while the request stream is open (a bidi call given up midway) would leave the server's
//! call running. Each request body is wrapped in `Cancellable`: when the `ResponseBody` (or the
//! call's future) is dropped early, the body fails with an `h2::Error` of reason CANCEL, and hyper
//! resets the stream with it, as gRPC clients do. tonic hands the service such a request stream as
//! its plain end (`None`).
//!
//! A tonic client's call returns only when the server's initial metadata arrives, so a client that
//! sends its first request only after that waits on a handler that sends none first (the server
//! side sends HEADERS early for tonic services; a raw Rust handler must call `send_headers`; a Go
//! or Python handler that reads first sends none, as grpc-go's and grpcio's do not).

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame};

use super::codec::{self, Deframer};
use super::retry::{self, Replayable};
use crate::call::CallOptions;
use crate::engine::client::{SendHalf, ShmCall};
use crate::status::{Code, Status};
use crate::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a response from a [`Channel`] used as a tower service: each response message
/// (prefix, then the message's own bytes), then the status as trailers; empty for a
/// trailers-only response, whose status is in its headers. Dropping it before the end cancels
/// the call.
pub struct ResponseBody(Source);

/// Where a response body's frames come from.
// The shm:// call is the common case, held inline: boxing it would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
enum Source {
    /// A call over `shm://`, with the message whose prefix was just yielded, and the encoding
    /// its messages are compressed with (the server's loopback only, [`Loopback`]).
    Shm { call: ShmCall, pending: Option<Bytes>, compress: Option<codec::Encoding> },
    /// tonic's HTTP/2 body (a `unix://` or `http://` channel), passed through; `cancel` resets
    /// the stream if the body is dropped before its end, and `deadline` (the request's
    /// `grpc-timeout`) ends it DEADLINE_EXCEEDED if it has not ended by then.
    Http { body: tonic::body::Body, cancel: CancelOnDrop, deadline: Option<Pin<Box<tokio::time::Sleep>>> },
    /// Over.
    Done,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").field("open", &!matches!(self.0, Source::Done)).finish()
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = match &mut self.0 {
            Source::Done => return Poll::Ready(None),
            // tonic bounds only the wait for the response's headers: the rest of a streaming
            // call is bounded here, also while frames keep coming (a clock read each), and the
            // timer wakes a body that waits. Dropping the body (below) resets the stream.
            Source::Http { deadline, .. } if passed(deadline) => {
                Frame::trailers(codec::status_trailers(&Status::deadline_exceeded()))
            }
            Source::Http { body, cancel, deadline } => match Pin::new(body).poll_frame(cx) {
                // A server resets the stream as its copy of the deadline passes (grpc-go's
                // sends CANCEL), which may come before the timer here fires: the call ended by
                // its deadline (grpc-go's client reads such a CANCEL so), not UNAVAILABLE. Any
                // failure past the deadline is read so: the call had run out of time.
                Poll::Ready(Some(Err(_))) if passed(deadline) => {
                    Frame::trailers(codec::status_trailers(&Status::deadline_exceeded()))
                }
                Poll::Ready(mut frame) => {
                    if frame.as_ref().is_none_or(|f| f.as_ref().is_ok_and(|f| f.is_trailers())) {
                        cancel.disarm(); // the call is over: nothing left to cancel
                    }
                    if let Some(Ok(Some(trailers))) = frame.as_mut().map(|f| f.as_mut().map(Frame::trailers_mut)) {
                        codec::conform_status(trailers);
                    }
                    return Poll::Ready(frame.map(|r| r.map_err(body_error)));
                }
                Poll::Pending => match deadline.as_mut().map(|d| d.as_mut().poll(cx)) {
                    Some(Poll::Ready(())) => Frame::trailers(codec::status_trailers(&Status::deadline_exceeded())),
                    _ => return Poll::Pending,
                },
            },
            Source::Shm { pending: pending @ Some(_), .. } => {
                return Poll::Ready(pending.take().map(|m| Ok(Frame::data(m))));
            }
            Source::Shm { call, pending, compress } => match ready!(call.poll_recv(cx)) {
                Ok(Some(m)) => {
                    let framed = match *compress {
                        Some(encoding) => codec::framed_compressed(&m, encoding).map(|data| (data, None)),
                        None => codec::framed(m),
                    };
                    match framed {
                        Ok((data, rest)) => {
                            *pending = rest;
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        Err(status) => Frame::trailers(codec::status_trailers(&status)),
                    }
                }
                Ok(None) => Frame::trailers(match call.status_message() {
                    // The rare OK with words (grpcio's `set_details`) keeps them.
                    Some(m) if !m.is_empty() => codec::status_trailers(
                        &Status::new(Code::Ok, m.to_owned())
                            .with_metadata(call.trailers().cloned().unwrap_or_default()),
                    ),
                    _ => codec::ok_trailers(call.trailers()),
                }),
                Err(status) => Frame::trailers(codec::status_trailers(&status)),
            },
        };
        // Trailers end the body; the call (if any) is done with.
        self.0 = Source::Done;
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Source::Http { body, .. } => body.is_end_stream(),
            Source::Done => true,
            _ => false,
        }
    }
}

/// An HTTP/2 response body's failure as the status tonic's decoder reports: tonic names a
/// connection that broke under the body (the server died: an I/O error, no HTTP/2 reason)
/// UNKNOWN, which gRPC calls UNAVAILABLE, as the engine's own calls do (`status_from_tonic`).
/// Errors with a reason keep tonic's code for it (REFUSED_STREAM is UNAVAILABLE, CANCEL
/// CANCELLED...).
fn body_error(status: tonic::Status) -> BoxError {
    match status.code() {
        tonic::Code::Unknown if std::error::Error::source(&status).is_some() => {
            Box::new(tonic::Status::unavailable(status.message().to_owned()))
        }
        _ => Box::new(status),
    }
}

/// tonic's server answers a deadline that passed with CANCELLED "Timeout expired" (a
/// trailers-only response, made outside any layer we could add there); gRPC's code for it is
/// DEADLINE_EXCEEDED, which is what this channel reports.
fn deadline_code(headers: &mut HeaderMap) {
    let expired = headers.get(codec::GRPC_STATUS).is_some_and(|c| c == "1")
        && headers.get(codec::GRPC_MESSAGE).is_some_and(|m| m == "Timeout expired" || m == "Timeout%20expired");
    if expired {
        headers.insert(codec::GRPC_STATUS, HeaderValue::from_static("4"));
        headers.insert(codec::GRPC_MESSAGE, HeaderValue::from_static(crate::status::DEADLINE_EXCEEDED));
    }
}

/// Whether a response is gRPC's: by its content type, as grpc-go tells (`application/grpc`,
/// `+…` or `;…`), whatever its HTTP status; a gRPC server's own refusals (HTTP 415 or 405)
/// carry their `grpc-status`.
fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|c| super::endpoint::is_grpc_content_type(c.as_bytes()))
}

/// The status of a response that is not gRPC's, as grpc-go gives it (PROTOCOL-HTTP2, "HTTP to
/// gRPC Status Code Mapping"): the code its HTTP status maps to, UNKNOWN for any other (200
/// among them), and what was wrong in grpc-go's words. tonic read such a body (a proxy's error
/// page) as gRPC messages: INTERNAL "invalid compression flag", or a wait for bytes that never
/// came.
fn not_grpc<B>(response: &http::Response<B>) -> Status {
    let http = response.status();
    let code = match http.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    };
    let content_type = match response.headers().get(http::header::CONTENT_TYPE) {
        Some(c) => format!("transport: received unexpected content-type {:?}", String::from_utf8_lossy(c.as_bytes())),
        None => "malformed header: missing HTTP content-type".to_owned(),
    };
    let reason = http.canonical_reason().unwrap_or("");
    Status::new(
        code,
        format!("unexpected HTTP status code received from server: {} ({reason}); {content_type}", http.as_u16()),
    )
}

/// Whether a call's deadline (its timer) has passed, fired or not.
fn passed(deadline: &Option<Pin<Box<tokio::time::Sleep>>>) -> bool {
    deadline.as_ref().is_some_and(|d| d.deadline() <= tokio::time::Instant::now())
}

/// Whether an HTTP/2 transport error is tonic's client-side deadline.
fn timed_out(e: &(dyn std::error::Error + 'static)) -> bool {
    super::cause::<tonic::TimeoutExpired>(e).is_some()
}

/// Sends the cancel for an HTTP/2 call when dropped, unless disarmed first.
struct CancelOnDrop(Option<tokio::sync::oneshot::Sender<()>>);

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            let _ = cancel.send(());
        }
    }
}

/// A request body that fails with CANCELLED once its call's response is dropped unfinished.
struct Cancellable<B> {
    body: Pin<Box<B>>,
    cancelled: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl<B> Body for Cancellable<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(rx) = self.cancelled.as_mut() {
            match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(())) => {
                    // hyper resets the stream with the reason it finds in the error: CANCEL, as
                    // gRPC clients cancel (it would say INTERNAL_ERROR otherwise).
                    return Poll::Ready(Some(Err(Box::new(h2::Error::from(h2::Reason::CANCEL)))));
                }
                // Disarmed: the call finished, nothing will cancel it any more.
                Poll::Ready(Err(_)) => self.cancelled = None,
                Poll::Pending => {}
            }
        }
        self.body.as_mut().poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
}

/// A response that carries only a status (the call failed before the server answered): gRPC's
/// trailers-only form, the status in the headers and no body, so that the server's bridge sends
/// one HEADERS with END_STREAM, as gRPC servers do for a call that fails before it answers (sent
/// as HEADERS and then TRAILERS, a client took the first for initial metadata).
fn failed_response(status: Status) -> http::Response<ResponseBody> {
    let mut response = http::Response::new(ResponseBody(Source::Done));
    grpc_headers(response.headers_mut());
    response.headers_mut().extend(codec::status_trailers(&status));
    response
}

/// The headers every response from shared memory starts with: gRPC's content type, and the
/// encodings this side reads (`codec::Encoding`).
fn grpc_headers(headers: &mut HeaderMap) {
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(codec::GRPC_ACCEPT_ENCODING, HeaderValue::from_static(codec::ACCEPT_ENCODING));
}

/// Runs `fut` for one poll here; `None` if it has to wait.
pub(super) async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *fut).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

/// A request body's start, read before its call starts. A unary request, which tonic hands over
/// whole, is one message and then the body's end: it goes inside the call's HEADERS (one frame,
/// ADR 0025). Anything else goes on as [`pump`] sends it, from where this reading stopped.
struct Begun {
    deframer: Deframer,
    /// The first message, cut and not sent.
    held: Option<Bytes>,
    /// A frame polled already and not yet deframed.
    frame: Option<Option<Result<Frame<Bytes>, BoxError>>>,
    /// The body has ended (it must not be polled again).
    ended: bool,
}

impl Begun {
    /// Nothing read yet. A server's bridge reads requests (a client's has no limit on them).
    fn new(limit: usize, encoding: Option<codec::Encoding>) -> Begun {
        let deframer = Deframer::new(limit).for_server().with_encoding(encoding);
        Begun { deframer, held: None, frame: None, ended: false }
    }

    /// What `body` has ready now (polled with the caller's `cx`, never waiting): at most two
    /// frames, the second only after a first that held exactly one whole message. Not `async`:
    /// a future of its own would sit inside every tonic call's.
    fn read<B>(
        body: &mut Pin<Box<B>>,
        cx: &mut Context<'_>,
        limit: usize,
        encoding: Option<codec::Encoding>,
    ) -> Result<Begun, Status>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let mut begun = Begun::new(limit, encoding);
        let Poll::Ready(first) = poll_next_frame(body, cx) else { return Ok(begun) };
        match first {
            None => begun.ended = true,
            Some(Err(e)) => return Err(request_failed(&*e)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    begun.deframer.push(data);
                    begun.held = begun.deframer.next()?;
                }
                if begun.held.is_some() && begun.deframer.is_empty() {
                    match poll_next_frame(body, cx) {
                        Poll::Ready(None) => begun.ended = true,
                        Poll::Ready(second) => begun.frame = Some(second),
                        Poll::Pending => {}
                    }
                }
            }
        }
        Ok(begun)
    }

    /// The request's only message, if it is whole: one message, then the end.
    fn whole(&self) -> Option<&Bytes> {
        self.held.as_ref().filter(|_| self.ended && self.deframer.is_empty())
    }
}

/// The next frame of `body`, its error boxed at once (the body's own error type need not be
/// `Send`).
fn next_frame<B>(body: &mut Pin<Box<B>>) -> impl Future<Output = Option<Result<Frame<Bytes>, BoxError>>> + Unpin + '_
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    std::future::poll_fn(move |cx| poll_next_frame(body, cx))
}

/// [`next_frame`]'s one poll.
fn poll_next_frame<B>(body: &mut Pin<Box<B>>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    body.as_mut().poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::<BoxError>::into)))
}

fn request_failed(e: &(dyn std::error::Error + Send + Sync)) -> Status {
    Status::new(Code::Cancelled, format!("the request stream failed: {e}"))
}

/// Sends a request body's messages on the call, from where [`Begun::read`] stopped. The last
/// message goes with the half-close in one frame, which needs to know it is the last: a message
/// is held until the body says whether more follow.
async fn pump<B>(body: Pin<Box<B>>, begun: Begun, sender: SendHalf)
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    // A request that cannot be sent whole fails the call, on both sides.
    if let Err(Stop::Failed(status)) = pump_messages(body, begun, &sender).await {
        sender.fail(status);
    }
}

/// Why a request stopped being sent.
enum Stop {
    /// The call is over already; its status reaches the caller through the response.
    CallOver,
    /// The request itself is at fault.
    Failed(Status),
}

impl From<Status> for Stop {
    fn from(s: Status) -> Stop {
        Stop::Failed(s)
    }
}

async fn pump_messages<B>(mut body: Pin<Box<B>>, begun: Begun, sender: &SendHalf) -> Result<(), Stop>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let Begun { mut deframer, mut held, mut frame, mut ended } = begun;
    let closed = |()| Stop::CallOver;
    // Messages cut from the first frame beyond the first.
    while let Some(m) = deframer.next()? {
        if let Some(prev) = held.replace(m) {
            sender.send(&prev, false).await.map_err(closed)?;
        }
    }
    while !ended {
        let next = match frame.take() {
            Some(f) => f,
            None => {
                let mut next = next_frame(&mut body);
                match poll_once(&mut next).await {
                    Some(f) => f,
                    None => {
                        if let Some(m) = held.take() {
                            sender.send(&m, false).await.map_err(closed)?;
                        }
                        // The body is the application's stream, fed for as long as it likes:
                        // once the call is over it is let go (dropped with this task), as
                        // hyper lets it go once the server ended the stream.
                        tokio::select! {
                            biased;
                            f = next => f,
                            () = sender.closed() => return Err(Stop::CallOver),
                        }
                    }
                }
            }
        };
        match next {
            None => ended = true,
            Some(Err(e)) => return Err(request_failed(&*e).into()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    deframer.push(data);
                    while let Some(m) = deframer.next()? {
                        if let Some(prev) = held.replace(m) {
                            sender.send(&prev, false).await.map_err(closed)?;
                        }
                    }
                }
            }
        }
    }
    if !deframer.is_empty() {
        return Err(Status::new(Code::Internal, "the request body ended inside a message").into());
    }
    match held {
        Some(m) => sender.send(&m, true).await.map_err(closed),
        None => sender.close().await.map_err(closed),
    }
}

impl Channel {
    /// A request over `shm://` that is not handed back; `replies` for the server's bridge (see
    /// [`call_shm`](Self::call_shm)).
    async fn call_http<B>(
        self,
        request: http::Request<B>,
        replies: Option<codec::ReplyCompression>,
        request_limit: usize,
    ) -> http::Response<ResponseBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match self.call_shm(request, false, replies, request_limit).await {
            Ok(response) => response,
            Err(_) => failed_response(Status::new(Code::Internal, "a call was handed back without a reason")),
        }
    }

    /// Carries a tonic request over `shm://`. With `hand_back`, a call whose start fails
    /// UNAVAILABLE (the connection is gone, so the server never saw it) is handed back
    /// untouched, for HTTP/2 to carry (an upgraded channel, `upgrade.rs`). `replies`, for a
    /// server's bridge only, says how to compress the replies; it also takes the handler's choice
    /// out of the reply's metadata. A request message over `request_limit` bytes fails the call
    /// RESOURCE_EXHAUSTED before it starts: the server's own limit on the bridge, none for a
    /// client (the channel's limit is on what it receives).
    async fn call_shm<B>(
        self,
        request: http::Request<B>,
        hand_back: bool,
        replies: Option<codec::ReplyCompression>,
        request_limit: usize,
    ) -> Result<http::Response<ResponseBody>, http::Request<Pin<Box<B>>>>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let options = match (codec::metadata_from(&parts.headers), codec::timeout_from(&parts.headers)) {
            (Ok(metadata), Ok(timeout)) => CallOptions { metadata, timeout, ..CallOptions::default() },
            (Err(s), _) | (_, Err(s)) => return Ok(failed_response(s)),
        };
        let encoding = match codec::Encoding::from_headers(&parts.headers) {
            Ok(encoding) => encoding,
            // A compression HTTP/2 may carry and `shm://` does not read (tonic's zstd): a call
            // that may go back to HTTP/2 does, as it did before the move.
            Err(_) if hand_back => return Err(http::Request::from_parts(parts, Box::pin(body))),
            Err(s) => return Ok(failed_response(s)),
        };
        // Requests are usually whole already (a unary call's one message): one that is goes
        // inside the call's HEADERS; the rest is sent here, and what must wait for more of a
        // streaming request gets a task of its own.
        let mut body = Box::pin(body);
        let limit = request_limit;
        // A call that may be handed back must leave its body as it was.
        let begun = match hand_back {
            true => Begun::new(limit, encoding),
            false => match std::future::poll_fn(|cx| Poll::Ready(Begun::read(&mut body, cx, limit, encoding))).await {
                Ok(begun) => begun,
                Err(status) => return Ok(failed_response(status)),
            },
        };
        let first = begun.whole().map(|m| &m[..]);
        let mut call = match self.start_shm_with(parts.uri.path(), options, first).await {
            Ok((call, true)) => call,
            Ok((call, false)) => {
                let mut sending = Box::pin(pump(body, begun, call.send_half()));
                if poll_once(&mut sending).await.is_none() {
                    tokio::spawn(sending);
                }
                call
            }
            Err(status) if hand_back && status.code() == Code::Unavailable => {
                return Err(http::Request::from_parts(parts, body))
            }
            Err(status) => return Ok(failed_response(status)),
        };
        Ok(match std::future::poll_fn(|cx| call.poll_headers(cx)).await {
            Err(status) => failed_response(status),
            Ok(mut metadata) => {
                let compress = replies.and_then(|r| {
                    let chosen = metadata.remove(crate::http::endpoint::REPLY_ENCODING_HEADER);
                    r.choose(chosen.as_deref())
                });
                let mut headers = HeaderMap::new();
                grpc_headers(&mut headers);
                codec::metadata_into(&metadata, &mut headers);
                if let Some(encoding) = compress {
                    headers.insert(codec::GRPC_ENCODING, HeaderValue::from_static(encoding.name()));
                }
                let mut response = http::Response::new(ResponseBody(Source::Shm { call, pending: None, compress }));
                *response.headers_mut() = headers;
                response
            }
        })
    }
}

/// A server's way to its own handlers for HTTP/2 calls (ADR 0007): its loopback `Channel`,
/// compressing the replies with `replies` (`Server::send_compressed`), or as each handler
/// chooses, for each client whose `grpc-accept-encoding` lists the encoding
/// ([`codec::ReplyCompression`]).
///
/// The channel takes replies of any size (the limit a server is given is on what it receives);
/// requests are held to `max_request`, the server's limit, before they reach its `shm://` side.
#[derive(Clone)]
pub(crate) struct Loopback {
    pub(crate) channel: Channel,
    pub(crate) replies: Option<codec::Encoding>,
    pub(crate) max_request: usize,
}

impl Loopback {
    /// Answers one HTTP/2 call through the loopback (the server's fallback service).
    pub(crate) async fn call<B>(
        self,
        request: http::Request<B>,
    ) -> Result<http::Response<ResponseBody>, std::convert::Infallible>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let replies = codec::ReplyCompression::new(self.replies, request.headers());
        let mut response = self.channel.call_http(request, Some(replies), self.max_request).await;
        response.extensions_mut().insert(FromHandler);
        Ok(response)
    }
}

/// Marks a response of the server's handlers (through its [`Loopback`]): its status is the
/// handler's own, which the HTTP/2 endpoint passes on as it is (`endpoint::TooLargeLayer`
/// gives gRPC's code to tonic services' refusals only).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FromHandler;

/// A `Channel` carries tonic's requests: `FooClient::new(channel)` works for any generated
/// client. Failures arrive as gRPC statuses in the response, as from any gRPC server.
impl<B> tower_service::Service<http::Request<B>> for Channel
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<ResponseBody>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // An HTTP/2 channel that moved to shared memory (`upgrade.rs`) sends the call there.
        if let Some((h2, connections)) = self.http() {
            let connections = connections.clone();
            if let Some((shm, to)) = self.route() {
                let http = self.without_upgrade();
                return Box::pin(async move {
                    let began = tokio::time::Instant::now();
                    match shm.call_shm(request, true, None, usize::MAX).await {
                        Ok(response) => Ok(response),
                        Err(mut request) => {
                            http.upgrade_lost(&to);
                            // With what is left of its deadline, not all of it again.
                            if let Ok(Some(t)) = codec::timeout_from(request.headers()) {
                                if !time_left(request.headers_mut(), t, began) {
                                    return Ok(failed_response(Status::deadline_exceeded()));
                                }
                            }
                            over_http(h2, connections, request).await
                        }
                    }
                });
            }
            return over_http(h2, connections, request);
        }
        // Mapped, not awaited in a block of its own, which would hold the request beside the
        // future that took it: this future is allocated and moved whole for every call.
        Box::pin(futures_util::FutureExt::map(self.clone().call_http(request, None, usize::MAX), Ok))
    }
}

/// Puts what is left of `timeout`, counted from `since`, in a request's `grpc-timeout` (a call
/// that goes again, or another way); false if nothing is left (the call is past its deadline).
fn time_left(headers: &mut http::HeaderMap, timeout: std::time::Duration, since: tokio::time::Instant) -> bool {
    let left = timeout.saturating_sub(since.elapsed());
    if !left.is_zero() {
        headers.insert(codec::GRPC_TIMEOUT, codec::timeout_value(left));
    }
    !left.is_zero()
}

/// A request carried by tonic's own HTTP/2 channel as it is (unix:// and http://, and a call an
/// upgraded channel handed back). `connections`: what the channel's connector sees of them.
fn over_http<B>(
    mut http: tonic::transport::Channel,
    connections: std::sync::Arc<crate::connectivity::Tracker>,
    request: http::Request<B>,
) -> Pin<Box<dyn Future<Output = Result<http::Response<ResponseBody>, std::convert::Infallible>> + Send>>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    // A malformed grpc-timeout is tonic's to refuse; here it bounds nothing.
    let timeout = codec::timeout_from(&parts.headers).ok().flatten();
    // hyper resets an HTTP/2 stream only once both its halves are dropped; a response
    // dropped while the request stream is still open would leave the server's call
    // running. The request body ends with CANCELLED instead, which resets it.
    let (cancel, cancelled) = tokio::sync::oneshot::channel();
    let body = Replayable::new(Cancellable { body: Box::pin(body), cancelled: Some(cancelled) });
    let cancel = CancelOnDrop(Some(cancel));
    Box::pin(async move {
        let start = tokio::time::Instant::now();
        let deadline = timeout.map(|t| Box::pin(tokio::time::sleep(t)));
        // A call its connection never carried to the server goes again (`retry.rs`), with the
        // time left of its deadline.
        let (mut view, mut attempt) = (body.first(), 1);
        let sent = loop {
            // An attempt whose body has ended already goes as tonic's empty body, which hyper
            // never asks: it is not watched (`retry.rs`).
            let watched = attempt < retry::ATTEMPTS && !view.is_end_stream();
            let mut ends = connections.ends();
            let mut request = http::Request::new(tonic::body::Body::new(view));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            *request.extensions_mut() = parts.extensions.clone();
            if let Some(t) = timeout.filter(|_| attempt > 1) {
                if !time_left(request.headers_mut(), t, start) {
                    return Ok(failed_response(Status::deadline_exceeded()));
                }
            }
            let mut sent = std::pin::pin!(async {
                tower::ServiceExt::ready(&mut http).await?;
                tower_service::Service::call(&mut http, request).await
            });
            // A connection that closed and left the channel none may hold this attempt in its
            // queue, never to send it (`retry.rs`): an attempt no connection took goes again.
            let given_up = loop {
                tokio::select! {
                    biased;
                    sent = &mut sent => break Err(sent),
                    Ok(()) = ends.changed(), if watched => {
                        if connections.get() == crate::connectivity::Connectivity::Ready {
                            continue;
                        }
                        if let Some(next) = body.again_if_untaken() {
                            break Ok(next);
                        }
                    }
                }
            };
            match given_up {
                Ok(next) => (view, attempt) = (next, attempt + 1),
                Err(Err(e)) if attempt < retry::ATTEMPTS && retry::never_processed(&e) => match body.again() {
                    Some(next) => (view, attempt) = (next, attempt + 1),
                    None => break Err(e),
                },
                Err(sent) => {
                    body.done();
                    break sent;
                }
            }
        };
        Ok(match sent {
            // Not a gRPC response (a proxy's error page): its body is not read, and dropping
            // it (and `cancel`) resets the stream.
            Ok(response) if !is_grpc(response.headers()) => failed_response(not_grpc(&response)),
            Ok(mut response) => {
                deadline_code(response.headers_mut());
                codec::conform_status(response.headers_mut());
                response.map(|body| ResponseBody(Source::Http { body, cancel, deadline }))
            }
            // tonic's own reading of its errors: a deadline that passed is
            // DEADLINE_EXCEEDED, a refused connection UNAVAILABLE. So is any failure once
            // the deadline has passed: the server's reset at its deadline may come first.
            Err(e) if timed_out(&e) || passed(&deadline) => {
                // tonic reports its own deadline as CANCELLED; gRPC's code is this one.
                failed_response(Status::deadline_exceeded())
            }
            Err(e) => {
                // A TLS failure says which (an unknown CA, no client certificate…).
                let tls = crate::http::tls::describe(&e);
                let causes = crate::http::call::with_causes(&e.to_string(), &e);
                let went_away = retry::went_away(&e);
                let reset = retry::reset_by_peer(&e);
                let t = tonic::Status::from_error(Box::new(e));
                // No response at all: the request could not be carried (the server hung
                // up or died before answering), which gRPC calls UNAVAILABLE; tonic names
                // such transport errors UNKNOWN.
                // hyper's "operation was canceled" is a request its connection dropped
                // (the server went away), not a cancel of ours: ours drops this future.
                let code = match t.code() {
                    // The server reset the stream with CANCEL (a handler that panicked, say):
                    // gRPC's CANCELLED, as tonic and grpc-go read it, not a retry-safe
                    // UNAVAILABLE for a call the server may have run.
                    _ if reset == Some(h2::Reason::CANCEL) => Code::Cancelled,
                    tonic::Code::Unknown | tonic::Code::Cancelled => Code::Unavailable,
                    // A GOAWAY that left the call out, which tonic calls INTERNAL.
                    _ if went_away => Code::Unavailable,
                    other => Code::from_u32(other as u32),
                };
                match tls {
                    Some(why) => failed_response(Status::new(Code::Unavailable, why)),
                    // grpc-go's words for it (tonic's are "h2 protocol error: http2 error").
                    None if code == Code::Cancelled => {
                        failed_response(Status::new(code, "stream terminated by RST_STREAM with error code: CANCEL"))
                    }
                    // tonic words a broken connection by its outermost error ("http2
                    // error"); what broke is further down ("keep-alive timed out").
                    None if code == Code::Unavailable => failed_response(Status::new(code, causes)),
                    None => {
                        failed_response(Status::new(code, t.message().to_owned()).with_details(t.details().to_vec()))
                    }
                }
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the fake server below answers on each path: responses a gRPC client meets from
    /// proxies and from other implementations' servers.
    fn answer(path: &str, respond: &mut h2::server::SendResponse<Bytes>) -> Result<(), h2::Error> {
        let head = |status: u16, content_type: &str| {
            http::Response::builder().status(status).header("content-type", content_type).body(()).expect("head")
        };
        let grpc = |trailers: &[(&'static str, &'static str)]| {
            let mut response = head(200, "application/grpc");
            for (k, v) in trailers {
                response.headers_mut().insert(*k, HeaderValue::from_static(v));
            }
            response
        };
        match path {
            "/t.S/Page" => {
                let mut body = respond.send_response(head(502, "text/html"), false)?;
                body.send_data(Bytes::from_static(b"<html>502 Bad Gateway</html>"), true)
            }
            "/t.S/PageOk" => {
                let mut body = respond.send_response(head(200, "text/html"), false)?;
                body.send_data(Bytes::from_static(b"<html>hello</html>"), true)
            }
            "/t.S/NoSuchPage" => respond.send_response(head(404, "text/plain"), true).map(drop),
            "/t.S/BadDetails" => {
                respond.send_response(grpc(&[("grpc-status", "3"), ("grpc-status-details-bin", "!!!")]), true).map(drop)
            }
            "/t.S/BadDetailsInTrailers" => {
                let mut body = respond.send_response(head(200, "application/grpc"), false)?;
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("3"));
                trailers.insert("grpc-status-details-bin", HeaderValue::from_static("QR=="));
                body.send_trailers(trailers)
            }
            "/t.S/Reset" => {
                respond.send_reset(h2::Reason::CANCEL);
                Ok(())
            }
            "/t.S/NotUtf8" => {
                respond.send_response(grpc(&[("grpc-status", "5"), ("grpc-message", "caf%E9")]), true).map(drop)
            }
            _ => respond.send_response(grpc(&[("grpc-status", "12")]), true).map(drop),
        }
    }

    /// A server that answers every request at once by its path (`answer`), its body unread.
    async fn fake_server(listener: tokio::net::TcpListener) {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(socket).await else { return };
                while let Some(Ok((request, mut respond))) = connection.accept().await {
                    let _ = answer(request.uri().path(), &mut respond);
                }
            });
        }
    }

    /// Responses that are not gRPC's, or whose status headers tonic cannot read, end the call
    /// as grpc-go ends it: a proxy's error page with the code its HTTP status maps to (it was
    /// INTERNAL "invalid compression flag"); details that are not base64 dropped (tonic
    /// panicked on them, in trailers-only headers and in trailers alike); a message that is
    /// not UTF-8 kept, with its code (it became UNKNOWN); a reset with CANCEL before any
    /// response is CANCELLED, as tonic reads it (it was a retry-safe UNAVAILABLE).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_tonic_reads_strictly_ends_a_call_as_grpc_go_ends_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let port = listener.local_addr().expect("its address").port();
        let server = tokio::spawn(fake_server(listener));
        let channel = crate::Channel::builder(&format!("http://127.0.0.1:{port}"))
            .upgrade(false)
            .connect()
            .await
            .expect("a channel");
        let options = || CallOptions { timeout: Some(std::time::Duration::from_secs(20)), ..Default::default() };
        let mut got = Vec::new();
        for path in ["Page", "PageOk", "NoSuchPage", "BadDetails", "BadDetailsInTrailers", "NotUtf8", "Reset"] {
            // On a task of its own: a panic (tonic's, before) fails the test, not the runtime.
            let (channel, path_of_call) = (channel.clone(), format!("/t.S/{path}"));
            let call = async move { channel.unary(&path_of_call, b"", options()).await };
            let status = tokio::spawn(call).await.expect("no panic").expect_err("a failed call");
            got.push((path, status.code(), status.message().to_owned(), status.details().len()));
        }
        server.abort();
        let page = "unexpected HTTP status code received from server: 502 (Bad Gateway); \
                    transport: received unexpected content-type \"text/html\"";
        let ok_page = "unexpected HTTP status code received from server: 200 (OK); \
                       transport: received unexpected content-type \"text/html\"";
        let not_found = "unexpected HTTP status code received from server: 404 (Not Found); \
                         transport: received unexpected content-type \"text/plain\"";
        let reset = "stream terminated by RST_STREAM with error code: CANCEL";
        assert_eq!(
            got,
            [
                ("Page", Code::Unavailable, page.to_owned(), 0),
                ("PageOk", Code::Unknown, ok_page.to_owned(), 0),
                ("NoSuchPage", Code::Unimplemented, not_found.to_owned(), 0),
                ("BadDetails", Code::InvalidArgument, String::new(), 0),
                ("BadDetailsInTrailers", Code::InvalidArgument, String::new(), 0),
                ("NotUtf8", Code::NotFound, "caf\u{FFFD}".to_owned(), 0),
                ("Reset", Code::Cancelled, reset.to_owned(), 0),
            ]
        );
    }
}
