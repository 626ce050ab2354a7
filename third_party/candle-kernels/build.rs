// edl's copy of candle-kernels 0.9.2's build script (third_party/README.md).
//
// - The kernels are compiled to PTX only, which the driver loads at run time. Upstream
//   also compiles its MoE kernels into a static library and links `libcudart`
//   dynamically, so every binary with the `cuda` feature needed the CUDA runtime library
//   to start at all; edl uses no MoE layer, and `src/ffi.rs` says so if one is called.
// - nvcc is found on PATH, under CUDA_ROOT/CUDA_PATH or /usr/local/cuda, or in the
//   workspace's `target/cuda-toolchain`; when there is none, `scripts/cuda-toolchain`
//   installs a pinned one from PyPI there.
// - Without CUDA_COMPUTE_CAP the PTX targets compute capability 7.5, which every newer
//   GPU's driver compiles on first load, also when the build machine has a GPU (upstream
//   asked its `nvidia-smi`, making a binary for that GPU only).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_COMPUTE_CAP: &str = "75";

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");
    for var in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME", "CUDA_TOOLKIT_ROOT_DIR"] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cuda_root = find_cuda(&out_dir);
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![cuda_root.join("bin")];
    dirs.extend(env::split_paths(&path));
    env::set_var("PATH", env::join_paths(dirs).unwrap());
    env::set_var("CUDA_ROOT", &cuda_root);
    if env::var_os("CUDA_COMPUTE_CAP").is_none() {
        env::set_var("CUDA_COMPUTE_CAP", DEFAULT_COMPUTE_CAP);
    }

    let ptx_path = out_dir.join("ptx.rs");
    let builder = bindgen_cuda::Builder::default()
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3");
    let bindings = builder.build_ptx().unwrap();
    bindings.write(&ptx_path).unwrap();
}

/// The CUDA root whose `bin/nvcc` and `include/cuda.h` the kernels are built with.
fn find_cuda(out_dir: &Path) -> PathBuf {
    let has =
        |root: &Path| root.join("bin/nvcc").is_file() && root.join("include/cuda.h").is_file();
    if let Some(root) = which("nvcc").and_then(|nvcc| Some(nvcc.parent()?.parent()?.to_path_buf()))
    {
        if has(&root) {
            return root;
        }
    }
    for var in [
        "CUDA_ROOT",
        "CUDA_PATH",
        "CUDA_HOME",
        "CUDA_TOOLKIT_ROOT_DIR",
    ] {
        if let Some(root) = env::var_os(var).map(PathBuf::from) {
            if has(&root) {
                return root;
            }
        }
    }
    let system = PathBuf::from("/usr/local/cuda");
    if has(&system) {
        return system;
    }
    let toolchain = target_dir(out_dir).join("cuda-toolchain");
    let root = toolchain.join("cuda");
    if has(&root) && toolchain.join("installed").is_file() {
        return root;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cuda-toolchain");
    println!("cargo::warning=no nvcc found: installing one with scripts/cuda-toolchain");
    let ok = Command::new("bash")
        .arg(&script)
        .arg(&toolchain)
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !has(&root) {
        panic!(
            "edl's `cuda` feature needs nvcc, and none was found (PATH, CUDA_ROOT, \
             /usr/local/cuda) nor installed by {}: run that script and read its error, or \
             put a CUDA toolkit's bin/ on PATH",
            script.display()
        );
    }
    root
}

fn which(program: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Cargo's target directory, found above OUT_DIR (`<target>[/<triple>]/<profile>/build/..`):
/// the first ancestor holding CACHEDIR.TAG, which cargo writes there.
fn target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .find(|a| a.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| out_dir.join("cuda-toolchain-home"))
}
