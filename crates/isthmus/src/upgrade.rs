//! One address for both worlds: a channel to an HTTP/2 address (`host:port`, `unix:`,
//! `https://`…) whose server is an isthmus server on this machine that also serves `shm://`
//! moves its calls to shared memory, and stays on HTTP/2 otherwise (ADR 0013).
//!
//! **The offer.** Every HTTP/2 endpoint of a server answers `/isthmus.v1.Upgrade/Offer`
//! (`OfferService`): an empty message whose initial metadata names the server's public
//! `shm://` endpoint as a socket path (`isthmus-shm-target`), the server's process id
//! (`isthmus-shm-pid`) and the machine's boot id (`isthmus-boot-id`). A server with no public
//! `shm://` endpoint, with the offer turned off, or asked by a client that authenticated with a
//! TLS certificate (which a call over `shm://` would not carry) answers UNIMPLEMENTED, as any
//! plain gRPC server does.
//!
//! **The move.** A channel's first call goes over HTTP/2 and starts a probe beside it: it asks
//! for the offer on the HTTP/2 connection itself. (A unary request larger than HTTP/2 servers
//! take by default waits for the probe instead: `Channel::settle_upgrade`.) The offer is taken
//! only if three things the kernel, not the peer, vouches for agree:
//! - the process at the other end of the channel's own HTTP/2 connection is the offered pid
//!   (`SO_PEERCRED` for a unix socket; for TCP, the server's end of the connection found in
//!   `/proc/net/tcp*` and among the offered process's open files), so a remote server, a proxy
//!   or a man in the middle cannot send the channel to some other local server;
//! - the boot id is this machine's;
//! - the process behind the offered socket is the offered pid (`SO_PEERCRED`), so a squatter on
//!   the path is refused.
//!
//! Another host, another pid namespace (a container), another uid (whose `/proc` entries and
//! socket directory the client cannot read) fail a check, and the channel stays on HTTP/2. Once connected, calls go over `shm://`; if that connection dies (the server
//! restarted, say), calls go back to HTTP/2 at once and the probe runs again 5 s later (60 s
//! after a server that offered nothing; after probes that failed, 5 s doubled for each failure
//! in a row, up to 120 s). Calls in flight are never moved.
//!
//! It is on by default; `ChannelBuilder::upgrade(false)` turns it off for a channel, the
//! environment variable `ISTHMUS_UPGRADE=0` for every channel of a process that does not say.
//!
//! [`Channel::transport_counts`](crate::Channel::transport_counts) counts the calls each way
//! carried; [`Channel::upgrade_status`](crate::Channel::upgrade_status) says where the channel
//! stands.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use isthmus_shm::Config;

use crate::call::CallOptions;
use crate::client::Channel;
use crate::status::{Code, Status};

/// The method that asks a server for its `shm://` endpoint.
pub const OFFER_PATH: &str = "/isthmus.v1.Upgrade/Offer";
const TARGET_KEY: &str = "isthmus-shm-target";
const PID_KEY: &str = "isthmus-shm-pid";
const BOOT_KEY: &str = "isthmus-boot-id";
/// The longest target an offer may name (a unix socket path is at most 108 bytes).
const MAX_TARGET: usize = 200;
/// How long after a failed probe, or after the shm connection was lost, the next probe runs;
/// doubled for each probe in a row that fails (an offer this client can never connect to: a
/// mount namespace of its own, say), up to `REPROBE_MAX`, as gRPC's reconnect backoff grows.
const REPROBE: Duration = Duration::from_secs(5);
/// The longest wait between two failed probes (gRPC's reconnect backoff stops at 120 s too).
const REPROBE_MAX: Duration = Duration::from_secs(120);
/// The same, after a server that offers nothing (a plain gRPC server, say).
const NOT_OFFERED: Duration = Duration::from_secs(60);
/// How long a probe's offer call may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether channels move to shared memory unless told otherwise: yes, unless the environment
/// variable `ISTHMUS_UPGRADE` is `0`, `off` or `false` (for a process whose code says nothing
/// per channel, and for tests of the HTTP/2 path itself).
pub(crate) fn on_by_default() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let value = std::env::var("ISTHMUS_UPGRADE").unwrap_or_default();
        !matches!(value.to_ascii_lowercase().as_str(), "0" | "off" | "false")
    })
}

