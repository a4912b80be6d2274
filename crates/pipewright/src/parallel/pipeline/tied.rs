//! Tied (shared) weights across pipeline stages (Varuna's `shared_weights`, GPT's `wte.weight`
//! and `lm_head.weight`): two parameters that start equal and stay equal because both are
//! updated with the sum of their gradients. The members may sit on different stages.
//!
//! One validation (both names are parameters of the model, of equal shape) finds each
//! member's owner once, when the pipeline is built; each step then sums the pair's gradients
//! between the owners.

use candle_core::{Device, Tensor, Var};

use crate::distributed::comm::{Communicator, MAX_TAG};
use crate::model::grads::Grads;
use crate::{invalid, Result};

/// The tied pairs of a pipeline, with the pipeline rank that owns each member.
#[derive(Clone, Debug, Default)]
pub struct Tied {
    pairs: Vec<Pair>,
    /// The pairs by name, as given (what gradient norms skip the second member of).
    names: Vec<(String, String)>,
}

#[derive(Clone, Debug)]
struct Pair {
    a: String,
    b: String,
    owner_a: usize,
    owner_b: usize,
}

impl Tied {
    /// Checks every pair and finds the owners (collective over the pipeline `comm`; `params`
    /// are this rank's).
    pub fn new(
        comm: &dyn Communicator,
        params: &[(String, Var)],
        pairs: &[(String, String)],
    ) -> Result<Self> {
        let mut out = Vec::new();
        for (a, b) in pairs {
            let (owner_a, shape_a) = owner(comm, params, a)?;
            let (owner_b, shape_b) = owner(comm, params, b)?;
            if shape_a != shape_b {
                return Err(invalid!(
                    "tied parameters `{a}` {shape_a:?} and `{b}` {shape_b:?} differ in shape: \
                     only equal shapes can be shared"
                ));
            }
            out.push(Pair {
                a: a.clone(),
                b: b.clone(),
                owner_a,
                owner_b,
            });
        }
        Ok(Self {
            pairs: out,
            names: pairs.to_vec(),
        })
    }

    /// The pairs, as given.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.names
    }

    /// Sums each pair's gradients between its owners, first member's plus second's on both,
    /// so both stay bit-equal (collective over the owners of each pair).
    pub fn sum_grads(&self, comm: &dyn Communicator, grads: &mut Grads) -> Result<()> {
        let me = comm.rank();
        for (i, p) in self.pairs.iter().enumerate() {
            let tag = MAX_TAG - 1 - i as u64;
            let (a, b) = (&p.a, &p.b);
            let take = |grads: &Grads, n: &String| {
                grads
                    .get(n)
                    .cloned()
                    .ok_or_else(|| invalid!("no gradient for tied `{n}`"))
            };
            if p.owner_a == p.owner_b {
                if me == p.owner_a {
                    if let (Some(ga), Some(gb)) = (grads.get(a), grads.get(b)) {
                        let s = (ga + gb)?;
                        grads.insert(a.clone(), s.clone());
                        grads.insert(b.clone(), s);
                    }
                }
            } else if me == p.owner_a {
                let ga = take(grads, a)?;
                comm.send(&ga, p.owner_b, tag)?;
                let gb = comm.recv(p.owner_b, tag)?.to_device(ga.device())?;
                grads.insert(a.clone(), (ga + gb)?);
            } else if me == p.owner_b {
                let gb = take(grads, b)?;
                let ga = comm.recv(p.owner_a, tag)?.to_device(gb.device())?;
                comm.send(&gb, p.owner_a, tag)?;
                grads.insert(b.clone(), (ga + gb)?);
            }
        }
        Ok(())
    }
}

/// The pipeline rank holding parameter `name` and its shape (collective: each rank tells
/// whether it holds it and the shape it has).
fn owner(
    comm: &dyn Communicator,
    params: &[(String, Var)],
    name: &str,
) -> Result<(usize, Vec<i64>)> {
    let mine = params.iter().find(|(n, _)| n == name);
    let mut t = vec![i64::from(mine.is_some())];
    if let Some((_, v)) = mine {
        t.extend(v.dims().iter().map(|d| *d as i64));
    }
    let all = comm.all_gather(&Tensor::new(t.as_slice(), &Device::Cpu)?)?;
    for (r, t) in all.iter().enumerate() {
        let v = t.to_vec1::<i64>()?;
        if v[0] == 1 {
            return Ok((r, v[1..].to_vec()));
        }
    }
    Err(invalid!(
        "unknown tied parameter `{name}`: it is not a parameter of the model"
    ))
}
