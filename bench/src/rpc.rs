//! Echo through whole RPC stacks: the isthmus engine over `shm://` (`isthmus-rust`) beside
//! tonic over a Unix socket (`tonic-uds`). Both echo raw bytes: tonic gets a pass-through codec,
//! so neither side pays for protobuf, and both get message limits raised out of the way.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::measure::{self, Budget, Sample};
use crate::system::{ready, unique, Server, System};

pub(crate) const PATH: &str = "/bench.Echo/Unary";
/// A server stream: the request is `u32 count, u32 size` (little-endian); the reply is `count`
/// messages of `size` bytes.
const STREAM_PATH: &str = "/bench.Echo/Stream";

/// The stream request for `count` messages of `size` bytes.
fn stream_request(count: usize, size: usize) -> Vec<u8> {
    [(count as u32).to_le_bytes(), (size as u32).to_le_bytes()].concat()
}

fn parse_stream_request(m: &[u8]) -> Option<(usize, usize)> {
    let word = |at: usize| m.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
    Some((word(0)? as usize, word(4)? as usize))
}

/// How many messages a stream of `size`-byte messages carries: about 256 MiB, at most 200 000.
pub fn stream_count(size: usize) -> usize {
    ((256 << 20) / size.max(1)).clamp(16, 200_000)
}

/// The largest message either stack accepts here: 16 MiB echoes must pass.
pub(crate) const MAX_MESSAGE: usize = 64 << 20;

// ---------------------------------------------------------------------------------------------
// isthmus-rust: the engine's blocking client → the engine's server.

/// Server role: an isthmus server echoing unary calls.
///
/// Several targets at once (`shm://` and an HTTP/2 one) offer the first to clients of the
/// second on this machine: the upgrade.
pub fn serve_isthmus(targets: &[String]) {
    let mut config = isthmus::Config::default();
    // The protocol features granted (ADR 0025), to compare with and without one in one build:
    // `ISTHMUS_BENCH_FEATURES=0` serves every call in the frames of protocol 13.7 alone.
    if let Some(features) = std::env::var("ISTHMUS_BENCH_FEATURES").ok().and_then(|f| f.parse().ok()) {
        config.features = features;
    }
    serve_isthmus_with(targets, config)
}

/// [`serve_isthmus`] with the connections' spin bound set to `spin_us` (0: a wait sleeps at once).
pub fn serve_isthmus_spin(addr: &str, spin_us: u64) {
    let mut config = isthmus::Config::default();
    config.spin.max = std::time::Duration::from_micros(spin_us);
    serve_isthmus_with(&[addr.to_owned()], config)
}

/// The soak's server: the echo on `addr`, writing its connections' largest arena high-water mark
/// to `stats_path` as JSON a few times a second.
pub fn serve_isthmus_soak(addr: &str, stats_path: &str) {
    serve_isthmus_inner(&[addr.to_owned()], isthmus::Config::default(), Some(stats_path.to_owned()))
}

fn serve_isthmus_with(targets: &[String], config: isthmus::Config) {
    serve_isthmus_inner(targets, config, None)
}

fn serve_isthmus_inner(targets: &[String], config: isthmus::Config, stats_path: Option<String>) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let bound = isthmus::Server::builder()
            .config(config)
            .handler(PATH, |mut call: isthmus::ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                call.send_last(&m).await
            })
            .handler(crate::allocs::COUNT_PATH, |mut call: isthmus::ServerCall| async move {
                call.send(&crate::allocs::count().to_le_bytes()).await
            })
            .handler(STREAM_PATH, |mut call: isthmus::ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                let (count, size) = parse_stream_request(&m)
                    .ok_or_else(|| isthmus::Status::new(isthmus::Code::InvalidArgument, "count and size"))?;
                let message = vec![0xa5u8; size];
                for _ in 0..count {
                    call.send(&message).await?;
                }
                Ok(())
            })
            .bind_all(targets.iter().map(String::as_str))
            .expect("bind");
        if let Some(path) = stats_path {
            let stats = bound.stats();
            tokio::spawn(async move {
                let mut high = 0;
                loop {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    high = stats.connections().iter().map(|c| c.transport.arena_high_water).fold(high, u64::max);
                    let tmp = format!("{path}.tmp");
                    if std::fs::write(&tmp, format!("{{\"arena_high_water\": {high}}}")).is_ok() {
                        let _ = std::fs::rename(&tmp, &path);
                    }
                }
            });
        }
        ready();
        bound.serve().await.expect("serve");
    });
}

