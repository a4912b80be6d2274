//! Parameter sweeps (pystematic's `run_parameter_sweep`): a program run once for every
//! combination of parameter values (the cartesian product), each run in its own directory, at
//! most `max_parallel` at once; a failed run is recorded and the others go on. The summary
//! (each run's parameters, final loss and metric from its `summary.json` when it writes one,
//! seconds and status) is written as `sweep.csv` beside the runs, and their report page
//! (`report.html`, every run overlaid) too. Ctrl-C or SIGTERM asks the running runs to save
//! and stop (SIGTERM to each), starts no other, and the table says which were interrupted and
//! which never started. A grid whose runs would not each be their own is refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::{invalid, Error, Result};

/// One run of a sweep and how it went.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepRun {
    /// `name=value,...`: also its directory's name.
    pub name: String,
    /// Its parameters, in the sweep's order.
    pub params: Vec<(String, String)>,
    /// Its run directory.
    pub dir: PathBuf,
    /// `summary.json`'s `final_loss` and `metric`, when the run wrote them.
    pub final_loss: Option<f64>,
    /// The metric the run reported (`None` if it reported none).
    pub metric: Option<f64>,
    /// Seconds from its start to its end, and when it started (seconds after the sweep began).
    pub seconds: f64,
    /// When it started, in seconds since the Unix epoch.
    pub started: f64,
    /// `None` when it succeeded; else what went wrong (exit status, or why it did not start).
    pub failure: Option<String>,
}

/// What to sweep.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// Each parameter (its flag name without dashes) and its values.
    pub grid: Vec<(String, Vec<String>)>,
    /// The program and its fixed arguments.
    pub command: Vec<String>,
    /// Where the runs go (`<out>/<run name>`) and `sweep.csv`.
    pub out: PathBuf,
    /// The flag that takes a run's directory (`--out`).
    pub out_flag: String,
    /// Runs at once.
    pub max_parallel: usize,
}

/// Every combination of `grid`'s values, the first parameter varying slowest.
pub fn combinations(grid: &[(String, Vec<String>)]) -> Vec<Vec<(String, String)>> {
    grid.iter().fold(vec![Vec::new()], |acc, (name, values)| {
        acc.into_iter()
            .flat_map(|c| {
                values.iter().map(move |v| {
                    let mut c = c.clone();
                    c.push((name.clone(), v.clone()));
                    c
                })
            })
            .collect()
    })
}

/// Runs the sweep; every run's outcome, in the grid's order (failed runs included: the caller
/// decides what a failure means; `sweep.csv` is written either way).
pub fn run_parameter_sweep(s: &Sweep) -> Result<Vec<SweepRun>> {
    if s.grid.is_empty() || s.grid.iter().any(|(_, v)| v.is_empty()) {
        return Err(invalid!(
            "a sweep needs at least one parameter, each with values"
        ));
    }
    if s.command.is_empty() || s.max_parallel == 0 {
        return Err(invalid!(
            "a sweep needs a program to run and max_parallel of at least 1"
        ));
    }
    check_grid(&s.grid)?;
    // A second sweep into the same directory would overwrite the first's table and runs.
    crate::runtime::files::ensure_new(&s.out, "the sweep directory")?;
    std::fs::create_dir_all(&s.out).map_err(|e| Error::io("cannot create", &s.out, e))?;
    let todo: Vec<(usize, Vec<(String, String)>)> =
        combinations(&s.grid).into_iter().enumerate().collect();
    // No more workers than runs: a million asked for would spawn a million threads.
    let workers = s.max_parallel.min(todo.len());
    let queue = Mutex::new(todo.into_iter());
    let done = Mutex::new(Vec::new());
    let t0 = Instant::now();
    // Ctrl-C or SIGTERM: the running runs are asked to save and stop, no new one starts, and
    // the table still says what each did.
    let stop = crate::distributed::preemption_flag()?;
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                let Some((i, params)) = next else { break };
                let run = run_one(s, params, t0, &stop);
                done.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((i, run));
            });
        }
    });
    let mut runs = done.into_inner().unwrap_or_else(|e| e.into_inner());
    for (i, params) in queue.into_inner().unwrap_or_else(|e| e.into_inner()) {
        runs.push((i, not_started(s, params)));
    }
    runs.sort_by_key(|(i, _)| *i);
    let runs: Vec<SweepRun> = runs.into_iter().map(|(_, r)| r).collect();
    write_csv(&s.out.join("sweep.csv"), &s.grid, &runs)?;
    // One page for the whole sweep, its runs overlaid (a run that made no directory has
    // nothing to draw; sweep.csv names its failure).
    let dirs: Vec<&Path> = runs
        .iter()
        .map(|r| r.dir.as_path())
        .filter(|d| d.is_dir())
        .collect();
    if !dirs.is_empty() {
        super::report::write_report(&dirs, &s.out.join("report.html"))?;
    }
    Ok(runs)
}

/// Fails unless every run of `grid` is its own: a parameter named twice (`steps=1,2` and
/// `steps=3`: every run would train with the last flag's value while the table listed the
/// first's), a value given twice, or two values whose run directories' names are the same
/// (one run's log and directory would be the other's).
fn check_grid(grid: &[(String, Vec<String>)]) -> Result<()> {
    let mut names = std::collections::BTreeSet::new();
    for (name, values) in grid {
        if !names.insert(name.as_str()) {
            return Err(invalid!(
                "the sweep names the parameter `{name}` twice: give all its values once \
                 (`{name}=A,B,C`)"
            ));
        }
        let mut seen = std::collections::BTreeMap::new();
        for v in values {
            let dir = run_name(&[(name.clone(), v.clone())]);
            if let Some(first) = seen.insert(dir.clone(), v) {
                let why = if first == v {
                    format!("gives `{name}` the value `{v}` twice")
                } else {
                    format!("gives `{name}` the values `{first}` and `{v}`, whose runs would share the directory `{dir}`")
                };
                return Err(invalid!("the sweep {why}: give each value once"));
            }
        }
    }
    Ok(())
}

