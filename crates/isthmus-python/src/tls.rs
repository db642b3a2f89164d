//! TLS settings and identities across the boundary: grpcio's credential arguments (PEM bytes)
//! into the engine's TLS configurations, and a TLS client's certificate into grpcio's
//! `auth_context()` dict.

use std::collections::HashMap;

use isthmus::binding::HandedCall;
use isthmus::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig, Status};
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

fn bad(status: Status) -> pyo3::PyErr {
    PyValueError::new_err(status.message().to_owned())
}

/// `ssl_channel_credentials(root_certificates, private_key, certificate_chain)` and grpc's
/// `grpc.ssl_target_name_override`, as the Python package passes them.
pub(crate) type ClientTls = (Option<Vec<u8>>, Option<Vec<u8>>, Option<Vec<u8>>, Option<String>);

pub(crate) fn client_config((roots, key, chain, name): ClientTls) -> PyResult<ClientTlsConfig> {
    let mut tls = ClientTlsConfig::new();
    if let Some(roots) = roots {
        tls = tls.ca_certificate(Certificate::from_pem(roots).map_err(bad)?);
    }
    match (key, chain) {
        (Some(key), Some(chain)) => tls = tls.identity(Identity::from_pem(chain, key).map_err(bad)?),
        (None, None) => {}
        _ => return Err(PyValueError::new_err("a client certificate needs both private_key and certificate_chain")),
    }
    if let Some(name) = name {
        tls = tls.domain_name(name);
    }
    Ok(tls)
}

/// `ssl_server_credentials([(private_key, certificate_chain)], root_certificates,
/// require_client_auth)`, as the Python package passes it (one pair).
pub(crate) type ServerTls = (Vec<u8>, Vec<u8>, Option<Vec<u8>>, bool);

pub(crate) fn server_config((key, chain, roots, require): ServerTls) -> PyResult<ServerTlsConfig> {
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(chain, key).map_err(bad)?);
    match roots {
        // Without `require_client_auth` grpcio asks clients for no certificate, roots or not
        // (grpc-core's GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE): asked, a client whose
        // certificate another CA signed was refused, and handlers saw identities grpcio's do
        // not. The roots are still read, so that bad ones fail here as in grpcio.
        Some(roots) => {
            let roots = Certificate::from_pem(roots).map_err(bad)?;
            if require {
                tls = tls.client_ca_root(roots);
            }
        }
        None if require => {
            return Err(PyValueError::new_err("require_client_auth needs root_certificates to check clients with"))
        }
        None => {}
    }
    Ok(tls)
}

/// grpcio's `auth_context()` for a call: the transport's security and, under mutual TLS, the
/// client certificate's names under grpc's property names.
pub(crate) fn auth_context(call: &HandedCall) -> HashMap<&'static str, Vec<Vec<u8>>> {
    let one = |s: &str| vec![s.as_bytes().to_vec()];
    let many = |v: &[String]| v.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>();
    let mut ctx = HashMap::new();
    let (kind, level) = if call.is_tls() {
        ("ssl", "TSI_PRIVACY_AND_INTEGRITY")
    } else if call.peer().starts_with("shm:") {
        // Like grpc's local credentials: the endpoint admits only the uids it is told to.
        ("local", "TSI_PRIVACY_AND_INTEGRITY")
    } else {
        ("insecure", "TSI_SECURITY_NONE")
    };
    ctx.insert("transport_security_type", one(kind));
    ctx.insert("security_level", one(level));
    if call.is_tls() {
        ctx.insert("ssl_session_reused", one("false"));
    }
    if let Some(cert) = call.peer_certificate() {
        ctx.insert("x509_subject", one(cert.subject()));
        if let Some(cn) = cert.common_name() {
            ctx.insert("x509_common_name", one(cn));
        }
        ctx.insert("x509_pem_cert", one(&cert.pem()));
        for (key, values) in [
            ("x509_subject_alternative_name", cert.subject_alt_names()),
            ("peer_dns", cert.dns_names()),
            ("peer_uri", cert.uris()),
            ("peer_email", cert.emails()),
            ("peer_ip", cert.ips()),
        ] {
            if !values.is_empty() {
                ctx.insert(key, many(values));
            }
        }
        if let [uri] = cert.uris() {
            if uri.starts_with("spiffe://") {
                ctx.insert("peer_spiffe_id", one(uri));
            }
        }
    }
    ctx
}
