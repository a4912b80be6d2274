//! What [`Communicator::all_to_all`] agrees on before it moves anything, and the one way every
//! backend without a native exchange does it.
//!
//! Each member passes one part per member (part `j` goes to member `j`), every part with the
//! same dtype and the same dims after the first; the rows (dim 0) may differ, zero included:
//! expert parallelism's dispatch and combine send each rank the tokens routed to its experts.
//! The members first share a small descriptor of their parts (how many, the dtype and trailing
//! dims, each part's rows), so that every member checks the same facts and reports the same
//! error, then the rows each member receives are known before any byte moves.

use candle_core::{DType, Device, Tensor};

use super::{describe_parts, Communicator};
use crate::{Error, Result};

/// What every member of an all_to_all passes: the rows `rows[src][dst]` member `src` sends
/// member `dst`, each row `row` (the dims after the first) of `dtype`.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Rows each member sends each member.
    pub rows: Vec<Vec<usize>>,
    /// The dims of one row.
    pub row: Vec<usize>,
    /// The parts' dtype.
    pub dtype: DType,
}

/// The dtypes a descriptor names, by position.
const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// The descriptor this member shares: `[parts, agree, dtype, n, row dims (n of them), rows of
/// each part...]`, where `agree` says the parts share a dtype and their dims after the first.
pub fn descriptor(parts: &[Tensor]) -> Vec<u64> {
    let agree = parts.iter().all(|p| {
        p.rank() > 0 && p.dtype() == parts[0].dtype() && p.dims()[1..] == parts[0].dims()[1..]
    });
    let mut d = vec![parts.len() as u64, u64::from(agree)];
    match parts.first().filter(|_| agree) {
        Some(p) => {
            let dtype = DTYPES
                .iter()
                .position(|t| *t == p.dtype())
                .unwrap_or(DTYPES.len());
            d.extend([dtype as u64, (p.rank() - 1) as u64]);
            d.extend(p.dims()[1..].iter().map(|x| *x as u64));
        }
        None => d.extend([0, 0]),
    }
    d.extend(
        parts
            .iter()
            .map(|p| p.dims().first().copied().unwrap_or(0) as u64),
    );
    d
}

impl Plan {
    /// The plan every member's descriptor (in rank order) describes, or the first thing one
    /// member got wrong: the same error on every member, since every member checks the same
    /// descriptors.
    pub fn agree(descriptors: &[Vec<u64>]) -> std::result::Result<Self, String> {
        let n = descriptors.len();
        let mut first: Option<(Vec<usize>, DType)> = None;
        let mut rows = Vec::with_capacity(n);
        for (r, d) in descriptors.iter().enumerate() {
            let parts = d[0] as usize;
            if parts != n {
                return Err(format!(
                    "all_to_all: rank {r} passed {parts} parts for a group of {n} ranks: pass one \
                     part per member (an empty part has 0 rows)"
                ));
            }
            if d[1] != 1 {
                return Err(format!(
                    "all_to_all: rank {r}'s parts differ in dtype or in their dims after the \
                     first (or one has no dims): every part must share them, only rows differ"
                ));
            }
            let Some(&dt) = DTYPES.get(d[2] as usize) else {
                return Err(format!(
                    "all_to_all: rank {r} passed a dtype no backend carries"
                ));
            };
            let n_row = d[3] as usize;
            let row: Vec<usize> = d[4..4 + n_row].iter().map(|x| *x as usize).collect();
            match &first {
                None => first = Some((row.clone(), dt)),
                Some((row0, dt0)) if (&row, dt) != (row0, *dt0) => {
                    return Err(format!(
                        "all_to_all: rank {r} passed rows of {} but rank 0 passed rows of {}; \
                         dtypes and the dims after the first must agree",
                        describe_parts(&row, dt),
                        describe_parts(row0, *dt0)
                    ))
                }
                Some(_) => {}
            }
            rows.push(d[4 + n_row..].iter().map(|x| *x as usize).collect());
        }
        let (row, dtype) = first.ok_or("all_to_all: a group of no ranks")?;
        Ok(Self { rows, row, dtype })
    }

    /// The rows member `me` receives from each member, in rank order.
    pub fn received(&self, me: usize) -> Vec<usize> {
        self.rows.iter().map(|r| r[me]).collect()
    }

    /// The dims of `rows` rows.
    pub fn dims(&self, rows: usize) -> Vec<usize> {
        std::iter::once(rows)
            .chain(self.row.iter().copied())
            .collect()
    }
}

/// The plan of `parts` agreed with every member of `comm` (their descriptors all-gathered).
pub fn agree<C: Communicator + ?Sized>(comm: &C, parts: &[Tensor]) -> Result<Plan> {
    let mine = descriptor(parts);
    let len = mine.len();
    let t = Tensor::from_vec(mine.iter().map(|x| *x as i64).collect(), len, &Device::Cpu)?;
    let all = comm
        .all_gather(&t)?
        .iter()
        .map(|t| Ok(t.to_vec1::<i64>()?.into_iter().map(|x| x as u64).collect()))
        .collect::<Result<Vec<_>>>()?;
    Plan::agree(&all).map_err(Error::Comm)
}

/// all_to_all through [`Communicator::all_gather`]: every member gathers every member's parts
/// joined and keeps its own rows of each. It moves `size` times the bytes a native exchange
/// moves; a backend without one uses it.
pub fn through_all_gather<C: Communicator + ?Sized>(
    comm: &C,
    parts: &[Tensor],
) -> Result<Vec<Tensor>> {
    let plan = agree(comm, parts)?;
    let joined = Tensor::cat(parts, 0)?;
    let me = comm.rank();
    comm.all_gather(&joined)?
        .iter()
        .zip(&plan.rows)
        .map(|(all, rows)| {
            let start = rows[..me].iter().sum();
            Ok(all.narrow(0, start, rows[me])?)
        })
        .collect()
}
