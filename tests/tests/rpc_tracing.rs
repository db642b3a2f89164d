//! Calls are `tracing` spans on both sides, with the final code recorded. The server runs in
//! this process here (a subscriber sees only its own process), over a real segment.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use isthmus::{CallOptions, Channel, Code, Server, ServerCall, Status};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records each span's name and fields as text, keyed by span id.
#[derive(Default)]
struct Spans {
    next: AtomicU64,
    seen: Mutex<Vec<String>>,
}

struct Fields<'a>(&'a mut String);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={:?}", field.name(), value));
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut text = span.metadata().name().to_owned();
        span.record(&mut Fields(&mut text));
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(text);
        }
        Id::from_u64(id + 1)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Ok(mut seen) = self.seen.lock() {
            if let Some(text) = seen.get_mut(span.into_u64() as usize - 1) {
                values.record(&mut Fields(text));
            }
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn each_call_is_a_span_on_both_sides_with_its_final_code() {
    let spans = Arc::new(Spans::default());
    tracing::subscriber::set_global_default(Arc::clone(&spans)).expect("first subscriber");
    let addr = isthmus_tests::fresh_addr("trace");
    let rt = isthmus_tests::runtime();
    rt.block_on(async {
        let bound = Server::builder()
            .handler("/t.S/Ok", |mut call: ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                call.send(&m).await
            })
            .handler("/t.S/Fail", |_call: ServerCall| async move { Err(Status::new(Code::NotFound, "nope")) })
            .bind(&addr)
            .expect("bind");
        tokio::spawn(bound.serve());
        let ch = Channel::connect(&addr).await.expect("connect");
        ch.unary("/t.S/Ok", b"x", CallOptions::default()).await.expect("ok");
        let s = ch.unary("/t.S/Fail", b"x", CallOptions::default()).await.expect_err("fails");
        assert_eq!(s.code(), Code::NotFound);
        // The server records its code just before it sends the trailers the client waited for.
        let done = isthmus_tests::eventually(Duration::from_secs(10), || {
            spans.seen.lock().map(|s| s.iter().filter(|t| t.contains("code=")).count() >= 4).unwrap_or(false)
        });
        let seen = spans.seen.lock().map(|s| s.clone()).unwrap_or_default();
        assert!(done, "spans: {seen:#?}");
        let has = |name: &str, path: &str, code: &str| {
            seen.iter().any(|t| t.starts_with(name) && t.contains(path) && t.contains(&format!("code={code}")))
        };
        assert!(has("isthmus.call", "/t.S/Ok", "Ok"), "{seen:#?}");
        assert!(has("isthmus.call", "/t.S/Fail", "NotFound"), "{seen:#?}");
        assert!(has("isthmus.serve", "/t.S/Ok", "Ok"), "{seen:#?}");
        assert!(has("isthmus.serve", "/t.S/Fail", "NotFound"), "{seen:#?}");
    });
}
