//! Fuzz target: arbitrary bytes as the HTTP/2 stream of a unix- or TCP-socket client, through
//! the `:authority` filter (frames, padding, CONTINUATION, HPACK). It must end the connection
//! with an error or pass bytes on, never panic or grow without bound.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The filter catches its HPACK decoder's panics (see `authority.rs`): keep libfuzzer's hook
    // from aborting on those, and only those. Any other panic still reaches the previous hook
    // (libfuzzer's), which reports it and fails the run.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.location().is_some_and(|l| l.file().contains("fluke-hpack")) {
                previous(info);
            }
        }));
    });
    isthmus::fuzz::http2_client_bytes(data)
});
