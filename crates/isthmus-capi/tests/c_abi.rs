//! The C ABI's own tests: `tests/c/abi_check.c`, a C program that uses the library only through
//! `include/isthmus.h`, built here by the system compiler under AddressSanitizer (LeakSanitizer
//! on: a leak or a use-after-free fails it) and run as real processes: a server (`abi_check
//! serve`), its clients over `shm://`, `unix://` and `http://` (`abi_check client`), a client
//! whose server is killed with SIGKILL mid-call (`abi_check peer-gone`), and a TLS server and
//! client (`abi_check serve-tls`, `client-tls`) with certificates made here (rcgen). The library
//! itself is not instrumented: ASan sees its heap (every allocation goes through the interposed
//! malloc, so LeakSanitizer counts them) and the C program's accesses, not the library's own
//! reads.
//!
//! LeakSanitizer cannot see a handle that was never freed (the library's registry keeps it
//! reachable), so the program also compares `isthmus_live_handles()` before and after each check
//! and requires 0 at the end.
//!
//! By hand, from the workspace root (`cargo build -p isthmus-capi` first):
//!
//! ```sh
//! cc -std=c11 -Wall -Wextra -Werror -fsanitize=address -fno-omit-frame-pointer -g -O1 -pthread \
//!   -Icrates/isthmus-capi/include crates/isthmus-capi/tests/c/abi_check.c \
//!   -Ltarget/debug -listhmus_capi -Wl,-rpath,$PWD/target/debug -o /tmp/abi_check
//! /tmp/abi_check serve shm://demo unix:///tmp/demo.sock   # prints "ready"; Ctrl-D stops it
//! /tmp/abi_check client shm://demo                        # in another shell
//! ```

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// ASan's settings for every process: leaks fail the run, reports go to stderr without an abort.
const ASAN_OPTIONS: &str = "detect_leaks=1:abort_on_error=0";

/// How long the C compiler may take.
const COMPILE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a server may take to print `ready`, and a client run (64 MiB copies under ASan).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a server may take to shut down once its stdin is closed.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// The tests share the machine's few cores: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A fresh directory under the system's temp dir, removed on drop (failures included).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let name = format!("isthmus-capi-{}-{}-{nanos}", std::process::id(), COUNT.fetch_add(1, Ordering::Relaxed));
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The directory that holds the `libisthmus_capi.so` this test was built with: this test
/// binary's own `deps` directory, where cargo builds the crate's cdylib before its integration
/// tests. Its parent (`target/debug`) gets a copy only from `cargo build`, so a copy there may
/// be older than the code under test: it is the fallback, not the first choice.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.ancestors().find(|p| p.file_name().is_some_and(|n| n == "deps")).unwrap_or_else(|| {
        panic!("{} is not in a cargo `deps` directory", exe.display());
    });
    let found = [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .find(|dir| dir.join("libisthmus_capi.so").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| {
            panic!("no libisthmus_capi.so in or beside {}: run `cargo build -p isthmus-capi`", deps.display())
        });
    found
}

/// Builds `tests/c/abi_check.c` into `scratch` with ASan; the binary's path.
fn build_abi_check(scratch: &Scratch) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = library_dir();
    let out = scratch.path("abi_check");
    let mut rpath = std::ffi::OsString::from("-Wl,-rpath,");
    rpath.push(&lib);
    let mut libdir = std::ffi::OsString::from("-L");
    libdir.push(&lib);
    let mut include = std::ffi::OsString::from("-I");
    include.push(crate_dir.join("include"));
    let spawned = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror"])
        .args(["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1", "-pthread"])
        .arg(include)
        .arg(crate_dir.join("tests/c/abi_check.c"))
        .arg(libdir)
        .arg("-listhmus_capi")
        .arg(rpath)
        .arg("-o")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let mut cc = match spawned {
        Ok(cc) => cc,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("no C compiler (`cc`) to build tests/c/abi_check.c: apt-get install gcc")
        }
        Err(e) => panic!("cannot run cc: {e}"),
    };
    let mut pipe = cc.stderr.take().expect("piped stderr");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + COMPILE_TIMEOUT;
    let status = loop {
        match cc.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = cc.kill();
                let _ = cc.wait();
                panic!("cc did not finish within {COMPILE_TIMEOUT:?}; killed");
            }
        }
    };
    let errors = errors.join().unwrap_or_default();
    assert!(
        status.success(),
        "cc failed to build tests/c/abi_check.c ({status}; AddressSanitizer needs gcc's libasan: apt-get install gcc):\n{errors}"
    );
    out
}

