//! gRPC's target names and TLS, across processes: a Rust client reaches `tonic-peer` (an
//! isthmus server in its own process) by every form grpc-core parses, over TLS and mutual TLS
//! with certificates made here (rcgen), fails UNAVAILABLE with the reason for every certificate
//! problem, and grpcurl calls the TLS endpoint with `-cacert`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use isthmus::{CallOptions, Certificate, ClientTlsConfig, Code, Identity};
use isthmus_tests::{fresh_socket, run, spawn_tonic_peer, Peer};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType};

/// A PEM certificate and key.
struct Pair {
    cert: String,
    key: String,
    der: Vec<u8>,
}

/// A CA that signs certificates for the tests.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let pem = params.self_signed(&key).expect("self-signed").pem();
        Ca { pem, issuer: Issuer::new(params, key) }
    }

    fn issue(&self, cn: &str, dns: &[&str], client: bool, expired: bool) -> Pair {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(dns.iter().map(|d| (*d).to_owned()).collect::<Vec<_>>()).expect("params");
        params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages =
            vec![if client { ExtendedKeyUsagePurpose::ClientAuth } else { ExtendedKeyUsagePurpose::ServerAuth }];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        Pair { cert: cert.pem(), key: key.serialize_pem(), der: cert.der().to_vec() }
    }
}

/// A temporary directory for certificate files, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("isthmus-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        Dir(dir)
    }

    fn write(&self, name: &str, data: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, data).expect("write");
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tonic-peer` serving `https://127.0.0.1:0` with `server`, requiring client certificates
/// from `client_ca` if given; returns it and its port.
fn tls_peer(dir: &Dir, server: &Pair, client_ca: Option<&str>) -> (Peer, u16) {
    let mut command = std::process::Command::new(isthmus_tests::peer_bin("tonic-peer"));
    command
        .arg("https://127.0.0.1:0")
        .env("ISTHMUS_TLS_CERT", dir.write("server.crt", &server.cert))
        .env("ISTHMUS_TLS_KEY", dir.write("server.key", &server.key));
    if let Some(ca) = client_ca {
        command.env("ISTHMUS_TLS_CLIENT_CA", dir.write("client-ca.crt", ca));
    }
    let mut peer = Peer::command(&mut command);
    let line = peer.expect_line("LISTENING ", Duration::from_secs(30));
    let port = line.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    assert!(line.starts_with("LISTENING https://"), "{line}");
    (peer, port)
}

fn client_tls(ca: &str) -> ClientTlsConfig {
    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca).expect("CA"))
}

/// The status of one unary call over a channel with `tls` to `target`.
async fn call_status(target: &str, tls: ClientTlsConfig) -> isthmus::Status {
    let channel = isthmus::Channel::builder(target).tls_config(tls).connect_lazy().expect("channel");
    let mut client = isthmus_tests::cases::client_on(channel);
    let err = client.unary(isthmus_tests::cases::request(b"x".to_vec(), 1)).await.expect_err("must fail");
    isthmus::Status::new(Code::from_u32(err.code() as u32), err.message())
}

