//! What a resumed run may change. A checkpoint goes on as the run that saved it: the same
//! data (the same shards or blend, wherever they now lie), global batch and seed, or its
//! steps would not be the uninterrupted run's, and its record would describe another run. The
//! learning rate may change (lowering it after a spike is common practice, as Megatron-LM's
//! `--override-opt_param-scheduler` allows); it is taken and said. The layout, precision and
//! cadence may change freely (a resume in another layout is exact).

use std::path::Path;

use pipewright::{invalid, Result};

use crate::{RunSpec, TaskSpec};

impl RunSpec {
    /// Fails when this run cannot resume a checkpoint saved by `stored` (another data set,
    /// global batch or seed, each named with both values); else the changes it takes, each a
    /// line to say (a new learning rate).
    pub fn resumes(&self, stored: &RunSpec) -> Result<Vec<String>> {
        let refuse = |what: &str, then: String, now: String| {
            invalid!(
                "the checkpoint's run trained with {what} {then} and this one gives {now}: a \
                 resumed run goes on as the run that saved it (give {then}), or start a new \
                 run from its weights (`--init-from` an export of it)"
            )
        };
        let (t, s) = (&self.train, &stored.train);
        if t.batch.global_batch != s.batch.global_batch {
            return Err(refuse(
                "--batch-size",
                s.batch.global_batch.to_string(),
                t.batch.global_batch.to_string(),
            ));
        }
        if t.seed != s.seed {
            return Err(refuse("--seed", s.seed.to_string(), t.seed.to_string()));
        }
        if !same_data(&self.task, &stored.task) {
            return Err(refuse(
                "the data",
                describe(&stored.task),
                describe(&self.task),
            ));
        }
        let mut notes = Vec::new();
        if t.optim.lr != s.optim.lr {
            notes.push(format!(
                "the learning rate changes on resuming: {:?} (the checkpoint's run had {:?})",
                t.optim.lr, s.optim.lr
            ));
        }
        Ok(notes)
    }

    /// Fails when this run cannot go on from the checkpoint `ck`: a resume asked for by hand
    /// (`by_hand`) with no steps left (it would end at once and rewrite the run's scalars and
    /// summary with nothing), token shards of another tokenizer than the checkpoint's run's,
    /// or what [`RunSpec::resumes`] refuses; else the changes it takes, each a line to say.
    pub fn resumes_checkpoint(&self, ck: &Path, by_hand: bool) -> Result<Vec<String>> {
        let r = pipewright::engine::checkpoint::Reader::open(ck)?;
        let (at, steps) = (r.manifest().step, self.train.cadence.steps);
        if by_hand && at >= steps {
            return Err(invalid!(
                "`{}` holds step {at} and --steps is {steps}: nothing is left to train (a \
                 resumed run ends at --steps, counted from the first step): give --steps above \
                 {at}",
                ck.display()
            ));
        }
        // Checkpoints from before runs recorded their spec recorded no tokenizer either.
        let Ok(stored) = RunSpec::from_meta(&r.manifest().meta) else {
            return Ok(Vec::new());
        };
        if let (
            TaskSpec::Tokens {
                tokenizer_sha256: now,
                ..
            },
            TaskSpec::Tokens {
                tokenizer_sha256: then,
                ..
            },
        ) = (&self.task, &stored.task)
        {
            if !then.is_empty() && now != then {
                return Err(invalid!(
                    "`{}` was trained on ids of another tokenizer (sha256 {}) than the shards \
                     of --data hold (sha256 {}): resume on the shards of its tokenizer",
                    ck.display(),
                    &then[..then.len().min(12)],
                    &now[..now.len().min(12)]
                ));
            }
        }
        // After the tokenizer's check, which says more about shards of another tokenizer.
        self.resumes(&stored)
    }
}

/// The data of a task, for a message.
fn describe(t: &TaskSpec) -> String {
    match t {
        TaskSpec::Tokens { dir, blend, .. } if blend.is_empty() => format!("`{}`", dir.display()),
        TaskSpec::Tokens { blend, .. } => {
            let parts: Vec<String> = blend
                .iter()
                .map(|(w, d)| format!("{w}:{}", d.display()))
                .collect();
            format!("the blend `{}`", parts.join(","))
        }
        TaskSpec::Text { path, .. } => format!("`{}`", path.display()),
        other => serde_json::to_string(other).unwrap_or_else(|_| format!("{other:?}")),
    }
}

/// Whether two tasks read the same data: equal specs, or token shards (or text) that lie
/// elsewhere now but are the same (the same shard index, the same bytes).
fn same_data(now: &TaskSpec, then: &TaskSpec) -> bool {
    if now == then {
        return true;
    }
    let same_dir = |a: &Path, b: &Path| {
        same_file(
            &a.join(pipewright::data::shards::INDEX_FILE),
            &b.join(pipewright::data::shards::INDEX_FILE),
        )
    };
    match (now, then) {
        (
            TaskSpec::Tokens {
                dir: a,
                seq_len: la,
                blend: ba,
                ..
            },
            TaskSpec::Tokens {
                dir: b,
                seq_len: lb,
                blend: bb,
                ..
            },
        ) => {
            la == lb
                && same_dir(a, b)
                && ba.len() == bb.len()
                && ba
                    .iter()
                    .zip(bb)
                    .all(|((wa, da), (wb, db))| wa == wb && same_dir(da, db))
        }
        (
            TaskSpec::Text {
                path: a,
                seq_len: la,
            },
            TaskSpec::Text {
                path: b,
                seq_len: lb,
            },
        ) => la == lb && same_file(a, b),
        _ => false,
    }
}

/// Whether `a` and `b` are one file, or files of the same bytes.
fn same_file(a: &Path, b: &Path) -> bool {
    if let (Ok(x), Ok(y)) = (a.canonicalize(), b.canonicalize()) {
        if x == y {
            return true;
        }
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) if x.len() == y.len() => {
            matches!((std::fs::read(a), std::fs::read(b)), (Ok(p), Ok(q)) if p == q)
        }
        _ => false,
    }
}
