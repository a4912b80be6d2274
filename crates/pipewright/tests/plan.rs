//! Profiling, balancing, planning and morphing a model that is not the GPT, from the library
//! alone: a layer far larger than the others gets a stage of its own by size and is the
//! slowest by time; a plain MLP is profiled, planned and morphed to worlds of other sizes.

use pipewright::parallel::dims::{BatchSpec, ParallelSpec};
use pipewright::parallel::pipeline::ScheduleChoice;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, DType, Device, Shape, Tensor, Var};
use pipewright::distributed::topology::Layout;
use pipewright::model::nn::{Linear, Module};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::plan::{
    balance_by, estimate, layouts, measure, morph, morph_layouts, profile_layers, rank,
    search::candidates, By, Candidate, Cluster, Hardware, MorphPlanner, MorphRequest, Profile,
    Request, Sizes,
};
use pipewright::{Batch, Build, Result};

struct Dense(Linear, String);

impl Layer for Dense {
    fn name(&self) -> &str {
        &self.1
    }
    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        Ok(self.0.forward(&x.into_tensor(&self.1)?)?.tanh()?.into())
    }
    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

fn model(widths: &[usize]) -> Sequential {
    let mut m = Sequential::new();
    for (i, w) in widths.windows(2).enumerate() {
        let (inp, out) = (w[0], w[1]);
        let name = format!("l{i}");
        m.push(LayerSpec::new(name.clone(), move |b: &Build| {
            Ok(
                Box::new(Dense(Linear::new(b, &name, inp, out, true)?, name.clone()))
                    as Box<dyn Layer>,
            )
        }));
    }
    m
}

#[test]
fn a_huge_layer_is_isolated_by_size_and_slowest_by_time() {
    // l2 is 512 x 512; the others at most 16 x 512.
    let m = model(&[16, 16, 512, 512, 16, 16]);
    let x = Tensor::ones((64, 16), DType::F32, &Device::Cpu).unwrap();
    let sample = Batch::input(x);
    let costs = profile_layers(&m, &Build::cpu(0), &sample, 3, None).unwrap();
    assert_eq!(costs.len(), 5);
    assert_eq!(costs[2].param_bytes, (512 * 512 + 512) * 4);
    assert_eq!(costs[0].activation_bytes, 64 * 16 * 4);
    assert!(costs[2].time() > costs[0].time(), "{costs:?}");
    let b = balance_by(By::Size, &m, &Build::cpu(0), &sample, &[0, 1, 2]).unwrap();
    assert_eq!(b, vec![2, 1, 2], "l2 alone");
}