#[test]
fn every_grpc_target_form_reaches_the_server() {
    let unix = fresh_socket("targets");
    let abstract_name = format!("isthmus-test-{}", std::process::id());
    let unix_target = format!("unix:{}", unix.display());
    let abstract_target = format!("unix-abstract:{abstract_name}");
    // `[::]:0` is dual-stack: v4 and v6 clients reach it.
    let (_peer, addresses) = spawn_tonic_peer(&["[::]:0", &unix_target, &abstract_target]);
    let port = addresses[0].rsplit(':').next().expect("port").to_owned();
    assert!(addresses[0].starts_with("http://[::]:"), "{addresses:?}");
    assert_eq!(addresses[2], abstract_target);
    let targets = [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("dns:localhost:{port}"),
        format!("dns:///localhost:{port}"),
        format!("ipv4:127.0.0.1:{port}"),
        format!("ipv4:127.0.0.1:1,127.0.0.1:{port}"),
        format!("ipv6:[::1]:{port}"),
        format!("http://localhost:{port}"),
        format!("unix://{}", unix.display()),
        unix_target.clone(),
        abstract_target.clone(),
    ];
    run(async move {
        // Every form makes a unary call with metadata both ways; one of each kind of socket
        // (TCP by name, TCP v6, unix path, abstract) makes every kind of call, 16 MiB included.
        for target in &targets {
            let mut client = isthmus_tests::cases::client(target).await;
            let reply = client.unary(isthmus_tests::cases::request(b"form".to_vec(), 9)).await;
            let reply = reply.unwrap_or_else(|e| panic!("{target}: {e:?}")).into_inner();
            assert_eq!((reply.payload.as_slice(), reply.seq), (&b"form"[..], 9), "{target}");
        }
        for target in [&targets[0], &targets[6], &targets[9], &targets[10]] {
            isthmus_tests::cases::every_kind_of_call(target).await;
            println!("{target}: every kind of call");
        }
    });
    drop(_peer);
    let _ = std::fs::remove_file(&unix);
}

/// A server that has stopped accepting, with its backlog full, at a `unix:` path or an
/// abstract name: an HTTP/2 client's call to it fails UNAVAILABLE at once (tokio's connect to a
/// path never waited; the abstract one blocked a runtime thread with no bound), and binding an
/// HTTP/2 server at that path finds it in use (its probe waited with no bound).
#[test]
fn a_unix_socket_whose_backlog_is_full_neither_hangs_calls_nor_binds() {
    let path = fresh_socket("http-full");
    let name = format!("isthmus-full-{}", std::process::id());
    let _at_path = isthmus_tests::FullBacklog::bind(&path);
    let _at_name = isthmus_tests::FullBacklog::bind_abstract(name.as_bytes());
    let targets = [format!("unix:{}", path.display()), format!("unix-abstract:{name}")];
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        run(async move {
            for target in &targets {
                let channel = isthmus::Channel::builder(target).upgrade(false).connect_lazy().expect("channel");
                let options = CallOptions { timeout: Some(Duration::from_secs(60)), ..CallOptions::default() };
                let called = channel.unary("/conformance.Echo/Unary", b"", options).await.map(drop);
                let _ = done.send((target.clone(), called.map_err(|s| s.code())));
            }
            let bound = isthmus::Server::builder().bind_all([targets[0].as_str()]).map(drop);
            let _ = done.send(("bind".to_owned(), bound.map_err(|s| s.code())));
        })
    });
    for _ in 0..3 {
        let (what, outcome) = ended.recv_timeout(Duration::from_secs(30)).expect("hung in connect(2)");
        let expected = if what == "bind" { Code::AlreadyExists } else { Code::Unavailable };
        assert_eq!(outcome, Err(expected), "{what}");
    }
}

#[test]
fn unknown_schemes_and_bad_ports_are_refused_by_name() {
    run(async {
        // A host with a colon that is no IPv6 address: other gRPC schemes, a typo. They were
        // taken for IPv6 literals, and every call failed later, looking the "host" up.
        let colons = ["vsock:3:5000", "xds:svc:443", "localhost::50051"];
        let forms = ["tcp://x:1", "localhost:http", "dns:///", "ipv4:300.1.1.1:5", "ipv6:[nope]:1", "unix-abstract:"];
        for bad in forms.into_iter().chain(colons) {
            let err = isthmus::Channel::lazy(bad).expect_err(bad);
            assert_eq!(err.code(), Code::InvalidArgument, "{bad}: {err:?}");
        }
        let err = isthmus::Channel::lazy("tcp://x:1").expect_err("tcp");
        assert!(err.message().contains("shm://NAME") && err.message().contains("unix-abstract:NAME"), "{err:?}");
        let err = isthmus::Server::builder().bind("https://127.0.0.1:0").expect_err("no TLS settings");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    });
}

