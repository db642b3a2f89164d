//! Fuzz target: arbitrary bytes as a TLS client's certificate, read for the names that a
//! server's auth context shows (subject, common name, alternative names).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus::fuzz::x509(data));
