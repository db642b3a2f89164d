//! Push to many subscribers: a [`Topic`] that server-streaming handlers subscribe their calls to,
//! and a [`publish`](Topic::publish) that reaches every current subscriber (ADR 0016).
//!
//! - **One write.** `publish` copies the message once into the shared arena of each listener
//!   its subscribers came through (usually one), and every subscriber's call carries a
//!   reference to that block ([`ServerCall::send_shared`]); its client reads it in place. A
//!   small message (up to the connection's `inline_max`, 8 KiB by default) is copied once into
//!   the heap and inline into each ring, which costs less than a shared block would. Calls that came over `unix://` or `http://`
//!   reach the handler through the server's loopback `shm://` endpoint (ADR 0007) and get the
//!   same block; the bridge then writes an ordinary gRPC stream.
//! - **No task per subscriber per message.** A subscriber whose handler waits idle in
//!   [`Topic::serve`] (nothing of its queued or being sent, credit in its window, room in its
//!   ring) is sent the message by `publish` itself, on the publisher's thread; otherwise the
//!   message waits in its queue for its handler.
//! - **Nobody waits for the slowest.** `publish` never waits: it appends to each subscriber's
//!   queue, bounded by [`TopicOptions::capacity`]. A subscriber whose queue is full meets the
//!   topic's [`SlowSubscriber`] policy: drop its oldest message and count a gap, which
//!   [`Topic::serve_with`] hands to the handler to turn into a resync message, or end its call
//!   with RESOURCE_EXHAUSTED. Memory stays bounded either way: at most `capacity` messages per
//!   subscriber, each a reference.
//! - **Late joiners.** [`publish_state`](Topic::publish_state) also keeps the message as the
//!   topic's current state, delivered first to every later subscriber.
//! - **Leaving.** A [`Subscription`] leaves the topic when dropped: when its client cancels or
//!   goes away the engine drops the handler's future, and with it the subscription, at once.
//!   [`close`](Topic::close) ends every subscription with OK after what it has queued. A
//!   server that starts to shut down ends each subscription its calls serve with UNAVAILABLE
//!   (`the server is shutting down`) after what it has queued, so that a graceful shutdown
//!   waits for no subscriber longer than it takes to send that, and its clients know to
//!   subscribe again elsewhere.
//!
//! ```no_run
//! # async fn demo() -> Result<(), isthmus::Status> {
//! let topic = isthmus::Topic::new("catalog");
//! let served = topic.clone();
//! let bound = isthmus::Server::builder()
//!     .handler("/catalog.v1.Catalog/Watch", move |mut call: isthmus::ServerCall| {
//!         let topic = served.clone();
//!         async move { topic.serve(&mut call).await }
//!     })
//!     .bind("shm://catalog")?;
//! tokio::spawn(bound.serve());
//! topic.publish_state(b"tools: [search, fetch]");
//! # Ok(()) }
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use isthmus_shm::{SharedArena, SharedBlock};
use tokio::sync::Notify;

use crate::engine::server::{Direct, GoingAway, ServerCall, GOING_AWAY};
use crate::status::{Code, Status};

/// Messages up to this size travel inline in the ring, where a copy per subscriber is cheaper
/// than a shared block and its release: the transport's default `inline_max`, for a subscriber
/// that does not say its connection's ([`Topic::subscribe_for`]).
const INLINE: usize = 8 << 10;

/// What a topic does with a subscriber whose queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlowSubscriber {
    /// Drop the subscriber's oldest queued message and count a gap ([`Delivery::Gap`]).
    #[default]
    DropOldest,
    /// End the subscriber's call with RESOURCE_EXHAUSTED.
    Cancel,
}

/// How a topic queues for its subscribers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicOptions {
    /// Messages queued per subscriber before the [`SlowSubscriber`] policy applies. At least 1.
    pub capacity: usize,
    /// The policy for a full queue.
    pub slow: SlowSubscriber,
}

impl Default for TopicOptions {
    fn default() -> TopicOptions {
        TopicOptions { capacity: 64, slow: SlowSubscriber::DropOldest }
    }
}

/// A topic's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TopicStats {
    /// Subscribers now.
    pub subscribers: usize,
    /// Messages published.
    pub published: u64,
    /// Payload bytes published (each message counted once, however many it reached).
    pub bytes: u64,
    /// Messages sent to subscribers, by [`Topic::serve`] (one per subscriber reached).
    pub delivered: u64,
    /// Messages dropped from full queues ([`SlowSubscriber::DropOldest`]).
    pub dropped: u64,
    /// Subscribers ended for falling behind ([`SlowSubscriber::Cancel`]).
    pub cancelled: u64,
}

struct PublishedInner {
    seq: u64,
    len: usize,
    /// The message in the heap, when some subscriber has no shared block of it.
    heap: Option<Bytes>,
    /// The message in each shared arena that has subscribers.
    blocks: Vec<SharedBlock>,
}

/// One published message as subscribers receive it: cheap to clone.
#[derive(Clone)]
pub struct Published(Arc<PublishedInner>);

impl std::fmt::Debug for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published").field("seq", &self.0.seq).field("len", &self.0.len).finish()
    }
}

