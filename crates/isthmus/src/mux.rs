//! One connection's streams: the table that routes incoming frames to calls, and the reader
//! task that fills it. Shared by the client and the server side.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use isthmus_shm::{flags, ErrorKind, Frame, Kind, Receiver, Sender};
use tokio::sync::{mpsc, Notify};

use crate::metadata::MetadataMap;
use crate::status::{Code, Status};
use crate::wire;

/// What a call hears from the other side.
#[derive(Debug)]
pub(crate) enum Event {
    /// The server's initial metadata (client side only).
    Headers(MetadataMap),
    /// One message.
    Message(Bytes),
    /// The other side will send no more messages (the client's half-close).
    HalfClose,
    /// The call is over: the server's trailers, a CANCEL, or the connection's death.
    End(Status),
}

/// A new call the server's reader found: its head, its event queue, and the signal that the
/// client cancelled it (or the connection died), which must stop its handler.
pub(crate) struct Incoming {
    pub(crate) stream: u64,
    pub(crate) head: wire::RequestHead,
    pub(crate) events: mpsc::UnboundedReceiver<Event>,
    pub(crate) cancelled: Arc<Cancel>,
}

/// Tells a server call that it is over before its handler finished, and with which code (the
/// client's CANCEL carries CANCELLED or DEADLINE_EXCEEDED; a dead connection is UNAVAILABLE).
#[derive(Debug, Default)]
pub(crate) struct Cancel {
    pub(crate) signal: Notify,
    code: Mutex<Option<Code>>,
}

impl Cancel {
    fn fire(&self, code: Code) {
        if let Ok(mut c) = self.code.lock() {
            c.get_or_insert(code);
        }
        self.signal.notify_one();
    }

    /// The code the call ended with, once fired.
    pub(crate) fn code(&self) -> Code {
        self.code.lock().ok().and_then(|c| *c).unwrap_or(Code::Cancelled)
    }
}

/// One open stream: where its events go, and (server side) who to tell of a cancel.
struct Entry {
    events: mpsc::UnboundedSender<Event>,
    cancelled: Option<Arc<Cancel>>,
}

/// The stream table of one connection.
pub(crate) struct Mux {
    pub(crate) sender: Sender,
    streams: Mutex<HashMap<u64, Entry>>,
    /// Set once the connection is finished: every later call fails with it.
    dead: Mutex<Option<Status>>,
    /// Server side: GOAWAY was sent; new calls are refused.
    draining: AtomicBool,
    /// Server side: the highest stream id accepted.
    last_stream: AtomicU64,
    /// Calls started and finished on this connection, by final code.
    pub(crate) calls: CallTally,
}

/// Calls started, and calls finished by their final code.
#[derive(Debug, Default)]
pub(crate) struct CallTally {
    started: AtomicU64,
    finished: [AtomicU64; 17],
}

