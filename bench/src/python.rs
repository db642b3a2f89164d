//! Python clients (`bench/py_client.py`, run in the project's venv) against Rust servers:
//! isthmus's sync and asyncio APIs over `shm://` (and the sync one given `localhost:PORT` of a
//! server that offers `shm://`, the upgrade) beside grpcio and grpc.aio against tonic over a
//! Unix socket, and a plain Python socket against the length-prefixed echo. And against Python
//! servers (`bench/py_server.py`): `py-py-isthmus` (isthmus to isthmus over `shm://`) beside
//! `py-py-grpcio` (grpcio to grpcio over a Unix socket), and the same with asyncio at both ends,
//! `py-aio-py-isthmus` beside `py-aio-py-grpc-aio`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::measure::{Budget, Sample};
use crate::system::{unique, Server, System};

/// The interpreter of the project's venv (`make python` builds isthmus into it).
pub(crate) fn python() -> Option<String> {
    let path = std::env::var("ISTHMUS_PYTHON").unwrap_or_else(|_| ".venv/bin/python".into());
    std::path::Path::new(&path).exists().then_some(path)
}

/// One Python client process and the Rust server it talks to.
pub struct PyClient {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// None for the floor, which has no server.
    _server: Option<Server>,
}

impl PyClient {
    /// Every Python system, or none (with a note) if the venv is missing.
    pub fn all() -> Vec<PyClient> {
        let Some(python) = python() else {
            eprintln!("no .venv/bin/python: skipping the Python clients (run `make python` first)");
            return Vec::new();
        };
        let shm = || {
            let addr = format!("shm://{}", unique("py"));
            (Server::spawn(&["serve-isthmus".into(), addr.clone()]), addr)
        };
        // The same server with an HTTP/2 port too; the client is given `localhost:PORT` and its
        // calls move to the shm:// endpoint the server offers (the upgrade).
        let upgraded = || {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port");
            let shm = format!("shm://{}", unique("pyup"));
            (Server::spawn(&["serve-isthmus".into(), shm, format!("127.0.0.1:{port}")]), format!("localhost:{port}"))
        };
        let socket = |tag: &str| std::env::temp_dir().join(format!("{}.sock", unique(tag))).display().to_string();
        let tonic = || {
            let path = socket("pytonic");
            (Server::spawn(&["serve-tonic".into(), path.clone()]).removing(&path), path)
        };
        let raw = || {
            let path = socket("pyuds");
            (Server::spawn(&["serve-uds".into(), path.clone()]).removing(&path), path)
        };
        // A Python server (bench/py_server.py), for the Python-to-Python systems.
        let py_server = |system: &str, target: String| {
            let mut command = Command::new(&python);
            command.args(["bench/py_server.py", system, &target]);
            let server = Server::spawn_command(command, &format!("py_server.py {system}"));
            (server.removing(&target), target)
        };
        vec![
            PyClient::start(&python, "py-isthmus-sync", "isthmus-sync", shm()),
            PyClient::start(
                &python,
                "py-py-isthmus",
                "isthmus-sync",
                py_server("isthmus", format!("shm://{}", unique("pypy"))),
            ),
            PyClient::start(&python, "py-py-grpcio", "grpc-sync", py_server("grpcio", socket("pypygrpc"))),
            PyClient::start(&python, "py-isthmus-upgraded", "isthmus-sync", upgraded()),
            PyClient::start(&python, "py-isthmus-aio", "isthmus-aio", shm()),
            // asyncio at both ends: an asyncio client of an asyncio Python server.
            PyClient::start(
                &python,
                "py-aio-py-isthmus",
                "isthmus-aio",
                py_server("isthmus-aio", format!("shm://{}", unique("pyaio"))),
            ),
            PyClient::start(&python, "py-aio-py-grpc-aio", "grpc-aio", py_server("grpc-aio", socket("pyaiogrpc"))),
            PyClient::start(&python, "py-grpc-sync-tonic-uds", "grpc-sync", tonic()),
            PyClient::start(&python, "py-grpc-aio-tonic-uds", "grpc-aio", tonic()),
            PyClient::start(&python, "py-raw-uds", "raw-uds", raw()),
            // The asyncio client loop with no transport: what asyncio itself allows.
            PyClient::spawn(&python, "py-aio-floor", "aio-floor", "-", None),
        ]
    }

    fn start(python: &str, name: &'static str, mode: &str, (server, target): (Server, String)) -> PyClient {
        PyClient::spawn(python, name, mode, &target, Some(server))
    }

    fn spawn(python: &str, name: &'static str, mode: &str, target: &str, server: Option<Server>) -> PyClient {
        let mut child = Command::new(python)
            .args(["bench/py_client.py", mode, target])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {python}: {e}"));
        let stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("client output");
        assert_eq!(line.trim(), "READY", "{name}: the Python client did not start");
        PyClient { name, child, stdin, stdout, _server: server }
    }

    fn ask(&mut self, command: String) -> Option<Sample> {
        writeln!(self.stdin, "{command}").and_then(|()| self.stdin.flush()).expect("client stdin");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("client stdout");
        let v: Vec<f64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        match v[..] {
            [p50_us, p99_us, rps] => Some(Sample { p50_us, p99_us, rps }),
            _ if line.trim() == "none" => None,
            _ => panic!("{}: the Python client failed (answered {line:?})", self.name),
        }
    }
}

impl Drop for PyClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl System for PyClient {
    fn name(&self) -> &'static str {
        self.name
    }

    fn round_trip(&mut self, size: usize, b: Budget) -> Sample {
        let command = format!("rt {size} {} {} {}", b.time.as_millis(), b.min_iters, b.max_iters);
        self.ask(command).expect("every system has a round trip")
    }

    fn pipelined(&mut self, size: usize, inflight: usize, b: Budget) -> Option<Sample> {
        self.ask(format!("pipe {size} {inflight} {} {} {}", b.time.as_millis(), b.min_iters, b.max_iters))
    }
}
