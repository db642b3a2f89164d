//! gRPC's transparent retry for calls over HTTP/2: a call that its connection never carried to
//! the server goes again instead of failing UNAVAILABLE.
//!
//! A server that ends a connection (a maximum connection age, an idle limit, a graceful stop)
//! sends GOAWAY and closes it once its calls are done. A call the client starts in that moment
//! can be lost before the server sees it: hyper queued it for a connection that closed before
//! sending it ("operation was canceled: connection closed", or "connection was not ready"). A
//! server may also refuse a stream it did not process (RST_STREAM REFUSED_STREAM). grpc-core and
//! grpc-go retry such calls whatever the call's retry policy, since running them again cannot
//! run them twice; so does this module, up to [`ATTEMPTS`] times within the deadline, on a new
//! connection or, after a refusal, on the same one.
//!
//! A stream the server's GOAWAY left out goes again too, as grpc-go's does: h2's remote GOAWAY
//! with NO_ERROR, which h2 gives the streams above the GOAWAY's last stream id. One corner: h2
//! gives the same error to a stream whose HEADERS it had already queued when the GOAWAY lands
//! between hyper's `send_request` and its next `poll_ready` (measured: about one GOAWAY in a
//! hundred, with calls back to back). hyper then drops that stream before sending any of its
//! body, and the server gets its HEADERS and a reset (CANCEL). No request message reached it,
//! so a unary or server-streaming handler never ran (gRPC servers read the request first); a
//! client-streaming or bidi handler that acts before its first read was started and at once
//! cancelled, and starts again with the retry.
//!
//! To send a request again, its body must be whole: [`Replay`] keeps every data frame it hands
//! out (the `Bytes` are shared, not copied) until the response opens, at most [`KEPT`] bytes, as
//! grpc-core's per-call retry buffer does. A call that sent more, or whose body fails or holds
//! any other kind of frame (a gRPC request has none), is not retried. Each attempt reads the
//! body through its own `Replay`: the kept frames first, then the body itself; an attempt given
//! up (a stale one, whose stream hyper may still poll) reads nothing more. Once the response
//! opens nothing more is kept, but the attempt that got it still sends what it has not yet sent
//! of the kept frames (hyper sends as the stream's window allows, which may be after the
//! response's headers).
//!
//! An attempt can also be lost before any connection takes it. hyper hands a request to a
//! connection's task through a queue; a request queued just as that task ends (a GOAWAY, and
//! the connection closed) stays there, neither sent nor failed, until tonic drops the
//! connection's handle, which it does only when the channel's next call comes. A call made
//! alone waited so for its deadline (seen about once in 500,000 calls with a GOAWAY every
//! 50 ms). hyper's task asks a request's body its `size_hint` as it takes the request, before
//! it opens a stream, and nothing asks before it (tonic's `Body::new` asks `is_end_stream`, and
//! puts an empty body in place of one that has ended, which is never asked: such an attempt is
//! not watched). So an attempt whose body was never asked when the channel's connection closes
//! and leaves it with none was not sent, and goes again ([`Replayable::again_if_untaken`]).
//! A connection's task also ends when a request wakes it after a GOAWAY while the connection
//! still carries calls; that request's own retry then goes through tonic, which drops the
//! handle and fails what its queue held (and that goes again as above). Not covered: an
//! attempt that begins after the connection closed but still reaches its queue (a window of
//! microseconds, not seen).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

use super::cause;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many times a call goes at most, its first attempt included.
pub(crate) const ATTEMPTS: u32 = 5;

/// The most request bytes kept for a retry (grpc-core's `grpc.per_rpc_retry_buffer_size`).
pub(crate) const KEPT: usize = 256 << 10;

