//! Compiles `proto/etcdserverpb/rpc.proto` (the part of etcd's v3 API the state store calls)
//! with the vendored protoc, so a fresh machine needs nothing but cargo. A `$PROTOC` in the
//! environment still wins.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = match std::env::var_os("PROTOC") {
        Some(path) => PathBuf::from(path),
        None => protoc_bin_vendored::protoc_bin_path()?,
    };
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .compile_with_config(config, &["proto/etcdserverpb/rpc.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
