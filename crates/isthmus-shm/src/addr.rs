//! `shm://` addresses and the private runtime directory their sockets live in.

use std::fmt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};
use crate::sys;

/// Longest path a Unix socket address can hold (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Where an shm server listens: the path of its handshake socket.
///
/// - `shm://NAME` names a socket `NAME.sock` in the per-user runtime directory
///   (`$XDG_RUNTIME_DIR/isthmus`, or `/tmp/isthmus-UID`), created with mode 0700 so no other user
///   can connect. `NAME` is 1–64 characters of `A-Z a-z 0-9 . _ -` and does not start with a dot.
/// - `shm:///abs/path.sock` uses that path as is; its directory's permissions are the caller's
///   business.
///
/// ```
/// use isthmus_shm::Address;
/// let a: Address = "shm:///tmp/demo.sock".parse()?;
/// assert_eq!(a.socket_path(), std::path::Path::new("/tmp/demo.sock"));
/// assert!("shm://../etc".parse::<Address>().is_err());
/// # Ok::<(), isthmus_shm::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Address {
    uri: String,
    path: PathBuf,
    named: bool,
}

impl Address {
    /// The handshake socket's path.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// True for `shm://NAME` (socket in the private runtime directory).
    pub fn is_named(&self) -> bool {
        self.named
    }

    /// Makes sure the runtime directory exists and is private to this user.
    pub(crate) fn prepare_dir(&self) -> Result<()> {
        if self.named {
            if let Some(dir) = self.path.parent() {
                ensure_private_dir(dir)?;
            }
        }
        Ok(())
    }

    /// Client side: the runtime directory, if it exists, must be private to this user; a missing
    /// one just means no server is there.
    pub(crate) fn check_dir(&self) -> Result<()> {
        match self.path.parent() {
            Some(dir) if self.named && dir.exists() => check_private_dir(dir),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

impl FromStr for Address {
    type Err = Error;

    fn from_str(uri: &str) -> Result<Address> {
        let rest = uri.strip_prefix("shm://").ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidAddress,
                format!("{uri:?} is not an shm:// address (expected shm://NAME or shm:///abs/path.sock)"),
            )
        })?;
        let (path, named) = if rest.starts_with('/') {
            (PathBuf::from(rest), false)
        } else {
            validate_name(uri, rest)?;
            (runtime_dir().join(format!("{rest}.sock")), true)
        };
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(Error::new(
                ErrorKind::InvalidAddress,
                format!(
                    "socket path {} is {} bytes; a Unix socket path holds at most {MAX_SOCKET_PATH}",
                    path.display(),
                    path.as_os_str().len()
                ),
            ));
        }
        Ok(Address { uri: uri.to_owned(), path, named })
    }
}

fn validate_name(uri: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::InvalidAddress,
            format!("{uri:?}: an shm name is 1-64 characters of A-Z a-z 0-9 . _ - and does not start with '.'"),
        ))
    }
}

/// The per-user directory that holds `shm://NAME` sockets.
pub fn runtime_dir() -> PathBuf {
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(xdg).join("isthmus");
    }
    PathBuf::from(format!("/tmp/isthmus-{}", sys::uid()))
}

/// Creates `dir` with mode 0700 if needed, and refuses one another user owns or others can enter.
fn ensure_private_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("cannot create runtime directory {}", dir.display()), e)),
    }
    check_private_dir(dir)
}

/// Refuses a directory another user owns or others can enter.
fn check_private_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::io(format!("cannot inspect runtime directory {}", dir.display()), e))?;
    if !meta.is_dir() {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!("runtime directory {} is not a directory", dir.display()),
        ));
    }
    if meta.uid() != sys::uid() {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "runtime directory {} belongs to uid {}, not to this user (uid {})",
                dir.display(),
                meta.uid(),
                sys::uid()
            ),
        ));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "runtime directory {} has mode {:o}; it must not be open to group or others (0700)",
                dir.display(),
                meta.permissions().mode() & 0o777
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_named_and_path_forms() {
        let a: Address = "shm://svc-1.a_b".parse().expect("valid name");
        assert!(a.is_named());
        assert!(a.socket_path().ends_with("svc-1.a_b.sock"));
        let b: Address = "shm:///run/x.sock".parse().expect("valid path");
        assert!(!b.is_named());
        assert_eq!(b.socket_path(), Path::new("/run/x.sock"));
    }

    #[test]
    fn rejects_bad_names() {
        for bad in ["shm://", "shm://a/b", "shm://..", "shm://.hidden", "unix:///x", "shm://a b"] {
            let e = bad.parse::<Address>().expect_err(bad);
            assert_eq!(e.kind(), ErrorKind::InvalidAddress, "{bad}");
        }
        let long = format!("shm:///{}", "x".repeat(200));
        assert_eq!(long.parse::<Address>().expect_err("too long").kind(), ErrorKind::InvalidAddress);
    }
}