/// This boot of this machine's kernel, which an offer must name to be taken.
fn boot_id() -> Option<&'static str> {
    static BOOT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let id = id.trim();
        (!id.is_empty()).then(|| id.to_owned())
    })
    .as_deref()
}

/// The `shm://` endpoint a server offers to its HTTP/2 clients, shared by the binds of one
/// server (the Python binding binds each port on its own). The first public `shm://` endpoint
/// bound is offered.
#[derive(Debug, Clone, Default)]
pub struct ShmOffer(Arc<Mutex<Option<String>>>);

impl ShmOffer {
    /// An offer with nothing to offer yet.
    pub fn new() -> ShmOffer {
        ShmOffer::default()
    }

    /// Offers `target` (`shm:///abs/path.sock`) unless something is offered already.
    pub(crate) fn offer(&self, target: String) {
        if let Ok(mut offered) = self.0.lock() {
            offered.get_or_insert(target);
        }
    }

    pub(crate) fn offered(&self) -> Option<String> {
        self.0.lock().ok().and_then(|o| o.clone())
    }
}

/// Answers [`OFFER_PATH`] on a server's HTTP/2 endpoints (see the module's documentation).
#[derive(Debug, Clone)]
pub(crate) struct OfferService(pub(crate) ShmOffer);

impl tonic::server::NamedService for OfferService {
    const NAME: &'static str = "isthmus.v1.Upgrade";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for OfferService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        // A client that showed a certificate is known by it; over shm:// it would not be.
        let authenticated =
            request.extensions().get::<crate::http::endpoint::PeerInfo>().is_some_and(|peer| peer.cert.is_some());
        let offered = if authenticated { None } else { self.0.offered() };
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(crate::http::BytesCodec);
            Ok(grpc.unary(Offer(offered), request).await)
        })
    }
}

struct Offer(Option<String>);

impl tonic::server::UnaryService<Bytes> for Offer {
    type Response = Bytes;
    type Future = std::future::Ready<Result<tonic::Response<Bytes>, tonic::Status>>;

    fn call(&mut self, _request: tonic::Request<Bytes>) -> Self::Future {
        let answer = || -> Option<tonic::Response<Bytes>> {
            let mut response = tonic::Response::new(Bytes::new());
            let metadata = response.metadata_mut();
            metadata.insert(TARGET_KEY, self.0.as_deref()?.parse().ok()?);
            metadata.insert(PID_KEY, std::process::id().to_string().parse().ok()?);
            metadata.insert(BOOT_KEY, boot_id()?.parse().ok()?);
            Some(response)
        };
        std::future::ready(
            answer().ok_or_else(|| tonic::Status::unimplemented("this server offers no shm:// endpoint")),
        )
    }
}

/// The `shm://` endpoint an HTTP/2 channel moved to, and the server process behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradedTo {
    /// `shm:///abs/path.sock`.
    pub target: String,
    /// The server's process id, which every connection to `target` is checked against.
    pub pid: u32,
}

/// Where an HTTP/2 channel stands with respect to shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpgradeStatus {
    /// Not an HTTP/2 channel, or the upgrade is turned off for it.
    Off,
    /// No probe has finished yet: calls go over HTTP/2.
    Pending,
    /// Calls go over `shm://`.
    Shm(UpgradedTo),
    /// The last probe found nothing to move to (or lost it): calls go over HTTP/2, and the
    /// probe runs again later.
    Http2,
}

/// Calls a channel started over each transport.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportCounts {
    /// Over shared memory.
    pub shm: u64,
    /// Over HTTP/2.
    pub http2: u64,
}

enum State {
    /// Calls go over HTTP/2; a probe runs with the first call after `next_probe`. `lost`: the
    /// `shm://` connection it had moved to went (a server restarted, say), so a call that
    /// HTTP/2 would likely refuse probes at once (`settle`).
    Idle { next_probe: Instant, probed: bool, lost: bool },
    /// A probe runs, started at `since`.
    Probing { probed: bool, since: Instant },
    /// Calls go over `channel`, to which the channel moved at `since`.
    Shm { channel: Channel, to: UpgradedTo, since: Instant },
    /// The channel was closed: calls stay on HTTP/2 and no probe runs again.
    Closed,
}

