//! Where a server listens and a channel connects: `shm://` (isthmus), or `unix://` and `http://`
//! (standard gRPC over HTTP/2, for any gRPC client and for peers on other machines).
//!
//! `Target::parse`: `shm://NAME` and `shm:///path.sock`; `unix:///abs/path.sock`,
//! `unix:/abs/path.sock` and `unix:relative.sock` (gRPC's forms); `http://host:port` with no path.
//! Any other scheme, or a form without its path or host, is INVALID_ARGUMENT. `https://` and a
//! channel's or server's TLS settings make a TCP endpoint TLS (`tls.rs`).
//!
//! `HttpListener::bind`: for `unix://`, if a connect to the path succeeds a server is there and the
//! bind fails ALREADY_EXISTS (an `shm://` bind says UNAVAILABLE then); otherwise whatever is at the
//! path is removed and the path bound. For `http://`, a TCP bind; port 0 lets the system choose.
//! Other failures are UNAVAILABLE. The socket gets the process's umask: these endpoints have none
//! of `shm://`'s checks (no peer credentials or `PeerPolicy`, no private directory); TCP has
//! TLS, and mutual TLS, when asked for.
//!
//! `HttpListener::serve` runs tonic's HTTP/2 server with tonic's defaults over the server's
//! `Routes` (the tonic services, health and reflection, and the loopback `Channel` as fallback),
//! every accepted connection read through the `:authority` filter, and tonic's two answers
//! that gRPC names otherwise given gRPC's codes (an expired deadline, `DeadlineLayer`; a message
//! over a service's limit, `TooLargeLayer`), behind `GrpcOnlyLayer`, which refuses a request that
//! is not a gRPC call (its method, its content type). On the stop signal tonic stops
//! accepting and drains (GOAWAY, calls in progress finish), then the unix socket file is removed.
//! `grace` bounds this drain and the `shm://` one together.
//! With a maximum connection age, tonic sends each connection that old its GOAWAY, and `Aged`
//! ends the connection when the age's grace is over too.
//!
//! `http_endpoint` and `connector` make a channel's tonic `Endpoint` and open its stream
//! (`HttpIo`): a unix stream, or TCP with `TCP_NODELAY`; the connect, TLS handshake and the
//! server's SETTINGS within the channel's connect timeout (20 s, gRPC's), or the attempt and
//! the connection fail. The URI's authority is `localhost` for a
//! unix socket, as grpc-go and h2 expect, and the target's host (and port) as written for TCP.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::ServerName;

use crate::connectivity::{Live, Tracker};
use crate::http::tls::{self, ServerTlsConfig};
use crate::status::{Code, Status};
use crate::upgrade::{Ends, HttpPeer};

/// The schemes `Target::parse` accepts, for its errors.
const ACCEPTED: &str = "shm://NAME, unix:PATH, unix:///ABS, unix-abstract:NAME, HOST:PORT, dns:HOST:PORT, \
                        dns:///HOST:PORT, ipv4:A.B.C.D:PORT, ipv6:[ADDR]:PORT, http://HOST:PORT or https://HOST:PORT";

/// One parsed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `shm://NAME` or `shm:///path.sock`.
    Shm(String),
    /// `unix:///abs/path.sock`, `unix:/abs/path.sock` or `unix:relative.sock` (gRPC's forms).
    Unix(PathBuf),
    /// `unix-abstract:NAME`: a socket in Linux's abstract namespace (no file).
    UnixAbstract(Vec<u8>),
    /// TCP: `host:port` in any of gRPC's forms, or `http://`/`https://`. `addrs` are tried in
    /// order (gRPC's `ipv4:` and `ipv6:` take lists). `tls`: `Some(true)` for `https://`,
    /// `Some(false)` for `http://` (plaintext whatever the settings), `None` for gRPC's forms
    /// (TLS if the channel or server has TLS settings). `authority`: what a client's calls send
    /// as `:authority`, the host (and port) as the target wrote it, as grpc-go, grpcio and
    /// tonic send it for their forms: no default port added (a proxy that routes by host,
    /// Envoy's virtual hosts say, may not match `host:443` to `host`); for an `ipv4:`/`ipv6:`
    /// list, its first address as written.
    Tcp { addrs: Vec<String>, tls: Option<bool>, authority: String },
}

impl Target {
    /// Parses a target as grpc-core names them, plus isthmus's `shm://`, `http://`, `https://`.
    /// A form with no port gets gRPC's default, 443 (80 for `http://`).
    pub(crate) fn parse(target: &str) -> Result<Target, Status> {
        let bad = |why: &str| Status::new(Code::InvalidArgument, format!("target {target:?}: {why}"));
        let tcp = |addrs: Vec<String>, tls: Option<bool>, authority: &str| {
            Ok(Target::Tcp { addrs, tls, authority: as_authority(authority) })
        };
        if target.starts_with("shm://") {
            return Ok(Target::Shm(target.to_owned()));
        }
        if let Some(name) = target.strip_prefix("unix-abstract:") {
            if name.is_empty() {
                return Err(bad("no abstract socket name"));
            }
            return Ok(Target::UnixAbstract(name.as_bytes().to_vec()));
        }
        if let Some(rest) = target.strip_prefix("unix:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(bad("no socket path"));
            }
            if rest.starts_with("//") && !path.starts_with('/') {
                return Err(bad("unix:// takes an absolute path (unix:///abs/path); unix:PATH takes a relative one"));
            }
            return Ok(Target::Unix(PathBuf::from(path)));
        }
        for (scheme, tls, port) in [("http://", false, 80), ("https://", true, 443)] {
            if let Some(rest) = target.strip_prefix(scheme) {
                let host = rest.strip_suffix('/').unwrap_or(rest);
                if host.contains('/') {
                    return Err(bad(&format!("expected {scheme}HOST:PORT, with no path")));
                }
                return tcp(vec![host_port(host, port).map_err(|why| bad(&why))?], Some(tls), host);
            }
        }
        if let Some(rest) = target.strip_prefix("dns:") {
            // `dns:host:port`, `dns:///host:port`, or `dns://resolver/host:port`: the resolver
            // named in the authority is the system's either way.
            let host = match rest.strip_prefix("//") {
                Some(after) => after.split_once('/').map(|(_, h)| h).ok_or_else(|| bad("expected dns:///HOST:PORT"))?,
                None => rest,
            };
            return tcp(vec![host_port(host, 443).map_err(|why| bad(&why))?], None, host);
        }
        for (scheme, v6) in [("ipv4:", false), ("ipv6:", true)] {
            if let Some(list) = target.strip_prefix(scheme) {
                let addrs = list
                    .split(',')
                    .map(|a| ip_port(a, v6))
                    .collect::<Result<Vec<_>, String>>()
                    .map_err(|why| bad(&why))?;
                // The first address as written (grpc-core sends the whole list, which is no
                // URI authority; grpc-go has no such scheme).
                let first = list.split(',').next().unwrap_or_default();
                return tcp(addrs, None, first);
            }
        }
        if let Some((scheme, _)) = target.split_once("://") {
            return Err(bad(&format!("unknown scheme {scheme:?}; the accepted forms are {ACCEPTED}")));
        }
        // No scheme: gRPC's default, `dns:///target`.
        host_port(target, 443)
            .map(|a| Target::Tcp { addrs: vec![a], tls: None, authority: as_authority(target) })
            .map_err(|why| bad(&format!("{why}; the accepted forms are {ACCEPTED}")))
    }

    /// The host name a TLS client checks the server's certificate against: the first
    /// address's host, without its port or brackets (`localhost` for a unix socket).
    pub(crate) fn host(&self) -> String {
        match self {
            Target::Tcp { addrs, .. } => addrs.first().map_or_else(String::new, |a| split_host_port(a).0.to_owned()),
            _ => "localhost".to_owned(),
        }
    }
}

