//! The server's front: a [`Server`] builds one handler table (handlers by path, tonic services,
//! health, reflection) and a [`Bound`] serves it on every endpoint at once: `shm://` through the
//! engine ([`crate::engine`]), `unix://` and `http://` as standard gRPC over HTTP/2
//! ([`crate::http`]).
//!
//! The builder's settings (`handler`, `handler_object`, `fallback`, `add_service`, `reflection`,
//! `grace`, default 10 s, `max_concurrent_streams`, `config`) are documented on their methods.
//! `fallback` is for servers whose methods are known only at run time (the Python binding's): it
//! takes every path that no handler and no tonic service takes, and such a server answers unknown
//! methods itself. `reflection` serves `grpc.reflection.v1` and `v1alpha` for the given descriptor
//! sets and the health service, so grpcurl needs no `.proto`.
//!
//! A call's path finds its handler in this order (`Methods`): the handler for the exact path; else
//! the tonic service whose `/package.Service/` prefixes it (the health service included), so a
//! method a known service lacks gets tonic's UNIMPLEMENTED; else the fallback; else the engine's
//! UNIMPLEMENTED ("method … is not implemented by this server"), with no handler run. A prefix
//! lookup costs less than axum's router, which allocated per call.
//!
//! `bind_all(targets)` binds every target before it returns, so clients can connect at once: an
//! `shm://` listener per `shm://` target, an `HttpListener` per `unix://` or `http://` target. If
//! there is an HTTP/2 target and any handler, it also binds a private
//! `shm://isthmus-loopback-PID-N` with the server's `config`, and a lazy `Channel` to it becomes
//! the HTTP/2 router's fallback: an HTTP/2 call no tonic service takes goes through the bridge to
//! that endpoint and arrives as an `shm://` call like any other (ADR 0007). No target is
//! INVALID_ARGUMENT; outside a tokio runtime with I/O, tokio panics. `bind` is `bind_all` of one;
//! `serve` and `serve_all` bind, then serve.
//!
//! `serve_until(signal)` is `serve_with_shutdown` with the grace that `signal` yields (grpcio's
//! `stop(grace)`). `http_addresses()` gives each HTTP/2 endpoint as clients reach it
//! (`unix:///path`, or `http://ip:port` with the port chosen).
//!
//! Health: every endpoint, `shm://` included, serves `grpc.health.v1`. `""` is SERVING from the
//! start; each added service is set SERVING when serving starts; an unknown name is NOT_FOUND.
//! `health(false)` leaves that name to the application's own service; so does
//! `Bound::serve_health(false)`, up to the moment it serves (the service joins the routes then).
//!
//! A graceful shutdown (the signal, or an endpoint that ended):
//!
//! 1. the health service reports NOT_SERVING for `""` and every service, before anything stops, so
//!    a `Watch`er sees it;
//! 2. one stop signal ends every `shm://` accept loop, which drops its listener and removes its
//!    socket, and starts tonic's graceful shutdown on each HTTP/2 endpoint;
//! 3. every live `shm://` connection gets GOAWAY and drains: a HEADERS after it is refused
//!    UNAVAILABLE, with no handler run; a connection whose handshake was still under way gets
//!    GOAWAY once it ends, and closes at once. A [`Topic`](crate::Topic)'s subscriptions, which
//!    never end on their own, end UNAVAILABLE once what was queued for them is sent;
//! 4. the server waits until no `shm://` call is in flight and every endpoint's task has ended, for
//!    at most `grace` in all;
//! 5. endpoint tasks still running are aborted (their HTTP/2 calls dropped) and every `shm://`
//!    connection is closed: its calls end UNAVAILABLE on the client, their handlers stopped as for
//!    a cancel. The result is `Ok(())` after the signal, or the ended endpoint's status (its error,
//!    UNAVAILABLE "an endpoint stopped", or INTERNAL for a task that failed). A client leaves its
//!    calls in flight alone on GOAWAY and connects anew for the next call, which finds no server
//!    (UNAVAILABLE) unless a new one has bound the address.
//!
//! Not yet, or by design:
//!
//! - `config`, the call counters and the `isthmus.serve` spans reach only the calls the engine
//!   serves: every `shm://` call and the HTTP/2 calls that reach handlers through the loopback.
//!   HTTP/2 calls to tonic services get tonic's settings (set message limits on the generated
//!   `FooServer`). All HTTP/2 calls to handlers share the loopback's one connection, so
//!   `ServerStats` shows one connection; `max_concurrent_streams` holds each HTTP/2 connection in
//!   its settings instead. Both its ends copy what arrives out of its arena (ADR 0036), so one
//!   HTTP/2 client that reads slowly holds its streams' windows in memory, not the arena the
//!   other clients' calls need.
//! - The loopback is a real socket in the private runtime directory, reachable by processes of the
//!   same user as the named endpoints are; it costs each HTTP/2 handler call one more local hop
//!   (about 2 µs beside HTTP/2's tens of µs), and the HTTP/2 peer's address does not cross it.
//! - A path served by both a `handler` and a tonic service goes to the handler over `shm://` and to
//!   the service over HTTP/2.
//! - A raw handler sends no HEADERS before its first message unless it calls `send_headers`, so a
//!   tonic client that sends its first request only once the response opens waits on it, on every
//!   endpoint, until its deadline.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use isthmus_shm::Config;
use tokio::io::unix::AsyncFd;

