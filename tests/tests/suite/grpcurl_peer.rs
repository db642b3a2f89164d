//! grpcurl, a real gRPC client that knows nothing of the service but what server reflection
//! tells it, lists and calls the isthmus server's standard endpoints, `http://` and `unix://`.
//! Needs grpcurl in `.tools/bin` (`make tools`).

use isthmus_tests::{fresh_socket, spawn_tonic_peer};
use std::path::{Path, PathBuf};
use std::process::Command;

fn grpcurl() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/grpcurl");
    assert!(p.exists(), "{} is missing: run `make tools` to build it", p.display());
    p
}

/// Runs `grpcurl -plaintext ARGS…`; its stdout.
fn grpcurl_ok(args: &[&str]) -> String {
    let out = Command::new(grpcurl()).arg("-plaintext").args(args).output().expect("run grpcurl");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "grpcurl {args:?} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}

#[test]
fn grpcurl_lists_and_calls_through_reflection() {
    let unix = format!("unix://{}", fresh_socket("grpcurl").display());
    let (_server, addresses) = spawn_tonic_peer(&[&unix, "http://127.0.0.1:0"]);
    for addr in &addresses {
        // grpcurl takes gRPC's target forms: `unix:///path` (its `-unix` flag dials TCP in
        // v1.9.3), and `host:port`.
        let target = addr.strip_prefix("http://").unwrap_or(addr);
        let services = grpcurl_ok(&[target, "list"]);
        assert!(services.contains("conformance.Echo"), "{services}");
        assert!(services.contains("grpc.health.v1.Health"), "{services}");

        let reply = grpcurl_ok(&["-d", r#"{"payload":"aGk=","seq":"3"}"#, target, "conformance.Echo/Unary"]);
        assert!(reply.contains(r#""payload": "aGk=""#) && reply.contains(r#""seq": "3""#), "{reply}");

        let stream = grpcurl_ok(&["-d", r#"{"count":3,"size":2}"#, target, "conformance.Echo/ServerStream"]);
        assert_eq!(stream.matches(r#""payload""#).count(), 3, "{stream}");
        println!("grpcurl {target}: list, unary and server streaming ok");
    }
}