/// An HTTP/2 channel's upgrade state, shared by its clones.
pub(crate) struct Upgrade {
    state: Mutex<State>,
    /// The fork count `state` belongs to: a child forked since starts over (ADR 0030), since
    /// a probe running at the fork ran on the parent's runtime and never ends in the child, and
    /// the `shm://` connection it moved to is the parent's.
    forks: AtomicU64,
    config: Config,
    /// The channel's user agent, which its `shm://` calls name too.
    agent: Option<Arc<str>>,
    /// Who is at the other end of the channel's HTTP/2 connection (its connector records it).
    http_peer: HttpPeer,
    shm: AtomicU64,
    http2: AtomicU64,
    /// Told when a probe ends (`ProbeGuard`), for calls that wait for it (`settle`).
    probe_ended: tokio::sync::Notify,
    /// Probes in a row that failed to reach an offer (`failed_probe`); none since the last
    /// that moved the channel.
    failed_probes: AtomicU32,
}

impl Upgrade {
    pub(crate) fn new(config: Config, http_peer: HttpPeer, agent: Option<Arc<str>>) -> Upgrade {
        Upgrade {
            state: Mutex::new(State::Idle { next_probe: Instant::now(), probed: false, lost: false }),
            forks: AtomicU64::new(isthmus_shm::forks()),
            config,
            agent,
            http_peer,
            shm: AtomicU64::new(0),
            http2: AtomicU64::new(0),
            probe_ended: tokio::sync::Notify::new(),
            failed_probes: AtomicU32::new(0),
        }
    }

    /// The `shm://` connection the channel moved to is gone (the server went away, or
    /// restarted): HTTP/2 until a probe finds it again, or at once for a call that HTTP/2 would
    /// likely refuse (`lost`).
    fn lost_shm(&self, state: &mut State) {
        let held = match state {
            State::Shm { since, .. } => since.elapsed(),
            _ => Duration::MAX,
        };
        *state = State::Idle { next_probe: after(self.wait_after_loss(held)), probed: true, lost: true };
    }

    /// How long after losing an `shm://` connection that had `held` that long the next probe
    /// runs: `REPROBE` after one that held (`HELD`), the failed probes' growing wait after one
    /// that died young. A server whose `shm://` side broke each connection soon after the move
    /// (its calls failing with it) was probed again every 5 s for ever, where HTTP/2 would
    /// have served every call.
    fn wait_after_loss(&self, held: Duration) -> Duration {
        if held >= HELD {
            self.failed_probes.store(0, Ordering::Relaxed);
            return REPROBE;
        }
        self.failed_probe()
    }

    /// How long to wait before the next probe after one more that failed: `REPROBE`, doubled
    /// for each failure in a row before it, at most `REPROBE_MAX`.
    fn failed_probe(&self) -> Duration {
        let before = self.failed_probes.fetch_add(1, Ordering::Relaxed).min(16);
        REPROBE.saturating_mul(1 << before).min(REPROBE_MAX)
    }

    /// The `shm://` channel to carry the next call, if the channel has moved and its
    /// connection is up; otherwise starts a probe over `http` if one is due (inside a tokio
    /// runtime) and returns `None`.
    pub(crate) fn route(self: &Arc<Self>, http: &Channel) -> Option<(Channel, UpgradedTo)> {
        let mut state = self.state()?;
        match &*state {
            State::Shm { channel, to, .. } => {
                if channel.shm_connected() {
                    return Some((channel.clone(), to.clone()));
                }
                self.lost_shm(&mut state);
                None
            }
            State::Idle { .. } => {
                self.probe_if_due(&mut state, http, false);
                None
            }
            _ => None,
        }
    }