use crate::engine::mux::Mux;
use crate::engine::server::{
    accept_shm, bind_shm, bind_shm_unless_taken, route, Accepting, Handler, HandlerFn, Methods, ServerCall,
    ServerStats, Tracker, GOING_AWAY,
};
use crate::http::endpoint::{ConnectionPolicy, HttpListener, Target};
use crate::http::tls::ServerTlsConfig;
use crate::status::{Code, Status};
use crate::upgrade::ShmOffer;

/// The largest request message a server's handlers take over HTTP/2 unless
/// [`Server::max_message_size`] says otherwise: 4 MiB, the default of grpc-go's, grpcio's and
/// tonic's servers.
pub const HTTP_MAX_MESSAGE: u64 = 4 << 20;

/// The health service's name (`grpc.health.v1.Health`).
const HEALTH_SERVICE: &str = <tonic_health::pb::health_server::HealthServer<()> as tonic::server::NamedService>::NAME;

/// A server: handlers by method path, served on one or more endpoints.
///
/// ```no_run
/// # async fn demo() -> Result<(), isthmus::Status> {
/// isthmus::Server::builder()
///     .handler("/demo.Echo/Say", |mut call: isthmus::ServerCall| async move {
///         while let Some(m) = call.recv().await? {
///             call.send(&m).await?;
///         }
///         Ok(())
///     })
///     .serve("shm://sidecar")
///     .await
/// # }
/// ```
#[derive(Clone)]
pub struct Server {
    handlers: HashMap<String, HandlerFn, crate::engine::server::PathKeys>,
    catch_all: Option<HandlerFn>,
    /// tonic services, for the methods no handler takes: routed by axum over HTTP/2.
    routes: Option<tonic::service::Routes>,
    /// The same services by name, for `shm://` calls (a lookup by prefix costs less than axum's
    /// router) and the health service.
    services: Vec<(&'static str, crate::http::BoxService)>,
    /// Encoded `FileDescriptorSet`s for server reflection.
    descriptors: Vec<Vec<u8>>,
    config: Config,
    /// The request limit set for every endpoint (`max_message_size`), if one was.
    max_message: Option<u64>,
    grace: Duration,
    stream_limit: usize,
    /// For `https://` targets (and `bind_secure`).
    tls: Option<ServerTlsConfig>,
    /// The `shm://` endpoint offered to HTTP/2 clients (`upgrade.rs`), unless `offer_shm` is off.
    offer: ShmOffer,
    offer_shm: bool,
    /// Serve `grpc.health.v1` (off when the application serves its own).
    health: bool,
    /// Compress handlers' replies over HTTP/2 with this, where the client reads it.
    reply_compression: Option<crate::Compression>,
    /// Bind TCP addresses with `SO_REUSEPORT`.
    reuse_port: bool,
    /// How its `unix://` and TCP endpoints keep their HTTP/2 connections: keepalive and age.
    connections: ConnectionPolicy,
}

impl Default for Server {
    fn default() -> Server {
        Server {
            handlers: HashMap::default(),
            catch_all: None,
            routes: None,
            services: Vec::new(),
            descriptors: Vec::new(),
            config: Config::default(),
            max_message: None,
            grace: Duration::from_secs(10),
            stream_limit: usize::MAX,
            tls: None,
            offer: ShmOffer::new(),
            offer_shm: true,
            health: true,
            reply_compression: None,
            reuse_port: false,
            connections: ConnectionPolicy::default(),
        }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("methods", &self.handlers.keys().collect::<Vec<_>>()).finish()
    }
}

impl Server {
    /// A server with no handlers and the default transport configuration.
    pub fn builder() -> Server {
        Server::default()
    }

    /// Registers `handler` for `path`. The handler ends the call by returning: `Ok(())` sends
    /// OK, `Err(status)` sends that status; a panic sends INTERNAL and the server goes on.
    pub fn handler<F, Fut>(mut self, path: &str, handler: F) -> Server
    where
        F: Fn(ServerCall) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Status>> + Send + 'static,
    {
        self.handlers.insert(path.to_owned(), route(move |call| Box::pin(handler(call))));
        self
    }

    /// Adds a tonic service (a `FooServer` that `tonic-build` generated): its methods are
    /// served over `shm://` as over HTTP/2, with the same metadata, deadlines and statuses.
    /// Handlers registered by path take precedence over it.
    pub fn add_service<S>(mut self, service: S) -> Server
    where
        S: tower_service::Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<tonic::body::Body>,
                Error = std::convert::Infallible,
            > + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.services.push((S::NAME, crate::http::BoxService::new(service.clone())));
        self.routes = Some(match self.routes.take() {
            None => tonic::service::Routes::new(service),
            Some(routes) => routes.add_service(service),
        });
        self
    }

