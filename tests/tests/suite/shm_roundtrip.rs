//! Messages of every size, many threads, zero-copy blocks and async waits, between two processes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use isthmus_shm::{flags, Address, Config, Connection, Kind, Sender};
use isthmus_tests::{first_mismatch, fresh_addr, pattern, watchdog, Peer};

fn echo_peer(tag: &str) -> (Peer, Address) {
    let addr = fresh_addr(tag);
    let peer = Peer::spawn(&["echo-server", &addr]);
    (peer, addr.parse().expect("address"))
}

#[test]
fn round_trips_at_every_size() {
    let (_peer, addr) = echo_peer("sizes");
    watchdog(Duration::from_secs(300), move || {
        let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
        let inline = sender.inline_max();
        let sizes = [0, 1, 64, 1024, inline, inline + 1, 64 << 10, 1 << 20, 16 << 20, (32 << 20) + 1, 256 << 20];
        for (i, &size) in sizes.iter().enumerate() {
            let stream = i as u64 + 1;
            let payload = pattern(size, stream);
            sender.send_message(stream, flags::END_STREAM, &payload, None).expect("send");
            drop(payload);
            let f = receiver.recv(Some(Instant::now() + Duration::from_secs(120))).expect("echo");
            assert_eq!((f.kind, f.stream, f.flags), (Kind::Message, stream, flags::END_STREAM), "size {size}");
            assert_eq!(f.body.len(), size, "size {size}");
            assert_eq!(first_mismatch(&f.body, stream), None, "size {size}: corrupted");
        }
        let c = sender.counters();
        assert_eq!(c.bytes_received as usize, sizes.iter().sum::<usize>());
        assert!(c.frames_received as usize > sizes.len(), "the largest messages came in pieces");
    });
}

/// Sends `n` patterned messages of 1 MiB on streams 1..=n from a thread of their own, which
/// hands the sender back.
fn send_mebibytes(sender: Sender, n: u64) -> std::thread::JoinHandle<Sender> {
    std::thread::spawn(move || {
        for stream in 1..=n {
            let deadline = Some(Instant::now() + Duration::from_secs(60));
            sender.send_message(stream, flags::END_STREAM, &pattern(1 << 20, stream), deadline).expect("send");
        }
        sender
    })
}

#[test]
fn a_receiver_that_copies_what_arrives_holds_none_of_the_peers_arena() {
    // 96 messages of 1 MiB, all held, through the peer's 64 MiB arena: read in place they would
    // keep its blocks and the echo would wait for room; copied out as they arrive
    // (`copy_received`, what a server's loopback does, ADR 0036) they keep none.
    let (_peer, addr) = echo_peer("copyout");
    watchdog(Duration::from_secs(300), move || {
        const N: u64 = 96;
        let cfg = Config { copy_received: Some(u64::MAX), ..Config::default() };
        let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
        let writer = send_mebibytes(sender, N);
        let mut held = Vec::new();
        for _ in 0..N {
            let f =
                receiver.recv(Some(Instant::now() + Duration::from_secs(60))).expect("an echo, the earlier ones held");
            assert_eq!((f.body.len(), first_mismatch(&f.body, f.stream)), (1 << 20, None), "stream {}", f.stream);
            held.push(f);
        }
        let sender = writer.join().expect("writer");
        assert_eq!(sender.counters().bytes_received, N << 20);
    });
}

