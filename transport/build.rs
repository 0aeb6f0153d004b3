//! Builds the native shims the `mori` and `hip` features load at node start.
//!
//! Each shim is a shared library of its own, loaded with dlopen rather than linked: a pdkv binary
//! built with these features starts on any host and reports what is missing (ROCm 7, mori, a GPU,
//! an RDMA NIC) as a clear error at node start instead of failing in the dynamic loader.
//!
//! - `mori`: `mori/pdkv_mori_shim.cpp` against mori's headers and `libmori_io.so` from
//!   `MORI_ROOT` (the `mori/` folder of the unpacked amd-mori wheel), HIP's headers (ROCm's, or
//!   Debian's `libamdhip64-dev`) and libibverbs' headers. Also builds the no-device stand-ins of
//!   ROCm 7's runtime the tests load mori against (`mori/standin/`).
//! - `hip`: `hip/pdkv_hip_shim.c` against HIP's headers, linked with `libamdhip64`.

use std::env;
use std::path::PathBuf;
#[cfg(any(feature = "mori", feature = "hip"))]
use std::{path::Path, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=mori");
    println!("cargo:rerun-if-changed=hip");
    println!("cargo:rerun-if-env-changed=MORI_ROOT");
    println!("cargo:rerun-if-env-changed=ROCM_PATH");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    #[cfg(feature = "mori")]
    build_mori(&out);
    #[cfg(feature = "hip")]
    build_hip(&out);
    let _ = out;
}

/// ROCm's include and library folders when ROCm is installed (`ROCM_PATH`, else `/opt/rocm`);
/// Debian's HIP packages install into the system folders, which need no flag.
#[cfg(any(feature = "mori", feature = "hip"))]
fn rocm_dirs() -> Vec<(String, PathBuf)> {
    let root = env::var_os("ROCM_PATH").map_or_else(|| PathBuf::from("/opt/rocm"), PathBuf::from);
    if root.join("include/hip/hip_runtime_api.h").exists() {
        vec![
            ("-I".into(), root.join("include")),
            ("-L".into(), root.join("lib")),
        ]
    } else {
        Vec::new()
    }
}

#[cfg(any(feature = "mori", feature = "hip"))]
fn run(mut command: Command, what: &str) {
    let status = command
        .status()
        .unwrap_or_else(|error| panic!("{what}: cannot run the compiler: {error}"));
    assert!(
        status.success(),
        "{what}: the compiler failed ({status}); command: {command:?}"
    );
}

#[cfg(any(feature = "mori", feature = "hip"))]
fn compiler(cpp: bool) -> Command {
    cc::Build::new().cpp(cpp).pic(true).get_compiler().to_command()
}

