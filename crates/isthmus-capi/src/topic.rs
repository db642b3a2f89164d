//! Push to many subscribers from C (the engine's `isthmus::Topic`, ADR 0016): a topic a server
//! serves at a method path, whose clients subscribe with a server-streaming call to it, and a
//! publish that reaches every current subscriber with one write into shared memory.

use std::ffi::c_char;

use isthmus::{SlowSubscriber, Topic, TopicOptions};

use crate::abi::{c_bytes, c_str, entry, entry_out, invalid, isthmus_code_t, isthmus_status_t, put};
use crate::handle::Registry;
use crate::server::{build_at, isthmus_server_t};

/// A topic: publish to it from any thread; a server serves it at a method path
/// (`isthmus_server_add_topic`).
pub struct isthmus_topic_t {
    topic: Topic,
    /// `ISTHMUS_TOPIC_RESYNC_STATE`.
    resync: bool,
}

pub(crate) static TOPICS: Registry<isthmus_topic_t> = Registry::new("topic");

/// Options of a topic. Zero-initialise it, then set what you need; NULL means defaults.
#[repr(C)]
pub struct isthmus_topic_options_t {
    /// Messages queued per subscriber before its queue counts as full; 0 for the default (64).
    pub capacity: u32,
    /// `ISTHMUS_TOPIC_*` flags ORed together, or 0.
    pub flags: u32,
}

/// Topic flag: a subscriber whose queue is full has its call ended RESOURCE_EXHAUSTED. Without
/// it, its oldest queued message is dropped (counted in `isthmus_topic_stats_t.dropped`) and it
/// goes on with the newer ones.
pub const ISTHMUS_TOPIC_CANCEL_SLOW: u32 = 1;

/// Topic flag: when a subscriber's queue overflowed (messages were dropped for it), the messages
/// still queued for it are dropped too and the topic's state (`isthmus_topic_publish_state`) is
/// sent in their place, a resync. With no state, or one a plain `isthmus_topic_publish` came
/// after (sent again, it would take the subscriber back past those messages), the queued
/// messages are sent as they are.
pub const ISTHMUS_TOPIC_RESYNC_STATE: u32 = 2;

/// A topic's counters (`isthmus_topic_stats`); fields are only ever appended.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct isthmus_topic_stats_t {
    /// Subscribers now.
    pub subscribers: u64,
    /// Messages published.
    pub published: u64,
    /// Payload bytes published, each message counted once however many it reached.
    pub bytes: u64,
    /// Messages sent to subscribers, one per subscriber reached.
    pub delivered: u64,
    /// Messages dropped from full queues.
    pub dropped: u64,
    /// Subscribers ended for falling behind (`ISTHMUS_TOPIC_CANCEL_SLOW`).
    pub cancelled: u64,
}

/// Makes a topic named `name` (for logs). Free it with `isthmus_topic_free`; a server that
/// serves it keeps it alive meanwhile.
///
/// Thread-safety: any thread.
///
/// # Safety
///
/// `name` is NUL-terminated; `opts` is NULL or valid; `out` is writable; `status` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_topic_new(
    name: *const c_char,
    opts: *const isthmus_topic_options_t,
    out: *mut *mut isthmus_topic_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        entry_out(out, "topic", status, || {
            let name = c_str(name, "the topic's name")?;
            let mut options = TopicOptions::default();
            if let Some(o) = opts.as_ref() {
                if o.flags & !(ISTHMUS_TOPIC_CANCEL_SLOW | ISTHMUS_TOPIC_RESYNC_STATE) != 0 {
                    return Err(invalid(format!("unknown topic flags {:#x}", o.flags)));
                }
                if o.capacity > 0 {
                    options.capacity = o.capacity as usize;
                }
                if o.flags & ISTHMUS_TOPIC_CANCEL_SLOW != 0 {
                    options.slow = SlowSubscriber::Cancel;
                }
            }
            let resync = opts.as_ref().is_some_and(|o| o.flags & ISTHMUS_TOPIC_RESYNC_STATE != 0);
            Ok(Some(TOPICS.add(isthmus_topic_t { topic: Topic::with_options(name, options), resync })))
        })
    }
}

/// Publishes `len` bytes to every current subscriber and stores how many it reached in
/// `*reached` (NULL: not wanted). It never waits: each subscriber's queue takes the message (a
/// full one meets the topic's policy). The bytes are copied before it returns. After
/// `isthmus_topic_close`, nothing is published (0 reached).
///
/// Thread-safety: any thread; publishes from several threads at once are ordered by a lock.
///
/// # Safety
///
/// `data` is valid for `len` bytes (or `len` is 0); `reached` and `status` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_topic_publish(
    topic: *const isthmus_topic_t,
    data: *const u8,
    len: usize,
    reached: *mut usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { publish(topic, data, len, reached, status, false) }
}

/// `isthmus_topic_publish`, also keeping the message as the topic's state: every later
/// subscriber gets it first.
///
/// Thread-safety: as `isthmus_topic_publish`.
///
/// # Safety
///
/// As `isthmus_topic_publish`.
#[no_mangle]
pub unsafe extern "C" fn isthmus_topic_publish_state(
    topic: *const isthmus_topic_t,
    data: *const u8,
    len: usize,
    reached: *mut usize,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { publish(topic, data, len, reached, status, true) }
}

