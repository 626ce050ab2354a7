//! Generates the Rust code of edl's own `.proto` files (`proto/edl/`) and of the etcd v3
//! API (`third_party/`, vendored). The files are compiled by protox, a protobuf compiler
//! written in Rust, into descriptor sets that tonic-prost-build turns into code: building
//! edl needs no `protoc` and no system `.proto` includes.

use std::error::Error;

use prost_types::FileDescriptorSet;

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=third_party");

    let edl = compile(
        &["edl/sample.proto", "edl/master.proto", "edl/pserver.proto"],
        &["proto"],
    )?;
    tonic_prost_build::configure().compile_fds(only(&edl, &["edl.sample.v1", "edl.master.v1"]))?;
    tonic_prost_build::configure()
        // Packed floats of the pserver decode as zero-copy slices of the receive buffer,
        // and its large messages are encoded into buffers sized once.
        .bytes(".edl.pserver.v1")
        .codec_path("crate::codec::SizedProstCodec")
        .compile_fds(only(&edl, &["edl.pserver.v1"]))?;

    // The etcd v3 API: clients only (edl never serves it).
    let etcd = compile(&["etcd/api/etcdserverpb/rpc.proto"], &["third_party"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(only(
            &etcd,
            &["etcdserverpb", "mvccpb", "authpb", "versionpb"],
        ))?;
    Ok(())
}

/// Parses `files` and everything they import (searched in `includes`; protox knows
/// the well-known `google/protobuf/*.proto` files itself), with their comments.
fn compile(files: &[&str], includes: &[&str]) -> Result<FileDescriptorSet, Box<dyn Error>> {
    let mut compiler = protox::Compiler::new(includes)?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files(files)?;
    Ok(compiler.file_descriptor_set())
}

/// The files of `set` that belong to `packages`: code is generated for those only
/// (imports such as grpc-gateway options are needed to parse, not at run time).
fn only(set: &FileDescriptorSet, packages: &[&str]) -> FileDescriptorSet {
    FileDescriptorSet {
        file: set
            .file
            .iter()
            .filter(|f| packages.contains(&f.package()))
            .cloned()
            .collect(),
    }
}