/// The name of a run's directory and log: `k=v,k=v`, with every character a path would read
/// otherwise (`/`, a space, ...) as `_`: a value that is a path (`data=texts/a.md`) named a
/// file in a directory that does not exist, and every run failed on its log.
fn run_name(params: &[(String, String)]) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
        .chars()
        .map(|c| match c {
            c if c.is_alphanumeric() || "-_.=,+".contains(c) => c,
            _ => '_',
        })
        .collect()
}

/// A run the sweep did not start: it was interrupted before.
fn not_started(s: &Sweep, params: Vec<(String, String)>) -> SweepRun {
    let name = run_name(&params);
    SweepRun {
        dir: s.out.join(&name),
        name,
        params,
        final_loss: None,
        metric: None,
        seconds: 0.0,
        started: 0.0,
        failure: Some("not started: the sweep was interrupted".into()),
    }
}

/// Waits for `child`; once `stop` is set, asks it to save and stop (SIGTERM, which a run takes
/// as a preemption notice: a second SIGINT after the terminal's would end it unsaved). Its
/// exit status, and whether it was asked.
fn wait_or_stop(
    mut child: std::process::Child,
    stop: &AtomicBool,
) -> std::io::Result<(std::process::ExitStatus, bool)> {
    let mut asked = false;
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok((st, asked));
        }
        if stop.load(Ordering::Relaxed) && !asked {
            // SAFETY: signalling a child this process started and has not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            asked = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn run_one(s: &Sweep, params: Vec<(String, String)>, t0: Instant, stop: &AtomicBool) -> SweepRun {
    let name = run_name(&params);
    let dir = s.out.join(&name);
    let started = t0.elapsed().as_secs_f64();
    let t = Instant::now();
    let log = s.out.join(format!("{name}.log"));
    let mut cmd = Command::new(&s.command[0]);
    cmd.args(&s.command[1..]);
    for (k, v) in &params {
        cmd.arg(format!("--{k}")).arg(v);
    }
    cmd.arg(&s.out_flag).arg(&dir).stdin(Stdio::null());
    let failure = match std::fs::File::create(&log).and_then(|f| Ok((f.try_clone()?, f))) {
        Err(e) => Some(format!("cannot write {}: {e}", log.display())),
        Ok((out, err)) => match cmd.stdout(out).stderr(err).spawn() {
            Err(e) => Some(format!("did not start: {e}")),
            Ok(child) => match wait_or_stop(child, stop) {
                Err(e) => Some(format!("cannot wait for it: {e}")),
                // A run that saved and stopped early did not run its course.
                Ok((st, true)) => Some(format!(
                    "interrupted ({st}): stopped before its end; see {}",
                    log.display()
                )),
                Ok((st, false)) if st.success() => None,
                Ok((st, false)) => Some(format!("{st}; see {}", log.display())),
            },
        },
    };
    let summary: Option<serde_json::Value> = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let num = |k: &str| summary.as_ref().and_then(|s| s[k].as_f64());
    SweepRun {
        name,
        params,
        final_loss: num("final_loss"),
        metric: num("metric"),
        dir,
        seconds: t.elapsed().as_secs_f64(),
        started,
        failure,
    }
}

fn write_csv(path: &Path, grid: &[(String, Vec<String>)], runs: &[SweepRun]) -> Result<()> {
    let mut csv: Vec<String> = grid.iter().map(|(k, _)| k.clone()).collect();
    csv.extend(["final_loss", "metric", "seconds", "started", "status"].map(String::from));
    let mut text = csv.join(",") + "\n";
    let opt = |v: Option<f64>| v.map(|x| x.to_string()).unwrap_or_default();
    for r in runs {
        let mut row: Vec<String> = r.params.iter().map(|(_, v)| v.clone()).collect();
        row.push(opt(r.final_loss));
        row.push(opt(r.metric));
        row.push(format!("{:.6}", r.seconds));
        row.push(format!("{:.6}", r.started));
        row.push(match &r.failure {
            None => "ok".into(),
            Some(f) => format!("failed: {}", f.replace([',', '\n'], " ")),
        });
        text.push_str(&(row.join(",") + "\n"));
    }
    std::fs::write(path, text).map_err(|e| Error::io("cannot write", path, e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_grid_whose_runs_are_not_each_their_own_is_refused() {
        let g = |v: &[(&str, &[&str])]| -> Vec<(String, Vec<String>)> {
            v.iter()
                .map(|(n, vs)| (n.to_string(), vs.iter().map(|s| s.to_string()).collect()))
                .collect()
        };
        let err = |v: &[(&str, &[&str])]| super::check_grid(&g(v)).unwrap_err().to_string();
        assert!(err(&[("lr", &["1e-3", "1e-3"])]).contains("value `1e-3` twice"));
        let e = err(&[("steps", &["1", "2"]), ("steps", &["3"])]);
        assert!(e.contains("`steps` twice"), "{e}");
        let e = err(&[("data", &["a/b", "a b"])]);
        assert!(e.contains("share the directory `data=a_b`"), "{e}");
        super::check_grid(&g(&[("lr", &["1e-3", "3e-3"]), ("steps", &["1"])])).unwrap();
    }

    #[test]
    fn a_value_that_is_a_path_names_a_file_of_the_sweep() {
        let params = [("data".to_string(), "texts/a b.md".to_string())];
        assert_eq!(super::run_name(&params), "data=texts_a_b.md");
    }
}