/// The two publishes.
///
/// # Safety
///
/// As `isthmus_topic_publish`.
unsafe fn publish(
    topic: *const isthmus_topic_t,
    data: *const u8,
    len: usize,
    reached: *mut usize,
    status: *mut *mut isthmus_status_t,
    keep: bool,
) -> isthmus_code_t {
    // SAFETY: the caller promises `reached` is NULL or writable.
    unsafe { put(reached, 0) };
    entry(status, || {
        let topic = TOPICS.get(topic)?;
        // SAFETY: the caller promises `len` readable bytes at `data`.
        let message = unsafe { c_bytes(data, len, "the message")? };
        let n = if keep { topic.topic.publish_state(message) } else { topic.topic.publish(message) };
        // SAFETY: as above.
        unsafe { put(reached, n) };
        Ok(())
    })
}

/// Forgets the topic's state (`isthmus_topic_publish_state`): later subscribers get none.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_topic_clear_state(topic: *const isthmus_topic_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        TOPICS.get(topic)?.topic.clear_state();
        Ok(())
    })
}

/// Closes the topic: every subscription ends OK after what it has queued, and later subscribers'
/// calls end OK at once. The handle stays valid (free it with `isthmus_topic_free`).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn isthmus_topic_close(topic: *const isthmus_topic_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        TOPICS.get(topic)?.topic.close();
        Ok(())
    })
}

/// The topic's counters into `*out`; `size` is `sizeof(*out)` as the caller compiled it, and no
/// more is written (see `isthmus_channel_stats`).
///
/// Thread-safety: any thread; the counts of that moment.
///
/// # Safety
///
/// `out` is NULL or writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn isthmus_topic_stats(
    topic: *const isthmus_topic_t,
    out: *mut isthmus_topic_stats_t,
    size: usize,
) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || {
        let s = TOPICS.get(topic)?.topic.stats();
        let stats = isthmus_topic_stats_t {
            subscribers: s.subscribers as u64,
            published: s.published,
            bytes: s.bytes,
            delivered: s.delivered,
            dropped: s.dropped,
            cancelled: s.cancelled,
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { crate::stats::store(out, size, stats) }
    })
}

/// Frees the topic's handle. It does not close the topic: a server that serves it keeps it,
/// and its subscribers, until the server is freed.
///
/// Thread-safety: any thread, once.
#[no_mangle]
pub extern "C" fn isthmus_topic_free(topic: *mut isthmus_topic_t) -> isthmus_code_t {
    entry(std::ptr::null_mut(), || TOPICS.remove(topic).map(drop))
}

/// Serves `topic` at `path`: each call to it (a server-streaming call; its request is not read)
/// is a subscriber, sent the topic's state if it has one, then every message published while
/// it is subscribed, until its client cancels or goes away, or the topic closes (OK), or the
/// server starts to shut down (UNAVAILABLE, once what was queued is sent: a graceful shutdown
/// does not wait for subscribers). Before `isthmus_server_start` only; `path` is checked as
/// `isthmus_server_add_handler`'s (ALREADY_EXISTS for one that has a handler or a topic).
///
/// Thread-safety: any thread, before `isthmus_server_start` (a lock orders them).
///
/// # Safety
///
/// `path` is NUL-terminated; `status` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_add_topic(
    server: *const isthmus_server_t,
    path: *const c_char,
    topic: *const isthmus_topic_t,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    // SAFETY: the caller's promises, passed on.
    unsafe { isthmus_server_add_topic_limited(server, path, topic, 0, status) }
}

/// [`isthmus_server_add_topic`] for a server whose handlers send messages of at most
/// `max_send_message_size` bytes (gRPC's `max_send_message_length`; 0: no limit): a message,
/// state or resync over it ends that subscriber's call with `ISTHMUS_RESOURCE_EXHAUSTED`,
/// naming its size and the limit, as a handler's send of it would fail; the topic's other
/// subscribers go on, and the publish counts only those it reached.
///
/// Thread-safety: as [`isthmus_server_add_topic`].
///
/// # Safety
///
/// As [`isthmus_server_add_topic`].
#[no_mangle]
pub unsafe extern "C" fn isthmus_server_add_topic_limited(
    server: *const isthmus_server_t,
    path: *const c_char,
    topic: *const isthmus_topic_t,
    max_send_message_size: u64,
    status: *mut *mut isthmus_status_t,
) -> isthmus_code_t {
    entry(status, || {
        // SAFETY: the caller's promise, passed on.
        let path = unsafe { c_str(path, "the path")? };
        if path.is_empty() {
            return Err(invalid("a topic is served at a path, not as the fallback"));
        }
        let handle = TOPICS.get(topic)?;
        let (topic, resync) = (handle.topic.clone(), handle.resync);
        // 0, or past usize (a 32-bit host): no message can be over it.
        let max_send = match max_send_message_size {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        build_at(server, Some(path), |b| {
            b.handler(path, move |mut call| {
                let topic = topic.clone();
                async move {
                    let mut resync_with_state = |_| topic.current_state();
                    let on_gap = resync.then_some(&mut resync_with_state as &mut (dyn FnMut(u64) -> _ + Send));
                    topic.serve_limited(&mut call, max_send, on_gap).await
                }
            })
        })
    })
}
