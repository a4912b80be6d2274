//! Planning: which layers each stage gets, and (later) which layout a job should use.
//!
//! - [`balance`]: the contiguous split of per-layer (or per-segment) costs over pipeline stages
//!   that minimises the most expensive stage (torchgpipe's `balance_by_time` and
//!   `balance_by_size` over given costs).

pub mod balance;

pub use balance::{balance_cost, stage_costs};
