//! An experiment as a program (pystematic's `@experiment`): a name, declared parameters and a
//! body. [`Experiment::main`] parses the command line (defaults, then `--params-file`, then
//! flags), makes the run's own directory `<output_dir>/<name>/<date>-<time>-<id>/` with
//! `parameters.json` (every value: feeding it back as `--params-file` reruns the run), and runs
//! the body once per rank: one rank; `--distributed --nproc-per-node N` ranks as threads of
//! this process, or (built with the `mpi` feature) as N processes it relaunches under `mpirun`
//! with the run's `parameters.json`; or one per process when started by `mpirun` / `pipewright
//! launch`. A program such as `pipewright train` declares its flags as a clap struct
//! ([`Experiment::args`]), names the flag of an exact run directory ([`Experiment::run_dir`])
//! and takes its rank count from its own layout ([`Experiment::world`]).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::context::Context;
use super::lock::RunLock;
use super::params::{self, ArgsGroup, Param, Params};
use crate::distributed::comm::local;
use crate::{invalid, Error, Result};

/// An experiment: a name, its parameters and its body.
pub struct Experiment<F> {
    name: String,
    about: String,
    params: Vec<Param>,
    group: Option<ArgsGroup>,
    aliases: Vec<(String, String)>,
    run_dir: Option<String>,
    world: Option<fn(&Params) -> Result<usize>>,
    subcommand: Vec<String>,
    body: F,
}

