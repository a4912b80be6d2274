//! Generated tasks: deterministic, correct, and never training on held-out examples.

use std::collections::HashSet;

use pipewright::model::nn::IGNORE_INDEX;
use pipewright_models::tasks::{Adder, Shapes, Sort, Text};
use pipewright_models::{Task, TaskShape};

#[test]
fn adder_sequences_are_sums_and_held_out_problems_are_never_drawn() {
    let task = Adder::new(2, 9).unwrap();
    assert_eq!(task.held_out().len(), 1000);
    assert_eq!(
        task.shape(),
        TaskShape::Tokens {
            vocab: 10,
            seq_len: 6
        }
    );
    // Perfect oracle predictor: evaluate must report 1.0.
    let mut oracle = |x: &candle_core::Tensor| {
        let rows: Vec<Vec<u32>> = x.to_vec2::<u32>()?;
        let t = rows[0].len();
        let mut logits = vec![0f32; rows.len() * t * 10];
        for (b, r) in rows.iter().enumerate() {
            let a = r[0] * 10 + r[1];
            let c = r[2] * 10 + r[3];
            let sum = format!("{:03}", a + c)
                .chars()
                .rev()
                .map(|d| d.to_digit(10).unwrap())
                .collect::<Vec<_>>();
            let next = sum[t - 4];
            logits[(b * t + t - 1) * 10 + next as usize] = 1.0;
        }
        Ok(candle_core::Tensor::from_vec(
            logits,
            (rows.len(), t, 10),
            &candle_core::Device::Cpu,
        )?)
    };
    assert_eq!(task.evaluate(&mut oracle).unwrap(), 1.0);

    let (x, y) = task.batch(0, 50).unwrap();
    let (x2, y2) = task.batch(0, 50).unwrap();
    assert_eq!(x.to_vec2::<u32>().unwrap(), x2.to_vec2::<u32>().unwrap());
    assert_eq!(y.to_vec2::<i64>().unwrap(), y2.to_vec2::<i64>().unwrap());
    for (xs, ys) in x
        .to_vec2::<u32>()
        .unwrap()
        .iter()
        .zip(y.to_vec2::<i64>().unwrap())
    {
        let a = xs[0] * 10 + xs[1];
        let b = xs[2] * 10 + xs[3];
        assert_eq!(&ys[..3], &[IGNORE_INDEX; 3]);
        let c = ys[3] + 10 * ys[4] + 100 * ys[5];
        assert_eq!(c as u32, a + b);
    }
    // Held-out problems never appear in training batches.
    let held: HashSet<(u32, u32)> = task
        .held_out()
        .iter()
        .map(|&(a, b)| (a as u32, b as u32))
        .collect();
    let mut seen = HashSet::new();
    for s in 0..200 {
        for r in task.batch(s, 64).unwrap().0.to_vec2::<u32>().unwrap() {
            let p = (r[0] * 10 + r[1], r[2] * 10 + r[3]);
            assert!(
                !held.contains(&p),
                "step {s} trains on held-out problem {p:?}"
            );
            seen.insert(p);
        }
    }
    // 12 800 draws over the 9 000 trainable problems reach about 6 800 of them.
    assert!(
        seen.len() > 6000,
        "training drew only {} distinct problems",
        seen.len()
    );
    assert!(Adder::new(0, 0).is_err());
}

#[test]
fn sort_targets_are_sorted_inputs() {
    let task = Sort::new(6, 3, 0).unwrap();
    let (x, y) = task.batch(1, 20).unwrap();
    for (xs, ys) in x
        .to_vec2::<u32>()
        .unwrap()
        .iter()
        .zip(y.to_vec2::<i64>().unwrap())
    {
        let mut s = xs[..6].to_vec();
        s.sort();
        assert_eq!(&ys[..5], &[IGNORE_INDEX; 5]);
        let got: Vec<u32> = ys[5..].iter().map(|v| *v as u32).collect();
        assert_eq!(got, s);
    }
}

#[test]
fn text_windows_and_errors() {
    let bytes: Vec<u8> = (0..400u32).map(|i| b'a' + (i % 26) as u8).collect();
    let task = Text::from_bytes(bytes, 16, 0).unwrap();
    let (x, y) = task.batch(0, 4).unwrap();
    let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<i64>().unwrap());
    for (xs, ys) in x.iter().zip(&y) {
        assert_eq!(
            &xs[1..],
            &ys[..15].iter().map(|v| *v as u32).collect::<Vec<_>>()[..]
        );
    }
    assert!(Text::from_bytes(b"tiny".to_vec(), 16, 0).is_err());
    let missing = Text::from_file(std::path::Path::new("/nonexistent/file.txt"), 16, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(missing.contains("/nonexistent/file.txt"), "{missing}");
}

#[test]
fn shapes_are_deterministic_and_all_classes_occur() {
    let task = Shapes::new(16, 0).unwrap();
    let (x, y) = task.batch(3, 64).unwrap();
    let (x2, _) = task.batch(3, 64).unwrap();
    assert_eq!(x.dims(), &[64, 1, 16, 16]);
    let a = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a, x2.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    let classes: HashSet<i64> = y.to_vec1::<i64>().unwrap().into_iter().collect();
    assert_eq!(classes.len(), 4);
}
