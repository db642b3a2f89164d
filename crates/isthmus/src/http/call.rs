//! Calls by method path over `unix://` and `http://`: the same call shapes as over `shm://`,
//! carried by tonic's gRPC client on the channel's HTTP/2 connection, messages as raw bytes.
//!
//! A call (`HttpCall`) is `tonic::client::Grpc` with [`BytesCodec`], a pass-through codec that is
//! public for callers who serialise themselves; the path goes as it is.
//! `HttpCall::start` spawns one task that sends the request head and waits for the response to
//! open (headers, or a trailers-only status). Requests go meanwhile through a queue of one message,
//! from which the HTTP/2 body takes them as HTTP/2's flow control allows; `close_send` ends the
//! body. So requests flow before anyone reads, as over `shm://`. `recv` then reads the response
//! stream and, at its end, the trailers.
//!
//! The deadline is the call's: `grpc-timeout` goes with the head and every wait is bounded by it
//! (DEADLINE_EXCEEDED, "Deadline Exceeded"). So is the channel's `close`: a wait ends
//! with the status the close gave, and the call ends so (its stream reset). A status tonic made
//! from a transport error (an UNKNOWN with a source) is reported UNAVAILABLE, as the connection's
//! end is over `shm://`.
//! The largest response message is the channel's `max_message_size` (its builder's `Config`);
//! requests have no limit. `CallOptions::compression` compresses the requests (tonic's
//! `send_compressed`). Dropping or cancelling the call ends the body
//! and resets the stream: the server sees CANCELLED. Each request is copied once into a `Bytes`
//! (none if given one, `CallSender::send_bytes`), and tonic's encoder copies it again.

use std::sync::{Arc, Mutex};

use bytes::{Buf, BufMut, Bytes};
use isthmus_shm::MadeIn;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder, Streaming};

use super::codec;
use crate::call::{until, CallOptions};
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// A tonic codec that passes messages through as bytes, for callers that serialize
/// themselves (calls by method path; language bindings; benchmarks).
#[derive(Debug, Clone, Copy, Default)]
pub struct BytesCodec;

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = BytesCodec;
    type Decoder = BytesCodec;

    fn encoder(&mut self) -> BytesCodec {
        BytesCodec
    }

    fn decoder(&mut self) -> BytesCodec {
        BytesCodec
    }
}

impl Encoder for BytesCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for BytesCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The request side of an HTTP/2 call: the body ends once no sender is left.
#[derive(Clone)]
pub(crate) struct Requests(Arc<RequestSide>);

struct RequestSide {
    tx: Mutex<Option<mpsc::Sender<Bytes>>>,
    /// The call's deadline: a send that waits (for the request queue's room, which only the
    /// call's own reading of requests makes) gives up there, as the call does.
    deadline: Option<Instant>,
    /// The fork count the call was made under: in a child forked since, the body that reads
    /// these requests is a task of the parent's runtime, and closing the sender would wake it
    /// (ADR 0030). There nothing is sent, and the sender is forgotten, not dropped.
    made_in: MadeIn,
}

impl Drop for RequestSide {
    fn drop(&mut self) {
        if self.made_in.forked() {
            if let Ok(tx) = self.tx.get_mut() {
                std::mem::forget(tx.take());
            }
        }
    }
}

impl Requests {
    fn new(tx: mpsc::Sender<Bytes>, deadline: Option<Instant>, made_in: MadeIn) -> Requests {
        Requests(Arc::new(RequestSide { tx: Mutex::new(Some(tx)), deadline, made_in }))
    }

    fn sender(&self) -> Option<mpsc::Sender<Bytes>> {
        if self.0.made_in.forked() {
            self.close();
            return None;
        }
        self.0.tx.lock().ok()?.clone()
    }

    pub(crate) fn close(&self) {
        if let Ok(mut tx) = self.0.tx.lock() {
            let tx = tx.take();
            if self.0.made_in.forked() {
                std::mem::forget(tx);
            }
        }
    }

    /// Sends one message; `false` once the call is over or half-closed.
    pub(crate) async fn send(&self, message: Bytes, last: bool) -> bool {
        let Some(tx) = self.sender() else { return false };
        let sent = match self.0.deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, tx.send(message)).await.is_ok_and(|r| r.is_ok()),
            None => tx.send(message).await.is_ok(),
        };
        // Not after a send that timed out: the server would see a clean end without the last
        // message. The call's end (its deadline) resets the stream instead.
        if last && sent {
            self.close();
        }
        sent
    }
}

