//! Tensor-parallel layers against their unsharded selves: for tp in {1, 2, 4} (ranks as
//! threads), every output, loss and gradient equals the serial computation's part (relative
//! 1e-5, f32), and TorchShard's helpers behave as documented.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use pipewright::distributed::comm::local;
use pipewright::model::nn::{
    cross_entropy_sum, max_rel_diff, Linear, Module, WeightLayout, IGNORE_INDEX,
};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Mode, Sequential};
use pipewright::parallel::tensor_parallel::{
    get_parallel_dim, part, reduce_from_group, register_ddp_parameters_to_ignore,
    register_parallel_attribute, register_parallel_dim, slice, vocab_parallel_cross_entropy_sum,
    Group, ParallelDim, ParallelEmbedding, ParallelLinear, Shard,
};
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::{Build, Result};

const SEED: u64 = 11;

fn randn(key: &str, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let v = normal_vec(&mut rng_for(1, key), n, 0.0, 1.0);
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

/// What one forward and backward gave: output (as this rank holds it), whether it is split
/// on the last dim, gradients of the parameters (this rank's parts) and of the input.
struct Out {
    y: Tensor,
    split: bool,
    grads: HashMap<String, Tensor>,
    shards: HashMap<String, Shard>,
    dx: Option<Tensor>,
}

type Forward = dyn Fn(&Build, &Tensor, &mut Cx) -> Result<(Tensor, Vec<(String, Var)>, Vec<(String, Shard)>)>
    + Sync;

/// Runs `f` on `x` and back-propagates `sum(y * R)` (for a split output, this rank's part of
/// the sum, then summed over the group, so every rank holds the whole objective).
fn forward_backward(
    init: &Build,
    x: &Tensor,
    f: &Forward,
    input_grad: bool,
    stride: usize,
) -> Result<Out> {
    let xv = Var::from_tensor(x)?;
    let mut cx = Cx::new(Mode::Train, SEED, 0, 0);
    let (y, params, shards) = f(init, xv.as_tensor(), &mut cx)?;
    let split = get_parallel_dim(&cx, &y) == Some(-1);
    let g = &init.tp;
    let mut rdims = y.dims().to_vec();
    let last = rdims.len() - 1;
    if split {
        rdims[last] *= g.size();
    }
    let r = randn("R", &rdims);
    let r = if split {
        part(&r, last, stride, g.rank(), g.size())?
    } else {
        r
    };
    let mut obj = (&y * &r)?.sum_all()?;
    if split {
        obj = reduce_from_group(&obj, g)?;
    }
    let store = obj.backward()?;
    let grads = params
        .iter()
        .map(|(n, v)| (n.clone(), store.get(v.as_tensor()).unwrap().clone()))
        .collect();
    Ok(Out {
        y,
        split,
        grads,
        shards: shards.into_iter().collect(),
        dx: if input_grad {
            store.get(xv.as_tensor()).cloned()
        } else {
            None
        },
    })
}

fn check(what: &str, x: &Tensor, f: &Forward, input_grad: bool, stride: usize) {
    let want = forward_backward(&Build::cpu(SEED), x, f, input_grad, stride).unwrap();
    assert!(!want.split);
    for tp in [1, 2, 4] {
        let got = local::run(tp, |comm| {
            let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
            forward_backward(&init, x, f, input_grad, stride)
        })
        .unwrap();
        for (rank, o) in got.iter().enumerate() {
            let at = format!("{what}, tp={tp} rank {rank}");
            let wy = if o.split {
                part(&want.y, want.y.rank() - 1, stride, rank, tp).unwrap()
            } else {
                want.y.clone()
            };
            assert!(max_rel_diff(&o.y, &wy).unwrap() < 1e-5, "{at}: output");
            assert_eq!(o.grads.len(), want.grads.len());
            for (n, w) in &want.grads {
                let w = match o.shards.get(n) {
                    Some(s) => part(w, s.axis, s.stride, s.index, s.count).unwrap(),
                    None => w.clone(),
                };
                let d = max_rel_diff(&o.grads[n], &w).unwrap();
                assert!(d < 1e-5, "{at}: gradient of {n} off by {d:e}");
            }
            if let (Some(a), Some(b)) = (&o.dx, &want.dx) {
                assert!(max_rel_diff(a, b).unwrap() < 1e-5, "{at}: input gradient");
            }
            if tp > 1 {
                assert!(
                    !o.shards.is_empty() || what.contains("replicated"),
                    "{at}: nothing sharded"
                );
            }
        }
    }
}

fn linear(dim: Option<i64>, gather: bool) -> Box<Forward> {
    Box::new(move |init: &Build, x: &Tensor, cx: &mut Cx| {
        let l = ParallelLinear::new(init, &init.tp, "lin", 12, 8, true, dim)?.gather_output(gather);
        let y = l.forward(x, cx)?;
        Ok((y, l.params(), l.shards()))
    })
}

#[test]
fn parallel_linear_every_dim() {
    let x = randn("x", &[3, 5, 12]);
    check("replicated", &x, &linear(None, false), true, 1);
    check("column (-1)", &x, &linear(Some(-1), false), true, 1);
    check("column (1)", &x, &linear(Some(1), false), true, 1);
    check("column gathered", &x, &linear(Some(-1), true), true, 1);
    // A row-parallel layer fed a whole input splits it itself.
    check("row (0)", &x, &linear(Some(0), false), true, 1);
}

#[test]
fn column_then_row_as_megatron_mlp() {
    let x = randn("x", &[4, 8]);
    let f: Box<Forward> = Box::new(|init: &Build, x: &Tensor, cx: &mut Cx| {
        let fc = ParallelLinear::from_whole(
            Linear::conv1d(init, "fc", 8, 16, 0.5)?,
            Some(ParallelDim::Column),
            1,
            &init.tp,
        )?;
        let proj = ParallelLinear::from_whole(
            Linear::new(init, "proj", 16, 8, true)?,
            Some(ParallelDim::Row),
            1,
            &init.tp,
        )?
        .input_is_parallel(true);
        let h = fc.forward(x, cx)?.tanh()?;
        let y = proj.forward(&h, cx)?;
        let mut p = fc.params();
        p.extend(proj.params());
        let mut s = fc.shards();
        s.extend(proj.shards());
        Ok((y, p, s))
    });
    check("column then row", &x, &f, true, 1);
}

#[test]
fn strided_column_split_keeps_each_block() {
    // q | k | v columns: each rank gets its part of every block; gathered back in order.
    let x = randn("x", &[2, 3, 8]);
    for gather in [false, true] {
        let f: Box<Forward> = Box::new(move |init: &Build, x: &Tensor, cx: &mut Cx| {
            let l = ParallelLinear::from_whole(
                Linear::conv1d(init, "qkv", 8, 24, 0.3)?,
                Some(ParallelDim::Column),
                3,
                &init.tp,
            )?
            .gather_output(gather);
            Ok((l.forward(x, cx)?, l.params(), l.shards()))
        });
        check("strided column", &x, &f, true, 3);
    }
}

#[test]
fn parallel_embedding_masks_other_ranks_ids() {
    let ids = Tensor::new(&[[0u32, 3, 7, 4], [1, 6, 2, 5], [7, 7, 0, 1]], &Device::Cpu).unwrap();
    let f: Box<Forward> = Box::new(|init: &Build, ids: &Tensor, cx: &mut Cx| {
        let e = ParallelEmbedding::new(init, &init.tp, "emb", 8, 5, 1.0)?;
        let y = e.forward(&ids.to_dtype(DType::U32)?, cx)?;
        Ok((y, e.params(), e.shards()))
    });
    check(
        "embedding",
        &ids.to_dtype(DType::F32).unwrap(),
        &f,
        false,
        1,
    );
    // Out-of-range ids name the layer.
    let errs = local::run(2, |comm| {
        let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
        let e = ParallelEmbedding::new(&init, &init.tp, "emb", 8, 5, 1.0)?;
        Ok(e.forward(&Tensor::new(&[8u32], &Device::Cpu)?, &Cx::eval())
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    assert!(
        errs[0].contains("emb") && errs[0].contains("id 8"),
        "{}",
        errs[0]
    );
}

#[test]
fn vocab_parallel_cross_entropy_matches_whole() {
    let (n, v) = (7, 8);
    let logits = (randn("logits", &[n, v]) * 3.0).unwrap();
    let targets = Tensor::new(&[0i64, 7, IGNORE_INDEX, 3, 4, 1, 5], &Device::Cpu).unwrap();
    let lv = Var::from_tensor(&logits).unwrap();
    let (want, count) = cross_entropy_sum(lv.as_tensor(), &targets).unwrap();
    let want_g = want
        .backward()
        .unwrap()
        .get(lv.as_tensor())
        .unwrap()
        .clone();
    let want = want.to_scalar::<f32>().unwrap();
    for tp in [1, 2, 4] {
        let got = local::run(tp, |comm| {
            let g = Group::new(Box::new(comm));
            let mine = Var::from_tensor(&part(&logits, 1, 1, g.rank(), g.size())?)?;
            let (l, c) = vocab_parallel_cross_entropy_sum(mine.as_tensor(), &targets, &g)?;
            let grad = l.backward()?.get(mine.as_tensor()).unwrap().clone();
            Ok((l.to_scalar::<f32>()?, c, grad, g.rank()))
        })
        .unwrap();
        for (l, c, grad, r) in got {
            assert_eq!(c, count);
            assert!(
                ((l - want) / want).abs() < 1e-5,
                "tp={tp}: loss {l} vs {want}"
            );
            let w = part(&want_g, 1, 1, r, tp).unwrap();
            assert!(
                max_rel_diff(&grad, &w).unwrap() < 1e-5,
                "tp={tp} rank {r}: gradient"
            );
        }
    }
}

#[test]
fn slice_is_torch_split() {
    let t = randn("t", &[3, 10]);
    let parts = slice(&t, 2, Some(-1), false).unwrap();
    assert_eq!(parts.len(), 2);
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.dims(), [3, 5]);
        assert_eq!(
            max_rel_diff(p, &t.narrow(1, 5 * i, 5).unwrap()).unwrap(),
            0.0
        );
    }
    let rows = slice(&t, 3, Some(0), true).unwrap();
    assert!(rows
        .iter()
        .all(|p| p.dims() == [1, 10] && p.is_contiguous()));
    let whole = slice(&t, 4, None, false).unwrap();
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].dims(), [3, 10]);
    let err = slice(&t, 4, Some(1), false).unwrap_err().to_string();
    assert!(err.contains("does not split into 4 equal parts"), "{err}");
    assert!(slice(&t, 2, Some(2), false).is_err());
}

