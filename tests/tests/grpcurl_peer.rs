//! grpcurl, a real gRPC client that knows nothing of the service but what server reflection
//! tells it, lists and calls the isthmus server's standard endpoints, `http://` and `unix://`.
//! Needs grpcurl in `.tools/bin` (`make tools`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use isthmus_tests::Peer;

fn grpcurl() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/grpcurl");
    assert!(p.exists(), "{} is missing: run `make tools` to build it", p.display());
    p
}

/// Runs grpcurl with `address` (as its arguments take it) and `args`; its stdout.
fn run(address: &[&str], args: &[&str]) -> String {
    let out = Command::new(grpcurl()).arg("-plaintext").args(address).args(args).output().expect("run grpcurl");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "grpcurl {address:?} {args:?} failed:\n{stdout}\n{stderr}");
    stdout.into_owned()
}

#[test]
fn grpcurl_lists_and_calls_through_reflection() {
    let sock = std::env::temp_dir().join(format!("isthmus-grpcurl-{}.sock", std::process::id()));
    let unix = format!("unix://{}", sock.display());
    let mut server = Peer::spawn_bin("tonic-peer", &[&unix, "http://127.0.0.1:0"]);
    let mut endpoints: Vec<Vec<String>> = Vec::new();
    for _ in 0..2 {
        let line = server.expect_line("LISTENING ", Duration::from_secs(30));
        let addr = &line["LISTENING ".len()..];
        // grpcurl takes gRPC's target forms: `unix:///path` (its `-unix` flag dials TCP in
        // v1.9.3), and `host:port`.
        endpoints.push(match addr.strip_prefix("http://") {
            Some(host) => vec![host.into()],
            None => vec![addr.into()],
        });
    }
    for endpoint in &endpoints {
        let address: Vec<&str> = endpoint.iter().map(String::as_str).collect();
        let services = run(&address[..address.len() - 1], &[address[address.len() - 1], "list"]);
        assert!(services.contains("conformance.Echo"), "{services}");
        assert!(services.contains("grpc.health.v1.Health"), "{services}");

        let target = address[address.len() - 1];
        let flags = &address[..address.len() - 1];
        let reply = run(flags, &["-d", r#"{"payload":"aGk=","seq":"3"}"#, target, "conformance.Echo/Unary"]);
        assert!(reply.contains(r#""payload": "aGk=""#) && reply.contains(r#""seq": "3""#), "{reply}");

        let stream = run(flags, &["-d", r#"{"count":3,"size":2}"#, target, "conformance.Echo/ServerStream"]);
        assert_eq!(stream.matches(r#""payload""#).count(), 3, "{stream}");
        println!("grpcurl {endpoint:?}: list, unary and server streaming ok");
    }
}
