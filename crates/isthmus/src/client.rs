//! The client's front: a [`Channel`] to one server, and the [`ClientCall`]s made on it. The
//! target picks the way: the engine over shared memory (`shm://`, [`crate::engine`]) or
//! standard gRPC over HTTP/2 (`unix://`, `http://`, [`crate::http`]); the API is the same.
//!
//! `connect(target)` and `connect_with(target, config)` connect at once; `lazy(target)` and
//! `lazy_with` only parse the target and check the configuration, and connect on the first call. A
//! target that does not parse is INVALID_ARGUMENT; an eager connect that fails is UNAVAILABLE.
//!
//! A `ClientCall` is one type over both ways: an engine call (`engine::client`) or an HTTP/2 call
//! by path (`http::call`), with the same methods. [`CallSender`] (`ClientCall::sender`) sends a
//! call's requests from another thread or task while the owner reads responses, which
//! grpcio-style streaming needs. `alloc` and `send_block` build a message in shared memory and are
//! `shm://`-only: over HTTP/2 a call's `alloc` and `send_block` return UNIMPLEMENTED.
//!
//! A `Channel` is also a tower `Service` over `http::Request`s, which makes it the transport of any
//! tonic-generated client; that impl lives in `http::tonic_client`. Each call holds the channel's
//! shared state, so the connection stays open while any call lives, even after every handle on the
//! channel is gone (a tonic client dropped while its response stream is still read).
//!
//! [`blocking::Channel`](crate::blocking::Channel) is the same client for plain threads with no
//! runtime, over `shm://` only; an async `Channel` and a blocking one never share a connection.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use isthmus_shm::{BlockMut, Config};

use crate::call::{CallOptions, Response};
use crate::connectivity::{Connectivity, Tracker};
use crate::engine::client::{SendHalf, ShmCall, ShmChannel};
use crate::engine::mux::ConnectionCounters;
use crate::http::call::{HttpCall, Requests};
use crate::http::endpoint::{connector, http_endpoint, Target};
use crate::http::tls::ClientTlsConfig;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};
use crate::upgrade::{HttpPeer, TransportCounts, Upgrade, UpgradeStatus, UpgradedTo};

/// A connection to one server. Cheap to clone; clones share the connection. If the
/// connection dies (the server restarted, say), the next call connects again.
///
/// ```no_run
/// # async fn demo() -> Result<(), isthmus::Status> {
/// let channel = isthmus::Channel::connect("shm://sidecar").await?;
/// let reply = channel.unary("/demo.Echo/Say", b"hello", Default::default()).await?;
/// assert_eq!(&reply.message[..], b"hello");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Channel {
    via: Arc<Via>,
    /// Whether this handle's waiting calls read the connection themselves
    /// ([`with_calls_read`](Self::with_calls_read)).
    calls_read: bool,
    /// Whether calls on this handle may move to shared memory (false for the handles that
    /// carry a call already routed to HTTP/2, and for the upgrade's probe).
    routes: bool,
}

/// What a channel runs over.
enum Via {
    /// isthmus shared memory.
    Shm(ShmChannel),
    /// Standard gRPC over HTTP/2 (tonic's channel), to any other target; with the state of
    /// its move to shared memory unless that is turned off (`upgrade.rs`).
    /// `max_message`: the largest response message accepted (the builder's `Config`).
    /// `connectivity`: what the connector under tonic's channel saw of its connections.
    /// `closed`: the status `close` gave, which every call by path in progress ends with.
    Http {
        channel: HttpChannel,
        target: String,
        upgrade: Option<Arc<Upgrade>>,
        max_message: usize,
        connectivity: Arc<Tracker>,
        closed: tokio::sync::watch::Sender<Option<Status>>,
    },
}

/// tonic's channel under an HTTP/2 target. Its connection is a task on the runtime it was made
/// on, so in a child forked since (whose runtime is its own, ADR 0030) nothing would ever carry
/// a call on it: the child makes a channel of its own on first use, connecting anew, and leaves
/// the parent's untouched. Not even dropped: the last handle's drop wakes the channel's worker,
/// which would ring the parent's runtime through the descriptor both processes hold. The
/// parent's own calls look at one fork count and take no lock.
struct HttpChannel {
    /// The channel made with this one (`None` only while it is dropped).
    made: Option<tonic::transport::Channel>,
    made_in: isthmus_shm::MadeIn,
    /// Makes the channel again, connecting on its first call.
    remake: Box<dyn Fn() -> tonic::transport::Channel + Send + Sync>,
    /// A forked child's own channel, with the fork count it was made under.
    child: std::sync::Mutex<Option<(u64, tonic::transport::Channel)>>,
    /// The fork count whose process last took over the connectivity state (`settle`).
    settled: std::sync::atomic::AtomicU64,
    connectivity: Arc<Tracker>,
}

impl HttpChannel {
    /// The channel this process's calls go on.
    fn get(&self) -> tonic::transport::Channel {
        if let (false, Some(made)) = (self.made_in.forked(), &self.made) {
            return made.clone();
        }
        let forks = self.settle();
        if let Some(channel) = self.child_channel(forks) {
            return channel;
        }
        // Made outside the lock (it may start the binding runtime's threads). tonic starts the
        // channel's worker with `tokio::spawn`: on the binding runtime, made anew in the child,
        // unless the caller runs in a runtime of its own.
        let made = {
            let _in_runtime = tokio::runtime::Handle::try_current().is_err().then(|| crate::binding::runtime().enter());
            (self.remake)()
        };
        let mut child = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*child {
            // Another thread of this process made one meanwhile; ours is this process's to drop.
            Some((made_in, channel)) if *made_in == forks => channel.clone(),
            _ => {
                if let Some((_, grandparents)) = child.replace((forks, made.clone())) {
                    std::mem::forget(grandparents);
                }
                made
            }
        }
    }

    fn child_channel(&self, forks: u64) -> Option<tonic::transport::Channel> {
        let child = self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        child.as_ref().filter(|(made_in, _)| *made_in == forks).map(|(_, channel)| channel.clone())
    }

