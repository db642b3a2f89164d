//! Fuzz target: arbitrary bytes as the HTTP/2 stream of a unix- or TCP-socket client, through
//! the `:authority` filter (frames, padding, CONTINUATION, HPACK). It must end the connection
//! with an error or pass bytes on, never panic or grow without bound.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The filter catches its HPACK decoder's panics (see `authority.rs`); keep libfuzzer's hook
    // from aborting on those. A panic the filter does not catch still fails the run.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    isthmus::fuzz::http2_client_bytes(data)
});
