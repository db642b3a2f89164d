//! Linux implementation of the `sys` contract (see `sys/mod.rs`).

use std::ffi::CString;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::time::Instant;

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Takes ownership of a freshly returned fd.
fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: every caller passes an fd that a system call just returned to this process and that
    // nothing else has recorded, so this is its only owner.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The real user id of this process.
pub(crate) fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Creates an anonymous, sealable, close-on-exec shared-memory file.
pub(crate) fn memfd_create(name: &str) -> io::Result<OwnedFd> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    cvt(fd).map(owned)
}

/// Sets the size of a file.
pub(crate) fn set_len(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: ftruncate only reads its scalar arguments; a bad fd is reported as EBADF.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }).map(drop)
}

/// The seals that keep a segment's size fixed for its whole life.
pub(crate) const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Seals a memfd against shrinking and growing, and against further seal changes.
pub(crate) fn seal(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = REQUIRED_SEALS | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int argument; a bad fd is reported as an error.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }).map(drop)
}

/// The seals a shared arena carries besides [`REQUIRED_SEALS`]: no process may write it except
/// through a mapping that existed before the seal (the server's own).
pub(crate) const SHARED_SEALS: libc::c_int = libc::F_SEAL_FUTURE_WRITE;

/// Seals a shared arena: fixed size, and writable only through the mappings that exist now, so
/// the clients it is passed to can map it read-only and nothing else.
pub(crate) fn seal_shared(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = REQUIRED_SEALS | SHARED_SEALS | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int argument; a bad fd is reported as an error.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }).map(drop)
}

/// A pidfd for process `pid`, readable once that process has exited. `Ok(None)` if it has
/// exited already (no such process).
pub(crate) fn pidfd_open(pid: i32) -> io::Result<Option<OwnedFd>> {
    // SAFETY: pidfd_open takes a pid and flags (0) and returns a new fd or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd == -1 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ESRCH) { Ok(None) } else { Err(e) };
    }
    Ok(Some(owned(fd as libc::c_int)))
}

/// True once the process of `pidfd` has exited (its pidfd is readable); never blocks.
pub(crate) fn pidfd_exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: `p` is one live pollfd; a timeout of 0 returns at once.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents != 0
}

/// The seals set on a memfd.
pub(crate) fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: F_GET_SEALS takes no argument; a bad or non-memfd fd is reported as an error.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
}

/// The size of a file in bytes.
pub(crate) fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is valid for writes of one `stat`, which fstat fills on success.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    Ok(st.st_size as u64)
}

/// A shared read/write mapping of a whole file, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; every access to its bytes goes through
// raw pointers or atomics whose users uphold their own synchronisation.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: `&Mapping` only hands out the base pointer and length.
unsafe impl Sync for Mapping {}

/// The size of a huge page that maps a whole page-table entry's worth on x86-64 and arm64 (4 KiB
/// pages); where a platform's is larger, the advice covers fewer whole pages, which is harmless.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

impl Mapping {
    /// Maps `len` bytes of `fd` shared and read/write.
    pub(crate) fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Mapping::with_protection(fd, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Maps `len` bytes of `fd` shared and read-only: a write through it faults, so this process
    /// cannot change what others read there, even by mistake.
    pub(crate) fn read_only(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Mapping::with_protection(fd, len, libc::PROT_READ)
    }

    fn with_protection(fd: BorrowedFd<'_>, len: usize, prot: libc::c_int) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: a fresh mapping at an address the kernel picks aliases no Rust object; the
        // result is checked against MAP_FAILED before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(Mapping { ptr, len })
    }

    /// Asks the kernel to back bytes `range` of the mapping with huge pages where it can: the
    /// whole 2 MiB pages inside the range, and only if the host allows them for shared memory
    /// (`shmem_enabled` is `advise`, `within_size` or `always`). Advice only: where the kernel
    /// has no huge pages, or refuses, nothing changes and nothing fails. Returns whether the
    /// kernel took the advice (false also when the range holds no whole huge page).
    pub(crate) fn advise_huge_pages(&self, range: std::ops::Range<usize>) -> bool {
        let base = self.ptr.as_ptr() as usize;
        let end = range.end.min(self.len);
        let (Some(from), Some(to)) = (base.checked_add(range.start), base.checked_add(end)) else { return false };
        let (from, to) = (from.next_multiple_of(HUGE_PAGE), to / HUGE_PAGE * HUGE_PAGE);
        if from >= to {
            return false;
        }
        // SAFETY: `[from, to)` lies inside this mapping (the range is clamped to it and only
        // narrowed by the rounding). MADV_HUGEPAGE changes how later faults are served, never
        // the contents or the validity of any address.
        unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) == 0 }
    }

    /// The first byte of the mapping.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping this value created and nobody else unmaps; every
        // borrower of the memory holds an `Arc` to the owner of this value, so none is left.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Creates a non-blocking, close-on-exec eventfd with a zero count.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes scalar arguments only.
    cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) }).map(owned)
}