    /// Starts a probe over `http` if one is due (inside a tokio runtime), or, for an `urgent`
    /// call, if the channel lost its `shm://` connection; whether one runs now.
    fn probe_if_due(self: &Arc<Self>, state: &mut State, http: &Channel, urgent: bool) -> bool {
        if matches!(&*state, State::Shm { channel, .. } if urgent && !channel.shm_connected()) {
            self.lost_shm(state);
        }
        self.end_stale_probe(state);
        match *state {
            State::Probing { .. } => true,
            State::Idle { next_probe, probed, lost } if (urgent && lost) || Instant::now() >= next_probe => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else { return false };
                *state = State::Probing { probed, since: Instant::now() };
                runtime.spawn(probe(self.clone(), http.clone()));
                true
            }
            _ => false,
        }
    }

    /// Ends a probe whose task never ran: dropped unpolled with its runtime, where its guard,
    /// made in the task, never was, it stayed under way for ever (no probe again, and a call
    /// that waited for its end with no deadline waited for ever). Each probe ends within
    /// `PROBE_LIMIT`: one past it twice over is taken to have failed.
    fn end_stale_probe(&self, state: &mut State) {
        if let State::Probing { probed, since } = *state {
            if since.elapsed() > 2 * PROBE_LIMIT {
                *state = State::Idle { next_probe: after(self.failed_probe()), probed, lost: false };
            }
        }
    }

    /// Waits for the probe under way, or due now (which it starts; also where the `shm://`
    /// connection was lost), to end, until `until` at the latest; at once if none is. For a
    /// call that HTTP/2 would likely refuse and the move would carry (`Channel::settle_upgrade`).
    pub(crate) async fn settle(self: &Arc<Self>, http: &Channel, until: Option<tokio::time::Instant>) {
        let ended = self.probe_ended.notified();
        tokio::pin!(ended);
        {
            let Some(mut state) = self.state() else { return };
            if !self.probe_if_due(&mut state, http, true) {
                return;
            }
            // Before the lock goes: the probe's end, under the same lock, cannot come unseen.
            ended.as_mut().enable();
        }
        // Bounded all the same: a probe ends within `PROBE_LIMIT`, or is taken to have failed.
        let limit = tokio::time::Instant::now() + 2 * PROBE_LIMIT;
        let until = until.map_or(limit, |until| until.min(limit));
        drop(tokio::time::timeout_at(until, ended).await);
    }

    /// The state, as this process's: in a child forked since, a new start (closed stays closed).
    fn state(&self) -> Option<std::sync::MutexGuard<'_, State>> {
        let mut state = self.state.lock().ok()?;
        let forks = isthmus_shm::forks();
        if self.forks.load(Ordering::Relaxed) != forks {
            self.forks.store(forks, Ordering::Relaxed);
            if !matches!(*state, State::Closed) {
                // Not dropped: the parent's `shm://` channel is the parent's to close.
                std::mem::forget(std::mem::replace(
                    &mut *state,
                    State::Idle { next_probe: Instant::now(), probed: false, lost: false },
                ));
            }
            // The counts are of this process's calls.
            self.shm.store(0, Ordering::Relaxed);
            self.http2.store(0, Ordering::Relaxed);
        }
        Some(state)
    }

    /// The channel was closed: the `shm://` channel it moved to closes too, and it moves no more.
    pub(crate) fn close(&self, status: Status) {
        if let Some(mut state) = self.state() {
            if let State::Shm { channel, .. } = std::mem::replace(&mut *state, State::Closed) {
                channel.close(status);
            }
        }
    }

    /// A call over the upgraded channel could not start (its connection is gone): it goes over
    /// HTTP/2 instead (and is counted there), so do the next calls, and a probe runs again later.
    pub(crate) fn lost(&self, to: &UpgradedTo) {
        let state = self.state();
        let _ = self.shm.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        self.http2.fetch_add(1, Ordering::Relaxed);
        if let Some(mut state) = state {
            if matches!(&*state, State::Shm { to: current, .. } if current == to) {
                self.lost_shm(&mut state);
            }
        }
    }

    /// The `shm://` channel this one moved to, if it has (for its counters).
    pub(crate) fn moved_to(&self) -> Option<Channel> {
        match self.state().as_deref() {
            Some(State::Shm { channel, .. }) => Some(channel.clone()),
            _ => None,
        }
    }

    pub(crate) fn count(&self, shm: bool) {
        let counter = if shm { &self.shm } else { &self.http2 };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn counts(&self) -> TransportCounts {
        drop(self.state()); // a child forked since counts its own calls
        TransportCounts { shm: self.shm.load(Ordering::Relaxed), http2: self.http2.load(Ordering::Relaxed) }
    }

    pub(crate) fn status(&self) -> UpgradeStatus {
        match self.state().as_deref() {
            Some(State::Shm { to, .. }) => UpgradeStatus::Shm(to.clone()),
            Some(State::Idle { probed: true, .. } | State::Probing { probed: true, .. } | State::Closed) => {
                UpgradeStatus::Http2
            }
            _ => UpgradeStatus::Pending,
        }
    }
}

