//! What gRPC's auth context shows of a TLS peer's certificate: its subject (as an RFC 2253
//! string), common name and subject alternative names.
//!
//! The certificate has passed rustls's verification before it gets here, but it is still the
//! peer's bytes: this reader checks every length against what is left, gives up (`None`) on
//! anything it does not expect, and never panics (the `x509` fuzz target feeds it).

use std::net::{Ipv4Addr, Ipv6Addr};

/// The names a peer's certificate carries, read from its DER.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCertificate {
    der: Vec<u8>,
    subject: String,
    common_name: Option<String>,
    dns: Vec<String>,
    uris: Vec<String>,
    emails: Vec<String>,
    ips: Vec<String>,
    /// Every alternative name of these kinds, in the certificate's order.
    alt_names: Vec<String>,
}

impl PeerCertificate {
    /// Reads `der`, an X.509 certificate; `None` if it does not decode.
    pub fn from_der(der: &[u8]) -> Option<PeerCertificate> {
        let mut cert = PeerCertificate { der: der.to_vec(), ..PeerCertificate::default() };
        let certificate = Der(der).expect(SEQUENCE)?;
        let mut tbs = Der(Der(certificate).expect(SEQUENCE)?);
        // [0] version (optional), then the serial number.
        let (mut tag, _) = tbs.next()?;
        if tag == VERSION {
            tag = tbs.next()?.0;
        }
        if tag != INTEGER {
            return None;
        }
        let _signature = tbs.expect(SEQUENCE)?;
        let _issuer = tbs.expect(SEQUENCE)?;
        let _validity = tbs.expect(SEQUENCE)?;
        let subject = tbs.expect(SEQUENCE)?;
        let _key = tbs.expect(SEQUENCE)?;
        cert.read_subject(subject)?;
        while let Some((tag, value)) = tbs.next() {
            if tag == EXTENSIONS {
                cert.read_extensions(Der(value).expect(SEQUENCE)?)?;
            }
        }
        Some(cert)
    }

    fn read_subject(&mut self, subject: &[u8]) -> Option<()> {
        let mut parts = Vec::new();
        let mut rdns = Der(subject);
        while let Some((tag, set)) = rdns.next() {
            if tag != SET {
                return None;
            }
            let mut attrs = Der(set);
            let mut rdn = Vec::new();
            while let Some((tag, attr)) = attrs.next() {
                if tag != SEQUENCE {
                    return None;
                }
                let mut attr = Der(attr);
                let oid = attr.expect(OID)?;
                let (kind, value) = attr.next()?;
                let text = string(kind, value)?;
                if oid == OID_COMMON_NAME && self.common_name.is_none() {
                    self.common_name = Some(text.clone());
                }
                rdn.push(format!("{}={}", attribute_name(oid), escape_rfc2253(&text)));
            }
            parts.push(rdn.join("+"));
        }
        // RFC 2253 names the most specific part first: the reverse of the DER order.
        parts.reverse();
        self.subject = parts.join(",");
        Some(())
    }

    fn read_extensions(&mut self, extensions: &[u8]) -> Option<()> {
        let mut list = Der(extensions);
        while let Some((tag, extension)) = list.next() {
            if tag != SEQUENCE {
                return None;
            }
            let mut ext = Der(extension);
            let oid = ext.expect(OID)?;
            let (mut tag, mut value) = ext.next()?;
            if tag == BOOLEAN {
                (tag, value) = ext.next()?;
            }
            if tag != OCTET_STRING {
                return None;
            }
            if oid == OID_SUBJECT_ALT_NAME {
                let mut names = Der(Der(value).expect(SEQUENCE)?);
                while let Some((tag, name)) = names.next() {
                    let (list, text) = match tag {
                        SAN_EMAIL => (&mut self.emails, String::from_utf8_lossy(name).into_owned()),
                        SAN_DNS => (&mut self.dns, String::from_utf8_lossy(name).into_owned()),
                        SAN_URI => (&mut self.uris, String::from_utf8_lossy(name).into_owned()),
                        SAN_IP => (&mut self.ips, ip(name)?),
                        _ => continue,
                    };
                    list.push(text.clone());
                    self.alt_names.push(text);
                }
            }
        }
        Some(())
    }

