//! Fan-out (publish/subscribe): one publisher process sends each message to 1, 8 or 32
//! subscriptions of the server stream `/bench.Fanout/Watch`, each subscription on its own
//! connection, held by up to four subscriber processes. Measured: the time from a message's
//! publish to its delivery to the last subscriber (p50, p99), and the publisher process's CPU
//! time per publish.
//!
//! - `fanout-isthmus-shm`: the engine's server with its fan-out helper (`serve-fanout-isthmus`,
//!   [`serve_fanout_isthmus`]: not written yet, so the system is skipped with a note), subscribers
//!   on `isthmus::Channel` over `shm://`;
//! - `fanout-tonic-uds`: a tonic server on a Unix socket with the `tonic-uds` settings; each
//!   subscriber is a bounded `tokio::sync::mpsc` whose receiver is its response stream, and each
//!   publish is one `Bytes` cloned into every one (`serve-fanout-tonic`); tonic subscribers;
//! - `fanout-grpcio`: grpcio's server and subscribers, `bench/fanout_grpcio.py`.
//!
//! Every publisher and subscriber role, the Python ones too, keeps one protocol:
//!
//! ```text
//! PUBLISHER TARGET SIZE COUNT INTERVAL_US SUBS [WARMUP]
//!   prints READY once it serves (UNAVAILABLE WHY if its system cannot run: skipped)
//!   waits for SUBS Watch calls, then publishes COUNT messages of SIZE bytes: u64 sequence
//!   number, u64 CLOCK_MONOTONIC ns of the publish (both little-endian), then filler. A publish
//!   comes INTERVAL_US after the one before, and not before every subscriber's stream has taken
//!   that one: no queue builds up when a system is slower than the interval.
//!   CPU window (getrusage(RUSAGE_SELF), user + system): from the publish of seq WARMUP to the
//!   line `stop` on stdin (or its end), which the driver sends once every subscriber has every
//!   message. Then it ends every stream with OK, prints
//!   {"cpu_us_per_publish": µs, "publishes_per_s": rate, "published": COUNT}
//!   and exits at the end of stdin (the driver closes it once every subscriber has left).
//! SUBSCRIBER ADDR CONNS COUNT
//!   CONNS subscriptions, one connection each; prints DONE once each has COUNT messages (or has
//!   failed), then, once the streams have ended,
//!   {"lat_us": [per seq, the largest now - stamp over its subscriptions, null if none],
//!    "lost": messages missing, out of order or extra, "size": the messages' bytes or -1}
//! ```

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::measure;
use crate::report::Record;
use crate::rpc::{self, H2_CONNECTION_WINDOW, H2_STREAM_WINDOW, MAX_MESSAGE};
use crate::system::{ready, unique};

pub(crate) const WATCH_PATH: &str = "/bench.Fanout/Watch";
/// Message sizes and subscriber counts of the matrix.
pub const SIZES: [usize; 2] = [1 << 10, 1 << 20];
pub const SUBSCRIBERS: [usize; 3] = [1, 8, 32];
/// The systems, in the order they take turns within a cell.
pub const SYSTEMS: [&str; 3] = ["fanout-isthmus-shm", "fanout-tonic-uds", "fanout-grpcio"];
/// A publish every 2 ms: subscribers sleep between messages, as catalog updates let them.
const INTERVAL_US: u64 = 2000;
/// Subscriber processes at most (2 cores: 32 processes would measure the scheduler).
const MAX_PROCESSES: usize = 4;
/// Each subscriber's queue in the tonic publisher.
const QUEUE: usize = 64;
/// The stamp at the head of every message: sequence number and publish time.
const HEADER: usize = 16;

/// Messages per cell and the warm-up among them (not in the percentiles nor in the CPU window).
fn counts(size: usize, subscribers: usize, quick: bool) -> (u64, u64) {
    match (quick, size >= 1 << 20 && subscribers >= 32) {
        (false, false) => (200, 10),
        (false, true) => (100, 10),
        (true, false) => (50, 5),
        (true, true) => (30, 5),
    }
}

// ---------------------------------------------------------------------------------------------
// Clocks.