#[test]
fn tls_and_mutual_tls_carry_every_kind_of_call() {
    let ca = Ca::new("isthmus test CA");
    let dir = Dir::new("ok");
    let server = ca.issue("localhost", &["localhost"], false, false);
    let client = ca.issue("client-7", &["client.example"], true, false);
    let (_tls, port) = tls_peer(&dir, &server, None);
    let mtls_dir = Dir::new("mtls");
    let (_mtls, mtls_port) = tls_peer(&mtls_dir, &server, Some(&ca.pem));
    run(async move {
        for (i, target) in
            [format!("https://localhost:{port}"), format!("localhost:{port}"), format!("ipv4:127.0.0.1:{port}")]
                .iter()
                .enumerate()
        {
            let channel = isthmus::Channel::builder(target).tls_config(client_tls(&ca.pem)).connect().await;
            let channel = channel.unwrap_or_else(|e| panic!("{target}: {e:?}"));
            if i == 0 {
                isthmus_tests::cases::every_kind_of_call_on(channel).await;
            } else {
                let mut client = isthmus_tests::cases::client_on(channel);
                let reply = client.unary(isthmus_tests::cases::request(b"t".to_vec(), 1)).await;
                assert_eq!(reply.unwrap_or_else(|e| panic!("{target}: {e:?}")).into_inner().seq, 1);
            }
        }
        let identity = Identity::from_pem(&client.cert, &client.key).expect("identity");
        let channel = isthmus::Channel::builder(&format!("localhost:{mtls_port}"))
            .tls_config(client_tls(&ca.pem).identity(identity))
            .connect()
            .await
            .expect("mTLS connect");
        let mut echo = isthmus_tests::cases::client_on(channel.clone());
        let reply = echo.unary(isthmus_tests::cases::request(b"who".to_vec(), 1)).await.expect("mTLS call");
        // The server's tonic service saw the client's certificate.
        assert_eq!(reply.metadata().get("x-peer-cn").and_then(|v| v.to_str().ok()), Some("client-7"));
        isthmus_tests::cases::every_kind_of_call_on(channel).await;
    });
}

#[test]
fn certificate_problems_say_which() {
    let ca = Ca::new("isthmus test CA");
    let other = Ca::new("another CA");
    let (good, expired, elsewhere) = (
        ca.issue("localhost", &["localhost"], false, false),
        ca.issue("localhost", &["localhost"], false, true),
        ca.issue("elsewhere", &["elsewhere.example"], false, false),
    );
    let intruder = other.issue("intruder", &["intruder.example"], true, false);
    let dirs = [Dir::new("p1"), Dir::new("p2"), Dir::new("p3"), Dir::new("p4")];
    let (_a, good_port) = tls_peer(&dirs[0], &good, None);
    let (_b, expired_port) = tls_peer(&dirs[1], &expired, None);
    let (_c, elsewhere_port) = tls_peer(&dirs[2], &elsewhere, None);
    let (_d, mtls_port) = tls_peer(&dirs[3], &good, Some(&ca.pem));
    run(async move {
        let cases = [
            (format!("localhost:{good_port}"), client_tls(&other.pem), "unknown issuer"),
            (format!("localhost:{expired_port}"), client_tls(&ca.pem), "expired"),
            (format!("localhost:{elsewhere_port}"), client_tls(&ca.pem), "not valid for the host name"),
            (format!("localhost:{mtls_port}"), client_tls(&ca.pem), "requires a client certificate"),
            (
                format!("localhost:{mtls_port}"),
                client_tls(&ca.pem).identity(Identity::from_pem(&intruder.cert, &intruder.key).expect("id")),
                "refused the client certificate",
            ),
        ];
        for (target, tls, words) in cases {
            let status = call_status(&target, tls).await;
            assert_eq!(status.code(), Code::Unavailable, "{target}: {status:?}");
            assert!(status.message().contains(words), "{target}: {status:?} should say {words:?}");
        }
        // The name the certificate covers can be named instead of the target's host.
        let channel = isthmus::Channel::builder(&format!("127.0.0.1:{elsewhere_port}"))
            .tls_config(client_tls(&ca.pem).domain_name("elsewhere.example"))
            .connect_lazy()
            .expect("channel");
        isthmus_tests::cases::every_kind_of_call_on(channel).await;
        // So can the authority, which TLS then checks the certificate against, as grpc-go's
        // `WithAuthority` and grpcio's `grpc.default_authority` do; the TLS settings' own name
        // still comes first.
        let channel = isthmus::Channel::builder(&format!("127.0.0.1:{elsewhere_port}"))
            .tls_config(client_tls(&ca.pem))
            .authority("elsewhere.example")
            .connect_lazy()
            .expect("channel");
        isthmus_tests::cases::every_kind_of_call_on(channel).await;
        let channel = isthmus::Channel::builder(&format!("127.0.0.1:{elsewhere_port}"))
            .tls_config(client_tls(&ca.pem).domain_name("localhost"))
            .authority("elsewhere.example")
            .connect_lazy()
            .expect("channel");
        let status =
            channel.unary("/conformance.Echo/Unary", b"", CallOptions::default()).await.expect_err("localhost");
        assert!(status.message().contains("not valid for the host name"), "{status:?}");
    });
}

