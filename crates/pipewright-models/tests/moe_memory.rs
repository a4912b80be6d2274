//! Expert parallelism divides a mixture's expert weights: counted by the allocator, the bytes
//! a rank holds for a mixture of 8 experts are the router's and 8/ep experts', at ep 1, 2, 4.

use pipewright::distributed::comm::{local, Communicator, Group};
use pipewright::runtime::memory::{self, CountingAlloc};
use pipewright::Build;
use pipewright_models::moe::{MoeConfig, MoeMlp, MoeNames};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const DIM: usize = 64;
const HIDDEN: usize = 256;
const EXPERTS: usize = 8;

#[test]
fn a_ranks_expert_bytes_fall_as_one_over_ep() {
    assert!(memory::installed());
    let cfg = MoeConfig {
        n_experts: EXPERTS,
        top_k: 2,
        moe_hidden: HIDDEN,
        shared_experts: 0,
        norm_topk: true,
        aux_loss_coef: 0.01,
        names: MoeNames::Mixtral,
        moe_every: 1,
    };
    let expert = 3 * DIM * HIDDEN * 4;
    let router = DIM * EXPERTS * 4;
    for ep in [1, 2, 4] {
        let held = local::run(ep, |c| {
            let rank = c.rank();
            let build = Build::cpu(0).with_ep(Group::new(Box::new(c)));
            let before = memory::thread_live_bytes().unwrap();
            let moe = MoeMlp::new(&build, "model.layers.0", DIM, cfg)?;
            let bytes = memory::thread_live_bytes().unwrap() - before;
            Ok((rank, bytes, moe.params().len()))
        })
        .unwrap();
        for (rank, bytes, params) in held {
            let want = (router + EXPERTS / ep * expert) as u64;
            // Within 16 KiB: names and the parameter list beside the weights.
            assert!(
                bytes.abs_diff(want) < 16 * 1024,
                "ep {ep}, rank {rank}: {bytes} bytes held, {want} expected"
            );
            assert_eq!(params, 1 + 3 * EXPERTS / ep, "ep {ep}");
        }
    }
}