#[test]
fn copies_past_their_limit_are_read_in_place() {
    // With room for 8 MiB of copies, 96 messages of 1 MiB held: 8 are copied, the next ones are
    // read in place until the peer's 64 MiB arena is full, and the echo waits for room; once
    // the held messages go, the rest arrive.
    let (_peer, addr) = echo_peer("copylimit");
    watchdog(Duration::from_secs(300), move || {
        const N: u64 = 96;
        let cfg = Config { copy_received: Some(8 << 20), ..Config::default() };
        let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
        let writer = send_mebibytes(sender, N);
        let mut held = Vec::new();
        let stalled = loop {
            match receiver.recv(Some(Instant::now() + Duration::from_secs(2))) {
                Ok(f) => held.push(f),
                Err(e) => break e,
            }
            assert!(held.len() < N as usize, "every echo came while all were held");
        };
        assert_eq!(stalled.kind(), isthmus_shm::ErrorKind::Timeout, "{stalled:?}");
        assert!(held.len() > 8 + 32, "the arena held fewer than it should: {}", held.len());
        let mut count = held.len() as u64;
        drop(held);
        while count < N {
            let f = receiver.recv(Some(Instant::now() + Duration::from_secs(60))).expect("an echo");
            assert_eq!((f.body.len(), first_mismatch(&f.body, f.stream)), (1 << 20, None), "stream {}", f.stream);
            count += 1;
        }
        writer.join().expect("writer");
    });
}

#[test]
fn ten_thousand_messages_from_eight_threads_arrive_intact() {
    const THREADS: u64 = 8;
    const PER_THREAD: u64 = 1250;
    let (_peer, addr) = echo_peer("threads");
    watchdog(Duration::from_secs(300), move || {
        let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
        let reader = std::thread::spawn(move || {
            let mut seen = HashSet::new();
            let mut bytes = 0usize;
            for _ in 0..THREADS * PER_THREAD {
                let f = receiver.recv(Some(Instant::now() + Duration::from_secs(60))).expect("echo");
                assert_eq!(first_mismatch(&f.body, f.stream), None, "stream {} corrupted", f.stream);
                assert_eq!(f.body.len(), size_for(f.stream), "stream {} length", f.stream);
                assert!(seen.insert(f.stream), "stream {} delivered twice", f.stream);
                bytes += f.body.len();
            }
            (seen.len(), bytes)
        });
        let sender = Arc::new(sender);
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let sender = sender.clone();
                std::thread::spawn(move || {
                    for i in 0..PER_THREAD {
                        let stream = (t << 32) | i;
                        sender.send_message(stream, 0, &pattern(size_for(stream), stream), None).expect("send");
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        let (distinct, bytes) = reader.join().expect("reader");
        assert_eq!(distinct as u64, THREADS * PER_THREAD, "messages lost");
        println!("10,000 messages, {bytes} bytes, 0 lost, 0 corrupted");
    });
}

/// Mixes inline messages with arena blocks of up to ~200 KiB.
fn size_for(stream: u64) -> usize {
    let x = isthmus_tests::mix(stream);
    if x % 4 == 0 {
        (x >> 8) as usize % (200 << 10)
    } else {
        (x >> 8) as usize % 4096
    }
}

#[test]
fn a_block_written_in_place_is_read_in_place() {
    let (_peer, addr) = echo_peer("block");
    watchdog(Duration::from_secs(60), move || {
        let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
        let mut block = sender.alloc(3 << 20, None).expect("alloc");
        isthmus_tests::fill(&mut block[..(1 << 20) + 5], 42);
        block.truncate((1 << 20) + 5);
        sender.send_block(9, 0, block, None).expect("send block");
        let f = receiver.recv(None).expect("echo");
        assert_eq!(f.body.len(), (1 << 20) + 5);
        assert_eq!(first_mismatch(&f.body, 42), None);
        assert!(sender.counters().arena_high_water >= 3 << 20, "the block came from the arena");
        // An unsent block goes back to the arena: the whole arena can be taken again.
        drop(sender.alloc(40 << 20, None).expect("alloc"));
        drop(
            sender
                .alloc(sender.max_block(), Some(Instant::now() + Duration::from_secs(30)))
                .expect("whole arena is free again"),
        );
    });
}

#[test]
fn async_send_and_recv_on_tokio() {
    let (_peer, addr) = echo_peer("async");
    watchdog(Duration::from_secs(60), move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
            for i in 0..200u64 {
                sender.send_async(Kind::Message, 0, i, &pattern(100, i)).await.expect("send");
                let f = receiver.recv_async().await.expect("recv");
                assert_eq!((f.stream, first_mismatch(&f.body, i)), (i, None));
            }
            let mut block = sender.alloc_async(1 << 20).await.expect("alloc");
            isthmus_tests::fill(&mut block, 5);
            sender.send_block(500, 0, block, None).expect("send block");
            let f = tokio::time::timeout(Duration::from_secs(30), receiver.recv_async())
                .await
                .expect("in time")
                .expect("recv");
            assert_eq!(first_mismatch(&f.body, 5), None);
        });
    });
}

