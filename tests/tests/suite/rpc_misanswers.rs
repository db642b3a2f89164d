//! Answers an honest server never sends, from a server process that writes its frames by hand
//! (`shm-peer misanswering-server`): the client's call fails with a status that says what was
//! wrong, a frame that does not decode ends only its connection, and the same channel's next
//! call works. Both clients, async and blocking.

use isthmus::{CallOptions, Code, Status};
use isthmus_tests::{fresh_addr, run, Peer};

/// Each misanswer (the request that asks for it), the code its call ends with, a part of the
/// status message, and whether the connection ends with it (a frame that does not decode).
const CASES: [(&str, Code, &str, bool); 12] = [
    ("bad-trailers", Code::Internal, "malformed frame from the peer", true),
    ("bad-headers", Code::Internal, "malformed frame from the peer", true),
    ("bad-window", Code::Internal, "malformed frame from the peer", true),
    ("bad-goaway", Code::Internal, "malformed frame from the peer", true),
    ("message-inside-headers", Code::Internal, "HEADERS with a message inside", true),
    // gRPC: a code outside its sixteen is UNKNOWN; the message is the server's.
    ("unknown-code", Code::Unknown, "odd", false),
    ("no-response", Code::Internal, "without a response", false),
    ("two-responses", Code::Internal, "more than one response", false),
    // HEADERS come once; a peer that sent them on and on had each queued for the call.
    ("two-headers", Code::Internal, "a second HEADERS", false),
    // A cancelled call is not a success, whatever code its CANCEL carries.
    ("cancel-ok", Code::Cancelled, "cancelled by the peer", false),
    ("trailers-only", Code::PermissionDenied, "no headers first", false),
    // Frames for streams nobody opened are no fault: the call gets its echo.
    ("stray-frames", Code::Ok, "", false),
];

const PATH: &str = "/test.Echo/Unary";

fn check(case: &str, outcome: Result<Vec<u8>, Status>, code: Code, part: &str) {
    match outcome {
        Ok(reply) => {
            assert_eq!(code, Code::Ok, "{case}: succeeded, expected {code:?}");
            assert_eq!(reply, case.as_bytes(), "{case}: the echo");
        }
        Err(s) => {
            assert_eq!(s.code(), code, "{case}: {s:?}");
            assert!(s.message().contains(part), "{case}: {:?} does not say {part:?}", s.message());
        }
    }
}

#[test]
fn a_misanswered_call_fails_naming_the_fault_and_the_channel_goes_on() {
    let addr = fresh_addr("misanswers");
    let mut server = Peer::spawn(&["misanswering-server", &addr]);
    let options = CallOptions { timeout: Some(std::time::Duration::from_secs(30)), ..CallOptions::default() };

    let blocking = isthmus::blocking::Channel::connect(&addr).expect("connect");
    let mut ended = 0;
    for (case, code, part, ends) in CASES {
        let outcome = blocking.unary(PATH, case.as_bytes(), options.clone()).map(|r| r.message.to_vec());
        check(case, outcome, code, part);
        if ends {
            // The client hung up on the faulty connection: the server sees it go.
            server.expect_line("ENDED", std::time::Duration::from_secs(30));
            ended += 1;
        }
        let r = blocking.unary(PATH, b"after", options.clone()).unwrap_or_else(|s| panic!("{case}: next call: {s:?}"));
        assert_eq!(&r.message[..], b"after", "{case}");
    }
    assert_eq!(ended, 5);

    run({
        let (addr, options) = (addr.clone(), options.clone());
        async move {
            let ch = isthmus::Channel::connect(&addr).await.expect("connect");
            for (case, code, part, _) in CASES {
                let outcome = ch.unary(PATH, case.as_bytes(), options.clone()).await.map(|r| r.message.to_vec());
                check(case, outcome, code, part);
                let r = ch.unary(PATH, b"after", options.clone()).await;
                let r = r.unwrap_or_else(|s| panic!("{case}: next call: {s:?}"));
                assert_eq!(&r.message[..], b"after", "{case}");
            }
        }
    });
    assert!(server.child.try_wait().expect("status").is_none(), "the server process lives on");
}