    /// Turns on gRPC server reflection (`grpc.reflection.v1` and `v1alpha`) for the services in
    /// `descriptors`, an encoded `FileDescriptorSet` (what `tonic-prost-build`'s
    /// `file_descriptor_set_path` writes, or protox's output encoded). Tools such as grpcurl
    /// then list and call the services without the `.proto`. The health service is described
    /// too. Call once per set.
    pub fn reflection(mut self, descriptors: impl Into<Vec<u8>>) -> Server {
        self.descriptors.push(descriptors.into());
        self
    }

    /// Registers a [`Handler`] trait object for `path`.
    pub fn handler_object(mut self, path: &str, handler: Arc<dyn Handler>) -> Server {
        self.handlers.insert(path.to_owned(), route(move |call| handler.clone().handle(call)));
        self
    }

    /// Whether a handler is registered for `path` (None: the [`fallback`](Server::fallback)),
    /// for a binding that refuses a second registration where this builder replaces the first.
    pub fn handles(&self, path: Option<&str>) -> bool {
        match path {
            Some(path) => self.handlers.contains_key(path),
            None => self.catch_all.is_some(),
        }
    }

    /// Registers a [`Handler`] for every path that no handler and no tonic service takes: for
    /// servers whose methods are known only at run time (the Python binding's). It then answers
    /// unknown methods itself.
    pub fn fallback(mut self, handler: Arc<dyn Handler>) -> Server {
        self.catch_all = Some(route(move |call| handler.clone().handle(call)));
        self
    }

    /// How long a graceful shutdown waits for calls in progress before it closes connections
    /// (default 10 s).
    pub fn grace(mut self, grace: Duration) -> Server {
        self.grace = grace;
        self
    }

    /// HTTP/2 keepalive (gRPC's server `keepalive_time` and `keepalive_timeout`, grpc-go's
    /// `keepalive.ServerParameters`): a connection to an HTTP/2 endpoint from which nothing
    /// arrived for `time` gets a PING, and if its answer does not come within `timeout` the
    /// connection is closed and its calls are cancelled, so that handlers do not wait on a client
    /// that vanished without a word. None by default. `shm://` clients need none: a client that
    /// dies there is seen at once.
    pub fn keepalive(mut self, time: Duration, timeout: Duration) -> Server {
        self.connections.keepalive = Some((time, timeout));
        self
    }

    /// The longest an HTTP/2 connection to this server may live (gRPC's `MAX_CONNECTION_AGE`,
    /// grpc-go's `keepalive.ServerParameters.MaxConnectionAge`, grpcio's
    /// `grpc.max_connection_age_ms`): at that age it gets a GOAWAY, so its client opens a new
    /// connection for its next calls while those in progress finish on the old one. Clients
    /// behind a load balancer spread out this way. Unlike gRPC, no jitter is added. None by
    /// default; `shm://` connections have no age limit.
    pub fn max_connection_age(mut self, age: Duration) -> Server {
        self.connections.max_age = Some(age);
        self
    }

    /// How long calls in progress may go on after [`max_connection_age`](Self::max_connection_age)
    /// sent their connection its GOAWAY (gRPC's `MAX_CONNECTION_AGE_GRACE`): then the connection
    /// closes and they are cancelled, their clients seeing UNAVAILABLE. Without it, or without
    /// a maximum age, they may go on for ever.
    pub fn max_connection_age_grace(mut self, grace: Duration) -> Server {
        self.connections.max_age_grace = Some(grace);
        self
    }

    /// Calls one client connection may have open at once (default: no limit). Over `shm://` a
    /// call over the limit is refused with RESOURCE_EXHAUSTED, as grpcio's
    /// `maximum_concurrent_rpcs` does; an HTTP/2 connection is told the limit in its settings
    /// (SETTINGS_MAX_CONCURRENT_STREAMS, as grpc-go's `MaxConcurrentStreams`), and its client
    /// waits for a place.
    pub fn max_concurrent_streams(mut self, limit: usize) -> Server {
        self.stream_limit = limit.max(1);
        self.connections.max_streams = Some(u32::try_from(self.stream_limit).unwrap_or(u32::MAX));
        self
    }

    /// The transport configuration (sizes, peer policy, spinning), and the message limit of
    /// its `shm://` endpoints unless [`max_message_size`](Self::max_message_size) sets one.
    pub fn config(mut self, config: Config) -> Server {
        self.config = config;
        self
    }

    /// The largest request message a call may carry, on every endpoint, as grpc-go's
    /// `MaxRecvMsgSize`: a larger one fails its call RESOURCE_EXHAUSTED, naming both sizes, and
    /// the server goes on. Unset, `shm://` endpoints take their [`Config`]'s `max_message_size`
    /// (4 GiB by default) and HTTP/2 endpoints the same or [`HTTP_MAX_MESSAGE`] (4 MiB),
    /// whichever is less: there a request is gathered, and a compressed one inflated, in memory
    /// before its handler sees it, for any client that reaches the port (ADR 0034). tonic
    /// services over HTTP/2 keep tonic's limits.
    pub fn max_message_size(mut self, limit: u64) -> Server {
        self.max_message = Some(limit);
        self
    }