type Opened = Result<tonic::Response<Streaming<Bytes>>, tonic::Status>;

enum Response {
    /// The request is under way; the task ends when the server's initial metadata (or a
    /// trailers-only status) arrives. A task, so requests flow before anyone reads.
    Opening(JoinHandle<Opened>),
    Open(Box<Streaming<Bytes>>),
    Ended,
}

/// One call over HTTP/2. Dropping it before the end resets the stream: the server sees
/// CANCELLED.
pub(crate) struct HttpCall {
    /// Request messages, taken by the HTTP/2 body as the server's window allows; `None` once
    /// half-closed. Shared with the call's [`Requests`] handles.
    requests: Requests,
    response: Response,
    headers: Option<MetadataMap>,
    trailers: Option<MetadataMap>,
    /// The message of the OK status in the trailers (`grpc-message`), nearly always empty.
    ok_message: String,
    /// How the call ended, once it has: `Ok` with OK, the status otherwise.
    ended: Option<Result<(), Status>>,
    deadline: Option<Instant>,
    /// The largest response message (for telling tonic's refusal of one from a server's).
    limit: usize,
    /// The channel's `close`: the status the call ends with once it is set.
    closed: watch::Receiver<Option<Status>>,
    /// The fork count the call was made under. In a child forked since, the call's tasks and
    /// its connection are the parent runtime's: the call ends UNAVAILABLE when next used, and
    /// what would wake those tasks (an abort, the response body's drop) is forgotten instead
    /// (ADR 0030).
    made_in: MadeIn,
}

impl Drop for HttpCall {
    fn drop(&mut self) {
        if self.made_in.forked() {
            std::mem::forget(std::mem::replace(&mut self.response, Response::Ended));
        } else if let Response::Opening(task) = &self.response {
            task.abort();
        }
    }
}

/// A status from tonic, with its trailers as metadata; `limit` is the call's largest response.
fn status_from_tonic(t: tonic::Status, limit: usize) -> Status {
    let metadata = codec::metadata_from_server(&t.metadata().clone().into_headers());
    // tonic's own refusal of a response over this call's limit (its words with this side's
    // limit in them): the size of the message it refused.
    let refused = (t.code() == tonic::Code::OutOfRange)
        .then(|| codec::tonic_refusal(t.message()))
        .flatten()
        .filter(|&(decoded, _, max)| decoded && max.parse() == Ok(limit))
        .map(|(_, size, _)| size);
    // An UNKNOWN that tonic made from a transport error, not one the server sent: the
    // connection broke, which gRPC calls UNAVAILABLE. tonic keeps the error as its source, or,
    // where the status was copied on the way (a response body that broke), only its text.
    let code = match t.code() {
        tonic::Code::Unknown if std::error::Error::source(&t).is_some() || t.message() == "transport error" => {
            Code::Unavailable
        }
        _ if refused.is_some() => Code::ResourceExhausted, // as gRPC names it
        other => Code::from_u32(other as u32),
    };
    // A TLS failure under the transport error says which (unknown CA, no client certificate…).
    let message = match (crate::http::tls::describe(&t), refused) {
        (Some(why), _) if code == Code::Unavailable => why,
        _ if code == Code::Unavailable => with_causes(t.message(), &t),
        // In the words the shm:// transport and grpc-core use.
        (_, Some(size)) => format!("CLIENT: Received message larger than max ({size} vs. {limit})"),
        _ => t.message().to_owned(),
    };
    Status::new(code, message).with_details(t.details().to_vec()).with_metadata(metadata)
}

/// `message` followed by what the error's sources say that it does not ("http2 error: keep-alive
/// timed out"): tonic words a broken connection by its outermost error alone.
pub(crate) fn with_causes(message: &str, error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = message.to_owned();
    let mut next = error.source();
    while let Some(e) = next {
        let said = e.to_string();
        if !said.is_empty() && !out.contains(&said) {
            out = if out.is_empty() { said } else { format!("{out}: {said}") };
        }
        next = e.source();
    }
    out
}