    /// The fork count now; in a child that has not looked since it was forked, the channel's
    /// connectivity starts over first (IDLE: the parent's connections are not this one's).
    fn settle(&self) -> u64 {
        use std::sync::atomic::Ordering;
        let forks = isthmus_shm::forks();
        if self.made_in.forked() && self.settled.swap(forks, Ordering::AcqRel) != forks {
            self.connectivity.forked();
        }
        forks
    }
}

impl Drop for HttpChannel {
    fn drop(&mut self) {
        let forks = isthmus_shm::forks();
        if self.made_in.forked() {
            std::mem::forget(self.made.take());
        }
        let child = self.child.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        if child.as_ref().is_some_and(|(made_in, _)| *made_in != forks) {
            std::mem::forget(child.take());
        }
    }
}

impl Via {
    /// The shared-memory way (`shm://` channels only).
    fn shm(&self) -> Result<&ShmChannel, Status> {
        match self {
            Via::Shm(shm) => Ok(shm),
            Via::Http { target, .. } => {
                Err(Status::new(Code::Unimplemented, format!("{target}: this needs an shm:// channel")))
            }
        }
    }
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let target = match &*self.via {
            Via::Shm(shm) => shm.target(),
            Via::Http { target, .. } => target.clone(),
        };
        f.debug_struct("Channel").field("target", &target).finish_non_exhaustive()
    }
}

/// Settings for a [`Channel`] before it connects: [`Channel::builder`].
#[derive(Debug, Clone)]
pub struct ChannelBuilder {
    target: String,
    config: Config,
    tls: Option<ClientTlsConfig>,
    upgrade: bool,
    keepalive: Option<Keepalive>,
    user_agent: Option<String>,
    authority: Option<String>,
    connect_timeout: Duration,
}

/// HTTP/2 keepalive for a channel's connection ([`ChannelBuilder::keepalive`]): gRPC's
/// `keepalive_time`, `keepalive_timeout` and `keepalive_permit_without_calls` (grpcio's
/// `grpc.keepalive_*_ms` options, grpc-go's `keepalive.ClientParameters`).
///
/// Over a network a peer can vanish without a word (a host that loses power, a NAT or firewall
/// that drops the flow): nothing then arrives, and a call without a deadline waits for ever. With
/// keepalive, a connection that has been quiet for `time` gets a PING; if its answer does not
/// come within `timeout`, the connection is closed, and its calls end UNAVAILABLE. `shm://` has
/// no use for it: a peer that dies there is seen at once, through the socket beside the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// How long the connection may be quiet before a PING goes out.
    pub time: Duration,
    /// How long the PING's answer may take.
    pub timeout: Duration,
    /// Whether PINGs go out while no call is open too (gRPC's default: no).
    pub permit_without_calls: bool,
}

impl Keepalive {
    /// A PING after `time` of quiet, answered within 20 s (gRPC's default timeout), only while a
    /// call is open.
    pub fn new(time: Duration) -> Keepalive {
        Keepalive { time, timeout: Duration::from_secs(20), permit_without_calls: false }
    }
}

impl ChannelBuilder {
    /// Whether calls to an HTTP/2 address move to shared memory when the server is an isthmus
    /// server on this machine that offers it (default: yes, unless the environment variable
    /// `ISTHMUS_UPGRADE` is `0`, `off` or `false`; see [`crate::upgrade`]).
    pub fn upgrade(mut self, on: bool) -> ChannelBuilder {
        self.upgrade = on;
        self
    }

    /// HTTP/2 keepalive (see [`Keepalive`]); none by default, as in gRPC. Applies to HTTP/2
    /// targets; an `shm://` channel, and the `shm://` connection an HTTP/2 one moves to, do not
    /// need it.
    pub fn keepalive(mut self, keepalive: Keepalive) -> ChannelBuilder {
        self.keepalive = Some(keepalive);
        self
    }

    /// The user agent the channel's calls name, as gRPC's channels do (grpcio's
    /// `grpc.primary_user_agent`, grpc-go's `WithUserAgent`): a server's handlers see it as
    /// `user-agent` in their metadata, grpcio's, grpc-go's and isthmus's alike. Over HTTP/2
    /// tonic's own agent follows it (`"AGENT tonic/…"`), as grpc-go's follows a user's;
    /// over `shm://` it goes as it is. Printable ASCII, at most 1 KiB: INVALID_ARGUMENT on
    /// connect otherwise. None by default (an HTTP/2 call then names tonic's alone).
    pub fn user_agent(mut self, agent: impl Into<String>) -> ChannelBuilder {
        self.user_agent = Some(agent.into());
        self
    }

    /// The `:authority` the channel's calls send over HTTP/2 in place of the target's (grpcio's
    /// `grpc.default_authority`, grpc-go's `WithAuthority`), for a proxy or a server that routes
    /// by host. As in grpc-go and grpcio, TLS then checks the server's certificate against its
    /// host, unless the TLS settings name another ([`ClientTlsConfig::domain_name`]).
    /// `host[:port]`; INVALID_ARGUMENT on connect otherwise. `shm://` sends no `:authority`,
    /// and a call that moved there (the upgrade) goes without it.
    pub fn authority(mut self, authority: impl Into<String>) -> ChannelBuilder {
        self.authority = Some(authority.into());
        self
    }

    /// How long an HTTP/2 connection may take to come up: its connect, TLS handshake and the
    /// server's SETTINGS (gRPC's minimum connect timeout, grpc-go's
    /// `ConnectParams.MinConnectTimeout`; 20 s by default, as theirs). Past it the attempt fails
    /// and the calls waiting on it fail UNAVAILABLE (those with `wait_for_ready` wait for the
    /// next attempt), instead of waiting for their deadline, or for ever, on a host that drops
    /// packets or a server that never answers. Zero is the default, as in the C ABI, Go and
    /// Lua; `Duration::MAX` is no bound. An `shm://` connection is bounded by its
    /// configuration's `handshake_timeout` instead.
    pub fn connect_timeout(mut self, timeout: Duration) -> ChannelBuilder {
        self.connect_timeout = match timeout.is_zero() {
            true => crate::http::endpoint::DEFAULT_CONNECT_TIMEOUT,
            false => timeout,
        };
        self
    }