/// `host:port`, `[v6]:port`, or a host alone (with `default_port`), checked and normalised to
/// `host:port` as `ToSocketAddrs` takes it.
fn host_port(s: &str, default_port: u16) -> Result<String, String> {
    if s.is_empty() {
        return Err("no host".into());
    }
    let (host, port) = split_host_port(s);
    if host.is_empty() || host.contains(['/', '[', ']', ' ', '@', '?', '#']) {
        return Err(format!("{s:?} is not HOST:PORT"));
    }
    let port = match port {
        None => default_port,
        Some(p) => p.parse::<u16>().map_err(|_| format!("{p:?} is not a port number"))?,
    };
    // A host with a colon is an IPv6 literal or nothing: `vsock:3:5000`, `xds:svc:443` (other
    // gRPC schemes) or `localhost::50051` (a typo) passed as hosts, failing every call later.
    if host.contains(':') && host.parse::<std::net::Ipv6Addr>().is_err() {
        return Err(format!("{s:?} is neither HOST:PORT nor an IPv6 address"));
    }
    // An IPv6 literal keeps its brackets, which is how the socket address parser wants it.
    Ok(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") })
}

/// A target's `host[:port]` as an `:authority`: a bare IPv6 literal (`::1`) gets its brackets.
fn as_authority(host: &str) -> String {
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// Splits `host:port` or `[v6]:port` (or a host or `[v6]` alone); a bare IPv6 literal
/// (`::1`) is all host.
fn split_host_port(s: &str) -> (&str, Option<&str>) {
    if let Some(rest) = s.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((host, "")) => (host, None),
            Some((host, tail)) => (host, Some(tail.strip_prefix(':').unwrap_or(tail))),
            None => (s, None),
        };
    }
    match s.rsplit_once(':') {
        Some((host, _)) if host.contains(':') => (s, None),
        Some((host, port)) => (host, Some(port)),
        None => (s, None),
    }
}

/// One address of an `ipv4:` or `ipv6:` list: an IP literal of that family, port 443 if none.
fn ip_port(s: &str, v6: bool) -> Result<String, String> {
    let (host, port) = split_host_port(s);
    let ok = if v6 { host.parse::<std::net::Ipv6Addr>().is_ok() } else { host.parse::<std::net::Ipv4Addr>().is_ok() };
    if !ok {
        return Err(format!("{host:?} is not an IPv{} address", if v6 { 6 } else { 4 }));
    }
    host_port(
        &match port {
            Some(p) if v6 => format!("[{host}]:{p}"),
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        },
        443,
    )
}

