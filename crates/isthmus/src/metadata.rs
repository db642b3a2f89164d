//! Call metadata (headers and trailers) with gRPC's rules.
//!
//! - Keys are lower-case ASCII `0-9 a-z - _ .`, 1–255 bytes.
//! - Keys ending in `-bin` carry arbitrary bytes; all others carry printable ASCII (0x20–0x7E).
//! - Keys starting with `grpc-` are reserved for the protocol itself, and so are the HTTP/2
//!   headers a gRPC peer owns (`content-type`, `te`, `user-agent`, `:`-pseudo-headers): users
//!   cannot set them, and a peer that sends them in user metadata is refused.
//! - A key may appear several times; order among values of one key is kept.
//! - One exception: a server's handler finds its caller's user agent under `user-agent` in its
//!   call's metadata, as grpcio's and grpc-go's do. A map never sends an entry under a reserved
//!   key: one passed on from a handler's metadata leaves the agent behind.

use std::fmt;

use bytes::Bytes;

/// Why a key or value was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidMetadata(String);

impl fmt::Display for InvalidMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidMetadata {}

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 255;

const RESERVED: [&str; 3] = ["content-type", "te", "user-agent"];

/// True if `key` ends in `-bin` (a binary-valued key).
pub fn is_binary_key(key: &str) -> bool {
    key.ends_with("-bin")
}

/// True if gRPC reserves `key` for itself (`grpc-*`, and the HTTP/2 headers it sets): a
/// binding that takes metadata as grpcio does may leave such keys out rather than fail.
pub fn is_reserved_key(key: &str) -> bool {
    key.starts_with("grpc-") || RESERVED.contains(&key)
}

/// Checks a key against gRPC's rules, including the reserved names.
pub fn check_key(key: &str) -> Result<(), InvalidMetadata> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(InvalidMetadata(format!("metadata key {key:?} must be 1-{MAX_KEY_LEN} bytes")));
    }
    if !key.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || matches!(b, b'-' | b'_' | b'.')) {
        return Err(InvalidMetadata(format!(
            "metadata key {key:?} may hold only lower-case a-z, 0-9, '-', '_' and '.'"
        )));
    }
    if is_reserved_key(key) {
        return Err(InvalidMetadata(format!("metadata key {key:?} is reserved by gRPC")));
    }
    Ok(())
}

/// Checks a value for `key`: anything for `-bin` keys, printable ASCII otherwise.
pub fn check_value(key: &str, value: &[u8]) -> Result<(), InvalidMetadata> {
    if !is_binary_key(key) && !value.iter().all(|&b| (0x20..=0x7e).contains(&b)) {
        return Err(InvalidMetadata(format!(
            "metadata value for {key:?} must be printable ASCII; use a '-bin' key for bytes"
        )));
    }
    Ok(())
}

/// An ordered multimap of metadata entries.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MetadataMap {
    entries: Vec<(String, Bytes)>,
}

impl MetadataMap {
    /// The empty map, as a constant.
    pub(crate) const EMPTY: MetadataMap = MetadataMap { entries: Vec::new() };

    /// An empty map.
    pub fn new() -> MetadataMap {
        MetadataMap::default()
    }

    /// Removes every entry under `key`, returning the first one's value.
    pub fn remove(&mut self, key: &str) -> Option<Bytes> {
        let first = self.entries.iter().position(|(k, _)| k == key)?;
        let value = self.entries[first].1.clone();
        self.entries.retain(|(k, _)| k != key);
        Some(value)
    }

    /// Removes every entry under `key`, returning the last one's value.
    pub(crate) fn remove_last(&mut self, key: &str) -> Option<Bytes> {
        let last = self.entries.iter().rposition(|(k, _)| k == key)?;
        let value = self.entries[last].1.clone();
        self.entries.retain(|(k, _)| k != key);
        Some(value)
    }

    /// Appends an ASCII entry. The key must not end in `-bin`.
    ///
    /// ```
    /// let mut md = isthmus::MetadataMap::new();
    /// md.append("x-request-id", "42")?;
    /// md.append_bin("trace-bin", vec![0, 159, 255])?;
    /// assert_eq!(md.get("x-request-id"), Some("42"));
    /// assert!(md.append("grpc-status", "0").is_err());
    /// # Ok::<(), isthmus::InvalidMetadata>(())
    /// ```
    pub fn append(&mut self, key: &str, value: &str) -> Result<(), InvalidMetadata> {
        if is_binary_key(key) {
            return Err(InvalidMetadata(format!("{key:?} is a binary key; use append_bin")));
        }
        self.append_raw(key, Bytes::copy_from_slice(value.as_bytes()))
    }

