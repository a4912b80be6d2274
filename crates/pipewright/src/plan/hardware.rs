//! The machines a plan is for: a small JSON file per kind of node (devices per node, each
//! device's memory, peak FLOP/s, memory bandwidth, and the links inside and between nodes),
//! and byte sizes with units (`4GiB`, `512MiB`) as the planner reads and prints them.
//!
//! Four files ship with the crate (`hardware/*.json`, also built in by name): `h100-node` (8
//! H100 SXM per node, NVLink inside, 400 Gb/s InfiniBand between), `a100-node` (8 A100 SXM
//! 80GB, NVLink 3 inside, 200 Gb/s HDR InfiniBand per GPU between: NVIDIA's DGX A100 and
//! Selene), both from published figures; `h200-node` (8 H200 SXM, the H100's links), its
//! curves, flash attention rates and memory bandwidth measured on one H200; and `cpu-2core`
//! (the 2-core machine pipewright's CI runs on, where every rank of a job shares one CPU).
//! Each carries matrix-product curves by shape ([`GemmCurve`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::attention_rate::{AttentionRate, AttentionTiming};
use super::gemm::{GemmCurve, GemmTiming};
pub use crate::runtime::bytes::{format_bytes, parse_bytes};
use crate::{invalid, Error, Result};

/// A link between devices: a message of `b` bytes takes `latency_s + b / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Seconds before the first byte arrives.
    pub latency_s: f64,
    /// Bytes per second of one device's share of the link.
    pub bandwidth_bytes_per_s: f64,
    /// An all-reduce measured over this link (`pipewright bench comm --out`), used for groups
    /// of its size instead of the ring formula.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_reduce: Option<AllReduce>,
}

/// An all-reduce of `b` bytes over `world` ranks measured to take `latency_s + b / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllReduce {
    /// Ranks the fit was measured over.
    pub world: usize,
    /// Seconds of an empty message.
    pub latency_s: f64,
    /// Bytes per second beyond the latency.
    pub bandwidth_bytes_per_s: f64,
}

/// The most a fitted bandwidth may be (a zero-copy transfer fits an infinite one).
const FASTEST: f64 = 1e18;

impl Link {
    /// The link and its all-reduce fitted (least squares, `seconds = latency + bytes /
    /// bandwidth`) to timings of `(bytes, seconds)`: one-way transfers and all-reduces over
    /// `world` ranks (`pipewright bench comm`).
    pub fn fit(p2p: &[(f64, f64)], all_reduce: &[(f64, f64)], world: usize) -> Self {
        let line = |points: &[(f64, f64)]| {
            let f = super::profile::Fit::through(points);
            (f.fixed_s, 1.0 / f.per_sample_s.max(1.0 / FASTEST))
        };
        let (latency_s, bandwidth_bytes_per_s) = line(p2p);
        let (l, b) = line(all_reduce);
        Link {
            latency_s,
            bandwidth_bytes_per_s,
            all_reduce: Some(AllReduce {
                world,
                latency_s: l,
                bandwidth_bytes_per_s: b,
            }),
        }
    }