    /// The transport configuration for `shm://` (ring and arena sizes, the largest message
    /// accepted, spinning).
    pub fn config(mut self, config: Config) -> ChannelBuilder {
        self.config = config;
        self
    }

    /// TLS for a TCP target, in any of its forms (`host:port`, `dns:`, `ipv4:`, `https://`…);
    /// an `https://` target without it trusts the system's roots. INVALID_ARGUMENT on connect
    /// for a target that is not TCP.
    pub fn tls_config(mut self, tls: ClientTlsConfig) -> ChannelBuilder {
        self.tls = Some(tls);
        self
    }

    /// Connects now (see [`Channel::connect`]). Must run inside a tokio runtime.
    pub async fn connect(self) -> Result<Channel, Status> {
        match Target::parse(&self.target)? {
            Target::Shm(_) => {
                let channel = self.connect_lazy()?;
                channel.via.shm()?.mux(false, None).await?;
                Ok(channel)
            }
            other => {
                let (endpoint, connector, peer, connectivity) = self.http_parts(&other)?;
                let channel = endpoint.connect_with_connector(connector.clone()).await.map_err(|e| {
                    let why = crate::http::tls::describe(&e).unwrap_or_else(|| e.to_string());
                    Status::new(Code::Unavailable, format!("cannot connect to {}: {why}", self.target))
                })?;
                Ok(self.over_http(channel, endpoint, connector, peer, connectivity))
            }
        }
    }

    fn over_http(
        &self,
        channel: tonic::transport::Channel,
        endpoint: tonic::transport::Endpoint,
        connector: impl crate::http::endpoint::MakeIo + Sync,
        peer: HttpPeer,
        connectivity: Arc<Tracker>,
    ) -> Channel {
        let agent = self.user_agent.as_deref().map(Arc::from);
        let upgrade = self.upgrade.then(|| Arc::new(Upgrade::new(self.config.clone(), peer, agent)));
        let channel = HttpChannel {
            made: Some(channel),
            made_in: isthmus_shm::MadeIn::now(),
            remake: Box::new(move || endpoint.connect_with_connector_lazy(connector.clone())),
            child: std::sync::Mutex::new(None),
            settled: std::sync::atomic::AtomicU64::new(isthmus_shm::forks()),
            connectivity: connectivity.clone(),
        };
        Channel {
            via: Arc::new(Via::Http {
                channel,
                target: self.target.clone(),
                upgrade,
                max_message: usize::try_from(self.config.max_message_size).unwrap_or(usize::MAX),
                connectivity,
                closed: tokio::sync::watch::Sender::new(None),
            }),
            calls_read: true,
            routes: true,
        }
    }

    /// A channel that connects on its first call (see [`Channel::lazy`]).
    pub fn connect_lazy(self) -> Result<Channel, Status> {
        match Target::parse(&self.target)? {
            Target::Shm(_) if self.tls.is_some() => Err(Status::new(
                Code::InvalidArgument,
                format!("{}: TLS applies to TCP targets; shm:// is local and checked by uid", self.target),
            )),
            Target::Shm(_) => {
                // Refused as on any other target, though shm:// sends none.
                if let Some(authority) = &self.authority {
                    crate::http::endpoint::checked_authority(authority)?;
                }
                let shm = ShmChannel::new(&self.target, self.config)?;
                shm.set_agent(self.user_agent.as_deref())?;
                Ok(Channel { via: Arc::new(Via::Shm(shm)), calls_read: true, routes: true })
            }
            other => {
                let (endpoint, connector, peer, connectivity) = self.http_parts(&other)?;
                let channel = endpoint.connect_with_connector_lazy(connector.clone());
                Ok(self.over_http(channel, endpoint, connector, peer, connectivity))
            }
        }
    }

    /// tonic's endpoint and the connector under it, with TLS if this target takes it.
    fn http_parts(
        &self,
        target: &Target,
    ) -> Result<(tonic::transport::Endpoint, impl crate::http::endpoint::MakeIo, HttpPeer, Arc<Tracker>), Status> {
        let tls = match (target, &self.tls) {
            (Target::Tcp { tls: Some(false), .. }, Some(_)) => {
                return Err(Status::new(
                    Code::InvalidArgument,
                    format!("{} is plaintext: give https://HOST:PORT or HOST:PORT for TLS", self.target),
                ))
            }
            (Target::Tcp { .. }, Some(tls)) => Some(tls.clone()),
            (Target::Tcp { tls: Some(true), .. }, None) => Some(ClientTlsConfig::new()),
            (Target::Tcp { .. }, None) => None,
            (_, Some(_)) => {
                return Err(Status::new(
                    Code::InvalidArgument,
                    format!("{}: TLS applies to TCP targets only", self.target),
                ))
            }
            (_, None) => None,
        };
        let authority = self.authority.as_deref().map(crate::http::endpoint::checked_authority).transpose()?;
        let host = match &authority {
            Some(authority) => crate::http::endpoint::authority_host(authority).to_owned(),
            None => target.host(),
        };
        let tls = match tls {
            Some(tls) => Some((tls.rustls()?, tls.server_name(&host)?)),
            None => None,
        };
        let (peer, connectivity) = (HttpPeer::default(), Arc::<Tracker>::default());
        let mut endpoint = http_endpoint(target, tls.is_some(), authority.as_deref())?;
        if let Some(agent) = &self.user_agent {
            crate::call::check_user_agent(agent)?;
            endpoint = endpoint
                .user_agent(agent.as_str())
                .map_err(|e| Status::new(Code::InvalidArgument, format!("user agent {agent:?}: {e}")))?;
        }
        if let Some(k) = self.keepalive {
            endpoint = endpoint
                .http2_keep_alive_interval(k.time)
                .keep_alive_timeout(k.timeout)
                .keep_alive_while_idle(k.permit_without_calls);
        }
        Ok((
            endpoint,
            connector(target, tls, peer.clone(), connectivity.clone(), self.connect_timeout),
            peer,
            connectivity,
        ))
    }
}