/// Adds one to an eventfd's count, waking whoever polls it.
pub(crate) fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one: u64 = 1;
    // SAFETY: `one` is valid for reads of 8 bytes. The result is ignored on purpose: the only
    // failure for a valid eventfd is EAGAIN at a count near u64::MAX, which already means "ready".
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), size_of::<u64>()) };
}

/// Resets an eventfd's count to zero; true if it was signalled. Never blocks, even on an
/// eventfd whose `O_NONBLOCK` the peer cleared: the flag belongs to the open file description,
/// which a doorbell passed over the socket shares with the peer, and a peer that cleared it and
/// emptied the count between our `poll` and our read held this thread in the read for good.
/// So the read is non-blocking per call (`RWF_NOWAIT`, which eventfds honour from Linux 5.12);
/// on an older kernel, it reads only what a `poll` just found (a window the peer must hit).
pub(crate) fn eventfd_drain(fd: BorrowedFd<'_>) -> bool {
    let mut count: u64 = 0;
    let iov = libc::iovec { iov_base: (&mut count as *mut u64).cast(), iov_len: size_of::<u64>() };
    // SAFETY: one iovec over `count`, valid for writes of 8 bytes; offset -1 is the file's own
    // position (an eventfd has none).
    let n = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
    if n == size_of::<u64>() as isize {
        return true;
    }
    let unsupported = n < 0
        && matches!(io::Error::last_os_error().raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS));
    if !unsupported || !wait_one(fd, Some(Instant::now())) {
        return false;
    }
    // SAFETY: `count` is valid for writes of 8 bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), (&mut count as *mut u64).cast(), size_of::<u64>()) };
    n == size_of::<u64>() as isize
}

/// Blocks until `fd` is readable or `deadline` passes; true if readable.
pub(crate) fn wait_one(fd: BorrowedFd<'_>, deadline: Option<Instant>) -> bool {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        let timeout = match deadline {
            None => -1,
            // Round up so a sub-millisecond remainder still sleeps instead of spinning.
            Some(d) => {
                d.saturating_duration_since(Instant::now()).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        };
        // SAFETY: `pfd` is one live pollfd struct.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout) };
        match n {
            1.. => return true,
            0 => return false,
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => continue,
            _ => return false,
        }
    }
}

