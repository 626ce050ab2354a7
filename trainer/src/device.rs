//! Choosing the compute device: `auto`, `cpu` or `cuda:N`.
//!
//! The default build has no CUDA code at all: `auto` is the CPU and `cuda:N` is a clear
//! error. With the `cuda` feature, CUDA is used only after a probe: the NVIDIA driver must
//! be loaded (`/proc/driver/nvidia/version`) and `libcuda.so.1` must be present in a
//! library directory, because cudarc's dynamic loader panics when the library is
//! missing. Device creation itself runs under `catch_unwind` as a last line of defence,
//! so a machine without a usable GPU gets an error (or the CPU for `auto`), never a panic.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

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

/// A short name of a device for logs and metrics (`cpu`, `cuda:0`).
pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// Whether this build can use CUDA at all (the `cuda` feature).
pub const CUDA_BUILD: bool = cfg!(feature = "cuda");

/// Whether the NVIDIA driver and `libcuda.so.1` look present (without loading anything).
pub fn cuda_driver_present() -> bool {
    if std::fs::metadata("/proc/driver/nvidia/version").is_err() {
        return false;
    }
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/compat",
        "/usr/local/nvidia/lib64",
        "/lib/x86_64-linux-gnu",
    ] {
        dirs.push(d.into());
    }
    dirs.iter()
        .any(|d| std::fs::metadata(d.join("libcuda.so.1")).is_ok())
}

/// Resolves a choice to a device, never panicking.
pub fn select_device(choice: DeviceChoice) -> Result<Device> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => {
            if CUDA_BUILD && cuda_driver_present() {
                match open_cuda(0) {
                    Ok(d) => return Ok(d),
                    Err(e) => {
                        tracing::warn!(error = %e, "a GPU looked present but cannot be used; training on the CPU")
                    }
                }
            }
            Ok(Device::Cpu)
        }
        DeviceChoice::Cuda(n) => {
            if !CUDA_BUILD {
                return Err(Error::Device(format!(
                    "device cuda:{n} asked for, but this edl was built without CUDA support \
                     (rebuild with `--features cuda`)"
                )));
            }
            if !cuda_driver_present() {
                return Err(Error::Device(format!(
                    "device cuda:{n} asked for, but no NVIDIA driver / libcuda.so.1 was found"
                )));
            }
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
    }

    #[test]
    fn auto_and_cpu_never_fail() {
        // Whatever this machine has, `auto` and `cpu` give a device without panicking.
        assert!(select_device(DeviceChoice::Cpu).is_ok_and(|d| d.is_cpu()));
        let auto = select_device(DeviceChoice::Auto);
        assert!(auto.is_ok());
        if !CUDA_BUILD || !cuda_driver_present() {
            assert!(auto.is_ok_and(|d| d.is_cpu()));
        }
    }

    #[test]
    fn cuda_without_support_is_an_error() {
        if CUDA_BUILD && cuda_driver_present() {
            return;
        }
        let e = select_device(DeviceChoice::Cuda(0)).expect_err("no usable CUDA here");
        assert!(e.to_string().contains("cuda:0"), "{e}");
    }
}