#[test]
fn parallel_dims_of_tensors_and_parameters() {
    // TorchShard's examples: ParallelLinear(20, 30, dim=-1) holds weight [20, 15] on each of 2
    // ranks, dim=0 holds [10, 30] (weights stored (in, out), order type 1).
    let shapes = local::run(2, |comm| {
        let g = Group::new(Box::new(comm));
        let col = register_parallel_attribute(&[20, 30], -1, WeightLayout::InOut, 1, &g)?;
        let row = register_parallel_attribute(&[20, 30], 0, WeightLayout::InOut, 1, &g)?;
        let torch = register_parallel_attribute(&[30, 20], -1, WeightLayout::OutIn, 1, &g)?;
        let init = Build::cpu(SEED).with_tp(g);
        let l = ParallelLinear::new(&init, &init.tp, "m", 30, 30, true, Some(-1))?;
        let input = Tensor::zeros((20, 30), DType::F32, &Device::Cpu)?;
        let mut cx = Cx::eval();
        let out = l.forward(&input, &mut cx)?;
        let dims = (get_parallel_dim(&cx, &out), get_parallel_dim(&cx, &input));
        register_parallel_dim(&mut cx, &input, Some(-1))?;
        let marked = get_parallel_dim(&cx, &input);
        register_parallel_dim(&mut cx, &input, None)?;
        Ok((
            col.shape(),
            row.shape(),
            torch.shape(),
            dims,
            marked,
            get_parallel_dim(&cx, &input),
        ))
    })
    .unwrap();
    for (col, row, torch, dims, marked, cleared) in shapes {
        assert_eq!(col, [20, 15]);
        assert_eq!(row, [10, 30]);
        assert_eq!(torch, [15, 20]);
        assert_eq!(dims, (Some(-1), None));
        assert_eq!((marked, cleared), (Some(-1), None));
    }
}

