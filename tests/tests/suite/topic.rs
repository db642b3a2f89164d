//! `isthmus::Topic` on a Rust server (this process) with subscribers in other processes
//! (`topic-subscriber`), over `shm://`, `unix://` and `http://` at once: every subscriber gets
//! every message in order, each large message is written once into the listener's shared arena,
//! and a subscriber killed while it holds blocks leaves at once and frees them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use isthmus::{ServerCall, ServerStats, SharedArena, Topic};
use isthmus_tests::{fill, fresh_addr, fresh_socket, Peer};

const PATIENCE: Duration = Duration::from_secs(30);

type Arena = Arc<Mutex<Option<SharedArena>>>;

/// A server of `topic` on shm, unix and http: the shared arena of the first call that subscribed
/// (once one has), the server's counters, the addresses.
fn serve(rt: &tokio::runtime::Runtime, topic: &Topic) -> (Arena, ServerStats, Vec<String>) {
    let (arena, bound, addresses) = bind(rt, topic, Duration::from_secs(10));
    let stats = bound.stats();
    rt.spawn(bound.serve());
    (arena, stats, addresses)
}

/// The server [`serve`] runs, bound with `grace` for its shutdown, not yet serving.
fn bind(rt: &tokio::runtime::Runtime, topic: &Topic, grace: Duration) -> (Arena, isthmus::Bound, Vec<String>) {
    let arena: Arc<Mutex<Option<SharedArena>>> = Arc::default();
    let (seen, served) = (arena.clone(), topic.clone());
    let shm = fresh_addr("topic");
    let unix = format!("unix://{}", fresh_socket("topic").display());
    let bound = rt.block_on(async {
        isthmus::Server::builder()
            .handler("/topic.Feed/Watch", move |mut call: ServerCall| {
                let (topic, seen) = (served.clone(), seen.clone());
                async move {
                    if let (Some(a), Ok(mut seen)) = (call.shared_arena(), seen.lock()) {
                        seen.get_or_insert_with(|| a.clone());
                    }
                    topic.serve(&mut call).await
                }
            })
            .grace(grace)
            .bind_all([shm.as_str(), unix.as_str(), "http://127.0.0.1:0"])
            .expect("bind")
    });
    let mut addresses = vec![shm];
    addresses.extend(bound.http_addresses());
    (arena, bound, addresses)
}

/// A server of the topic (as [`serve`]'s) that shuts down gracefully, within `grace`, once
/// `stop` is sent or dropped: its counters, its addresses, and where its outcome comes.
struct Stoppable {
    server: ServerStats,
    addresses: Vec<String>,
    stop: tokio::sync::oneshot::Sender<()>,
    ended: std::sync::mpsc::Receiver<Result<(), isthmus::Status>>,
}

fn serve_stoppable(rt: &tokio::runtime::Runtime, topic: &Topic, grace: Duration) -> Stoppable {
    let (_, bound, addresses) = bind(rt, topic, grace);
    let server = bound.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (done, ended) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let _ = done.send(bound.serve_with_shutdown(async move { drop(stopped.await) }).await);
    });
    Stoppable { server, addresses, stop, ended }
}

/// Message `seq`: seq as a u64, then `len - 8` bytes of the pattern for seed seq.
fn message(seq: u64, len: usize) -> Vec<u8> {
    let mut m = vec![0u8; len];
    m[..8].copy_from_slice(&seq.to_le_bytes());
    fill(&mut m[8..], seq);
    m
}

fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < end, "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn every_subscriber_gets_every_message_once_written() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let (_, server, addresses) = serve(&rt, &topic);
    const COUNT: u64 = 30;
    let mut subs: Vec<Peer> = Vec::new();
    for addr in addresses.iter().chain([&addresses[0], &addresses[0]]) {
        // More than will come: each reads until the topic closes.
        subs.push(Peer::spawn_bin("topic-subscriber", &[addr, "1000", "0"]));
    }
    until("5 subscribers", || topic.stats().subscribers == 5);
    for seq in 0..COUNT {
        let len = if seq % 3 == 0 { 500 } else { 300_000 };
        assert_eq!(topic.publish(&message(seq, len)), 5);
    }
    for p in &mut subs {
        for seq in 0..COUNT {
            assert_eq!(p.expect_line("", PATIENCE), format!("GOT {seq}"));
        }
    }
    let stats = topic.stats();
    assert_eq!((stats.published, stats.dropped), (COUNT, 0));
    until("every message counted delivered", || topic.stats().delivered == 5 * COUNT);
    // The 20 large messages went by reference on each shm:// subscriber's connection. The
    // unix:// and http:// calls reach the handler through the server's loopback shm:// endpoint;
    // two calls on one connection may meet a block the other still holds, which goes as a copy.
    let by_reference: Vec<u64> = server.connections().iter().map(|c| c.transport.shared_sent).collect();
    assert!(by_reference.iter().filter(|&&n| n == 20).count() >= 3, "{by_reference:?}");
    assert!(by_reference.iter().sum::<u64>() >= 4 * 20, "{by_reference:?}");
    topic.close();
    for p in &mut subs {
        assert_eq!(p.expect_line("END", PATIENCE), "END OK");
    }
}

/// A `topic-subscriber` on each of `addresses`, taking up to `count` messages, once the topic
/// counts them all.
fn subscribed(topic: &Topic, addresses: &[String], count: &str) -> Vec<Peer> {
    let subs: Vec<Peer> =
        addresses.iter().map(|addr| Peer::spawn_bin("topic-subscriber", &[addr, count, "0"])).collect();
    until("every subscriber", || topic.stats().subscribers == subs.len());
    subs
}

/// A subscription never ends on its own: a graceful shutdown waited out its whole grace for
/// every subscriber (and grpc-go's `GracefulStop`, which has none, for ever). Now each
/// subscription ends UNAVAILABLE, the code that tells a client to go elsewhere, once what was
/// published before is sent, and the shutdown is done with it.
#[test]
fn a_graceful_shutdown_ends_each_subscription_after_its_queue() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let Stoppable { addresses, stop, ended, .. } = serve_stoppable(&rt, &topic, Duration::from_secs(600));
    let mut subs = subscribed(&topic, &addresses, "1000");
    for seq in 0..3 {
        assert_eq!(topic.publish(&message(seq, if seq == 1 { 300_000 } else { 500 })), 3);
    }
    let _ = stop.send(());
    let ended = ended.recv_timeout(PATIENCE);
    ended.expect("the shutdown waited for its subscribers").expect("served");
    for p in &mut subs {
        for seq in 0..3 {
            assert_eq!(p.expect_line("", PATIENCE), format!("GOT {seq}"));
        }
        assert_eq!(p.expect_line("END", PATIENCE), "END Unavailable");
    }
    assert_eq!(topic.stats().subscribers, 0);
    assert_eq!(topic.publish(b"after"), 0);
}

/// The same shutdown while the topic publishes faster than its subscribers take it: each
/// always has something queued, and a subscription that looked for the shutdown only with an
/// empty queue never saw it (grpc-go's `GracefulStop` waited for ever again). Messages
/// published after the shutdown began are not queued any more.
#[test]
fn a_graceful_shutdown_ends_subscriptions_that_always_have_more_queued() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let Stoppable { addresses, stop, ended, .. } = serve_stoppable(&rt, &topic, Duration::from_secs(600));
    let mut subs = subscribed(&topic, &addresses, "100000000");
    let publishing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let publisher = {
        let (topic, publishing) = (topic.clone(), publishing.clone());
        std::thread::spawn(move || {
            let mut seq = 0;
            while publishing.load(std::sync::atomic::Ordering::Relaxed) {
                topic.publish(&message(seq, 300_000));
                seq += 1;
            }
        })
    };
    for p in &mut subs {
        for _ in 0..20 {
            p.expect_line("GOT", PATIENCE); // flowing, with more queued behind
        }
    }
    let _ = stop.send(());
    let ended = ended.recv_timeout(PATIENCE);
    publishing.store(false, std::sync::atomic::Ordering::Relaxed);
    publisher.join().expect("publisher");
    ended.expect("the shutdown waited for its subscribers").expect("served");
    for p in &mut subs {
        assert_eq!(p.expect_line("END", PATIENCE), "END Unavailable");
    }
}

