//! Pipeline parity through the one production step: a GPT split over pp ranks (threads,
//! pp-only layouts of [`Varuna`]) and trained with each schedule and recompute mode gives the
//! serial run's losses, gradients and parameters; misused skips and cuts are clear errors.

mod common;

use candle_core::Tensor;
use common::*;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::Balance;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::parallel::pipeline::Recompute;
use pipewright::{Batch, Sequential};

#[test]
fn gpipe_1f1b_and_zero_bubble_match_serial_training_in_every_recompute_mode() {
    for chunks in [1, 3, 4] {
        let case = gpt_case(chunks);
        let want = serial(&case);
        for pp in [1, 2, 4] {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubbleH1,
            ] {
                for recompute in RECOMPUTE {
                    let what = format!("{kind} pp={pp} chunks={chunks} recompute {recompute:?}");
                    compare(&what, &pipelined(&case, pp, kind, 1, recompute), &want);
                }
            }
        }
    }
}

#[test]
fn interleaved_matches_serial_training() {
    for (pp, chunks) in [(2, 4), (2, 2), (1, 3)] {
        let case = gpt_case(chunks);
        let want = serial(&case);
        for recompute in RECOMPUTE {
            compare(
                &format!("interleaved pp={pp} chunks={chunks} v=2 recompute {recompute:?}"),
                &pipelined(&case, pp, ScheduleKind::Interleaved, 2, recompute),
                &want,
            );
        }
    }
}

#[test]
fn a_schedule_saved_to_a_file_and_loaded_back_trains_to_the_same_losses() {
    let case = gpt_case(4);
    let dir = std::env::temp_dir().join(format!("pw-schedule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("zb1.csv");
    Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 4, 1)
        .unwrap()
        .save(&path)
        .unwrap();
    let loaded = Schedule::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let mut opts = options(&case, 2, ScheduleKind::GPipe, 1, Recompute::Never);
    opts.spec.pipeline.custom_schedule = Some(loaded);
    let got = pipelined_with(&case, 2, opts);
    let built = pipelined(&case, 2, ScheduleKind::ZeroBubbleH1, 1, Recompute::Never);
    assert_eq!(
        got.0, built.0,
        "the loaded zb1 and the built one give other losses"
    );
    compare("zb1 loaded from a file", &got, &serial(&case));
}

#[test]
fn a_v_shaped_schedule_trains_to_the_serial_losses() {
    // Two ranks, four stages in a V (ZB-V's placement): rank 0 holds stages 0 and 3 (the
    // embedding and the tied head), rank 1 holds 1 and 2.
    // Each rank runs GPipe's order over its two stages, written as PyTorch's CSV.
    let case = gpt_case(2);
    let v = Schedule::from_csv(
        "0F0,0F1,3F0,3F1,3B0,3B1,0B0,0B1\n\
         1F0,1F1,2F0,2F1,2B0,2B1,1B0,1B1\n",
    )
    .unwrap();
    assert_eq!(v.placement().unwrap(), vec![0, 1, 1, 0]);
    let mut opts = options(&case, 2, ScheduleKind::GPipe, 1, Recompute::Never);
    opts.spec.pipeline.custom_schedule = Some(v);
    compare(
        "V-shaped",
        &pipelined_with(&case, 2, opts.clone()),
        &serial(&case),
    );
    // One that does not fit the pipeline is refused before anything is built.
    opts.spec.pipeline.custom_schedule = Some(Schedule::new(ScheduleKind::GPipe, 2, 3, 1).unwrap());
    let e = opts.validate(&case.model, 2).unwrap_err().to_string();
    assert!(e.contains("3 micro-batches") && e.contains("chunks"), "{e}");
}

/// Per rank: (most forward graphs, most stage inputs) held during one step.
fn peaks(c: &Case, pp: usize, kind: ScheduleKind, recompute: Recompute) -> Vec<(usize, usize)> {
    let opts = options(c, pp, kind, 1, recompute);
    local::run(pp, |comm| {
        let mut p = Varuna::new(&c.model, Box::new(comm), opts.clone())?;
        p.set_optimizer(adamw)?;
        p.step(&(c.batch)(0))?;
        Ok((p.pipeline().peak_activations(), p.pipeline().peak_inputs()))
    })
    .unwrap()
}

#[test]
fn the_executor_holds_the_activations_its_schedule_promises() {
    let (pp, m) = (4, 6);
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZeroBubbleH1,
    ] {
        let got: Vec<usize> = peaks(&gpt_case(m), pp, kind, Recompute::Never)
            .into_iter()
            .map(|p| p.0)
            .collect();
        let want: Vec<usize> = match kind {
            ScheduleKind::GPipe => vec![m; pp],
            _ => (0..pp).map(|s| (pp - s).min(m)).collect(),
        };
        assert_eq!(got, want, "{kind}");
    }
}