    /// Reads a link written by `pipewright bench comm --out`.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
        let link: Link = serde_json::from_str(&text).map_err(|e| {
            invalid!(
                "link file {} is malformed: {e} (write one with `pipewright bench comm --out FILE`)",
                path.display()
            )
        })?;
        check_link(&link, &path.display().to_string(), "link")?;
        Ok(link)
    }

    /// Seconds to send `bytes` from one device to another.
    pub fn p2p(&self, bytes: f64) -> f64 {
        self.latency_s + bytes / self.bandwidth_bytes_per_s
    }

    /// Seconds of a ring all-reduce of `bytes` over `n` devices: 2 (n - 1) steps, each
    /// moving `bytes / n` (what NCCL's and Open MPI's ring algorithms cost).
    pub fn all_reduce(&self, n: usize, bytes: f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        if let Some(m) = self.all_reduce.filter(|m| m.world == n) {
            return m.latency_s + bytes / m.bandwidth_bytes_per_s;
        }
        let steps = 2.0 * (n - 1) as f64;
        steps * (self.latency_s + bytes / n as f64 / self.bandwidth_bytes_per_s)
    }

    /// Seconds of an all-reduce of a few bytes (a flag, a loss, a norm's squares) over `n`
    /// devices: a tree's `2 log2(n)` latencies, as NCCL's tree and MPI's recursive doubling
    /// run small messages (a ring's `2 (n - 1)` would charge 3072 GPUs 61 ms for a scalar).
    pub fn scalar_all_reduce(&self, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        2.0 * (n as f64).log2().ceil() * self.latency_s
    }

    /// Seconds of a ring all-gather (or reduce-scatter) of `bytes` in all over `n` devices:
    /// half an all-reduce's steps.
    pub fn all_gather(&self, n: usize, bytes: f64) -> f64 {
        self.all_reduce(n, bytes) / 2.0
    }

    /// Seconds of an all-to-all over `n` devices of which each holds `bytes` spread evenly
    /// over the others: `n - 1` exchanges, each moving `bytes / n` (expert parallelism's
    /// dispatch or combine).
    pub fn all_to_all(&self, n: usize, bytes: f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let k = (n - 1) as f64;
        k * self.latency_s + k * bytes / n as f64 / self.bandwidth_bytes_per_s
    }
}

/// One kind of node of a cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// What the file describes (printed with the plan).
    pub name: String,
    /// Devices that compute side by side in one node. Ranks beyond this share the devices
    /// (a CPU node is one device: its ranks share its cores).
    pub devices_per_node: usize,
    /// Cores of one device that ranks sharing it divide among themselves (a CPU's cores; 1
    /// for a GPU, whose ranks each have their own).
    #[serde(default = "one")]
    pub cores_per_device: usize,
    /// The share of the device's product rate one thread reaches alone, where measured
    /// (`profile --gemm` under `RAYON_NUM_THREADS=1` over the same with every core); the
    /// rate of `t` threads is taken on the line from one thread's to all cores'
    /// ([`Hardware::thread_rate`]). Absent: a thread's share is one core's (linear).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_thread_share: Option<f64>,
    /// Memory of one device, with a unit (`80GiB`).
    pub memory: String,
    /// Peak FLOP/s of one device in f32, and in bf16/f16.
    pub peak_flops_f32: f64,
    /// FLOP/s of one device in bf16/f16 matrix products.
    pub peak_flops_half: f64,
    /// Share of the peak that the matrix products of a training step reach (the products of
    /// a measured profile; a model planned from its shapes uses the curves below).
    pub efficiency: f64,
    /// Matrix products in f32 by shape (`pipewright profile --gemm`; default: `peak_flops_f32
    /// x efficiency` and the memory bandwidth, no overhead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_f32: Option<GemmCurve>,
    /// Matrix products in bf16/f16 by shape (default from `peak_flops_half`, as for f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_half: Option<GemmCurve>,
    /// Bytes per second the element-wise work of a step streams through memory.
    pub memory_bandwidth_bytes_per_s: f64,
    /// Bytes a rank holds before its first tensor (the runtime, a CUDA context), with a unit.
    pub runtime_memory: String,
    /// Between devices of one node.
    pub intra_node: Link,
    /// Between nodes (one device's share of its node's network).
    pub inter_node: Link,
}

fn one() -> usize {
    1
}

const PRESETS: [(&str, &str); 4] = [
    ("h100-node", include_str!("../../hardware/h100-node.json")),
    ("h200-node", include_str!("../../hardware/h200-node.json")),
    ("a100-node", include_str!("../../hardware/a100-node.json")),
    ("cpu-2core", include_str!("../../hardware/cpu-2core.json")),
];