/// A TCP listener on `host` (`host:port`, resolved; the first address that binds) with
/// `SO_REUSEPORT`, as `std::net::TcpListener::bind` would make it otherwise.
fn bind_reusing_port(host: &str) -> std::io::Result<tokio::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for addr in host.to_socket_addrs()? {
        let socket = match addr {
            std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        };
        let bound = socket.and_then(|socket| {
            // As std's own bind: a port a closing connection still holds can be bound again.
            socket.set_reuseaddr(true)?;
            socket.set_reuseport(true)?;
            socket.bind(addr)?;
            socket.listen(1024)
        });
        match bound {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to bind")))
}

/// A bound HTTP/2 listener.
pub(crate) enum HttpListener {
    /// A unix socket, and its file, removed with the listener (none for an abstract name).
    Unix(tokio::net::UnixListener, Option<SocketFile>, String),
    /// TCP, with TLS if configured.
    Tcp(tokio::net::TcpListener, Option<Arc<rustls::ServerConfig>>),
}

impl HttpListener {
    /// Binds `target` now (inside a tokio runtime), with TLS if `tls` is given (TCP targets
    /// only), and a TCP address with `SO_REUSEPORT` if `reuse_port`. A unix socket left by a
    /// dead server is replaced; one that answers is not.
    pub(crate) fn bind(
        target: &Target,
        tls: Option<&ServerTlsConfig>,
        reuse_port: bool,
    ) -> Result<HttpListener, Status> {
        let unavailable = |what: String| Status::new(Code::Unavailable, what);
        if tls.is_some() && !matches!(target, Target::Tcp { .. }) {
            return Err(Status::new(Code::InvalidArgument, "TLS is served on TCP addresses only"));
        }
        match target {
            Target::Unix(path) => {
                // Without waiting: a server stopped with its backlog full would hold a blocking
                // connect for ever, and it is alive all the same.
                use std::io::ErrorKind;
                match isthmus_shm::connect_unix(path, None) {
                    Ok(_) => return Err(in_use(path)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Err(in_use(path)),
                    // Only a socket nobody listens on (a dead server's) is replaced; any other
                    // file stays, and the bind below reports it.
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                        use std::os::unix::fs::FileTypeExt;
                        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                            let _ = std::fs::remove_file(path);
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    // One we may not connect to (another user's, say) is not ours to remove.
                    Err(e) => return Err(unavailable(format!("cannot probe {}: {e}", path.display()))),
                }
                let std = std::os::unix::net::UnixListener::bind(path)
                    .map_err(|e| unavailable(format!("cannot bind {}: {e}", path.display())))?;
                let file = SocketFile::bound(path.clone());
                let name = format!("unix://{}", path.display());
                Ok(HttpListener::Unix(tokio_unix(std)?, file, name))
            }
            Target::UnixAbstract(name) => {
                let addr = abstract_addr(name)?;
                let std = std::os::unix::net::UnixListener::bind_addr(&addr).map_err(|e| {
                    let code =
                        if e.kind() == std::io::ErrorKind::AddrInUse { Code::AlreadyExists } else { Code::Unavailable };
                    Status::new(code, format!("cannot bind unix-abstract:{}: {e}", String::from_utf8_lossy(name)))
                })?;
                Ok(HttpListener::Unix(
                    tokio_unix(std)?,
                    None,
                    format!("unix-abstract:{}", String::from_utf8_lossy(name)),
                ))
            }
            Target::Tcp { addrs, tls: wants_tls, .. } => {
                let [host] = addrs.as_slice() else {
                    return Err(Status::new(Code::InvalidArgument, "a server binds one address per target"));
                };
                let config = match (tls, wants_tls) {
                    (Some(tls), _) => Some(tls.rustls()?),
                    (None, Some(true)) => {
                        return Err(Status::new(
                            Code::InvalidArgument,
                            format!("https://{host} needs the server's TLS settings (Server::tls_config)"),
                        ))
                    }
                    (None, _) => None,
                };
                let l = match reuse_port {
                    false => std::net::TcpListener::bind(host.as_str()).and_then(|std| {
                        std.set_nonblocking(true)?;
                        tokio::net::TcpListener::from_std(std)
                    }),
                    true => bind_reusing_port(host),
                };
                let l = l.map_err(|e| unavailable(format!("cannot bind {host}: {e}")))?;
                Ok(HttpListener::Tcp(l, config))
            }
            Target::Shm(_) => Err(Status::new(Code::Internal, "an shm:// target is not an HTTP listener")),
        }
    }

    /// The address clients reach: `unix://path`, `unix-abstract:name`, or `http://ip:port` /
    /// `https://ip:port` with the real port.
    pub(crate) fn local_addr(&self) -> String {
        match self {
            HttpListener::Unix(_, _, name) => name.clone(),
            HttpListener::Tcp(l, tls) => {
                let scheme = if tls.is_some() { "https" } else { "http" };
                l.local_addr().map_or_else(|_| format!("{scheme}://?"), |a| format!("{scheme}://{a}"))
            }
        }
    }

    /// Serves `routes` with tonic's HTTP/2 server until `stop` completes; calls in progress
    /// then finish (tonic's graceful shutdown). `connections` says how connections are kept
    /// (keepalive PINGs, a maximum age). A `unix://` socket's file goes when this ends or is
    /// dropped (`SocketFile`).
    pub(crate) async fn serve(
        self,
        routes: tonic::service::Routes,
        connections: ConnectionPolicy,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), Status> {
        let ConnectionPolicy { keepalive, max_age, max_age_grace, max_streams } = connections;
        let mut server = tonic::transport::Server::builder()
            .max_concurrent_streams(max_streams)
            // hyper's own default, which tonic's builder turns off: a client whose streams the
            // server keeps resetting for its errors gets a GOAWAY after 1024 of them.
            .http2_max_local_error_reset_streams(Some(1024))
            // What the `:authority` filter every connection is read through takes (its
            // bound): a client that keeps to it is not cut off.
            .http2_max_header_list_size(crate::http::authority::MAX_BLOCK as u32)
            .http2_keepalive_interval(keepalive.map(|(time, _)| time))
            .http2_keepalive_timeout(keepalive.map(|(_, timeout)| timeout));
        if let Some(age) = max_age {
            // Not tonic's `max_connection_age_grace`: with it tonic sends no GOAWAY at the age,
            // and only drops the connection when the grace ends too. `Aged` ends it instead.
            server = server.max_connection_age(age);
        }
        let server = server
            .layer(GrpcOnlyLayer)
            .layer(crate::http::authority::DeadlineLayer)
            .layer(TooLargeLayer)
            .layer(PeerLayer)
            .add_routes(routes);
        let failed =
            |e: tonic::transport::Error| Status::new(Code::Unavailable, format!("HTTP/2 endpoint failed: {e}"));
        // Every connection is read through the `:authority` filter (see `authority.rs`), and
        // closed when its age and grace are over.
        let end_after = max_age.zip(max_age_grace).map(|(age, grace)| age.saturating_add(grace));
        let fix = move |s: std::io::Result<ServerIo>| {
            s.map(|io| Aged::new(crate::http::authority::AuthorityFix::new(io), end_after))
        };
        match self {
            // `_file` goes when this ends, or when the task is aborted at the end of a grace.
            HttpListener::Unix(l, _file, _) => {
                let incoming =
                    tokio_stream::StreamExt::map(paced(tokio_stream::wrappers::UnixListenerStream::new(l)), move |s| {
                        fix(s.map(ServerIo::Unix))
                    });
                server.serve_with_incoming_shutdown(incoming, stop).await.map_err(failed)
            }
            HttpListener::Tcp(l, None) => {
                let incoming =
                    tokio_stream::StreamExt::map(paced(tokio_stream::wrappers::TcpListenerStream::new(l)), move |s| {
                        fix(s.map(ServerIo::tcp))
                    });
                server.serve_with_incoming_shutdown(incoming, stop).await.map_err(failed)
            }
            HttpListener::Tcp(l, Some(config)) => {
                let incoming = tokio_stream::StreamExt::map(tls_incoming(l, config), fix);
                server.serve_with_incoming_shutdown(incoming, stop).await.map_err(failed)
            }
        }
    }
}

/// How a server's HTTP/2 endpoints keep their connections (`Server::keepalive`,
/// `Server::max_connection_age`, `Server::max_connection_age_grace`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ConnectionPolicy {
    /// PING a connection quiet this long, and close it if the answer takes longer than this.
    pub(crate) keepalive: Option<(std::time::Duration, std::time::Duration)>,
    /// GOAWAY to a connection this old.
    pub(crate) max_age: Option<std::time::Duration>,
    /// After the GOAWAY, close the connection this much later, whatever still runs on it.
    pub(crate) max_age_grace: Option<std::time::Duration>,
    /// The streams a connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub(crate) max_streams: Option<u32>,
}

/// A server connection's stream that fails every read and write once `end` passes: h2 then
/// closes the connection and cancels the calls still on it. Reads and writes both, since h2
/// polls one or the other: a client that stops reading leaves h2 waiting to write.
pub(crate) struct Aged<S> {
    io: S,
    end: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Aged<S> {
    /// `io`, ended `after` from now (`None`: never).
    fn new(io: S, after: Option<std::time::Duration>) -> Aged<S> {
        Aged { io, end: after.map(|after| Box::pin(tokio::time::sleep(after))) }
    }

    /// The error for a read or write once `end` has passed (the wake-up when it does is `cx`'s).
    fn over(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        let end = self.end.as_mut()?;
        end.as_mut().poll(cx).is_ready().then(|| {
            std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the connection's maximum age and its grace are over",
            )
        })
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Aged<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.over(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Aged<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.over(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.over(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.over(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Aged<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// A unix socket's file, removed when this is dropped if it is still the socket bound (its
/// device and inode), not a successor's: the rule the `shm://` listener keeps (protocol 2).
pub(crate) struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl SocketFile {
    /// The file just bound at `path`; `None` if it cannot be looked at (nothing is removed).
    fn bound(path: PathBuf) -> Option<SocketFile> {
        let id = file_id(&path)?;
        Some(SocketFile { path, id })
    }
}

fn file_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if file_id(&self.path) == Some(self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn tokio_unix(std: std::os::unix::net::UnixListener) -> Result<tokio::net::UnixListener, Status> {
    let unavailable = |e: std::io::Error| Status::new(Code::Unavailable, e.to_string());
    std.set_nonblocking(true).map_err(unavailable)?;
    tokio::net::UnixListener::from_std(std).map_err(unavailable)
}

fn abstract_addr(name: &[u8]) -> Result<std::os::unix::net::SocketAddr, Status> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name)
        .map_err(|e| Status::new(Code::InvalidArgument, format!("unix-abstract name: {e}")))
}

/// `incoming` with its accept errors (out of fds, say) dropped after a pause that doubles while
/// they last, as the `shm://` listener's are: passed on, tonic took the next at once, and the
/// accept failed again at once, a core spinning while the connections that held the fds lived.
fn paced<T: Send + 'static>(
    incoming: impl tokio_stream::Stream<Item = std::io::Result<T>> + Send + 'static,
) -> impl tokio_stream::Stream<Item = std::io::Result<T>> + Send + 'static {
    use crate::engine::server::{ACCEPT_PAUSE_MAX, ACCEPT_PAUSE_MIN};
    let start = (Box::pin(incoming), None::<std::time::Duration>);
    futures_util::stream::unfold(start, |(mut incoming, mut pause)| async move {
        loop {
            match tokio_stream::StreamExt::next(&mut incoming).await? {
                Ok(io) => return Some((Ok(io), (incoming, None))),
                Err(e) => {
                    let p = pause.map_or(ACCEPT_PAUSE_MIN, |p| (p * 2).min(ACCEPT_PAUSE_MAX));
                    pause = Some(p);
                    tracing::warn!(error = %e, retry_in = ?p, "isthmus: accepting an HTTP/2 connection failed");
                    tokio::time::sleep(p).await;
                }
            }
        }
    })
}

/// How long a TLS client may take over its handshake before the server drops it.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Handshakes in progress at once; a flood of connections waits for accept beyond it.
const HANDSHAKES: usize = 256;

/// Accepted TLS connections, each handshake on a task of its own so that a slow client holds
/// up nobody else. A failed handshake is dropped (the client hears the alert). Ends when the
/// server stops reading it.
fn tls_incoming(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<ServerIo>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let slots = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else { return };
            let tcp = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        tracing::debug!("accept failed: {e}");
                        // Out of fds, say: keep the connections we have and try again shortly.
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    }
                },
            };
            let _ = tune_tcp(&tcp);
            let (tx, acceptor) = (tx.clone(), acceptor.clone());
            tokio::spawn(async move {
                let _slot = slot;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    // A client that did not offer HTTP/2 is closed on, as grpc-core's and
                    // grpc-go's servers close on it (rustls refuses only a client that offered
                    // other protocols).
                    Ok(Ok(tls)) if !crate::http::tls::is_h2(tls.get_ref().1.alpn_protocol()) => {
                        tracing::debug!("TLS client without ALPN \"h2\" refused");
                    }
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(ServerIo::Tls(Box::new(tls)))).await;
                    }
                    Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A connection accepted by an HTTP/2 endpoint.
pub(crate) enum ServerIo {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

impl ServerIo {
    /// An accepted plaintext TCP connection, with Nagle's algorithm off, as the TLS ones and
    /// the client's: with it on, a small write that follows one not yet acknowledged (the next
    /// message of a stream) waited for the client's delayed ACK, some 40 ms. tonic sets it
    /// only on the connections its own listener accepts.
    fn tcp(tcp: tokio::net::TcpStream) -> ServerIo {
        let _ = tune_tcp(&tcp);
        ServerIo::Tcp(tcp)
    }
}

/// How long a TCP connection may stay silent before its kernel probes the peer, and how far
/// apart the probes go (the kernel gives up after its count of them, 9 on Linux): Go's
/// defaults, which grpc-go's clients and servers run with. A peer whose host went away (power,
/// a cable) is then found out in some minutes instead of never: its calls end UNAVAILABLE and
/// the connection's memory goes. gRPC's HTTP/2 keepalive PINGs stay off by default, as gRPC has
/// them.
const TCP_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// Nagle's algorithm off (see [`ServerIo::tcp`]) and TCP keepalive on ([`TCP_KEEPALIVE`]),
/// for every TCP connection, accepted or made.
fn tune_tcp(tcp: &tokio::net::TcpStream) -> std::io::Result<()> {
    tcp.set_nodelay(true)?;
    let keepalive = socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE).with_interval(TCP_KEEPALIVE);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive) {
        tracing::debug!("TCP keepalive not set: {e}"); // the connection serves all the same
    }
    Ok(())
}

/// Who is at the other end of an HTTP/2 connection: what tonic puts in each request's
/// extensions, and what [`PeerLayer`] hands on to handlers.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    /// gRPC's form of the peer's address: `ipv4:1.2.3.4:5`, `ipv6:%5B::1%5D:5` or `unix:`.
    pub(crate) addr: String,
    /// Whether the connection is TLS.
    pub(crate) tls: bool,
    /// The client's certificate (DER), under mutual TLS.
    pub(crate) cert: Option<bytes::Bytes>,
    /// What tonic's own server gives a service of the connection, for
    /// `Request::remote_addr` and `local_addr`, and a unix client's credentials.
    pub(crate) tonic: TonicInfo,
}