/// The engine's echo, called from a plain thread with the blocking client: one call in flight
/// is the calling thread's alone; 32 in flight are pipelined calls read by that same thread.
pub struct IsthmusRust {
    _server: Server,
    channel: isthmus::blocking::Channel,
}

impl IsthmusRust {
    pub fn start() -> IsthmusRust {
        IsthmusRust::against("serve-isthmus")
    }

    /// The blocking client against the server of `role` (`serve-isthmus`, or
    /// `serve-tonic-isthmus` to see what the tonic service side costs alone).
    pub fn against(role: &str) -> IsthmusRust {
        let addr = format!("shm://{}", unique("rpc"));
        let server = Server::spawn(&[role.into(), addr.clone()]);
        let channel = isthmus::blocking::Channel::connect(&addr).expect("connect");
        IsthmusRust { _server: server, channel }
    }

    fn finish(call: &mut isthmus::blocking::Call, size: usize) {
        let m = call.recv().expect("echo").expect("a reply");
        assert_eq!(m.len(), size);
        assert!(call.recv().expect("end").is_none());
    }
}

impl System for IsthmusRust {
    fn name(&self) -> &'static str {
        "isthmus-rust"
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let payload = vec![0x5au8; size];
        let ch = &self.channel;
        let before = ch.counters().transport;
        let s = measure::run(budget, size, || {
            let r = ch.unary(PATH, &payload, Default::default()).expect("echo");
            assert_eq!(r.message.len(), size);
        });
        if std::env::var_os("ISTHMUS_BENCH_DEBUG").is_some() {
            let after = ch.counters().transport;
            eprintln!(
                "client: frames rx {} sleeps {} spin hits {} rung {}",
                after.frames_received - before.frames_received,
                after.sleeps - before.sleeps,
                after.spin_hits - before.spin_hits,
                after.doorbells_rung - before.doorbells_rung
            );
        }
        s
    }

    fn pipelined(&mut self, size: usize, inflight: usize, budget: Budget) -> Option<Sample> {
        let payload = vec![0x5au8; size];
        let ch = &self.channel;
        let start_one = || {
            let mut call = ch.start(PATH, Default::default()).expect("start");
            call.send_last(&payload).expect("send");
            (Instant::now(), call)
        };
        let total = (budget.max_iters * 4).max(inflight * 4);
        let mut lat = Vec::with_capacity(total);
        // The clock starts before the first calls are issued, as for every other system.
        let start = Instant::now();
        let mut open: VecDeque<_> = (0..inflight).map(|_| start_one()).collect();
        let mut sent = inflight;
        while let Some((at, mut call)) = open.pop_front() {
            Self::finish(&mut call, size);
            lat.push(at.elapsed());
            if sent < total && start.elapsed() < budget.time {
                open.push_back(start_one());
                sent += 1;
            }
        }
        let n = lat.len();
        Some(measure::summarise(&mut lat, n, start.elapsed()))
    }

    fn stream(&mut self, size: usize) -> Option<Sample> {
        let count = stream_count(size);
        let mut call = self.channel.start(STREAM_PATH, Default::default()).expect("start");
        call.send_last(&stream_request(count, size)).expect("request");
        let mut gaps = Vec::with_capacity(count);
        let start = Instant::now();
        let mut last = start;
        while let Some(m) = call.recv().expect("message") {
            assert_eq!(m.len(), size);
            let now = Instant::now();
            gaps.push(now - last);
            last = now;
        }
        assert_eq!(gaps.len(), count);
        Some(measure::summarise(&mut gaps, count, start.elapsed()))
    }
}

// ---------------------------------------------------------------------------------------------
// tonic-uds: a tonic client → a tonic server over a Unix socket.

/// The echo service, written as tonic's generated servers are: a tower service per package
/// service, dispatching on the method path. Also `tonic-floor`'s transport: a tonic client on
/// it hands each `http::Request` it builds straight to the service, in the same task, and takes
/// the service's `http::Response` as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct EchoService;

impl tonic::server::NamedService for EchoService {
    const NAME: &'static str = "bench.Echo";
}

struct EchoUnary;