/// Whether a request that failed with `e` never reached the server's application (see the
/// module's documentation), so that sending it again cannot run it twice.
pub(crate) fn never_processed(e: &(dyn std::error::Error + 'static)) -> bool {
    if cause::<hyper::Error>(e).is_some_and(hyper::Error::is_canceled) {
        return true;
    }
    cause::<h2::Error>(e).is_some_and(|h2| {
        h2.is_remote()
            && match h2.reason() {
                Some(h2::Reason::REFUSED_STREAM) => h2.is_reset(),
                Some(h2::Reason::NO_ERROR) => h2.is_go_away(),
                _ => false,
            }
    })
}

/// The reason the server reset the call's stream with (RST_STREAM), if it did.
pub(crate) fn reset_by_peer(e: &(dyn std::error::Error + 'static)) -> Option<h2::Reason> {
    cause::<h2::Error>(e).filter(|h2| h2.is_reset() && h2.is_remote()).and_then(h2::Error::reason)
}

/// Whether `e` is the server's GOAWAY: the connection went away under the call, which gRPC
/// calls UNAVAILABLE (tonic says INTERNAL, "h2 protocol error", for one with NO_ERROR).
pub(crate) fn went_away(e: &(dyn std::error::Error + 'static)) -> bool {
    cause::<h2::Error>(e).is_some_and(|h2| h2.is_go_away() && h2.is_remote())
}

/// A request body and what its attempts took of it.
struct Shared<B> {
    body: Pin<Box<B>>,
    /// The data frames taken so far; `None` once the call can no longer go again and the
    /// current attempt has sent them all.
    kept: Option<Vec<Bytes>>,
    bytes: usize,
    /// The response opened: no more attempts, nothing more kept.
    closed: bool,
    /// The attempt reading now; older ones read nothing more.
    attempt: u32,
    /// A connection took the current attempt (hyper looked at its body).
    taken: bool,
    ended: bool,
}

/// A call's request body, kept so that the call can go again (see the module's documentation).
pub(crate) struct Replayable<B>(Arc<Mutex<Shared<B>>>);

/// One attempt's view of a [`Replayable`] body: the body it sends.
pub(crate) struct Replay<B> {
    shared: Arc<Mutex<Shared<B>>>,
    attempt: u32,
    /// The next kept frame this attempt sends.
    at: usize,
}

impl<B> Replayable<B> {
    pub(crate) fn new(body: B) -> Replayable<B> {
        let shared = Shared {
            body: Box::pin(body),
            kept: Some(Vec::new()),
            bytes: 0,
            closed: false,
            attempt: 0,
            taken: false,
            ended: false,
        };
        Replayable(Arc::new(Mutex::new(shared)))
    }

    /// The first attempt's view.
    pub(crate) fn first(&self) -> Replay<B> {
        Replay { shared: self.0.clone(), attempt: 0, at: 0 }
    }

    /// The next attempt's view, which sends the body from its start; `None` if the call cannot
    /// go again (more than [`KEPT`] bytes went, or the body failed, or the response opened).
    /// The attempts before it read nothing more.
    pub(crate) fn again(&self) -> Option<Replay<B>> {
        self.next(false)
    }

    /// [`again`](Self::again), if no connection has taken the current attempt (in the same
    /// lock, so none takes it meanwhile): one queued for a connection that ended is not sent,
    /// and a connection that takes it later finds its body given up and resets the stream
    /// after its HEADERS, before any request message.
    pub(crate) fn again_if_untaken(&self) -> Option<Replay<B>> {
        self.next(true)
    }

    fn next(&self, if_untaken: bool) -> Option<Replay<B>> {
        let mut shared = self.0.lock().ok()?;
        if shared.closed || (if_untaken && shared.taken) {
            return None;
        }
        shared.kept.as_ref()?;
        shared.attempt += 1;
        shared.taken = false;
        Some(Replay { shared: self.0.clone(), attempt: shared.attempt, at: 0 })
    }

    /// Keeps nothing more: the server has the call (its response opened). The current attempt
    /// still sends the kept frames it has not sent, then lets them go.
    pub(crate) fn done(&self) {
        if let Ok(mut shared) = self.0.lock() {
            shared.closed = true;
        }
    }
}

impl<B> Body for Replay<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Ok(mut shared) = this.shared.lock() else {
            return Poll::Ready(Some(Err("the request body's lock was poisoned".into())));
        };
        let shared = &mut *shared;
        if shared.attempt != this.attempt {
            // Given up: its stream is gone or going; hyper resets it with this.
            return Poll::Ready(Some(Err(Box::new(h2::Error::from(h2::Reason::CANCEL)))));
        }
        shared.taken = true;
        if let Some(kept) = &shared.kept {
            if let Some(data) = kept.get(this.at) {
                this.at += 1;
                return Poll::Ready(Some(Ok(Frame::data(data.clone()))));
            }
            if shared.closed {
                shared.kept = None;
            }
        }
        if shared.ended {
            return Poll::Ready(None);
        }
        match shared.body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // A gRPC request is data frames only; anything else is not kept, nor sent again.
                match (&mut shared.kept, frame.data_ref()) {
                    (Some(kept), Some(data)) if shared.bytes + data.len() <= KEPT => {
                        shared.bytes += data.len();
                        kept.push(data.clone());
                        this.at += 1;
                    }
                    (kept, _) => *kept = None,
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                shared.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                // A body that failed cannot be sent whole again.
                shared.kept = None;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        let Ok(shared) = self.shared.lock() else { return false };
        let kept_left = shared.kept.as_ref().is_some_and(|k| self.at < k.len());
        shared.attempt == self.attempt && !kept_left && (shared.ended || shared.body.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // hyper's connection task asks first, as it takes the request: the attempt is taken.
        if let Ok(mut shared) = self.shared.lock() {
            if shared.attempt == self.attempt {
                shared.taken = true;
            }
        }
        http_body::SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A body of data frames.
    struct Frames(VecDeque<Bytes>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front().map(|d| Ok(Frame::data(d))))
        }
    }

    fn body(frames: &[&'static [u8]]) -> Frames {
        Frames(frames.iter().map(|f| Bytes::from_static(f)).collect())
    }

    /// The next frame's data; `None` at the end; panics on an error.
    async fn next(b: &mut Replay<Frames>) -> Result<Option<Bytes>, BoxError> {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *b).poll_frame(cx)).await;
        frame.transpose().map(|f| f.and_then(|f| f.into_data().ok()))
    }

    async fn all(mut b: Replay<Frames>) -> Vec<Bytes> {
        let mut got = Vec::new();
        while let Some(d) = next(&mut b).await.expect("a frame") {
            got.push(d);
        }
        got
    }

    #[tokio::test]
    async fn a_second_attempt_sends_the_whole_body_again() {
        let r = Replayable::new(body(&[b"a", b"bc"]));
        let mut first = r.first();
        // The first attempt took one frame before its connection failed.
        assert_eq!(next(&mut first).await.expect("ok"), Some(Bytes::from_static(b"a")));
        let second = r.again().expect("replayable");
        assert_eq!(all(second).await, vec![Bytes::from_static(b"a"), Bytes::from_static(b"bc")]);
        // The attempt given up reads nothing more.
        assert!(next(&mut first).await.is_err());
    }

    #[tokio::test]
    async fn a_response_that_opens_mid_replay_still_gets_the_whole_request() {
        // The server answered headers while the retry had sent one kept frame of two (the rest
        // waited for window): the rest still goes, then the body's own.
        let r = Replayable::new(body(&[b"a", b"b", b"c"]));
        let mut first = r.first();
        for _ in 0..2 {
            next(&mut first).await.expect("a frame");
        }
        let mut second = r.again().expect("replayable");
        assert_eq!(next(&mut second).await.expect("ok"), Some(Bytes::from_static(b"a")));
        r.done();
        assert!(!second.is_end_stream());
        assert_eq!(all(second).await, vec![Bytes::from_static(b"b"), Bytes::from_static(b"c")]);
        assert!(r.again().is_none());
    }

    #[tokio::test]
    async fn no_attempt_after_the_response_opened_or_past_the_limit() {
        let r = Replayable::new(body(&[b"a"]));
        r.done();
        assert!(r.again().is_none());

        let big: &'static [u8] = Box::leak(vec![0u8; KEPT + 1].into_boxed_slice());
        let r = Replayable::new(body(&[big]));
        assert_eq!(all(r.first()).await.len(), 1);
        assert!(r.again().is_none());
    }

    #[tokio::test]
    async fn an_attempt_goes_again_on_a_connection_end_only_if_none_took_it() {
        let r = Replayable::new(body(&[b"a"]));
        let first = r.first();
        // Queued and never taken: it goes again, and the one given up sends nothing.
        let second = r.again_if_untaken().expect("untaken");
        let mut first = first;
        assert!(next(&mut first).await.is_err());
        // hyper's task took the second as it does (it asks the body's size first): no more.
        let _ = second.size_hint();
        assert!(r.again_if_untaken().is_none());
        assert_eq!(all(second).await, vec![Bytes::from_static(b"a")]);
    }

    #[test]
    fn failures_of_this_side_are_not_the_servers_word() {
        // A REFUSED_STREAM made here, not received, and a broken pipe: no retry.
        assert!(!never_processed(&h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert!(!never_processed(&std::io::Error::new(std::io::ErrorKind::BrokenPipe, "gone")));
        assert!(!went_away(&h2::Error::from(h2::Reason::NO_ERROR)));
    }
}