/// CLOCK_MONOTONIC in ns: one clock for every process of the machine (`Instant`'s value is not
/// meant to be compared across processes).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// This process's CPU time, every thread's user and system time, in µs.
pub fn cpu_us() -> f64 {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

// ---------------------------------------------------------------------------------------------
// The publisher's side of the protocol, for every Rust publisher.

/// A publisher role's arguments after its target.
#[derive(Debug, Clone, Copy)]
pub struct PublishArgs {
    pub size: usize,
    pub count: u64,
    pub interval: Duration,
    pub subscribers: usize,
    pub warmup: u64,
}

impl PublishArgs {
    /// `TARGET SIZE COUNT INTERVAL_US SUBS [WARMUP]`.
    fn parse(args: &[String]) -> Result<(String, PublishArgs), String> {
        let usage = "TARGET SIZE COUNT INTERVAL_US SUBS [WARMUP]";
        let num = |i: usize| -> Result<u64, String> {
            args.get(i).and_then(|a| a.parse().ok()).ok_or_else(|| format!("usage: {usage}"))
        };
        let target = args.first().cloned().ok_or_else(|| format!("usage: {usage}"))?;
        let a = PublishArgs {
            size: num(1)? as usize,
            count: num(2)?,
            interval: Duration::from_micros(num(3)?),
            subscribers: num(4)? as usize,
            warmup: if args.len() > 5 { num(5)? } else { 0 },
        };
        if a.size < HEADER || a.subscribers == 0 || a.warmup >= a.count {
            return Err(format!("SIZE must be at least {HEADER}, SUBS at least 1, WARMUP below COUNT"));
        }
        Ok((target, a))
    }
}

/// Pacing, the stamped messages, the CPU window and the report line.
#[derive(Debug)]
pub struct Pacer {
    args: PublishArgs,
    filler: Vec<u8>,
    published: u64,
    /// When the last publish started.
    last: Option<Instant>,
    /// CPU time and clock at the publish of seq `warmup`.
    window: Option<(f64, Instant)>,
}

impl Pacer {
    pub fn new(args: PublishArgs) -> Pacer {
        let filler = vec![0xa5; args.size - HEADER];
        Pacer { args, filler, published: 0, last: None, window: None }
    }

    /// Whether every message has been published.
    pub fn done(&self) -> bool {
        self.published >= self.args.count
    }

    /// Waits until the interval since the last publish has passed.
    pub async fn pace(&self) {
        let Some(last) = self.last else { return };
        let wait = (last + self.args.interval).saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            // On a blocking thread: tokio's timer counts whole milliseconds (2 ms would be 3).
            let _ = tokio::task::spawn_blocking(move || std::thread::sleep(wait)).await;
        }
    }

    /// The next message, stamped now: call it when the publish starts.
    pub fn message(&mut self) -> Bytes {
        let seq = self.published;
        if seq == self.args.warmup {
            self.window = Some((cpu_us(), Instant::now()));
        }
        self.last = Some(Instant::now());
        self.published += 1;
        let mut m = BytesMut::with_capacity(self.args.size);
        m.extend_from_slice(&seq.to_le_bytes());
        m.extend_from_slice(&monotonic_ns().to_le_bytes());
        m.extend_from_slice(&self.filler);
        m.freeze()
    }

    /// The report line, the CPU window closing now.
    pub fn report(&self) -> Value {
        let cpu = cpu_us();
        let measured = self.published.saturating_sub(self.args.warmup);
        let Some((cpu0, t0)) = self.window else {
            return json!({ "cpu_us_per_publish": null, "publishes_per_s": null, "published": self.published });
        };
        let span = self.last.map_or(0.0, |t| t.duration_since(t0).as_secs_f64());
        let rate = if measured > 1 && span > 0.0 { Some((measured - 1) as f64 / span) } else { None };
        json!({
            "cpu_us_per_publish": (cpu - cpu0) / measured.max(1) as f64,
            "publishes_per_s": rate,
            "published": self.published,
        })
    }
}

