//! Fuzz target: arbitrary bytes as the HTTP/2 stream of a unix- or TCP-socket client, through
//! the `:authority` filter (frames, padding, CONTINUATION, HPACK). It must end the connection
//! with an error or pass bytes on, never panic or grow without bound.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus::fuzz::http2_client_bytes(data));