impl CallTally {
    pub(crate) fn start(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn finish(&self, code: Code) {
        self.finished[code as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of one connection's calls and transport counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionCounters {
    /// Calls started (client) or accepted (server).
    pub calls_started: u64,
    /// Calls finished, indexed by the final code's number (`Code::Ok as usize` = 0, …).
    pub calls_finished: [u64; 17],
    /// The transport's counters: frames and bytes each way, doorbell rings, sleeps, spins,
    /// ring-full and arena-full waits, arena high-water mark.
    pub transport: isthmus_shm::Counters,
}

impl ConnectionCounters {
    /// Calls finished with `code`.
    pub fn finished(&self, code: Code) -> u64 {
        self.calls_finished[code as usize]
    }

    /// Calls started and not finished yet.
    pub fn in_flight(&self) -> u64 {
        self.calls_started.saturating_sub(self.calls_finished.iter().sum())
    }
}

fn poisoned() -> Status {
    Status::new(Code::Internal, "a thread panicked while holding the stream table")
}

impl Mux {
    pub(crate) fn new(sender: Sender) -> Arc<Mux> {
        Arc::new(Mux {
            sender,
            streams: Mutex::new(HashMap::new()),
            dead: Mutex::new(None),
            draining: AtomicBool::new(false),
            last_stream: AtomicU64::new(0),
            calls: CallTally::default(),
        })
    }

    /// This connection's counters.
    pub(crate) fn counters(&self) -> ConnectionCounters {
        let mut finished = [0u64; 17];
        for (f, c) in finished.iter_mut().zip(&self.calls.finished) {
            *f = c.load(Ordering::Relaxed);
        }
        ConnectionCounters {
            calls_started: self.calls.started.load(Ordering::Relaxed),
            calls_finished: finished,
            transport: self.sender.counters(),
        }
    }

    /// The status every call gets once the connection is gone, if it is.
    pub(crate) fn dead(&self) -> Option<Status> {
        self.dead.lock().ok().and_then(|d| d.clone())
    }

    /// Opens the queue of stream `id`.
    pub(crate) fn register(&self, id: u64) -> Result<mpsc::UnboundedReceiver<Event>, Status> {
        self.register_entry(id, None)
    }

    fn register_entry(
        &self,
        id: u64,
        cancelled: Option<Arc<Cancel>>,
    ) -> Result<mpsc::UnboundedReceiver<Event>, Status> {
        if let Some(s) = self.dead() {
            return Err(s);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let mut streams = self.streams.lock().map_err(|_| poisoned())?;
        if streams.contains_key(&id) {
            return Err(Status::new(Code::Internal, format!("the peer reused open stream id {id}")));
        }
        streams.insert(id, Entry { events: tx, cancelled });
        drop(streams);
        // The reader may have died between the check and the insert; it empties the table
        // after setting `dead`, so look again.
        if let Some(s) = self.dead() {
            self.unregister(id);
            return Err(s);
        }
        Ok(rx)
    }

    pub(crate) fn unregister(&self, id: u64) {
        if let Ok(mut s) = self.streams.lock() {
            s.remove(&id);
        }
    }

    fn deliver(&self, id: u64, ev: Event) {
        let end = match &ev {
            Event::End(status) => Some(status.code()),
            _ => None,
        };
        if let Ok(mut s) = self.streams.lock() {
            if let Some(entry) = s.get(&id) {
                let _ = entry.events.send(ev);
                if let (Some(code), Some(c)) = (end, &entry.cancelled) {
                    c.fire(code);
                }
            }
            if end.is_some() {
                s.remove(&id);
            }
        }
    }

    /// Ends every call with `status` and refuses new ones.
    pub(crate) fn fail_all(&self, status: Status) {
        if let Ok(mut d) = self.dead.lock() {
            d.get_or_insert(status.clone());
        }
        let streams = self.streams.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default();
        for (_, entry) in streams {
            let _ = entry.events.send(Event::End(status.clone()));
            if let Some(c) = entry.cancelled {
                c.fire(status.code());
            }
        }
    }

    /// Server side: tells the client no new call will be taken here (GOAWAY); calls in progress
    /// go on.
    pub(crate) async fn go_away(&self, why: &str) {
        self.draining.store(true, Ordering::Release);
        let g = wire::GoAway { last_stream: self.last_stream.load(Ordering::Acquire), message: why.to_owned() };
        let _ = self.sender.send_async(Kind::GoAway, 0, 0, &g.encode()).await;
    }

    /// Sends a CANCEL for `id` (best effort: the connection may be gone) and forgets it.
    pub(crate) async fn cancel(&self, id: u64, code: Code) {
        self.unregister(id);
        let _ = self.sender.send_async(Kind::Cancel, 0, id, &wire::encode_cancel(code)).await;
    }

    /// Reads frames until the connection ends, routing each to its call. On the server side,
    /// HEADERS for an unknown stream opens a call and is handed to `incoming`.
    pub(crate) async fn read_loop(
        self: Arc<Self>,
        mut receiver: Receiver,
        incoming: Option<mpsc::UnboundedSender<Incoming>>,
    ) {
        // If this task is dropped unfinished (its runtime shut down), nobody reads replies any
        // more: the connection must count as dead, or calls on it would wait for ever.
        struct Watch(Arc<Mux>);
        impl Drop for Watch {
            fn drop(&mut self) {
                self.0.fail_all(Status::new(
                    Code::Unavailable,
                    "the connection's reader stopped (its tokio runtime shut down)",
                ));
                self.0.sender.close();
            }
        }
        let _watch = Watch(self.clone());
        let end = loop {
            match receiver.recv_async().await {
                Ok(frame) => {
                    if let Err(status) = self.route(frame, incoming.as_ref()).await {
                        self.sender.close();
                        break status;
                    }
                }
                // One message too large: that call fails, the connection goes on. The server ends
                // it with a status that names the size and the limit; a client cancels its side.
                Err(e) if e.kind() == ErrorKind::MessageTooLarge => {
                    if let Some(id) = e.stream() {
                        let status = Status::from_transport(&e);
                        self.deliver(id, Event::End(status.clone()));
                        if incoming.is_some() {
                            self.unregister(id);
                            let body = wire::encode_trailers(&status);
                            let _ = self.sender.send_async(Kind::Trailers, flags::END_STREAM, id, &body).await;
                        } else {
                            self.cancel(id, Code::ResourceExhausted).await;
                        }
                    }
                }
                Err(e) => break Status::from_transport(&e),
            }
        };
        self.fail_all(end);
    }

    async fn route(&self, f: Frame, incoming: Option<&mpsc::UnboundedSender<Incoming>>) -> Result<(), Status> {
        let internal = |e: wire::WireError| Status::new(Code::Internal, format!("malformed frame from the peer: {e}"));
        match f.kind {
            Kind::Headers => match incoming {
                Some(_) if self.draining.load(Ordering::Acquire) => {
                    // A call that crossed our GOAWAY: refuse it so the client retries elsewhere.
                    let refused = Status::new(Code::Unavailable, "the server is shutting down and takes no new calls");
                    let body = wire::encode_trailers(&refused);
                    let _ = self.sender.send_async(Kind::Trailers, flags::END_STREAM, f.stream, &body).await;
                }
                Some(new_calls) => {
                    let head = wire::RequestHead::decode(&f.body).map_err(internal)?;
                    self.last_stream.fetch_max(f.stream, Ordering::AcqRel);
                    let cancelled = Arc::new(Cancel::default());
                    let events = self.register_entry(f.stream, Some(cancelled.clone()))?;
                    let _ = new_calls.send(Incoming { stream: f.stream, head, events, cancelled });
                }
                None => self
                    .deliver(f.stream, Event::Headers(wire::ResponseHead::decode(&f.body).map_err(internal)?.metadata)),
            },
            Kind::Message => {
                let half_close = f.flags & flags::END_STREAM != 0;
                self.deliver(f.stream, Event::Message(f.body));
                if half_close {
                    self.deliver(f.stream, Event::HalfClose);
                }
            }
            // From the client, TRAILERS (empty) is a half-close without a message.
            Kind::Trailers if incoming.is_some() => self.deliver(f.stream, Event::HalfClose),
            Kind::Trailers => self.deliver(f.stream, Event::End(wire::decode_trailers(&f.body).map_err(internal)?)),
            Kind::Cancel => {
                let code = wire::decode_cancel(&f.body).map_err(internal)?;
                self.deliver(f.stream, Event::End(Status::new(code, "the call was cancelled by the peer")));
            }
            Kind::Ping => {
                if f.flags & flags::ACK == 0 {
                    let _ = self.sender.send_async(Kind::Ping, flags::ACK, f.stream, &f.body).await;
                }
            }
            Kind::GoAway => {
                let g = wire::GoAway::decode(&f.body).map_err(internal)?;
                if let Ok(mut d) = self.dead.lock() {
                    d.get_or_insert(Status::new(Code::Unavailable, format!("the server is going away: {}", g.message)));
                }
            }
        }
        Ok(())
    }
}