impl Published {
    /// Its place in the topic's order, from 1.
    pub fn seq(&self) -> u64 {
        self.0.seq
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True for an empty message.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The message's block in `arena`, if it was written there.
    pub fn shared_block(&self, arena: &SharedArena) -> Option<&SharedBlock> {
        self.0.blocks.iter().find(|b| b.arena().same(arena))
    }

    /// The message's bytes: shared with the topic when it kept a heap copy, else copied out of
    /// a shared block.
    pub fn bytes(&self) -> Bytes {
        match (&self.0.heap, self.0.blocks.first()) {
            (Some(heap), _) => heap.clone(),
            (None, Some(block)) => Bytes::copy_from_slice(block),
            (None, None) => Bytes::new(),
        }
    }
}

/// A message on its way to one subscriber.
enum Outgoing {
    Shared(SharedBlock),
    Bytes(Bytes),
}

/// What a subscription yields next.
#[derive(Debug, Clone)]
pub enum Delivery {
    /// The next message.
    Message(Published),
    /// This many messages were dropped here, because the queue was full
    /// ([`SlowSubscriber::DropOldest`]); the next message comes after them.
    Gap(u64),
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Published>,
    /// The first item is the topic's state, queued when the subscriber joined: it does not
    /// count against the capacity (a late joiner would otherwise be one message short, and a
    /// subscriber of capacity 1 cancelled by the first publish).
    state_first: bool,
    gap: u64,
    /// How the subscription ends once its queue is empty: OK (the topic closed) or a status.
    end: Option<Result<(), Status>>,
    /// `end` is a status that lets the queue, and a send under way, go first (the server is
    /// shutting down): it does not resolve [`Subscription::cancelled`].
    end_waits: bool,
    /// The subscriber took a delivery and may still be sending it (until its next `next`).
    busy: bool,
    /// The call of a subscriber served by [`Topic::serve`]: a publish sends to it directly
    /// while nothing of its own is queued or under way, with no task woken.
    direct: Option<Direct>,
}

struct Subscriber {
    arena: Option<SharedArena>,
    /// The largest message its connection sends inline, copied into the ring: it needs no
    /// block of the arena for those (`Connection::inline_max`).
    inline_max: usize,
    /// The largest message its call may send (its server's `max_send_message_length`;
    /// `usize::MAX` for none): a larger one ends the call RESOURCE_EXHAUSTED instead of going
    /// out.
    max_send: usize,
    queue: Mutex<Queue>,
    wake: Notify,
}

impl Subscriber {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// RESOURCE_EXHAUSTED if a message of `len` bytes is over this subscriber's limit.
    fn check_size(&self, topic: &str, len: usize) -> Result<(), Status> {
        if len <= self.max_send {
            return Ok(());
        }
        let max = self.max_send;
        Err(Status::new(
            Code::ResourceExhausted,
            format!("topic {topic:?}: trying to send message larger than max ({len} vs. {max})"),
        ))
    }

    fn end(&self, how: Result<(), Status>) {
        let mut q = self.queue();
        // A cancel cuts an end that was waiting for the queue.
        if q.end.is_none() || (q.end_waits && how.is_err()) {
            q.end = Some(how);
            q.end_waits = false;
        }
        drop(q);
        self.wake.notify_one();
    }

    /// The status this subscriber was cut off with, if it was: an end that does not wait for
    /// the queue.
    fn cut(&self) -> Option<Status> {
        let q = self.queue();
        match &q.end {
            Some(Err(status)) if !q.end_waits => Some(status.clone()),
            _ => None,
        }
    }

    /// Ends the subscription with `status` once its queue is sent (a send under way goes on).
    fn end_after_queue(&self, status: Status) {
        let mut q = self.queue();
        if q.end.is_none() {
            q.end = Some(Err(status));
            q.end_waits = true;
        }
    }
}

/// What became of a message offered to one subscriber.
enum Offered {
    /// Sent or queued: the subscriber counts as reached.
    Taken,
    /// Not queued: the subscriber is ending (a shutdown's end waits for its queue), and leaves
    /// when its handler does.
    Ending,
    /// Not queued: the subscriber fell too far behind and is cancelled; it leaves now.
    Cancelled,
}

#[derive(Default)]
struct Members {
    by_id: HashMap<u64, Arc<Subscriber>>,
    next_id: u64,
    seq: u64,
    state: Option<Published>,
    closed: bool,
}

struct Inner {
    name: String,
    options: TopicOptions,
    members: Mutex<Members>,
    published: AtomicU64,
    bytes: AtomicU64,
    delivered: AtomicU64,
    dropped: AtomicU64,
    cancelled: AtomicU64,
}

impl Inner {
    fn members(&self) -> MutexGuard<'_, Members> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stream of messages that any number of server-streaming calls subscribe to. Cheap to clone;
/// clones are the same topic.
#[derive(Clone)]
pub struct Topic {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Topic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topic").field("name", &self.inner.name).field("stats", &self.stats()).finish()
    }
}

impl Topic {
    /// A topic with the default options: 64 messages per subscriber, then drop the oldest.
    pub fn new(name: impl Into<String>) -> Topic {
        Topic::with_options(name, TopicOptions::default())
    }

    /// A topic with `options` (a capacity of 0 counts as 1).
    pub fn with_options(name: impl Into<String>, options: TopicOptions) -> Topic {
        let options = TopicOptions { capacity: options.capacity.max(1), ..options };
        Topic {
            inner: Arc::new(Inner {
                name: name.into(),
                options,
                members: Mutex::default(),
                published: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                delivered: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
                cancelled: AtomicU64::new(0),
            }),
        }
    }

