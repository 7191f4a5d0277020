//! Compiles `proto/bigfleet/v1alpha1/provider.proto` with the vendored protoc, so a fresh machine
//! needs nothing but cargo. A `$PROTOC` in the environment still wins.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = match std::env::var_os("PROTOC") {
        Some(path) => PathBuf::from(path),
        None => protoc_bin_vendored::protoc_bin_path()?,
    };
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    // MachineList is written by hand (src/list.rs) so a server can emit machines it already
    // encoded; its wire form is exactly the generated one.
    config.extern_path(".bigfleet.v1alpha1.MachineList", "crate::list::MachineList");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("bigfleet_v1alpha1_descriptor.bin"))
        .compile_with_config(
            config,
            &["proto/bigfleet/v1alpha1/provider.proto"],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