/// The driver's words on a publisher's stdin: `stop` resolves at its first line (every
/// subscriber has every message), `gone` at its end (every subscriber has seen its stream end
/// and left). The end of stdin resolves both.
#[derive(Debug)]
pub struct Control {
    pub stop: oneshot::Receiver<()>,
    pub gone: oneshot::Receiver<()>,
}

impl Control {
    /// Starts reading stdin on a thread of its own.
    pub fn start() -> Control {
        let (stop_tx, stop) = oneshot::channel();
        let (gone_tx, gone) = oneshot::channel();
        std::thread::spawn(move || {
            let mut lines = std::io::stdin().lock().lines();
            let _ = lines.next();
            let _ = stop_tx.send(());
            for _ in lines.by_ref() {}
            let _ = gone_tx.send(());
        });
        Control { stop, gone }
    }
}

/// Waits until `ok` holds for the count in `tx`.
async fn wait_for(
    tx: &watch::Sender<usize>,
    what: &str,
    within: Duration,
    ok: impl FnMut(&usize) -> bool,
) -> Result<(), String> {
    let mut rx = tx.subscribe();
    let waited = tokio::time::timeout(within, async { rx.wait_for(ok).await.map(drop) }).await;
    match waited {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(format!("{what}: the count went away")),
        Err(_) => Err(format!("timed out after {within:?} waiting for {what}")),
    }
}

fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The roles `serve-fanout-tonic` and `serve-fanout-isthmus`.
pub fn serve(role: &str, args: &[String]) {
    let (target, a) = PublishArgs::parse(args).unwrap_or_else(|e| {
        eprintln!("{role}: {e}");
        std::process::exit(2)
    });
    let result = if role == "serve-fanout-isthmus" {
        serve_fanout_isthmus(&target, a).map_err(|e| {
            // Before READY, an error means the system cannot run here: the driver skips it.
            print_line(&format!("UNAVAILABLE {e}"));
            e
        })
    } else {
        serve_fanout_tonic(&target, a)
    };
    if let Err(e) = result {
        eprintln!("{role}: {e}");
        std::process::exit(1);
    }
}

/// The `fanout-isthmus-shm` publisher: the engine's server on `target` (`shm://NAME`) serving
/// `/bench.Fanout/Watch` with [`isthmus::Topic::serve`], keeping the protocol of this module
/// (READY, SUBS subscribers, [`Pacer`] for the messages and the report, [`Control`]). Like the
/// tonic publisher it publishes the next message only once every stream has taken the last
/// (the topic's `delivered` count), checked after the pacing sleep, so the check rarely runs
/// more than once. An error returned before READY is printed as `UNAVAILABLE …`.
pub fn serve_fanout_isthmus(target: &str, a: PublishArgs) -> Result<(), String> {
    rpc::runtime().block_on(async {
        let topic = isthmus::Topic::new("bench");
        let served = topic.clone();
        let bound = isthmus::Server::builder()
            .handler("/bench.Fanout/Watch", move |mut call: isthmus::ServerCall| {
                let topic = served.clone();
                async move { topic.serve(&mut call).await }
            })
            .bind(target)
            .map_err(|e| format!("bind {target}: {e}"))?;
        tokio::spawn(async move {
            if let Err(e) = bound.serve().await {
                eprintln!("serve-fanout-isthmus: {e}");
            }
        });
        let control = Control::start();
        ready();
        let wanted = a.subscribers;
        poll_until("the subscribers", Duration::from_secs(60), || topic.stats().subscribers >= wanted).await?;
        let mut pacer = Pacer::new(a);
        let taken = Duration::from_secs(30);
        let mut expected = 0u64;
        while !pacer.done() {
            pacer.pace().await;
            poll_until("the streams to take a message", taken, || topic.stats().delivered >= expected).await?;
            let message = pacer.message();
            expected += topic.publish(&message) as u64;
        }
        poll_until("the streams to take the last message", taken, || topic.stats().delivered >= expected).await?;
        let _ = control.stop.await;
        let report = pacer.report();
        // The streams end with OK once their queues are drained.
        topic.close();
        print_line(&report.to_string());
        let _ = poll_until("the streams to end", Duration::from_secs(10), || topic.stats().subscribers == 0).await;
        let _ = tokio::time::timeout(Duration::from_secs(10), control.gone).await;
        Ok(())
    })
}

