//! An experiment's parameters (pystematic's `parameter`): each declared with a name, a type,
//! a default and a help line; values come from the defaults, then a parameters file
//! (`--params-file`, JSON or TOML), then the command line, each overriding the one before.
//! [`Params::to_json`] is what `parameters.json` holds: every value, defaults included, so that
//! feeding it back as `--params-file` reruns the experiment exactly. A program with many typed
//! flags declares them as a clap `Args` struct instead ([`ArgsGroup`]); a file's values pass
//! through the same command-line parser as the flags, so one set of checks holds for both.

use std::collections::BTreeMap;
use std::path::Path;

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::Value;

use crate::{invalid, Error, Result};

/// What a parameter holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    /// A whole number.
    Int,
    /// A floating-point number.
    Float,
    /// A flag: true or false.
    Bool,
    /// A string.
    Str,
}

/// A declared parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// `snake_case`; on the command line `--kebab-case`.
    pub name: String,
    /// What values it takes.
    pub kind: ParamType,
    /// The default (`Null`: none, for an optional string).
    pub default: Value,
    /// The line `--help` prints for it.
    pub help: String,
    /// Other names of its flag (`--seed` for `--random-seed` in `pipewright train`).
    pub aliases: Vec<String>,
    /// The least value an integer parameter takes (a seed or a count is not negative).
    pub min: Option<i64>,
}

impl Param {
    fn new(name: &str, kind: ParamType, default: Value, help: &str) -> Self {
        Self {
            name: name.to_string(),
            kind,
            default,
            help: help.to_string(),
            aliases: Vec::new(),
            min: None,
        }
    }

    /// This integer parameter with a least value, checked where it is given.
    pub fn at_least(mut self, min: i64) -> Self {
        self.min = Some(min);
        self
    }

    /// An integer parameter.
    pub fn int(name: &str, default: i64, help: &str) -> Self {
        Self::new(name, ParamType::Int, default.into(), help)
    }

    /// A floating-point parameter.
    pub fn float(name: &str, default: f64, help: &str) -> Self {
        Self::new(name, ParamType::Float, default.into(), help)
    }

    /// A flag (`--name` alone sets it; `--name false` clears it).
    pub fn flag(name: &str, default: bool, help: &str) -> Self {
        Self::new(name, ParamType::Bool, default.into(), help)
    }

    /// A string parameter.
    pub fn string(name: &str, default: &str, help: &str) -> Self {
        Self::new(name, ParamType::Str, default.into(), help)
    }

    /// A string parameter without a default.
    pub fn optional(name: &str, help: &str) -> Self {
        Self::new(name, ParamType::Str, Value::Null, help)
    }

    fn flag_name(&self) -> String {
        self.name.replace('_', "-")
    }

    /// `text` as this parameter's value.
    fn parse(&self, text: &str) -> Result<Value> {
        let bad = || {
            invalid!(
                "parameter {} takes {:?} values, not `{text}`",
                self.name,
                self.kind
            )
        };
        Ok(match self.kind {
            ParamType::Int => {
                let v = text.trim().parse::<i64>().map_err(|_| bad())?;
                if let Some(min) = self.min.filter(|m| v < *m) {
                    let also: String = self.aliases.iter().map(|a| format!(", --{a}")).collect();
                    return Err(invalid!(
                        "--{}{also} must be at least {min}, got {v}",
                        self.flag_name()
                    ));
                }
                v.into()
            }
            ParamType::Float => {
                let v = text.trim().parse::<f64>().map_err(|_| bad())?;
                if !v.is_finite() {
                    return Err(invalid!(
                        "--{} takes a finite number, got `{text}`",
                        self.flag_name()
                    ));
                }
                v.into()
            }
            ParamType::Bool => match text.trim() {
                "true" | "1" | "yes" => true.into(),
                "false" | "0" | "no" => false.into(),
                _ => return Err(bad()),
            },
            ParamType::Str => text.into(),
        })
    }
}