/// Blocks SIGPIPE on the calling thread, so that a write to a socket whose peer has gone fails
/// with EPIPE instead of killing a host process that has not ignored the signal. (A signal
/// raised by a write is sent to the writing thread; blocked, it stays pending there, unseen.)
pub(crate) fn block_sigpipe() {
    // SAFETY: `set` is a local sigset that sigemptyset initialises before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Forks since the count was first asked for, as a child counts them (a `pthread_atfork` child
/// handler adds one).
static FORKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Forks this process has gone through, as a child counts them: 0 in the process that first
/// asked, and one more in each child of a `fork` made after that (the child handler is
/// registered on the first call).
pub(crate) fn forks() -> u64 {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    extern "C" fn count_fork() {
        FORKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    REGISTER.call_once(|| {
        // SAFETY: `count_fork` is async-signal-safe (one atomic add) and lives as long as the
        // process; registering a child handler has no other effect.
        unsafe { libc::pthread_atfork(None, None, Some(count_fork)) };
    });
    forks_counted()
}

/// [`forks`] without the registration: for a caller that called it before (a count taken
/// before any registration could not have changed since).
pub(crate) fn forks_counted() -> u64 {
    FORKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The time-stamp counter (see `crate::ticks`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn ticks() -> u64 {
    // SAFETY: RDTSC reads a counter and touches no memory; every x86-64 CPU has it. A process
    // that forbade it (`prctl(PR_SET_TSC, PR_TSC_SIGSEGV)`) gets SIGSEGV, not undefined
    // behaviour.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// Nanoseconds since the first call (see `crate::ticks`).
#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn ticks() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Sends `data` on a stream socket with `fds` attached as SCM_RIGHTS.
pub(crate) fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // u64 storage keeps the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // SAFETY: msghdr is a plain C struct for which all-zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points at `space` writable bytes, enough for one header with
        // `fd_bytes` of data, so the first header and its data area lie inside `control`.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), raw.len());
        }
    }
    let mut sent = loop {
        // SAFETY: `msg` points at a live iovec over `data` and at the control buffer filled
        // above; both outlive the call.
        match cvt_size(unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) }) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    // The fds went with the first chunk; any rest is plain bytes.
    while sent < data.len() {
        let rest = &data[sent..];
        // SAFETY: `rest` is valid for reads of its length.
        match cvt_size(unsafe { libc::send(sock.as_raw_fd(), rest.as_ptr().cast(), rest.len(), libc::MSG_NOSIGNAL) }) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Receives into `buf` from a stream socket, keeping any fds sent with it (close-on-exec).
///
/// Returns the byte count (0 at EOF) and the fds. Fds beyond `max_fds`, or a truncated control
/// message, are an error; every fd received is owned, so none leaks either way.
pub(crate) fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let fd_bytes = (max_fds * size_of::<RawFd>()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is a plain C struct for which all-zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points at an iovec over `buf` and at `control`, both live and writable
        // for the lengths given.
        match cvt_size(unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) }) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel set msg_controllen to the bytes it wrote into `control`; CMSG_FIRSTHDR
    // and CMSG_NXTHDR stay inside that length and return null past the end.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let len = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for i in 0..len / size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(owned(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > max_fds {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "peer sent more fds than the handshake allows"));
    }
    Ok((n, fds))
}

/// The credentials of the process at the other end of a Unix socket, as of `connect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerCred {
    pub(crate) pid: i32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// Connects a Unix stream socket to `name` (a path, or with `abstract_name` a name in Linux's
/// abstract namespace). A blocking `connect(2)` to a listener that has stopped accepting (hung,
/// stopped) and whose backlog is full waits for room with no bound; Linux bounds that wait by
/// the socket's send timeout (`SO_SNDTIMEO`), set here to `wait` before connecting: `TimedOut`
/// past it. `None` does not wait at all: the socket is non-blocking, a full backlog is
/// `WouldBlock` at once (a Unix socket's connect never stays in progress), and the stream stays
/// non-blocking.
pub(crate) fn connect_unix(
    name: &[u8],
    abstract_name: bool,
    wait: Option<std::time::Duration>,
) -> io::Result<UnixStream> {
    // SAFETY: an all-zero sockaddr_un is a valid value (family 0, empty path), filled below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // A path needs its terminating NUL (and no other); an abstract name starts with one.
    let room = addr.sun_path.len() - 1;
    if name.is_empty() || name.len() > room || (!abstract_name && name.contains(&0)) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no socket name, one too long, or a path with a NUL"));
    }
    let at = usize::from(abstract_name);
    for (to, from) in addr.sun_path[at..].iter_mut().zip(name) {
        *to = *from as libc::c_char;
    }
    let len = (size_of::<libc::sa_family_t>() + at + name.len() + usize::from(!abstract_name)) as libc::socklen_t;
    let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | if wait.is_none() { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain socket creation; the result is checked and owned at once.
    let fd = owned(cvt(unsafe { libc::socket(libc::AF_UNIX, flags, 0) })?);
    let deadline = wait.map(|wait| Instant::now() + wait);
    loop {
        if let Some(deadline) = deadline {
            // At least one try, however short the wait: a microsecond at least, since a zero
            // timeout is none at all.
            let left = deadline.saturating_duration_since(Instant::now());
            set_send_timeout(fd.as_fd(), left.max(std::time::Duration::from_micros(1)))?;
        }
        // SAFETY: `addr` is a sockaddr_un valid for `len` bytes (family, name and a path's NUL).
        let ret = unsafe { libc::connect(fd.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len) };
        match cvt(ret) {
            Ok(_) => {
                if wait.is_some() {
                    // The stream's writes get no timeout of ours.
                    set_send_timeout(fd.as_fd(), std::time::Duration::ZERO)?;
                }
                return Ok(UnixStream::from(fd));
            }
            // A Unix socket's connect that a signal interrupted has not connected: a retry
            // starts over, with what is left of the time.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "connect: the deadline passed"));
                }
                continue;
            }
            // What the send timeout's expiry reports: the backlog stayed full.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && wait.is_some() => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the listener's backlog stayed full for {:?}", wait.unwrap_or_default()),
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

/// Sets a socket's send timeout (`SO_SNDTIMEO`), in whole microseconds; `Duration::ZERO` is
/// none at all, as the kernel reads a zero timeval.
fn set_send_timeout(sock: BorrowedFd<'_>, timeout: std::time::Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Under a million: fits every platform's suseconds_t.
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: `tv` is a valid timeval for the length given.
    cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Reads SO_PEERCRED from a connected Unix socket.
pub(crate) fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut cred = MaybeUninit::<libc::ucred>::zeroed();
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is valid for writes of `len` bytes and `len` for one socklen_t.
    cvt(unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, cred.as_mut_ptr().cast(), &mut len)
    })?;
    // SAFETY: zero-initialised and then filled by the kernel; ucred is plain integers.
    let cred = unsafe { cred.assume_init() };
    Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// Which of the fds given to [`wait_readable`] are ready.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Readiness {
    pub(crate) first: bool,
    pub(crate) second: bool,
}