/// `fut`'s output, unless the deadline passes or the channel is closed first: then the status
/// the call ends with.
async fn bounded<T>(
    deadline: Option<Instant>,
    closed: &mut watch::Receiver<Option<Status>>,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, Status> {
    let closing = async {
        let status = closed.wait_for(Option::is_some).await.ok().and_then(|status| status.clone());
        match status {
            Some(status) => status,
            // The channel is gone, and with it any close to come.
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        status = closing => Err(status),
        done = until(deadline, fut) => done.ok_or_else(Status::deadline_exceeded),
    }
}

/// Waits until the channel can carry a call ([`HttpCall::start`]'s wait for a server).
pub(crate) type Ready = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Status>> + Send>>;

impl HttpCall {
    /// Sends the request head at once (after `ready`, if given); must run inside a tokio
    /// runtime.
    ///
    /// `channel` carries the request: the front's `Channel`, whose HTTP/2 way resets a stream
    /// that is dropped half-way (`tonic_client`). `closed` is that channel's close signal.
    pub(crate) fn start<T>(
        channel: T,
        path: &str,
        options: CallOptions,
        limit: usize,
        closed: watch::Receiver<Option<Status>>,
        ready: Option<Ready>,
    ) -> Result<Self, Status>
    where
        T: tonic::client::GrpcService<tonic::body::Body> + Send + 'static,
        T::Future: Send,
        T::Error: Into<Box<dyn std::error::Error + Send + Sync>> + std::fmt::Display,
        T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
        <T::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let path = http::uri::PathAndQuery::try_from(path)
            .map_err(|e| Status::new(Code::InvalidArgument, format!("method path {path:?}: {e}")))?;
        let (tx, rx) = mpsc::channel::<Bytes>(1);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut headers = http::HeaderMap::new();
        codec::metadata_into(&options.metadata, &mut headers);
        *request.metadata_mut() = tonic::metadata::MetadataMap::from_headers(headers);
        // The server is told the time left when the request goes, after any wait for READY.
        let deadline = options.timeout.and_then(crate::call::deadline_in).map(Instant::from_std);
        // Replies a server chose to compress are read; requests are compressed when the call
        // asks (uncompressed ones every server accepts).
        let mut grpc = tonic::client::Grpc::new(channel)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(usize::MAX)
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip)
            .accept_compressed(tonic::codec::CompressionEncoding::Deflate);
        if let Some(compression) = options.compression {
            grpc = grpc.send_compressed(match compression {
                crate::Compression::Gzip => tonic::codec::CompressionEncoding::Gzip,
                crate::Compression::Deflate => tonic::codec::CompressionEncoding::Deflate,
            });
        }
        let task = tokio::spawn(async move {
            if let Some(ready) = ready {
                ready
                    .await
                    .map_err(|s| tonic::Status::new(tonic::Code::from_i32(s.code() as i32), s.message().to_owned()))?;
            }
            grpc.ready().await.map_err(|e| {
                let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                let why = crate::http::tls::describe(&*e).unwrap_or_else(|| e.to_string());
                tonic::Status::unavailable(format!("channel not ready: {why}"))
            })?;
            if let Some(deadline) = deadline {
                // tonic panics on a timeout `grpc-timeout` cannot say (over 8 digits of hours).
                request.set_timeout(deadline.saturating_duration_since(Instant::now()).min(codec::MAX_TIMEOUT));
            }
            grpc.streaming(request, path, BytesCodec).await
        });
        let made_in = MadeIn::now();
        Ok(HttpCall {
            requests: Requests::new(tx, deadline, made_in),
            response: Response::Opening(task),
            headers: None,
            trailers: None,
            ok_message: String::new(),
            ended: None,
            deadline,
            limit,
            closed,
            made_in,
        })
    }

    /// In a child forked since the call was made: ends it UNAVAILABLE, touching nothing.
    fn end_if_forked(&mut self) -> Result<(), Status> {
        match self.made_in.forked() {
            true => self.end(Err(crate::status::made_before_fork())),
            false => Ok(()),
        }
    }

    fn end(&mut self, outcome: Result<(), Status>) -> Result<(), Status> {
        match std::mem::replace(&mut self.response, Response::Ended) {
            response if self.made_in.forked() => std::mem::forget(response),
            Response::Opening(task) => task.abort(),
            _ => {}
        }
        self.requests.close();
        if self.trailers.is_none() {
            self.trailers = Some(outcome.as_ref().err().map(|s| s.metadata().clone()).unwrap_or_default());
        }
        // A failure keeps the initial metadata that came before it, as over shm://.
        let outcome = outcome.map_err(|s| s.after_headers(self.headers.as_ref()));
        self.ended.get_or_insert(outcome).clone()
    }

    /// Waits for the response to open (initial metadata in).
    async fn open(&mut self) -> Result<(), Status> {
        let Response::Opening(task) = &mut self.response else { return Ok(()) };
        match bounded(self.deadline, &mut self.closed, task).await {
            Err(status) => self.end(Err(status)),
            Ok(Err(e)) => self.end(Err(Status::new(Code::Internal, format!("call task failed: {e}")))),
            Ok(Ok(Err(t))) => {
                self.headers.get_or_insert_with(MetadataMap::new);
                self.end(Err(status_from_tonic(t, self.limit)))
            }
            Ok(Ok(Ok(response))) => {
                let (metadata, body, _) = response.into_parts();
                let headers = metadata.into_headers();
                let fields = codec::metadata_from_server(&headers);
                if headers.contains_key(codec::GRPC_STATUS) {
                    // A trailers-only response (tonic passes only an OK one): its fields are the
                    // trailers, as grpcio and grpc-go read them, and there is no initial metadata.
                    self.headers = Some(MetadataMap::new());
                    self.trailers = Some(fields);
                    self.ok_message = codec::status_message(&headers);
                } else {
                    self.headers = Some(fields);
                }
                self.response = Response::Open(Box::new(body));
                Ok(())
            }
        }
    }

    /// Sends one request message; `last` half-closes after it. `Ok(false)` if the call has
    /// already ended (its status comes from `recv`).
    pub(crate) async fn send(&mut self, message: Bytes, last: bool) -> Result<bool, Status> {
        if let Some(Err(s)) = &self.ended {
            return Err(s.clone());
        }
        self.end_if_forked()?;
        let Some(tx) = self.requests.sender() else {
            return Err(Status::new(Code::FailedPrecondition, "the request stream was already closed"));
        };
        let sent = match bounded(self.deadline, &mut self.closed, tx.send(message)).await {
            Ok(sent) => sent.is_ok(),
            Err(status) => return self.end(Err(status)).map(|()| false),
        };
        if last {
            self.requests.close();
        }
        Ok(sent)
    }

    /// Half-closes.
    pub(crate) fn close_send(&mut self) {
        self.requests.close();
    }

    /// A handle that sends requests beside this call's reading.
    pub(crate) fn requests(&self) -> Requests {
        self.requests.clone()
    }

    /// The next response message; `None` at an OK end.
    pub(crate) async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        if let Some(ended) = &self.ended {
            return ended.clone().map(|()| None);
        }
        self.end_if_forked()?;
        self.open().await?;
        let Response::Open(body) = &mut self.response else {
            return self.ended.clone().unwrap_or(Ok(())).map(|()| None);
        };
        match bounded(self.deadline, &mut self.closed, body.message()).await {
            Err(status) => self.end(Err(status)).map(|()| None),
            Ok(Ok(Some(m))) => Ok(Some(m)),
            Ok(Err(t)) => self.end(Err(status_from_tonic(t, self.limit))).map(|()| None),
            Ok(Ok(None)) => {
                let trailers = match body.trailers().await {
                    Ok(t) => t.map(|t| t.into_headers()),
                    Err(t) => return self.end(Err(status_from_tonic(t, self.limit))).map(|()| None),
                };
                if let Some(t) = &trailers {
                    self.ok_message = codec::status_message(t);
                    self.trailers = Some(codec::metadata_from_server(t));
                }
                self.end(Ok(())).map(|()| None)
            }
        }
    }

    /// The server's initial metadata.
    pub(crate) async fn headers(&mut self) -> Result<MetadataMap, Status> {
        if self.ended.is_none() {
            self.end_if_forked()?;
        }
        self.open().await?;
        Ok(self.headers.clone().unwrap_or_default())
    }

    /// Trailing metadata once the call has ended.
    pub(crate) fn trailers(&self) -> Option<&MetadataMap> {
        self.trailers.as_ref().filter(|_| self.ended.is_some())
    }

    /// The message of the OK status the call ended with; `None` before it ended OK.
    pub(crate) fn status_message(&self) -> Option<&str> {
        matches!(self.ended, Some(Ok(()))).then_some(self.ok_message.as_str())
    }

    /// Ends the call as cancelled: the stream is reset, the server sees CANCELLED.
    pub(crate) fn cancel(&mut self) {
        let _ = self.end(Err(Status::new(Code::Cancelled, "the call was cancelled")));
    }
}
