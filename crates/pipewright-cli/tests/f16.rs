//! An f16 run's log: its dynamic loss scale and the steps it skipped, on every evaluation
//! line (a log written to a file has no progress bar to show them).

mod common;

use common::{text, tmp, train, TINY};

#[test]
fn an_f16_run_logs_its_loss_scale_and_skipped_steps() {
    // A log written to a file has no progress bar: the evaluation lines carry the scale. It
    // starts at 2^16 (PyTorch's GradScaler), halves on each skipped step and cannot grow
    // within 2000 good ones, so each line's scale is 65536 / 2^skipped.
    let out = tmp("f16-log");
    let mut args = TINY.to_vec();
    let dir = out.to_str().unwrap();
    args.extend_from_slice(&["--precision", "f16", "--steps", "20", "--eval-every", "10"]);
    args.extend_from_slice(&["--out", dir]);
    let o = train(&args);
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    // `step N  loss ...`: "step" and a number (not the summary's `steps` or `step time`).
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some("step") && w.next().is_some_and(|n| n.parse::<u64>().is_ok())
        })
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    for line in lines {
        let after = |key: &str| -> f64 {
            let rest = line.split(key).nth(1).unwrap_or_else(|| panic!("{line}"));
            rest.split_whitespace().next().unwrap().parse().unwrap()
        };
        let (scale, skipped) = (after("loss scale "), after("skipped "));
        assert_eq!(scale, 65536.0 / 2f64.powf(skipped), "{line}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}