impl Channel {
    /// Connects to `target` now. Must run inside a tokio runtime.
    ///
    /// - `shm://NAME` or `shm:///path.sock`: isthmus over shared memory (the handshake runs on a
    ///   blocking thread);
    /// - every other form gRPC names (`unix:path`, `unix:///abs`, `unix-abstract:name`,
    ///   `host:port`, `dns:///host:port`, `ipv4:a.b.c.d:port`, `ipv6:[addr]:port`) and
    ///   `http://host:port`: standard gRPC over HTTP/2 (tonic's transport), for servers
    ///   elsewhere or not isthmus: with a tonic client (`FooClient::new(channel)`) or by method
    ///   path ([`start`](Self::start), [`unary`](Self::unary)), as over `shm://`;
    /// - `https://host:port`: the same over TLS, trusting the system's roots; give other
    ///   settings with [`builder`](Self::builder).
    pub async fn connect(target: &str) -> Result<Channel, Status> {
        Channel::builder(target).connect().await
    }

    /// [`connect`](Self::connect) with a transport configuration (ring and arena sizes, the
    /// largest message accepted, spinning).
    pub async fn connect_with(target: &str, config: Config) -> Result<Channel, Status> {
        Channel::builder(target).config(config).connect().await
    }

    /// A channel to `target` with settings: transport configuration, TLS.
    ///
    /// ```no_run
    /// # async fn demo(ca_pem: &[u8]) -> Result<(), isthmus::Status> {
    /// let tls = isthmus::ClientTlsConfig::new().ca_certificate(isthmus::Certificate::from_pem(ca_pem)?);
    /// let channel = isthmus::Channel::builder("sidecar.example:443").tls_config(tls).connect().await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(target: &str) -> ChannelBuilder {
        ChannelBuilder {
            target: target.to_owned(),
            config: Config::default(),
            tls: None,
            upgrade: crate::upgrade::on_by_default(),
            keepalive: None,
            user_agent: None,
            authority: None,
            connect_timeout: crate::http::endpoint::DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// An `shm://` channel to where an HTTP/2 channel moved, refusing any server but that
    /// process.
    pub(crate) fn expecting(to: &UpgradedTo, config: Config, agent: Option<&str>) -> Result<Channel, Status> {
        let shm = ShmChannel::expecting(&to.target, config, to.pid)?;
        shm.set_agent(agent)?;
        Ok(Channel { via: Arc::new(Via::Shm(shm)), calls_read: true, routes: true })
    }

    /// Connects an `shm://` channel now (once; no retries).
    pub(crate) async fn connect_shm(&self) -> Result<(), Status> {
        self.via.shm()?.mux(false, None).await.map(drop)
    }

    /// Whether an `shm://` channel's connection is up.
    pub(crate) fn shm_connected(&self) -> bool {
        self.via.shm().is_ok_and(ShmChannel::is_connected)
    }

    /// The upgrade state of a channel to an HTTP/2 address, unless turned off.
    fn upgrade(&self) -> Option<&Arc<Upgrade>> {
        match &*self.via {
            Via::Http { upgrade, .. } => upgrade.as_ref(),
            Via::Shm(_) => None,
        }
    }

    /// Where the next call goes, for a channel to an HTTP/2 address: the `shm://` channel it
    /// moved to (counted), or `None` for HTTP/2 (counted, and a probe started if one is due).
    pub(crate) fn route(&self) -> Option<(Channel, UpgradedTo)> {
        let up = self.upgrade().filter(|_| self.routes)?;
        let routed = up.route(self);
        up.count(routed.is_some());
        routed.map(|(shm, to)| (shm.with_calls_read(self.calls_read), to))
    }

    /// A handle on the same connection whose calls never move to shared memory: for calls
    /// already routed to HTTP/2, the probe's own, and bindings that route calls themselves
    /// ([`route_for_binding`](Self::route_for_binding)).
    pub fn without_upgrade(&self) -> Channel {
        Channel { via: self.via.clone(), calls_read: self.calls_read, routes: false }
    }

    /// How many calls this channel, to an HTTP/2 address, started over shared memory and over
    /// HTTP/2 (zero for an `shm://` channel, or with the upgrade off).
    pub fn transport_counts(&self) -> TransportCounts {
        self.upgrade().map(|up| up.counts()).unwrap_or_default()
    }

    /// Where this channel stands with respect to shared memory ([`crate::upgrade`]).
    pub fn upgrade_status(&self) -> UpgradeStatus {
        self.upgrade().map_or(UpgradeStatus::Off, |up| up.status())
    }

    /// For bindings with an `shm://` fast path of their own (the Python binding's blocking
    /// calls): where this HTTP/2 channel moved, if it has, counting one call there; otherwise
    /// counts one HTTP/2 call and starts a probe if one is due. Call inside the runtime.
    pub fn route_for_binding(&self) -> Option<UpgradedTo> {
        self.route().map(|(_, to)| to)
    }

    /// For a unary request of `len` bytes, more than an HTTP/2 server takes unless told
    /// otherwise ([`HTTP_MAX_MESSAGE`](crate::HTTP_MAX_MESSAGE), gRPC's 4 MiB): if this channel
    /// to an HTTP/2 address is probing for the move to shared memory, or due to, waits (within
    /// `timeout`) for the probe to end, so that the call takes the move when there is one, where
    /// HTTP/2 would refuse it RESOURCE_EXHAUSTED (a channel's first calls go over HTTP/2 while
    /// its probe runs). At once otherwise. `unary` does this itself; bindings with a fast path of
    /// their own call it before [`route_for_binding`](Self::route_for_binding). Returns the
    /// call's timeout less the time waited, for the call to be given. Call inside a tokio
    /// runtime with its timers, as every call on an HTTP/2 channel is.
    pub async fn settle_upgrade(
        &self,
        len: usize,
        timeout: Option<std::time::Duration>,
    ) -> Option<std::time::Duration> {
        let Some(up) = self.upgrade().filter(|_| self.routes && len as u64 > crate::HTTP_MAX_MESSAGE) else {
            return timeout;
        };
        let began = tokio::time::Instant::now();
        // A timeout too long for the clock (a caller's "forever") bounds nothing.
        up.settle(self, timeout.and_then(|t| began.checked_add(t))).await;
        timeout.map(|t| t.saturating_sub(began.elapsed()))
    }

    /// For bindings: the binding's own connection to `to` failed, so the call that
    /// [`route_for_binding`](Self::route_for_binding) counted over shared memory goes over
    /// HTTP/2 (and is counted there), as do the next ones; a probe runs again later.
    pub fn upgrade_lost(&self, to: &UpgradedTo) {
        if let Some(up) = self.upgrade() {
            up.lost(to);
        }
    }

    /// Starts a call over HTTP/2 whatever the upgrade says (the probe's own call).
    pub(crate) fn start_http(&self, path: &str, options: CallOptions) -> Result<ClientCall, Status> {
        crate::call::check_start(path, &options)?;
        let limit = self.max_message_size();
        let closed = match &*self.via {
            Via::Http { closed, .. } => closed.subscribe(),
            Via::Shm(_) => tokio::sync::watch::Sender::new(None).subscribe(),
        };
        // A closed channel's call fails here, as grpc-go's `NewStream` does, not at its first
        // receive (its first send went nowhere and said nothing).
        if let Some(status) = closed.borrow().clone() {
            return Err(status);
        }
        // gRPC's wait_for_ready: the call waits (within its deadline) until the channel is
        // READY instead of failing UNAVAILABLE while no server answers.
        let http = self.without_upgrade();
        // The wait ends with the call's deadline: the call's request stream waits on it too,
        // and a send there would wait for ever with nobody reading the call's status.
        let ready = match options.wait_for_ready {
            true => {
                let (channel, timeout) = (http.clone(), options.timeout);
                Some(Box::pin(async move {
                    match timeout {
                        Some(t) => tokio::time::timeout(t, channel.until_ready()).await.unwrap_or_else(|_| {
                            Err(Status::new(
                                Code::DeadlineExceeded,
                                "the call's deadline passed waiting for the channel to be ready",
                            ))
                        }),
                        None => channel.until_ready().await,
                    }
                }) as crate::http::call::Ready)
            }
            false => None,
        };
        let call = HttpCall::start(http, path, options, limit, closed, ready)?;
        Ok(ClientCall { via: CallVia::Http(Box::new(call)) })
    }

    /// Waits until an HTTP/2 channel is READY, asking it to connect (it retries with backoff
    /// while it fails); SHUTDOWN fails with UNAVAILABLE.
    async fn until_ready(&self) -> Result<(), Status> {
        loop {
            match self.connectivity(true) {
                Connectivity::Ready => return Ok(()),
                Connectivity::Shutdown => return Err(Status::new(Code::Unavailable, "the channel was closed")),
                state => {
                    self.connectivity_changed(state).await;
                }
            }
        }
    }

    /// The HTTP/2 channel under an HTTP/2 target (this process's: see `HttpChannel`).
    pub(crate) fn http(&self) -> Option<(tonic::transport::Channel, &Arc<Tracker>)> {
        match &*self.via {
            Via::Http { channel, connectivity, .. } => Some((channel.get(), connectivity)),
            Via::Shm(_) => None,
        }
    }

    /// A channel that connects on its first call.
    pub fn lazy(target: &str) -> Result<Channel, Status> {
        Channel::builder(target).connect_lazy()
    }

    /// [`lazy`](Self::lazy) with a transport configuration.
    pub fn lazy_with(target: &str, config: Config) -> Result<Channel, Status> {
        Channel::builder(target).config(config).connect_lazy()
    }

    /// A handle on the same connection whose calls over `shm://`, when they wait for their next
    /// message, do (`true`, the default) or do not read the connection themselves, on the
    /// thread that polls them, for up to the connection's spin bound. With one call in flight
    /// its reply then reaches it with no task woken and no thread handed anything; the
    /// connection's reader task reads whenever no call does (ADR 0008). Turn it off for calls
    /// that an event loop polls among other work (the Python binding's asyncio channels do),
    /// where the spin would hold that work up. Clones keep the setting.
    pub fn with_calls_read(&self, on: bool) -> Channel {
        Channel { via: self.via.clone(), calls_read: on, routes: self.routes }
    }

    /// The channel's connectivity state, as gRPC names it ([`crate::connectivity`]). With
    /// `try_to_connect`, an IDLE or failed channel starts connecting in the background, retrying
    /// with backoff until it is READY or every handle on it is gone; that needs a tokio runtime
    /// current on this thread (without one, nothing is started).
    pub fn connectivity(&self, try_to_connect: bool) -> Connectivity {
        let tracker = self.tracker();
        let state = match &*self.via {
            Via::Shm(shm) => shm.connectivity(),
            Via::Http { .. } => tracker.get(),
        };
        if try_to_connect && matches!(state, Connectivity::Idle | Connectivity::TransientFailure) {
            tracker.kick(Arc::downgrade(&self.via), Channel::attempt);
        }
        state
    }

    /// Closes an `shm://` channel: its connection ends now, its calls in progress fail with
    /// `status`, and later calls fail UNAVAILABLE. Over HTTP/2 the calls by path in progress
    /// ([`start`](Self::start), [`unary`](Self::unary)) and later ones fail with `status` (their
    /// streams reset), as grpcio's `close` cancels its calls; tonic's connection closes when the
    /// last handle on the channel is dropped. A channel that moved to shared memory closes that
    /// connection now, and moves no more. A `status` of OK ends them CANCELLED ("the channel was
    /// closed"): a call the channel ended did not succeed.
    pub fn close(&self, status: Status) {
        let status = Status::closing(status);
        match &*self.via {
            Via::Shm(shm) => shm.close(status),
            Via::Http { upgrade, connectivity, closed, .. } => {
                closed.send_replace(Some(status.clone()));
                if let Some(upgrade) = upgrade {
                    upgrade.close(status);
                }
                connectivity.shutdown();
            }
        }
    }

    /// Waits until the connectivity state is not `from`, and gives the new one.
    pub async fn connectivity_changed(&self, from: Connectivity) -> Connectivity {
        self.tracker().changed(from).await
    }

    fn tracker(&self) -> &Arc<Tracker> {
        match &*self.via {
            Via::Shm(shm) => &shm.connectivity,
            Via::Http { connectivity, channel, .. } => {
                // In a child forked since, the parent's state is not this process's.
                channel.settle();
                connectivity
            }
        }
    }

    /// One attempt to connect, for [`connectivity`](Self::connectivity): `true` once connected.
    async fn attempt(via: Arc<Via>) -> bool {
        match &*via {
            Via::Shm(shm) => shm.mux(false, None).await.is_ok(),
            Via::Http { connectivity, .. } => {
                // tonic connects only for a request: a health check's answer, whatever it is,
                // means the connection is up.
                let channel = Channel { via: via.clone(), calls_read: true, routes: false };
                let options = CallOptions { timeout: Some(std::time::Duration::from_secs(20)), ..Default::default() };
                if let Ok(mut call) = channel.start_http("/grpc.health.v1.Health/Check", options) {
                    if call.send_last(&[]).await.is_ok() {
                        while let Ok(Some(_)) = call.recv().await {}
                    }
                }
                connectivity.get() == Connectivity::Ready
            }
        }
    }

    /// Starts a call of any shape: send messages, half-close, read responses.
    pub async fn start(&self, path: &str, options: CallOptions) -> Result<ClientCall, Status> {
        match &*self.via {
            Via::Shm(_) => Ok(ClientCall { via: CallVia::Shm(self.start_shm(path, options).await?) }),
            Via::Http { .. } => {
                let Some((shm, to)) = self.route() else { return self.start_http(path, options) };
                // Over shm:// the call does not wait for a server: HTTP/2 is there.
                let shm_options = CallOptions { wait_for_ready: false, ..options.clone() };
                let began = std::time::Instant::now();
                match shm.start_shm(path, shm_options).await {
                    Ok(call) => Ok(ClientCall { via: CallVia::Shm(call) }),
                    // The connection went before the call's head did (or could not be made):
                    // the server never saw it, so HTTP/2 carries it instead, within what is left
                    // of its time.
                    Err(status) if status.code() == Code::Unavailable => {
                        self.upgrade_lost(&to);
                        let timeout = options.timeout.map(|t| t.saturating_sub(began.elapsed()));
                        self.start_http(path, CallOptions { timeout, ..options })
                    }
                    Err(status) => Err(status),
                }
            }
        }
    }

    /// [`start`](Self::start) over `shm://`.
    pub(crate) async fn start_shm(&self, path: &str, options: CallOptions) -> Result<ShmCall, Status> {
        let shm = self.via.shm()?;
        shm.start_with(path, options, self.calls_read, self.via.clone(), None).await.map(|(call, _)| call)
    }

    /// [`start_shm`](Self::start_shm) that sends `first`, the call's only request, inside its
    /// HEADERS when it can (a one-frame call, ADR 0025); whether it did.
    pub(crate) async fn start_shm_with(
        &self,
        path: &str,
        options: CallOptions,
        first: Option<&[u8]>,
    ) -> Result<(ShmCall, bool), Status> {
        self.via.shm()?.start_with(path, options, self.calls_read, self.via.clone(), first).await
    }

    /// The largest message this channel accepts (its configuration's `max_message_size`).
    pub(crate) fn max_message_size(&self) -> usize {
        match &*self.via {
            Via::Shm(shm) => shm.max_message_size(),
            Via::Http { max_message, .. } => *max_message,
        }
    }

    /// Counters of the current `shm://` connection (zero if there is none yet): for a channel
    /// to an HTTP/2 address, of the one it moved to ([`crate::upgrade`]). They start afresh when
    /// the channel reconnects.
    pub fn counters(&self) -> ConnectionCounters {
        match self.via.shm() {
            Ok(shm) => shm.counters(),
            Err(_) => self.upgrade().and_then(|up| up.moved_to()).map(|c| c.counters()).unwrap_or_default(),
        }
    }

    /// A unary call: one request, one response.
    pub async fn unary(&self, path: &str, request: &[u8], options: CallOptions) -> Result<Response, Status> {
        // This future is small on purpose: the bindings allocate it and copy it whole at each
        // move, once per call. The paths taken less often are boxed, and the call is finished
        // in a future of its own, so that its state does not sit beside the start's (2,352
        // bytes before; `-Zprint-type-sizes`).
        if matches!(&*self.via, Via::Http { .. }) {
            return Box::pin(self.unary_http(path, request, options)).await;
        }
        // The engine's own start, not `start_shm_with`: a future more around it made this one
        // 112 bytes larger.
        let shm = self.via.shm()?;
        let (call, sent) = shm.start_with(path, options, self.calls_read, self.via.clone(), Some(request)).await?;
        // Unsent, the request did not fit in the call's HEADERS frame (ADR 0025).
        unary_response(call, (!sent).then_some(request), path).await
    }

    /// [`unary`](Self::unary) over HTTP/2.
    async fn unary_http(&self, path: &str, request: &[u8], options: CallOptions) -> Result<Response, Status> {
        let timeout = self.settle_upgrade(request.len(), options.timeout).await;
        let mut call = self.start(path, CallOptions { timeout, ..options }).await?;
        call.send_last(request).await?;
        let message = call.recv().await?.ok_or_else(|| no_response(path))?;
        if call.recv().await?.is_some() {
            return Err(more_than_one(path));
        }
        let metadata = call.headers().await?;
        let trailers = call.trailers().cloned().unwrap_or_default();
        let status_message = call.status_message().unwrap_or_default().to_owned();
        Ok(Response { metadata, message, trailers, status_message })
    }
}

/// The one response of a unary call over `shm://`, once `request` (if not sent already) has gone.
async fn unary_response(mut call: ShmCall, request: Option<&[u8]>, path: &str) -> Result<Response, Status> {
    if let Some(request) = request {
        Box::pin(call.send_last(request)).await?;
    }
    let message = call.recv().await?.ok_or_else(|| no_response(path))?;
    if call.recv().await?.is_some() {
        return Err(more_than_one(path));
    }
    Ok(call.take_response(message))
}

fn no_response(path: &str) -> Status {
    Status::new(Code::Internal, format!("{path}: the server ended the call without a response"))
}

fn more_than_one(path: &str) -> Status {
    Status::new(Code::Internal, format!("{path}: the server sent more than one response"))
}

/// One call in progress. Dropping it before the server has finished cancels it.
///
/// Over `shm://`, request messages are flow-controlled: a `send` waits while the server has not
/// taken the messages already sent (up to a window of [`INITIAL_WINDOW`](crate::INITIAL_WINDOW)
/// bytes, or [`SMALL_INITIAL_WINDOW`](crate::SMALL_INITIAL_WINDOW) where the handshake agreed to
/// it). Over `unix://` and `http://`, HTTP/2's own flow control does the same.
pub struct ClientCall {
    via: CallVia,
}

// The shm:// call is the common case, held inline: boxing it would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
enum CallVia {
    Shm(ShmCall),
    Http(Box<HttpCall>),
}

fn shm_only(what: &str) -> Status {
    Status::new(Code::Unimplemented, format!("{what} needs an shm:// channel"))
}

/// Sends a call's requests from one task or thread while another reads its responses
/// ([`ClientCall::sender`]); a bidi stream's two halves.
#[derive(Clone)]
pub struct CallSender {
    via: SenderVia,
}

#[derive(Clone)]
enum SenderVia {
    Shm(SendHalf),
    Http(Requests),
}

impl std::fmt::Debug for CallSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallSender").finish_non_exhaustive()
    }
}

