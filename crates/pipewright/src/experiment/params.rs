//! An experiment's parameters (pystematic's `parameter`): each declared with a name, a type,
//! a default and a help line; values come from the defaults, then a parameters file
//! (`--params-file`, JSON or TOML), then the command line, each overriding the one before.
//! [`Params::to_json`] is what `parameters.json` holds: every value, defaults included, so that
//! feeding it back as `--params-file` reruns the experiment exactly.

use std::collections::BTreeMap;
use std::path::Path;

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, Command};
use serde_json::Value;

use crate::{invalid, Error, Result};

/// What a parameter holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    Int,
    Float,
    Bool,
    Str,
}

/// A declared parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// `snake_case`; on the command line `--kebab-case`.
    pub name: String,
    pub kind: ParamType,
    /// The default (`Null`: none, for an optional string).
    pub default: Value,
    pub help: String,
}

impl Param {
    fn new(name: &str, kind: ParamType, default: Value, help: &str) -> Self {
        Self {
            name: name.to_string(),
            kind,
            default,
            help: help.to_string(),
        }
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
            ParamType::Int => text.trim().parse::<i64>().map_err(|_| bad())?.into(),
            ParamType::Float => text.trim().parse::<f64>().map_err(|_| bad())?.into(),
            ParamType::Bool => match text.trim() {
                "true" | "1" | "yes" => true.into(),
                "false" | "0" | "no" => false.into(),
                _ => return Err(bad()),
            },
            ParamType::Str => text.into(),
        })
    }

    /// `v` (from a parameters file) checked against this parameter's type.
    fn check(&self, v: Value, file: &str) -> Result<Value> {
        let ok = match self.kind {
            ParamType::Int => v.is_i64() || v.is_u64(),
            ParamType::Float => v.is_number(),
            ParamType::Bool => v.is_boolean(),
            ParamType::Str => v.is_string() || v.is_null(),
        };
        if !ok {
            return Err(invalid!(
                "{file}: parameter {} takes {:?} values, not {v}",
                self.name,
                self.kind
            ));
        }
        Ok(match (self.kind, v) {
            (ParamType::Float, Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN).into(),
            (_, v) => v,
        })
    }
}

/// pystematic's default parameters, which every experiment has.
pub fn standard() -> Vec<Param> {
    vec![
        Param::string("output_dir", "./output", "Where runs go: <output_dir>/<experiment>/<date>-<time>-<id>/."),
        Param::int("random_seed", 0, "The seed of every random stream of the run."),
        Param::flag("debug", false, "Verbose logs (the parameters, each rank's start and end); a body passes it on as VarunaOptions::detect_anomaly to name the first NaN or inf."),
        Param::optional("checkpoint", "A checkpoint of the context to restore before the experiment goes on."),
        Param::flag("cuda", false, "Compute on the GPU (needs a build with CUDA)."),
        Param::flag("distributed", false, "Run nproc_per_node x nnodes ranks: threads, or processes under mpirun in a build with MPI."),
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

    /// Every value, defaults included (`parameters.json`).
    pub fn to_json(&self) -> Value {
        Value::Object(self.0.clone().into_iter().collect())
    }

    /// Reads a parameters file (JSON, or TOML by its `.toml` extension) into `self`, checking
    /// every key against `params`.
    fn load_file(&mut self, params: &[Param], path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
        let what = path.display().to_string();
        let table: serde_json::Map<String, Value> = if path.extension().is_some_and(|e| e == "toml")
        {
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
        for (k, v) in table {
            let p = params
                .iter()
                .find(|p| p.name == k)
                .ok_or_else(|| invalid!("{what}: the experiment has no parameter `{k}`"))?;
            self.0.insert(k, p.check(v, &what)?);
        }
        Ok(())
    }
}

/// The command line of an experiment named `name` with `params`: `--help` lists each with its
/// default; `--params-file FILE` too.
pub fn command(name: &str, about: &str, params: &[Param]) -> Command {
    let mut cmd = Command::new(name.to_string()).about(about.to_string()).arg(
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
    cmd
}

/// The values of `params` for the command line `args` (its first item the program): the
/// defaults, then `--params-file`, then the flags given.
pub fn parse<I, T>(name: &str, about: &str, params: &[Param], args: I) -> Result<Params>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = command(name, about, params)
        .try_get_matches_from(args)
        .map_err(|e| match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                Error::Help(e.render().to_string())
            }
            _ => invalid!("{e}"),
        })?;
    let mut values = Params::defaults(params);
    if let Some(file) = matches.get_one::<String>("params_file") {
        values.load_file(params, Path::new(file))?;
    }
    for p in params {
        if matches.value_source(&p.name) == Some(ValueSource::CommandLine) {
            let text = matches.get_one::<String>(&p.name).expect("given");
            values.0.insert(p.name.clone(), p.parse(text)?);
        }
    }
    Ok(values)
}