    /// Appends a binary entry. The key must end in `-bin`.
    pub fn append_bin(&mut self, key: &str, value: impl Into<Bytes>) -> Result<(), InvalidMetadata> {
        if !is_binary_key(key) {
            return Err(InvalidMetadata(format!("{key:?} is not a binary key (binary keys end in '-bin')")));
        }
        self.append_raw(key, value.into())
    }

    /// Appends an entry of either kind after checking key and value.
    pub fn append_raw(&mut self, key: &str, value: Bytes) -> Result<(), InvalidMetadata> {
        check_key(key)?;
        check_value(key, &value)?;
        self.entries.push((key.to_owned(), value));
        Ok(())
    }

    /// The first ASCII value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.get_bin(key).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first value of `key`, as bytes.
    pub fn get_bin(&self, key: &str) -> Option<&[u8]> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| &v[..])
    }

    /// Every value of `key`, in order.
    pub fn get_all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.entries.iter().filter(move |(k, _)| k == key).map(|(_, v)| &v[..])
    }

    /// Every entry, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(k, v)| (k.as_str(), &v[..]))
    }

    /// Appends an entry under a key gRPC reserves, unchecked: what a call's transport carried
    /// outside its metadata and a handler sees in it, as grpcio's and grpc-go's do (the HTTP/2
    /// client's `user-agent`). Such entries are never sent on ([`sendable`](Self::sendable)),
    /// so a handler that passes its metadata to a call of its own sends its own agent, not
    /// its caller's.
    pub(crate) fn append_transport(&mut self, key: &'static str, value: Bytes) {
        debug_assert!(is_reserved_key(key));
        self.entries.push((key.to_owned(), value));
    }

    /// The entries a call sends: every one but those under reserved keys
    /// ([`append_transport`](Self::append_transport)'s).
    pub(crate) fn sendable(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.iter().filter(|(k, _)| !is_reserved_key(k))
    }

    /// Appends every entry of `other` (already checked when it was built; a handler's may hold
    /// its caller's `user-agent`, which is never sent).
    pub fn extend(&mut self, other: &MetadataMap) {
        self.entries.extend(other.entries.iter().cloned());
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl fmt::Debug for MetadataMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.entries {
            match std::str::from_utf8(v) {
                Ok(s) if !is_binary_key(k) => m.entry(k, &s),
                _ => m.entry(k, &format_args!("<{} bytes>", v.len())),
            };
        }
        m.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_last_takes_every_value_and_gives_the_last() {
        let mut md = MetadataMap::new();
        for (k, v) in [("a", "1"), ("b", "2"), ("a", "3")] {
            md.append(k, v).expect("ascii");
        }
        assert_eq!(md.remove_last("a").as_deref(), Some(&b"3"[..]));
        assert_eq!((md.get("a"), md.get("b"), md.len()), (None, Some("2"), 1));
        assert_eq!(md.remove_last("a"), None);
    }

    #[test]
    fn keys_follow_grpc_rules() {
        for ok in ["a", "x-user-id", "trace.id_2", "k-bin"] {
            check_key(ok).expect(ok);
        }
        for bad in ["", "Upper", "sp ace", "grpc-timeout", "content-type", "te", ":path", "ü"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_key(&"k".repeat(256)).is_err());
    }

    #[test]
    fn values_are_ascii_unless_binary() {
        let mut md = MetadataMap::new();
        assert!(md.append("k", "tab\tnot allowed").is_err());
        assert!(md.append_raw("k", Bytes::from_static(&[0xff])).is_err());
        md.append_bin("k-bin", vec![0u8, 0xff]).expect("binary");
        assert!(md.append("k-bin", "x").is_err(), "ascii API refuses binary keys");
        assert!(md.append_bin("k", vec![1]).is_err(), "binary API refuses ascii keys");
        md.append("k", "one").expect("ascii");
        md.append("k", "two").expect("repeat");
        assert_eq!(md.get_all("k").collect::<Vec<_>>(), vec![&b"one"[..], &b"two"[..]]);
        assert_eq!(md.get_bin("k-bin"), Some(&[0u8, 0xff][..]));
        assert_eq!(md.len(), 3);
    }
}