#[cfg(feature = "mori")]
fn build_mori(out: &Path) {
    let root = env::var_os("MORI_ROOT").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "the `mori` feature needs MORI_ROOT: the mori/ folder of the amd-mori wheel, unpacked \
             (README, \"AMD GPUs\": pip download --no-deps amd-mori==1.2.4 --python-version 3.10 \
             --only-binary=:all: --platform manylinux_2_35_x86_64)"
        )
    });
    let sources = root.join("_jit-sources");
    for needed in [root.join("libmori_io.so"), sources.join("include/mori/io/io.hpp")] {
        assert!(
            needed.exists(),
            "MORI_ROOT={} has no {}: point it at the wheel's mori/ folder",
            root.display(),
            needed.display()
        );
    }
    let shim = out.join("libpdkv_mori_shim.so");
    let mut command = compiler(true);
    command
        .args([
            "-std=c++20",
            "-O2",
            "-shared",
            "-DMSGPACK_NO_BOOST",
            "-D__HIP_PLATFORM_AMD__",
        ])
        .arg("-I")
        .arg(sources.join("include"))
        .arg("-I")
        .arg(sources.join("3rdparty/msgpack-c/include"))
        .arg("-I")
        .arg(sources.join("3rdparty/spdlog/include"));
    for (flag, dir) in rocm_dirs() {
        command.arg(format!("{flag}{}", dir.display()));
    }
    command
        .arg("mori/pdkv_mori_shim.cpp")
        .arg("-o")
        .arg(&shim)
        .arg(format!("-L{}", root.display()))
        .arg("-l:libmori_io.so")
        // mori's libraries next to the shim first (an install), then where it was built from.
        .arg("-Wl,-rpath,$ORIGIN")
        .arg(format!("-Wl,-rpath,{}", root.display()))
        // libmori_io.so needs ROCm 7's runtime, which the build host may lack: resolved at load.
        .arg("-Wl,--allow-shlib-undefined");
    run(command, "building the mori shim");
    println!("cargo:rustc-env=PDKV_MORI_SHIM_BUILT={}", shim.display());

    let standin = out.join("standin");
    std::fs::create_dir_all(&standin).expect("create the stand-in folder");
    for (source, map, soname) in [
        ("hip_no_device.c", "hip_no_device.map", "libamdhip64.so.7"),
        ("hsa_no_device.c", "hsa_no_device.map", "libhsa-runtime64.so.1"),
    ] {
        let mut command = compiler(false);
        command
            .args(["-O1", "-shared"])
            .arg(format!("mori/standin/{source}"))
            .arg("-o")
            .arg(standin.join(soname))
            .arg(format!("-Wl,-soname,{soname}"))
            .arg(format!("-Wl,--version-script=mori/standin/{map}"));
        run(command, "building a ROCm stand-in for the tests");
    }
    println!("cargo:rustc-env=PDKV_MORI_STANDIN_DIR={}", standin.display());
    let loopback = standin.join("libpdkv_mori_loopback.so");
    let mut command = compiler(false);
    command
        .args([
            "-std=c11",
            "-O2",
            "-shared",
            "-pthread",
            "mori/standin/loopback_shim.c",
            "-o",
        ])
        .arg(&loopback);
    run(command, "building the loopback mori shim for the tests");
    println!("cargo:rustc-env=PDKV_MORI_LOOPBACK_SHIM={}", loopback.display());
}

#[cfg(feature = "hip")]
fn build_hip(out: &Path) {
    let shim = out.join("libpdkv_hip_shim.so");
    let mut command = compiler(false);
    command.args(["-std=c11", "-O2", "-shared", "-D__HIP_PLATFORM_AMD__"]);
    let dirs = rocm_dirs();
    for (flag, dir) in &dirs {
        command.arg(format!("{flag}{}", dir.display()));
    }
    command.arg("hip/pdkv_hip_shim.c").arg("-o").arg(&shim);
    if let Some((_, lib)) = dirs.iter().find(|(flag, _)| flag == "-L") {
        command.arg(format!("-Wl,-rpath,{}", lib.display()));
    }
    command.arg("-lamdhip64");
    run(
        command,
        "building the HIP shim (needs HIP's headers and libamdhip64: ROCm, or Debian's libamdhip64-dev)",
    );
    println!("cargo:rustc-env=PDKV_HIP_SHIM_BUILT={}", shim.display());

    // For the tests: the same shim linked against a HIP whose one GPU is host memory.
    let standin = out.join("hip-standin");
    std::fs::create_dir_all(&standin).expect("create the HIP stand-in folder");
    let mut command = compiler(false);
    command
        .args(["-O1", "-shared", "hip/standin/hip_host_memory.c", "-o"])
        .arg(standin.join("libpdkv_hip_host_memory.so"));
    run(command, "building the host-memory HIP stand-in for the tests");
    let emulated = standin.join("libpdkv_hip_shim.so");
    let mut command = compiler(false);
    command.args(["-std=c11", "-O2", "-shared", "-D__HIP_PLATFORM_AMD__"]);
    for (flag, dir) in &dirs {
        if flag == "-I" {
            command.arg(format!("{flag}{}", dir.display()));
        }
    }
    command
        .arg("hip/pdkv_hip_shim.c")
        .arg("-o")
        .arg(&emulated)
        .arg(format!("-L{}", standin.display()))
        .arg(format!("-Wl,-rpath,{}", standin.display()))
        .arg("-lpdkv_hip_host_memory");
    run(command, "building the HIP shim over the host-memory stand-in");
    println!("cargo:rustc-env=PDKV_HIP_SHIM_HOST_MEMORY={}", emulated.display());
}