struct Lin(String, ParallelLinear);

impl Layer for Lin {
    fn name(&self) -> &str {
        &self.0
    }
    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        Ok(self.1.forward(&x.into_tensor(&self.0)?, cx)?.into())
    }
    fn params(&self) -> Vec<(String, Var)> {
        self.1.params()
    }
    fn shards(&self) -> Vec<(String, Shard)> {
        self.1.shards()
    }
}

#[test]
fn ddp_ignores_exactly_the_sharded_parameters() {
    // TorchShard's example: a plain Linear and a ParallelLinear; only the latter's are listed.
    let mut s = Sequential::new();
    s.push(LayerSpec::new("layer1", |init| {
        let l = ParallelLinear::from_whole(
            Linear::new(init, "layer1", 20, 20, true)?,
            None,
            1,
            &init.tp,
        )?;
        Ok(Box::new(Lin("layer1".into(), l)) as Box<dyn Layer>)
    }));
    s.push(LayerSpec::new("layer2", |init| {
        Ok(Box::new(Lin(
            "layer2".into(),
            ParallelLinear::new(init, &init.tp, "layer2", 20, 30, true, Some(-1))?,
        )) as Box<dyn Layer>)
    }));
    let lists = local::run(2, |comm| {
        let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
        Ok(register_ddp_parameters_to_ignore(&s.build(&init)?))
    })
    .unwrap();
    for l in lists {
        assert_eq!(l, ["layer2.weight", "layer2.bias"]);
    }
    // A whole model has nothing to ignore.
    assert!(register_ddp_parameters_to_ignore(&s.build(&Build::cpu(SEED)).unwrap()).is_empty());
}

#[test]
fn a_group_larger_than_the_world_is_a_clear_error() {
    use pipewright::distributed::comm::axis_group;
    use pipewright::distributed::topology::{Axis, Layout, Topology};
    let errs = local::run(2, |comm| {
        let topo = Topology::new(Layout::new(1, 4, 1)?);
        Ok(axis_group(&comm, &topo, Axis::Tensor)
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in errs {
        let e = e.expect("tp=4 over 2 ranks must fail");
        assert!(e.contains("needs 4 ranks but the world has 2"), "{e}");
    }
}
