//! The peer process of the cross-process tests. One role per invocation:
//!
//! ```text
//! shm-peer echo-server ADDR [ARENA]      echo every MESSAGE back on its stream
//! shm-peer hang-client ADDR              connect, send one message, block in recv
//! shm-peer big-client ADDR SIZE ARENA    send one SIZE-byte patterned message, print the reply
//! shm-peer composing-client ADDR SIZE    on the server's `go`, once its reader sleeps: take a
//!                                        SIZE-byte block (`ANNOUNCED rung=… composing=…`), fill
//!                                        it with pattern SIZE and send it (`SENT composing=…`),
//!                                        then take one more and drop it (`DROPPED composing=…`)
//! shm-peer hostile-server ADDR MODE      accept one client, then corrupt the segment
//! shm-peer misanswering-server ADDR      serve unary calls with hand-made frames: a request
//!                                        that names a wrong answer (see `answer`) gets it, any
//!                                        other its echo; `ENDED kind` as a connection ends
//! shm-peer ping-server ADDR COUNT LEN    accept one client, take its first frame (a call), send
//!                                        COUNT PINGs of LEN bytes (pattern i) reading nothing,
//!                                        then read the answers (`ACKS n`) and hang up
//! shm-peer credit-server ADDR WAIT_MS [PINGS [LEN]]
//!                                        accept one client, take its call, send PINGS (20) PINGs
//!                                        of LEN bytes (64 KiB - 16: 20 answers fill the client's
//!                                        1 MiB ring and 4 more) and 40 messages of 64 KiB on the call, read
//!                                        nothing for WAIT_MS, then read: `ANSWERS n GRANTED b
//!                                        ENDED kind` once a WINDOW for the call comes (`-`), or
//!                                        the connection ends (or 10 s pass), and end the call OK
//! shm-peer pieces-client ADDR            write by hand messages in pieces on streams 1, 3, 5
//!                                        and 7 (768 KiB pattern-0 block, 1 MiB each; 5 ends
//!                                        in a CANCEL), then "after" inline on stream 9
//! shm-peer partials-client ADDR          write by hand a message in 300 pieces of 1 KiB on stream
//!                                        1, then 257 messages begun in pieces on streams 3, 5,
//!                                        …; print how its connection ended (`ENDED kind`)
//! shm-peer sink-server ADDR              accept clients and never read from them
//! shm-peer client-as-uid ADDR UID        switch to UID (needs root), then try to connect
//! shm-peer server-as-uid ADDR UID        switch to UID (needs root), then echo-serve
//! shm-peer shared-sink ADDR COUNT HOLD   receive COUNT messages, message k patterned with seed
//!                                        k; HOLD=1 keeps them all and waits to be killed; HOLD=2
//!                                        keeps them, closes the connection, and checks them
//!                                        again and again (`CHECKED n`, `CHANGED k` if one did)
//! ```
//!
//! Every role prints `READY` once it is set up, and reports on stdout in lines the tests parse.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::Duration;

use isthmus_shm::frame::{ArenaDescriptor, FrameHeader};
use isthmus_shm::layout::{self, CLIENT_TO_SERVER, SERVER_TO_CLIENT};
use isthmus_shm::{flags, Address, Config, Connection, Kind, Listener, Sender};
use isthmus_tests::pattern;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn arg(args: &[String], i: usize, what: &str) -> String {
    args.get(i).cloned().unwrap_or_else(|| {
        eprintln!("shm-peer: missing {what}");
        std::process::exit(2)
    })
}

