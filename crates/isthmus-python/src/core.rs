//! A streaming client call as both front ends (blocking and asyncio) drive it: one side sends
//! while the other receives, and a cancel reaches whichever is waiting.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use isthmus::{CallSender, ClientCall, Code, MetadataMap, Status};
use tokio::sync::watch;

fn cancelled() -> Status {
    Status::new(Code::Cancelled, "the call was cancelled")
}

/// One client call of any shape.
pub(crate) struct CallCore {
    sender: CallSender,
    /// `None` once cancelled.
    call: tokio::sync::Mutex<Option<ClientCall>>,
    cancel: watch::Sender<bool>,
    /// The trailing metadata, once the call has ended.
    trailers: Mutex<Option<MetadataMap>>,
}

impl CallCore {
    pub(crate) fn new(call: ClientCall) -> Arc<CallCore> {
        Arc::new(CallCore {
            sender: call.sender(),
            call: tokio::sync::Mutex::new(Some(call)),
            cancel: watch::Sender::new(false),
            trailers: Mutex::new(None),
        })
    }

    /// Sends one request (`last` half-closes with it); `false` if the call is over (or
    /// cancelled).
    pub(crate) async fn send(&self, message: Bytes, last: bool) -> bool {
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => false,
            sent = self.sender.send_bytes(message, last) => sent,
        }
    }

    /// Half-closes.
    pub(crate) async fn close_send(&self) {
        let mut cancel = self.cancel.subscribe();
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => {}
            _ = self.sender.close() => {}
        }
    }

    fn ended(&self, trailers: MetadataMap) {
        if let Ok(mut t) = self.trailers.lock() {
            t.get_or_insert(trailers);
        }
    }

    /// The next response; `None` at an OK end.
    pub(crate) async fn recv(&self) -> Result<Option<Bytes>, Status> {
        let mut cancel = self.cancel.subscribe();
        let mut guard = self.call.lock().await;
        let Some(call) = guard.as_mut() else { return Err(cancelled()) };
        let received = tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => None,
            r = call.recv() => Some(r),
        };
        match received {
            None => {
                if let Some(call) = guard.take() {
                    call.cancel().await;
                }
                self.ended(MetadataMap::new());
                Err(cancelled())
            }
            Some(Ok(Some(message))) => Ok(Some(message)),
            Some(Ok(None)) => {
                self.ended(call.trailers().cloned().unwrap_or_default());
                Ok(None)
            }
            Some(Err(status)) => {
                self.ended(status.metadata().clone());
                Err(status)
            }
        }
    }

    /// The server's initial metadata.
    pub(crate) async fn headers(&self) -> Result<MetadataMap, Status> {
        let mut cancel = self.cancel.subscribe();
        let mut guard = self.call.lock().await;
        let Some(call) = guard.as_mut() else { return Err(cancelled()) };
        tokio::select! {
            biased;
            _ = cancel.wait_for(|c| *c) => Err(cancelled()),
            h = call.headers() => h,
        }
    }

    /// The trailing metadata, once the call has ended.
    pub(crate) fn trailers(&self) -> Option<MetadataMap> {
        self.trailers.lock().ok()?.clone()
    }

    /// Ends the call with CANCELLED on both sides: wakes a waiting receiver, which sends the
    /// cancel, or sends it here if none waits.
    pub(crate) fn cancel(self: &Arc<Self>) {
        if self.cancel.send_replace(true) {
            return;
        }
        let this = self.clone();
        crate::runtime().spawn(async move {
            if let Some(call) = this.call.lock().await.take() {
                call.cancel().await;
            }
            this.ended(MetadataMap::new());
        });
    }
}