/// pystematic's default parameters, which every experiment has.
pub fn standard() -> Vec<Param> {
    vec![
        Param::string("output_dir", "./output", "Where runs go: <output_dir>/<experiment>/<date>-<time>-<id>/."),
        Param::int("random_seed", 0, "The seed of every random stream of the run.").at_least(0),
        Param::flag("debug", false, "Verbose logs (the parameters, each rank's start and end); a body passes it on as VarunaOptions::detect_anomaly to name the first NaN or inf."),
        Param::optional("checkpoint", "A checkpoint of the context to restore before the experiment goes on."),
        Param::flag("cuda", false, "Compute on the GPU (needs a build with CUDA)."),
        Param::flag("distributed", false, "Run nproc_per_node x nnodes ranks (or as many as the program's layout has) as processes under mpirun in a build with MPI, else as threads."),
        Param::int("nproc_per_node", 1, "Ranks per node when distributed."),
        Param::int("nnodes", 1, "Nodes of a distributed run."),
        Param::int("node_rank", 0, "This node's index in a multi-node run."),
        Param::string("master_addr", "127.0.0.1", "Address of the node with rank 0."),
        Param::int("master_port", 29500, "Port of the rendezvous on the master node."),
    ]
}

/// The values of an experiment's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Params(BTreeMap<String, Value>);

impl Params {
    /// The defaults of `params`.
    pub fn defaults(params: &[Param]) -> Self {
        Self(
            params
                .iter()
                .map(|p| (p.name.clone(), p.default.clone()))
                .collect(),
        )
    }

    fn value(&self, name: &str) -> Result<&Value> {
        self.0
            .get(name)
            .ok_or_else(|| invalid!("the experiment declares no parameter `{name}`"))
    }

    /// An integer parameter's value.
    pub fn int(&self, name: &str) -> Result<i64> {
        self.value(name)?
            .as_i64()
            .ok_or_else(|| invalid!("parameter {name} is not an integer"))
    }

    /// An integer parameter that must be a positive count (sizes, steps, ranks).
    pub fn positive(&self, name: &str) -> Result<usize> {
        usize::try_from(self.int(name)?)
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| invalid!("--{} must be positive", name.replace('_', "-")))
    }

    /// A floating-point parameter's value.
    pub fn float(&self, name: &str) -> Result<f64> {
        self.value(name)?
            .as_f64()
            .ok_or_else(|| invalid!("parameter {name} is not a number"))
    }

    /// A flag's value.
    pub fn flag(&self, name: &str) -> Result<bool> {
        self.value(name)?
            .as_bool()
            .ok_or_else(|| invalid!("parameter {name} is not a flag"))
    }

    /// A string parameter's value (`None` when an optional one is not set).
    pub fn string(&self, name: &str) -> Result<Option<String>> {
        Ok(self.value(name)?.as_str().map(str::to_string))
    }

    /// Whether the run these parameters start goes on from a checkpoint: `checkpoint` given
    /// (a resume), or a launcher's restarted attempt. Such a run reopens its run directory and
    /// its checkpoint directory instead of making them.
    pub fn goes_on(&self) -> Result<bool> {
        Ok(self.string("checkpoint")?.is_some() || crate::distributed::Env::from_env().restart > 0)
    }

    /// Changes a declared parameter's value (a resumed run taking what its run directory
    /// recorded for a flag the command line left at its default).
    pub fn set(&mut self, name: &str, value: Value) -> Result<()> {
        self.value(name)?;
        self.0.insert(name.to_string(), value);
        Ok(())
    }

    /// Every value, defaults included (`parameters.json`).
    pub fn to_json(&self) -> Value {
        Value::Object(self.0.clone().into_iter().collect())
    }

    /// The values of an [`ArgsGroup`]'s struct `A`.
    pub fn args<A: serde::de::DeserializeOwned>(&self) -> Result<A> {
        serde_json::from_value(self.to_json())
            .map_err(|e| invalid!("the parameters do not make the program's arguments: {e}"))
    }
}