/// A process of the test: killed and reaped on drop, whatever way the test ends. Its stdout
/// arrives line by line on a channel; its stderr (ASan's reports) is kept for failure messages.
struct Proc {
    what: String,
    child: Child,
    /// Each line of stdout with when it came.
    lines: Receiver<(Instant, String)>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(what: &str, binary: &Path, args: &[&str], scratch: &Scratch, stdin: Stdio) -> Proc {
        Proc::spawn_with(what, binary, args, scratch, stdin, &[])
    }

    /// [`Proc::spawn`] with `env` set last (over the defaults).
    fn spawn_with(
        what: &str,
        binary: &Path,
        args: &[&str],
        scratch: &Scratch,
        stdin: Stdio,
        env: &[(&str, &str)],
    ) -> Proc {
        let mut child = Command::new(binary)
            .args(args)
            .env("ASAN_OPTIONS", ASAN_OPTIONS)
            // shm://NAME sockets (and a server's private loopback) then live in the scratch dir.
            .env("XDG_RUNTIME_DIR", &scratch.0)
            // Each check names the transport it tests: an HTTP/2 address stays on HTTP/2
            // rather than move to the server's shm:// endpoint (ADR 0013).
            .env("ISTHMUS_UPGRADE", "0")
            .envs(env.iter().copied())
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Proc { what: what.to_owned(), child, lines, seen: Vec::new(), stderr }
    }

    /// Everything it printed so far, for a failure message.
    fn transcript(&mut self) -> String {
        while let Ok((_, line)) = self.lines.try_recv() {
            self.seen.push(line);
        }
        let stderr = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
        format!("--- {} stdout:\n{}\n--- {} stderr:\n{}", self.what, self.seen.join("\n"), self.what, stderr)
    }

    /// The next line of stdout, within `timeout`.
    fn next_line(&mut self, timeout: Duration) -> String {
        self.next_line_at(timeout).1
    }

    /// [`next_line`](Self::next_line) with the time it was read.
    fn next_line_at(&mut self, timeout: Duration) -> (Instant, String) {
        match self.lines.recv_timeout(timeout) {
            Ok((at, line)) => {
                self.seen.push(line.clone());
                (at, line)
            }
            Err(RecvTimeoutError::Timeout) => {
                let transcript = self.transcript();
                panic!("{}: no line within {timeout:?}\n{transcript}", self.what)
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.wait(Duration::from_secs(5));
                let transcript = self.transcript();
                panic!("{}: stdout closed ({status})\n{transcript}", self.what)
            }
        }
    }