/// Senders of more messages in pieces than a receiver takes at once (`MAX_PARTIALS`, 256, past
/// which it closes the connection): 300 of them, each with a 1 MiB message through a 256 KiB
/// arena (16 pieces of 64 KiB, 4 at a time), from threads and from tokio tasks. They began more
/// than 256 before a sender kept to a limit of its own, and the echo server closed the
/// connection.
#[test]
fn more_messages_in_pieces_than_a_receiver_takes_at_once_wait_their_turn() {
    const SENDERS: u64 = 300;
    const SIZE: usize = 1 << 20;
    let (_peer, addr) = echo_peer("partials-turn");
    watchdog(Duration::from_secs(300), move || {
        let cfg = Config { arena_size: 256 << 10, ..Config::default() };
        for tasks in [false, true] {
            let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
            let reader = std::thread::spawn(move || {
                let mut seen = HashSet::new();
                for _ in 0..SENDERS {
                    let f = receiver.recv(Some(Instant::now() + Duration::from_secs(60))).expect("echo");
                    assert_eq!((f.body.len(), first_mismatch(&f.body, f.stream)), (SIZE, None), "stream {}", f.stream);
                    seen.insert(f.stream);
                }
                seen.len() as u64
            });
            let sender = Arc::new(sender);
            let deadline = || Some(Instant::now() + Duration::from_secs(60));
            if tasks {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async {
                    let sends = (1..=SENDERS).map(|stream| {
                        let sender = sender.clone();
                        tokio::spawn(async move {
                            let message = pattern(SIZE, stream);
                            sender.send_message_async(stream, flags::END_STREAM, &message).await.expect("send");
                        })
                    });
                    for send in sends.collect::<Vec<_>>() {
                        send.await.expect("task");
                    }
                });
            } else {
                let threads: Vec<_> = (1..=SENDERS)
                    .map(|stream| {
                        let sender = sender.clone();
                        std::thread::spawn(move || {
                            let message = pattern(SIZE, stream);
                            sender.send_message(stream, flags::END_STREAM, &message, deadline()).expect("send");
                        })
                    })
                    .collect();
                for t in threads {
                    t.join().expect("sender");
                }
            }
            assert_eq!(reader.join().expect("reader"), SENDERS, "tasks: {tasks}");
        }
    });
}