/// A subscriber whose process stopped (SIGSTOP) with its ring full holds the shutdown until
/// the grace is over, and no longer: it is cut off then, and a subscriber that reads ends
/// UNAVAILABLE. (The GOAWAYs now go all at once within the grace: one that found no room at
/// all in a ring, a few bytes, waited before the grace began, for as long as the process
/// stayed stopped, and held up the others'. No test fills a ring to the byte.)
#[test]
fn a_stopped_subscriber_holds_a_graceful_shutdown_no_longer_than_its_grace() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let Stoppable { server, addresses, stop, ended } = serve_stoppable(&rt, &topic, Duration::from_secs(2));
    let mut stalled = Peer::spawn_bin("topic-subscriber", &[&addresses[0], "100000000", "0"]);
    until("the first subscriber", || topic.stats().subscribers == 1);
    topic.publish(&message(0, 500));
    stalled.expect_line("GOT 0", PATIENCE);
    let stop_process = |signal: &str| {
        let pid = stalled.child.id().to_string();
        let sent = std::process::Command::new("kill").args([signal, &pid]).status().expect("kill");
        assert!(sent.success(), "kill {signal} {pid}");
    };
    stop_process("-STOP");
    // Until its ring is full and a send waits for room in it.
    let mut seq = 0;
    until("a send waits for room in the stalled subscriber's ring", || {
        for _ in 0..100 {
            seq += 1;
            topic.publish(&message(seq, 500));
        }
        server.connections().iter().any(|c| c.transport.ring_full_waits > 0)
    });
    let mut reading = Peer::spawn_bin("topic-subscriber", &[&addresses[0], "100000000", "0"]);
    until("the second subscriber", || topic.stats().subscribers == 2);
    topic.publish(&message(seq + 1, 500));
    reading.expect_line("GOT", PATIENCE);
    let _ = stop.send(());
    let ended = ended.recv_timeout(PATIENCE);
    stop_process("-CONT");
    ended.expect("the shutdown outlasted its grace").expect("served");
    assert_eq!(reading.expect_line("END", PATIENCE), "END Unavailable");
}

#[test]
fn a_subscriber_killed_holding_blocks_leaves_and_frees_them() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let (arena, _, addresses) = serve(&rt, &topic);
    let mut holder = Peer::spawn_bin("topic-subscriber", &[&addresses[0], "4", "1"]);
    until("the holder subscribed", || topic.stats().subscribers == 1);
    for seq in 0..4 {
        topic.publish(&message(seq, 1 << 20));
    }
    holder.expect_line("HOLDING", PATIENCE);
    let arena = arena.lock().expect("lock").clone().expect("arena");
    assert_eq!(arena.in_use(), 4 << 20, "four blocks held by the subscriber");
    holder.child.kill().expect("kill -9");
    holder.child.wait().expect("reap");
    until("the killed subscriber left the topic", || topic.stats().subscribers == 0);
    // Its connection's end kept them until its process was gone; an allocation frees them.
    until("its blocks were freed", || {
        drop(arena.try_alloc(4096));
        arena.in_use() == 0
    });
    assert_eq!(topic.publish(b"nobody"), 0);
}

/// A subscriber gets the response's initial metadata when it joins, before anything is
/// published: a tonic-generated client's server-streaming call returns its stream only then,
/// and grpc-go's `Header()` waits for them. They came with the first message, and a topic with
/// no state left such a client waiting until the first publish (an application that publishes
/// once its client says it has subscribed waited for ever).
#[test]
fn a_subscriber_gets_its_headers_before_the_first_message() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let (_, _, addresses) = serve(&rt, &topic);
    rt.block_on(async {
        for address in &addresses {
            let channel = isthmus::Channel::connect(address).await.expect("connect");
            let mut call = channel.start("/topic.Feed/Watch", Default::default()).await.expect("start");
            call.send_last(b"").await.expect("the request");
            let headers = tokio::time::timeout(Duration::from_secs(10), call.headers()).await;
            assert!(matches!(headers, Ok(Ok(_))), "{address}: no headers in 10 s, nothing published: {headers:?}");
            call.cancel().await;
        }
    });
    assert_eq!(topic.stats().published, 0);
}