/// tonic's connection info for one transport, as its server would put it into each request's
/// extensions (a TLS connection's too: tonic's own `TlsConnectInfo` cannot be made outside it,
/// and `remote_addr` reads the TCP one as well).
#[derive(Debug, Clone)]
pub(crate) enum TonicInfo {
    Tcp(tonic::transport::server::TcpConnectInfo),
    Uds(tonic::transport::server::UdsConnectInfo),
}

fn grpc_addr(addr: Option<std::net::SocketAddr>) -> String {
    match addr {
        Some(std::net::SocketAddr::V4(a)) => format!("ipv4:{a}"),
        // A v4 client of a dual-stack socket shows as v4, as grpc shows it.
        Some(std::net::SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
            Some(v4) => format!("ipv4:{v4}:{}", a.port()),
            // grpc-core's URI form, brackets %-encoded, as grpcio's `peer()` shows it.
            None => format!("ipv6:%5B{}%5D:{}", a.ip(), a.port()),
        },
        None => "unknown".into(),
    }
}

impl tonic::transport::server::Connected for ServerIo {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        match self {
            ServerIo::Unix(s) => {
                PeerInfo { addr: "unix:".into(), tls: false, cert: None, tonic: TonicInfo::Uds(s.connect_info()) }
            }
            ServerIo::Tcp(s) => {
                let info = s.connect_info(); // the peer's address, asked of the socket once
                PeerInfo { addr: grpc_addr(info.remote_addr), tls: false, cert: None, tonic: TonicInfo::Tcp(info) }
            }
            ServerIo::Tls(s) => {
                let (tcp, session) = s.get_ref();
                let cert = session
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|leaf| bytes::Bytes::copy_from_slice(leaf.as_ref()));
                let info = tcp.connect_info();
                PeerInfo { addr: grpc_addr(info.remote_addr), tls: true, cert, tonic: TonicInfo::Tcp(info) }
            }
        }
    }
}

/// The headers that carry an HTTP/2 peer's address and certificate to the handlers behind the
/// loopback (ADR 0012). A client's own headers of these names are dropped on the way in.
pub(crate) const PEER_HEADER: &str = "x-isthmus-peer";
pub(crate) const PEER_CERT_HEADER: &str = "x-isthmus-peer-cert-bin";
pub(crate) const PEER_TLS_HEADER: &str = "x-isthmus-peer-tls";
/// The HTTP/2 client's `user-agent`, which gRPC keeps out of metadata but grpcio's and
/// grpc-go's servers show their handlers; the loopback would drop it as a protocol header, so
/// it goes on as an `shm://` client's agent does.
pub(crate) const PEER_AGENT_HEADER: &str = crate::engine::wire::AGENT_KEY;

