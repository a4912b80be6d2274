//! The split backward of zero-bubble schedules: with a weight-gradient queue, a backward pass
//! gives weight-bearing layers no weight gradient (and computes none: its store holds nothing
//! but the input's and the other parameters' gradients), the input the gradient the unsplit
//! backward gives it, and the queue later gives exactly (bit for bit) the weight gradient the
//! unsplit backward gives.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::deferred::WeightGradQueue;
use pipewright::model::nn::{Conv2d, Embedding, Init, Linear, Module};
use pipewright::model::{Cx, Mode};
use pipewright::runtime::seed::{normal_vec, rng_for};

fn randn(key: &str, shape: &[usize]) -> Tensor {
    let v = normal_vec(&mut rng_for(5, key), shape.iter().product(), 0.0, 1.0);
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Runs `f` twice, plain and deferred, and compares the weight gradient of `weight` and the
/// gradient of `input` (when the op has one); `others` are the op's other parameters.
fn check(what: &str, weight: &Var, input: Option<&Var>, others: &[Var], f: impl Fn(&Cx) -> Tensor) {
    let plain = f(&Cx::new(Mode::Train, 0, 0, 0));
    let r = randn("r", plain.dims());
    let plain = (plain * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let want = plain
        .get(weight.as_tensor())
        .expect("plain backward reaches the weight")
        .clone();

    let q = WeightGradQueue::new();
    let mut cx = Cx::new(Mode::Train, 0, 0, 3);
    cx.weight_grads = Some(q.clone());
    let split = f(&cx);
    let store = (split * &r).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(
        store.get(weight.as_tensor()).is_none(),
        "{what}: the backward gave the weight a gradient"
    );
    // candle's matmul and convolution backwards compute a weight gradient even for a
    // detached weight, and leave it in the store: the input pass must not run them.
    // (The mask `r` gets one from candle's product backward.)
    let mut leaves: Vec<_> = others
        .iter()
        .chain(input)
        .map(|v| v.as_tensor().id())
        .collect();
    leaves.push(r.id());
    for id in store.get_ids() {
        assert!(
            leaves.contains(id),
            "{what}: the backward computed a gradient for a tensor that is not a leaf: {:?}",
            store.get_id(*id).map(|t| t.dims().to_vec())
        );
    }
    if let Some(x) = input {
        let want = plain.get(x.as_tensor()).expect("the plain input gradient");
        let got = store
            .get(x.as_tensor())
            .expect("{what}: the input's gradient");
        assert_eq!(bits(got), bits(want), "{what}: input gradient differs");
    }
    assert_eq!(q.pending(), 1, "{what}: one queued weight gradient");
    assert!(
        q.weight_grads(0).unwrap().is_empty(),
        "{what}: nothing for another micro-batch"
    );
    let got = q.weight_grads(3).unwrap();
    let (_, g) = got.iter().next().expect("a gradient");
    assert_eq!(
        bits(g),
        bits(&want),
        "{what}: deferred gradient differs from the plain one"
    );
    assert_eq!(q.pending(), 0);
}

#[test]
fn deferred_weight_gradients_equal_plain_ones_bit_for_bit() {
    let init = Init::cpu(1);
    let x = Var::from_tensor(&randn("x", &[2, 3, 5])).unwrap();
    let l = Linear::new(&init, "fc", 5, 4, true).unwrap();
    check(
        "linear (out, in)",
        &l.params()[0].1,
        Some(&x),
        &[l.params()[1].1.clone()],
        |cx| l.forward_cx(x.as_tensor(), cx).unwrap(),
    );
    let c = Linear::conv1d(&init, "c_fc", 5, 6, 0.5).unwrap();
    check(
        "linear (in, out)",
        &c.params()[0].1,
        Some(&x),
        &[c.params()[1].1.clone()],
        |cx| c.forward_cx(x.as_tensor(), cx).unwrap(),
    );
    // Fed with ids: nothing upstream needs a gradient, and the weight still gets its own.
    let e = Embedding::new(&init, "wte", 7, 4, 1.0).unwrap();
    let ids = Tensor::new(&[[1u32, 3, 3], [6, 0, 1]], &Device::Cpu).unwrap();
    check("embedding", e.weight(), None, &[], |cx| {
        e.forward_cx(&ids, cx).unwrap()
    });
    let img = Var::from_tensor(&randn("img", &[2, 3, 6, 6])).unwrap();
    for (k, s, p) in [(3, 1, 1), (3, 2, 1), (1, 2, 0)] {
        let conv = Conv2d::new(&init, "conv", 3, 4, k, s, p, false).unwrap();
        let what = format!("conv k{k} s{s} p{p}");
        check(&what, &conv.params()[0].1, Some(&img), &[], |cx| {
            conv.forward_cx(img.as_tensor(), cx).unwrap()
        });
    }
    // An image that is no variable: nothing upstream needs a gradient.
    let conv = Conv2d::new(&init, "conv", 3, 4, 3, 1, 1, false).unwrap();
    let plain = img.as_tensor().detach();
    check(
        "conv of a plain image",
        &conv.params()[0].1,
        None,
        &[],
        |cx| conv.forward_cx(&plain, cx).unwrap(),
    );
}