/// Blocks until `first` or `second` is readable (or hung up), or `deadline` passes.
pub(crate) fn wait_readable(
    first: BorrowedFd<'_>,
    second: BorrowedFd<'_>,
    deadline: Option<Instant>,
) -> io::Result<Readiness> {
    let mut fds = [
        libc::pollfd { fd: first.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: second.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 },
    ];
    loop {
        let timeout = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so a sub-millisecond remainder still sleeps instead of spinning.
                let ms = left.as_micros().div_ceil(1000);
                ms.min(i32::MAX as u128) as i32
            }
        };
        // SAFETY: `fds` is a live array of two pollfd structs.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if n == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(Readiness { first: fds[0].revents != 0, second: fds[1].revents != 0 });
    }
}

/// What a non-consuming look at a socket found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketState {
    /// Nothing to read: the peer is there and quiet.
    Quiet,
    /// Orderly EOF or a reset: the peer is gone.
    Closed,
    /// Bytes are waiting, which the protocol never sends after the handshake.
    Data,
}

/// Looks at a socket without consuming anything.
pub(crate) fn socket_state(sock: BorrowedFd<'_>) -> SocketState {
    let mut byte = 0u8;
    // SAFETY: `byte` is valid for a one-byte write.
    let n =
        unsafe { libc::recv(sock.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    match n {
        0 => SocketState::Closed,
        n if n > 0 => SocketState::Data,
        _ => match io::Error::last_os_error().kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => SocketState::Quiet,
            _ => SocketState::Closed,
        },
    }
}

/// Shuts a socket down in both directions (errors ignored: it may already be shut).
pub(crate) fn shutdown(fd: RawFd) {
    // SAFETY: shutdown takes scalars; the caller guarantees `fd` is still the open socket.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// What `fd` is, as `/proc/self/fd` names it (`anon_inode:[eventfd]`, `pipe:[123]`, a path);
/// `None` where `/proc` is not mounted, so nothing can be told.
pub(crate) fn fd_kind(fd: BorrowedFd<'_>) -> Option<String> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    Some(link.to_string_lossy().into_owned())
}

/// What `fd_kind` names an eventfd.
pub(crate) const EVENTFD_KIND: &str = "anon_inode:[eventfd]";

/// Makes an fd non-blocking.
pub(crate) fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL take and return ints; a bad fd is reported as an error.
    let flags = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) }).map(drop)
}

