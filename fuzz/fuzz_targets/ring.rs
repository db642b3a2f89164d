//! Fuzz target: a hostile peer's ring bytes, cursors and release entries. It must never panic, hang or
//! read out of bounds (AddressSanitizer watches); errors are the expected outcome.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus_shm::fuzz::ring(data));