impl Hardware {
    /// The product rate of `threads` threads on one device, in cores' worth: `threads` where
    /// rates are linear in threads, else on the line from one thread's measured share
    /// ([`Hardware::one_thread_share`]) to every core's.
    pub fn thread_rate(&self, threads: usize) -> f64 {
        let (t, cores) = (threads.max(1) as f64, self.cores_per_device as f64);
        match self.one_thread_share {
            Some(one) if self.cores_per_device > 1 => {
                let t = t.min(cores);
                cores * (one + (1.0 - one) * (t - 1.0) / (cores - 1.0))
            }
            _ => t,
        }
    }

    /// A built-in description by name (`h100-node`, `h200-node`, `a100-node`, `cpu-2core`) or
    /// a JSON file.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some((_, text)) = PRESETS.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(text, name_or_path);
        }
        let path = Path::new(name_or_path);
        let text = std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                invalid!(
                    "no hardware file `{name_or_path}`: give a JSON file or one of {}",
                    PRESETS.map(|p| p.0).join(", ")
                )
            } else {
                Error::io("cannot read", path, e)
            }
        })?;
        Self::parse(&text, name_or_path)
    }

    /// Parses and checks a description; `what` names it in errors.
    pub fn parse(text: &str, what: &str) -> Result<Self> {
        let hw: Hardware = serde_json::from_str(text)
            .map_err(|e| invalid!("hardware file {what} is malformed: {e}"))?;
        hw.check(what)?;
        Ok(hw)
    }

    fn check(&self, what: &str) -> Result<()> {
        let bad = |field: &str| invalid!("hardware file {what}: {field} must be positive");
        if self.devices_per_node == 0 {
            return Err(bad("devices_per_node"));
        }
        if self.cores_per_device == 0 {
            return Err(bad("cores_per_device"));
        }
        if self
            .one_thread_share
            .is_some_and(|s| !(s > 0.0 && s <= 1.0))
        {
            return Err(invalid!(
                "hardware file {what}: one_thread_share is one thread's share of every core's \
                 rate: a number in (0, 1]"
            ));
        }
        for (field, v) in [
            ("peak_flops_f32", self.peak_flops_f32),
            ("peak_flops_half", self.peak_flops_half),
            (
                "memory_bandwidth_bytes_per_s",
                self.memory_bandwidth_bytes_per_s,
            ),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(field));
            }
        }
        if !(self.efficiency > 0.0 && self.efficiency <= 1.0) {
            return Err(invalid!(
                "hardware file {what}: efficiency is a share of the peak, in (0, 1]"
            ));
        }
        for (field, curve) in [("gemm_f32", &self.gemm_f32), ("gemm_half", &self.gemm_half)] {
            if let Some(c) = curve {
                c.check(&format!("hardware file {what}: {field}"))?;
            }
        }
        for (field, l) in [
            ("intra_node", self.intra_node),
            ("inter_node", self.inter_node),
        ] {
            check_link(&l, &format!("hardware file {what}"), field)?;
        }
        for (field, v) in [
            ("memory", &self.memory),
            ("runtime_memory", &self.runtime_memory),
        ] {
            parse_bytes(v).map_err(|e| invalid!("hardware file {what}: {field}: {e}"))?;
        }
        Ok(())
    }

    /// Memory of one device in bytes.
    pub fn memory_bytes(&self) -> u64 {
        parse_bytes(&self.memory).expect("checked when loaded")
    }

    /// What a rank holds before its first tensor, in bytes.
    pub fn runtime_bytes(&self) -> u64 {
        parse_bytes(&self.runtime_memory).expect("checked when loaded")
    }

    /// How one device runs matrix products in `half` precision or in f32: the file's measured
    /// curve, else `peak x efficiency` at the memory bandwidth with no overhead.
    pub fn gemm(&self, half: bool) -> GemmCurve {
        let curve = if half {
            &self.gemm_half
        } else {
            &self.gemm_f32
        };
        curve.clone().unwrap_or_else(|| {
            GemmCurve::new(
                self.peak_flops(half) * self.efficiency,
                self.memory_bandwidth_bytes_per_s,
                0.0,
                if half { 2 } else { 4 },
            )
        })
    }

    /// This description with the curve fitted to `timings` of `dtype_bytes`-byte products
    /// and, where the device has a fused attention kernel, its `attention` timings
    /// (`pipewright profile --gemm`) in place of its f32 (4) or half-precision (2) one, and
    /// `source` added to its name.
    pub fn with_measured_gemm(
        &self,
        timings: &[GemmTiming],
        attention: Option<&[AttentionTiming]>,
        dtype_bytes: usize,
        source: &str,
    ) -> Result<Self> {
        let mut curve = GemmCurve::fit(timings, dtype_bytes)?;
        curve.attention = attention.map(AttentionRate::fit).transpose()?;
        let mut hw = self.clone();
        match dtype_bytes {
            4 => hw.gemm_f32 = Some(curve),
            2 => hw.gemm_half = Some(curve),
            _ => {
                return Err(invalid!(
                    "dtype_bytes is 2 (bf16, f16) or 4 (f32), not {dtype_bytes}"
                ))
            }
        }
        if !hw.name.contains(source) {
            hw.name = format!("{}; products measured {source}", hw.name);
        }
        hw.check("measured")?;
        Ok(hw)
    }

    /// Writes the description as JSON (atomically), for `plan --hardware FILE`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid!("{e}"))?;
        crate::runtime::files::write_atomic(path, text.as_bytes())
    }

    /// Peak FLOP/s of one device computing in `half` precision or in f32.
    pub fn peak_flops(&self, half: bool) -> f64 {
        if half {
            self.peak_flops_half
        } else {
            self.peak_flops_f32
        }
    }
}