/// Sends `data` on a stream socket without blocking or raising SIGPIPE; what does not fit the
/// socket's buffer, or a peer gone, is dropped (for bells, where one byte already waiting is
/// as good as another).
pub(crate) fn send_nowait(sock: BorrowedFd<'_>, data: &[u8]) {
    // SAFETY: `data` is valid for reads of its length; the result is ignored on purpose.
    unsafe { libc::send(sock.as_raw_fd(), data.as_ptr().cast(), data.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
}

/// Reads what is waiting on a socket without consuming it or blocking.
pub(crate) fn peek(sock: BorrowedFd<'_>, buf: &mut [u8]) -> usize {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe {
        libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    n.max(0) as usize
}

/// Identity of a file: (device, inode).
pub(crate) fn file_id(path: &std::path::Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Test helpers that read what the kernel did with a mapping.
#[cfg(test)]
pub(crate) mod inspect {
    use super::Mapping;

    /// The host's setting for huge pages in shared memory (the bracketed word of
    /// `shmem_enabled`), or `None` where the kernel has no transparent huge pages.
    pub(crate) fn shmem_huge_setting() -> Option<String> {
        let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
        Some(text.split_once('[')?.1.split_once(']')?.0.to_owned())
    }

    /// Whether the host gives shared memory huge pages when a mapping asks for them.
    pub(crate) fn shmem_huge_on_advice() -> bool {
        matches!(shmem_huge_setting().as_deref(), Some("advise" | "within_size" | "always" | "force"))
    }

    /// KiB that the kernel maps with huge page-table entries now in the areas of `map` that
    /// overlap bytes `range`, from `/proc/self/smaps` (the advice splits a mapping into areas).
    pub(crate) fn huge_mapped_kib(map: &Mapping, range: std::ops::Range<usize>) -> u64 {
        let (from, to) = (map.as_ptr() as usize + range.start, map.as_ptr() as usize + range.end);
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut overlaps = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-').filter(|(a, _)| a.chars().all(|c| c.is_ascii_hexdigit())) {
                let (a, b) = (usize::from_str_radix(a, 16).unwrap_or(0), usize::from_str_radix(b, 16).unwrap_or(0));
                overlaps = a < to && b > from;
            } else if overlaps && (first == "ShmemPmdMapped:" || first == "FilePmdMapped:") {
                kib += line.split_whitespace().nth(1).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        kib
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::inspect::*;
    use super::*;

    #[test]
    fn draining_a_doorbell_never_blocks_even_when_its_peer_cleared_o_nonblock() {
        // An eventfd without O_NONBLOCK: what a peer that cleared the shared flag leaves.
        // SAFETY: eventfd takes scalar arguments only.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) }).map(owned).expect("eventfd");
        let (tx, rx) = std::sync::mpsc::channel();
        let drained = fd.try_clone().expect("dup");
        std::thread::spawn(move || {
            let empty = eventfd_drain(drained.as_fd());
            eventfd_signal(drained.as_fd());
            let _ = tx.send((empty, eventfd_drain(drained.as_fd()), eventfd_drain(drained.as_fd())));
        });
        // A watchdog, not a timing assertion: a blocking read never returns.
        let got = rx.recv_timeout(std::time::Duration::from_secs(30));
        if got.is_err() {
            eventfd_signal(fd.as_fd()); // let the stuck read go
        }
        assert_eq!(got.ok(), Some((false, true, false)), "empty, signalled, empty again; none blocking");
    }

    #[test]
    fn huge_page_advice_covers_whole_huge_pages_only() {
        let len = 16 << 20;
        let fd = memfd_create("advice").expect("memfd");
        set_len(fd.as_fd(), len as u64).expect("size");
        let map = Mapping::new(fd.as_fd(), len).expect("map");
        assert!(!map.advise_huge_pages(0..HUGE_PAGE - 1), "no whole huge page in it");
        assert!(!map.advise_huge_pages(5..5));
        assert!(!map.advise_huge_pages(usize::MAX - 1..usize::MAX), "clamped to the mapping");
        let has_thp = shmem_huge_setting().is_some();
        assert_eq!(map.advise_huge_pages(0..len), has_thp, "16 MiB always holds a whole huge page");
        // SAFETY: the mapping is `len` bytes, writable and ours alone.
        unsafe { std::ptr::write_bytes(map.as_ptr(), 1, len) };
        let huge = huge_mapped_kib(&map, 0..len);
        if shmem_huge_on_advice() {
            assert!(huge >= 2048, "the host allows huge pages in shared memory, yet none: {huge} KiB");
        } else {
            assert_eq!(huge, 0, "the host keeps shared memory in small pages ({:?})", shmem_huge_setting());
        }
    }
}