    /// The certificate as the peer sent it (DER).
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    /// The certificate as PEM, as grpc's `x509_pem_cert` shows it.
    pub fn pem(&self) -> String {
        let mut b64 = crate::http::codec::encode_base64(&self.der).into_bytes();
        b64.resize(b64.len().div_ceil(4) * 4, b'=');
        let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
        for line in b64.chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
        pem
    }

    /// The subject as an RFC 2253 string (`CN=client,O=example`), as grpc's `x509_subject`.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The subject's common name, if it has one.
    pub fn common_name(&self) -> Option<&str> {
        self.common_name.as_deref()
    }

    /// Every subject alternative name (DNS, URI, e-mail, IP), in the certificate's order, as
    /// grpc's `x509_subject_alternative_name` lists them.
    pub fn subject_alt_names(&self) -> &[String] {
        &self.alt_names
    }

    /// The DNS names among the alternative names.
    pub fn dns_names(&self) -> &[String] {
        &self.dns
    }

    /// The URIs among the alternative names (SPIFFE IDs, say).
    pub fn uris(&self) -> &[String] {
        &self.uris
    }

    /// The e-mail addresses among the alternative names.
    pub fn emails(&self) -> &[String] {
        &self.emails
    }

    /// The IP addresses among the alternative names, as text.
    pub fn ips(&self) -> &[String] {
        &self.ips
    }
}

const BOOLEAN: u8 = 0x01;
const INTEGER: u8 = 0x02;
const OCTET_STRING: u8 = 0x04;
const OID: u8 = 0x06;
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const VERSION: u8 = 0xa0;
const EXTENSIONS: u8 = 0xa3;
const SAN_EMAIL: u8 = 0x81;
const SAN_DNS: u8 = 0x82;
const SAN_URI: u8 = 0x86;
const SAN_IP: u8 = 0x87;
const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
const OID_SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];

/// A cursor over DER's tag-length-value items.
struct Der<'a>(&'a [u8]);

impl<'a> Der<'a> {
    /// The next item's tag and contents; `None` at the end or on a malformed item.
    fn next(&mut self) -> Option<(u8, &'a [u8])> {
        let (&tag, rest) = self.0.split_first()?;
        if tag & 0x1f == 0x1f {
            return None; // multi-byte tags: nothing a certificate's names use
        }
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let (bytes, after) = rest.split_at(n);
            rest = after;
            bytes.iter().fold(0usize, |len, &b| len << 8 | usize::from(b))
        };
        if rest.len() < len {
            self.0 = &[];
            return None;
        }
        let (value, after) = rest.split_at(len);
        self.0 = after;
        Some((tag, value))
    }

    /// The next item's contents if it has tag `want`.
    fn expect(&mut self, want: u8) -> Option<&'a [u8]> {
        match self.next()? {
            (tag, value) if tag == want => Some(value),
            _ => None,
        }
    }
}

/// A directory string as text: UTF-8, printable, IA5, teletex (read as Latin-1) or BMP.
fn string(kind: u8, value: &[u8]) -> Option<String> {
    match kind {
        0x0c | 0x13 | 0x16 | 0x1a => Some(String::from_utf8_lossy(value).into_owned()),
        0x14 => Some(value.iter().map(|&b| char::from(b)).collect()),
        0x1e if value.len() % 2 == 0 => {
            let units = value.chunks(2).map(|p| u16::from_be_bytes([p[0], p[1]]));
            Some(char::decode_utf16(units).map(|c| c.unwrap_or('\u{fffd}')).collect())
        }
        _ => None,
    }
}