/// Polls `ok` every 50 µs until it holds (the topic's counters have no waiter to notify).
async fn poll_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Result<(), String> {
    let end = Instant::now() + within;
    while !ok() {
        if Instant::now() >= end {
            return Err(format!("timed out after {within:?} waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_micros(50)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// fanout-tonic-uds: the publisher.

/// The subscribers of the tonic publisher, and the counts it waits on.
struct Hub {
    subscribers: Mutex<Vec<mpsc::Sender<Bytes>>>,
    /// Watch calls taken.
    registered: watch::Sender<usize>,
    /// Subscribers whose stream has not yet taken the last message published.
    untaken: watch::Sender<usize>,
    /// Response streams alive.
    active: watch::Sender<usize>,
}

/// One subscriber's response stream: its queue's receiver, counting what tonic takes from it.
struct Subscription {
    rx: mpsc::Receiver<Bytes>,
    hub: Arc<Hub>,
}

impl tokio_stream::Stream for Subscription {
    type Item = Result<Bytes, tonic::Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let message = std::task::ready!(self.rx.poll_recv(cx));
        if message.is_some() {
            self.hub.untaken.send_modify(|n| *n = n.saturating_sub(1));
        }
        Poll::Ready(message.map(Ok))
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.active.send_modify(|n| *n = n.saturating_sub(1));
    }
}

struct Watch(Arc<Hub>);

impl tonic::server::ServerStreamingService<Bytes> for Watch {
    type Response = Bytes;
    type ResponseStream = Subscription;
    type Future = std::future::Ready<Result<tonic::Response<Subscription>, tonic::Status>>;

    fn call(&mut self, _: tonic::Request<Bytes>) -> Self::Future {
        let (tx, rx) = mpsc::channel(QUEUE);
        let hub = self.0.clone();
        hub.active.send_modify(|n| *n += 1);
        let stream = Subscription { rx, hub: hub.clone() };
        hub.subscribers.lock().unwrap_or_else(PoisonError::into_inner).push(tx);
        hub.registered.send_modify(|n| *n += 1);
        std::future::ready(Ok(tonic::Response::new(stream)))
    }
}

/// The service as tonic's generated servers are: a tower service dispatching on the path.
#[derive(Clone)]
struct FanoutService(Arc<Hub>);

impl tonic::server::NamedService for FanoutService {
    const NAME: &'static str = "bench.Fanout";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<tonic::body::Body>> for FanoutService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let hub = self.0.clone();
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(isthmus::BytesCodec)
                .apply_max_message_size_config(Some(MAX_MESSAGE), Some(MAX_MESSAGE));
            Ok(match req.uri().path() {
                WATCH_PATH => grpc.server_streaming(Watch(hub), req).await,
                other => tonic::Status::unimplemented(other.to_owned()).into_http(),
            })
        })
    }
}

/// The `fanout-tonic-uds` publisher: a tonic server on the Unix socket at `path`.
fn serve_fanout_tonic(path: &str, a: PublishArgs) -> Result<(), String> {
    let _ = std::fs::remove_file(path);
    rpc::runtime().block_on(async {
        let listener = tokio::net::UnixListener::bind(path).map_err(|e| format!("bind {path}: {e}"))?;
        let hub = Arc::new(Hub {
            subscribers: Mutex::new(Vec::new()),
            registered: watch::Sender::new(0),
            untaken: watch::Sender::new(0),
            active: watch::Sender::new(0),
        });
        let server = tonic::transport::Server::builder()
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .add_service(FanoutService(hub.clone()))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener));
        tokio::spawn(async move {
            if let Err(e) = server.await {
                eprintln!("serve-fanout-tonic: {e}");
            }
        });
        let control = Control::start();
        ready();
        let wanted = a.subscribers;
        wait_for(&hub.registered, "the subscribers", Duration::from_secs(60), |&n| n >= wanted).await?;
        let senders = std::mem::take(&mut *hub.subscribers.lock().unwrap_or_else(PoisonError::into_inner));
        let mut pacer = Pacer::new(a);
        let taken = Duration::from_secs(30);
        while !pacer.done() {
            pacer.pace().await;
            wait_for(&hub.untaken, "the streams to take a message", taken, |&n| n == 0).await?;
            let message = pacer.message();
            hub.untaken.send_replace(senders.len());
            for tx in &senders {
                tx.send(message.clone()).await.map_err(|_| "a subscriber went away".to_owned())?;
            }
        }
        wait_for(&hub.untaken, "the streams to take the last message", taken, |&n| n == 0).await?;
        let _ = control.stop.await;
        let report = pacer.report();
        // The streams end with OK once their queues are drained and closed.
        drop(senders);
        print_line(&report.to_string());
        let _ = wait_for(&hub.active, "the streams to end", Duration::from_secs(10), |&n| n == 0).await;
        // A stream's end may still be on its way to the subscriber: exiting now could cut it.
        let _ = tokio::time::timeout(Duration::from_secs(10), control.gone).await;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The Rust subscribers: tonic over a Unix socket, the engine's client over shm://.

/// One subscription's messages.
struct Tally {
    /// Per seq, `now - stamp` in µs (NaN: not received in order).
    lat_us: Vec<f64>,
    next: u64,
    bad: u64,
    size: Option<usize>,
    sizes_differ: bool,
    /// Dropped once this subscription has every message (or has failed).
    done: Option<mpsc::UnboundedSender<()>>,
}

impl Tally {
    fn new(count: u64, done: mpsc::UnboundedSender<()>) -> Tally {
        Tally {
            lat_us: vec![f64::NAN; count as usize],
            next: 0,
            bad: 0,
            size: None,
            sizes_differ: false,
            done: Some(done),
        }
    }

    fn take(&mut self, m: &[u8], now_ns: u64) {
        let word = |at: usize| m.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match (word(0), word(8)) {
            (Some(seq), Some(stamp)) if seq == self.next && (seq as usize) < self.lat_us.len() => {
                self.lat_us[seq as usize] = now_ns.saturating_sub(stamp) as f64 / 1e3;
                self.next += 1;
            }
            _ => self.bad += 1,
        }
        match self.size {
            None => self.size = Some(m.len()),
            Some(s) if s != m.len() => self.sizes_differ = true,
            Some(_) => {}
        }
        if self.next as usize == self.lat_us.len() {
            self.done = None;
        }
    }

    fn lost(&self) -> u64 {
        self.lat_us.len() as u64 - self.next + self.bad
    }
}

async fn watch_tonic(path: &str, tally: &mut Tally) -> Result<(), String> {
    let channel = rpc::uds_channel(path.to_owned()).await.map_err(|e| format!("connect: {e}"))?;
    let mut grpc =
        tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE);
    grpc.ready().await.map_err(|e| format!("ready: {e}"))?;
    let request = tonic::Request::new(Bytes::new());
    let path = http::uri::PathAndQuery::from_static(WATCH_PATH);
    let mut stream =
        grpc.server_streaming(request, path, isthmus::BytesCodec).await.map_err(|e| e.to_string())?.into_inner();
    while let Some(m) = stream.message().await.map_err(|e| e.to_string())? {
        tally.take(&m, monotonic_ns());
    }
    Ok(())
}

async fn watch_isthmus(target: &str, tally: &mut Tally) -> Result<(), String> {
    let channel = isthmus::Channel::connect(target).await.map_err(|e| format!("connect: {e}"))?;
    let mut call = channel.start(WATCH_PATH, Default::default()).await.map_err(|e| e.to_string())?;
    call.send_last(&[]).await.map_err(|e| e.to_string())?;
    while let Some(m) = call.recv().await.map_err(|e| e.to_string())? {
        tally.take(&m, monotonic_ns());
    }
    Ok(())
}

/// The role `fanout-subscriber SYSTEM ADDR CONNS COUNT` (SYSTEM: `tonic` or `isthmus`).
pub fn subscribe(args: &[String]) {
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let (system, addr) = (arg(0), arg(1));
    let (Ok(conns), Ok(count)) = (arg(2).parse::<usize>(), arg(3).parse::<u64>()) else {
        eprintln!("usage: fanout-subscriber tonic|isthmus ADDR CONNS COUNT");
        std::process::exit(2);
    };
    let out = rpc::runtime().block_on(async move {
        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let tasks: Vec<_> = (0..conns)
            .map(|_| {
                let (system, addr, done) = (system.clone(), addr.clone(), done_tx.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::new(count, done);
                    let watched = match system.as_str() {
                        "tonic" => watch_tonic(&addr, &mut tally).await,
                        "isthmus" => watch_isthmus(&addr, &mut tally).await,
                        other => Err(format!("no subscriber for {other}")),
                    };
                    if let Err(e) = watched {
                        eprintln!("fanout-subscriber {system}: {e}");
                    }
                    tally.done = None;
                    tally
                })
            })
            .collect();
        drop(done_tx);
        // Every subscription has every message (or failed): the publisher may stop its clock.
        while done_rx.recv().await.is_some() {}
        print_line("DONE");
        let mut lat_us = vec![f64::NAN; count as usize];
        let (mut lost, mut sizes) = (0, HashSet::new());
        for task in tasks {
            match task.await {
                Ok(tally) => {
                    for (max, v) in lat_us.iter_mut().zip(&tally.lat_us) {
                        *max = max.max(*v);
                    }
                    lost += tally.lost();
                    if tally.sizes_differ {
                        sizes.insert(usize::MAX);
                    }
                    sizes.extend(tally.size);
                }
                Err(e) => {
                    eprintln!("fanout-subscriber: a subscription failed: {e}");
                    lost += count;
                }
            }
        }
        let size = match sizes.iter().collect::<Vec<_>>()[..] {
            [&s] if s != usize::MAX => s as i64,
            _ => -1,
        };
        let lat: Vec<Value> = lat_us
            .iter()
            .map(|&v| if v.is_finite() { json!((v * 1000.0).round() / 1000.0) } else { Value::Null })
            .collect();
        json!({ "lat_us": lat, "lost": lost, "size": size })
    });
    print_line(&out.to_string());
}