    /// Binds `target` now, so clients can connect as soon as this returns; serve with
    /// [`Bound::serve`]. Must be called inside a tokio runtime. See [`bind_all`](Self::bind_all)
    /// for the kinds of target.
    pub fn bind(self, target: &str) -> Result<Bound, Status> {
        self.bind_all([target])
    }

    /// Binds every target now: `shm://NAME` (isthmus, for clients on this machine), and
    /// `unix:///path.sock` or `http://host:port`, where the same methods answer standard gRPC
    /// over HTTP/2, for any gRPC client: tonic services ([`add_service`](Self::add_service))
    /// directly, handlers by path through a private `shm://` endpoint of this server.
    pub fn bind_all<'a>(self, targets: impl IntoIterator<Item = &'a str>) -> Result<Bound, Status> {
        let targets = targets.into_iter().map(Target::parse).collect::<Result<Vec<_>, _>>()?;
        self.bind_targets(targets)
    }

    /// The TLS settings for `https://` targets and gRPC's TCP forms (`[::]:443`,
    /// `localhost:8443`…): the server's certificate and key, and for mutual TLS the CA that
    /// signs its clients' certificates. An `http://` target stays plaintext.
    pub fn tls_config(mut self, tls: ServerTlsConfig) -> Server {
        self.tls = Some(tls);
        self
    }

    /// Whether the server answers `grpc.health.v1` itself (default: yes). Off for an
    /// application whose own health service is a foreign servicer behind the catch-all
    /// handler; a tonic health service added with [`add_service`](Self::add_service)
    /// (tonic_health's `health_reporter`), or handlers of the service's methods (Go's
    /// `RegisterHealthServer`), take its place by themselves.
    pub fn health(mut self, on: bool) -> Server {
        self.health = on;
        self
    }

    /// Compresses the handlers' replies to HTTP/2 calls with `compression`, for each client
    /// whose `grpc-accept-encoding` lists it (grpc's clients list gzip and deflate); others get
    /// them uncompressed. Replies over `shm://` cross no wire and go as they are, and tonic
    /// services keep their own setting (`send_compressed` on the generated server).
    pub fn send_compressed(mut self, compression: crate::Compression) -> Server {
        self.reply_compression = Some(compression);
        self
    }

    /// Binds TCP addresses with `SO_REUSEPORT` (default: no), so that servers of several
    /// processes, or several in one, serve the same port, the kernel spreading the
    /// connections among them; each must bind with it. grpcio's servers do so by default
    /// (`grpc.so_reuseport`), and the Python binding follows them.
    pub fn reuse_port(mut self, on: bool) -> Server {
        self.reuse_port = on;
        self
    }

    /// Whether HTTP/2 clients of this server are offered its `shm://` endpoint, so that their
    /// calls move to shared memory when they run on this machine (default: yes; see
    /// [`crate::upgrade`]).
    pub fn offer_shm(mut self, on: bool) -> Server {
        self.offer_shm = on;
        self
    }

    /// Shares what is offered between several binds of one server: an `shm://` endpoint bound
    /// by one is offered on the HTTP/2 endpoints of all (the Python binding binds each port on
    /// its own).
    pub fn shm_offer(mut self, offer: ShmOffer) -> Server {
        self.offer = offer;
        self
    }

    /// Binds one TCP target in any of its forms (`[::]:50051`, `0.0.0.0:0`, `https://…`) with
    /// TLS, as grpcio's `add_secure_port` does. INVALID_ARGUMENT for a target that is not TCP.
    pub fn bind_secure(mut self, target: &str, tls: ServerTlsConfig) -> Result<Bound, Status> {
        match Target::parse(target)? {
            Target::Tcp { addrs, authority, .. } => {
                self.tls = Some(tls);
                self.bind_targets(vec![Target::Tcp { addrs, tls: Some(true), authority }])
            }
            _ => Err(Status::new(Code::InvalidArgument, format!("{target}: TLS is served on TCP addresses only"))),
        }
    }

    fn bind_targets(self, targets: Vec<Target>) -> Result<Bound, Status> {
        // `grpc.health.v1` on every endpoint: the server ("") and each tonic service SERVING
        // while it serves, NOT_SERVING once a graceful shutdown begins.
        // The service itself joins the routes when serving starts (`Bound::serve_health`).
        let (health, _) = tonic_health::server::health_reporter();
        let mut this = self;
        if let Some(limit) = this.max_message {
            this.config.max_message_size = limit;
        }
        if !this.descriptors.is_empty() {
            let bad = |e: tonic_reflection::server::Error| {
                Status::new(Code::InvalidArgument, format!("a reflection descriptor set does not decode: {e}"))
            };
            let mut v1 = tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
            let mut v1alpha = tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
            for set in &this.descriptors {
                v1 = v1.register_encoded_file_descriptor_set(set);
                v1alpha = v1alpha.register_encoded_file_descriptor_set(set);
            }
            let (v1, v1alpha) = (v1.build_v1().map_err(bad)?, v1alpha.build_v1alpha().map_err(bad)?);
            this = this.add_service(v1).add_service(v1alpha);
        }
        // Every service but the health service itself has a health status.
        let health_name = <tonic_health::pb::health_server::HealthServer<()> as tonic::server::NamedService>::NAME;
        let names: Vec<&'static str> =
            this.services.iter().map(|(name, _)| *name).filter(|name| *name != health_name).collect();
        let mut shm = Vec::new();
        let mut http = Vec::new();
        let mut loopback = None;
        // Offered once every target is bound: the offer is shared with clones of this builder,
        // and one from a bind that failed later would name a socket that is gone to a retry.
        let mut first_shm = None;
        for target in targets {
            match target {
                Target::Shm(t) => {
                    let listener = bind_shm(&t, &this.config, false)?;
                    if this.offer_shm && first_shm.is_none() {
                        let path = listener.get_ref().listener.address().socket_path().display().to_string();
                        first_shm = Some(format!("shm://{path}"));
                    }
                    shm.push(listener);
                }
                // `https://`, and gRPC's TCP forms when the server has TLS settings; `http://`
                // is plaintext (HttpListener::bind refuses it with TLS settings).
                Target::Tcp { tls, .. } if tls == Some(true) || (tls.is_none() && this.tls.is_some()) => {
                    http.push(HttpListener::bind(
                        &target,
                        Some(this.tls.as_ref().ok_or_else(|| {
                            Status::new(
                                Code::InvalidArgument,
                                "an https:// target needs the server's TLS settings (Server::tls_config)",
                            )
                        })?),
                        this.reuse_port,
                    )?);
                }
                other => http.push(HttpListener::bind(&other, None, this.reuse_port)?),
            }
        }
        if shm.is_empty() && http.is_empty() {
            return Err(Status::new(Code::InvalidArgument, "no target to serve"));
        }
        // No tonic service (the built-in health service turned off): an empty router still
        // serves the offer and the handlers' fallback.
        let mut http_routes = match (&this.routes, http.is_empty()) {
            (None, false) => Some(tonic::service::Routes::default()),
            (routes, _) => routes.clone(),
        };
        if this.offer_shm && !http.is_empty() {
            let offer = crate::upgrade::OfferService(this.offer.clone());
            http_routes = http_routes.map(|routes| routes.add_service(offer));
        }
        if !http.is_empty() && (!this.handlers.is_empty() || this.catch_all.is_some()) {
            // Handlers take a ServerCall, which only an shm:// stream gives: HTTP/2 calls no
            // tonic service takes go through the bridge to a private shm:// endpoint of this
            // server (ADR 0007). One local hop (~2 µs) is small beside HTTP/2's own cost.
            // Both ends take what arrives out of the arena: the one connection carries every
            // HTTP/2 client's calls, so a client that reads slowly (or a handler) holds its
            // streams' windows in memory, not the arena all of them need (ADR 0036).
            // And its streams have small windows, so that one a client leaves unread holds 64 KiB
            // and a message of that, not 4 MiB (ADR 0037).
            let config = Config {
                copy_received: Some(LOOPBACK_COPIES),
                features: this.config.features | isthmus_shm::features::SMALL_WINDOW,
                ..this.config.clone()
            };
            let (target, bound) = bind_loopback(&config)?;
            loopback = Some(bound);
            // The server's message limit is on what it receives: its replies may be larger, and
            // the loopback's client side takes them as any client would (its requests are held
            // to the limit by the bridge, and by the shm:// side again).
            let replies = Config { max_message_size: u64::MAX, max_reassembly: None, ..config };
            let channel = crate::Channel::lazy_with(&target, replies)?;
            let max_request = this.max_message.unwrap_or(this.config.max_message_size.min(HTTP_MAX_MESSAGE));
            let max_request = usize::try_from(max_request).unwrap_or(usize::MAX);
            let loopback = crate::http::Loopback { channel, replies: this.reply_compression, max_request };
            let channel = tower::service_fn(move |request| loopback.clone().call(request));
            http_routes = http_routes.map(|mut routes| {
                let router = routes.axum_router_mut();
                *router = std::mem::take(router).fallback_service(channel);
                routes
            });
        }
        // An application's own health service (tonic_health's `health_reporter`, added as any
        // service) is the one served: a second under the same name made the router panic when
        // serving began.
        // So is one a binding registered method by method (Go's `RegisterHealthServer`, C's
        // handlers): over HTTP/2 the built-in service's routes came first, and a Go server
        // draining (NOT_SERVING) still answered SERVING there.
        let own_health = |path: &String| {
            path.strip_prefix('/').and_then(|p| p.strip_prefix(HEALTH_SERVICE)).is_some_and(|m| m.starts_with('/'))
        };
        let serve_health = this.health
            && !this.services.iter().any(|(name, _)| *name == HEALTH_SERVICE)
            && !this.handlers.keys().any(own_health);
        if let Some(offered) = first_shm {
            this.offer.offer(offered);
        }
        Ok(Bound {
            shm,
            loopback,
            http,
            routes: http_routes,
            handlers: Arc::new(Methods {
                by_path: this.handlers,
                services: this
                    .services
                    .into_iter()
                    .map(|(name, service)| {
                        let handler = crate::http::ServiceHandler(service);
                        let f: HandlerFn = route(move |call| Box::pin(handler.clone().serve(call)));
                        (format!("/{name}/"), f)
                    })
                    .collect(),
                catch_all: this.catch_all,
            }),
            health: (health, names),
            serve_health,
            grace: this.grace,
            stream_limit: this.stream_limit,
            connections: this.connections,
            tracker: Arc::default(),
        })
    }

    /// Binds and serves `target` until the listener fails.
    pub async fn serve(self, target: &str) -> Result<(), Status> {
        self.bind(target)?.serve().await
    }

    /// Binds and serves every target (see [`bind_all`](Self::bind_all)) until one fails.
    pub async fn serve_all<'a>(self, targets: impl IntoIterator<Item = &'a str>) -> Result<(), Status> {
        self.bind_all(targets)?.serve().await
    }
}

