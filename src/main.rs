//! The `ddb-aggregator` command line. Only argument handling and printing live here.
//!
//! Exit codes: 0 done, 1 the work failed, 2 bad input (arguments, config, pattern, records).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, Context};
use clap::{Parser, Subcommand};
use ddb_aggregator::config::Config;
use ddb_aggregator::pattern::{Pattern, PatternOptions};
use ddb_aggregator::rules::{Coalescer, Engine, TargetKey};
use serde::ser::{SerializeMap, Serializer};
use serde_json::Value;

#[derive(Parser)]
#[command(name = "ddb-aggregator", version, about = "Keeps counter and rollup items exactly right from a DynamoDB table's stream", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The service: lease stream shards, filter, aggregate exactly once, checkpoint, and serve
    /// /metrics, /healthz and /readyz on metrics.listen. AWS endpoints, region and credentials
    /// come from the standard chain (AWS_REGION, AWS_ENDPOINT_URL_DYNAMODB, ...). SIGTERM
    /// finishes in-flight batches, checkpoints, releases leases and exits 0.
    Run {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Log lines as JSON (for log pipelines) or text (for people). Levels from RUST_LOG.
        #[arg(long, value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
    },
    /// Load and check a config: settings, filter patterns, templates, measures and feedback
    /// loops. Prints a summary; errors name the setting's path and exit 2.
    Validate {
        /// The YAML config (environment variables DDB_AGGREGATOR__SECTION__KEY override it).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Test a filter pattern against one event, like `aws events test-event-pattern`.
    /// Prints `true` or `false` and exits 0; an invalid pattern or event exits 2.
    TestPattern {
        /// The pattern (JSON; duplicate keys: the last wins, as in AWS).
        #[arg(long, value_name = "FILE")]
        pattern: PathBuf,
        /// The event, e.g. one DynamoDB stream record (JSON).
        #[arg(long, value_name = "FILE")]
        event: PathBuf,
        /// Compare DynamoDB N values numerically, as a rule with `numeric_strings: true` does.
        #[arg(long)]
        numeric_strings: bool,
    },
    /// Offline dry run of the rules (no AWS): reads stream records and prints the summed
    /// delta of every target attribute as JSON lines, sorted by target then attribute.
    /// Poison records are reported on stderr and do not stop the run.
    Simulate {
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Stream records: JSON lines (one GetRecords/Lambda record per line) or one Lambda
        /// event document `{"Records": [...]}`; `-` reads standard input.
        #[arg(long, value_name = "FILE")]
        records: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

/// An error that is the user's input, not a failure of the work: exit 2.
#[derive(Debug)]
struct BadInput(String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

fn bad(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BadInput(msg.into()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { config, log_format } => run(&config, log_format),
        Command::Validate { config } => validate(&config),
        Command::TestPattern { pattern, event, numeric_strings } => test_pattern(&pattern, &event, numeric_strings),
        Command::Simulate { config, records } => simulate(&config, &records),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<BadInput>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(path: &Path, format: LogFormat) -> anyhow::Result<()> {
    let config = load_config(path)?;
    ddb_aggregator::telemetry::init_logging(matches!(format, LogFormat::Json));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    runtime.block_on(ddb_aggregator::service::run(config)).map_err(|e| match e {
        ddb_aggregator::service::ServiceError::Setup(m) => bad(m),
        ddb_aggregator::service::ServiceError::Runtime(m) => anyhow!(m),
    })
}

fn load_config(path: &Path) -> anyhow::Result<Config> {
    Config::load(path).map_err(|e| bad(format!("{}: {e}", path.display())))
}

fn validate(path: &Path) -> anyhow::Result<()> {
    let config = load_config(path)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}: valid", path.display())?;
    writeln!(
        out,
        "  source table {} -> aggregates table {}, state table {}",
        config.source.table, config.aggregates_table, config.state.table
    )?;
    for rule in &config.engine.rules {
        let target: Vec<String> = rule.target.iter().map(|(k, t)| format!("{k}={t}")).collect();
        let measures: Vec<String> = rule.measures.iter().map(|m| m.name.to_string()).collect();
        writeln!(out, "  rule {}: target {} measures {}", rule.name, target.join(" "), measures.join(", "))?;
    }
    let vars: Vec<String> = config.target_variables().into_iter().map(|v| format!("--{v}")).collect();
    if !vars.is_empty() {
        writeln!(out, "  reconcile flags: {}", vars.join(" "))?;
    }
    Ok(())
}

fn read_input(path: &Path) -> anyhow::Result<String> {
    if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|e| bad(format!("standard input: {e}")))?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|e| bad(format!("{}: cannot read: {e}", path.display())))
}

fn test_pattern(pattern: &Path, event: &Path, numeric_strings: bool) -> anyhow::Result<()> {
    let pattern_text = read_input(pattern)?;
    let compiled = Pattern::parse(&pattern_text, PatternOptions { numeric_strings })
        .map_err(|e| bad(format!("{}: invalid pattern: {e}", pattern.display())))?;
    let event_text = read_input(event)?;
    let event_value: Value =
        serde_json::from_str(&event_text).map_err(|e| bad(format!("{}: event is not valid JSON: {e}", event.display())))?;
    println!("{}", compiled.matches(&event_value));
    Ok(())
}

/// Records with where they came from (`file:line` or `Records[i]`) for messages.
fn parse_records(text: &str, name: &str) -> anyhow::Result<Vec<(String, Value)>> {
    let whole = serde_json::from_str::<Value>(text);
    match whole {
        Ok(Value::Object(mut doc)) if doc.contains_key("Records") => match doc.remove("Records") {
            Some(Value::Array(records)) => Ok(records.into_iter().enumerate().map(|(i, r)| (format!("{name}: Records[{i}]"), r)).collect()),
            _ => Err(bad(format!("{name}: Records must be an array of stream records"))),
        },
        Ok(v @ Value::Object(_)) => Ok(vec![(format!("{name}:1"), v)]),
        Ok(Value::Array(records)) => Ok(records.into_iter().enumerate().map(|(i, r)| (format!("{name}: [{i}]"), r)).collect()),
        Ok(_) => Err(bad(format!("{name}: expected stream records (JSON lines or {{\"Records\": [...]}})"))),
        Err(whole_err) => {
            let mut out = Vec::new();
            let mut first = true;
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Value>(line) {
                    Ok(v) => out.push((format!("{name}:{}", i + 1), v)),
                    // A multi-line document that is broken: the whole-text error says where.
                    Err(_) if first && whole_err.line() > i + 1 => return Err(bad(format!("{name}: not valid JSON: {whole_err}"))),
                    Err(e) => return Err(bad(format!("{name}:{}: not valid JSON: {e}", i + 1))),
                }
                first = false;
            }
            Ok(out)
        }
    }
}

struct TargetJson<'a>(&'a [String], &'a TargetKey);

impl serde::Serialize for TargetJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in self.0.iter().zip(self.1 .0.iter()) {
            map.serialize_entry(name, &**value)?;
        }
        map.end()
    }
}