/// The reply metadata that carries a handler's choice of compression for its replies
/// (`ServerCall::set_compression`: `gzip`, `deflate` or `identity`) to the bridge, which frames
/// them for the HTTP/2 client; sent on the bridge's calls only, and taken out by the bridge.
pub(crate) const REPLY_ENCODING_HEADER: &str = "x-isthmus-reply-encoding";

/// Puts the connection's [`PeerInfo`] into each request's headers, for handlers reached through
/// the loopback (whose `shm://` connection is the server's own), after removing any the client
/// sent; and tonic's connection info into its extensions, as tonic's server does, for tonic
/// services (`Request::remote_addr`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeerLayer;

impl<S> tower::Layer<S> for PeerLayer {
    type Service = PeerService<S>;

    fn layer(&self, inner: S) -> PeerService<S> {
        PeerService(inner)
    }
}

/// [`PeerLayer`]'s service.
#[derive(Debug, Clone)]
pub(crate) struct PeerService<S>(S);

impl<S, B> tower_service::Service<http::Request<B>> for PeerService<S>
where
    S: tower_service::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> S::Future {
        let peer = request.extensions().get::<PeerInfo>().cloned();
        match peer.as_ref().map(|p| &p.tonic) {
            Some(TonicInfo::Tcp(info)) => drop(request.extensions_mut().insert(info.clone())),
            Some(TonicInfo::Uds(info)) => drop(request.extensions_mut().insert(info.clone())),
            None => {}
        }
        let headers = request.headers_mut();
        headers.remove(PEER_HEADER);
        headers.remove(PEER_CERT_HEADER);
        headers.remove(PEER_TLS_HEADER);
        headers.remove(PEER_AGENT_HEADER);
        // Only what metadata may carry (printable ASCII): another agent would fail the call.
        let agent = headers.get(http::header::USER_AGENT);
        let agent = agent.filter(|a| crate::metadata::check_value(PEER_AGENT_HEADER, a.as_bytes()).is_ok()).cloned();
        if let Some(agent) = agent {
            headers.insert(PEER_AGENT_HEADER, agent);
        }
        if let Some(peer) = peer {
            if peer.tls {
                headers.insert(PEER_TLS_HEADER, http::HeaderValue::from_static("1"));
            }
            if let Ok(v) = http::HeaderValue::from_str(&peer.addr) {
                headers.insert(PEER_HEADER, v);
            }
            if let Some(cert) = peer.cert {
                let encoded = crate::http::codec::encode_base64(&cert);
                if let Ok(v) = http::HeaderValue::from_str(&encoded) {
                    headers.insert(PEER_CERT_HEADER, v);
                }
            }
        }
        self.0.call(request)
    }
}

/// Refuses an HTTP/2 request that is not a gRPC call before any service or handler sees it, as
/// grpc-go's server does and with its words: a method other than `POST` (HTTP 405, INTERNAL),
/// and a content type other than `application/grpc`, `application/grpc+…` or
/// `application/grpc;…` (HTTP 415, INVALID_ARGUMENT). The gRPC spec asks for the 415 so that no
/// other HTTP client takes the answer for a success; it also keeps a browser's cross-site form
/// `POST` (`text/plain`) from running a handler. tonic's server checks neither.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GrpcOnlyLayer;

impl<S> tower::Layer<S> for GrpcOnlyLayer {
    type Service = GrpcOnly<S>;

    fn layer(&self, inner: S) -> GrpcOnly<S> {
        GrpcOnly(inner)
    }
}

/// [`GrpcOnlyLayer`]'s service.
#[derive(Debug, Clone)]
pub(crate) struct GrpcOnly<S>(S);

impl<S, B> tower_service::Service<http::Request<B>> for GrpcOnly<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::Either<std::future::Ready<Responded<S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match not_grpc(&request) {
            Some(refusal) => futures_util::future::Either::Left(std::future::ready(Ok(refusal))),
            None => futures_util::future::Either::Right(self.0.call(request)),
        }
    }
}

/// The answer to a request that is not a gRPC call ([`GrpcOnlyLayer`]), or None for a call.
/// The content type is looked at first, as grpc-go does: a stray `GET` with none is 415.
fn not_grpc<B>(request: &http::Request<B>) -> Option<http::Response<tonic::body::Body>> {
    let content_type = request.headers().get(http::header::CONTENT_TYPE).map(|v| v.as_bytes()).unwrap_or_default();
    let (http_status, status) = if !is_grpc_content_type(content_type) {
        let words = format!("invalid gRPC request content-type {:?}", String::from_utf8_lossy(content_type));
        (http::StatusCode::UNSUPPORTED_MEDIA_TYPE, Status::new(Code::InvalidArgument, words))
    } else if request.method() != http::Method::POST {
        let words =
            format!("Received a HEADERS frame with :method {:?} which should be POST", request.method().as_str());
        (http::StatusCode::METHOD_NOT_ALLOWED, Status::new(Code::Internal, words))
    } else {
        return None;
    };
    let mut response = http::Response::new(tonic::body::Body::empty());
    *response.status_mut() = http_status;
    let headers = response.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    headers.extend(crate::http::codec::status_trailers(&status));
    Some(response)
}

/// `application/grpc`, or it followed by `+` (a codec) or `;` (parameters), as grpc-go reads it.
pub(crate) fn is_grpc_content_type(value: &[u8]) -> bool {
    match value.strip_prefix(b"application/grpc") {
        Some(rest) => rest.is_empty() || rest[0] == b'+' || rest[0] == b';',
        None => false,
    }
}

/// Gives tonic's refusal of a message over a service's limit gRPC's code on an HTTP/2 endpoint,
/// as the `shm://` bridge does ([`codec::too_large_code`](crate::http::codec::too_large_code)):
/// tonic says OUT_OF_RANGE where grpc-go and grpc-core say RESOURCE_EXHAUSTED. A trailers-only
/// response's headers are looked at here, a body's trailers as they pass. The handlers' answers
/// (through the loopback, marked `FromHandler`) pass as they are: their statuses are their own,
/// the same over every transport.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TooLargeLayer;

impl<S> tower::Layer<S> for TooLargeLayer {
    type Service = TooLarge<S>;

    fn layer(&self, inner: S) -> TooLarge<S> {
        TooLarge(inner)
    }
}

/// [`TooLargeLayer`]'s service.
#[derive(Debug, Clone)]
pub(crate) struct TooLarge<S>(S);

type Responded<E> = Result<http::Response<tonic::body::Body>, E>;

impl<S, B> tower_service::Service<http::Request<B>> for TooLarge<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures_util::future::Map<S::Future, fn(Responded<S::Error>) -> Responded<S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let code: fn(Responded<S::Error>) -> Responded<S::Error> = |r| r.map(too_large_code);
        futures_util::FutureExt::map(self.0.call(request), code)
    }
}

fn too_large_code(response: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    if response.extensions().get::<crate::http::tonic_client::FromHandler>().is_some() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    crate::http::codec::too_large_code_in(&mut parts.headers);
    http::Response::from_parts(parts, tonic::body::Body::new(TooLargeTrailers(body)))
}

/// A response body whose trailers go through [`codec::too_large_code_in`](crate::http::codec::too_large_code_in).
struct TooLargeTrailers(tonic::body::Body);

