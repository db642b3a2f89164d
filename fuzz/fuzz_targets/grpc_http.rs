//! Fuzz target: arbitrary bytes as a gRPC-over-HTTP/2 body (the 5-byte message prefix) and as
//! the header values the bridge reads (`grpc-timeout`, metadata, `grpc-status`, details).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| isthmus::fuzz::grpc_http(data));