impl CallSender {
    /// Sends one request message once flow control allows; `last` half-closes with it.
    /// `false` if the call is over (its status comes from the receiving side).
    pub async fn send(&self, message: &[u8], last: bool) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.send(message, last).await.is_ok(),
            SenderVia::Http(requests) => requests.send(Bytes::copy_from_slice(message), last).await,
        }
    }

    /// [`send`](Self::send) for a message already in [`Bytes`]: over HTTP/2 it is handed on
    /// without a copy (over `shm://` it is copied into shared memory either way).
    pub async fn send_bytes(&self, message: Bytes, last: bool) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.send(&message, last).await.is_ok(),
            SenderVia::Http(requests) => requests.send(message, last).await,
        }
    }

    /// A writable block of `len` bytes in this side's shared memory, to fill and send with
    /// [`send_block`](Self::send_block) (see [`ClientCall::alloc`]). `shm://` only.
    pub async fn alloc(&self, len: usize) -> Result<BlockMut, Status> {
        match &self.via {
            SenderVia::Shm(half) => half.alloc(len).await,
            SenderVia::Http(_) => Err(shm_only("alloc")),
        }
    }

    /// Whether `block` can go by [`send_block`](Self::send_block): over `shm://`, one
    /// allocated from this call's connection (another is refused, as the call being over
    /// is); over HTTP/2 any, copied.
    pub fn can_send(&self, block: &BlockMut) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.owns(block),
            SenderVia::Http(_) => true,
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it. `false` if the call is over.
    pub async fn send_block(&self, block: BlockMut, last: bool) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.send_block(block, last).await.is_ok(),
            SenderVia::Http(requests) => requests.send(Bytes::copy_from_slice(&block), last).await,
        }
    }

    /// Half-closes without a message.
    pub async fn close(&self) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.close().await.is_ok(),
            SenderVia::Http(requests) => {
                requests.close();
                true
            }
        }
    }
}

