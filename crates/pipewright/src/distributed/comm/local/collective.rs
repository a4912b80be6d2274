//! One collective of the local backend in two halves. [`LocalComm::start`] takes the
//! collective's tag (its place in this member's order of collectives) and posts this member's
//! inputs to the group's first member at once; [`Started::finish`] then, on the first member,
//! gathers every member's inputs, combines them and posts each member its reply, and on the
//! others takes the reply. A blocking collective is the two back to back; a non-blocking one
//! ([`Communicator::iall_reduce`](super::Communicator::iall_reduce)) finishes when waited on, so
//! a member may start several and wait on them in any order. The first member combines when it
//! waits: a member waiting on a collective waits for the first member to reach the same wait.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::{LocalComm, Msg, World, MAX_TAG};
use crate::{Error, Result};

/// A collective this member has started: what [`Started::finish`] needs.
pub(super) struct Started {
    world: Arc<World>,
    group: u64,
    /// World ranks of the members, indexed by group rank.
    members: Arc<Vec<usize>>,
    rank: usize,
    tag: u64,
    name: &'static str,
    /// The first member's own inputs (the others posted theirs).
    inputs: Option<Vec<Tensor>>,
    /// Where the reply goes: the device of this member's inputs.
    here: Option<Device>,
}

impl LocalComm {
    /// Starts collective `name` with this member's `inputs`.
    pub(super) fn start(&self, name: &'static str, inputs: Vec<Tensor>) -> Result<Started> {
        // Collective messages live above the user tag range.
        let tag = MAX_TAG + self.seq.fetch_add(1, Ordering::SeqCst);
        let here = inputs.first().map(|t| t.device().clone());
        let inputs = inputs
            .iter()
            .map(Self::outgoing)
            .collect::<Result<Vec<_>>>()?;
        let (root, me) = (self.members[0], self.me());
        let inputs = if self.rank != 0 {
            self.world
                .post((self.group, me, root, tag), Msg::Tensors(inputs));
            None
        } else {
            Some(inputs)
        };
        Ok(Started {
            world: self.world.clone(),
            group: self.group,
            members: self.members.clone(),
            rank: self.rank,
            tag,
            name,
            inputs,
            here,
        })
    }
}

impl Started {
    /// This member's reply: on the first member, `combine` turns every member's inputs (in
    /// rank order) into one reply per member, or an error every member reports.
    pub(super) fn finish(
        self,
        combine: impl FnOnce(Vec<Vec<Tensor>>) -> std::result::Result<Vec<Vec<Tensor>>, String>,
    ) -> Result<Vec<Tensor>> {
        let (group, tag, name) = (self.group, self.tag, self.name);
        let (root, me) = (self.members[0], self.members[self.rank]);
        let reply = match self.inputs {
            None => self.world.take((group, root, me, tag), me, name)?,
            Some(inputs) => {
                let mut all = vec![inputs];
                for &m in &self.members[1..] {
                    all.push(self.world.take((group, m, root, tag), me, name)?);
                }
                let mut replies = match combine(all) {
                    Ok(replies) => replies,
                    Err(why) => {
                        for &m in &self.members[1..] {
                            self.world
                                .post((group, root, m, tag), Msg::Failed(why.clone()));
                        }
                        return Err(Error::Comm(why));
                    }
                };
                for (r, &m) in self.members.iter().enumerate().skip(1) {
                    let reply = std::mem::take(&mut replies[r]);
                    self.world.post((group, root, m, tag), Msg::Tensors(reply));
                }
                std::mem::take(&mut replies[0])
            }
        };
        Ok(reply
            .iter()
            .map(|t| t.to_device(self.here.as_ref().unwrap_or(t.device())))
            .collect::<candle_core::Result<_>>()?)
    }
}