/// Parameters declared as a clap [`clap::Args`] struct: its flags join the experiment's
/// command line with their own value checks, and its fields (serialised) join the values, where
/// [`Params::args`] reads them back as the struct.
#[derive(Clone, Copy)]
pub struct ArgsGroup {
    augment: fn(Command) -> Command,
    values: fn(&ArgMatches) -> Result<Value>,
}

impl ArgsGroup {
    /// The names of its fields that are flags.
    pub fn flags(&self) -> Vec<String> {
        (self.augment)(Command::new("args"))
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect()
    }

    /// The group of the flags of `A`.
    pub fn of<A: clap::Args + serde::Serialize>() -> Self {
        Self {
            augment: A::augment_args,
            values: |m| {
                let a = A::from_arg_matches(m).map_err(|e| invalid!("{e}"))?;
                serde_json::to_value(&a).map_err(|e| invalid!("{e}"))
            },
        }
    }
}

/// The command line of an experiment named `name` with `params` (and `group`'s flags):
/// `--help` lists each with its default under "Parameters"; `--params-file FILE` too. A flag
/// given on the command line takes the place of a file's value; given twice on the command
/// line, its last value is taken, and that is said ([`parse`]).
pub fn command(name: &str, about: &str, params: &[Param], group: Option<ArgsGroup>) -> Command {
    // The experiment's parameters under one heading; a group's flags bring their own.
    let mut cmd = Command::new(name.to_string())
        .next_help_heading("Parameters")
        .args_override_self(true)
        .allow_negative_numbers(true)
        .arg(
            Arg::new("params_file")
                .long("params-file")
                .value_name("FILE")
                .help("Parameters from a JSON or TOML file (the command line wins over it)."),
        );
    for p in params {
        let default = match &p.default {
            Value::Null => "none".to_string(),
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let mut arg = Arg::new(p.name.clone())
            .long(p.flag_name())
            .visible_aliases(p.aliases.clone())
            .value_name(p.flag_name().to_uppercase())
            .help(format!("{} [default: {default}]", p.help));
        if p.kind == ParamType::Bool {
            arg = arg
                .num_args(0..=1)
                .default_missing_value("true")
                .value_name("BOOL");
        }
        cmd = cmd.arg(arg.action(ArgAction::Set));
    }
    if let Some(g) = group {
        cmd = (g.augment)(cmd);
    }
    // After the group's, which brings its struct's doc comment.
    cmd.about(about.to_string())
}

/// The values of `params` (and `group`) for the command line `args` (its first item the
/// program): the defaults, then `--params-file`, then the flags given.
pub fn parse<I, T>(
    name: &str,
    about: &str,
    params: &[Param],
    group: Option<ArgsGroup>,
    args: I,
) -> Result<Params>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let cmd = command(name, about, params, group);
    let mut matches = get_matches(&cmd, &args)?;
    say_repeated(&cmd, &args);
    if let Some(file) = matches.get_one::<String>("params_file").cloned() {
        let program = &args[..args.len().min(1)];
        let defaults = values(&cmd, params, group, &get_matches(&cmd, program)?)?;
        let mut with_file = program.to_vec();
        with_file.extend(file_flags(&cmd, &defaults, Path::new(&file))?);
        with_file.extend(args.iter().skip(1).cloned());
        matches = get_matches(&cmd, &with_file)
            .map_err(|e| invalid!("with the values of {file}: {e}"))?;
    }
    values(&cmd, params, group, &matches)
}