/// An attribute's short name (RFC 2253, and the ones OpenSSL prints), else its dotted OID.
fn attribute_name(oid: &[u8]) -> String {
    let name = match oid {
        [0x55, 0x04, 0x03] => "CN",
        [0x55, 0x04, 0x06] => "C",
        [0x55, 0x04, 0x07] => "L",
        [0x55, 0x04, 0x08] => "ST",
        [0x55, 0x04, 0x09] => "street",
        [0x55, 0x04, 0x0a] => "O",
        [0x55, 0x04, 0x0b] => "OU",
        [0x55, 0x04, 0x05] => "serialNumber",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19] => "DC",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x01] => "UID",
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01] => "emailAddress",
        _ => return dotted(oid),
    };
    name.to_owned()
}

fn dotted(oid: &[u8]) -> String {
    let mut arcs = Vec::new();
    let mut n: u64 = 0;
    for &b in oid {
        n = n.saturating_mul(128) | u64::from(b & 0x7f);
        if b & 0x80 == 0 {
            if arcs.is_empty() {
                let first = (n / 40).min(2);
                arcs.push(first);
                arcs.push(n - first * 40);
            } else {
                arcs.push(n);
            }
            n = 0;
        }
    }
    arcs.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
}

fn escape_rfc2253(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let edge_space = c == ' ' && (i == 0 || i == last);
        if matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';') || edge_space || (i == 0 && c == '#') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn ip(bytes: &[u8]) -> Option<String> {
    match bytes.len() {
        4 => Some(Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?).to_string()),
        16 => Some(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?).to_string()),
        _ => None,
    }
}

/// Fuzzing entry: any bytes as a certificate.
pub(crate) fn fuzz(data: &[u8]) {
    if let Some(cert) = PeerCertificate::from_der(data) {
        let _ = (cert.pem(), cert.subject_alt_names());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncations_of_a_certificate_never_panic() {
        // A minimal hand-made certificate: subject CN=a, SAN dns b and ip 127.0.0.1.
        fn tlv(tag: u8, parts: &[&[u8]]) -> Vec<u8> {
            let body = parts.concat();
            let mut out = vec![tag, u8::try_from(body.len()).expect("short")];
            out.extend_from_slice(&body);
            out
        }
        let cn = tlv(SEQUENCE, &[&tlv(OID, &[OID_COMMON_NAME]), &tlv(0x0c, &[b"a"])]);
        let name = tlv(SEQUENCE, &[&tlv(SET, &[&cn])]);
        let san = tlv(SEQUENCE, &[&tlv(SAN_DNS, &[b"b"]), &tlv(SAN_IP, &[&[127, 0, 0, 1]])]);
        let ext = tlv(SEQUENCE, &[&tlv(OID, &[OID_SUBJECT_ALT_NAME]), &tlv(OCTET_STRING, &[&san])]);
        let exts = tlv(EXTENSIONS, &[&tlv(SEQUENCE, &[&ext])]);
        let empty = tlv(SEQUENCE, &[]);
        let version = tlv(VERSION, &[&tlv(INTEGER, &[&[2]])]);
        let tbs = tlv(SEQUENCE, &[&version, &tlv(INTEGER, &[&[1]]), &empty, &name, &empty, &name, &empty, &exts]);
        let der = tlv(SEQUENCE, &[&tbs]);
        let cert = PeerCertificate::from_der(&der).expect("decodes");
        assert_eq!(cert.common_name(), Some("a"));
        assert_eq!(cert.subject(), "CN=a");
        assert_eq!(cert.subject_alt_names(), ["b", "127.0.0.1"]);
        assert!(cert.pem().starts_with("-----BEGIN CERTIFICATE-----\nM"));
        for cut in 0..der.len() {
            assert_eq!(PeerCertificate::from_der(&der[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn names_escape_and_oids_print() {
        assert_eq!(escape_rfc2253("a,b"), "a\\,b");
        assert_eq!(escape_rfc2253(" #x "), "\\ #x\\ ");
        assert_eq!(dotted(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d]), "1.2.840.113549");
    }
}
