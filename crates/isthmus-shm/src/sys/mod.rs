//! Every system call the transport makes, behind safe functions.
//!
//! The contract a platform module must meet:
//!
//! - **Segments**: create an anonymous shared-memory file that no other process can open by name
//!   (`memfd_create`), size it, seal it against shrinking and growing, report its size and seals,
//!   and map it shared read/write; advise huge pages for parts of a mapping (advice only: where
//!   the platform has none, nothing changes).
//! - **Doorbells**: a counter fd that one process signals and another waits on (`eventfd`),
//!   non-blocking, drained by one read.
//! - **Handshake socket**: connect with a bound on the wait for room in the listener's backlog,
//!   pass fds with a message (`SCM_RIGHTS`), report the peer's credentials (`SO_PEERCRED`), and
//!   tell an orderly EOF from stray bytes without consuming them.
//! - **Waiting**: block until one of two fds is readable or a deadline passes, retrying `EINTR`.
//!
//! Every fd handed out is close-on-exec and owned (`OwnedFd`), so nothing leaks into children or
//! outlives its owner. Above this module no code calls `libc` directly.

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub(crate) use linux::*;

#[cfg(not(target_os = "linux"))]
compile_error!("isthmus-shm needs Linux: memfd_create, eventfd, SO_PEERCRED and SCM_RIGHTS");
