//! Where a server listens and a channel connects: `shm://` (isthmus), or `unix://` and `http://`
//! (standard gRPC over HTTP/2, for any gRPC client and for peers on other machines).
//!
//! `Target::parse`: `shm://NAME` and `shm:///path.sock`; `unix:///abs/path.sock`,
//! `unix:/abs/path.sock` and `unix:relative.sock` (gRPC's forms); `http://host:port` with no path.
//! Any other scheme, or a form without its path or host, is INVALID_ARGUMENT. `https://` is not
//! supported yet, and nothing configures TLS.
//!
//! `HttpListener::bind`: for `unix://`, if a connect to the path succeeds a server is there and the
//! bind fails ALREADY_EXISTS (an `shm://` bind says UNAVAILABLE then); otherwise whatever is at the
//! path is removed and the path bound. For `http://`, a TCP bind; port 0 lets the system choose.
//! Other failures are UNAVAILABLE. The socket gets the process's umask: these endpoints have none
//! of `shm://`'s checks (no peer credentials or `PeerPolicy`, no private directory, no TLS or
//! authentication on TCP).
//!
//! `HttpListener::serve` runs tonic's HTTP/2 server with tonic's defaults over the server's
//! `Routes` (the tonic services, health and reflection, and the loopback `Channel` as fallback),
//! every accepted connection read through the `:authority` filter. On the stop signal tonic stops
//! accepting and drains (GOAWAY, calls in progress finish), then the unix socket file is removed.
//! `grace` bounds this drain and the `shm://` one together.
//!
//! `http_endpoint` and `connector` make a channel's tonic `Endpoint` and open its stream
//! (`HttpIo`): a unix stream, or TCP with `TCP_NODELAY`. The URI's authority is `localhost` for a
//! unix socket, as grpc-go and h2 expect, and `host:port` for TCP.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::status::{Code, Status};

/// One parsed target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `shm://NAME` or `shm:///path.sock`.
    Shm(String),
    /// `unix:///abs/path.sock`, `unix:/abs/path.sock` or `unix:relative.sock` (gRPC's forms).
    Unix(PathBuf),
    /// `http://host:port`.
    Http(String),
}

impl Target {
    pub(crate) fn parse(target: &str) -> Result<Target, Status> {
        let bad = |why: &str| Status::new(Code::InvalidArgument, format!("target {target:?}: {why}"));
        if target.starts_with("shm://") {
            return Ok(Target::Shm(target.to_owned()));
        }
        if let Some(rest) = target.strip_prefix("unix:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(bad("no socket path"));
            }
            return Ok(Target::Unix(PathBuf::from(path)));
        }
        if let Some(rest) = target.strip_prefix("http://") {
            let host = rest.trim_end_matches('/');
            if host.is_empty() || host.contains('/') {
                return Err(bad("expected http://host:port"));
            }
            return Ok(Target::Http(host.to_owned()));
        }
        Err(bad("the scheme must be shm://, unix:// or http://"))
    }
}

/// A bound HTTP/2 listener.
pub(crate) enum HttpListener {
    Unix(tokio::net::UnixListener, PathBuf),
    Tcp(tokio::net::TcpListener),
}

impl HttpListener {
    /// Binds `target` now (inside a tokio runtime). A unix socket left by a dead server is
    /// replaced; one that answers is not.
    pub(crate) fn bind(target: &Target) -> Result<HttpListener, Status> {
        let unavailable = |what: String| Status::new(Code::Unavailable, what);
        match target {
            Target::Unix(path) => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(Status::new(
                        Code::AlreadyExists,
                        format!("a server is already listening on {}", path.display()),
                    ));
                }
                // Only a socket left by a dead server is replaced; any other file stays, and the
                // bind below reports it.
                use std::os::unix::fs::FileTypeExt;
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                    let _ = std::fs::remove_file(path);
                }
                let std = std::os::unix::net::UnixListener::bind(path)
                    .map_err(|e| unavailable(format!("cannot bind {}: {e}", path.display())))?;
                std.set_nonblocking(true).map_err(|e| unavailable(e.to_string()))?;
                let l = tokio::net::UnixListener::from_std(std).map_err(|e| unavailable(e.to_string()))?;
                Ok(HttpListener::Unix(l, path.clone()))
            }
            Target::Http(host) => {
                let std = std::net::TcpListener::bind(host.as_str())
                    .map_err(|e| unavailable(format!("cannot bind {host}: {e}")))?;
                std.set_nonblocking(true).map_err(|e| unavailable(e.to_string()))?;
                let l = tokio::net::TcpListener::from_std(std).map_err(|e| unavailable(e.to_string()))?;
                Ok(HttpListener::Tcp(l))
            }
            Target::Shm(_) => Err(Status::new(Code::Internal, "an shm:// target is not an HTTP listener")),
        }
    }

    /// The address clients reach: the socket path, or the TCP address with its real port.
    pub(crate) fn local_addr(&self) -> String {
        match self {
            HttpListener::Unix(_, path) => format!("unix://{}", path.display()),
            HttpListener::Tcp(l) => l.local_addr().map_or_else(|_| "http://?".into(), |a| format!("http://{a}")),
        }
    }

    /// Serves `routes` with tonic's HTTP/2 server until `stop` completes; calls in progress
    /// then finish (tonic's graceful shutdown).
    pub(crate) async fn serve(
        self,
        routes: tonic::service::Routes,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), Status> {
        let server =
            tonic::transport::Server::builder().layer(crate::http::authority::DeadlineLayer).add_routes(routes);
        let failed =
            |e: tonic::transport::Error| Status::new(Code::Unavailable, format!("HTTP/2 endpoint failed: {e}"));
        match self {
            HttpListener::Unix(l, path) => {
                // grpc-core clients name the socket as the `:authority`; see `authority.rs`.
                let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnixListenerStream::new(l), |s| {
                    s.map(crate::http::authority::AuthorityFix::new)
                });
                let r = server.serve_with_incoming_shutdown(incoming, stop).await.map_err(failed);
                let _ = std::fs::remove_file(path);
                r
            }
            HttpListener::Tcp(l) => {
                let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(l), |s| {
                    s.map(crate::http::authority::AuthorityFix::new)
                });
                server.serve_with_incoming_shutdown(incoming, stop).await.map_err(failed)
            }
        }
    }
}

