//! Fuzz target: arbitrary bytes into the handshake decoder of peer data. It must never panic, hang or
//! read out of bounds (AddressSanitizer watches); errors are the expected outcome.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus_shm::fuzz::handshake(data));