impl http_body::Body for TooLargeTrailers {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.0).poll_frame(cx).map_ok(|frame| match frame.into_trailers() {
            Ok(mut trailers) => {
                crate::http::codec::too_large_code_in(&mut trailers);
                http_body::Frame::trailers(trailers)
            }
            Err(frame) => frame,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// The stream under an HTTP/2 client connection, as hyper takes it.
pub(crate) type Io = hyper_util::rt::TokioIo<Tracked>;

/// Opening one such stream.
pub(crate) type Connecting = Pin<Box<dyn Future<Output = std::io::Result<Io>> + Send>>;

/// The largest header list (metadata, a status's message) an HTTP/2 server may send a client:
/// grpc-go's. hyper's 16 KiB failed a call whose status message was 20 KB INTERNAL ('h2
/// protocol error') where grpc-go's clients read it. (A server takes 1 MiB, its `:authority`
/// filter's bound.)
pub(crate) const MAX_HEADER_LIST: u32 = 16 << 20;

/// tonic's endpoint for an HTTP/2 target. Its URI's authority, which its calls send as
/// `:authority`, is `chosen` if the channel was given one (already [`checked_authority`]'s),
/// else `localhost` for a unix socket, as grpc-go and h2 expect, and the target's own for TCP
/// (`Target::Tcp`'s `authority`); the connector connects to the addresses either way.
pub(crate) fn http_endpoint(
    target: &Target,
    tls: bool,
    chosen: Option<&str>,
) -> Result<tonic::transport::Endpoint, Status> {
    let authority = match (target, chosen) {
        (Target::Shm(t), _) => return Err(Status::new(Code::Internal, format!("{t} is not an HTTP/2 target"))),
        (_, Some(chosen)) => chosen,
        (Target::Unix(_) | Target::UnixAbstract(_), None) => "localhost",
        (Target::Tcp { authority, .. }, None) => authority.as_str(),
    };
    let uri = format!("{}://{authority}", if tls { "https" } else { "http" });
    let endpoint =
        tonic::transport::Endpoint::from_shared(uri).map_err(|e| Status::new(Code::InvalidArgument, e.to_string()))?;
    Ok(endpoint.http2_max_header_list_size(MAX_HEADER_LIST))
}

/// The error for a `unix:` path a live server holds.
fn in_use(path: &std::path::Path) -> Status {
    Status::new(Code::AlreadyExists, format!("a server is already listening on {}", path.display()))
}

/// An authority a channel was given (grpcio's `grpc.default_authority`, grpc-go's
/// `WithAuthority`), as a URI takes it: `host[:port]`, a bare IPv6 literal bracketed; no user
/// part, path or spaces (INVALID_ARGUMENT).
pub(crate) fn checked_authority(given: &str) -> Result<String, Status> {
    let authority = as_authority(given);
    let (host, port) = split_host_port(&authority);
    // A target's rules for its host and port (`host_port`), and stricter ones where a target's
    // address would fail later, at connect, but an authority would go out as it is: a bracketed
    // host is an IPv6 address, and a port is digits only (`u16`'s parser takes a leading `+`,
    // and so does the URI's). Then what the URI's own parser refuses besides (control bytes,
    // `%` not followed by hex…).
    let ok = host_port(&authority, 0).is_ok()
        && (!authority.starts_with('[') || host.parse::<std::net::Ipv6Addr>().is_ok())
        && port.is_none_or(|p| p.bytes().all(|b| b.is_ascii_digit()))
        && authority.parse::<http::uri::Authority>().is_ok();
    match ok {
        true => Ok(authority),
        false => Err(Status::new(Code::InvalidArgument, format!("authority {given:?} is not HOST[:PORT]"))),
    }
}

/// The host of an authority (`checked_authority`'s), without its port or an IPv6 literal's
/// brackets: what TLS checks the server's certificate against when the channel names one.
pub(crate) fn authority_host(authority: &str) -> &str {
    split_host_port(authority).0
}

/// What opens the stream under a channel's HTTP/2 connection.
pub(crate) trait MakeIo:
    tower_service::Service<http::Uri, Response = Io, Error = std::io::Error, Future = Connecting> + Clone + Send + 'static
{
}

impl<T> MakeIo for T where
    T: tower_service::Service<http::Uri, Response = Io, Error = std::io::Error, Future = Connecting>
        + Clone
        + Send
        + 'static
{
}

/// How long a channel's connection may take to come up (gRPC's `MIN_CONNECT_TIMEOUT`, grpc-go's
/// `ConnectParams.MinConnectTimeout`): its connect and TLS handshake, and then the server's
/// SETTINGS, the frame an HTTP/2 server sends first.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Opens the stream under an HTTP/2 connection: the unix socket, or TCP to the first address
/// that answers, with TLS over it if `tls` is given; within `timeout` (unless it is longer than
/// the clock can say), or the attempt fails (`TimedOut`), as grpc-go's does after its connect
/// timeout, and the calls waiting on it fail UNAVAILABLE instead of waiting for a host that
/// drops packets or a server that never answers. The channel is READY once the server's first
/// frame arrives ([`Tracked`]).
pub(crate) fn connector(
    target: &Target,
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    peer: HttpPeer,
    connectivity: Arc<Tracker>,
    timeout: std::time::Duration,
) -> impl MakeIo {
    let target = target.clone();
    tower::service_fn(move |_: http::Uri| {
        let (target, tls, peer, connectivity) = (target.clone(), tls.clone(), peer.clone(), connectivity.clone());
        connectivity.connecting();
        Box::pin(async move {
            // A timeout too long for the clock (a caller's "forever") bounds nothing.
            let deadline = tokio::time::Instant::now().checked_add(timeout);
            let opening = open(target, tls, peer, deadline);
            let opened = match deadline {
                Some(d) => tokio::time::timeout_at(d, opening)
                    .await
                    .unwrap_or_else(|_| Err(past_connect_timeout("no connection", timeout))),
                None => opening.await,
            };
            match opened {
                Ok(io) => {
                    let waiting = Some(Waiting::new(deadline, timeout, connectivity));
                    Ok(hyper_util::rt::TokioIo::new(Tracked { io, waiting, _live: None }))
                }
                Err(e) => {
                    connectivity.failed();
                    Err(e)
                }
            }
        }) as Connecting
    })
}

/// Opens the stream under one HTTP/2 connection, by `deadline` (the connect timeout's end) if
/// there is one.
async fn open(
    target: Target,
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    peer: HttpPeer,
    deadline: Option<tokio::time::Instant>,
) -> std::io::Result<HttpIo> {
    // Who is at the other end: the upgrade checks an offer against it.
    let unix = |s: tokio::net::UnixStream| {
        let pid = s.peer_cred().ok().and_then(|c| c.pid()).and_then(|p| u32::try_from(p).ok());
        peer.record(Ends::Unix(pid.filter(|&p| p != 0)));
        HttpIo::Unix(s)
    };
    let stream = match target {
        Target::Unix(path) => unix(tokio::net::UnixStream::connect(path).await?),
        Target::UnixAbstract(name) => {
            // Without waiting, as tokio connects a path: a full backlog fails at once (a
            // blocking connect would hold this runtime's thread while it lasted).
            let std = isthmus_shm::connect_unix_abstract(&name, None)?;
            unix(tokio::net::UnixStream::from_std(std)?)
        }
        Target::Tcp { addrs, .. } => {
            let began = tokio::time::Instant::now();
            let tcp = connect_first(&addrs).await?;
            // A round trip at least (with name lookups and addresses that refused first, more): a
            // TLS 1.3 server's alert comes one after the handshake.
            let round_trip = began.elapsed();
            tune_tcp(&tcp)?;
            if let (Ok(local), Ok(remote)) = (tcp.local_addr(), tcp.peer_addr()) {
                peer.record(Ends::Tcp { local, peer: remote });
            }
            match tls {
                Some((config, name)) => {
                    // TLS's look for the server's first bytes (where a refusal of the client's
                    // certificate is read in words) takes half of what is left, so that a server
                    // that speaks only after the client's preface is still reached; but at least
                    // a few round trips, within what is left (and `tls::FIRST_READ`).
                    let left = deadline.map(|d| {
                        let left = d.saturating_duration_since(tokio::time::Instant::now());
                        (left / 2).max(round_trip.saturating_mul(4)).min(left)
                    });
                    HttpIo::Tls(Box::new(tls::connect(&config, name, tcp, left).await?))
                }
                None => HttpIo::Tcp(tcp),
            }
        }
        Target::Shm(_) => return Err(std::io::Error::other("not an HTTP/2 target")),
    };
    Ok(stream)
}

/// A client connection's stream, which holds its channel READY, from the server's first frame
/// (its SETTINGS) until hyper drops it when the connection ends: a call that waits for READY
/// is then not sent on a connection nobody answers. Until that frame, a read fails `TimedOut`
/// once the connect timeout has passed: a server that accepts and says nothing ends the
/// connection, and its calls, as in grpc-go, instead of holding them for ever; and the
/// channel's attempt counts as failed (TRANSIENT_FAILURE).
#[derive(Debug)]
pub(crate) struct Tracked {
    io: HttpIo,
    /// Until the server's first frame, if it is a SETTINGS.
    waiting: Option<Waiting>,
    _live: Option<Live>,
}

/// A connection waiting for its server's first frame.
#[derive(Debug)]
struct Waiting {
    /// The connect timeout's end (none for a timeout the clock cannot say).
    silent: Option<Pin<Box<tokio::time::Sleep>>>,
    timeout: std::time::Duration,
    tracker: Arc<Tracker>,
    /// The first frame's header as far as it has come (its type is the fourth byte).
    head: [u8; 4],
    seen: usize,
}

/// The error of a connection that did not come up within the connect timeout: `what` did not
/// happen within it.
fn past_connect_timeout(what: &str, timeout: std::time::Duration) -> std::io::Error {
    let words = format!("{what} within the connect timeout ({timeout:?})");
    std::io::Error::new(std::io::ErrorKind::TimedOut, super::tls::Worded(words))
}

impl Waiting {
    /// Waiting for the first frame until `deadline`, if there is one.
    fn new(deadline: Option<tokio::time::Instant>, timeout: std::time::Duration, tracker: Arc<Tracker>) -> Waiting {
        let silent = deadline.map(|d| Box::pin(tokio::time::sleep_until(d)));
        Waiting { silent, timeout, tracker, head: [0; 4], seen: 0 }
    }

    /// Takes the server's next bytes: `true` once they show a SETTINGS frame first, as an HTTP/2
    /// server's preface begins. Anything else never makes the channel READY: h2 fails the
    /// connection where it refuses the frame (an HTTP/1 server's answer reads as one too long),
    /// the connect timeout ends it otherwise (none with no bound), and its attempt counts as
    /// failed.
    fn took(&mut self, bytes: &[u8]) -> bool {
        let n = bytes.len().min(self.head.len() - self.seen);
        self.head[self.seen..self.seen + n].copy_from_slice(&bytes[..n]);
        self.seen += n;
        const SETTINGS: u8 = 4;
        self.seen == self.head.len() && self.head[3] == SETTINGS
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(waiting) = self.waiting.take() {
            waiting.tracker.ended_unready();
        }
    }
}

impl tokio::io::AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(waiting) = &mut this.waiting {
            match read {
                Poll::Ready(Ok(())) if buf.filled().len() > before && waiting.took(&buf.filled()[before..]) => {
                    this._live = Some(waiting.tracker.connected());
                    this.waiting = None;
                }
                Poll::Pending if waiting.silent.as_mut().is_some_and(|s| s.as_mut().poll(cx).is_ready()) => {
                    return Poll::Ready(Err(past_connect_timeout("the server sent nothing", waiting.timeout)))
                }
                _ => {}
            }
        }
        read
    }
}

