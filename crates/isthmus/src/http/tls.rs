//! TLS on TCP endpoints: rustls with the ring provider (no OpenSSL, nothing to build but Rust
//! and ring's C), HTTP/2 agreed by ALPN as gRPC requires.
//!
//! A client trusts the system's roots (`rustls-native-certs`) unless it is given its own CA
//! certificates, checks the server's name against the target's host (or `domain_name`), and
//! presents a client certificate if given an [`Identity`]. A server presents its [`Identity`]
//! and, given a client CA, asks for a client certificate: required unless
//! `client_auth_optional`. Certificates and keys are PEM, as tonic and grpcio take them.
//!
//! A failed handshake is UNAVAILABLE on the calls that needed it, and the message says why in
//! words (`describe`): an unknown CA, a name the certificate does not cover, an expired
//! certificate, a client certificate the server requires and did not get. Under TLS 1.3 the
//! last is known to the client only after its side of the handshake is done, when it reads the
//! server's alert: `ClientTls` turns that read error into the same words.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::status::{Code, Status};

fn invalid(what: String) -> Status {
    Status::new(Code::InvalidArgument, what)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// One or more X.509 certificates (a CA bundle, say), from PEM.
#[derive(Debug, Clone)]
pub struct Certificate {
    ders: Vec<CertificateDer<'static>>,
}

impl Certificate {
    /// Every `CERTIFICATE` block of `pem`. INVALID_ARGUMENT if there is none or one does not
    /// decode.
    pub fn from_pem(pem: impl AsRef<[u8]>) -> Result<Certificate, Status> {
        let ders = CertificateDer::pem_slice_iter(pem.as_ref())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("a PEM certificate does not decode: {e}")))?;
        if ders.is_empty() {
            return Err(invalid("no PEM CERTIFICATE block found".into()));
        }
        Ok(Certificate { ders })
    }
}

