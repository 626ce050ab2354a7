//! Choosing the compute device: `auto`, `cpu` or `cuda:N`.
//!
//! The default build has no CUDA code at all: `auto` is the CPU and `cuda:N` is a clear
//! error. A build with the `cuda` feature links no CUDA library (candle's CUDA crates are
//! patched to load them at run time, third_party/README.md), so it starts on any machine;
//! CUDA is used only after a probe: the NVIDIA driver must be loaded
//! (`/proc/driver/nvidia/version`), the driver, cuBLAS and cuRAND libraries must load
//! (cudarc's loader panics on a missing library), the driver must support CUDA 13.0
//! (the kernels' PTX) and the device must exist. Where the probe fails, `auto`
//! says once why it trains on the CPU and `cuda:N` is one error naming what is missing.
//! Device creation itself runs under `catch_unwind` as a last line of defence, so a
//! machine without a usable GPU gets an error (or the CPU for `auto`), never a panic.

use std::fmt;
use std::str::FromStr;

use candle_core::{Device, DeviceLocation};

use crate::error::{Error, Result};

/// A device choice as written on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// A GPU when one is present and usable, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: use auto, cpu or cuda:N")),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A short name of a device for logs, metrics and reports (`cpu`, `cuda:0`).
pub fn device_name(device: &Device) -> String {
    match device.location() {
        DeviceLocation::Cpu => "cpu".into(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Whether this build can use CUDA at all (the `cuda` feature).
pub const CUDA_BUILD: bool = cfg!(feature = "cuda");

/// The oldest driver API this build's kernels load on: nvcc 13.0 writes their PTX, and
/// a driver loads no PTX newer than its own CUDA version (docs/gpu.md).
pub const MIN_DRIVER_CUDA: i32 = 13000;

/// Why CUDA device `ordinal` cannot be used here, or `Ok` when it can: the driver is
/// loaded and new enough, the libraries candle needs load, and the device exists
/// (checked without creating a context).
pub fn cuda_probe(ordinal: usize) -> std::result::Result<(), String> {
    if !CUDA_BUILD {
        return Err("this edl was built without CUDA support (build it with \
                    `cargo build --release -p edl --features cuda`, docs/gpu.md)"
            .into());
    }
    if std::fs::metadata("/proc/driver/nvidia/version").is_err() {
        return Err("no NVIDIA driver is loaded (no /proc/driver/nvidia/version)".into());
    }
    let missing = missing_libraries();
    if !missing.is_empty() {
        return Err(format!(
            "the CUDA libraries {} cannot be loaded: put the folders holding them on \
             LD_LIBRARY_PATH (the driver installs libcuda.so.1; pip's nvidia-cublas and \
             nvidia-curand wheels put the others under site-packages/nvidia/*/lib)",
            missing.join(", ")
        ));
    }
    let (version, count) = driver_facts()?;
    if version < MIN_DRIVER_CUDA {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}, and this edl's kernels need {}.{} or \
             newer: update the driver (580 or later), or build edl with the nvcc of your \
             driver's CUDA version (docs/gpu.md)",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_CUDA / 1000,
            MIN_DRIVER_CUDA % 1000 / 10
        ));
    }
    if ordinal >= count {
        return Err(format!(
            "cuda:{ordinal} does not exist: the driver sees {count} GPU(s) (cuda:0 to \
             cuda:{})",
            count.saturating_sub(1)
        ));
    }
    Ok(())
}

/// The libraries candle's CUDA device needs that do not load (by cudarc's own lookup).
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn missing_libraries() -> Vec<&'static str> {
    // SAFETY: each call only tries `dlopen` on the library's usual names (and closes
    // it); loading NVIDIA's libraries runs no code of ours.
    let present = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
            ("libcurand", cudarc::curand::sys::is_culib_present()),
        ]
    };
    present
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| name)
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn missing_libraries() -> Vec<&'static str> {
    Vec::new()
}

/// The driver's CUDA version (`13000` for 13.0) and its number of devices.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn driver_facts() -> std::result::Result<(i32, usize), String> {
    use cudarc::driver::result;
    result::init().map_err(|e| format!("the NVIDIA driver does not start (cuInit): {e}"))?;
    let mut version = 0;
    // SAFETY: the driver is initialised (above) and `version` outlives the call.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| format!("cannot read the driver's CUDA version: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("cannot count the GPUs: {e}"))?;
    Ok((version, usize::try_from(count).unwrap_or(0)))
}

#[cfg(not(feature = "cuda"))]
fn driver_facts() -> std::result::Result<(i32, usize), String> {
    Err("this edl was built without CUDA support".into())
}

/// Resolves a choice to a device, never panicking. In a CUDA build, `auto` on a machine
/// where CUDA cannot be used says why once per process, then trains on the CPU.
pub fn select_device(choice: DeviceChoice) -> Result<Device> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            if !CUDA_BUILD {
                return Ok(Device::Cpu);
            }
            match cuda_probe(0).and_then(|()| open_cuda(0).map_err(|e| e.to_string())) {
                Ok(d) => Ok(d),
                Err(why) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!("--device auto: training on the CPU: {why}");
                    });
                    Ok(Device::Cpu)
                }
            }
        }
        DeviceChoice::Cuda(n) => {
            cuda_probe(n).map_err(|why| Error::Device(format!("cannot use cuda:{n}: {why}")))?;
            open_cuda(n)
        }
    }
}

fn open_cuda(n: usize) -> Result<Device> {
    match std::panic::catch_unwind(|| Device::new_cuda(n)) {
        Ok(Ok(d)) => Ok(d),
        Ok(Err(e)) => Err(Error::Device(format!("cannot open cuda:{n}: {e}"))),
        Err(_) => Err(Error::Device(format!(
            "cannot open cuda:{n}: the CUDA runtime failed to load"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_choices() {
        assert_eq!("auto".parse::<DeviceChoice>(), Ok(DeviceChoice::Auto));
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert!("gpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
        assert_eq!(DeviceChoice::Cuda(2).to_string(), "cuda:2");
        assert_eq!(device_name(&Device::Cpu), "cpu");
    }

    #[test]
    fn auto_and_cpu_never_fail() {
        // Whatever this machine has, `auto` and `cpu` give a device without panicking,
        // and `auto` is the CPU when the probe says CUDA cannot be used, a GPU when it
        // says it can.
        assert!(select_device(DeviceChoice::Cpu).is_ok_and(|d| d.is_cpu()));
        let auto = select_device(DeviceChoice::Auto).expect("auto always gives a device");
        assert_eq!(auto.is_cuda(), cuda_probe(0).is_ok(), "{auto:?}");
    }

    #[test]
    fn cuda_without_support_is_one_error_naming_the_fix() {
        let Err(why) = cuda_probe(0) else {
            // A usable GPU: cuda:0 opens (the GPU check covers it, docs/gpu.md).
            assert!(select_device(DeviceChoice::Cuda(0)).is_ok_and(|d| d.is_cuda()));
            return;
        };
        let e = select_device(DeviceChoice::Cuda(0)).expect_err("no usable CUDA here");
        let e = e.to_string();
        assert!(e.contains("cannot use cuda:0") && e.contains(&why), "{e}");
        if !CUDA_BUILD {
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