#[test]
fn grpcurl_calls_the_tls_endpoint_with_its_ca() {
    let grpcurl = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/grpcurl");
    assert!(grpcurl.exists(), "{} is missing: run `make tools` to build it", grpcurl.display());
    let ca = Ca::new("isthmus test CA");
    let dir = Dir::new("grpcurl");
    let server = ca.issue("localhost", &["localhost"], false, false);
    let client = ca.issue("grpcurl", &[], true, false);
    let (_peer, port) = tls_peer(&dir, &server, Some(&ca.pem));
    let ca_file = dir.write("ca.crt", &ca.pem);
    let (cert, key) = (dir.write("client.crt", &client.cert), dir.write("client.key", &client.key));
    let out = std::process::Command::new(&grpcurl)
        .args(["-cacert", &ca_file.to_string_lossy(), "-cert", &cert.to_string_lossy(), "-key", &key.to_string_lossy()])
        .args(["-d", r#"{"payload":"aGk=","seq":"3"}"#, &format!("localhost:{port}"), "conformance.Echo/Unary"])
        .output()
        .expect("run grpcurl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "grpcurl failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(r#""payload": "aGk=""#), "{stdout}");
    // Without the client certificate the mTLS endpoint refuses grpcurl.
    let out = std::process::Command::new(&grpcurl)
        // grpc-go keeps redialling a refused TLS connection until its connect timeout (10 s by
        // default): the refusal is the expected outcome, so it need not take that long.
        .args(["-connect-timeout", "3", "-cacert", &ca_file.to_string_lossy(), &format!("localhost:{port}"), "list"])
        .output()
        .expect("run grpcurl");
    assert!(!out.status.success(), "grpcurl without a client certificate got in");
}

#[test]
fn no_client_can_claim_another_identity() {
    run(async {
        let shm = isthmus_tests::fresh_addr("peer-claims");
        let bound = isthmus::Server::builder()
            .handler("/t.Who/Am", |mut call: isthmus::ServerCall| async move {
                let _ = call.recv().await?;
                let leaked = call.metadata().iter().filter(|(k, _)| k.starts_with("x-isthmus-peer")).count();
                let answer = format!(
                    "{} tls={} cert={} leaked={leaked}",
                    call.peer(),
                    call.is_tls(),
                    call.peer_certificate().is_some()
                );
                call.send(answer.as_bytes()).await
            })
            .bind_all([shm.as_str(), "http://127.0.0.1:0"])
            .expect("bind");
        let http = bound.http_addresses().remove(0);
        tokio::spawn(bound.serve());
        let mut forged = isthmus::MetadataMap::new();
        forged.append("x-isthmus-peer", "ipv4:6.6.6.6:1").expect("ascii");
        forged.append("x-isthmus-peer-tls", "1").expect("ascii");
        // A real certificate, which the handler would take if it believed the metadata.
        let forged_cert = Ca::new("forger").issue("forged", &["forged.example"], true, false).der;
        forged.append_bin("x-isthmus-peer-cert-bin", forged_cert).expect("bin");
        let options = || isthmus::CallOptions { metadata: forged.clone(), ..Default::default() };
        let over_shm = isthmus::Channel::connect(&shm).await.expect("shm");
        let reply = over_shm.unary("/t.Who/Am", b"", options()).await.expect("shm call");
        let said = String::from_utf8_lossy(&reply.message).into_owned();
        assert_eq!(said, format!("shm:pid={},uid={} tls=false cert=false leaked=0", std::process::id(), own_uid()));
        let over_http = isthmus::Channel::connect(&http).await.expect("http");
        let reply = over_http.unary("/t.Who/Am", b"", options()).await.expect("http call");
        let said = String::from_utf8_lossy(&reply.message).into_owned();
        assert!(said.starts_with("ipv4:127.0.0.1:") && said.ends_with(" tls=false cert=false leaked=0"), "{said}");
    });
}

/// A handler sees its caller's user agent in its metadata as `user-agent`, as grpcio's and
/// grpc-go's handlers do: the agent a channel names (`ChannelBuilder::user_agent`) over
/// `shm://` and over HTTP/2 (tonic's after it there), and an HTTP/2 client's own `user-agent`
/// header, which the loopback carries, never a claim in its metadata. Passing that metadata on
/// to a call of its own sends no `user-agent`: an `shm://` server would refuse one as
/// malformed, and end the connection.
#[test]
fn a_handler_sees_its_callers_user_agent_and_does_not_send_it_on() {
    run(async {
        let shm = isthmus_tests::fresh_addr("user-agent");
        let agent = |call: &isthmus::ServerCall| call.metadata().get("user-agent").unwrap_or("none").to_owned();
        let onward = shm.clone();
        let bound = isthmus::Server::builder()
            .handler("/t.Who/Agent", move |mut call: isthmus::ServerCall| async move {
                let _ = call.recv().await?;
                let answer = agent(&call);
                call.send(answer.as_bytes()).await
            })
            .handler("/t.Who/Onward", move |mut call: isthmus::ServerCall| {
                let onward = onward.clone();
                async move {
                    let _ = call.recv().await?;
                    let seen = agent(&call);
                    let ch = isthmus::Channel::connect(&onward).await?;
                    let options = isthmus::CallOptions { metadata: call.metadata().clone(), ..Default::default() };
                    let reply = ch.unary("/t.Who/Agent", b"", options).await?;
                    call.send(format!("{seen} then {}", String::from_utf8_lossy(&reply.message)).as_bytes()).await
                }
            })
            .bind_all([shm.as_str(), "http://127.0.0.1:0"])
            .expect("bind");
        let http = bound.http_addresses().remove(0);
        tokio::spawn(bound.serve());
        let said = |reply: isthmus::Response| String::from_utf8_lossy(&reply.message).into_owned();
        let none = || isthmus::CallOptions::default();

        let plain = isthmus::Channel::connect(&shm).await.expect("shm");
        assert_eq!(said(plain.unary("/t.Who/Agent", b"", none()).await.expect("shm call")), "none");
        let named = isthmus::Channel::builder(&shm).user_agent("rust-test/1.0").connect().await.expect("shm");
        assert_eq!(said(named.unary("/t.Who/Agent", b"", none()).await.expect("shm call")), "rust-test/1.0");
        let blocking = isthmus::blocking::Channel::lazy(&shm).expect("blocking");
        blocking.set_user_agent("rust-test/1.1").expect("an agent");
        let reply = tokio::task::spawn_blocking(move || blocking.unary("/t.Who/Agent", b"", none()))
            .await
            .expect("joins")
            .expect("blocking call");
        assert_eq!(said(reply), "rust-test/1.1");
        let over_http =
            isthmus::Channel::builder(&http).user_agent("rust-test/2.0").upgrade(false).connect().await.expect("http");
        let seen = said(over_http.unary("/t.Who/Agent", b"", none()).await.expect("http call"));
        assert!(seen.starts_with("rust-test/2.0 tonic/"), "{seen}");
        for bad in [String::new(), "caf\u{e9}".into(), "a\nb".into(), "x".repeat(1025)] {
            for target in [&shm, &http] {
                let refused = isthmus::Channel::builder(target).user_agent(bad.as_str()).connect().await;
                let refused = refused.expect_err("a bad agent");
                assert_eq!(refused.code(), isthmus::Code::InvalidArgument, "{target} {bad:?}: {refused}");
            }
        }

        // tonic's own client, whose agent is its header: a claim in its metadata is dropped.
        let seen = tonic_call(&http, http::HeaderValue::from_static("agent-test/7.0"), "/t.Who/Onward").await;
        assert!(seen.starts_with("agent-test/7.0"), "the caller's own agent, not a claimed one: {seen}");
        assert!(seen.ends_with(" then none"), "the agent went on with the metadata: {seen}");
        // An agent that is not printable ASCII goes nowhere, and the claim does not stand in.
        let odd = http::HeaderValue::from_bytes(b"caf\xe9/1.0").expect("obs-text is a header value");
        assert_eq!(tonic_call(&http, odd, "/t.Who/Agent").await, "none");
    });
}

/// A call of `path` by tonic's own HTTP/2 client, with `agent` as its `user-agent` and a claim
/// of another in its metadata: the reply, as text.
async fn tonic_call(http: &str, agent: http::HeaderValue, path: &'static str) -> String {
    let tonic = tonic::transport::Endpoint::from_shared(http.to_owned())
        .expect("endpoint")
        .user_agent(agent)
        .expect("agent")
        .connect()
        .await
        .expect("tonic connect");
    let mut grpc = tonic::client::Grpc::new(tonic);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(bytes::Bytes::new());
    request.metadata_mut().insert("x-isthmus-peer-agent", "claimed/3.0".parse().expect("ascii"));
    let path = http::uri::PathAndQuery::from_static(path);
    let reply = grpc.unary(request, path, isthmus::BytesCodec).await.expect("tonic call");
    String::from_utf8_lossy(reply.get_ref()).into_owned()
}

fn own_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

#[test]
fn wait_for_ready_connects_a_channel_whose_first_attempt_lost_its_caller() {
    // Calls start the channel's connection and give up (a deadline, a caller that drops its
    // call) while the TLS handshake waits. The attempt goes on without them, so a call that waits
    // for READY (and sends nothing until then) is carried once the way opens. (A review asked
    // whether CONNECTING could then stick with nobody driving the attempt.)
    let ca = Ca::new("isthmus test CA");
    let dir = Dir::new("gate");
    let server = ca.issue("localhost", &["localhost"], false, false);
    let (_peer, port) = tls_peer(&dir, &server, None);
    let gate = isthmus_tests::TcpProxy::held(format!("127.0.0.1:{port}"));
    run(async move {
        let channel = isthmus::Channel::builder(&format!("https://{}", gate.addr))
            .tls_config(client_tls(&ca.pem))
            .connect_lazy()
            .expect("channel");
        let path = "/conformance.Echo/Unary";
        let quick = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
        let status = channel.unary(path, &b""[..], quick).await.expect_err("the handshake is held");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        // And one whose caller drops it.
        let dropped =
            tokio::time::timeout(Duration::from_millis(300), channel.unary(path, &b""[..], CallOptions::default()));
        dropped.await.expect_err("the handshake is held");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(channel.connectivity(false), isthmus::Connectivity::Connecting);

        gate.open();
        let ready =
            CallOptions { timeout: Some(Duration::from_secs(20)), wait_for_ready: true, ..CallOptions::default() };
        let began = std::time::Instant::now();
        channel.unary(path, &b""[..], ready).await.expect("a call once the way is open");
        assert!(began.elapsed() < Duration::from_secs(10), "took {:?}", began.elapsed());
    });
}