/// The most bytes of copies each end of the loopback holds for calls that have not taken
/// them (ADR 0036): past it, messages wait in the arena as on any connection, so clients that
/// leave many streams unread cannot take more of the server's memory than this and the arena.
const LOOPBACK_COPIES: u64 = 256 << 20;

/// The prefix of a loopback endpoint's name (`isthmus-loopback-PID-N`).
const LOOPBACK: &str = "isthmus-loopback-";

/// A fresh private `shm://` name for the HTTP/2 endpoints' way to the handlers. The process's
/// first one sweeps the runtime directory of the loopback sockets dead processes left.
fn loopback_target() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if n == 0 {
        sweep_dead_loopbacks(&isthmus_shm::runtime_dir());
    }
    format!("shm://{LOOPBACK}{}-{n}", std::process::id())
}

/// Binds the loopback at a fresh name. One that a live server has already is passed over for
/// the next: another copy of this library in the process (two modules that each link it)
/// counts its names from 0 too, and its second server failed to start ("another server is
/// listening on …isthmus-loopback-PID-0").
fn bind_loopback(config: &Config) -> Result<(String, AsyncFd<Accepting>), Status> {
    for _ in 0..LOOPBACK_TRIES {
        let target = loopback_target();
        if let Some(bound) = bind_shm_unless_taken(&target, config, true)? {
            return Ok((target, bound));
        }
    }
    Err(Status::new(Code::Unavailable, format!("{LOOPBACK_TRIES} loopback names in a row are taken")))
}