impl tonic::server::UnaryService<Bytes> for EchoUnary {
    type Response = Bytes;
    type Future = std::future::Ready<Result<tonic::Response<Bytes>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        std::future::ready(Ok(tonic::Response::new(request.into_inner())))
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

struct EchoStream;

type MessageStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Bytes, tonic::Status>> + Send>>;

impl tonic::server::ServerStreamingService<Bytes> for EchoStream {
    type Response = Bytes;
    type ResponseStream = MessageStream;
    type Future = std::future::Ready<Result<tonic::Response<MessageStream>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        std::future::ready(match parse_stream_request(request.get_ref()) {
            None => Err(tonic::Status::invalid_argument("count and size")),
            Some((count, size)) => {
                let message = Bytes::from(vec![0xa5u8; size]);
                let stream: MessageStream = Box::pin(tokio_stream::iter((0..count).map(move |_| Ok(message.clone()))));
                Ok(tonic::Response::new(stream))
            }
        })
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for EchoService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(isthmus::BytesCodec)
                .apply_max_message_size_config(Some(MAX_MESSAGE), Some(MAX_MESSAGE));
            Ok(match req.uri().path() {
                PATH => grpc.unary(EchoUnary, req).await,
                STREAM_PATH => grpc.server_streaming(EchoStream, req).await,
                other => tonic::Status::unimplemented(other.to_owned()).into_http(),
            })
        })
    }
}

/// HTTP/2 flow-control windows for both tonic sides: large enough that a 16 MiB message is
/// never held back by a window update (hyper's defaults are 64 KiB to 5 MiB).
pub(crate) const H2_STREAM_WINDOW: u32 = 32 << 20;
pub(crate) const H2_CONNECTION_WINDOW: u32 = 64 << 20;

/// Server role: a tonic server on a Unix socket.
pub fn serve_tonic(path: &str) {
    let _ = std::fs::remove_file(path);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let listener = tokio::net::UnixListener::bind(path).expect("bind");
        ready();
        tonic::transport::Server::builder()
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .add_service(EchoService)
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
            .expect("serve");
    });
}

/// The transports a tonic client runs on here.
pub trait TonicTransport:
    tonic::client::GrpcService<
        tonic::body::Body,
        Error: Into<tonic::codegen::StdError>,
        ResponseBody: http_body::Body<Data = Bytes, Error: Into<tonic::codegen::StdError> + Send> + Send + 'static,
        Future: Send,
    > + Clone
    + Send
    + Sync
    + 'static
{
}

impl TonicTransport for tonic::transport::Channel {}
impl TonicTransport for isthmus::Channel {}
impl TonicTransport for EchoService {}

/// A tonic client, on a multi-threaded tokio runtime as a tonic user has it, over `T`.
pub struct TonicClient<T> {
    name: &'static str,
    _server: Option<Server>,
    rt: tokio::runtime::Runtime,
    channel: T,
    socket: Option<String>,
}

impl TonicClient<tonic::transport::Channel> {
    /// `tonic-uds`: tonic client → tonic server over a Unix socket.
    pub fn over_uds() -> Self {
        let path = std::env::temp_dir().join(format!("{}.sock", unique("tonic"))).display().to_string();
        let server = Server::spawn(&["serve-tonic".into(), path.clone()]);
        let rt = runtime();
        let channel = rt.block_on(uds_channel(path.clone())).expect("connect");
        TonicClient { name: "tonic-uds", _server: Some(server), rt, channel, socket: Some(path) }
    }
}

/// A tonic channel (one HTTP/2 connection) to the Unix socket at `path`, with the bench's windows.
pub(crate) async fn uds_channel(path: String) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tonic::transport::Endpoint::from_static("http://localhost")
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let socket = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

impl TonicClient<isthmus::Channel> {
    /// `tonic-isthmus-shm`: the same tonic client and service, with isthmus under them: the
    /// client on an `isthmus::Channel`, the service behind `isthmus::Server::add_service`.
    pub fn over_isthmus() -> Self {
        Self::over_isthmus_against("serve-tonic-isthmus")
    }

    /// The tonic client over isthmus against the server of `role` (`serve-tonic-isthmus`, or
    /// `serve-isthmus` to see what the tonic client side costs alone).
    pub fn over_isthmus_against(role: &str) -> Self {
        let addr = format!("shm://{}", unique("tonic-shm"));
        let server = Server::spawn(&[role.into(), addr.clone()]);
        let rt = runtime();
        let channel = rt.block_on(isthmus::Channel::connect(&addr)).expect("connect");
        TonicClient { name: "tonic-isthmus-shm", _server: Some(server), rt, channel, socket: None }
    }
}