    /// The topic's name (in the status of a subscriber it cancels).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The topic's options.
    pub fn options(&self) -> TopicOptions {
        self.inner.options
    }

    /// Queues `message` for every current subscriber; returns how many took it (one that is
    /// ending, on a server's shutdown or a cancel, takes no more and is not counted). Never
    /// waits. After [`close`](Self::close), does nothing and returns 0.
    pub fn publish(&self, message: &[u8]) -> usize {
        self.publish_inner(message, false)
    }

    /// [`publish`](Self::publish), and keeps `message` as the topic's current state: every
    /// later subscriber receives it first.
    pub fn publish_state(&self, message: &[u8]) -> usize {
        self.publish_inner(message, true)
    }

    /// The current state ([`publish_state`](Self::publish_state)), if any: what a gap's resync
    /// usually sends ([`serve_with`](Self::serve_with)).
    pub fn state(&self) -> Option<Bytes> {
        self.inner.members().state.as_ref().map(Published::bytes)
    }

    /// The current state, if no plain [`publish`](Self::publish) came after it: what a resync
    /// may send in place of dropped messages. A state older than a message published since
    /// would take a subscriber back past what it may have had already (state v1 sent again in
    /// place of deltas published after it).
    pub fn current_state(&self) -> Option<Bytes> {
        let m = self.inner.members();
        m.state.as_ref().filter(|s| s.0.seq == m.seq).map(Published::bytes)
    }

    /// Forgets the current state: later subscribers start with the next message.
    pub fn clear_state(&self) {
        self.inner.members().state = None;
    }

    fn publish_inner(&self, message: &[u8], keep: bool) -> usize {
        let mut m = self.inner.members();
        if m.closed {
            return 0;
        }
        m.seq += 1;
        let published = self.write_once(m.seq, message, m.by_id.values());
        let mut reached = 0;
        let mut cancelled = Vec::new();
        for (&id, sub) in &m.by_id {
            match self.offer(sub, &published) {
                Offered::Taken => reached += 1,
                Offered::Ending => {}
                Offered::Cancelled => cancelled.push(id),
            }
        }
        for id in cancelled {
            m.by_id.remove(&id);
        }
        if keep {
            m.state = Some(published);
        }
        self.inner.published.fetch_add(1, Ordering::Relaxed);
        self.inner.bytes.fetch_add(message.len() as u64, Ordering::Relaxed);
        reached
    }

    /// The message written once into every shared arena among `subs`, and into the heap if a
    /// subscriber has no block of it (no arena, a full one, or a message small enough to go
    /// inline).
    fn write_once<'a>(&self, seq: u64, message: &[u8], subs: impl Iterator<Item = &'a Arc<Subscriber>>) -> Published {
        let mut blocks: Vec<SharedBlock> = Vec::new();
        // Arenas with no room for it: asked once per publish (a full arena drains every
        // connection it serves before it says no).
        let mut full: Vec<&SharedArena> = Vec::new();
        let mut heap = false;
        for sub in subs {
            if message.len() <= sub.inline_max {
                heap = true; // its connection copies it into the ring
                continue;
            }
            match &sub.arena {
                Some(arena) if blocks.iter().any(|b| b.arena().same(arena)) => {}
                Some(arena) if full.iter().any(|f| f.same(arena)) => {}
                Some(arena) => match arena.try_alloc(message.len()) {
                    Ok(Some(mut block)) => {
                        block.copy_from_slice(message);
                        blocks.push(block.freeze());
                    }
                    // Full, or too large for it: this arena's subscribers get copies.
                    _ => {
                        heap = true;
                        full.push(arena);
                    }
                },
                None => heap = true,
            }
        }
        // With no subscriber at all, the heap copy is what a late joiner gets as the state.
        let heap = (heap || blocks.is_empty()).then(|| Bytes::copy_from_slice(message));
        Published(Arc::new(PublishedInner { seq, len: message.len(), heap, blocks }))
    }

