//! A subscriber process of the topic tests: `topic-subscriber ADDR COUNT HOLD`.
//!
//! Calls `/topic.Feed/Watch` on ADDR (any target a `Channel` takes) with the engine's client,
//! prints `READY` once the call is open, then `GOT seq` for every message whose bytes are the
//! pattern for its seq (`BAD seq` otherwise; a message is seq as a `u64`, then the pattern of
//! [`isthmus_tests::fill`] for that seed), and after COUNT messages or the end of the stream
//! `END code`. With HOLD=1 it keeps every message (views into the server's shared memory) and
//! waits to be killed.

use std::io::Write;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (addr, count, hold) = match (args.get(1), args.get(2).and_then(|c| c.parse::<usize>().ok()), args.get(3)) {
        (Some(a), Some(c), h) => (a.clone(), c, h.is_some_and(|h| h == "1")),
        _ => {
            eprintln!("usage: topic-subscriber ADDR COUNT HOLD");
            std::process::exit(2)
        }
    };
    isthmus_tests::runtime().block_on(async move {
        let channel = isthmus::Channel::connect(&addr).await.expect("connect");
        let mut call = channel.start("/topic.Feed/Watch", Default::default()).await.expect("start");
        call.send_last(b"").await.expect("request");
        say("READY");
        let mut kept = Vec::new();
        let end = loop {
            if kept.len() == count && !hold {
                break "OK".to_owned();
            }
            match call.recv().await {
                Ok(Some(m)) => {
                    let seq = m.get(..8).map_or(u64::MAX, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
                    let ok = isthmus_tests::first_mismatch(&m[8.min(m.len())..], seq).is_none();
                    say(&format!("{} {seq}", if ok { "GOT" } else { "BAD" }));
                    kept.push(m);
                    if hold && kept.len() == count {
                        say("HOLDING");
                        std::future::pending::<()>().await;
                    }
                }
                Ok(None) => break "OK".to_owned(),
                Err(status) => break format!("{:?}", status.code()),
            }
        };
        say(&format!("END {end}"));
    });
}
