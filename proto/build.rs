fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(
        &["proto/edl/sample.proto", "proto/edl/master.proto"],
        &["proto"],
    )?;
    Ok(())
}
