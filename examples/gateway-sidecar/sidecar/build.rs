//! Generates the `Sidecar` service's tonic code from `../proto/sidecar.proto` with protox (no
//! system protoc), as any tonic user would.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto/sidecar.proto");
    let descriptors = protox::compile(["../proto/sidecar.proto"], ["../proto"])?;
    tonic_prost_build::compile_fds(descriptors)?;
    Ok(())
}