// ---------------------------------------------------------------------------------------------
// The driver.

/// A child process of a cell: its stdout read line by line, killed and reaped on drop.
struct Proc {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std_mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(mut command: Command, what: String) -> Result<Proc, String> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std_mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(Proc { what, child, stdin, lines })
    }

    /// The next line it prints, by `deadline`.
    fn line(&mut self, deadline: Instant) -> Result<String, String> {
        match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => Ok(line),
            Err(std_mpsc::RecvTimeoutError::Timeout) => Err(format!("{}: no answer in time", self.what)),
            Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                self.wait(Duration::from_secs(1));
                let status = match self.child.try_wait() {
                    Ok(Some(status)) => status.to_string(),
                    Ok(None) => "its output closed".into(),
                    Err(e) => e.to_string(),
                };
                Err(format!("{} ended ({status})", self.what))
            }
        }
    }

    /// The next line it prints, which must be `expected`.
    fn expect(&mut self, expected: &str, deadline: Instant) -> Result<(), String> {
        match self.line(deadline)? {
            line if line.trim() == expected => Ok(()),
            other => Err(format!("{}: expected {expected}, got {other:?}", self.what)),
        }
    }

    /// The next line it prints, as JSON.
    fn json(&mut self, deadline: Instant) -> Result<Value, String> {
        let line = self.line(deadline)?;
        serde_json::from_str(&line).map_err(|e| format!("{}: {e} in {line:?}", self.what))
    }

    fn send_line(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or_else(|| format!("{}: stdin closed", self.what))?;
        writeln!(stdin, "{line}").and_then(|()| stdin.flush()).map_err(|e| format!("{}: {e}", self.what))
    }

    /// Waits up to `within` for it to exit; it is killed on drop otherwise.
    fn wait(&mut self, within: Duration) {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A path removed on drop (a Unix socket a publisher bound).
struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One cell's result.
enum Outcome {
    Measured {
        p50_us: f64,
        p99_us: f64,
        cpu_us_per_publish: f64,
        publishes_per_s: f64,
        lost: u64,
    },
    /// The publisher cannot run here (`UNAVAILABLE …`): the system is skipped.
    Unavailable(String),
}

/// One (system, size, subscribers) cell: a publisher, its subscriber processes, the stamps.
fn cell(system: &str, size: usize, subs: usize, (count, warmup): (u64, u64), python: &str) -> Result<Outcome, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // Dropped last: removed once every process of the cell is gone, as they may not have.
    let (target, _socket) = match system {
        "fanout-isthmus-shm" => {
            let target = format!("shm://{}", unique("fanout"));
            let address: isthmus_shm::Address = target.parse().map_err(|e| format!("{target}: {e}"))?;
            (target, TempPath(address.socket_path().to_owned()))
        }
        _ => {
            let path = std::env::temp_dir().join(format!("{}.sock", unique("fanout")));
            (path.display().to_string(), TempPath(path))
        }
    };
    let publish_args = [
        target.clone(),
        size.to_string(),
        count.to_string(),
        INTERVAL_US.to_string(),
        subs.to_string(),
        warmup.to_string(),
    ];
    // `role` and the words after it, for this binary.
    let rust = |role: &str| {
        let mut c = Command::new(&exe);
        c.args(role.split_whitespace());
        c
    };
    let py = |role: &str| {
        let mut c = Command::new(python);
        // grpc-core's notes (a GOAWAY as a publisher stops) would fill the run's output.
        c.args(["bench/fanout_grpcio.py", role]).env("GRPC_VERBOSITY", "ERROR");
        c
    };
    let mut publisher = match system {
        "fanout-isthmus-shm" => rust("serve-fanout-isthmus"),
        "fanout-tonic-uds" => rust("serve-fanout-tonic"),
        _ => py("serve"),
    };
    publisher.args(&publish_args);
    let subscriber = |conns: usize| {
        let mut c = match system {
            "fanout-isthmus-shm" => rust("fanout-subscriber isthmus"),
            "fanout-tonic-uds" => rust("fanout-subscriber tonic"),
            _ => py("subscribe"),
        };
        c.args([target.clone(), conns.to_string(), count.to_string()]);
        c
    };

    let mut publisher = Proc::spawn(publisher, format!("{system} publisher"))?;
    let line = publisher.line(Instant::now() + Duration::from_secs(30))?;
    if let Some(why) = line.strip_prefix("UNAVAILABLE") {
        return Ok(Outcome::Unavailable(why.trim().to_owned()));
    }
    if line.trim() != "READY" {
        return Err(format!("{system} publisher: expected READY, got {line:?}"));
    }
    let processes = subs.min(MAX_PROCESSES);
    let mut subscribers = (0..processes)
        .map(|i| {
            let conns = subs / processes + usize::from(i < subs % processes);
            Proc::spawn(subscriber(conns), format!("{system} subscriber {i}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Generous: a cell that has not finished by then is stuck, not slow.
    let deadline = Instant::now() + Duration::from_secs(60) + Duration::from_millis(250) * count as u32;
    for s in subscribers.iter_mut() {
        s.expect("DONE", deadline)?;
    }
    publisher.send_line("stop")?;
    let report = publisher.json(deadline)?;
    let outs = subscribers.iter_mut().map(|s| s.json(deadline)).collect::<Result<Vec<_>, _>>()?;
    for s in subscribers.iter_mut() {
        s.wait(Duration::from_secs(5));
    }
    // Every subscriber has left: the publisher may go.
    drop(publisher.stdin.take());
    publisher.wait(Duration::from_secs(5));

    let mut last = vec![f64::NAN; count as usize];
    let mut lost = 0;
    for out in &outs {
        if out["size"].as_i64() != Some(size as i64) {
            return Err(format!("{system}: a subscriber saw messages of {} bytes, not {size}", out["size"]));
        }
        lost += out["lost"].as_u64().ok_or("a subscriber's report has no `lost`")?;
        let lat = out["lat_us"].as_array().ok_or("a subscriber's report has no `lat_us`")?;
        for (max, v) in last.iter_mut().zip(lat) {
            *max = max.max(v.as_f64().unwrap_or(f64::NAN));
        }
    }
    let mut lat: Vec<Duration> = last[warmup as usize..]
        .iter()
        .filter(|v| v.is_finite())
        .map(|&us| Duration::from_secs_f64(us.max(0.0) / 1e6))
        .collect();
    if lat.is_empty() {
        return Err(format!("{system}: no message arrived"));
    }
    let n = lat.len();
    let s = measure::summarise(&mut lat, n, Duration::from_secs(1));
    let field = |name: &str| report[name].as_f64().unwrap_or(f64::NAN);
    Ok(Outcome::Measured {
        p50_us: s.p50_us,
        p99_us: s.p99_us,
        cpu_us_per_publish: field("cpu_us_per_publish"),
        publishes_per_s: field("publishes_per_s"),
        lost,
    })
}

/// The fan-out matrix: every system in `only` (all when `None`; `tonic-uds` names
/// `fanout-tonic-uds`), each (size, subscribers) cell with the systems taking turns, for
/// `ROUNDS` rounds (one with `quick`). Returns the records and whether every cell ran clean
/// (a skipped system is not a failure; a failed cell or a lost message is).
pub fn run(quick: bool, only: Option<&[String]>) -> (Vec<Record>, bool) {
    let wanted =
        |system: &str| only.is_none_or(|names| names.iter().any(|n| n == system || format!("fanout-{n}") == system));
    let mut systems: Vec<&str> = SYSTEMS.into_iter().filter(|s| wanted(s)).collect();
    let python = crate::python::python();
    if python.is_none() && systems.contains(&"fanout-grpcio") {
        eprintln!("no .venv/bin/python: skipping fanout-grpcio (run `make python` and `make peers` first)");
        systems.retain(|&s| s != "fanout-grpcio");
    }
    let python = python.unwrap_or_default();
    let rounds = if quick { 1 } else { crate::ROUNDS };
    let cells = rounds * SIZES.len() * SUBSCRIBERS.len() * systems.len();
    let (mut done, mut clean) = (0, true);
    let mut skipped: HashSet<&str> = HashSet::new();
    let mut records = Vec::new();
    for round in 1..=rounds {
        for size in SIZES {
            for subs in SUBSCRIBERS {
                for &system in &systems {
                    done += 1;
                    if skipped.contains(system) {
                        continue;
                    }
                    let what = format!("round {round}: {system} {} to {subs}", crate::report::size_name(size));
                    crate::status(&format!("[{done:>3}/{cells}] {what}"));
                    let (count, warmup) = counts(size, subs, quick);
                    match cell(system, size, subs, (count, warmup), &python) {
                        Ok(Outcome::Unavailable(why)) => {
                            crate::status("");
                            eprintln!("{system}: skipped ({why})");
                            skipped.insert(system);
                        }
                        Ok(Outcome::Measured { p50_us, p99_us, cpu_us_per_publish, publishes_per_s, lost }) => {
                            if lost > 0 {
                                crate::status("");
                                eprintln!("{what}: {lost} messages lost or out of order");
                                clean = false;
                            }
                            let sample = measure::Sample { p50_us, p99_us, rps: publishes_per_s };
                            let mut r = Record::new(system, size, 1, round, sample);
                            let r3 =
                                |v: f64| if v.is_finite() { json!((v * 1000.0).round() / 1000.0) } else { Value::Null };
                            r.extra = json!({
                                "subscribers": subs,
                                "cpu_us_per_publish": r3(cpu_us_per_publish),
                                "lost": lost,
                                "messages": count - warmup,
                                "interval_us": INTERVAL_US,
                            });
                            records.push(r);
                        }
                        Err(e) => {
                            crate::status("");
                            eprintln!("{what}: failed: {e}");
                            clean = false;
                        }
                    }
                }
            }
        }
    }
    crate::status("");
    (records, clean)
}
