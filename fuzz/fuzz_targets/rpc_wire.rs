//! Fuzz target: arbitrary bytes into every RPC frame-body decoder (HEADERS, TRAILERS, CANCEL,
//! GOAWAY). They must return an error or a value, never panic or read out of bounds.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus::wire::fuzz(data));
