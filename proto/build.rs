fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(
        &["proto/edl/sample.proto", "proto/edl/master.proto"],
        &["proto"],
    )?;
    tonic_prost_build::configure()
        // Packed floats of the pserver decode as zero-copy slices of the receive buffer,
        // and its large messages are encoded into buffers sized once.
        .bytes(".edl.pserver.v1")
        .codec_path("crate::codec::SizedProstCodec")
        .compile_protos(&["proto/edl/pserver.proto"], &["proto"])?;
    Ok(())
}