impl<F> Experiment<F>
where
    F: Fn(&mut Context) -> Result<()> + Sync,
{
    /// The experiment `name` running `body` for every rank, with pystematic's standard
    /// parameters ([`params::standard`]).
    pub fn new(name: &str, body: F) -> Self {
        Self {
            name: name.to_string(),
            about: String::new(),
            params: Vec::new(),
            group: None,
            aliases: Vec::new(),
            run_dir: None,
            world: None,
            subcommand: Vec::new(),
            body,
        }
    }

    /// What `--help` says the experiment does.
    pub fn about(mut self, text: &str) -> Self {
        self.about = text.to_string();
        self
    }

    /// Declares a parameter.
    pub fn param(mut self, p: Param) -> Self {
        self.params.push(p);
        self
    }

    /// Declares the flags of the clap struct `A` as parameters too (a program with many typed
    /// flags); the body reads them with [`Params::args`].
    pub fn args<A: clap::Args + serde::Serialize>(mut self) -> Self {
        self.group = Some(ArgsGroup::of::<A>());
        self
    }

    /// Gives the parameter `name` (a standard one too) another flag, `--alias`.
    pub fn alias(mut self, name: &str, alias: &str) -> Self {
        self.aliases.push((name.to_string(), alias.to_string()));
        self
    }

    /// The string parameter `name`, when set, is the run's directory itself instead of
    /// `<output_dir>/<name>/<date>-<time>-<id>/`: created, or reopened when the run goes on
    /// from a checkpoint or is a launcher's restarted attempt.
    pub fn run_dir(mut self, name: &str) -> Self {
        self.run_dir = Some(name.to_string());
        self
    }

    /// The number of ranks a run of these parameters has (a pipeline x tensor x data layout),
    /// instead of `nproc_per_node` x `nnodes` when distributed and 1 otherwise.
    pub fn world(mut self, ranks: fn(&Params) -> Result<usize>) -> Self {
        self.world = Some(ranks);
        self
    }

    /// The words before the experiment's flags on its program's command line (`train` in
    /// `pipewright train`), which relaunched ranks are given too.
    pub fn subcommand(mut self, words: &[&str]) -> Self {
        self.subcommand = words.iter().map(|w| w.to_string()).collect();
        self
    }

    /// Every parameter: the standard ones, then the declared ones.
    pub fn all_params(&self) -> Result<Vec<Param>> {
        let mut all = params::standard();
        let fields = self.group.map(|g| g.flags()).unwrap_or_default();
        for p in &self.params {
            if all.iter().any(|q| q.name == p.name) {
                return Err(invalid!(
                    "parameter `{}` is declared twice (or is a standard one)",
                    p.name
                ));
            }
            all.push(p.clone());
        }
        if let Some(f) = fields.iter().find(|f| all.iter().any(|p| &p.name == *f)) {
            return Err(invalid!(
                "the arguments' field `{f}` is also a parameter: rename one"
            ));
        }
        for (name, alias) in &self.aliases {
            let p = all
                .iter_mut()
                .find(|p| &p.name == name)
                .ok_or_else(|| invalid!("alias --{alias} names no parameter `{name}`"))?;
            p.aliases.push(alias.clone());
        }
        Ok(all)
    }

    /// The parameters of the command line `args` (the first item the program).
    pub fn parse<I, T>(&self, args: I) -> Result<Params>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        params::parse(
            &self.name,
            &self.about,
            &self.all_params()?,
            self.group,
            args,
        )
    }

    /// Parses this process's command line and runs; prints the error (or the help) and exits
    /// with status 1 (0 for `--help`) when it fails.
    pub fn main(&self) {
        let result = self
            .parse(std::env::args_os())
            .and_then(|p| self.run(&p).map(|_| ()));
        match result {
            Ok(()) => {}
            Err(Error::Help(text)) => print!("{text}"),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
    }

    /// Runs the body with `params` in a new run directory, which it returns.
    pub fn run(&self, params: &Params) -> Result<PathBuf> {
        let dir = self.run_ranks(params)?;
        if params.flag("debug")? {
            eprintln!("[{}] done: {}", self.name, dir.display());
        }
        Ok(dir)
    }

    /// The body on every rank; the run directory.
    fn run_ranks(&self, params: &Params) -> Result<PathBuf> {
        let debug = params.flag("debug")?;
        if debug {
            eprintln!("[{}] parameters: {}", self.name, params.to_json());
        }
        let body = |cx: &mut Context| -> Result<()> {
            if debug {
                let n = cx.get_num_processes();
                cx.log(&format!(
                    "[{}] rank {} of {n} starts",
                    self.name,
                    cx.get_rank()
                ))?;
            }
            let result = (self.body)(cx);
            if debug {
                let how = result
                    .as_ref()
                    .err()
                    .map_or("ends".to_string(), |e| format!("fails: {e}"));
                cx.log(&format!("[{}] rank {} {how}", self.name, cx.get_rank()))?;
            }
            result
        };
        let env = crate::distributed::Env::from_env();
        if env.world_size > 1 || crate::distributed::Env::under_mpi() {
            // One rank of a launched job: its world is the job's; its directory the one the
            // relaunching process made, or rank 0's.
            crate::distributed::comm::size_thread_pools(env.local_world_size);
            let world = crate::distributed::init()?;
            // Rank 0 holds the directory's lock (the relaunching process holds it for its
            // ranks).
            let (dir, _lock) = match std::env::var_os(RUN_DIR) {
                Some(d) => (PathBuf::from(d), None),
                None => self.agree_dir(params, world.comm.as_ref())?,
            };
            let (comm, _guard) = world.into_parts();
            let mut cx = Context::new(params.clone(), &dir, comm)?;
            let result = body(&mut cx);
            #[cfg(feature = "mpi")]
            if let (Err(e), true) = (&result, env.world_size > 1) {
                // The others would wait for this rank forever: end the job.
                eprintln!("error: rank {}: {e}", env.rank);
                crate::distributed::comm::mpi::Mpi::abort(1);
            }
            result?;
            return Ok(dir);
        }
        let distributed = params.flag("distributed")?;
        let ranks = match self.world {
            Some(world) => world(params)?,
            None if distributed => {
                let n = params.int("nproc_per_node")? * params.int("nnodes")?;
                usize::try_from(n)
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| invalid!("nproc_per_node x nnodes must be positive"))?
            }
            None => 1,
        };
        let (dir, _lock, fresh) = self.make_dir(params)?;
        let result = if ranks > 1 && distributed && cfg!(feature = "mpi") {
            relaunch(ranks, params, &dir, &self.subcommand).map(|_| ())
        } else {
            local::run(ranks, |comm| {
                let mut cx = Context::new(params.clone(), &dir, Box::new(comm))?;
                body(&mut cx)
            })
            .map(|_| ())
        };
        if result.is_err() && fresh {
            discard_if_untrained(&dir);
        }
        result.map(|()| dir)
    }

    /// The run directory, made (and locked) by rank 0 and its name given to every rank.
    fn agree_dir(
        &self,
        params: &Params,
        comm: &dyn crate::distributed::comm::Communicator,
    ) -> Result<(PathBuf, Option<RunLock>)> {
        // Rank 0's failure is every rank's: the others would wait for the name forever.
        const FAILED: u32 = u32::MAX;
        let (mine, lock, failed) = if comm.rank() == 0 {
            match self.make_dir(params) {
                Ok((dir, lock, _)) => (dir.to_string_lossy().into_owned(), Some(lock), None),
                Err(e) => (String::new(), None, Some(e)),
            }
        } else {
            (String::new(), None, None)
        };
        let bytes = mine.into_bytes();
        let said = if failed.is_some() {
            FAILED
        } else {
            bytes.len() as u32
        };
        let len = candle_core::Tensor::new(&[said], &candle_core::Device::Cpu)?;
        let len = comm.broadcast(&len, 0)?.to_vec1::<u32>()?[0];
        if let Some(e) = failed {
            return Err(e);
        }
        if len == FAILED {
            return Err(invalid!(
                "rank 0 could not make the run directory (its error is in its output)"
            ));
        }
        let len = len as usize;
        let mut buf = bytes;
        buf.resize(len, 0);
        let t = candle_core::Tensor::from_vec(buf, len, &candle_core::Device::Cpu)?;
        let got = comm.broadcast(&t, 0)?.to_vec1::<u8>()?;
        Ok((
            PathBuf::from(String::from_utf8_lossy(&got).into_owned()),
            lock,
        ))
    }

    /// Creates `<output_dir>/<name>/<date>-<time>-<id>/` (or the [`Experiment::run_dir`]
    /// parameter's directory: reopened when the run goes on) with `parameters.json`, and takes
    /// its lock for this process before anything is written into it.
    /// Also returns whether the directory is this run's own: it did not exist or was empty.
    fn make_dir(&self, params: &Params) -> Result<(PathBuf, RunLock, bool)> {
        let exact = match &self.run_dir {
            Some(name) => params.string(name)?,
            None => None,
        };
        let dir = match exact {
            Some(d) => PathBuf::from(d),
            None => self.stamped_dir(params)?,
        };
        let goes_on = params.goes_on()?;
        if let Some((inside, what)) = crate::runtime::files::inside_other(&dir, false) {
            return Err(invalid!(
                "the run directory `{}` is inside `{}`, {what}: give the run a directory of its \
                 own",
                dir.display(),
                inside.display()
            ));
        }
        let fresh = std::fs::read_dir(&dir).map_or(true, |mut d| d.next().is_none());
        if let Some(name) = &self.run_dir {
            super::owner::check_run_dir(&dir, &format!("--{}", name.replace('_', "-")))?;
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io("cannot create run directory", &dir, e))?;
        let lock = RunLock::acquire(&dir)?;
        let run = if goes_on && super::RunDir::holds_run(&dir) {
            super::RunDir::open(&dir)?
        } else {
            super::RunDir::create(&dir)?
        };
        super::owner::claim_run_dir(&dir)?;
        run.write_json("parameters.json", &params.to_json())?;
        Ok((dir, lock, fresh))
    }
}

