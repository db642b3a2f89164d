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

/// A subscription never ends on its own: a graceful shutdown waited out its whole grace for
/// every subscriber (and grpc-go's `GracefulStop`, which has none, for ever). Now each
/// subscription ends UNAVAILABLE, the code that tells a client to go elsewhere, once what was
/// published before is sent, and the shutdown is done with it.
#[test]
fn a_graceful_shutdown_ends_each_subscription_after_its_queue() {
    let rt = isthmus_tests::runtime();
    let topic = Topic::new("feed");
    let (_, bound, addresses) = bind(&rt, &topic, Duration::from_secs(600));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = rt.spawn(bound.serve_with_shutdown(async move {
        let _ = stopped.await;
    }));
    let mut subs: Vec<Peer> =
        addresses.iter().map(|addr| Peer::spawn_bin("topic-subscriber", &[addr, "1000", "0"])).collect();
    until("3 subscribers", || topic.stats().subscribers == 3);
    for seq in 0..3 {
        assert_eq!(topic.publish(&message(seq, if seq == 1 { 300_000 } else { 500 })), 3);
    }
    let _ = stop.send(());
    let ended = rt.block_on(async { tokio::time::timeout(PATIENCE, serving).await });
    ended.expect("the shutdown waited for its subscribers").expect("the server's task").expect("served");
    for p in &mut subs {
        for seq in 0..3 {
            assert_eq!(p.expect_line("", PATIENCE), format!("GOT {seq}"));
        }
        assert_eq!(p.expect_line("END", PATIENCE), "END Unavailable");
    }
    assert_eq!(topic.stats().subscribers, 0);
    assert_eq!(topic.publish(b"after"), 0);
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
