//! A real grpcio (Python) client calls the isthmus server's standard endpoints: `unix://`, where
//! grpcio names the socket as the `:authority` (grpc/grpc#38142), and `http://`. The client uses
//! stubs that grpcio-tools generates and no special channel options. Needs the project's venv
//! (`make tools`).

use isthmus_tests::{fresh_socket, spawn_tonic_peer};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    let p = root().join(".venv/bin/python");
    assert!(p.exists(), "{} is missing: run `make tools` to create the project's venv", p.display());
    p
}

#[test]
fn a_grpcio_client_calls_the_unix_and_http_endpoints() {
    let unix = format!("unix://{}", fresh_socket("grpcio").display());
    let (_server, addresses) = spawn_tonic_peer(&[&unix, "http://127.0.0.1:0"]);
    // grpcio's forms: `unix:/abs/path`, and `host:port` for TCP.
    let targets = addresses.iter().map(|addr| match addr.strip_prefix("unix://") {
        Some(path) => format!("unix:{path}"),
        None => addr.trim_start_matches("http://").replace("127.0.0.1", "localhost"),
    });
    for target in targets {
        let out = Command::new(python())
            .arg(root().join("tests/python/grpcio_client.py"))
            .arg(&target)
            .arg(root().join("tests/proto"))
            .output()
            .expect("run python");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "grpcio → {target} failed:\n{stdout}\n{stderr}");
        assert!(stdout.contains("bidi ok"), "{stdout}");
        println!("grpcio → {target}:\n{stdout}");
    }
}