/// TCP to the first of `addrs` that answers (each may name several addresses).
async fn connect_first(addrs: &[String]) -> std::io::Result<tokio::net::TcpStream> {
    let mut last = std::io::Error::other("no address to connect to");
    for addr in addrs {
        match tokio::net::TcpStream::connect(addr.as_str()).await {
            Ok(tcp) => return Ok(tcp),
            Err(e) => last = std::io::Error::new(e.kind(), format!("{addr}: {e}")),
        }
    }
    Err(last)
}

/// A unix, TCP or TLS stream under an HTTP/2 client connection.
#[derive(Debug)]
pub(crate) enum HttpIo {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
    Tls(Box<tls::ClientTls>),
}

/// `AsyncRead` and `AsyncWrite` for an enum of streams, each call passed to the variant's; or
/// `AsyncWrite` for a struct around a stream, each call passed to that field's.
macro_rules! delegate_io {
    (write $ty:ident . $field:ident) => {
        impl tokio::io::AsyncWrite for $ty {
            fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
                Pin::new(&mut self.get_mut().$field).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> Poll<std::io::Result<usize>> {
                Pin::new(&mut self.get_mut().$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.$field.is_write_vectored()
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Pin::new(&mut self.get_mut().$field).poll_flush(cx)
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Pin::new(&mut self.get_mut().$field).poll_shutdown(cx)
            }
        }
    };
    ($ty:ident { $($variant:ident),+ }) => {
        impl tokio::io::AsyncRead for $ty {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut tokio::io::ReadBuf<'_>,
            ) -> Poll<std::io::Result<()>> {
                match self.get_mut() { $($ty::$variant(s) => Pin::new(s).poll_read(cx, buf),)+ }
            }
        }

        impl tokio::io::AsyncWrite for $ty {
            fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
                match self.get_mut() { $($ty::$variant(s) => Pin::new(s).poll_write(cx, buf),)+ }
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> Poll<std::io::Result<usize>> {
                match self.get_mut() { $($ty::$variant(s) => Pin::new(s).poll_write_vectored(cx, bufs),)+ }
            }

            fn is_write_vectored(&self) -> bool {
                match self { $($ty::$variant(s) => s.is_write_vectored(),)+ }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                match self.get_mut() { $($ty::$variant(s) => Pin::new(s).poll_flush(cx),)+ }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                match self.get_mut() { $($ty::$variant(s) => Pin::new(s).poll_shutdown(cx),)+ }
            }
        }
    };
}