/// After a failed run, removes `dir` (which the run made) when it holds only what making it
/// wrote (`parameters.json`): kept, it made the same `--out` refused ("already holds a run")
/// once the fault was fixed. A directory with anything more (a rank's log, a row, a
/// checkpoint) is kept for the user to read.
fn discard_if_untrained(dir: &Path) {
    let only_parameters = std::fs::read_dir(dir).is_ok_and(|d| {
        d.flatten().all(|e| {
            matches!(
                e.file_name().to_str(),
                Some("parameters.json" | super::lock::LOCK_FILE | super::owner::OWNER_FILE)
            )
        })
    });
    if only_parameters {
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl<F> Experiment<F> {
    /// `<output_dir>/<name>/<date>-<time>-<id>/`: a new directory for every run.
    fn stamped_dir(&self, params: &Params) -> Result<PathBuf> {
        let root = params
            .string("output_dir")?
            .ok_or_else(|| invalid!("output_dir must be set"))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| invalid!("the clock is before 1970: {e}"))?;
        let id = format!(
            "{:06x}",
            (now.subsec_nanos() ^ std::process::id()) & 0xff_ffff
        );
        let stamp = timestamp(now.as_secs());
        Ok(Path::new(&root)
            .join(&self.name)
            .join(format!("{stamp}-{id}")))
    }
}

/// Where a relaunched rank finds the run directory its parent made.
const RUN_DIR: &str = "PIPEWRIGHT_RUN_DIR";

/// Runs this program again as `ranks` processes under mpirun (a build with MPI), each reading
/// the run's `parameters.json`; waits for them.
fn relaunch(ranks: usize, params: &Params, dir: &Path, subcommand: &[String]) -> Result<PathBuf> {
    if params.int("nnodes")? > 1 {
        return Err(invalid!(
            "a multi-node experiment starts through `pipewright launch --hostfile FILE -- PROGRAM`"
        ));
    }
    let exe = std::env::current_exe().map_err(|e| invalid!("cannot find this program: {e}"))?;
    let status = crate::distributed::mpirun(ranks)
        .env(RUN_DIR, dir)
        .args(["-x", RUN_DIR])
        .arg(exe)
        .args(subcommand)
        .arg("--params-file")
        .arg(dir.join("parameters.json"))
        .status()
        .map_err(|e| {
            Error::io(
                "cannot start",
                "mpirun (tools/install-mpi.sh installs Open MPI)",
                e,
            )
        })?;
    if !status.success() {
        return Err(invalid!("the {ranks} ranks under mpirun failed: {status}"));
    }
    Ok(dir.to_path_buf())
}

/// `YYYY-MM-DD-HH-MM-SS` (UTC) of `secs` since 1970 (Hinnant's civil-from-days).
fn timestamp(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}-{:02}-{:02}-{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_are_civil_dates() {
        assert_eq!(super::timestamp(0), "1970-01-01-00-00-00");
        // 2000-02-29 12:34:56 UTC, a leap day.
        assert_eq!(super::timestamp(951_827_696), "2000-02-29-12-34-56");
        assert_eq!(super::timestamp(1_795_435_200), "2026-11-23-12-00-00");
    }
}