/// A certificate chain and its private key, from PEM: what a server (or an mTLS client)
/// presents.
#[derive(Debug)]
pub struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Identity {
        Identity { chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl Identity {
    /// The chain (leaf first) and the private key (PKCS#8, PKCS#1 or SEC1). INVALID_ARGUMENT
    /// if either does not decode.
    pub fn from_pem(cert_chain: impl AsRef<[u8]>, key: impl AsRef<[u8]>) -> Result<Identity, Status> {
        let chain = Certificate::from_pem(cert_chain)?.ders;
        let key = PrivateKeyDer::from_pem_slice(key.as_ref())
            .map_err(|e| invalid(format!("the PEM private key does not decode: {e}")))?;
        Ok(Identity { chain, key })
    }
}

/// A client's TLS settings, tonic's shape: `ClientTlsConfig::new().ca_certificate(ca)`.
#[derive(Debug, Clone, Default)]
pub struct ClientTlsConfig {
    roots: Vec<CertificateDer<'static>>,
    identity: Option<Identity>,
    domain: Option<String>,
}

impl ClientTlsConfig {
    /// Trusts the system's roots, checks the target's host name, presents no certificate.
    pub fn new() -> ClientTlsConfig {
        ClientTlsConfig::default()
    }

    /// Trusts these CA certificates instead of the system's (may be called more than once).
    pub fn ca_certificate(mut self, ca: Certificate) -> ClientTlsConfig {
        self.roots.extend(ca.ders);
        self
    }

    /// Presents this certificate to servers that ask for one (mutual TLS).
    pub fn identity(mut self, identity: Identity) -> ClientTlsConfig {
        self.identity = Some(identity);
        self
    }

    /// Checks the server's certificate against this name instead of the target's host
    /// (grpc's `grpc.ssl_target_name_override`).
    pub fn domain_name(mut self, domain: impl Into<String>) -> ClientTlsConfig {
        self.domain = Some(domain.into());
        self
    }

    /// The name the server's certificate must cover, for a target whose host is `host`.
    pub(crate) fn server_name(&self, host: &str) -> Result<ServerName<'static>, Status> {
        let name = self.domain.as_deref().unwrap_or(host);
        ServerName::try_from(name.to_owned()).map_err(|_| invalid(format!("{name:?} is not a valid TLS server name")))
    }

    /// rustls's configuration, with ALPN `h2`.
    pub(crate) fn rustls(&self) -> Result<Arc<rustls::ClientConfig>, Status> {
        let roots = if self.roots.is_empty() {
            let roots = system_roots();
            if roots.is_empty() {
                return Err(Status::new(
                    Code::FailedPrecondition,
                    "no system CA certificates found: give the channel its CA certificate",
                ));
            }
            roots
        } else {
            let mut roots = rustls::RootCertStore::empty();
            for der in &self.roots {
                roots.add(der.clone()).map_err(|e| invalid(format!("a CA certificate is not usable: {e}")))?;
            }
            Arc::new(roots)
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Status::new(Code::Internal, e.to_string()))?
            .with_root_certificates(roots);
        let mut config = match &self.identity {
            Some(id) => builder
                .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
                .map_err(|e| invalid(format!("the client certificate or key is not usable: {e}")))?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The system's CA certificates, read and parsed once per process: reading them (a directory
/// of PEM files, ~150 certificates on Debian) took milliseconds, for every channel to an
/// `https://` target. Certificates the system gains later reach processes started later, as
/// with grpc-go's and OpenSSL's cached system pools; but a process that found none (before its
/// system's CA package was installed, say) looks again for its next channel.
fn system_roots() -> Arc<rustls::RootCertStore> {
    static ROOTS: std::sync::Mutex<Option<Arc<rustls::RootCertStore>>> = std::sync::Mutex::new(None);
    let mut cached = ROOTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(roots) = cached.as_ref() {
        return roots.clone();
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let roots = Arc::new(roots);
    if !roots.is_empty() {
        *cached = Some(roots.clone());
    }
    roots
}

/// A server's TLS settings, tonic's shape: `ServerTlsConfig::new().identity(id)`.
#[derive(Debug, Clone, Default)]
pub struct ServerTlsConfig {
    identity: Option<Identity>,
    client_roots: Vec<CertificateDer<'static>>,
    client_auth_optional: bool,
}

impl ServerTlsConfig {
    /// Settings with no identity yet: [`identity`](Self::identity) is required.
    pub fn new() -> ServerTlsConfig {
        ServerTlsConfig::default()
    }

    /// The certificate chain and key the server presents.
    pub fn identity(mut self, identity: Identity) -> ServerTlsConfig {
        self.identity = Some(identity);
        self
    }

    /// Asks clients for a certificate signed by this CA (mutual TLS); required unless
    /// [`client_auth_optional`](Self::client_auth_optional).
    pub fn client_ca_root(mut self, ca: Certificate) -> ServerTlsConfig {
        self.client_roots.extend(ca.ders);
        self
    }

    /// With a client CA: lets clients without a certificate in (one they send is still
    /// checked). grpcio's `require_client_auth=False`.
    pub fn client_auth_optional(mut self, optional: bool) -> ServerTlsConfig {
        self.client_auth_optional = optional;
        self
    }

    /// rustls's configuration, with ALPN `h2`.
    pub(crate) fn rustls(&self) -> Result<Arc<rustls::ServerConfig>, Status> {
        let id = self.identity.as_ref().ok_or_else(|| invalid("a TLS server needs an identity".into()))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| Status::new(Code::Internal, e.to_string()))?;
        let builder = if self.client_roots.is_empty() {
            builder.with_no_client_auth()
        } else {
            let mut roots = rustls::RootCertStore::empty();
            for der in &self.client_roots {
                roots.add(der.clone()).map_err(|e| invalid(format!("a client CA certificate is not usable: {e}")))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let verifier = if self.client_auth_optional { verifier.allow_unauthenticated() } else { verifier };
            builder.with_client_cert_verifier(
                verifier.build().map_err(|e| invalid(format!("the client CA is not usable: {e}")))?,
            )
        };
        let mut config = builder
            .with_single_cert(id.chain.clone(), id.key.clone_key())
            .map_err(|e| invalid(format!("the server certificate or key is not usable: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Says in words why a TLS handshake failed, if a rustls error (or one already put in words,
/// [`Worded`]: the connect timeout's too) is in `error`'s chain, directly or inside an I/O
/// error.
pub(crate) fn describe(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    fn words(e: &(dyn std::error::Error + 'static)) -> Option<String> {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(describe_rustls(tls));
        }
        e.downcast_ref::<Worded>().map(|worded| worded.0.clone())
    }
    let mut next = Some(error);
    while let Some(e) = next {
        let inner = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|i| i as &(dyn std::error::Error + 'static));
        if let Some(found) = words(e).or_else(|| inner.and_then(words)) {
            return Some(found);
        }
        next = e.source();
    }
    None
}

fn describe_rustls(e: &rustls::Error) -> String {
    use rustls::{AlertDescription as Alert, CertificateError as Cert, Error};
    match e {
        Error::InvalidCertificate(cert) => match cert {
            Cert::UnknownIssuer => {
                "TLS: the server's certificate is not signed by a trusted CA (unknown issuer)".into()
            }
            Cert::NotValidForName | Cert::NotValidForNameContext { .. } => {
                format!("TLS: the server's certificate is not valid for the host name the channel checks ({cert:?})")
            }
            Cert::Expired | Cert::ExpiredContext { .. } => {
                format!("TLS: the server's certificate has expired ({cert:?})")
            }
            Cert::NotValidYet | Cert::NotValidYetContext { .. } => {
                format!("TLS: the server's certificate is not valid yet ({cert:?})")
            }
            Cert::Revoked => "TLS: the server's certificate is revoked".into(),
            other => format!("TLS: the server's certificate is not acceptable: {other:?}"),
        },
        Error::AlertReceived(Alert::CertificateRequired) => {
            format!("TLS: the server requires a client certificate (mutual TLS) and none was sent ({e})")
        }
        Error::AlertReceived(Alert::HandshakeFailure) => format!(
            "TLS: the server refused the handshake: no protocol version or cipher in common, or it wanted a \
             client certificate ({e})"
        ),
        Error::AlertReceived(
            alert @ (Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateExpired
            | Alert::CertificateUnknown
            | Alert::AccessDenied),
        ) => format!("TLS: the server refused the client certificate ({alert:?})"),
        Error::NoApplicationProtocol => "TLS: the peer does not speak HTTP/2 over TLS (no ALPN h2)".into(),
        other => format!("TLS handshake failed: {other}"),
    }
}

/// A client's TLS stream, whose read errors say in words why the server ended the connection.
/// `first` holds what `connect` read ahead of HTTP/2 (see there).
#[derive(Debug)]
pub(crate) struct ClientTls {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    first: Vec<u8>,
    at: usize,
}

/// A failure put in words (a TLS handshake's, or the connect timeout's), carried inside the I/O
/// errors that reach hyper and tonic, so that `describe` finds it again at the call's end.
#[derive(Debug)]
pub(crate) struct Worded(pub(crate) String);

/// Whether a TLS connection's peer agreed to HTTP/2, as gRPC requires of both sides (ALPN).
pub(crate) fn is_h2(alpn: Option<&[u8]>) -> bool {
    alpn == Some(b"h2")
}

impl std::fmt::Display for Worded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Worded {}

fn worded(e: std::io::Error) -> std::io::Error {
    match describe(&e) {
        Some(words) => std::io::Error::new(e.kind(), Worded(words)),
        None => e,
    }
}

impl tokio::io::AsyncRead for ClientTls {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.at < this.first.len() {
            let n = buf.remaining().min(this.first.len() - this.at);
            buf.put_slice(&this.first[this.at..this.at + n]);
            this.at += n;
            if this.at == this.first.len() {
                this.first = Vec::new();
                this.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.tls).poll_read(cx, buf).map_err(worded)
    }
}

impl tokio::io::AsyncWrite for ClientTls {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf).map_err(worded)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write_vectored(cx, bufs).map_err(worded)
    }

    fn is_write_vectored(&self) -> bool {
        self.tls.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx).map_err(worded)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx).map_err(worded)
    }
}

/// How long `connect` waits for the server's first bytes after the handshake, at most.
const FIRST_READ: std::time::Duration = std::time::Duration::from_secs(3);

/// Connects TLS over `tcp`, checking the server's certificate against `host` (or the
/// configured domain name). A failure is an I/O error whose message says why.
///
/// Under TLS 1.3 the client's handshake ends before the server has checked the client's
/// certificate; a server that refuses it (or wanted one) says so in an alert that only the
/// next read sees. Read by hyper's connection task, that error would never reach a call,
/// which would end with a bare "transport error". So the first read happens here: an HTTP/2
/// server sends its SETTINGS at once, which are kept for hyper; an alert fails the connect in
/// words. A server that sends nothing first is not waited for beyond `FIRST_READ`, or `within`
/// if that is shorter (part of the connect timeout left).
pub(crate) async fn connect(
    config: &Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
    tcp: tokio::net::TcpStream,
    within: Option<std::time::Duration>,
) -> std::io::Result<ClientTls> {
    use tokio::io::AsyncReadExt;
    let mut tls = tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp).await.map_err(worded)?;
    // rustls holds a server to the protocols offered only when it picks one: a server that
    // picks none (an HTTPS server of HTTP/1.1 only, say) got an HTTP/2 preface and answered
    // it with an HTTP/1 error, read as a bare protocol error. grpc-core and grpc-go refuse it.
    if !is_h2(tls.get_ref().1.alpn_protocol()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            Worded("TLS: the server did not agree to HTTP/2 (no ALPN \"h2\"), which gRPC requires".into()),
        ));
    }
    // Under TLS 1.2 the server's verdict on the client is part of the handshake.
    if tls.get_ref().1.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
        return Ok(ClientTls { tls, first: Vec::new(), at: 0 });
    }
    let mut first = vec![0; 16 * 1024];
    let closed = || {
        std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            Worded(
                "TLS: the server closed the connection right after the handshake, as servers that require a \
                 client certificate do when none they trust was sent"
                    .into(),
            ),
        )
    };
    let n = match tokio::time::timeout(within.map_or(FIRST_READ, |w| w.min(FIRST_READ)), tls.read(&mut first)).await {
        Ok(Ok(0)) => return Err(closed()),
        Ok(Ok(n)) => n,
        // A server that hangs up without an alert (BoringSSL's, grpcio's, may).
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof && describe(&e).is_none() => return Err(closed()),
        Ok(Err(e)) => return Err(worded(e)),
        Err(_) => 0,
    };
    first.truncate(n);
    Ok(ClientTls { tls, first, at: 0 })
}
