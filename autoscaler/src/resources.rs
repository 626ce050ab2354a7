//! Amounts of CPU, memory and GPU, as a pod requests them and a node offers them.

use std::ops::{Add, AddAssign, Mul};

use serde::{Deserialize, Serialize};

/// CPU in millicores, memory in MiB, whole GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Resources {
    /// Millicores (1000 = one core).
    pub cpu_milli: u64,
    /// Mebibytes.
    pub mem_mib: u64,
    /// Whole devices.
    pub gpu: u64,
}

impl Resources {
    /// Nothing.
    pub const ZERO: Resources = Resources {
        cpu_milli: 0,
        mem_mib: 0,
        gpu: 0,
    };

    /// `cores` CPUs (fractions allowed), `mem_gib` GiB and `gpu` devices.
    pub fn new(cores: f64, mem_gib: f64, gpu: u64) -> Resources {
        Resources {
            cpu_milli: (cores * 1000.0).round().max(0.0) as u64,
            mem_mib: (mem_gib * 1024.0).round().max(0.0) as u64,
            gpu,
        }
    }

    /// Whether `other` fits in `self` in every dimension.
    pub fn fits(&self, other: &Resources) -> bool {
        other.cpu_milli <= self.cpu_milli && other.mem_mib <= self.mem_mib && other.gpu <= self.gpu
    }

    /// `self - other` per dimension, floored at zero.
    pub fn saturating_sub(&self, other: &Resources) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli.saturating_sub(other.cpu_milli),
            mem_mib: self.mem_mib.saturating_sub(other.mem_mib),
            gpu: self.gpu.saturating_sub(other.gpu),
        }
    }

    /// Whether every dimension is zero.
    pub fn is_zero(&self) -> bool {
        *self == Resources::ZERO
    }
}

impl Add for Resources {
    type Output = Resources;
    fn add(self, o: Resources) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli + o.cpu_milli,
            mem_mib: self.mem_mib + o.mem_mib,
            gpu: self.gpu + o.gpu,
        }
    }
}

impl AddAssign for Resources {
    fn add_assign(&mut self, o: Resources) {
        *self = *self + o;
    }
}

impl Mul<u64> for Resources {
    type Output = Resources;
    fn mul(self, n: u64) -> Resources {
        Resources {
            cpu_milli: self.cpu_milli * n,
            mem_mib: self.mem_mib * n,
            gpu: self.gpu * n,
        }
    }
}

impl std::iter::Sum for Resources {
    fn sum<I: Iterator<Item = Resources>>(iter: I) -> Resources {
        iter.fold(Resources::ZERO, Add::add)
    }
}

impl std::fmt::Display for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} CPU, {} MiB",
            self.cpu_milli as f64 / 1000.0,
            self.mem_mib
        )?;
        if self.gpu > 0 {
            write!(f, ", {} GPU", self.gpu)?;
        }
        Ok(())
    }
}
