//! Compiles `proto/conformance.proto` with tonic's own code generator, fed by protox (a protobuf
//! compiler in Rust), so no system `protoc` is needed. Nothing isthmus-specific is generated.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/conformance.proto");
    let descriptors = protox::compile(["proto/conformance.proto"], ["proto"])?;
    // The encoded descriptors too, for server reflection.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("conformance_descriptor.bin"), prost::Message::encode_to_vec(&descriptors))?;
    tonic_prost_build::compile_fds(descriptors)?;
    Ok(())
}
