//! Where a job runs and how its runtime communicates: the machines, how many ranks share a
//! node, and the runtime's choices the cost model follows ([`Runtime`]: pipewright's by
//! default; other runtimes' to compare with their published measurements).

use serde::Serialize;

use super::hardware::{Hardware, Link};
use super::profile::Profile;
use crate::parallel::data_parallel::DEFAULT_BUCKET_BYTES;
use crate::parallel::pipeline::Sharing;
use crate::Result;

/// How a training runtime moves gradients and activations, as the planner costs it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Runtime {
    /// Bytes per element of the data-parallel gradient sums (pipewright sums f32 buckets: 4).
    pub grad_reduce_bytes: f64,
    /// Whether the gradient sums start during the step's last backward, bucket by bucket, so
    /// only what outlasts it is exposed (PyTorch DDP's and Megatron's `--overlap-grad-reduce`).
    /// pipewright starts its sums during the last backward too (unless `--no-overlap`), but
    /// only Open MPI's communication thread moves them meanwhile (threads and NCCL sum when
    /// waited on): [`Runtime::pipewright`] says which.
    pub overlap_grad_reduce: bool,
    /// Bytes of a gradient bucket when the sums overlap (pipewright's `--bucket-mb`, DDP's
    /// `bucket_cap_mb`): each leaves once full, so the sums start no sooner.
    pub bucket_bytes: f64,
    /// Whether a stage sends its output to the next split over its tp ranks, each sending
    /// `1/tp` and the receivers all-gathering it over the node's links (Megatron-LM's
    /// scatter/gather); pipewright's tp ranks each send the whole.
    pub scatter_gather: bool,
    /// Whether stages take equal numbers of blocks, the embedding on the first and the head
    /// on the last (Megatron-LM's split, [`super::balance::even_blocks`]) instead of pipewright's
    /// balance by predicted time.
    pub even_blocks: bool,
}

impl Runtime {
    /// pipewright's runtime for a run with overlap `overlap` ([`crate::parallel::overlap::OverlapSpec::overlap`])
    /// over an engine that moves started collectives in the background (`background`: Open
    /// MPI's communication thread) or not (threads, NCCL): the sums (and ZeRO-2's
    /// reduce-scatters) are costed overlapped only with both, the sums in buckets of
    /// `bucket_bytes` ([`crate::parallel::overlap::OverlapSpec::bucket_bytes`]). ZeRO-3's gathers
    /// stay costed whole.
    pub fn pipewright(overlap: bool, background: bool, bucket_bytes: usize) -> Self {
        Self {
            overlap_grad_reduce: overlap && background,
            bucket_bytes: bucket_bytes as f64,
            ..Self::default()
        }
    }
}

impl Default for Runtime {
    /// pipewright's runtime as `plan` assumes it: the sums after the schedule (an engine
    /// without background progress, or `--no-overlap`).
    fn default() -> Self {
        Self {
            grad_reduce_bytes: 4.0,
            overlap_grad_reduce: false,
            bucket_bytes: DEFAULT_BUCKET_BYTES as f64,
            scatter_gather: false,
            even_blocks: false,
        }
    }
}

/// Bytes the optimizer streams per parameter (reads parameter, gradient, moments; writes 3).
const OPTIMIZER_BYTES_PER_PARAM: f64 = 28.0;

/// Where a job runs: the machines and how many ranks share a node.
#[derive(Clone, Copy, Debug)]
pub struct Cluster<'a> {
    /// The machines' hardware.
    pub hardware: &'a Hardware,
    /// Ranks placed on one node (tp fastest, then dp, then pp: `topology`'s order).
    pub ranks_per_node: usize,
    /// How the training runtime schedules its communication.
    pub runtime: Runtime,
}

impl<'a> Cluster<'a> {
    /// `world` ranks spread evenly over `nodes` nodes of `hardware` (default: as many nodes
    /// as the ranks need devices).
    pub fn new(hardware: &'a Hardware, world: usize, nodes: Option<usize>) -> Result<Self> {
        let nodes = nodes.unwrap_or_else(|| world.div_ceil(hardware.devices_per_node));
        if nodes == 0 || !world.is_multiple_of(nodes) {
            return Err(crate::invalid!(
                "a world of {world} ranks does not spread evenly over {nodes} nodes"
            ));
        }
        Ok(Self {
            hardware,
            ranks_per_node: world / nodes,
            runtime: Runtime::default(),
        })
    }

    /// Ranks on one device.
    pub(crate) fn ranks_per_device(&self) -> usize {
        self.ranks_per_node.div_ceil(self.hardware.devices_per_node)
    }

    /// CPU threads each rank gets: its share of the device's cores, at least one (what
    /// `comm::size_thread_pools` gives a run's ranks).
    pub fn threads_per_rank(&self) -> usize {
        (self.hardware.cores_per_device / self.ranks_per_device()).max(1)
    }

    /// The share of a device's ranks that can compute at full speed at once: its cores over
    /// their threads, at most 1.
    pub(crate) fn concurrent_share(&self) -> f64 {
        let threads = self.ranks_per_device() * self.threads_per_rank();
        (self.hardware.cores_per_device as f64 / threads as f64).min(1.0)
    }

    /// How ranks share the device's cores in a simulation of `pp` pipeline ranks (each
    /// standing for its stage's tp x dp ranks, busy and idle together): a share of them
    /// computing at full speed at once is that share of the pipeline ranks; while more are
    /// busy, they keep `crowded` of the cores' speed (a profile's crowded efficiency).
    pub(crate) fn sharing(&self, pp: usize, crowded: Option<f64>) -> Sharing {
        match self.concurrent_share() {
            s if s < 1.0 => Sharing {
                slots: s * pp as f64,
                crowded: crowded.unwrap_or(1.0),
                across: 1.0,
            },
            _ => Sharing::ALONE,
        }
    }

    /// Seconds one rank takes to update `params` parameters with the cores to itself (the
    /// rank's threads): timed by `profile` where it was measured, else its state streamed
    /// at the device's memory bandwidth ([`OPTIMIZER_BYTES_PER_PARAM`]).
    pub(crate) fn update_seconds(&self, profile: &Profile, params: f64) -> f64 {
        let (alone, threads) = match profile.optimizer {
            Some(f) => (f.at(params as usize), profile.threads),
            None => (
                params * OPTIMIZER_BYTES_PER_PARAM / self.hardware.memory_bandwidth_bytes_per_s,
                self.hardware.cores_per_device,
            ),
        };
        alone * self.thread_ratio(threads)
    }

    /// How much slower than the profile a rank computes alone: the rate of the profile's
    /// threads over the rank's ([`Hardware::thread_rate`]: linear in threads unless the
    /// hardware measured one thread's share; profile with the rank's thread count to need
    /// neither).
    pub(crate) fn thread_ratio(&self, profile_threads: usize) -> f64 {
        let hw = self.hardware;
        hw.thread_rate(profile_threads) / hw.thread_rate(self.threads_per_rank())
    }

    /// The link of a group whose members lie within `span` consecutive ranks.
    pub(crate) fn link(&self, span: usize) -> Link {
        if span <= self.ranks_per_node {
            self.hardware.intra_node
        } else {
            self.hardware.inter_node
        }
    }
}