delegate_io!(HttpIo { Unix, Tcp, Tls });
delegate_io!(ServerIo { Unix, Tcp, Tls });
delegate_io!(write Tracked.io);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_settings_frame_first_counts_as_an_http2_server_in_whatever_pieces_it_comes() {
        let waiting = || Waiting::new(None, std::time::Duration::ZERO, Arc::default());
        // An empty SETTINGS frame's header, then its flags and stream: whole, and byte by byte.
        let settings = [0u8, 0, 0, 4, 0, 0, 0, 0, 0];
        assert!(waiting().took(&settings));
        let mut w = waiting();
        let taken: Vec<bool> = settings[..4].iter().map(|b| w.took(std::slice::from_ref(b))).collect();
        assert_eq!(taken, [false, false, false, true]);
        // An HTTP/1 answer, a PING first, and too few bytes are not.
        assert!(!waiting().took(b"HTTP/1.1 400 Bad Request\r\n"));
        assert!(!waiting().took(&[0, 0, 8, 6, 0, 0, 0, 0, 0]));
        assert!(!waiting().took(&[0, 0, 0]));
    }

    #[tokio::test]
    async fn an_accepted_plaintext_connection_has_nagles_algorithm_off() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr")).await.expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        assert!(!accepted.nodelay().expect("nodelay"), "the kernel's default");
        let ServerIo::Tcp(served) = ServerIo::tcp(accepted) else { panic!("not TCP") };
        assert!(served.nodelay().expect("nodelay"));
        drop(client);
    }

    #[test]
    fn grpc_content_types_are_grpc_gos() {
        for ok in
            ["application/grpc", "application/grpc+proto", "application/grpc+json", "application/grpc;charset=utf-8"]
        {
            assert!(is_grpc_content_type(ok.as_bytes()), "{ok}");
        }
        for not in
            ["", "text/plain", "application/grpcx", "application/grpc-web", "Application/grpc", "application/json"]
        {
            assert!(!is_grpc_content_type(not.as_bytes()), "{not}");
        }
    }

    #[test]
    fn a_socket_file_is_removed_only_while_it_is_still_the_one_bound() {
        let path = std::env::temp_dir().join(format!("isthmus-socketfile-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let first = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        drop(SocketFile::bound(path.clone()).expect("bound"));
        assert!(!path.exists(), "our own socket file is removed");
        drop(first);

        let first = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        let file = SocketFile::bound(path.clone()).expect("bound");
        // A successor replaced the file (as `bind` does over a dead server's socket).
        std::fs::remove_file(&path).expect("remove");
        let successor = std::os::unix::net::UnixListener::bind(&path).expect("bind again");
        drop(file);
        assert!(path.exists(), "a successor's socket file stays");
        drop((first, successor));
        std::fs::remove_file(&path).expect("clean up");
    }

    #[test]
    fn a_tcp_port_is_shared_only_by_listeners_that_all_reuse_it() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let _context = runtime.enter();
        let tcp = |addr: String| Target::Tcp { addrs: vec![addr.clone()], tls: None, authority: addr };
        let first = HttpListener::bind(&tcp("127.0.0.1:0".into()), None, true).expect("bind");
        let HttpListener::Tcp(listener, _) = &first else { panic!("a TCP listener") };
        let port = listener.local_addr().expect("address").port();
        let at = tcp(format!("127.0.0.1:{port}"));
        let second = HttpListener::bind(&at, None, true).expect("a second listener that reuses the port");
        let refused = HttpListener::bind(&at, None, false).err().expect("one that does not is refused");
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
        drop((first, second));
        // Without the option on the first, the port is its own.
        let plain = HttpListener::bind(&tcp("127.0.0.1:0".into()), None, false).expect("bind");
        let HttpListener::Tcp(listener, _) = &plain else { panic!("a TCP listener") };
        let port = listener.local_addr().expect("address").port();
        assert!(HttpListener::bind(&tcp(format!("127.0.0.1:{port}")), None, true).is_err());
    }

    #[test]
    fn targets_parse_in_grpcs_forms() {
        // The authority is the host as written: a default port is for connecting only.
        let tcp = |a: &[&str], tls: Option<bool>, authority: &str| Target::Tcp {
            addrs: a.iter().map(|s| (*s).to_owned()).collect(),
            tls,
            authority: authority.to_owned(),
        };
        let cases = [
            ("shm://a", Target::Shm("shm://a".into())),
            ("unix:///run/a.sock", Target::Unix("/run/a.sock".into())),
            ("unix:/run/a.sock", Target::Unix("/run/a.sock".into())),
            ("unix:a.sock", Target::Unix("a.sock".into())),
            ("unix-abstract:a b", Target::UnixAbstract(b"a b".to_vec())),
            ("http://127.0.0.1:50051", tcp(&["127.0.0.1:50051"], Some(false), "127.0.0.1:50051")),
            ("http://h", tcp(&["h:80"], Some(false), "h")),
            ("https://h", tcp(&["h:443"], Some(true), "h")),
            ("https://h:443", tcp(&["h:443"], Some(true), "h:443")),
            ("https://[::1]:8443/", tcp(&["[::1]:8443"], Some(true), "[::1]:8443")),
            ("localhost:50051", tcp(&["localhost:50051"], None, "localhost:50051")),
            ("localhost", tcp(&["localhost:443"], None, "localhost")),
            ("::1", tcp(&["[::1]:443"], None, "[::1]")),
            ("[::]:0", tcp(&["[::]:0"], None, "[::]:0")),
            ("0.0.0.0:7", tcp(&["0.0.0.0:7"], None, "0.0.0.0:7")),
            ("dns:h:1", tcp(&["h:1"], None, "h:1")),
            ("dns:///h:1", tcp(&["h:1"], None, "h:1")),
            ("dns:///h", tcp(&["h:443"], None, "h")),
            ("dns://8.8.8.8/h:1", tcp(&["h:1"], None, "h:1")),
            ("ipv4:1.2.3.4:5,6.7.8.9", tcp(&["1.2.3.4:5", "6.7.8.9:443"], None, "1.2.3.4:5")),
            ("ipv4:6.7.8.9", tcp(&["6.7.8.9:443"], None, "6.7.8.9")),
            ("ipv6:[::1]:5", tcp(&["[::1]:5"], None, "[::1]:5")),
            ("ipv6:::1", tcp(&["[::1]:443"], None, "[::1]")),
        ];
        for (text, want) in cases {
            assert_eq!(Target::parse(text).unwrap_or_else(|e| panic!("{text}: {e:?}")), want, "{text}");
        }
        assert_eq!(Target::parse("https://[::1]:8443").expect("v6").host(), "::1");
        assert_eq!(Target::parse("h.example:1").expect("dns").host(), "h.example");
        for bad in [
            "",
            "tcp://x:1",
            "unix:",
            "unix://rel.sock",
            "unix-abstract:",
            "http://",
            "http://h:1/path",
            "h:port",
            "h:99999",
        ] {
            assert_eq!(Target::parse(bad).expect_err(bad).code(), Code::InvalidArgument, "{bad}");
        }
        for bad in ["ipv4:::1", "ipv6:1.2.3.4", "ipv4:1.2.3.4:5,", "dns://resolver"] {
            assert_eq!(Target::parse(bad).expect_err(bad).code(), Code::InvalidArgument, "{bad}");
        }
    }
}
