//! The V-shaped schedules (ZB-V, DualPipeV) and a schedule a user writes train as serial
//! training does: a tied GPT whose embedding and head share rank 0 of the V, at pp 2 and 4 in
//! every recompute mode (losses, first gradients and final parameters within 1e-5), with tensor
//! and data parallelism and ZeRO-3 (5 clipped AdamW steps, [`ParityRun`]); a saved schedule
//! edited by hand trains the same, an illegal edit is refused naming the rank and the action.

mod common;

use common::*;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::parallel::pipeline::Recompute;
use pipewright::parallel::zero::Zero;
use pipewright_models::parity::{worst_difference, ParityRun};
use pipewright_models::{gpt, GptConfig};

const V: [ScheduleKind; 2] = [ScheduleKind::ZeroBubbleV, ScheduleKind::DualPipeV];

/// A tied GPT of 6 blocks: 8 units between cut points, two per stage of a V over 4 ranks.
fn deep_case(chunks: usize) -> Case {
    Case {
        model: gpt(GptConfig {
            n_layer: 6,
            ..cfg()
        })
        .unwrap(),
        ..gpt_case(chunks)
    }
}

#[test]
fn v_schedules_match_serial_training_in_every_recompute_mode() {
    // 12 micro-batches: at least 2 x pp for DualPipeV at pp 4.
    let case = deep_case(12);
    let want = serial(&case);
    for kind in V {
        for pp in [2, 4] {
            for recompute in RECOMPUTE {
                let what = format!("{kind} pp={pp} recompute {recompute:?}");
                compare(&what, &pipelined(&case, pp, kind, 1, recompute), &want);
            }
        }
    }
}

#[test]
fn v_schedules_match_serial_training_with_tp_dp_and_zero_3() {
    let run = ParityRun::default();
    let want = run.serial().unwrap();
    for kind in V {
        for (pp, tp, dp, zero) in [
            (2, 2, 1, Zero::Off),
            (2, 1, 2, Zero::Off),
            (2, 1, 2, Zero::Parameters),
            (2, 2, 2, Zero::Parameters),
        ] {
            let layout = Layout::new(pp, tp, dp).unwrap();
            let opts = run.options(layout).with_spec(|s| {
                s.pipeline.schedule.kind = kind;
                s.parallel.zero = zero;
            });
            let ranks =
                local::run(layout.world(), |c| run.rank(Box::new(c), opts.clone())).unwrap();
            for (rank, got) in ranks.iter().enumerate() {
                let worst = worst_difference(got, &want).unwrap();
                assert!(
                    worst < 1e-5,
                    "{kind} {layout} {zero:?} rank {rank}: off by {worst:e}"
                );
            }
        }
    }
}

/// `text` with the actions `a` and `b` of rank `r` swapped.
fn swapped(text: &str, r: usize, a: &str, b: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let mut acts: Vec<&str> = lines[r].split(',').collect();
    let i = acts.iter().position(|x| *x == a).unwrap();
    let j = acts.iter().position(|x| *x == b).unwrap();
    acts.swap(i, j);
    lines[r] = acts.join(",");
    lines.join("\n") + "\n"
}

#[test]
fn a_saved_schedule_edited_by_hand_trains_and_an_illegal_edit_is_refused() {
    let case = gpt_case(4);
    let dir = std::env::temp_dir().join(format!("pw-vsched-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("zbv.csv");
    let built = Schedule::new(ScheduleKind::ZeroBubbleV, 2, 4, 1).unwrap();
    built.save(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    // Legal: rank 0 runs the weight pass of micro-batch 0 on stage 3 after the next forward.
    let edited = swapped(&text, 0, "3W0", "3F1");
    std::fs::write(&path, &edited).unwrap();
    let loaded = Schedule::load(&path).unwrap();
    assert_ne!(loaded, built);
    let mut opts = options(&case, 2, ScheduleKind::OneFOneB, 1, Recompute::Never);
    opts.spec.pipeline.custom_schedule = Some(loaded);
    compare(
        "zbv edited by hand",
        &pipelined_with(&case, 2, opts.clone()),
        &serial(&case),
    );
    // Illegal: rank 1 runs stage 2's input gradient of micro-batch 0 before its forward.
    std::fs::write(&path, swapped(&text, 1, "2F0", "2I0")).unwrap();
    let bad = Schedule::load(&path).unwrap();
    opts.spec.pipeline.custom_schedule = Some(bad);
    let e = opts.validate(&case.model, 2).unwrap_err().to_string();
    assert!(
        e.contains("deadlocks") && e.contains("rank 1 at 2I0 waits for forward of micro-batch 0"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
