//! The server's socket: bind (replacing a stale one), accept, remove on drop.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};

use crate::config::{Config, PeerPolicy};
use crate::connection::Connection;
use crate::error::{Error, ErrorKind, Result};
use crate::shared::SharedArena;
use crate::{establish, sys, Address};

/// A bound server socket. Dropping it removes the socket file (if it is still ours).
#[derive(Debug)]
pub struct Listener {
    inner: UnixListener,
    addr: Address,
    cfg: Config,
    file_id: (u64, u64),
    shared: Option<SharedArena>,
    /// A child forked since the bind leaves the socket file to the parent.
    made_in: crate::link::MadeIn,
}

/// An accepted socket whose handshake has not run yet. Run it with
/// [`handshake`](Incoming::handshake), on a thread that may block up to the configured
/// handshake timeout.
#[derive(Debug)]
pub struct Incoming {
    stream: UnixStream,
    cfg: Config,
    shared: Option<SharedArena>,
}

impl Incoming {
    /// Runs the server side of the handshake.
    pub fn handshake(self) -> Result<Connection> {
        establish::accept(self.stream, &self.cfg, self.shared)
    }
}

impl Listener {
    /// Binds `addr`. A socket file left by a crashed server is replaced; one a live server
    /// answers on, or one whose server has stopped accepting with its backlog full, is
    /// [`ErrorKind::AddrInUse`]. Creates the listener's shared arena
    /// ([`Config::shared_arena_size`]), which every connection it accepts can carry, if the
    /// policy admits only the server's own user and the kernel can seal it.
    pub fn bind(addr: &Address, cfg: Config) -> Result<Listener> {
        cfg.validate()?;
        // Every client maps all of it: only for clients of the server's own user. Without it
        // (or on a kernel that cannot seal it against writers) topics send copies.
        let shared = match (cfg.shared_arena_size, &cfg.peer_policy) {
            (0, _) | (_, PeerPolicy::Uids(_) | PeerPolicy::Any) => None,
            (size, PeerPolicy::SameUid) => SharedArena::create(size).ok(),
        };
        addr.prepare_dir()?;
        let path = addr.socket_path();
        let inner = match UnixListener::bind(path) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                let meta = std::fs::symlink_metadata(path)
                    .map_err(|e| Error::io(format!("cannot inspect {}", path.display()), e))?;
                if !meta.file_type().is_socket() {
                    return Err(Error::new(
                        ErrorKind::AddrInUse,
                        format!("{} exists and is not a socket; refusing to replace it", path.display()),
                    ));
                }
                // Without waiting: a blocking connect to a server stopped with its backlog full
                // would wait for room for ever, and that server is alive all the same.
                match crate::connect_unix(path, None) {
                    // One that connects is alive.
                    Ok(_) => {
                        return Err(Error::new(
                            ErrorKind::AddrInUse,
                            format!("another server is listening on {} ({addr})", path.display()),
                        ))
                    }
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        // Nobody accepts on it: a crashed server's leftover.
                        std::fs::remove_file(path)
                            .map_err(|e| Error::io(format!("cannot remove stale socket {}", path.display()), e))?;
                        UnixListener::bind(path).map_err(|e| Error::io(format!("cannot bind {}", path.display()), e))?
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        return Err(Error::new(
                            ErrorKind::AddrInUse,
                            format!("another server holds {} ({addr}) and does not accept", path.display()),
                        ))
                    }
                    Err(e) => return Err(Error::io(format!("cannot probe existing socket {}", path.display()), e)),
                }
            }
            Err(e) => return Err(Error::io(format!("cannot bind {}", path.display()), e)),
        };
        let file_id = sys::file_id(path).map_err(|e| Error::io(format!("cannot inspect {}", path.display()), e))?;
        Ok(Listener { inner, addr: addr.clone(), cfg, file_id, shared, made_in: crate::link::MadeIn::now() })
    }

    /// Accepts one connection and runs its handshake. A handshake failure (version mismatch,
    /// refused uid, a client that hangs up) is returned as an error for that connection only;
    /// the listener goes on.
    pub fn accept(&self) -> Result<Connection> {
        self.accept_incoming()?.handshake()
    }

    /// Accepts one socket without running the handshake.
    pub fn accept_incoming(&self) -> Result<Incoming> {
        loop {
            match self.inner.accept() {
                Ok((stream, _)) => return Ok(Incoming { stream, cfg: self.cfg.clone(), shared: self.shared.clone() }),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(format!("accept on {} failed", self.addr), e)),
            }
        }
    }

    /// Makes [`accept_incoming`](Self::accept_incoming) return `WouldBlock` errors instead of
    /// waiting, for event loops that poll [`as_fd`](AsFd::as_fd).
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<()> {
        self.inner.set_nonblocking(nonblocking).map_err(|e| Error::io("cannot change the listener's blocking mode", e))
    }

    /// The shared arena every connection of this listener can carry blocks of, if it has one.
    pub fn shared_arena(&self) -> Option<&SharedArena> {
        self.shared.as_ref()
    }

    /// The address this listener serves.
    pub fn address(&self) -> &Address {
        &self.addr
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let path = self.addr.socket_path();
        // Only remove the file if it is still the socket we bound, not a successor's, and this
        // is the process that bound it (a forked child's copy would take the parent's address).
        if !self.made_in.forked() && sys::file_id(path).is_ok_and(|id| id == self.file_id) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Connection {
    /// Connects to the server at `addr` and runs the handshake.
    pub fn connect(addr: &Address, cfg: &Config) -> Result<Connection> {
        establish::connect(addr, cfg)
    }
}