impl std::fmt::Debug for ClientCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.via {
            CallVia::Shm(call) => call.fmt(f),
            CallVia::Http(_) => f.debug_struct("ClientCall").field("over", &"http/2").finish_non_exhaustive(),
        }
    }
}

impl ClientCall {
    /// Sends one request message.
    pub async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send(message).await,
            CallVia::Http(call) => call.send(Bytes::copy_from_slice(message), false).await.map(drop),
        }
    }

    /// Sends the last request message and half-closes in the same frame.
    pub async fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send_last(message).await,
            CallVia::Http(call) => call.send(Bytes::copy_from_slice(message), true).await.map(drop),
        }
    }

    /// A writable block of `len` bytes in this side's shared memory, for a message built in
    /// place: fill it (or serialize into it), then [`send_block`](Self::send_block) it. The
    /// server reads it where it is, with no copy on either side. Waits for room in the arena
    /// until the call's deadline. `shm://` only.
    ///
    /// ```no_run
    /// # async fn demo(channel: isthmus::Channel) -> Result<(), isthmus::Status> {
    /// let mut call = channel.start("/demo.Blob/Put", Default::default()).await?;
    /// let mut block = call.alloc(1 << 20).await?;
    /// block.fill(7); // or serialize straight into `&mut block[..]`
    /// call.send_block(block, true).await?;
    /// # Ok(()) }
    /// ```
    pub async fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.alloc(len).await,
            CallVia::Http(_) => Err(shm_only("alloc")),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it.
    pub async fn send_block(&mut self, block: BlockMut, last: bool) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send_block(block, last).await,
            CallVia::Http(_) => Err(shm_only("send_block")),
        }
    }

    /// Half-closes: no more request messages.
    pub async fn close_send(&mut self) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.close_send().await,
            CallVia::Http(call) => {
                call.close_send();
                Ok(())
            }
        }
    }

    /// The next response message; `Ok(None)` once the server ended the call with OK (its
    /// trailers are then in [`trailers`](Self::trailers)); the server's status otherwise.
    ///
    /// Over `shm://` a large message is a view into the server's shared memory, not a copy;
    /// holding it keeps that memory from the server, so drop it (or copy what you keep) when
    /// done.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.recv().await,
            CallVia::Http(call) => call.recv().await,
        }
    }

    /// The server's initial metadata, waiting for it if needed.
    pub async fn headers(&mut self) -> Result<MetadataMap, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.headers().await,
            CallVia::Http(call) => call.headers().await,
        }
    }

    /// The server's trailing metadata, once the call has ended (with OK, over `shm://`).
    pub fn trailers(&self) -> Option<&MetadataMap> {
        match &self.via {
            CallVia::Shm(call) => call.trailers(),
            CallVia::Http(call) => call.trailers(),
        }
    }

    /// The message of the OK status the call ended with, once it has (nearly always empty);
    /// `None` before then, or if it failed (`recv` gave its status).
    pub fn status_message(&self) -> Option<&str> {
        match &self.via {
            CallVia::Shm(call) => call.status_message(),
            CallVia::Http(call) => call.status_message(),
        }
    }

    /// A handle that sends this call's requests beside the task that reads its responses.
    pub fn sender(&self) -> CallSender {
        let via = match &self.via {
            CallVia::Shm(call) => SenderVia::Shm(call.send_half()),
            CallVia::Http(call) => SenderVia::Http(call.requests()),
        };
        CallSender { via }
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub async fn cancel(self) {
        match self.via {
            CallVia::Shm(call) => call.cancel().await,
            CallVia::Http(mut call) => call.cancel(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `:authority` a channel's calls send over HTTP/2 is its target's (`Target::Tcp`'s
    /// `authority`, which `Target::parse` takes as written), not the address it connects to:
    /// read off the wire by a listener that decodes the call's HEADERS.
    #[test]
    fn an_http2_call_sends_its_targets_authority() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let seen = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("address").to_string();
            let target = Target::Tcp { addrs: vec![addr], tls: Some(false), authority: "sidecar.example".into() };
            let builder = Channel::builder("http://sidecar.example").upgrade(false);
            let (endpoint, connector, peer, connectivity) = builder.http_parts(&target).expect("parts");
            let made = endpoint.connect_with_connector_lazy(connector.clone());
            let channel = builder.over_http(made, endpoint, connector, peer, connectivity);
            let options = CallOptions { timeout: Some(std::time::Duration::from_secs(30)), ..Default::default() };
            let call = tokio::spawn(async move { channel.unary("/t.S/M", b"", options).await });
            let (mut conn, _) = listener.accept().await.expect("accept");
            let authority = first_authority(&mut conn).await;
            call.abort();
            authority
        });
        assert_eq!(seen.as_deref(), Some("sidecar.example"));
    }

    /// The `:authority` of the first HEADERS on a client's connection, after its preface
    /// (hyper sends a call's few headers in one frame, unpadded, with no priority).
    async fn first_authority(conn: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<String> {
        use tokio::io::AsyncReadExt;
        let mut preface = [0u8; 24];
        conn.read_exact(&mut preface).await.expect("preface");
        let block = loop {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head).await.expect("frame header");
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.expect("frame");
            if head[3] == 0x1 {
                assert_eq!(head[4] & 0x28, 0, "padded or with priority");
                break payload;
            }
        };
        let mut authority = None;
        let mut decoder = crate::http::hpack::Decoder::new(4096);
        decoder
            .decode(&block, 1 << 20, |name, value| {
                if name == b":authority" {
                    authority = Some(String::from_utf8_lossy(value).into_owned());
                }
            })
            .expect("the block decodes");
        authority
    }

    /// A channel given an authority (grpcio's `grpc.default_authority`, grpc-go's
    /// `WithAuthority`) sends it in place of its target's, over TCP and a Unix socket; one that
    /// is no `host[:port]` is INVALID_ARGUMENT.
    #[test]
    fn a_channel_given_an_authority_sends_it() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let dir = crate::testing::TempDir::new("authority");
        let dir = &dir.0;
        let seen = runtime.block_on(async {
            let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let unix = tokio::net::UnixListener::bind(dir.join("s.sock")).expect("bind");
            let targets = [
                (format!("127.0.0.1:{}", tcp.local_addr().expect("address").port()), "routed.example:8443"),
                (format!("unix:{}", dir.join("s.sock").display()), "::1"),
            ];
            let mut seen = Vec::new();
            for (i, (target, authority)) in targets.iter().enumerate() {
                let channel =
                    Channel::builder(target).upgrade(false).authority(*authority).connect_lazy().expect("lazy");
                let options = CallOptions { timeout: Some(std::time::Duration::from_secs(30)), ..Default::default() };
                let call = tokio::spawn(async move { channel.unary("/t.S/M", b"", options).await });
                let mut conn: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match i {
                    0 => Box::new(tcp.accept().await.expect("accept").0),
                    _ => Box::new(unix.accept().await.expect("accept").0),
                };
                seen.push(first_authority(&mut conn).await);
                call.abort();
            }
            seen
        });
        assert_eq!(seen, [Some("routed.example:8443".to_owned()), Some("[::1]".to_owned())]);
        let _runtime = runtime.enter();
        let bad = [
            "a b",
            "user@host",
            "",
            "host:notaport",
            "host:",
            "host:99999",
            "host:+443",
            ":443",
            "[::1]x",
            "[::1",
            "[notanip]:1",
        ];
        for bad in bad {
            for target in ["127.0.0.1:1", "unix:/tmp/nowhere.sock", "shm://nowhere"] {
                let made = Channel::builder(target).authority(bad).connect_lazy();
                assert_eq!(made.err().map(|s| s.code()), Some(Code::InvalidArgument), "{bad:?} on {target}");
            }
        }
        for good in ["h", "h:1", "routed.example:8443", "10.0.0.1", "[::1]:443", "::1", "xn--bcher-kva.example"] {
            assert!(Channel::builder("127.0.0.1:1").authority(good).connect_lazy().is_ok(), "{good:?}");
        }
    }

    /// The bindings box a unary call's future and move it whole (see `Channel::unary`): the
    /// paths taken less often stay out of it. 2,352 bytes with them inline, 736 now, and the
    /// C ABI's queued call around it 864, which glibc's thread cache serves (chunks up to
    /// 1,032 bytes); 4,960 before.
    #[test]
    fn a_unary_calls_future_leaves_its_rare_paths_boxed() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let _context = runtime.enter();
        let channel = Channel::lazy("shm://isthmus-future-size").expect("channel");
        let call = channel.unary("/a.B/C", b"", CallOptions::default());
        let size = std::mem::size_of_val(&call);
        assert!(size < 1024, "a unary call's future is {size} bytes");
    }
}
