//! TLS settings across the boundary: PEM strings from the caller into the engine's client and
//! server configurations, and what a handler can learn of a TLS client.

use std::ffi::c_char;

use isthmus::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig, Status};

use crate::abi::{c_str, invalid};

/// TLS settings of a channel (`isthmus_channel_options_t.tls`) or a server
/// (`isthmus_server_options_t.tls`). Zero-initialise it, then set what you need. Every string is
/// NUL-terminated PEM text (or a name), copied before the function that takes it returns.
#[repr(C)]
pub struct isthmus_tls_options_t {
    /// Certificates to trust. A channel: the CAs that sign the server's certificate (NULL: the
    /// system's roots). A server: the CAs that sign its clients' certificates, which it then
    /// asks clients for (mutual TLS; NULL: it asks none).
    pub root_certs_pem: *const c_char,
    /// This side's certificate chain, leaf first, with `private_key_pem`. A server needs one;
    /// a channel gives one for mutual TLS (NULL: none).
    pub cert_chain_pem: *const c_char,
    /// The private key of `cert_chain_pem` (PKCS#8, PKCS#1 or SEC1 PEM).
    pub private_key_pem: *const c_char,
    /// A channel: the name the server's certificate must carry, in place of the target's host
    /// (grpc's `ssl_target_name_override`); NULL for the host. A server: must be NULL.
    pub server_name: *const c_char,
    /// A server with `root_certs_pem`: 1 refuses a client without a certificate signed by them
    /// (grpc's `require_client_auth`); 0 lets it in without one. A channel: must be 0.
    pub require_client_cert: u32,
}

/// An optional PEM (or name) string field, copied.
///
/// # Safety
///
/// `s` is NULL or NUL-terminated.
unsafe fn field(s: *const c_char, what: &str) -> Result<Option<String>, Status> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: not NULL; NUL-terminated by the caller's promise.
    Ok(Some(unsafe { c_str(s, what) }?.to_owned()))
}

/// The settings copied out of the caller's struct, to build a configuration from later (a
/// server builds its own when it starts, where an error has a status to go to).
#[derive(Clone, Debug, Default)]
pub(crate) struct TlsPems {
    roots: Option<String>,
    chain: Option<String>,
    key: Option<String>,
    server_name: Option<String>,
    require_client_cert: bool,
}

impl TlsPems {
    /// Copies the settings behind `tls`; `None` for a NULL pointer.
    ///
    /// # Safety
    ///
    /// `tls` is NULL or points to a valid `isthmus_tls_options_t` whose strings are NULL or
    /// NUL-terminated.
    pub(crate) unsafe fn copy(tls: *const isthmus_tls_options_t) -> Result<Option<TlsPems>, Status> {
        // SAFETY: the caller promises NULL or a valid struct.
        let Some(t) = (unsafe { tls.as_ref() }) else { return Ok(None) };
        // SAFETY: the caller promises each string NULL or NUL-terminated.
        let pems = unsafe {
            TlsPems {
                roots: field(t.root_certs_pem, "tls.root_certs_pem")?,
                chain: field(t.cert_chain_pem, "tls.cert_chain_pem")?,
                key: field(t.private_key_pem, "tls.private_key_pem")?,
                server_name: field(t.server_name, "tls.server_name")?,
                require_client_cert: t.require_client_cert != 0,
            }
        };
        Ok(Some(pems))
    }

    /// This side's identity, if it gave one: both halves or neither. A half that does not
    /// decode is named, so that a caller knows which of its strings to look at.
    fn identity(&self) -> Result<Option<Identity>, Status> {
        match (&self.chain, &self.key) {
            (Some(chain), Some(key)) => {
                Certificate::from_pem(chain).map_err(|e| named("tls.cert_chain_pem", &e))?;
                Identity::from_pem(chain, key).map(Some).map_err(|e| named("tls.private_key_pem", &e))
            }
            (None, None) => Ok(None),
            _ => Err(invalid("tls: a certificate needs both cert_chain_pem and private_key_pem")),
        }
    }

    /// A channel's configuration.
    pub(crate) fn client(&self) -> Result<ClientTlsConfig, Status> {
        if self.require_client_cert {
            return Err(invalid("tls.require_client_cert is a server's setting; a channel's must be 0"));
        }
        let mut tls = ClientTlsConfig::new();
        if let Some(roots) = &self.roots {
            tls = tls.ca_certificate(roots_of(roots)?);
        }
        if let Some(identity) = self.identity()? {
            tls = tls.identity(identity);
        }
        if let Some(name) = &self.server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok(tls)
    }

    /// A server's configuration.
    pub(crate) fn server(&self) -> Result<ServerTlsConfig, Status> {
        if self.server_name.is_some() {
            return Err(invalid("tls.server_name is a channel's setting; a server's must be NULL"));
        }
        let identity =
            self.identity()?.ok_or_else(|| invalid("tls: a server needs cert_chain_pem and private_key_pem"))?;
        let mut tls = ServerTlsConfig::new().identity(identity);
        match &self.roots {
            Some(roots) => {
                tls = tls.client_ca_root(roots_of(roots)?).client_auth_optional(!self.require_client_cert);
            }
            None if self.require_client_cert => {
                return Err(invalid("tls.require_client_cert needs root_certs_pem to check clients with"));
            }
            None => {}
        }
        Ok(tls)
    }
}

/// `root_certs_pem` decoded; a failure names the field.
fn roots_of(pem: &str) -> Result<Certificate, Status> {
    Certificate::from_pem(pem).map_err(|e| named("tls.root_certs_pem", &e))
}

/// `e` (a PEM that does not decode) as INVALID_ARGUMENT naming the field it came from.
fn named(field: &str, e: &Status) -> Status {
    invalid(format!("{field}: {}", e.message()))
}