impl Drop for Upgrade {
    fn drop(&mut self) {
        // In a child forked since, an `shm://` channel it moved to is the parent's (`state`).
        if self.forks.load(Ordering::Relaxed) != isthmus_shm::forks() {
            let state = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            std::mem::forget(std::mem::replace(state, State::Closed));
        }
    }
}

/// How long an `shm://` connection must have held for its loss to count as a server going
/// away, not as a move that failed.
const HELD: Duration = Duration::from_secs(30);

/// When the next probe runs: `wait` from now, give or take a fifth, as gRPC's backoff jitters,
/// so that the clients of a server that restarted do not all probe it at the same moment.
fn after(wait: Duration) -> Instant {
    use std::hash::BuildHasher;
    // std's RandomState is seeded per thread and varied per instance: enough to spread clients.
    let draw = std::collections::hash_map::RandomState::new().hash_one(0u8) % 1000;
    Instant::now() + wait.mul_f64(0.8 + 0.4 * draw as f64 / 1000.0)
}

/// How long a whole probe (offer, checks, connect) may take.
const PROBE_LIMIT: Duration = Duration::from_secs(15);

/// Puts a probe that ended without a verdict (its task was dropped with its runtime, or it ran
/// past `PROBE_LIMIT`) back to idle, so that a later call probes again.
struct ProbeGuard(Arc<Upgrade>);

impl Drop for ProbeGuard {
    fn drop(&mut self) {
        if let Ok(mut state) = self.0.state.lock() {
            if let State::Probing { .. } = *state {
                let wait = self.0.failed_probe();
                *state = State::Idle { next_probe: after(wait), probed: true, lost: false };
            }
        }
        self.0.probe_ended.notify_waiters();
    }
}

/// Runs a probe within `PROBE_LIMIT`.
async fn probe(up: Arc<Upgrade>, http: Channel) {
    let _guard = ProbeGuard(up.clone());
    let _ = tokio::time::timeout(PROBE_LIMIT, probe_once(up, http)).await;
}

/// Asks for the offer over `http`, connects to it and checks it; the channel moves on success.
async fn probe_once(up: Arc<Upgrade>, http: Channel) {
    let offered = match offer(&http).await {
        // The offer must come from the process at the other end of this very connection. The
        // look reads `/proc` (every TCP socket of the machine's table, every descriptor of the
        // server): off the runtime's workers, as the handshake is.
        Ok(Some(to)) => {
            let (peer, pid) = (up.clone(), to.pid);
            match tokio::task::spawn_blocking(move || peer.http_peer.is_process(pid)).await {
                Ok(true) => Ok(Some(to)),
                _ => {
                    tracing::debug!("the offer names process {pid}, which is not the HTTP/2 peer");
                    Ok(None)
                }
            }
        }
        other => other,
    };
    let wait = match offered {
        Ok(Some(to)) => match connect(&to, up.config.clone(), up.agent.as_deref()).await {
            Ok(channel) => {
                // The failed probes before it count on until the connection has held
                // (`wait_after_loss`).
                if let Ok(mut state) = up.state.lock() {
                    match *state {
                        // Closed while the probe ran: the connection it made goes too.
                        State::Closed => channel.close(Status::new(Code::Cancelled, "the channel was closed")),
                        _ => *state = State::Shm { channel, to, since: Instant::now() },
                    }
                }
                return;
            }
            Err(status) => {
                tracing::debug!("the offered {} is not reachable: {status:?}", to.target);
                up.failed_probe()
            }
        },
        Ok(None) => NOT_OFFERED,
        Err(status) => {
            tracing::debug!("asking for an shm:// offer failed: {status:?}");
            up.failed_probe()
        }
    };
    if let Ok(mut state) = up.state.lock() {
        if !matches!(*state, State::Closed) {
            *state = State::Idle { next_probe: after(wait), probed: true, lost: false };
        }
    }
}