/// How many names [`bind_loopback`] tries.
const LOOPBACK_TRIES: usize = 64;

/// Removes from `dir` the loopback sockets of processes that no longer run. A server removes
/// its own when it stops; one killed (SIGKILL, a crash) cannot, and since each name carries its
/// process's id, no later server binds it and removes it as stale: they would pile up, one per
/// killed server. A name whose process runs, or that is no socket, stays.
fn sweep_dead_loopbacks(dir: &std::path::Path) {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(LOOPBACK))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let dead = !std::path::Path::new("/proc").join(pid.to_string()).exists();
        if dead && entry.file_type().is_ok_and(|t| t.is_socket()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A bound server, accepting once served.
pub struct Bound {
    shm: Vec<AsyncFd<Accepting>>,
    /// The private `shm://` endpoint through which HTTP/2 calls reach the handlers.
    loopback: Option<AsyncFd<Accepting>>,
    http: Vec<HttpListener>,
    routes: Option<tonic::service::Routes>,
    health: (tonic_health::server::HealthReporter, Vec<&'static str>),
    /// Whether the built-in health service answers (added to the routes when serving starts).
    serve_health: bool,
    handlers: Arc<Methods>,
    grace: Duration,
    stream_limit: usize,
    connections: ConnectionPolicy,
    tracker: Arc<Tracker>,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shm: Vec<String> = self.shm.iter().map(|l| l.get_ref().listener.address().to_string()).collect();
        f.debug_struct("Bound").field("shm", &shm).field("http", &self.http.len()).finish()
    }
}

impl Bound {
    /// The HTTP/2 endpoints as clients reach them (`unix:///path`, `http://host:port` with the
    /// port the system chose for port 0).
    pub fn http_addresses(&self) -> Vec<String> {
        self.http.iter().map(HttpListener::local_addr).collect()
    }

    /// Whether this server answers `grpc.health.v1` itself, as the builder's
    /// [`health`](Server::health) set it; changeable until it serves (the Python binding knows
    /// only at `start` whether the application serves its own).
    pub fn serve_health(&mut self, on: bool) {
        self.serve_health = on;
    }

    /// A handle on the server's counters that stays valid while it serves.
    pub fn stats(&self) -> ServerStats {
        ServerStats(self.tracker.clone())
    }

    /// Serves until `shutdown` completes, then shuts down gracefully: the sockets are removed,
    /// every `shm://` client is sent GOAWAY and the HTTP/2 endpoints stop taking calls; new
    /// calls are refused with UNAVAILABLE, and calls in progress get the grace period to finish
    /// before the connections close.
    pub async fn serve_with_shutdown(self, shutdown: impl Future<Output = ()>) -> Result<(), Status> {
        let grace = self.grace;
        self.serve_until(async move {
            shutdown.await;
            grace
        })
        .await
    }

    /// [`serve_with_shutdown`](Self::serve_with_shutdown) with the grace period chosen when
    /// the shutdown comes: `shutdown`'s output (grpcio's `stop(grace)`).
    pub async fn serve_until(self, shutdown: impl Future<Output = Duration>) -> Result<(), Status> {
        self.serve_to(async move { grace_ends(shutdown.await) }, None).await
    }

    /// [`serve_until`](Self::serve_until) for a shutdown that may be asked for again, sooner:
    /// `stop` holds when the calls still running are cut off (`None`: serve on). Its first
    /// instant starts the shutdown; a later, earlier one ends the grace period then, as a
    /// second `stop` with a smaller grace does in grpcio, and a `Stop` during `GracefulStop`
    /// in grpc-go.
    pub async fn serve_until_deadline(
        self,
        stop: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>,
    ) -> Result<(), Status> {
        let mut first = stop.clone();
        let shutdown = async move {
            match first.wait_for(Option::is_some).await {
                Ok(deadline) => deadline.unwrap_or_else(tokio::time::Instant::now),
                Err(_) => tokio::time::Instant::now(), // the sender went: stop now
            }
        };
        self.serve_to(shutdown, Some(stop)).await
    }

    /// Serves until `shutdown` gives the instant the calls still running are cut off at (or
    /// sooner, if `hurry` comes to hold an earlier one).
    async fn serve_to(
        self,
        shutdown: impl Future<Output = tokio::time::Instant>,
        hurry: Option<tokio::sync::watch::Receiver<Option<tokio::time::Instant>>>,
    ) -> Result<(), Status> {
        let Bound {
            shm,
            loopback,
            http,
            mut routes,
            health,
            serve_health,
            mut handlers,
            grace: default_grace,
            stream_limit,
            connections,
            tracker,
        } = self;
        let (reporter, names) = health;
        if serve_health {
            let service = tonic_health::pb::health_server::HealthServer::new(
                tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
            );
            routes = routes.map(|routes| routes.add_service(service.clone()));
            let name = <tonic_health::pb::health_server::HealthServer<()> as tonic::server::NamedService>::NAME;
            let handler = crate::http::ServiceHandler(crate::http::BoxService::new(service));
            let f: HandlerFn = route(move |call| Box::pin(handler.clone().serve(call)));
            Arc::make_mut(&mut handlers).services.push((format!("/{name}/"), f));
        }
        for name in &names {
            reporter.set_service_status(name, tonic_health::ServingStatus::Serving).await;
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let mut endpoints = tokio::task::JoinSet::new();
        for listener in http {
            if let Some(routes) = routes.clone() {
                endpoints.spawn(listener.serve(routes, connections, stopped()));
            }
        }
        for listener in shm {
            let (handlers, tracker, stop) = (handlers.clone(), tracker.clone(), stopped());
            endpoints.spawn(accept_shm(listener, handlers, tracker, stream_limit, stop));
        }
        if let Some(listener) = loopback {
            // Every HTTP/2 connection's calls to handlers share it: each of those connections
            // has the stream limit of its own, in its settings.
            let (handlers, tracker, stop) = (handlers.clone(), tracker.clone(), stopped());
            endpoints.spawn(accept_shm(listener, handlers, tracker, usize::MAX, stop));
        }
        tokio::pin!(shutdown);
        // An endpoint that failed gives the builder's grace to the others.
        let mut cut_off = None;
        let failed = tokio::select! {
            at = &mut shutdown => {
                cut_off = Some(at);
                None
            }
            Some(ended) = endpoints.join_next() => Some(match ended {
                Ok(Err(status)) => status,
                Ok(Ok(())) => Status::new(Code::Unavailable, "an endpoint stopped"),
                Err(e) => Status::new(Code::Internal, format!("an endpoint's task failed: {e}")),
            }),
        };
        let cut_off = cut_off.unwrap_or_else(|| grace_ends(default_grace));
        for name in names.iter().copied().chain([""]) {
            reporter.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
        }
        let _ = stop_tx.send(true); // shm listeners drop (their sockets go), HTTP/2 drains
                                    // Before the list: connections still in their handshake close themselves once it ends.
        tracker.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        let live: Vec<Arc<Mux>> =
            tracker.connections.lock().map(|c| c.iter().filter_map(|w| w.upgrade()).collect()).unwrap_or_default();
        // Each GOAWAY within the grace, all at once: one waits for room in its ring for as long
        // as its client reads nothing, and that must hold up neither the others (each stops
        // taking calls, and ends its subscriptions, at its first poll) nor the grace.
        let goaways = futures_util::future::join_all(live.iter().map(|mux| mux.go_away(GOING_AWAY)));
        let calls_done = async {
            // SeqCst, after `stopping`: a call that ends unseen here sees `stopping` and wakes
            // this (`CallGuard`).
            while tracker.calls.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                let idle = tracker.idle.notified();
                if tracker.calls.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    break;
                }
                idle.await;
            }
            while endpoints.join_next().await.is_some() {}
        };
        // The calls decide when this is done; the GOAWAYs go meanwhile, and one a client never
        // makes room for holds nothing up (its connection closes below).
        let drained = async {
            tokio::pin!(goaways, calls_done);
            tokio::select! {
                biased; // the GOAWAYs' first poll first: it sets every connection draining
                _ = &mut goaways => calls_done.await,
                () = &mut calls_done => {}
            }
        };
        tokio::select! {
            biased; // `drained` first: its first poll sets every connection draining
            () = drained => {}
            () = grace_over(cut_off, hurry) => {}
        }
        endpoints.abort_all();
        // Until each aborted task is dropped: what it holds (a listener, a socket file) is gone
        // once `serve` returns.
        while endpoints.join_next().await.is_some() {}
        for mux in &live {
            mux.sender.close(); // whatever is still running ends UNAVAILABLE on the client
        }
        failed.map_or(Ok(()), Err)
    }

    /// Serves until the listener fails.
    pub async fn serve(self) -> Result<(), Status> {
        self.serve_with_shutdown(std::future::pending()).await
    }
}