fn num(s: &str) -> usize {
    s.parse().unwrap_or_else(|_| {
        eprintln!("shm-peer: {s:?} is not a number");
        std::process::exit(2)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let role = arg(&args, 1, "role");
    let addr: Address = arg(&args, 2, "address").parse().unwrap_or_else(|e| {
        eprintln!("shm-peer: {e}");
        std::process::exit(2)
    });
    match role.as_str() {
        "echo-server" => {
            let mut cfg = Config::default();
            if let Some(a) = args.get(3) {
                cfg.arena_size = num(a);
            }
            echo_server(&addr, cfg)
        }
        "hang-client" => hang_client(&addr),
        "composing-client" => composing_client(&addr, num(&arg(&args, 3, "size"))),
        "big-client" => big_client(&addr, num(&arg(&args, 3, "size")), num(&arg(&args, 4, "arena"))),
        "hostile-server" => hostile_server(&addr, &arg(&args, 3, "mode")),
        "misanswering-server" => misanswering_server(&addr),
        "pieces-client" => pieces_client(&addr),
        "partials-client" => partials_client(&addr),
        "credit-server" => {
            let pings = args.get(4).map_or(20, |p| num(p) as u64);
            let len = args.get(5).map_or((64 << 10) - 16, |l| num(l));
            credit_server(&addr, num(&arg(&args, 3, "wait_ms")) as u64, pings, len)
        }
        "ping-server" => ping_server(&addr, num(&arg(&args, 3, "count")), num(&arg(&args, 4, "len"))),
        "shared-sink" => shared_sink(&addr, num(&arg(&args, 3, "count")), num(&arg(&args, 4, "hold"))),
        "sink-server" => sink_server(&addr),
        "client-as-uid" => client_as_uid(&addr, num(&arg(&args, 3, "uid")) as u32),
        "server-as-uid" => {
            become_uid(num(&arg(&args, 3, "uid")) as u32);
            echo_server(&addr, Config { peer_policy: isthmus_shm::PeerPolicy::Any, ..Config::default() })
        }
        other => {
            eprintln!("shm-peer: unknown role {other:?}");
            std::process::exit(2)
        }
    }
}

fn echo_server(addr: &Address, cfg: Config) {
    let listener = Listener::bind(addr, cfg).unwrap_or_else(|e| {
        say(&format!("BIND-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    say("READY");
    loop {
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                say(&format!("ACCEPT-ERROR {:?} {e}", e.kind()));
                continue;
            }
        };
        std::thread::spawn(move || {
            let Connection { sender, mut receiver } = conn;
            let end = loop {
                let f = match receiver.recv(None) {
                    Ok(f) => f,
                    Err(e) => break e,
                };
                let sent = match f.kind {
                    Kind::Message => sender.send_message(f.stream, f.flags, &f.body, None),
                    Kind::Ping => sender.send(Kind::Ping, flags::ACK, f.stream, &f.body, None),
                    _ => sender.send(f.kind, f.flags, f.stream, &f.body, None),
                };
                if let Err(e) = sent {
                    break e;
                }
            };
            say(&format!("CONN-END {:?} {end}", end.kind()));
        });
    }
}

fn hang_client(addr: &Address) {
    say("READY"); // before connecting: the test accepts only after this line
    let Connection { sender, mut receiver } = Connection::connect(addr, &Config::default()).unwrap_or_else(|e| {
        say(&format!("CONNECT-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    sender.send_message(1, 0, b"hello", None).expect("send");
    let r = receiver.recv(None);
    say(&format!("RECV {r:?}"));
}

fn big_client(addr: &Address, size: usize, arena: usize) {
    let cfg = Config { arena_size: arena, ..Config::default() };
    say("READY");
    let Connection { sender, mut receiver } = Connection::connect(addr, &cfg).unwrap_or_else(|e| {
        say(&format!("CONNECT-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    let payload = pattern(size, size as u64);
    sender.send_message(1, flags::END_STREAM, &payload, None).expect("send big message");
    drop(payload);
    match receiver.recv(None) {
        Ok(f) => say(&format!("REPLY {}", String::from_utf8_lossy(&f.body))),
        Err(e) => say(&format!("REPLY-ERROR {:?} {e}", e.kind())),
    }
    let c = sender.counters();
    say(&format!("COUNTERS arena_full_waits={} arena_high_water={}", c.arena_full_waits, c.arena_high_water));
}

/// Shows the announcement of a large block (ADR 0026) from the writer's side: what the
/// allocation rang, and the word the server reads, while the block is held, once it is sent,
/// and once another is dropped unsent.
fn composing_client(addr: &Address, size: usize) {
    say("READY");
    let Connection { sender, mut receiver } = Connection::connect(addr, &Config::default()).unwrap_or_else(|e| {
        say(&format!("CONNECT-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    let word = |field| sender.control_word_for_tests(CLIENT_TO_SERVER, field).expect("a control word");
    let go = receiver.recv(None).expect("the server's go");
    assert_eq!(&go.body[..], b"go");
    drop(go);
    // The server's reader is asleep once its parked flag is up: it waits for this client's
    // next frame and none is coming (a watchdog bound, not a timing assumption).
    let asleep = (0..30_000).any(|_| {
        std::thread::sleep(Duration::from_millis(1));
        word(layout::CTL_CONSUMER_PARKED) != 0
    });
    assert!(asleep, "the server's reader never went to sleep");
    let before = sender.counters().doorbells_rung;
    let mut block = sender.alloc(size, None).expect("a block");
    let rung = sender.counters().doorbells_rung - before;
    say(&format!("ANNOUNCED rung={rung} composing={}", word(layout::CTL_COMPOSING)));
    isthmus_tests::fill(&mut block, size as u64);
    sender.send_block(1, flags::END_STREAM, block, None).expect("send the block");
    say(&format!("SENT composing={}", word(layout::CTL_COMPOSING)));
    drop(sender.alloc(size, None).expect("another block"));
    say(&format!("DROPPED composing={}", word(layout::CTL_COMPOSING)));
    let _ = receiver.recv(None); // until the server closes
}

/// Writes what `mode` names into the server→client direction, as a broken or hostile server.
fn corrupt(sender: &Sender, mode: &str) {
    let l = sender.layout_for_tests();
    let ctl = |field: usize| layout::control_base(SERVER_TO_CLIENT) + field;
    let ring = l.ring_off[SERVER_TO_CLIENT];
    let publish = |tail: u64| sender.scribble_for_tests(ctl(layout::CTL_TAIL), &tail.to_le_bytes());
    match mode {
        "tail-jump" => publish(1 << 40),
        "bad-kind" => {
            let mut h = [0u8; 16];
            h[4] = 99;
            sender.scribble_for_tests(ring, &h);
            publish(16);
        }
        "bad-descriptor" => {
            let mut f = [0u8; 40];
            f[0..4].copy_from_slice(&24u32.to_le_bytes());
            f[4] = Kind::Message as u8;
            f[5] = flags::ARENA;
            f[8..16].copy_from_slice(&1u64.to_le_bytes());
            let off = l.arena_size[SERVER_TO_CLIENT] as u64 - 10;
            f[16..24].copy_from_slice(&off.to_le_bytes());
            f[24..32].copy_from_slice(&100u64.to_le_bytes());
            f[32..40].copy_from_slice(&100u64.to_le_bytes());
            sender.scribble_for_tests(ring, &f);
            publish(40);
        }
        "bad-shared" | "shared-piece" => {
            // A SHARED descriptor past the end of the shared arena, or of a part of a message.
            let mut f = [0u8; 40];
            f[0..4].copy_from_slice(&24u32.to_le_bytes());
            f[4] = Kind::Message as u8;
            f[5] = flags::ARENA | flags::SHARED;
            f[8..16].copy_from_slice(&1u64.to_le_bytes());
            let (off, len, total) =
                if mode == "bad-shared" { (l.shared_size as u64 - 10, 100u64, 100u64) } else { (0, 4096, 8192) };
            f[16..24].copy_from_slice(&off.to_le_bytes());
            f[24..32].copy_from_slice(&len.to_le_bytes());
            f[32..40].copy_from_slice(&total.to_le_bytes());
            sender.scribble_for_tests(ring, &f);
            publish(40);
        }
        "random" => {
            // Random bytes over the whole control block and both rings, for a while.
            let mut x = 0x1234_5678_9abc_def1u64;
            let span = l.arena_off[0];
            let end = std::time::Instant::now() + Duration::from_millis(300);
            while std::time::Instant::now() < end {
                x = isthmus_tests::mix(x);
                let off = (x % span as u64) as usize;
                let bytes = isthmus_tests::mix(x ^ 1).to_le_bytes();
                sender.scribble_for_tests(off, &bytes[..(x >> 60) as usize % 8 + 1]);
                let _ = sender.send_message(3, 0, &bytes, Some(std::time::Instant::now() + Duration::from_millis(1)));
            }
        }
        other => {
            eprintln!("shm-peer: unknown mode {other:?}");
            std::process::exit(2)
        }
    }
    std::sync::atomic::fence(Ordering::SeqCst);
}

/// Messages in pieces, written into the ring by hand so that several stay under way at once
/// (the real `Sender` sends one message's pieces in a row). Every piece is a view of the same
/// block at the start of our arena, patterned with seed 0, so a reassembled message is the
/// pattern's first `len` bytes of each piece one after the other.
fn pieces_client(addr: &Address) {
    const K: u64 = 1024;
    say("READY"); // before connecting: the test accepts only after this line
    let conn = Connection::connect(addr, &Config::default()).unwrap_or_else(|e| {
        say(&format!("CONNECT-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    let sender = &conn.sender;
    let l = sender.layout_for_tests();
    sender.scribble_for_tests(l.arena_off[CLIENT_TO_SERVER], &pattern(768 << 10, 0));
    let piece = |stream: u64, len: u64| {
        let d = ArenaDescriptor { offset: 0, len: len * K, total: 1024 * K };
        (Kind::Message, flags::ARENA, stream, d.encode().to_vec())
    };
    let frames = [
        piece(1, 512), // 512 KiB held
        piece(3, 768), // 1280 KiB would be held: stream 3's message is refused
        piece(1, 512), // 1 MiB held: stream 1's message is whole
        piece(3, 256), // stream 3's message ends: MessageTooLarge
        piece(5, 768),
        (Kind::Cancel, 0, 5, Vec::new()), // its 768 KiB are dropped
        piece(7, 768),                    // fits only if stream 5's bytes were given back
        piece(7, 256),
        (Kind::Message, 0, 9, b"after".to_vec()),
    ];
    publish_by_hand(sender, &frames);
    say("SENT");
    // Stay connected: the server must see our frames, not our end.
    std::thread::sleep(Duration::from_secs(3600));
}

/// Frames written into the client's ring by hand, then published at once (one tail store and
/// one doorbell), as a peer that ignores the protocol's bounds may.
fn publish_by_hand(sender: &Sender, frames: &[(Kind, u8, u64, Vec<u8>)]) {
    let l = sender.layout_for_tests();
    let mut ring = Vec::new();
    for (kind, flags, stream, body) in frames {
        let len = u32::try_from(body.len()).expect("small body");
        ring.extend_from_slice(&FrameHeader { len, kind: *kind, flags: *flags, stream: *stream }.encode());
        ring.extend_from_slice(body);
        ring.resize(ring.len().next_multiple_of(layout::FRAME_ALIGN), 0);
    }
    sender.scribble_for_tests(l.ring_off[CLIENT_TO_SERVER], &ring);
    std::sync::atomic::fence(Ordering::SeqCst);
    let tail = layout::control_base(CLIENT_TO_SERVER) + layout::CTL_TAIL;
    sender.scribble_for_tests(tail, &(ring.len() as u64).to_le_bytes());
    sender.ring_peer_for_tests();
}

/// Past the receiver's bounds on pieces: one message in more pieces than one `try_recv` takes,
/// then one message more in pieces at once than a receiver keeps.
fn partials_client(addr: &Address) {
    say("READY"); // before connecting: the test accepts only after this line
    let Connection { sender, mut receiver } = Connection::connect(addr, &Config::default()).unwrap_or_else(|e| {
        say(&format!("CONNECT-ERROR {:?} {e}", e.kind()));
        std::process::exit(1)
    });
    let l = sender.layout_for_tests();
    sender.scribble_for_tests(l.arena_off[CLIENT_TO_SERVER], &pattern(1024, 0));
    let piece = |stream: u64, total: u64| {
        let d = ArenaDescriptor { offset: 0, len: 1024, total };
        (Kind::Message, flags::ARENA, stream, d.encode().to_vec())
    };
    let mut frames: Vec<_> = (0..300).map(|_| piece(1, 300 * 1024)).collect();
    frames.extend((0..257).map(|k| piece(3 + 2 * k, 2048)));
    publish_by_hand(&sender, &frames);
    say("SENT");
    let deadline = Some(std::time::Instant::now() + Duration::from_secs(60));
    loop {
        match receiver.recv(deadline) {
            Ok(_) => continue,
            Err(e) => return say(&format!("ENDED {:?}", e.kind())),
        }
    }
}

/// A server that writes into the client's ring while it reads nothing of its own, as a peer of
/// the spec may: only once its PINGs are sent does it read, and count the answers that come in
/// order.
fn ping_server(addr: &Address, count: usize, len: usize) {
    let listener = Listener::bind(addr, Config::default()).expect("bind");
    say("READY");
    let Connection { sender, mut receiver } = listener.accept().expect("accept");
    let call = receiver.recv(None).expect("the client's call");
    say(&format!("CALL {:?} {}", call.kind, call.stream));
    for i in 0..count {
        sender.send(Kind::Ping, 0, 0, &pattern(len, i as u64), None).expect("PING");
    }
    let mut acks = 0;
    while acks < count {
        let deadline = Some(std::time::Instant::now() + Duration::from_secs(30));
        match receiver.recv(deadline) {
            Ok(f) if f.kind == Kind::Ping && f.flags == flags::ACK && f.body[..] == pattern(len, acks as u64)[..] => {
                acks += 1
            }
            Ok(f) if f.kind == Kind::Ping => {
                say(&format!("OUT-OF-ORDER after {acks}: {} bytes", f.body.len()));
                break;
            }
            Ok(_) => {}
            Err(e) => {
                say(&format!("RECV-ERROR after {acks}: {e}"));
                break;
            }
        }
    }
    say(&format!("ACKS {acks}"));
}

fn credit_server(addr: &Address, wait_ms: u64, pings: u64, len: usize) {
    use isthmus::{wire, Status};
    let listener = Listener::bind(addr, Config::default()).expect("bind");
    say("READY");
    let Connection { sender, mut receiver } = listener.accept().expect("accept");
    let call = receiver.recv(None).expect("the client's call");
    let stream = call.stream;
    say(&format!("CALL {:?} {stream}", call.kind));
    for i in 0..pings {
        sender.send(Kind::Ping, 0, 0, &pattern(len, i), None).expect("PING");
    }
    sender.send(Kind::Headers, 0, stream, &wire::ResponseHead::default().encode(), None).expect("HEADERS");
    // 2.5 MiB, past half the 4 MiB window: taking them grants credit.
    for i in 0..40 {
        sender.send_message(stream, 0, &pattern(64 << 10, i), None).expect("MESSAGE");
    }
    say("SENT");
    std::thread::sleep(Duration::from_millis(wait_ms));
    let (mut answers, mut granted, mut ended) = (0, 0, "-".to_owned());
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while granted == 0 {
        match receiver.recv(Some(end)) {
            Ok(f) if f.kind == Kind::Ping && f.flags == flags::ACK => answers += 1,
            Ok(f) if f.kind == Kind::Window && f.stream == stream => {
                granted = wire::decode_window(&f.body).unwrap_or(0)
            }
            Ok(_) => {}
            Err(e) => {
                ended = format!("{:?}", e.kind());
                break;
            }
        }
    }
    say(&format!("ANSWERS {answers} GRANTED {granted} ENDED {ended}"));
    // The client may be gone (the test that drops its channel).
    let _ = sender.send(Kind::Trailers, flags::END_STREAM, stream, &wire::encode_trailers(&Status::ok()), None);
    // Until the client hangs up.
    while receiver.recv(None).is_ok() {}
}

fn hostile_server(addr: &Address, mode: &str) {
    let listener = Listener::bind(addr, Config::default()).expect("bind");
    say("READY");
    let conn = listener.accept().expect("accept");
    let first = conn.sender.send_message(1, 0, b"before", None);
    say(&format!("SENT-FIRST {}", first.is_ok()));
    corrupt(&conn.sender, mode);
    // A real send would publish our own (sane) tail over the damage; ring the bell instead.
    conn.sender.ring_peer_for_tests();
    say("CORRUPTED");
    // Stay alive (socket open) so the client's error is about the damage, not about EOF.
    std::thread::sleep(Duration::from_secs(3600));
}

fn misanswering_server(addr: &Address) {
    let listener = Listener::bind(addr, Config::default()).expect("bind");
    say("READY");
    loop {
        match listener.accept() {
            Ok(conn) => drop(std::thread::spawn(move || misanswer(conn))),
            Err(e) => say(&format!("ACCEPT-ERROR {e}")),
        }
    }
}

/// Serves one connection until its client hangs up; says `ENDED kind` then.
fn misanswer(conn: Connection) {
    use isthmus::wire;
    let Connection { sender, mut receiver } = conn;
    let mut requests: std::collections::HashMap<u64, Vec<u8>> = std::collections::HashMap::new();
    let end = loop {
        let f = match receiver.recv(None) {
            Ok(f) => f,
            Err(e) => break e,
        };
        let ends = f.flags & flags::END_STREAM != 0;
        match f.kind {
            Kind::Headers if f.flags & wire::WITH_MESSAGE != 0 => {
                // A one-frame call: the request follows the head.
                let Ok((_, at)) = wire::RequestHead::decode_prefix(&f.body) else { break_bad(&sender) };
                answer(&sender, f.stream, &f.body[at..]);
            }
            Kind::Headers if ends => answer(&sender, f.stream, b""),
            Kind::Headers => drop(requests.insert(f.stream, Vec::new())),
            Kind::Message => {
                requests.entry(f.stream).or_default().extend_from_slice(&f.body);
                if ends {
                    let request = requests.remove(&f.stream).unwrap_or_default();
                    answer(&sender, f.stream, &request);
                }
            }
            Kind::Trailers => {
                let request = requests.remove(&f.stream).unwrap_or_default();
                answer(&sender, f.stream, &request);
            }
            Kind::Cancel => drop(requests.remove(&f.stream)),
            Kind::Ping if f.flags & flags::ACK == 0 => {
                drop(sender.send(Kind::Ping, flags::ACK, f.stream, &f.body, None))
            }
            _ => {}
        }
    };
    say(&format!("ENDED {:?}", end.kind()));
}

fn break_bad(sender: &Sender) -> ! {
    say("BAD-REQUEST-HEAD");
    sender.close();
    std::process::exit(1)
}

/// Answers the call on `stream` whose request was `request`: with the wrong answer it names,
/// or with its echo. The wrong answers are frames an honest server never sends, well-formed (a
/// status code outside gRPC's, no response, two responses, a status with no HEADERS before it,
/// frames for streams nobody opened) or not (a body that does not decode, a message inside a
/// frame that may not carry one).
fn answer(sender: &Sender, stream: u64, request: &[u8]) {
    use isthmus::{wire, Code, Status};
    let head = wire::ResponseHead::default().encode();
    let ok = wire::encode_trailers(&Status::ok());
    let send = |kind: Kind, frame_flags: u8, stream: u64, body: &[u8]| {
        if let Err(e) = sender.send(kind, frame_flags, stream, body, None) {
            say(&format!("SEND-ERROR {e}"));
        }
    };
    let mode = std::str::from_utf8(request).unwrap_or("");
    match mode {
        // A version byte, then a status cut short.
        "bad-trailers" => send(Kind::Trailers, flags::END_STREAM, stream, b"\x01\x00\x00"),
        // A wire version nobody speaks.
        "bad-headers" => send(Kind::Headers, 0, stream, b"\x07"),
        // Three bytes where a WINDOW has eight.
        "bad-window" => send(Kind::Window, 0, stream, b"\x01\x00\x00"),
        "bad-goaway" => send(Kind::GoAway, 0, 0, b"\xff"),
        "message-inside-headers" => {
            let mut body = head.clone();
            body.extend_from_slice(request);
            send(Kind::Headers, wire::WITH_MESSAGE, stream, &body);
        }
        "unknown-code" => {
            // Code 99, which gRPC does not define, with a message.
            let mut body = vec![wire::WIRE_VERSION];
            body.extend_from_slice(&99u32.to_le_bytes());
            body.extend_from_slice(&3u32.to_le_bytes());
            body.extend_from_slice(&0u32.to_le_bytes());
            body.extend_from_slice(b"odd");
            body.extend_from_slice(&0u32.to_le_bytes());
            send(Kind::Trailers, flags::END_STREAM, stream, &body);
        }
        "no-response" => {
            send(Kind::Headers, 0, stream, &head);
            send(Kind::Trailers, flags::END_STREAM, stream, &ok);
        }
        "two-responses" => {
            send(Kind::Headers, 0, stream, &head);
            send(Kind::Message, 0, stream, b"one");
            send(Kind::Message, 0, stream, b"two");
            send(Kind::Trailers, flags::END_STREAM, stream, &ok);
        }
        "two-headers" => {
            send(Kind::Headers, 0, stream, &head);
            send(Kind::Headers, 0, stream, &head);
            send(Kind::Message, 0, stream, request);
            send(Kind::Trailers, flags::END_STREAM, stream, &ok);
        }
        // A CANCEL that says OK, where the response was due.
        "cancel-ok" => send(Kind::Cancel, 0, stream, &wire::encode_cancel(Code::Ok)),
        "trailers-only" => {
            let failed = Status::new(Code::PermissionDenied, "no headers first");
            send(Kind::Trailers, flags::END_STREAM, stream, &wire::encode_trailers(&failed));
        }
        _ => {
            if mode == "stray-frames" {
                // Frames for streams this client never opened (nor will soon), before the echo.
                send(Kind::Message, 0, stream + 1_000_000, b"stray");
                send(Kind::Trailers, flags::END_STREAM, stream + 1_000_002, &ok);
                send(Kind::Window, 0, stream + 1_000_004, &wire::encode_window(4096));
            }
            send(Kind::Headers, 0, stream, &head);
            if let Err(e) = sender.send_message(stream, 0, request, None) {
                say(&format!("SEND-ERROR {e}"));
            }
            send(Kind::Trailers, flags::END_STREAM, stream, &ok);
        }
    }
}

fn shared_sink(addr: &Address, count: usize, hold_mode: usize) {
    let hold = hold_mode > 0;
    say("READY"); // before connecting: the test accepts after it sees this
    let mut conn = Connection::connect(addr, &Config::default()).expect("connect");
    let mut kept = Vec::new();
    for k in 0..count {
        match conn.receiver.recv(None) {
            Ok(f) => {
                match isthmus_tests::first_mismatch(&f.body, k as u64) {
                    None => say(&format!("GOT {k} {}", f.body.len())),
                    Some(at) => say(&format!("BAD {k} at {at}")),
                }
                if hold {
                    kept.push(f);
                }
            }
            Err(e) => {
                say(&format!("RECV-ERROR {:?} {e}", e.kind()));
                return;
            }
        }
    }
    if hold_mode == 2 {
        // Close the connection but keep reading the messages: they must not change.
        drop(conn);
        say("CLOSED");
        for pass in 1.. {
            for (k, f) in kept.iter().enumerate() {
                if let Some(at) = isthmus_tests::first_mismatch(&f.body, k as u64) {
                    say(&format!("CHANGED {k} at {at}"));
                }
            }
            say(&format!("CHECKED {pass}"));
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    if hold {
        say("HOLDING");
        std::thread::sleep(Duration::from_secs(3600));
    }
    say("DONE");
}

fn sink_server(addr: &Address) {
    let cfg = Config { arena_size: 1 << 20, ..Config::default() };
    let listener = Listener::bind(addr, cfg).expect("bind");
    say("READY");
    let mut keep = Vec::new();
    loop {
        match listener.accept() {
            Ok(c) => {
                say("ACCEPTED");
                keep.push(c);
            }
            Err(e) => say(&format!("ACCEPT-ERROR {:?} {e}", e.kind())),
        }
    }
}

fn become_uid(uid: u32) {
    // SAFETY: setuid has no memory-safety preconditions; the process is single-threaded here.
    if unsafe { libc::setuid(uid) } != 0 {
        say(&format!("SETUID-ERROR {}", std::io::Error::last_os_error()));
        std::process::exit(1);
    }
}

fn client_as_uid(addr: &Address, uid: u32) {
    become_uid(uid);
    say("READY");
    match Connection::connect(addr, &Config::default()) {
        Ok(mut c) => {
            c.sender.send_message(1, 0, b"ping", None).expect("send");
            let f = c.receiver.recv(None).expect("echo");
            say(&format!("CONNECTED {}", String::from_utf8_lossy(&f.body)));
        }
        Err(e) => say(&format!("CONNECT-ERROR {:?} {e}", e.kind())),
    }
}