/// The server's offer, if it makes one this machine can take: `Ok(None)` if it offers nothing
/// (UNIMPLEMENTED: a plain gRPC server, or the offer turned off) or another machine's.
async fn offer(http: &Channel) -> Result<Option<UpgradedTo>, Status> {
    let options = CallOptions { timeout: Some(PROBE_TIMEOUT), ..CallOptions::default() };
    let mut call = http.start_http(OFFER_PATH, options)?;
    let answered = async {
        call.send_last(&[]).await?;
        let headers = call.headers().await?;
        while call.recv().await?.is_some() {}
        Ok::<_, Status>(headers)
    };
    let headers = match answered.await {
        Ok(headers) => headers,
        // The connection failed or was slow: ask again later.
        Err(status) if matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded) => return Err(status),
        // UNIMPLEMENTED from a plain gRPC server, UNAUTHENTICATED from a proxy…: no offer.
        Err(_) => return Ok(None),
    };
    let (Some(target), Some(pid), Some(boot)) = (headers.get(TARGET_KEY), headers.get(PID_KEY), headers.get(BOOT_KEY))
    else {
        return Ok(None);
    };
    if Some(boot) != boot_id() {
        return Ok(None); // another machine (or another boot of this one)
    }
    let pid = pid.parse::<u32>().map_err(|_| Status::new(Code::Internal, format!("offered pid {pid:?}")))?;
    if target.len() > MAX_TARGET || !target.starts_with("shm:///") {
        return Err(Status::new(Code::Internal, format!("offered target {target:?} is not shm:///PATH")));
    }
    // pid 0 is what SO_PEERCRED reports for a process in a pid namespace the client cannot see.
    if pid == 0 {
        return Ok(None);
    }
    Ok(Some(UpgradedTo { target: target.to_owned(), pid }))
}

/// A connected `shm://` channel to `to`, whose server is checked to be process `to.pid`.
async fn connect(to: &UpgradedTo, config: Config, agent: Option<&str>) -> Result<Channel, Status> {
    let channel = Channel::expecting(to, config, agent)?;
    channel.connect_shm().await?;
    Ok(channel)
}

/// The ends of a channel's latest HTTP/2 connection, as its connector opened it: what the
/// probe checks an offer's pid against.
#[derive(Debug, Clone, Default)]
pub(crate) struct HttpPeer(Arc<Mutex<Option<Ends>>>);

#[derive(Debug, Clone, Copy)]
pub(crate) enum Ends {
    /// A unix socket, and the pid `SO_PEERCRED` gave (none from another pid namespace).
    Unix(Option<u32>),
    /// TCP: this side's address and the server's.
    Tcp { local: std::net::SocketAddr, peer: std::net::SocketAddr },
}

impl HttpPeer {
    pub(crate) fn record(&self, ends: Ends) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(ends);
        }
    }

    /// Whether process `pid` holds the server's end of the latest connection.
    fn is_process(&self, pid: u32) -> bool {
        match self.0.lock().ok().and_then(|e| *e) {
            Some(Ends::Unix(peer)) => peer == Some(pid),
            Some(Ends::Tcp { local, peer }) => tcp_inode(peer, local).is_some_and(|inode| holds_socket(pid, inode)),
            None => false,
        }
    }
}

/// The inode of the TCP socket whose local address is `local` and whose remote is `remote`, as
/// this network namespace's `/proc/net/tcp` and `tcp6` list them (the server's end of a
/// loopback connection is listed there; a remote server's is not).
fn tcp_inode(local: std::net::SocketAddr, remote: std::net::SocketAddr) -> Option<u64> {
    let (local, remote) = (canonical(local), canonical(remote));
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(l), Some(r), Some(inode)) = (fields.get(1), fields.get(2), fields.get(9)) else { continue };
            if proc_addr(l).map(canonical) == Some(local) && proc_addr(r).map(canonical) == Some(remote) {
                return inode.parse().ok().filter(|&i| i != 0);
            }
        }
    }
    None
}