/// An interruptible wait gives up when interrupted from another thread, whether it is asleep
/// on the doorbell by then or not yet waiting, and no frame is lost: the next wait gets the
/// echo that arrives later.
#[test]
fn an_interrupted_wait_gives_up_and_loses_no_frame() {
    let (_peer, addr) = echo_peer("interrupt");
    watchdog(Duration::from_secs(60), move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let cfg = Config {
                spin: isthmus_shm::SpinPolicy { max: Duration::ZERO, ..Default::default() },
                ..Config::default()
            };
            let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
            let interrupter = receiver.interrupter();
            // Before the wait: the next wait returns at once, once.
            interrupter.interrupt();
            assert!(receiver.recv_async_interruptible(receiver.spin_policy()).await.expect("interrupted").is_none());
            // During the wait, asleep on the doorbell (no spin), from another thread. Timed from
            // before the thread starts its 50 ms: a main thread that loses its core after the spawn
            // finds the interrupt already there, and still waited that long.
            let waited = Instant::now();
            let other = std::thread::spawn({
                let interrupter = interrupter.clone();
                move || {
                    std::thread::sleep(Duration::from_millis(50));
                    interrupter.interrupt();
                }
            });
            let got = tokio::time::timeout(
                Duration::from_secs(30),
                receiver.recv_async_interruptible(receiver.spin_policy()),
            )
            .await;
            assert!(got.expect("woken by the interrupt").expect("no error").is_none());
            assert!(waited.elapsed() >= Duration::from_millis(40));
            other.join().expect("thread");
            // Frames still come through.
            sender.send_async(Kind::Message, 0, 7, &pattern(100, 7)).await.expect("send");
            let f = tokio::time::timeout(
                Duration::from_secs(30),
                receiver.recv_async_interruptible(receiver.spin_policy()),
            )
            .await
            .expect("in time")
            .expect("recv")
            .expect("a frame, not an interrupt");
            assert_eq!((f.stream, first_mismatch(&f.body, 7)), (7, None));
        });
    });
}

#[test]
fn a_slow_reader_applies_backpressure_without_loss() {
    // 64 MiB cannot fit the two 1 MiB arenas and the rings, so while the client does not read
    // the server's echoes stop for room, it stops reading, and the client's own arena fills,
    // however fast either side is.
    let addr = fresh_addr("pressure");
    let _peer = Peer::spawn(&["echo-server", &addr, &(1usize << 20).to_string()]);
    let addr: Address = addr.parse().expect("address");
    watchdog(Duration::from_secs(120), move || {
        let cfg = Config { ring_size: 4096, arena_size: 1 << 20, inline_max: 512, ..Config::default() };
        let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
        let writer = std::thread::spawn(move || {
            for i in 0..256u64 {
                sender.send_message(i, 0, &pattern(256 << 10, i), None).expect("send");
            }
            sender
        });
        std::thread::sleep(Duration::from_millis(200)); // let the writer hit the walls
        for i in 0..256u64 {
            let f = receiver.recv(None).expect("echo");
            assert_eq!((f.stream, first_mismatch(&f.body, i)), (i, None));
        }
        let c = writer.join().expect("writer").counters();
        assert!(c.arena_full_waits > 0, "the writer should have waited for arena room: {c:?}");
    });
}

/// The path an external event loop (epoll, asyncio's add_reader) takes: arm, poll the doorbell
/// fd itself, disarm, then take the frames. The peer must ring only while we are armed.
#[test]
fn an_external_event_loop_can_wait_on_the_doorbell_fd() {
    use std::os::fd::AsRawFd;
    let (_peer, addr) = echo_peer("evloop");
    watchdog(Duration::from_secs(60), move || {
        let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
        for i in 0..100u64 {
            assert!(receiver.arm().expect("arm"), "nothing is waiting yet");
            sender.send_message(i, 0, &pattern(64, i), None).expect("send");
            let mut fds = [
                libc::pollfd { fd: receiver.doorbell_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: receiver.liveness_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: `fds` is a live array of two pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 30_000) };
            assert_eq!((n, fds[0].revents & libc::POLLIN), (1, libc::POLLIN), "the doorbell rang, the socket is quiet");
            receiver.disarm().expect("disarm");
            let f = receiver.try_recv().expect("recv").expect("the echo is there");
            assert_eq!((f.stream, first_mismatch(&f.body, i)), (i, None));
        }
        // Armed with a frame already waiting: arm says so instead of letting the loop sleep.
        sender.send_message(7, 0, b"early", None).expect("send");
        while !receiver.arm().is_ok_and(|armed| !armed) {
            receiver.disarm().expect("disarm");
            std::thread::yield_now();
        }
        assert_eq!(&receiver.try_recv().expect("recv").expect("frame").body[..], b"early");
    });
}
