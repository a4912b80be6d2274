//! Data-parallel pieces: bucketed gradient sums equal per-parameter sums with far fewer
//! collectives, and the distributed loader gives each replica its own rows, deterministically.

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::{local, Communicator};
use pipewright::model::nn::Grads;
use pipewright::parallel::data_parallel::{
    all_reduce_grads, shard_batch, ReplicaBatches, DEFAULT_BUCKET_BYTES,
};
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::Batch;

fn grads(rank: usize) -> Grads {
    let mut g = Grads::new();
    for (i, shape) in [vec![3, 4], vec![4], vec![16, 8], vec![1], vec![5, 5, 2]]
        .into_iter()
        .enumerate()
    {
        let n = shape.iter().product();
        let v: Vec<f32> = normal_vec(&mut rng_for(rank as u64, &format!("g{i}")), n, 0.0, 1.0)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        g.insert(
            format!("p{i}"),
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap(),
        );
    }
    g
}

#[test]
fn bucketed_sums_equal_per_parameter_sums() {
    // Buckets fill in name order until they reach the size: 48+16+512 bytes, then 4+200.
    for (bucket, want_collectives) in [(DEFAULT_BUCKET_BYTES, 1), (256, 2), (1, 5)] {
        let out = local::run(3, |comm| {
            let mut g = grads(comm.rank());
            let n = all_reduce_grads(&mut g, &comm, bucket)?;
            Ok((n, g))
        })
        .unwrap();
        let want: Vec<(String, Tensor)> = grads(0)
            .iter()
            .map(|(n, _)| {
                let s = (0..3).fold(None::<Tensor>, |acc, r| {
                    let t = grads(r).get(n).unwrap().clone();
                    Some(match acc {
                        None => t,
                        Some(a) => (a + t).unwrap(),
                    })
                });
                (n.clone(), s.unwrap())
            })
            .collect();
        for (n, g) in &out {
            assert_eq!(*n, want_collectives, "bucket of {bucket} bytes");
            for (name, w) in &want {
                let d = (g.get(name).unwrap() - w)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(d < 1e-6, "{name}: off by {d}");
                assert_eq!(g.get(name).unwrap().dims(), w.dims());
            }
        }
    }
}

#[test]
fn each_replica_gets_its_rows_of_the_same_global_batch() {
    let global = |step: u64, rows: usize| -> pipewright::Result<Batch> {
        let x: Vec<u32> = (0..rows as u32).map(|r| r + 100 * step as u32).collect();
        let y: Vec<i64> = x.iter().map(|v| *v as i64).collect();
        Ok(Batch::pair(
            Tensor::from_vec(x, rows, &Device::Cpu)?,
            Tensor::from_vec(y, rows, &Device::Cpu)?,
        ))
    };
    let mut seen = Vec::new();
    for rank in 0..4 {
        let l = ReplicaBatches::new(global, 8, rank, 4, Device::Cpu).unwrap();
        let b = l.batch(3).unwrap();
        let (x, y) = (b.get("inputs").unwrap(), b.get("targets").unwrap());
        assert_eq!(
            x.to_vec1::<u32>().unwrap(),
            l.batch(3)
                .unwrap()
                .get("inputs")
                .unwrap()
                .to_vec1::<u32>()
                .unwrap(),
            "deterministic"
        );
        assert_eq!(y.dims(), [2]);
        seen.extend(x.to_vec1::<u32>().unwrap());
    }
    assert_eq!(
        seen,
        (300..308).collect::<Vec<u32>>(),
        "the replicas' rows are the global batch, once each"
    );
    let err = ReplicaBatches::new(global, 6, 0, 4, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("global batch of 6 does not split evenly over 4"),
        "{err}"
    );
    let odd = Batch::new().with(
        "x",
        Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(shard_batch(&odd, 0, 2).is_err());
}