/// An address as `/proc/net/tcp*` prints it: hex words of the address in the kernel's byte
/// order (`%08X` of each 32-bit word), a colon, the port in hex.
fn proc_addr(text: &str) -> Option<std::net::SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    if ip.len() != 8 && ip.len() != 32 {
        return None;
    }
    let mut bytes = Vec::with_capacity(16);
    for word in ip.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(word).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// A v4-mapped v6 address as the v4 one, so both ends compare alike.
fn canonical(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    match addr {
        std::net::SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => std::net::SocketAddr::new(v4.into(), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

/// Whether process `pid` has socket `inode` open (readable for our own uid's processes only).
fn holds_socket(pid: u32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.filter_map(Result::ok)
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|link| link.as_os_str() == want.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_probes_back_off_and_a_move_starts_afresh() {
        let up = Upgrade::new(Config::default(), HttpPeer::default(), None);
        let waits: Vec<u64> = (0..40).map(|_| up.failed_probe().as_secs()).collect();
        assert_eq!(waits[..7], [5, 10, 20, 40, 80, 120, 120]);
        assert!(waits.iter().all(|&w| w <= 120), "never past REPROBE_MAX, nor wrapped: {waits:?}");
        // A connection that held: the next loss waits the least, and the count starts afresh.
        assert_eq!(up.wait_after_loss(HELD), REPROBE);
        assert_eq!(up.failed_probe(), REPROBE);
    }

    #[test]
    fn a_move_lost_young_backs_off_as_a_failed_probe_and_one_that_held_does_not() {
        let up = Upgrade::new(Config::default(), HttpPeer::default(), None);
        let young: Vec<u64> = (0..4).map(|_| up.wait_after_loss(Duration::from_secs(1)).as_secs()).collect();
        assert_eq!(young, [5, 10, 20, 40], "each move that broke at once waits longer");
        assert_eq!(up.wait_after_loss(Duration::from_secs(3600)), REPROBE);
        assert_eq!(up.wait_after_loss(Duration::from_secs(1)), REPROBE, "counted afresh after one that held");
    }

    #[test]
    fn a_probe_under_way_past_twice_its_limit_is_taken_to_have_failed() {
        let up = Upgrade::new(Config::default(), HttpPeer::default(), None);
        let started = |ago: Duration| State::Probing { probed: true, since: Instant::now() - ago };
        let mut state = started(PROBE_LIMIT);
        up.end_stale_probe(&mut state);
        assert!(matches!(state, State::Probing { .. }), "a probe within its time runs on");
        let mut state = started(2 * PROBE_LIMIT + Duration::from_secs(1));
        up.end_stale_probe(&mut state);
        match state {
            State::Idle { next_probe, probed: true, lost: false } => {
                assert!(next_probe > Instant::now(), "the next probe after a failed one's wait");
            }
            _ => panic!("a stale probe stays under way"),
        }
    }

    #[test]
    fn proc_addresses_read_in_the_kernels_order() {
        let v4 = u32::from_ne_bytes([127, 0, 0, 1]);
        assert_eq!(proc_addr(&format!("{v4:08X}:1F90")), Some("127.0.0.1:8080".parse().expect("addr")));
        let mut v6 = String::new();
        for word in std::net::Ipv6Addr::LOCALHOST.octets().chunks(4) {
            v6 += &format!("{:08X}", u32::from_ne_bytes(<[u8; 4]>::try_from(word).expect("4")));
        }
        assert_eq!(proc_addr(&format!("{v6}:0050")), Some("[::1]:80".parse().expect("addr")));
        assert_eq!(canonical("[::ffff:127.0.0.1]:5".parse().expect("addr")), "127.0.0.1:5".parse().expect("addr"));
        for bad in ["", "zz:1", "0100007F", "0100007F:xyz", "01007F:1"] {
            assert_eq!(proc_addr(bad), None, "{bad}");
        }
    }

    #[test]
    fn this_process_holds_the_server_end_of_its_own_loopback_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let _server = listener.accept().expect("accept");
        let peer = HttpPeer::default();
        peer.record(Ends::Tcp { local: client.local_addr().expect("local"), peer: client.peer_addr().expect("peer") });
        assert!(peer.is_process(std::process::id()));
        assert!(!peer.is_process(1), "pid 1 does not hold this test's socket");
    }
}