    /// Its exit status, within `timeout` (it is killed after that, and the test fails).
    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    let transcript = self.transcript();
                    panic!("{}: still running after {timeout:?}; killed\n{transcript}", self.what);
                }
                Err(e) => panic!("{}: cannot wait: {e}", self.what),
            }
        }
    }

    /// Waits for it to exit and for its output to end; its status and whole stdout.
    fn finish(&mut self, timeout: Duration) -> (ExitStatus, String) {
        let status = self.wait(timeout);
        // The reader thread ends at EOF, which follows the exit.
        while let Ok((_, line)) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(line);
        }
        (status, self.seen.join("\n"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Starts `abi_check serve TARGETS…` and waits for its `ready`.
fn start_server(binary: &Path, scratch: &Scratch, targets: &[&str]) -> Proc {
    let mut args = vec!["serve"];
    args.extend_from_slice(targets);
    start(binary, scratch, &args).0
}

/// Starts `abi_check ARGS…` as a server, waits for its `ready`, and reads the HTTP/2 addresses
/// it serves, as clients reach them.
fn start(binary: &Path, scratch: &Scratch, args: &[&str]) -> (Proc, Vec<String>) {
    let mut server = Proc::spawn("server", binary, args, scratch, Stdio::piped());
    let line = server.next_line(READY_TIMEOUT);
    assert_eq!(line, "ready", "the server's first line\n{}", server.transcript());
    let mut addresses = Vec::new();
    loop {
        let line = server.next_line(READY_TIMEOUT);
        match line.strip_prefix("address ") {
            Some(address) => addresses.push(address.to_owned()),
            None => {
                assert_eq!(line, "addresses end", "{}", server.transcript());
                return (server, addresses);
            }
        }
    }
}

/// Runs every client check against `target`; they must all pass.
fn run_client(binary: &Path, scratch: &Scratch, target: &str, server: &mut Proc) {
    let what = format!("client {target}");
    let mut client = Proc::spawn(&what, binary, &["client", target], scratch, Stdio::null());
    let (status, stdout) = client.finish(CLIENT_TIMEOUT);
    let last = stdout.lines().last().unwrap_or_default().to_owned();
    assert!(
        status.success() && last.ends_with(" passed, 0 failed") && stdout.contains("0 failed"),
        "{what}: {status}, last line {last:?}\n{}\n{}",
        client.transcript(),
        server.transcript()
    );
    println!("{what}:\n{stdout}");
}

#[test]
fn c_program_passes_every_check_over_shm_unix_and_http() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new();
    let binary = build_abi_check(&scratch);
    let shm = format!("shm://capi-{}", std::process::id());
    let unix = format!("unix://{}", scratch.path("s.sock").display());
    let (mut server, addresses) = start(&binary, &scratch, &["serve", &shm, &unix, "http://127.0.0.1:0"]);
    let http = addresses.iter().find(|a| a.starts_with("http://127.0.0.1:")).expect("the http:// endpoint");

    run_client(&binary, &scratch, &shm, &mut server);
    run_client(&binary, &scratch, &unix, &mut server);
    // Plain HTTP/2 over TCP (every process here runs with ISTHMUS_UPGRADE=0, so the client
    // stays there rather than move to the shm:// endpoint the server offers).
    run_client(&binary, &scratch, http, &mut server);

    drop(server.child.stdin.take()); // EOF: the server shuts down and frees everything
    let status = server.wait(EXIT_TIMEOUT);
    let transcript = server.transcript();
    assert!(status.success(), "the server exited with {status}\n{transcript}");
    println!("{transcript}");
}

/// The ABI's promise of no global state a second load breaks: the library loaded again from
/// another path (`dlopen`, `RTLD_LOCAL`), as two plugins of one host that each ship it would
/// load it, calls the same server beside the linked copy, each with its own handles.
#[test]
fn a_second_copy_of_the_library_works_beside_the_first() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new();
    let binary = build_abi_check(&scratch);
    let shm = format!("shm://capi-copy-{}", std::process::id());
    let mut server = start_server(&binary, &scratch, &[&shm]);
    let copy = scratch.path("libisthmus_capi_copy.so");
    std::fs::copy(library_dir().join("libisthmus_capi.so"), &copy).expect("a copy of the library");
    let copy = copy.to_str().expect("a UTF-8 path");
    let mut client = Proc::spawn("second-copy", &binary, &["second-copy", copy, &shm], &scratch, Stdio::null());
    let (status, stdout) = client.finish(CLIENT_TIMEOUT);
    assert!(
        status.success() && stdout.contains("second-copy: ok"),
        "second-copy: {status}\n{}\n{}",
        client.transcript(),
        server.transcript()
    );
    drop(server.child.stdin.take());
    assert!(server.wait(EXIT_TIMEOUT).success(), "the server\n{}", server.transcript());
}

/// A channel's upgrade flags against the process's default: here on (`ISTHMUS_UPGRADE=1`), so
/// a channel with no flag moves to the server's `shm://` endpoint and one with
/// `ISTHMUS_CHANNEL_NO_UPGRADE` stays on HTTP/2 (the other client checks run with it off, where
/// `ISTHMUS_CHANNEL_UPGRADE` moves a channel all the same).
#[test]
fn a_channels_upgrade_flags_overrule_the_processs_default() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new();
    let binary = build_abi_check(&scratch);
    let shm = format!("shm://capi-up-{}", std::process::id());
    let unix = format!("unix://{}", scratch.path("up.sock").display());
    let mut server = start_server(&binary, &scratch, &[&shm, &unix]);
    let what = "client-upgrade";
    let env = [("ISTHMUS_UPGRADE", "1")];
    let mut client = Proc::spawn_with(what, &binary, &[what, &unix], &scratch, Stdio::null(), &env);
    let (status, stdout) = client.finish(CLIENT_TIMEOUT);
    assert!(
        status.success() && stdout.contains("ok   upgrade_flags") && stdout.ends_with(" passed, 0 failed"),
        "{what}: {status}\n{}\n{}",
        client.transcript(),
        server.transcript()
    );
    drop(server.child.stdin.take());
    assert!(server.wait(EXIT_TIMEOUT).success(), "the server\n{}", server.transcript());
}