/// The stream under an HTTP/2 client connection, as hyper takes it.
pub(crate) type Io = hyper_util::rt::TokioIo<HttpIo>;

/// Opening one such stream.
pub(crate) type Connecting = Pin<Box<dyn Future<Output = std::io::Result<Io>> + Send>>;

/// tonic's endpoint for a `unix://` or `http://` target.
pub(crate) fn http_endpoint(target: &Target) -> Result<tonic::transport::Endpoint, Status> {
    let uri = match target {
        // The authority of a unix socket is `localhost`, as grpc-go and h2 expect.
        Target::Unix(_) => "http://localhost".to_owned(),
        Target::Http(host) => format!("http://{host}"),
        Target::Shm(t) => return Err(Status::new(Code::Internal, format!("{t} is not an HTTP/2 target"))),
    };
    tonic::transport::Endpoint::from_shared(uri).map_err(|e| Status::new(Code::InvalidArgument, e.to_string()))
}

/// Opens the stream under an HTTP/2 connection: the unix socket, or TCP to the host.
pub(crate) fn connector(
    target: &Target,
) -> impl tower_service::Service<http::Uri, Response = Io, Error = std::io::Error, Future = Connecting>
       + Clone
       + Send
       + 'static {
    let target = target.clone();
    tower::service_fn(move |_: http::Uri| {
        let target = target.clone();
        Box::pin(async move {
            let stream = match target {
                Target::Unix(path) => HttpIo::Unix(tokio::net::UnixStream::connect(path).await?),
                Target::Http(host) => {
                    let tcp = tokio::net::TcpStream::connect(host.as_str()).await?;
                    tcp.set_nodelay(true)?;
                    HttpIo::Tcp(tcp)
                }
                Target::Shm(_) => return Err(std::io::Error::other("not an HTTP/2 target")),
            };
            Ok(hyper_util::rt::TokioIo::new(stream))
        }) as Connecting
    })
}

/// A unix or TCP stream under an HTTP/2 connection.
#[derive(Debug)]
pub(crate) enum HttpIo {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

impl tokio::io::AsyncRead for HttpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpIo::Unix(s) => Pin::new(s).poll_read(cx, buf),
            HttpIo::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for HttpIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            HttpIo::Unix(s) => Pin::new(s).poll_write(cx, buf),
            HttpIo::Tcp(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpIo::Unix(s) => Pin::new(s).poll_flush(cx),
            HttpIo::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            HttpIo::Unix(s) => Pin::new(s).poll_shutdown(cx),
            HttpIo::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_in_grpcs_forms() {
        assert_eq!(Target::parse("shm://a").expect("shm"), Target::Shm("shm://a".into()));
        assert_eq!(Target::parse("unix:///run/a.sock").expect("unix"), Target::Unix("/run/a.sock".into()));
        assert_eq!(Target::parse("unix:/run/a.sock").expect("unix"), Target::Unix("/run/a.sock".into()));
        assert_eq!(Target::parse("unix:a.sock").expect("unix"), Target::Unix("a.sock".into()));
        assert_eq!(Target::parse("http://127.0.0.1:50051").expect("http"), Target::Http("127.0.0.1:50051".into()));
        for bad in ["", "tcp://x:1", "unix:", "http://", "http://h:1/path"] {
            assert_eq!(Target::parse(bad).expect_err(bad).code(), Code::InvalidArgument, "{bad}");
        }
    }
}
