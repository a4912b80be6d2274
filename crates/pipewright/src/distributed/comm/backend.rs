//! [`Backend`]: which [`super::Communicator`] a run's ranks talk through.

/// How a run's ranks talk (serialized as it parses: `local`, `mpi`, `nccl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Threads of one process ([`super::local`]).
    Local,
    /// One process per rank under `mpirun -np N` (a build with the `mpi` feature).
    Mpi,
    /// Every rank on a GPU of its own, its pipeline sends and collectives through NCCL in GPU
    /// memory; ranks as threads, or processes under mpirun (a build with the `cuda` feature).
    Nccl,
}

impl Backend {
    /// Whether collectives started with [`super::Communicator::iall_reduce`] and its kin move
    /// while the rank computes: Open MPI's communication thread does; threads complete them
    /// when waited on, NCCL when started. What the planner costs as overlapped
    /// ([`crate::plan::Runtime::pipewright`]).
    pub fn progresses_in_background(self) -> bool {
        self == Backend::Mpi
    }
}

crate::runtime::words::word_enum!(Backend, "backend", {
    Local => "local",
    Mpi => "mpi",
    Nccl => "nccl",
});