impl TonicClient<EchoService> {
    /// `tonic-floor`: the tonic client and service of `tonic-uds` and `tonic-isthmus-shm`, with
    /// nothing between them (the client's transport is the service itself). No transport under
    /// tonic's own layers can be faster, so `tonic-isthmus-shm`'s figure is this floor plus what
    /// isthmus adds.
    pub fn in_process() -> Self {
        TonicClient { name: "tonic-floor", _server: None, rt: runtime(), channel: EchoService, socket: None }
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Server role: the tonic echo service behind `isthmus::Server` on `shm://`.
pub fn serve_tonic_isthmus(addr: &str) {
    runtime().block_on(async {
        let bound = isthmus::Server::builder().add_service(EchoService).bind(addr).expect("bind");
        ready();
        bound.serve().await.expect("serve");
    });
}

impl<T> Drop for TonicClient<T> {
    fn drop(&mut self) {
        if let Some(path) = &self.socket {
            let _ = std::fs::remove_file(path);
        }
    }
}

pub(crate) async fn tonic_echo<T: TonicTransport>(channel: T, payload: Bytes) -> usize {
    let mut grpc =
        tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE);
    grpc.ready().await.map_err(Into::into).expect("ready");
    let path = http::uri::PathAndQuery::from_static(PATH);
    let reply = grpc.unary(tonic::Request::new(payload), path, isthmus::BytesCodec).await.expect("echo");
    reply.into_inner().len()
}

impl<T: TonicTransport> System for TonicClient<T> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let payload = Bytes::from(vec![0x5au8; size]);
        let channel = self.channel.clone();
        // The client runs in a task of the runtime, as the code of a tonic user does.
        let task = self.rt.spawn(async move {
            measure::run_async(budget, size, || {
                let (channel, payload) = (channel.clone(), payload.clone());
                async move { assert_eq!(tonic_echo(channel, payload).await, size) }
            })
            .await
        });
        self.rt.block_on(task).expect("client task")
    }

    fn pipelined(&mut self, size: usize, inflight: usize, budget: Budget) -> Option<Sample> {
        let payload = Bytes::from(vec![0x5au8; size]);
        let total = (budget.max_iters * 4).max(inflight * 4);
        let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let start = Instant::now();
        let until = start + budget.time;
        let workers: Vec<_> = (0..inflight)
            .map(|_| {
                let (channel, payload, issued) = (self.channel.clone(), payload.clone(), issued.clone());
                self.rt.spawn(async move {
                    let mut lat = Vec::new();
                    loop {
                        let n = issued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if n >= inflight && (n >= total || Instant::now() >= until) {
                            break;
                        }
                        let at = Instant::now();
                        assert_eq!(tonic_echo(channel.clone(), payload.clone()).await, size);
                        lat.push(at.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut lat: Vec<Duration> = Vec::with_capacity(total);
        for w in workers {
            lat.extend(self.rt.block_on(w).expect("worker"));
        }
        let n = lat.len();
        Some(measure::summarise(&mut lat, n, start.elapsed()))
    }

    fn stream(&mut self, size: usize) -> Option<Sample> {
        let count = stream_count(size);
        let channel = self.channel.clone();
        let task = self.rt.spawn(async move {
            let mut grpc = tonic::client::Grpc::new(channel)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE);
            grpc.ready().await.map_err(Into::into).expect("ready");
            let path = http::uri::PathAndQuery::from_static(STREAM_PATH);
            let request = tonic::Request::new(Bytes::from(stream_request(count, size)));
            let start = Instant::now();
            let mut stream =
                grpc.server_streaming(request, path, isthmus::BytesCodec).await.expect("stream").into_inner();
            let mut gaps = Vec::with_capacity(count);
            let mut last = start;
            while let Some(m) = stream.message().await.expect("message") {
                assert_eq!(m.len(), size);
                let now = Instant::now();
                gaps.push(now - last);
                last = now;
            }
            assert_eq!(gaps.len(), count);
            measure::summarise(&mut gaps, count, start.elapsed())
        });
        Some(self.rt.block_on(task).expect("client task"))
    }
}
