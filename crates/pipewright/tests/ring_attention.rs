//! Context parallelism's pieces against plain computations: the load-balanced chunks, and ring
//! attention's output and its query, key and value gradients (grouped-query heads too) against
//! causal attention over the whole sequence, in f64 (within 1e-12: the same function, rounded
//! differently) and f32.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::distributed::comm::local;
use pipewright::model::nn::{max_rel_diff, scaled_softmax};
use pipewright::parallel::context_parallel::{ring_attention, Chunks};
use pipewright::parallel::tensor_parallel::Group;
use pipewright::runtime::seed::{normal_vec, rng_for};

fn randn(key: &str, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product();
    let v = normal_vec(&mut rng_for(3, key), n, 0.0, 1.0);
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn chunks_take_a_front_and_a_back_chunk() {
    let t = Tensor::arange(0u32, 8, &Device::Cpu)
        .unwrap()
        .reshape((1, 8))
        .unwrap();
    let take = |rank| {
        Chunks { rank, size: 2 }
            .take(&t, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()
    };
    assert_eq!(take(0), [0, 1, 6, 7]);
    assert_eq!(take(1), [2, 3, 4, 5]);
    assert_eq!(Chunks { rank: 1, size: 2 }.positions(4), [2..4, 4..6]);
    let parts: Vec<Tensor> = (0..4)
        .map(|rank| Chunks { rank, size: 4 }.take(&t, 1).unwrap())
        .collect();
    let back = Chunks::join(&parts, 1).unwrap().flatten_all().unwrap();
    assert_eq!(back.to_vec1::<u32>().unwrap(), (0..8).collect::<Vec<_>>());
    let e = Chunks { rank: 0, size: 4 }
        .take(&t.narrow(1, 0, 6).unwrap(), 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2 x cp = 8") && e.contains("multiple of 8"),
        "{e}"
    );
}

/// Causal attention over the whole sequence, keys and values repeated for grouped heads.
fn plain(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, rep: usize) -> Tensor {
    let (b, h, t, hd) = q.dims4().unwrap();
    let grow = |y: &Tensor| {
        y.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, h / rep, rep, t, hd))
            .unwrap()
            .reshape((b, h, t, hd))
            .unwrap()
    };
    let att = scaled_softmax(&q.matmul(&grow(k).t().unwrap()).unwrap(), scale, true).unwrap();
    att.matmul(&grow(v)).unwrap()
}

fn check(cp: usize, rep: usize, dtype: DType, tol: f64) {
    let (b, h, t, hd) = (2, 4, 8 * cp, 8);
    let scale = 1.0 / (hd as f64).sqrt();
    let q = randn("q", &[b, h, t, hd], dtype);
    let k = randn("k", &[b, h / rep, t, hd], dtype);
    let v = randn("v", &[b, h / rep, t, hd], dtype);
    let w = randn("w", &[b, h, t, hd], dtype);
    let vars = [&q, &k, &v].map(|x| Var::from_tensor(x).unwrap());
    let out = plain(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        scale,
        rep,
    );
    let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let want: Vec<Tensor> = vars.iter().map(|x| grads.get(x).unwrap().clone()).collect();
    let results = local::run(cp, |comm| {
        let ring = Group::new(Box::new(comm));
        let me = Chunks::of(&ring);
        let mine = [&q, &k, &v].map(|x| Var::from_tensor(&me.take(x, 2).unwrap()).unwrap());
        let y = ring_attention(
            mine[0].as_tensor(),
            mine[1].as_tensor(),
            mine[2].as_tensor(),
            scale,
            rep,
            &ring,
        )?;
        let g = (&y * me.take(&w, 2)?)?.sum_all()?.backward()?;
        let gs: Vec<Tensor> = mine.iter().map(|x| g.get(x).unwrap().clone()).collect();
        Ok((me, y, gs))
    })
    .unwrap();
    for (me, y, gs) in results {
        let d = max_rel_diff(&y, &me.take(&out, 2).unwrap()).unwrap();
        assert!(
            d < tol,
            "cp {cp} rep {rep} {dtype:?} rank {}: output off by {d:e}",
            me.rank
        );
        for (i, (g, w)) in gs.iter().zip(&want).enumerate() {
            let d = max_rel_diff(g, &me.take(w, 2).unwrap()).unwrap();
            assert!(
                d < tol,
                "cp {cp} rep {rep} {dtype:?} rank {}: gradient {} off by {d:e}",
                me.rank,
                ["q", "k", "v"][i]
            );
        }
    }
}

#[test]
fn ring_attention_is_causal_attention_in_f64() {
    for cp in [2, 3, 4] {
        for rep in [1, 2] {
            check(cp, rep, DType::F64, 1e-12);
        }
    }
}

#[test]
fn ring_attention_is_causal_attention_in_f32() {
    check(2, 1, DType::F32, 1e-5);
    check(4, 2, DType::F32, 1e-5);
}