#[test]
fn a_users_mlp_is_planned_and_morphed_from_the_library() {
    // Five layers, so at most five pipeline stages; a plain MLP does not split (tp 1).
    let m = model(&[16, 64, 64, 64, 64, 16]);
    let batch = |rows: usize| -> Result<Batch> {
        Ok(Batch::input(Tensor::ones(
            (rows, 16),
            DType::F32,
            &Device::Cpu,
        )?))
    };
    let sizes = Sizes {
        rows: vec![2, 4],
        tp: vec![1],
        concurrent: 1,
        loss: None,
    };
    let profile = measure(&m, &Build::cpu(0), &batch, &sizes, vec![1], "here".into()).unwrap();
    assert_eq!(profile.units(), 5);
    // The update after the schedule is timed too: a line in parameters that costs something
    // for the model's (about 17 k) and is not a bandwidth bound's 28 bytes at 8 GB/s.
    let update = profile
        .optimizer
        .expect("a measured profile times its update");
    let params: u64 = profile.layers.iter().map(|l| l.params).sum();
    assert!(update.at(params as usize) > 0.0, "{update:?}");
    // So is the sum of each micro-batch's gradients into the step's running sum.
    let sum = profile
        .accumulate
        .expect("a measured profile times its gradient sum");
    assert!(sum.at(params as usize) > 0.0, "{sum:?}");
    let mut text = serde_json::to_value(&profile).unwrap();
    text.as_object_mut().unwrap().remove("optimizer");
    text.as_object_mut().unwrap().remove("accumulate");
    let old: Profile = serde_json::from_value(text).unwrap();
    assert_eq!(
        (old.optimizer, old.accumulate),
        (None, None),
        "a profile written before the update and the sum were timed still reads"
    );
    let hw = Hardware::load("cpu-2core").unwrap();

    // Plan: every candidate of a world of 4 for a batch of 24, the fastest first.
    let req = Request {
        world: 4,
        memory_bytes: 1e12,
        global_batch: 24,
        top: 3,
    };
    let cluster = Cluster::new(&hw, 4, None).unwrap();
    let all = candidates(&req, &profile);
    assert!(all
        .iter()
        .all(|c| c.parallel.layout.tp == 1 && c.parallel.layout.pp <= 5));
    let best = rank(&profile, &cluster, &req, all.clone()).unwrap();
    let fastest = all
        .iter()
        .map(|c| estimate(&profile, &cluster, c).unwrap().0.step_s)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(best.len(), 3);
    assert!(
        (best[0].step_s - fastest).abs() <= 1e-12 * fastest,
        "{best:?}"
    );

    // A crowded efficiency of 0.5 halves the speed of a layout whose ranks crowd the two
    // cores (dp 4 on one node, a rank standing for all four: always) and leaves one whose
    // ranks each have a core (dp 2) as it was.
    let crowded = Profile {
        crowded_efficiency: Some(0.5),
        ..profile.clone()
    };
    for (dp, slower) in [(4, 2.0), (2, 1.0)] {
        let cluster = Cluster::new(&hw, dp, Some(1)).unwrap();
        let c = Candidate {
            parallel: ParallelSpec::new(Layout::new(1, 1, dp).unwrap()),
            micro_batch: 3,
            micro_batches: 2,
            schedule: ScheduleChoice::default(),
        };
        let schedule = |p: &Profile| estimate(p, &cluster, &c).unwrap().1.makespan;
        let ratio = schedule(&crowded) / schedule(&profile);
        assert!((ratio - slower).abs() <= 1e-9, "dp {dp}: {ratio}");
    }

    // Morph a run of pp 2 x dp 2 in micro-batches of 4 rows to other worlds.
    let from = Layout::new(2, 1, 2).unwrap();
    let request = |world| MorphRequest {
        world,
        from: ParallelSpec::new(from),
        batch: BatchSpec {
            global_batch: 24,
            micro_batch: 4,
        },
        schedule: ScheduleChoice::default(),
        tp_divides: vec![1],
    };
    // World 2: (1, 1, 2) or (2, 1, 1); without a profile the same pp is nearest.
    assert_eq!(
        morph_layouts(&request(2), &m),
        vec![Layout::new(2, 1, 1).unwrap(), Layout::new(1, 1, 2).unwrap()]
    );
    let nearest = morph(&request(2), &m, None).unwrap();
    assert_eq!(
        (nearest.layout, nearest.step_s),
        (Layout::new(2, 1, 1).unwrap(), None)
    );
    // World 8: pp 8 has no stage for every rank (5 layers) and dp 4 or 8 does not divide the
    // 6 micro-batches of 4 rows: only pp 4 x dp 2 is left.
    assert_eq!(
        morph_layouts(&request(8), &m),
        vec![Layout::new(4, 1, 2).unwrap()]
    );
    // Before the micro-batch size: pp 1, 2 and 4 (dp 8, 4, 2 each divide 24 rows).
    let l = |pp, dp| Layout::new(pp, 1, dp).unwrap();
    assert_eq!(layouts(8, 5, &[1], 24), vec![l(1, 8), l(2, 4), l(4, 2)]);
    // World 6 with the planner: its choice is the fastest layout by the estimate.
    let cluster6 = Cluster::new(&hw, 6, None).unwrap();
    let planned = morph(
        &request(6),
        &m,
        Some(MorphPlanner {
            profile: &profile,
            cluster: cluster6,
            memory_bytes: 1e12,
        }),
    )
    .unwrap();
    let by_estimate = morph_layouts(&request(6), &m)
        .into_iter()
        .map(|layout| {
            let c = Candidate {
                parallel: ParallelSpec::new(layout),
                micro_batch: 4,
                micro_batches: 24 / (layout.dp * 4),
                schedule: ScheduleChoice::default(),
            };
            (estimate(&profile, &cluster6, &c).unwrap().0.step_s, layout)
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    assert_eq!(planned.layout, by_estimate.1, "{planned:?}");
    assert!((planned.step_s.unwrap() - by_estimate.0).abs() <= 1e-12 * by_estimate.0);
    // World 7 fits nothing: a clear error.
    let e = morph(&request(7), &m, None).unwrap_err().to_string();
    assert!(e.contains("no layout of 7 ranks"), "{e}");
}

/// Writes `F<i>` to the log when its layer's forward runs and `B<i>` when the backward passes
/// its output: the identity, with a backward that says when it ran.
struct Tap(usize, Arc<Mutex<Vec<String>>>);

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "tap"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = &s.as_slice::<f32>()?[l.start_offset()..][..l.shape().elem_count()];
        Ok((CpuStorage::F32(v.to_vec()), l.shape().clone()))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.1.lock().unwrap().push(format!("B{}", self.0));
        Ok(Some(grad.clone()))
    }
}

struct Logged(Dense, usize, Arc<Mutex<Vec<String>>>);

impl Layer for Logged {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        self.2.lock().unwrap().push(format!("F{}", self.1));
        let y = self.0.forward(x, cx)?.into_tensor("logged")?;
        Ok(y.apply_op1(Tap(self.1, self.2.clone()))?.into())
    }
    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

#[test]
fn a_profile_runs_the_layers_in_a_stages_order() {
    // Each layer timed twice in a row found its weights and input in the cache from the
    // first time, and this machine's layouts were predicted up to 27 % fast: the profile runs
    // every forward in order, then every backward in reverse, as a stage does (and so again
    // for the split backward, whose weight gradients follow each layer's input gradient).
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut m = Sequential::new();
    for i in 0..3 {
        let log = log.clone();
        m.push(LayerSpec::new(format!("l{i}"), move |b: &Build| {
            let name = format!("l{i}");
            let dense = Dense(Linear::new(b, &name, 8, 8, true)?, name);
            Ok(Box::new(Logged(dense, i, log.clone())) as Box<dyn Layer>)
        }));
    }
    let sample = Batch::input(Tensor::ones((4, 8), DType::F32, &Device::Cpu).unwrap());
    let costs = profile_layers(&m, &Build::cpu(0), &sample, 2, None).unwrap();
    assert_eq!(costs.len(), 3);
    let sweep = ["F0", "F1", "F2", "B2", "B1", "B0"];
    // Two repeats, each a sweep for the split backward and one for the whole.
    assert_eq!(*log.lock().unwrap(), sweep.repeat(4));
}