/// Says on stderr which single-valued flags `args` gives more than once: the last value is
/// taken (as a script that appends a flag to a command expects), and the others were dropped.
fn say_repeated(cmd: &Command, args: &[std::ffi::OsString]) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for a in args.iter().skip(1).filter_map(|a| a.to_str()) {
        let Some(long) = a.strip_prefix("--") else {
            continue;
        };
        let long = long.split('=').next().unwrap_or(long);
        let single = cmd.get_arguments().find(|arg| {
            arg.get_long() == Some(long)
                || arg.get_all_aliases().is_some_and(|al| al.contains(&long))
        });
        if let Some(arg) =
            single.filter(|arg| matches!(arg.get_action(), ArgAction::Set | ArgAction::SetTrue))
        {
            *seen
                .entry(format!("--{}", arg.get_long().unwrap_or(long)))
                .or_default() += 1;
        }
    }
    for (flag, n) in seen.into_iter().filter(|(_, n)| *n > 1) {
        eprintln!("note: {flag} is given {n} times: its last value is taken");
    }
}

/// `cmd`'s matches of `args`; `--help` as [`Error::Help`].
fn get_matches(cmd: &Command, args: &[std::ffi::OsString]) -> Result<ArgMatches> {
    cmd.clone()
        .try_get_matches_from(args)
        .map_err(|e| match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                Error::Help(e.render().to_string())
            }
            _ => invalid!("{}", e.to_string().trim_start_matches("error: ").trim_end()),
        })
}

/// The values `matches` of `cmd` give `params` and `group`'s fields.
fn values(
    cmd: &Command,
    params: &[Param],
    group: Option<ArgsGroup>,
    matches: &ArgMatches,
) -> Result<Params> {
    let mut values = Params::defaults(params);
    for p in params {
        if let Some(text) = matches.get_one::<String>(&p.name) {
            values.0.insert(p.name.clone(), p.parse(text)?);
        }
    }
    if let Some(g) = group {
        let Value::Object(fields) = (g.values)(matches)? else {
            return Err(invalid!(
                "an ArgsGroup's struct serialises to an object of fields"
            ));
        };
        // Fields without a flag (`#[arg(skip)]`) are the program's own business.
        let flags: Vec<&str> = cmd.get_arguments().map(|a| a.get_id().as_str()).collect();
        values.0.extend(
            fields
                .into_iter()
                .filter(|(k, _)| flags.contains(&k.as_str())),
        );
    }
    Ok(values)
}

/// The flags that give the values of a parameters file (JSON, or TOML by its `.toml`
/// extension) which differ from `defaults`, each checked against `cmd`'s parameters.
fn file_flags(cmd: &Command, defaults: &Params, path: &Path) -> Result<Vec<std::ffi::OsString>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
    let what = path.display().to_string();
    let table: serde_json::Map<String, Value> = if path.extension().is_some_and(|e| e == "toml") {
        let t: toml::Table =
            toml::from_str(&text).map_err(|e| invalid!("{what} is not TOML: {e}"))?;
        serde_json::to_value(t)
            .map_err(|e| invalid!("{what}: {e}"))?
            .as_object()
            .cloned()
            .unwrap_or_default()
    } else {
        serde_json::from_str(&text)
            .map_err(|e| invalid!("{what} is not a JSON object of parameters: {e}"))?
    };
    let mut flags = Vec::new();
    for (k, v) in table {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == k.as_str() && k != "params_file")
            .ok_or_else(|| invalid!("{what}: the experiment has no parameter `{k}`"))?;
        if v.is_null() || defaults.0.get(&k) == Some(&v) {
            continue;
        }
        let long = arg.get_long().unwrap_or(k.as_str());
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            match v {
                Value::Bool(true) => flags.push(format!("--{long}").into()),
                Value::Bool(false) => {}
                v => return Err(invalid!("{what}: parameter {k} is a flag, not {v}")),
            }
            continue;
        }
        let text = match v {
            Value::String(s) => s,
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            v => return Err(invalid!("{what}: parameter {k} takes one value, not {v}")),
        };
        flags.push(format!("--{long}={text}").into());
    }
    Ok(flags)
}
