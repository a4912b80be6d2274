//! Sub-communicators of the MPI backend: [`Communicator::split`] as an MPI communicator of the
//! members' group, checked first so that a bad member list is an error on every rank, not a
//! hang inside MPI.

use mpi::traits::{Communicator as _, Group as _};

use super::mpi::MpiComm;
use super::Communicator;
use crate::{Error, Result};

impl MpiComm {
    /// [`Communicator::split`], as an MPI communicator.
    pub(super) fn split_mpi(&self, members: &[usize]) -> Result<MpiComm> {
        let mut seen = vec![false; self.size()];
        for &m in members {
            if m >= self.size() || std::mem::replace(&mut seen[m], true) {
                return Err(Error::Comm(format!(
                    "split: members {members:?} must be distinct ranks below {}",
                    self.size()
                )));
            }
        }
        if !members.contains(&self.rank()) {
            return Err(Error::Comm(format!(
                "split: rank {} is not among the members {members:?}",
                self.rank()
            )));
        }
        let ranks: Vec<i32> = members.iter().map(|&m| m as i32).collect();
        let group = self.comm().group().include(&ranks);
        let sub = self
            .comm()
            .split_by_subgroup(&group)
            .ok_or_else(|| Error::Comm("split: MPI gave no communicator to a member".into()))?;
        Ok(MpiComm::new(sub))
    }
}