    /// Queues `p` for `sub`, or sends it at once on its call; what became of it.
    fn offer(&self, sub: &Subscriber, p: &Published) -> Offered {
        let mut q = sub.queue();
        if q.end.is_some() {
            return Offered::Ending; // it leaves when its handler does
        }
        if let Err(status) = sub.check_size(&self.inner.name, p.len()) {
            // As a handler's send over its server's limit ends its call, after what it sent
            // before: this subscriber only, once its queue is sent.
            q.end = Some(Err(status));
            q.end_waits = true;
            drop(q);
            sub.wake.notify_one();
            return Offered::Cancelled;
        }
        if q.items.is_empty() && q.gap == 0 && !q.busy {
            if let Some(direct) = &q.direct {
                let block = sub.arena.as_ref().and_then(|a| p.shared_block(a));
                if direct.try_send(block, || p.bytes()) {
                    self.inner.delivered.fetch_add(1, Ordering::Relaxed);
                    return Offered::Taken;
                }
            }
        }
        if q.items.len() - usize::from(q.state_first) >= self.inner.options.capacity {
            match self.inner.options.slow {
                SlowSubscriber::DropOldest => {
                    // The initial state goes first, and with it its place beside the `capacity`
                    // messages: the oldest of them goes too, or the queue held one over its
                    // bound for good.
                    while q.items.len() - usize::from(q.state_first) >= self.inner.options.capacity {
                        q.items.pop_front();
                        q.state_first = false;
                        q.gap += 1;
                        self.inner.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                SlowSubscriber::Cancel => {
                    q.items.clear();
                    q.end = Some(Err(Status::new(
                        Code::ResourceExhausted,
                        format!(
                            "the subscriber fell {} messages behind topic {:?} and was cancelled",
                            self.inner.options.capacity, self.inner.name
                        ),
                    )));
                    drop(q);
                    sub.wake.notify_one();
                    self.inner.cancelled.fetch_add(1, Ordering::Relaxed);
                    return Offered::Cancelled;
                }
            }
        }
        q.items.push_back(p.clone());
        drop(q);
        sub.wake.notify_one();
        Offered::Taken
    }

    /// Subscribes with no shared arena: every message arrives as [`Published::bytes`].
    pub fn subscribe(&self) -> Subscription {
        self.subscribe_for(None)
    }

    /// Subscribes a consumer that sends through `arena` (a call's
    /// [`shared_arena`](ServerCall::shared_arena)), so `publish` writes each message there once.
    /// The current state, if any, is queued first. After [`close`](Self::close) the subscription
    /// ends at once, with OK.
    pub fn subscribe_for(&self, arena: Option<&SharedArena>) -> Subscription {
        self.subscribe_sending(arena, INLINE, usize::MAX)
    }

    /// [`subscribe_for`](Self::subscribe_for) a call whose connection sends messages up to
    /// `inline_max` bytes inline (`publish` writes no block for those) and that may send
    /// messages of at most `max_send` bytes (`usize::MAX`: any).
    pub(crate) fn subscribe_sending(
        &self,
        arena: Option<&SharedArena>,
        inline_max: usize,
        max_send: usize,
    ) -> Subscription {
        let sub = Arc::new(Subscriber {
            arena: arena.cloned(),
            inline_max,
            max_send,
            queue: Mutex::default(),
            wake: Notify::new(),
        });
        let mut m = self.inner.members();
        let id = m.next_id;
        m.next_id += 1;
        let state_too_large = m.state.as_ref().and_then(|state| sub.check_size(&self.inner.name, state.len()).err());
        if m.closed {
            sub.end(Ok(()));
        } else if let Some(status) = state_too_large {
            sub.end(Err(status));
        } else {
            if let Some(state) = &m.state {
                let mut q = sub.queue();
                q.items.push_back(state.clone());
                q.state_first = true;
            }
            m.by_id.insert(id, sub.clone());
        }
        Subscription { topic: self.inner.clone(), id, sub, going_away: None }
    }

    /// Delivers the topic to `call` until the client leaves (the engine then drops this future)
    /// or the topic closes (`Ok`); an error if the call fails or the subscriber is cancelled for
    /// falling behind, at once, even while a send waits for a client that stopped reading; and
    /// UNAVAILABLE once the server starts to shut down and what was queued is sent. Gaps are
    /// skipped; see [`serve_with`](Self::serve_with).
    pub async fn serve(&self, call: &mut ServerCall) -> Result<(), Status> {
        self.serve_inner(call, usize::MAX, None).await
    }

    /// [`serve`](Self::serve), calling `on_gap(n)` when messages were dropped for this
    /// subscriber (`n` counts them and those still queued): a message it returns is sent in
    /// place of them all, a resync (the full state, say); with `None` the queued ones are sent
    /// still. Messages published while `on_gap` runs follow the resync and may already be in
    /// it: give the state a version the client can compare.
    pub async fn serve_with(
        &self,
        call: &mut ServerCall,
        mut on_gap: impl FnMut(u64) -> Option<Bytes> + Send,
    ) -> Result<(), Status> {
        self.serve_inner(call, usize::MAX, Some(&mut on_gap)).await
    }

    /// [`serve_with`](Self::serve_with) (or [`serve`](Self::serve), with no `on_gap`) for a
    /// server whose handlers send messages of at most `max_send` bytes (gRPC's
    /// `max_send_message_length`): a message, state or resync over it ends this subscriber's
    /// call with RESOURCE_EXHAUSTED, naming its size and the limit; the other subscribers
    /// go on.
    pub async fn serve_limited(
        &self,
        call: &mut ServerCall,
        max_send: usize,
        on_gap: Option<&mut (dyn FnMut(u64) -> Option<Bytes> + Send)>,
    ) -> Result<(), Status> {
        self.serve_inner(call, max_send, on_gap).await
    }

    async fn serve_inner(
        &self,
        call: &mut ServerCall,
        max_send: usize,
        mut on_gap: Option<&mut (dyn FnMut(u64) -> Option<Bytes> + Send)>,
    ) -> Result<(), Status> {
        let mut sub = self.subscribe_sending(call.shared_arena(), call.inline_max(), max_send);
        sub.end_when(call.going_away());
        sub.send_directly(call.direct().await?);
        while let Some(next) = sub.next().await? {
            let (message, published) = match next {
                Delivery::Gap(n) => match on_gap.as_mut().map(|on_gap| self.resync(&sub, n, on_gap)).transpose()? {
                    Some(Some(resync)) => (Outgoing::Bytes(resync), false),
                    _ => continue,
                },
                Delivery::Message(p) => match call.shared_arena().and_then(|a| p.shared_block(a)).cloned() {
                    Some(block) => (Outgoing::Shared(block), true),
                    None => (Outgoing::Bytes(p.bytes()), true),
                },
            };
            let send = async {
                match &message {
                    Outgoing::Shared(block) => call.send_shared(block).await,
                    Outgoing::Bytes(bytes) => call.send(bytes).await,
                }
            };
            // A client that stopped reading holds the send; the topic's verdict must not wait
            // for it.
            tokio::select! {
                biased;
                sent = send => sent?,
                status = sub.cancelled() => return Err(status),
            }
            if published {
                self.inner.delivered.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// A subscriber's resync after `n` messages were dropped for it: the messages still queued
    /// are taken out and `on_gap(n + their count)` asked. With a message, they are dropped (it
    /// goes in their place: the state, say, newer than them); without, they go back in front
    /// of what was published meanwhile, to be delivered after all. A message over the
    /// subscriber's `max_send` is RESOURCE_EXHAUSTED, as a published one is when offered.
    pub(crate) fn resync(
        &self,
        sub: &Subscription,
        n: u64,
        on_gap: &mut dyn FnMut(u64) -> Option<Bytes>,
    ) -> Result<Option<Bytes>, Status> {
        let queued = std::mem::take(&mut sub.sub.queue().items);
        let count = queued.len() as u64;
        let resync = on_gap(n + count);
        match resync {
            Some(_) => {
                self.inner.dropped.fetch_add(count, Ordering::Relaxed);
            }
            None => {
                let mut q = sub.sub.queue();
                let later = std::mem::replace(&mut q.items, queued);
                q.items.extend(later);
                // Past the capacity by what came meanwhile: the oldest go, as in `offer`.
                while q.items.len() > self.inner.options.capacity {
                    q.items.pop_front();
                    q.gap += 1;
                    self.inner.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if let Some(message) = &resync {
            sub.sub.check_size(&self.inner.name, message.len())?;
        }
        Ok(resync)
    }

    /// Counts a message a binding delivered itself (the Python and C bindings send on their own
    /// calls).
    pub(crate) fn count_delivered(&self) {
        self.inner.delivered.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends every subscription with OK once it has sent what it has queued; later publishes do
    /// nothing and later subscriptions end at once. The state ([`state`](Self::state)) stays,
    /// in the heap: the arena's block goes back once the subscribers have sent it.
    pub fn close(&self) {
        let subs: Vec<Arc<Subscriber>> = {
            let mut m = self.inner.members();
            m.closed = true;
            if let Some(state) = m.state.as_mut().filter(|s| !s.0.blocks.is_empty()) {
                let heap = Some(state.bytes());
                *state = Published(Arc::new(PublishedInner { heap, blocks: Vec::new(), ..*state.0 }));
            }
            m.by_id.drain().map(|(_, s)| s).collect()
        };
        for sub in subs {
            sub.end(Ok(()));
        }
    }

    /// The topic's counters now.
    pub fn stats(&self) -> TopicStats {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TopicStats {
            subscribers: self.inner.members().by_id.len(),
            published: load(&self.inner.published),
            bytes: load(&self.inner.bytes),
            delivered: load(&self.inner.delivered),
            dropped: load(&self.inner.dropped),
            cancelled: load(&self.inner.cancelled),
        }
    }
}

/// One subscriber's place in a [`Topic`]: its queue, read with [`next`](Self::next). Dropping
/// it leaves the topic.
pub struct Subscription {
    topic: Arc<Inner>,
    id: u64,
    sub: Arc<Subscriber>,
    /// The serving call's server, until it starts to shut down ([`end_when`](Self::end_when)).
    going_away: Option<GoingAway>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").field("topic", &self.topic.name).field("id", &self.id).finish()
    }
}

impl Subscription {
    /// The next delivery: a gap first if messages were dropped, then the oldest queued
    /// message; waits for one. `Ok(None)` once the topic closed and the queue is empty; the
    /// error of a subscriber cancelled for falling behind, or by its [`canceller`](Self::canceller).
    pub async fn next(&mut self) -> Result<Option<Delivery>, Status> {
        loop {
            // Looked at before the queue, not only when it is empty: a topic that publishes as
            // fast as this subscriber sends would never let it see the shutdown.
            if self.going_away.as_ref().is_some_and(GoingAway::is_set) {
                self.going_away = None;
                self.sub.end_after_queue(Status::new(Code::Unavailable, GOING_AWAY));
            }
            {
                let mut q = self.sub.queue();
                // Asking for the next one means the last is sent: direct sends may go again
                // once the queue is empty.
                q.busy = false;
                if q.gap > 0 {
                    q.busy = true;
                    return Ok(Some(Delivery::Gap(std::mem::take(&mut q.gap))));
                }
                if let Some(p) = q.items.pop_front() {
                    q.state_first = false;
                    q.busy = true;
                    return Ok(Some(Delivery::Message(p)));
                }
                if let Some(end) = &q.end {
                    return end.clone().map(|()| None);
                }
            }
            // A notification sent between the check and here is kept as a permit.
            match &self.going_away {
                Some(going_away) => tokio::select! {
                    biased;
                    () = self.sub.wake.notified() => {}
                    () = going_away.wait() => {} // the look above ends it
                },
                None => self.sub.wake.notified().await,
            }
        }
    }

    /// Ends this subscription with UNAVAILABLE, after what it has queued, once the server of
    /// the call that serves it starts to shut down.
    pub(crate) fn end_when(&mut self, going_away: GoingAway) {
        self.going_away = Some(going_away);
    }

    /// Resolves with the status this subscription was ended with: cancelled for falling behind
    /// ([`SlowSubscriber::Cancel`]) or by its [`canceller`](Self::canceller). Pending while it
    /// lives or once it ended OK. Race it against a send that a stalled client holds up.
    pub async fn cancelled(&self) -> Status {
        loop {
            let notified = self.sub.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(status) = self.sub.cut() {
                return status;
            }
            notified.await;
            // `next` checks the queue before it waits, so the wake-up taken here loses nothing.
        }
    }

    /// A handle that ends this subscription from any thread: its `next` then returns
    /// CANCELLED. For bindings whose calls end through a callback.
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let sub = self.sub.clone();
        move || sub.end(Err(Status::new(Code::Cancelled, "the subscriber's call ended")))
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.topic.members().by_id.remove(&self.id);
        let mut q = self.sub.queue();
        q.direct = None;
        // Nobody takes what is queued any more. A canceller the call keeps until it ends holds
        // the subscriber, and held the queue with it: an abandoned asyncio subscription pinned
        // up to `capacity` messages (blocks of the shared arena) for the rest of its call. The
        // end refuses what a publish that found this subscriber before it left still offers.
        q.items.clear();
        q.state_first = false;
        q.gap = 0;
        if q.end.is_none() {
            q.end = Some(Err(Status::new(Code::Cancelled, "the subscription was dropped")));
        }
    }
}

impl Subscription {
    /// Lets a publish send to `direct` (this subscriber's call) while nothing of this
    /// subscription's is queued or under way.
    pub(crate) fn send_directly(&self, direct: Direct) {
        self.sub.queue().direct = Some(direct);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next_now(sub: &mut Subscription) -> Option<Result<Option<Delivery>, Status>> {
        let mut fut = std::pin::pin!(sub.next());
        match fut.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Ready(r) => Some(r),
            std::task::Poll::Pending => None,
        }
    }

    fn message(d: Option<Result<Option<Delivery>, Status>>) -> Vec<u8> {
        match d {
            Some(Ok(Some(Delivery::Message(p)))) => p.bytes().to_vec(),
            other => panic!("expected a message, got {other:?}"),
        }
    }

    use std::future::Future;

    #[test]
    fn a_message_over_a_subscribers_limit_ends_that_subscriber_only() {
        let topic = Topic::new("t");
        let mut small = topic.subscribe_sending(None, INLINE, 4);
        let mut any = topic.subscribe();
        assert_eq!(topic.publish(b"four"), 2, "at the limit: both");
        assert_eq!(topic.publish(b"fives"), 1, "over it: only the subscriber with no limit");
        assert_eq!(message(next_now(&mut small)), b"four");
        match next_now(&mut small) {
            Some(Err(status)) => {
                assert_eq!(status.code(), Code::ResourceExhausted);
                assert!(status.message().contains("(5 vs. 4)"), "{}", status.message());
            }
            other => panic!("expected RESOURCE_EXHAUSTED, got {other:?}"),
        }
        assert_eq!(topic.stats().subscribers, 1, "it left the topic");
        assert_eq!(message(next_now(&mut any)), b"four");
        assert_eq!(message(next_now(&mut any)), b"fives");
        let resync = topic.resync(&small, 1, &mut |_| Some(Bytes::from_static(b"fives")));
        assert_eq!(resync.map_err(|s| s.code()), Err(Code::ResourceExhausted), "a resync too");

        // A state over the limit ends a subscriber that joins after it, before anything is sent.
        topic.publish_state(b"state!");
        let mut late = topic.subscribe_sending(None, INLINE, 4);
        assert!(matches!(next_now(&mut late), Some(Err(s)) if s.code() == Code::ResourceExhausted));
        assert_eq!(topic.stats().cancelled, 0, "not counted as falling behind");
    }

    #[test]
    fn every_subscriber_gets_every_message_in_order_and_late_joiners_the_state() {
        let topic = Topic::new("t");
        let mut a = topic.subscribe();
        topic.publish_state(b"state-1");
        assert_eq!(topic.state().as_deref(), Some(&b"state-1"[..]));
        topic.publish(b"m2");
        let mut b = topic.subscribe();
        assert_eq!(topic.stats().subscribers, 2);
        topic.publish(b"m3");
        for want in [&b"state-1"[..], b"m2", b"m3"] {
            assert_eq!(message(next_now(&mut a)), want);
        }
        assert_eq!(message(next_now(&mut b)), b"state-1");
        assert_eq!(message(next_now(&mut b)), b"m3");
        assert!(next_now(&mut a).is_none(), "nothing more: it waits");
        drop(b);
        assert_eq!(topic.stats().subscribers, 1, "a dropped subscription leaves at once");
        topic.close();
        assert!(matches!(next_now(&mut a), Some(Ok(None))));
        assert_eq!(topic.publish(b"late"), 0);
        let mut c = topic.subscribe();
        assert!(matches!(next_now(&mut c), Some(Ok(None))), "a subscription after close ends at once");
    }

    #[test]
    fn the_current_state_is_one_no_plain_message_came_after() {
        let topic = Topic::new("t");
        assert!(topic.current_state().is_none());
        topic.publish_state(b"v1");
        assert_eq!(topic.current_state().as_deref(), Some(&b"v1"[..]));
        topic.publish(b"delta");
        assert!(topic.current_state().is_none(), "v1 is older than the delta");
        assert_eq!(topic.state().as_deref(), Some(&b"v1"[..]), "still what a new subscriber gets");
        topic.publish_state(b"v2");
        assert_eq!(topic.current_state().as_deref(), Some(&b"v2"[..]));
    }

    #[test]
    fn a_dropped_subscription_lets_go_of_its_queue_though_its_canceller_lives_on() {
        let topic = Topic::new("t");
        let sub = topic.subscribe();
        let cancel = sub.canceller(); // kept by the call, which lives on
        let held = sub.sub.clone();
        topic.publish_state(b"state");
        topic.publish(b"m1");
        assert_eq!(held.queue().items.len(), 2);
        drop(sub);
        assert!(held.queue().items.is_empty(), "the queue went with the subscription");
        assert_eq!(topic.publish(b"m2"), 0, "nobody takes it");
        assert!(held.queue().items.is_empty());
        cancel(); // what the call's end does: nothing left to do
        assert!(held.queue().items.is_empty());
    }

    #[test]
    fn a_slow_subscriber_loses_its_oldest_messages_not_the_others_pace() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 2, slow: SlowSubscriber::DropOldest });
        let mut slow = topic.subscribe();
        let mut fast = topic.subscribe();
        for i in 0..5u8 {
            assert_eq!(topic.publish(&[i]), 2);
            assert_eq!(message(next_now(&mut fast)), [i]);
        }
        assert!(matches!(next_now(&mut slow), Some(Ok(Some(Delivery::Gap(3))))));
        assert_eq!(message(next_now(&mut slow)), [3]);
        assert_eq!(message(next_now(&mut slow)), [4]);
        assert_eq!(topic.stats().dropped, 3);
    }

    #[test]
    fn or_is_cancelled_with_resource_exhausted() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 2, slow: SlowSubscriber::Cancel });
        let mut slow = topic.subscribe();
        let mut fast = topic.subscribe();
        for i in 0..3u8 {
            topic.publish(&[i]);
            assert_eq!(message(next_now(&mut fast)), [i]);
        }
        match next_now(&mut slow) {
            Some(Err(s)) => {
                assert_eq!(s.code(), Code::ResourceExhausted);
                assert!(s.message().contains("\"t\""), "{s:?}");
            }
            other => panic!("{other:?}"),
        }
        let stats = topic.stats();
        assert_eq!((stats.subscribers, stats.cancelled), (1, 1));
    }

    #[test]
    fn a_cancelled_subscriber_learns_it_without_reading() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 1, slow: SlowSubscriber::Cancel });
        let stuck = topic.subscribe();
        let mut cancelled = std::pin::pin!(stuck.cancelled());
        let mut poll =
            || cancelled.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())).map(|s| s.code());
        assert!(poll().is_pending());
        topic.publish(b"1");
        assert!(poll().is_pending(), "one message fits");
        topic.publish(b"2");
        assert_eq!(poll(), std::task::Poll::Ready(Code::ResourceExhausted));
    }

    /// The end a server's shutdown gives lets the queue and a send under way go first, which
    /// a cancel does not: `cancelled` (raced against a send) ignores it until a cancel comes.
    #[test]
    fn an_end_after_the_queue_cuts_no_send_but_a_cancel_still_does() {
        let topic = Topic::new("t");
        let sub = topic.subscribe();
        topic.publish(b"queued");
        sub.sub.end_after_queue(Status::new(Code::Unavailable, GOING_AWAY));
        let poll_cancelled = || {
            let cancelled = std::pin::pin!(sub.cancelled());
            cancelled.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())).map(|s| s.code())
        };
        assert!(poll_cancelled().is_pending());
        let cancel = sub.canceller();
        cancel();
        assert_eq!(poll_cancelled(), std::task::Poll::Ready(Code::Cancelled));

        let mut sub = topic.subscribe();
        topic.publish(b"queued");
        sub.sub.end_after_queue(Status::new(Code::Unavailable, GOING_AWAY));
        assert_eq!(topic.publish(b"after the end"), 0, "not queued, so not counted as reached");
        assert_eq!(message(next_now(&mut sub)), b"queued");
        match next_now(&mut sub) {
            Some(Err(status)) => assert_eq!(status.code(), Code::Unavailable),
            other => panic!("expected the end, got {other:?}"),
        }
    }

    #[test]
    fn a_resync_replaces_what_was_queued() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 2, slow: SlowSubscriber::DropOldest });
        let mut sub = topic.subscribe();
        for i in 0..5u8 {
            topic.publish(&[i]);
        }
        assert!(matches!(next_now(&mut sub), Some(Ok(Some(Delivery::Gap(3))))));
        let mut asked = 0;
        let resync = topic.resync(&sub, 3, &mut |n| {
            asked = n;
            Some(Bytes::from_static(b"state"))
        });
        let resync = resync.expect("no limit");
        assert_eq!((resync.as_deref(), asked), (Some(&b"state"[..]), 5), "messages 3 and 4 go: the resync is newer");
        topic.publish(&[5]);
        assert_eq!(message(next_now(&mut sub)), [5]);
        assert_eq!(topic.stats().dropped, 5);
    }

    /// A gap with no resync to send (no state yet) keeps what is queued: it was dropped, and
    /// nothing went in its place (the C ABI's resync with the state lost up to a queue's worth
    /// so).
    #[test]
    fn a_gap_with_no_resync_keeps_what_is_queued() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 2, slow: SlowSubscriber::DropOldest });
        let mut sub = topic.subscribe();
        for i in 0..5u8 {
            topic.publish(&[i]);
        }
        assert!(matches!(next_now(&mut sub), Some(Ok(Some(Delivery::Gap(3))))));
        assert_eq!(topic.resync(&sub, 3, &mut |_| None).expect("no limit"), None);
        assert_eq!((message(next_now(&mut sub)), message(next_now(&mut sub))), (vec![3], vec![4]));
        assert_eq!(topic.stats().dropped, 3);
    }

    /// A late joiner's state does not count against its capacity: a subscriber of capacity 1
    /// is not cancelled by the first publish after it joined, and gets both.
    #[test]
    fn the_state_a_late_joiner_gets_first_is_not_counted_against_its_capacity() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 1, slow: SlowSubscriber::Cancel });
        topic.publish_state(b"state");
        let mut sub = topic.subscribe();
        topic.publish(b"x");
        assert_eq!((message(next_now(&mut sub)), message(next_now(&mut sub))), (b"state".to_vec(), b"x".to_vec()));
    }

    /// Once a late joiner falls behind, its queue holds `capacity` messages, not one more: the
    /// state went first, and its place with it. Before, it held capacity + 1 for good.
    #[test]
    fn a_late_joiner_that_falls_behind_holds_its_capacity_and_no_more() {
        let topic = Topic::with_options("t", TopicOptions { capacity: 2, slow: SlowSubscriber::DropOldest });
        topic.publish_state(b"state");
        let mut sub = topic.subscribe();
        for m in [b"a", b"b", b"c", b"d"] {
            topic.publish(m);
        }
        // Dropped: the state, a and b (the two that made room for c and d).
        assert!(matches!(next_now(&mut sub), Some(Ok(Some(Delivery::Gap(3))))));
        assert_eq!((message(next_now(&mut sub)), message(next_now(&mut sub))), (b"c".to_vec(), b"d".to_vec()));
        assert!(next_now(&mut sub).is_none(), "nothing more queued");
        assert_eq!(topic.stats().dropped, 3);
    }

    #[test]
    fn large_messages_are_written_once_per_arena() {
        let arena = isthmus_shm::SharedArena::for_tests(1 << 20).expect("arena");
        let topic = Topic::new("t");
        let mut subs: Vec<Subscription> = (0..4).map(|_| topic.subscribe_for(Some(&arena))).collect();
        let big = vec![7u8; 100_000];
        topic.publish(&big);
        assert_eq!(arena.in_use(), 100_000usize.next_multiple_of(4096), "one block for four subscribers");
        for s in &mut subs {
            match next_now(s) {
                Some(Ok(Some(Delivery::Message(p)))) => {
                    assert!(p.shared_block(&arena).is_some());
                    assert!(p.0.heap.is_none(), "no heap copy when every subscriber has the block");
                }
                other => panic!("{other:?}"),
            }
        }
        drop(subs);
        assert_eq!(arena.in_use(), 0, "freed with the last reference");
    }

    #[test]
    fn a_closed_topic_keeps_its_state_but_not_its_block() {
        let arena = isthmus_shm::SharedArena::for_tests(1 << 20).expect("arena");
        let topic = Topic::new("t");
        let sub = topic.subscribe_for(Some(&arena));
        let state = vec![5u8; 100_000];
        topic.publish_state(&state);
        drop(sub); // it never sent the state
        assert!(arena.in_use() > 0);
        topic.close();
        assert_eq!(arena.in_use(), 0, "the block pinned by the state went back (it stayed before)");
        assert_eq!(topic.state().as_deref(), Some(&state[..]));
    }

    #[test]
    fn the_inline_size_is_the_subscribers_connections() {
        // A 4 KiB message: inline under the default 8 KiB (a heap copy, no block); one block
        // for subscribers whose connections send at most 1 KiB inline (before, they got the
        // heap copy, and each connection copied it into a block of its own).
        let arena = isthmus_shm::SharedArena::for_tests(1 << 20).expect("arena");
        let topic = Topic::new("t");
        let message = vec![3u8; 4096];
        let mut default = topic.subscribe_for(Some(&arena));
        topic.publish(&message);
        assert_eq!(arena.in_use(), 0, "inline for a connection of the default size");
        let mut small = [(); 2].map(|_| topic.subscribe_sending(Some(&arena), 1024, usize::MAX));
        assert!(matches!(next_now(&mut default), Some(Ok(Some(Delivery::Message(_))))));
        topic.publish(&message);
        assert_eq!(arena.in_use(), 4096, "one block for the two small-ring subscribers");
        for s in small.iter_mut() {
            match next_now(s) {
                Some(Ok(Some(Delivery::Message(p)))) => assert!(p.shared_block(&arena).is_some()),
                other => panic!("{other:?}"),
            }
        }
        match next_now(&mut default) {
            Some(Ok(Some(Delivery::Message(p)))) => assert!(p.0.heap.is_some(), "and a heap copy for the other"),
            other => panic!("{other:?}"),
        }
    }
}