#[test]
fn a_call_ends_unavailable_when_the_server_is_killed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new();
    let binary = build_abi_check(&scratch);
    // An shm:// path this time (the other test uses a name), and a unix:// socket, where the
    // call rides HTTP/2.
    let shm = format!("shm://{}", scratch.path("gone.sock").display());
    let unix = format!("unix://{}", scratch.path("gone-h2.sock").display());
    for target in [shm, unix] {
        let mut server = start_server(&binary, &scratch, &[&target]);
        let what = format!("peer-gone {target}");
        let mut client = Proc::spawn(&what, &binary, &["peer-gone", &target], &scratch, Stdio::null());
        let line = client.next_line(READY_TIMEOUT);
        assert_eq!(line, "waiting", "{}", client.transcript());

        server.child.kill().expect("SIGKILL the server");
        let killed = Instant::now();
        let _ = server.child.wait();

        let (at, line) = client.next_line_at(Duration::from_secs(30));
        let after = at.saturating_duration_since(killed);
        assert!(line.contains("UNAVAILABLE"), "{what}: {line}\n{}", client.transcript());
        // Generous: the socket's EOF wakes the call at once (and the server's Sleep, were it
        // alive, would end the call CANCELLED after 5 s).
        assert!(after < Duration::from_secs(2), "{what}: returned {after:?} after the kill");
        let (status, _) = client.finish(EXIT_TIMEOUT);
        assert!(status.success(), "{what}: {status}\n{}", client.transcript());
        println!("{what}: {line} ({after:?} after the kill)");
    }
}

/// A CA for the TLS test's certificates.
struct Ca {
    pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let pem = params.self_signed(&key).expect("self-signed").pem();
        Ca { pem, issuer: rcgen::Issuer::new(params, key) }
    }

    /// A certificate for `localhost` and 127.0.0.1 (a server's, or with `client` a client's),
    /// and its key, as PEM.
    fn issue(&self, cn: &str, client: bool) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.subject_alt_names.push(rcgen::SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![match client {
            true => rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            false => rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        }];
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
}

#[test]
fn c_program_speaks_tls_and_mutual_tls() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new();
    let binary = build_abi_check(&scratch);
    let (server_ca, client_ca, other_ca) = (Ca::new("server CA"), Ca::new("client CA"), Ca::new("other CA"));
    let (server_cert, server_key) = server_ca.issue("localhost", false);
    let (client_cert, client_key) = client_ca.issue("abi-check client", true);
    let dir = scratch.path("tls");
    std::fs::create_dir(&dir).expect("mkdir tls");
    for (name, pem) in [
        ("server.crt", &server_cert),
        ("server.key", &server_key),
        ("client-ca.crt", &client_ca.pem),
        ("ca.crt", &server_ca.pem),
        ("client.crt", &client_cert),
        ("client.key", &client_key),
        ("other-ca.crt", &other_ca.pem),
    ] {
        std::fs::write(dir.join(name), pem).expect("write a TLS file");
    }
    let dir = dir.to_str().expect("a UTF-8 path");

    let (mut server, addresses) = start(&binary, &scratch, &["serve-tls", dir, "https://127.0.0.1:0"]);
    let address = addresses.first().expect("the https:// endpoint");
    assert!(address.starts_with("https://127.0.0.1:"), "{address}");

    let what = format!("client-tls {address}");
    let mut client = Proc::spawn(&what, &binary, &["client-tls", dir, address], &scratch, Stdio::null());
    let (status, stdout) = client.finish(CLIENT_TIMEOUT);
    assert!(
        status.success() && stdout.ends_with(" passed, 0 failed") && !stdout.contains("FAIL"),
        "{what}: {status}\n{}\n{}",
        client.transcript(),
        server.transcript()
    );
    println!("{what}:\n{stdout}");

    drop(server.child.stdin.take());
    let status = server.wait(EXIT_TIMEOUT);
    let transcript = server.transcript();
    assert!(status.success(), "the server exited with {status}\n{transcript}");
}
