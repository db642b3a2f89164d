//! Fuzz target: a hostile client's ring and arena bytes, read by a server's `Receiver`: frames,
//! arena descriptors, messages in pieces and their reassembly under small limits. It must never
//! panic, hang or read out of bounds (AddressSanitizer watches); errors are the expected outcome.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus_shm::fuzz::receive(data));