/// Asks a server run by [`Bound::serve_until_deadline`] to stop, cutting off the calls still
/// running `grace` from now, unless a stop already asked for cuts them off sooner (the
/// earliest counts, as grpcio's repeated `stop` and grpc-go's `Stop` during `GracefulStop`).
pub fn stop_by(stop: &tokio::sync::watch::Sender<Option<tokio::time::Instant>>, grace: Duration) {
    let at = grace_ends(grace);
    stop.send_if_modified(|sent| match sent {
        Some(earlier) if *earlier <= at => false,
        _ => {
            *sent = Some(at);
            true
        }
    });
}

/// When a grace period that starts now ends. One too long for the clock to hold
/// (`Duration::MAX`: "let them finish"), which a call's timeout takes as no deadline
/// ([`crate::call::deadline_in`]), ends in a century.
fn grace_ends(grace: Duration) -> tokio::time::Instant {
    crate::call::deadline_in(grace).map_or_else(
        || tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86_400),
        tokio::time::Instant::from_std,
    )
}

/// Completes at `cut_off`, or at an earlier instant `hurry` comes to hold.
async fn grace_over(
    mut cut_off: tokio::time::Instant,
    hurry: Option<tokio::sync::watch::Receiver<Option<tokio::time::Instant>>>,
) {
    let Some(mut hurry) = hurry else { return tokio::time::sleep_until(cut_off).await };
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(cut_off) => return,
            changed = hurry.changed() => match changed {
                Ok(()) => {
                    if let Some(at) = *hurry.borrow_and_update() {
                        cut_off = cut_off.min(at);
                    }
                }
                Err(_) => return tokio::time::sleep_until(cut_off).await, // no one can hurry it
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_removes_only_dead_processes_loopback_sockets() {
        let dir = crate::testing::TempDir::new("sweep");
        // No process has an id above the kernel's limit (pid_max is at most 2^22).
        let dead = 1u32 << 23;
        let me = std::process::id();
        let socket = |name: &str| std::os::unix::net::UnixListener::bind(dir.0.join(name)).expect("bind");
        let _listeners = [
            socket(&format!("{LOOPBACK}{dead}-0.sock")),
            socket(&format!("{LOOPBACK}{me}-0.sock")),
            socket(&format!("some-server-{dead}.sock")),
        ];
        std::fs::write(dir.0.join(format!("{LOOPBACK}{dead}-1.sock")), b"not a socket").expect("a file");
        sweep_dead_loopbacks(&dir.0);
        let mut left: Vec<String> = std::fs::read_dir(&dir.0)
            .expect("read the directory")
            .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![
            format!("{LOOPBACK}{dead}-1.sock"),
            format!("{LOOPBACK}{me}-0.sock"),
            format!("some-server-{dead}.sock"),
        ];
        want.sort();
        assert_eq!(left, want);
    }

    /// A bind that fails on a later target offers none of the `shm://` endpoints it bound
    /// before: the offer is shared with the builder's clones, and a retry (the C ABI's
    /// `isthmus_server_start` binds a clone and keeps the builder) went on offering a socket
    /// that was gone. A bind that succeeds offers its first `shm://` endpoint.
    #[tokio::test]
    async fn a_failed_bind_offers_nothing_to_a_retry() {
        let dir = crate::testing::TempDir::new("offer");
        let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("a port in use");
        let taken = format!("http://127.0.0.1:{}", busy.local_addr().expect("its address").port());
        let shm = |name: &str| format!("shm://{}", dir.0.join(name).display());
        let kept = Server::builder();
        let failed = kept.clone().bind_all([shm("a.sock").as_str(), taken.as_str()]);
        assert!(failed.is_err(), "the port is taken");
        assert_eq!(kept.offer.offered(), None);
        let bound = kept.clone().bind_all([shm("b.sock").as_str(), "http://127.0.0.1:0"]).expect("bind");
        assert_eq!(kept.offer.offered(), Some(shm("b.sock")));
        drop(bound);
    }
}