/// Checks `l`, field `field` of the file `what`: bandwidths positive, latencies zero or more.
fn check_link(l: &Link, what: &str, field: &str) -> Result<()> {
    let mut values = vec![("", l.latency_s, l.bandwidth_bytes_per_s)];
    if let Some(m) = l.all_reduce {
        if m.world < 2 {
            return Err(invalid!(
                "{what}: {field}.all_reduce.world must be 2 or more"
            ));
        }
        values.push((".all_reduce", m.latency_s, m.bandwidth_bytes_per_s));
    }
    for (sub, latency, bandwidth) in values {
        if !(bandwidth.is_finite() && bandwidth > 0.0) {
            return Err(invalid!(
                "{what}: {field}{sub}.bandwidth_bytes_per_s must be positive"
            ));
        }
        if !(latency.is_finite() && latency >= 0.0) {
            return Err(invalid!(
                "{what}: {field}{sub}.latency_s must be zero or more seconds"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Hardware;

    /// A thread's rate: one core's where nothing was measured; on the line from one thread's
    /// measured share to every core's where it was (cpu-2core: 0.81 of both cores).
    #[test]
    fn threads_compute_at_their_measured_share() {
        let mut hw = Hardware::load("cpu-2core").unwrap();
        assert_eq!(hw.one_thread_share, Some(0.81));
        assert!((hw.thread_rate(1) - 1.62).abs() < 1e-12);
        assert_eq!(hw.thread_rate(2), 2.0);
        assert_eq!(hw.thread_rate(8), 2.0, "no more than the cores");
        hw.cores_per_device = 4;
        assert!((hw.thread_rate(3) - 4.0 * (0.81 + 0.19 * 2.0 / 3.0)).abs() < 1e-12);
        hw.one_thread_share = None;
        assert_eq!(hw.thread_rate(3), 3.0);
        hw.one_thread_share = Some(1.5);
        assert!(hw
            .check("x")
            .unwrap_err()
            .to_string()
            .contains("one_thread_share"));
    }
}
