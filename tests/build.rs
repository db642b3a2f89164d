//! Compiles `proto/conformance.proto` with tonic's own code generator, fed by protox (a protobuf
//! compiler in Rust), so no system `protoc` is needed. Nothing isthmus-specific is generated.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/conformance.proto");
    let descriptors = protox::compile(["proto/conformance.proto"], ["proto"])?;
    tonic_prost_build::compile_fds(descriptors)?;
    Ok(())
}