#[derive(serde::Serialize)]
struct DeltaLine<'a> {
    target: TargetJson<'a>,
    attribute: &'a str,
    delta: String,
}

fn simulate(config_path: &Path, records_path: &Path) -> anyhow::Result<()> {
    let config = load_config(config_path)?;
    let text = read_input(records_path)?;
    let name = if records_path == Path::new("-") { "stdin".to_string() } else { records_path.display().to_string() };
    let records = parse_records(&text, &name)?;
    let engine: &Engine = &config.engine;
    let mut batch = Coalescer::new();
    let (mut matched, mut poisoned) = (0u64, 0u64);
    let stderr = std::io::stderr();
    let mut err = stderr.lock();
    for (origin, record) in &records {
        let report = engine.apply(record, &mut batch);
        if !report.matched.is_empty() {
            matched += 1;
        }
        for p in &report.poisons {
            poisoned += 1;
            writeln!(err, "{origin}: poison record: {p}")?;
        }
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut lines = 0u64;
    for (target, delta) in batch.into_targets() {
        for (attribute, value) in &delta.attributes {
            let line = DeltaLine { target: TargetJson(&engine.key_names, &target), attribute, delta: value.to_string() };
            serde_json::to_writer(&mut out, &line).context("writing output")?;
            out.write_all(b"\n")?;
            lines += 1;
        }
    }
    out.flush()?;
    writeln!(err, "simulate: {} records, {matched} matched a rule, {poisoned} poison, {lines} target attributes changed", records.len())?;
    if records.is_empty() && !text.trim().is_empty() {
        return Err(anyhow!("no records read"));
    }
    Ok(())
}