#[test]
fn bad_pipeline_configurations_are_errors() {
    let case = gpt_case(2);
    let err = |opts: VarunaOptions| {
        local::run(2, |comm| {
            Varuna::new(&case.model, Box::new(comm), opts.clone()).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    let base = options(&case, 2, ScheduleKind::GPipe, 1, Recompute::Never);
    let e = err(base
        .clone()
        .with_spec(|s| s.pipeline.balance = Some(Balance::Layers(vec![4, 3]))));
    assert!(e.contains("sums to 7 but the model has 6 segments"), "{e}");
    let e = err(base.clone().with_spec(|s| s.batch.micro_batch = 5));
    assert!(
        e.contains("a global batch of 12 rows does not split into 1 data-parallel replicas of micro-batches of 5 rows"),
        "{e}"
    );
    let e = err(base.with_spec(|s| {
        s.pipeline.schedule.kind = ScheduleKind::Interleaved;
        s.pipeline.schedule.virtual_stages = 2;
        s.batch.micro_batch = 12;
    }));
    assert!(e.contains("micro-batches"), "{e}");
}

#[test]
fn always_recompute_holds_only_stage_inputs() {
    let (pp, m) = (2, 4);
    for (recompute, graphs) in [
        (Recompute::Always, vec![0, 0]),
        (Recompute::ExceptLast, vec![1, 1]),
        (Recompute::Never, vec![4, 4]),
    ] {
        let (a, i): (Vec<usize>, Vec<usize>) =
            peaks(&gpt_case(m), pp, ScheduleKind::GPipe, recompute)
                .into_iter()
                .unzip();
        assert_eq!(a, graphs, "{recompute:?}: forward graphs held");
        assert_eq!(
            i,
            vec![m, m],
            "{recompute:?}: GPipe holds every stage input"
        );
    }
}

mod skip_misuse {
    use super::*;
    use pipewright::model::{Activation, Cx, Layer, LayerSpec};

    /// A layer that stashes or pops a name (or does nothing), passing its input on.
    struct Probe {
        stash: Option<&'static str>,
        pop: Option<&'static str>,
    }

    impl Layer for Probe {
        fn name(&self) -> &str {
            "probe"
        }
        fn forward(&self, x: Activation, cx: &mut Cx) -> pipewright::Result<Activation> {
            let t = x.into_tensor("probe")?;
            if let Some(n) = self.stash {
                cx.stash("probe", n, t.clone())?;
            }
            if let Some(n) = self.pop {
                return Ok((t + cx.pop("probe", n)?)?.into());
            }
            Ok(t.into())
        }
        fn params(&self) -> Vec<(String, candle_core::Var)> {
            Vec::new()
        }
    }

    fn spec(i: usize, stash: Option<&'static str>, pop: Option<&'static str>) -> LayerSpec {
        LayerSpec::new(format!("l{i}"), move |_| {
            Ok(Box::new(Probe { stash, pop }) as Box<dyn Layer>)
        })
    }

    #[test]
    fn misused_skips_are_clear_errors() {
        let mut pop_first = Sequential::new();
        pop_first
            .push(spec(0, None, Some("s")).pops(&["s"]))
            .push(spec(1, Some("s"), None).stashes(&["s"]));
        assert!(pop_first
            .skips()
            .unwrap_err()
            .to_string()
            .contains("which no earlier layer stashes"));
        let mut twice = Sequential::new();
        twice
            .push(spec(0, Some("s"), None).stashes(&["s"]))
            .push(spec(1, Some("s"), None).stashes(&["s"]));
        assert!(twice
            .skips()
            .unwrap_err()
            .to_string()
            .contains("stashed by two layers"));
        let mut never = Sequential::new();
        never
            .push(spec(0, Some("s"), None).stashes(&["s"]))
            .push(spec(1, None, None));
        assert!(never
            .skips()
            .unwrap_err()
            .to_string()
            .contains("no later layer pops it"));
        // At run time: popping what was never stashed, and stashing without declaring it.
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let mut cx = Cx::eval();
        let e = Probe {
            stash: None,
            pop: Some("ghost"),
        }
        .forward(x.clone().into(), &mut cx)
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("pops `ghost` but no earlier layer stashed it"),
            "{e}"
        );
        let mut undeclared = Sequential::new();
        undeclared
            .push(spec(0, Some("hidden"), None))
            .cut()
            .push(spec(1, None, None));
        let e = local::run(2, |comm| {
            let opts = VarunaOptions::new(Layout::new(2, 1, 1)?, 2, 2);
            let p = Varuna::new(&undeclared, Box::new(comm), opts)?;
            p.predict(&Batch::input(x.clone())).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "model stage 0: skip connections [\"hidden\"] were stashed but nothing pops them"
            ),
            "{e}"
        );
    }
}

#[test]
fn an_activation_without_the_batch_on_dim_0_is_refused_at_the_cut() {
    use pipewright::model::{Activation, Cx, Layer, LayerSpec};
    struct Transpose;
    impl Layer for Transpose {
        fn name(&self) -> &str {
            "transpose"
        }
        fn forward(&self, x: Activation, _cx: &mut Cx) -> pipewright::Result<Activation> {
            Ok(x.into_tensor("transpose")?.t()?.into())
        }
        fn params(&self) -> Vec<(String, candle_core::Var)> {
            Vec::new()
        }
    }
    let mut m = Sequential::new();
    m.push(LayerSpec::new("t0", |_| {
        Ok(Box::new(Transpose) as Box<dyn Layer>)
    }))
    .cut();
    m.push(LayerSpec::new("t1", |_| {
        Ok(Box::new(Transpose) as Box<dyn Layer>)
    }));
    let x = Tensor::zeros((4, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let e = local::run(2, |comm| {
        let opts = VarunaOptions::new(Layout::new(2, 1, 1)?, 4, 4);
        Varuna::new(&m, Box::new(comm), opts)?
            .predict(&Batch::input(x.clone()))
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(
            "layer 0 ends model stage 0 with an output of shape [3, 4] for a micro-batch of 4 rows"
        ),
        "{e}"
    );
}
