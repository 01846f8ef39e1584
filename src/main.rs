//! The `ddb-aggregator` command line. Only argument handling and printing live here.
//!
//! Exit codes: 0 done, 1 the work failed, 2 bad input (arguments, config, pattern, records).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, Context};
use clap::{Parser, Subcommand};
use ddb_aggregator::config::Config;
use ddb_aggregator::pattern::{Pattern, PatternOptions};
use ddb_aggregator::rules::copy::CopyBatch;
use ddb_aggregator::rules::helper::{self, Scalar};
use ddb_aggregator::rules::{Coalescer, Engine, TargetKey};
use serde::ser::{SerializeMap, Serializer};
use serde_json::Value;

/// mimalloc: the pipeline allocates many small short-lived values per record (JSON nodes,
/// key parts, deltas); glibc malloc spent about a sixth of the time in its own bookkeeping.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (`MIMALLOC_PURGE_DELAY`), which the bindings leave out: the
/// one before `use_numa_nodes` in mimalloc.h's option enum (mimalloc 2 and 3 alike).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed pages go back to the OS at once instead of after mimalloc's delay (1 s in the
/// mimalloc 3 this build links, 10 ms in mimalloc 2): a catch-up
/// allocates and frees a batch's worth every few hundred ms, and with the delay the peak RSS
/// of a 1,000-record batch rose from about 46 to 51-63 MiB. A user's own
/// `MIMALLOC_PURGE_DELAY` (or its older name `MIMALLOC_RESET_DELAY`) still decides.
fn tune_allocator() {
    if ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"].iter().any(|v| std::env::var_os(v).is_some()) {
        return;
    }
    // SAFETY: mi_option_set stores an integer in mimalloc's option table; it takes no pointer
    // and touches no allocation.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

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
        #[arg(long, value_name = "FILE", help = CONFIG_HELP)]
        config: PathBuf,
        /// Log lines as JSON (for log pipelines) or text (for people). Levels from RUST_LOG.
        #[arg(long, value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
    },
    /// Recompute targets from the source items and repair drift, safely while the stream is
    /// being consumed. Say what with the rules' variable names (`--customer c1`, `--date
    /// 2026-11-30`: `reconcile --config FILE --help` lists them) or `--all` (a parallel scan;
    /// also the initial backfill). Exit 0 when no drift is left, 1 when drift remains
    /// (always with --dry-run if any is found), 2 for bad input.
    Reconcile {
        #[arg(long, value_name = "FILE", help = CONFIG_HELP)]
        config: PathBuf,
        /// Every target of every rule, from a full scan of the source table.
        #[arg(long)]
        all: bool,
        /// Only this rule.
        #[arg(long, value_name = "NAME")]
        rule: Option<String>,
        /// Report drift, write nothing.
        #[arg(long)]
        dry_run: bool,
        /// `table` for people, `json` (one object per drift, then a summary) for scripts.
        #[arg(long, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// Parallel scan segments (--all and scan rules).
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
        segments: u32,
        /// Most items read per second by scans (default: unlimited).
        #[arg(long, value_name = "ITEMS", value_parser = clap::value_parser!(u32).range(1..))]
        read_rate: Option<u32>,
        /// Most read capacity units consumed per second, over every read of both the source
        /// and the aggregates table (default: unlimited).
        #[arg(long, value_name = "UNITS", value_parser = parse_units)]
        read_capacity: Option<f64>,
        /// Push the run's results (last success time, corrections, ...) to this Prometheus
        /// Pushgateway, e.g. http://pushgateway:9091 (default: the config's
        /// reconcile.pushgateway); for the nightly --all CronJob.
        #[arg(long, value_name = "URL")]
        pushgateway: Option<String>,
        /// Longest wait for a live replica that is behind and makes no progress (default:
        /// the config's reconcile.wait, 2m). Shards nobody owns are read by reconcile itself.
        #[arg(long, value_name = "DURATION")]
        wait: Option<String>,
        /// Do not wait for a consumer (only when no `run` will ever read this stream).
        #[arg(long)]
        no_wait: bool,
        /// Rounds for targets that change while being reconciled; still changing after them,
        /// they are reported (not forced) and the exit code is 1.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
        rounds: u32,
        /// Variable values as `--NAME VALUE`: flags built from the config (see command_for).
        #[arg(skip)]
        vars: Vec<(String, String)>,
    },
    /// Dead-letter queue tools.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
    },
    /// Load and check a config: settings, filter patterns, templates, measures and feedback
    /// loops. Prints a summary; errors name the setting's path and exit 2.
    Validate {
        #[arg(long, value_name = "FILE", help = CONFIG_HELP)]
        config: PathBuf,
        /// Also read the rule fingerprints in the state table (needs AWS access) and say which
        /// rules a deploy of this config would rebuild (added or changed since recorded), and
        /// whether the ledger registry in the aggregates table lets it start (exit 2 if not).
        #[arg(long)]
        against_state: bool,
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
    /// Ask a running service's /healthz (for container health checks: the image has no shell or
    /// curl). Exits 0 when it answers 2xx within 5 s, else 1 with the reason on stderr.
    Healthcheck {
        /// The service's health endpoint (metrics.listen plus /healthz).
        #[arg(long, default_value = "http://127.0.0.1:9464/healthz")]
        url: String,
    },
    /// Offline dry run of the rules (no AWS): reads stream records and prints the summed
    /// delta of every target attribute as JSON lines, sorted by target then attribute.
    /// Poison records are reported on stderr and do not stop the run.
    Simulate {
        #[arg(long, value_name = "FILE", help = CONFIG_HELP)]
        config: PathBuf,
        /// Stream records: JSON lines (one GetRecords/Lambda record per line) or one Lambda
        /// event document `{"Records": [...]}`; `-` reads standard input.
        #[arg(long, value_name = "FILE")]
        records: PathBuf,
    },
    /// Print the config file's JSON Schema (draft-07; also committed as config/schema.json).
    /// Editors with the YAML language server flag a wrong key while you type when a config
    /// starts with `# yaml-language-server: $schema=<path or URL of the schema>`;
    /// `check-jsonschema --schemafile schema.json config.yaml` checks one in pre-commit.
    Schema,
}

/// `--config`'s help, shared by every command.
const CONFIG_HELP: &str = "The YAML config, or env:NAME for YAML text held by environment variable NAME (e.g. from SSM \
     Parameter Store through an ECS task's secrets). DDB_AGGREGATOR__SECTION__KEY variables override its settings.";

#[derive(Subcommand)]
enum DlqAction {
    /// For each dead letter: reconcile the targets its record touched, then delete it.
    /// Letters whose targets cannot be determined or still drift stay in the queue.
    Replay {
        #[arg(long, value_name = "FILE", help = CONFIG_HELP)]
        config: PathBuf,
        /// Most letters to process in this run.
        #[arg(long, default_value_t = 1000)]
        max: u64,
        /// Longest wait for a live replica that is behind and makes no progress (default:
        /// the config's reconcile.wait, 2m). Shards nobody owns are read by reconcile itself.
        #[arg(long, value_name = "DURATION")]
        wait: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Table,
    Json,
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

/// `--read-capacity`: a positive number of read capacity units per second.
fn parse_units(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{text:?}: give read capacity units per second, a number above 0 (e.g. 100)")),
    }
}

/// The value of `--config` (`--config FILE` or `--config=FILE`) on a command line.
fn config_arg(args: &[String]) -> Option<String> {
    args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--config") {
        Some("") => args.get(i + 1).cloned(),
        Some(rest) => rest.strip_prefix('=').map(str::to_string),
        None => None,
    })
}

/// The command line with `reconcile`'s variable flags (`--customer`, `--date`, ...) built from
/// the config that `--config` names, so `--help` lists them and a typo gets clap's suggestion.
/// Returns the variables added (a name that clashes with a built-in flag is left out).
fn command_for(args: &[String]) -> Result<(clap::Command, Vec<String>), String> {
    use clap::CommandFactory;
    let cmd = Cli::command();
    if args.get(1).map(String::as_str) != Some("reconcile") {
        return Ok((cmd, Vec::new()));
    }
    let Some(path) = config_arg(args) else { return Ok((cmd, Vec::new())) };
    let config = Config::load(Path::new(&path)).map_err(|e| format!("{path}: {e}"))?;
    let taken: std::collections::BTreeSet<String> = cmd
        .find_subcommand("reconcile")
        .map(|c| c.get_arguments().filter_map(|a| a.get_long().map(str::to_string)).collect())
        .unwrap_or_default();
    let vars: Vec<String> = config.target_variables().into_iter().filter(|v| !taken.contains(v) && v != "help" && v != "version").collect();
    let cmd = cmd.mut_subcommand("reconcile", |mut c| {
        for v in &vars {
            let rules: Vec<String> = config
                .engine
                .rules
                .iter()
                .filter(|r| r.target.iter().any(|(_, t)| t.variables().any(|x| x == v)))
                .map(|r| r.name.to_string())
                .collect();
            c = c.arg(
                clap::Arg::new(format!("var:{v}"))
                    .long(v.clone())
                    .value_name("VALUE")
                    .help(format!("Reconcile the targets this value of {{{v}}} determines (rules: {})", rules.join(", ")))
                    .help_heading("Variable flags (from --config)"),
            );
        }
        c
    });
    Ok((cmd, vars))
}

fn main() -> ExitCode {
    tune_allocator();
    let args: Vec<String> = std::env::args().collect();
    let (cmd, var_names) = match command_for(&args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut matches = match cmd.try_get_matches_from(&args) {
        Ok(m) => m,
        Err(e) => {
            let unknown = e.kind() == clap::error::ErrorKind::UnknownArgument;
            let _ = e.print();
            if unknown && args.get(1).is_some_and(|a| a == "reconcile") {
                let flags: Vec<String> = var_names.iter().map(|v| format!("--{v}")).collect();
                match config_arg(&args) {
                    Some(path) if !flags.is_empty() => eprintln!("The variable flags of {path} are: {}", flags.join(" ")),
                    Some(path) => eprintln!("{path} has no variable flags: its targets use no variables; use --all"),
                    None => eprintln!("Variable flags (--customer, ...) come from the config: give --config FILE first."),
                }
            }
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let vars: Vec<(String, String)> = matches
        .subcommand_matches("reconcile")
        .map(|m| var_names.iter().filter_map(|v| m.get_one::<String>(&format!("var:{v}")).map(|x| (v.clone(), x.clone()))).collect())
        .unwrap_or_default();
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches_mut(&mut matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Command::Reconcile { vars: v, .. } = &mut cli.command {
        *v = vars;
    }
    let result = match cli.command {
        Command::Reconcile {
            config,
            all,
            rule,
            dry_run,
            output,
            segments,
            read_rate,
            read_capacity,
            pushgateway,
            wait,
            no_wait,
            rounds,
            vars,
        } => {
            let opts =
                ReconcileCli { all, rule, dry_run, output, segments, read_rate, read_capacity, pushgateway, wait, no_wait, rounds, vars };
            reconcile(&config, opts)
        }
        Command::Dlq { action: DlqAction::Replay { config, max, wait } } => dlq_replay(&config, max, wait.as_deref()),
        Command::Run { config, log_format } => run(&config, log_format),
        Command::Validate { config, against_state } => validate(&config, against_state),
        Command::Healthcheck { url } => healthcheck(&url),
        Command::TestPattern { pattern, event, numeric_strings } => test_pattern(&pattern, &event, numeric_strings),
        Command::Simulate { config, records } => simulate(&config, &records),
        Command::Schema => {
            print!("{}", ddb_aggregator::config::schema::json());
            Ok(())
        }
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

struct ReconcileCli {
    all: bool,
    rule: Option<String>,
    dry_run: bool,
    output: Output,
    segments: u32,
    read_rate: Option<u32>,
    read_capacity: Option<f64>,
    pushgateway: Option<String>,
    wait: Option<String>,
    no_wait: bool,
    rounds: u32,
    vars: Vec<(String, String)>,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

fn reconcile(path: &Path, cli: ReconcileCli) -> anyhow::Result<()> {
    use ddb_aggregator::reconcile::{Options, Reconciler};
    let config = load_config(path)?;
    let wait = wait_flag(cli.wait.as_deref(), &config)?;
    let opts = Options {
        // clap takes each variable flag at most once.
        vars: cli.vars.into_iter().collect(),
        all: cli.all,
        rule: cli.rule,
        dry_run: cli.dry_run,
        segments: cli.segments,
        read_rate: cli.read_rate,
        wait,
        no_wait: cli.no_wait,
        attempts: cli.rounds,
        progress: true,
        // Drifted targets are fenced by their correction; the service's requested repair
        // fences the rest (a nightly --all CronJob would rewrite every quiet item).
        fence_all: false,
        // A hand-run reconcile does not read which storage protocol is committed, so it never
        // holds a target (an older replica would not honour the hold).
        holds: false,
    };
    // Bad input is refused before any request.
    ddb_aggregator::reconcile::check(&config, &opts).map_err(|e| bad(e.to_string()))?;
    let read_capacity = cli.read_capacity;
    let pushgateway = cli.pushgateway.or_else(|| config.reconcile_pushgateway.clone());
    if let Some(url) = &pushgateway {
        ddb_aggregator::telemetry::push::parse_url(url).map_err(|e| bad(format!("--pushgateway: {e}")))?;
    }
    ddb_aggregator::telemetry::init_logging(false);
    let key_names = config.engine.key_names.clone();
    let rt = runtime()?;
    let started = std::time::Instant::now();
    let report = rt.block_on(async move {
        let sdk = ddb_aggregator::aws::sdk_config(&config.aws).await;
        let reconciler = Reconciler::new(&sdk, config).await?.with_own_consumer().with_read_capacity(read_capacity);
        reconciler.run(&opts).await
    });
    if let Some(url) = &pushgateway {
        let result = job_result(report.as_ref().ok(), started.elapsed());
        if let Err(e) = rt.block_on(ddb_aggregator::telemetry::push::push(url, &ddb_aggregator::telemetry::push::body(&result))) {
            eprintln!("warning: the results were not pushed: {e}");
        }
    }
    let report = report.map_err(|e| anyhow!(e))?;
    print_report(&report, &key_names, cli.output, cli.dry_run)?;
    if report.uncorrected() > 0 {
        return Err(anyhow!("{} drifted attribute(s) or target(s) left uncorrected", report.uncorrected()));
    }
    Ok(())
}

/// A run's results for the Pushgateway (None: the run failed).
fn job_result(
    report: Option<&ddb_aggregator::reconcile::Report>,
    elapsed: std::time::Duration,
) -> ddb_aggregator::telemetry::push::JobResult {
    let finished_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let mut r = ddb_aggregator::telemetry::push::JobResult { finished_s, seconds: elapsed.as_secs_f64(), ..Default::default() };
    if let Some(report) = report {
        r.succeeded = report.uncorrected() == 0;
        r.targets_checked = report.targets_checked;
        r.items_read = report.items_read;
        r.drifts = report.drifts.len() as u64;
        r.corrected = report.drifts.iter().filter(|d| d.corrected).count() as u64;
        r.uncorrected = report.uncorrected() as u64;
        r.shards_by_empty_pages = report.by_empty_pages.len() as u64;
        r.helpers = report.helpers.iter().map(|(rule, c)| (rule.clone(), c.live, c.zero)).collect();
    }
    r
}

fn print_report(report: &ddb_aggregator::reconcile::Report, key_names: &[String], output: Output, dry_run: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for why in &report.refused {
        eprintln!("skipped: {why}");
    }
    let target_text = |t: &TargetKey| t.0.join(" / ");
    match output {
        Output::Json => {
            for d in &report.drifts {
                let target: serde_json::Map<String, Value> =
                    key_names.iter().cloned().zip(d.target.0.iter().map(|v| Value::String(v.to_string()))).collect();
                let line = serde_json::json!({
                    "rule": d.rule, "target": target, "attribute": d.attribute,
                    "stored": d.stored.to_string(), "true": d.truth.to_string(),
                    "difference": d.difference().map(|x| x.to_string()), "corrected": d.corrected,
                });
                writeln!(out, "{line}")?;
            }
            for d in &report.copy_drifts {
                writeln!(out, "{}", d.json())?;
            }
            let not_quiet: Vec<String> = report.not_quiet.iter().map(|(r, t)| format!("{r}: {}", target_text(t))).collect();
            let failed: Vec<String> = report.failed.iter().map(|(r, t, why)| format!("{r}: {}: {why}", target_text(t))).collect();
            let summary = serde_json::json!({"summary": {
                "targets_checked": report.targets_checked, "items_read": report.items_read, "read_units": report.read_units, "drifts": report.drifts.len(),
                "corrected": report.drifts.iter().filter(|d| d.corrected).count(), "not_quiet": not_quiet, "failed": failed,
                "poison_items": report.poisons, "seconds": report.elapsed.as_secs_f64(), "dry_run": dry_run,
                "copies_checked": report.copies_checked, "copy_drifts": report.copy_drifts.len(), "copy_sources_pending": report.copy_sources_pending,
                "copies_corrected": report.copy_drifts.iter().filter(|d| d.corrected).count(),
                "shards_by_empty_pages": report.by_empty_pages,
                "helper_items": report.helpers.iter().map(|(rule, c)| (rule.clone(), serde_json::json!({"live": c.live, "zero": c.zero}))).collect::<serde_json::Map<String, Value>>(),
            }});
            writeln!(out, "{summary}")?;
        }
        Output::Table => {
            if !report.drifts.is_empty() {
                writeln!(out, "{:<20} {:<32} {:<20} {:>14} {:>14} {:>14}", "rule", "target", "attribute", "stored", "true", "difference")?;
                for d in &report.drifts {
                    let diff = d.difference().map(|x| x.to_string()).unwrap_or_else(|| "-".into());
                    writeln!(
                        out,
                        "{:<20} {:<32} {:<20} {:>14} {:>14} {:>14}  {}",
                        d.rule,
                        target_text(&d.target),
                        d.attribute,
                        d.stored.to_string(),
                        d.truth.to_string(),
                        diff,
                        if d.corrected { "corrected" } else { "" }
                    )?;
                }
            }
            if !report.copy_drifts.is_empty() {
                writeln!(out, "{:<20} {:<32} {:<20} {:>14} {:>14}", "copy rule", "copy item", "attribute", "stored", "source")?;
                for line in report.copy_drifts.iter().flat_map(|d| d.lines()) {
                    writeln!(out, "{line}")?;
                }
            }
            for (r, t) in &report.not_quiet {
                writeln!(out, "{r}: {} kept changing while being reconciled; not forced (run again)", target_text(t))?;
            }
            for (r, t, why) in &report.failed {
                writeln!(out, "{r}: {} could not be reconciled: {why}", target_text(t))?;
            }
            writeln!(
                out,
                "reconcile: {} target(s) checked, {} item(s) read in {:.1}s ({:.0}/s), {} drift(s){}, {} not quiet{}",
                report.targets_checked,
                report.items_read,
                report.elapsed.as_secs_f64(),
                report.items_read as f64 / report.elapsed.as_secs_f64().max(0.001),
                report.drifts.len(),
                if dry_run {
                    " (dry run: nothing written)".to_string()
                } else {
                    format!(", {} corrected", report.drifts.iter().filter(|d| d.corrected).count())
                },
                report.not_quiet.len(),
                if report.poisons > 0 { format!(", {} poison item(s) skipped", report.poisons) } else { String::new() },
            )?;
            for (rule, c) in &report.helpers {
                writeln!(out, "{rule}: {} helper item(s) live, {} at zero", c.live, c.zero)?;
            }
            if report.copy_sources_pending > 0 {
                writeln!(
                    out,
                    "copies: {} source(s) left out: a fan-out job of theirs is pending and writes their copies",
                    report.copy_sources_pending
                )?;
            }
            if report.copies_checked > 0 || !report.copy_drifts.is_empty() {
                let corrected = report.copy_drifts.iter().filter(|d| d.corrected).count();
                writeln!(
                    out,
                    "copies: {} copy item(s) checked, {} differed from their source{}",
                    report.copies_checked,
                    report.copy_drifts.len(),
                    if dry_run { " (dry run: nothing written)".to_string() } else { format!(", {corrected} corrected") }
                )?;
            }
            if !report.by_empty_pages.is_empty() {
                writeln!(
                    out,
                    "{} idle shard(s) judged caught up by the empty-page rule (reconcile.tip_evidence, an assumption: RELIABILITY.md): {}",
                    report.by_empty_pages.len(),
                    report.by_empty_pages.iter().cloned().collect::<Vec<_>>().join(", ")
                )?;
            }
        }
    }
    Ok(())
}

/// `--wait`, or the config's `reconcile.wait`.
fn wait_flag(flag: Option<&str>, config: &ddb_aggregator::config::Config) -> anyhow::Result<std::time::Duration> {
    match flag {
        Some(text) => ddb_aggregator::config::parse_duration(text).map_err(|e| bad(format!("--wait: {e}"))),
        None => Ok(config.reconcile_wait),
    }
}

fn dlq_replay(path: &Path, max: u64, wait: Option<&str>) -> anyhow::Result<()> {
    use ddb_aggregator::reconcile::{replay_dead_letters, Options, Reconciler};
    let config = load_config(path)?;
    let wait = wait_flag(wait, &config)?;
    let queue = config
        .dead_letter
        .as_ref()
        .map(|d| d.queue_url.clone())
        .ok_or_else(|| bad(format!("{}: no dead_letter.queue_url configured", path.display())))?;
    ddb_aggregator::telemetry::init_logging(false);
    let summary = runtime()?.block_on(async move {
        let sdk = ddb_aggregator::aws::sdk_config(&config.aws).await;
        let sqs = aws_sdk_sqs::Client::new(&sdk);
        let reconciler = Reconciler::new(&sdk, config).await?.with_own_consumer();
        replay_dead_letters(&reconciler, &sqs, &queue, max, &Options { wait, ..Options::default() }).await
    });
    let summary = summary.map_err(|e| anyhow!(e))?;
    for k in &summary.kept {
        eprintln!("kept: {k}");
    }
    println!(
        "dlq replay: {} letter(s) replayed and deleted, {} corrected attribute(s), {} kept",
        summary.replayed,
        summary.corrected,
        summary.kept.len()
    );
    if !summary.kept.is_empty() {
        return Err(anyhow!("{} letter(s) could not be replayed", summary.kept.len()));
    }
    Ok(())
}

fn healthcheck(url: &str) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    match runtime.block_on(ddb_aggregator::telemetry::probe::probe(url, std::time::Duration::from_secs(5))) {
        Ok(()) => Ok(()),
        Err(e @ ddb_aggregator::telemetry::probe::ProbeError::BadUrl(_)) => Err(bad(format!("--url: {e}"))),
        Err(e) => Err(anyhow!("unhealthy: {e}")),
    }
}

fn load_config(path: &Path) -> anyhow::Result<Config> {
    Config::load(path).map_err(|e| bad(format!("{}: {e}", path.display())))
}

fn validate(path: &Path, against_state: bool) -> anyhow::Result<()> {
    let config = load_config(path)?;
    if against_state {
        print_registry(&config)?;
        print_rebuilds(&config)?;
    }
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
        let helpers: Vec<String> = rule
            .measures
            .iter()
            .filter_map(|m| match &m.kind {
                ddb_aggregator::rules::MeasureKind::Helper(h) => Some(format!("{} ({})", m.name, h.derive.as_str())),
                _ => None,
            })
            .collect();
        if let (false, Some((_, sk))) = (helpers.is_empty(), rule.target.last()) {
            writeln!(
                out,
                "    kept in helper items next to each target (same partition key, sort key {}{}<measure>#<value>): {}",
                sk,
                helper::MARK,
                helpers.join(", ")
            )?;
        }
        if let Some(why) = ddb_aggregator::reconcile::refusal(rule) {
            writeln!(out, "  warning: {why}; drift in it is never repaired")?;
        }
    }
    if let Some(why) = config.short_removal_window() {
        writeln!(out, "  warning: {why}")?;
    }
    for why in &config.pattern_warnings {
        writeln!(out, "  warning: {why}")?;
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
    let hit = compiled.matches_json(&event_text).map_err(|e| bad(format!("{}: event is not valid JSON: {e}", event.display())))?;
    println!("{hit}");
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

/// What `simulate` shows for one target attribute.
enum Shown {
    Delta(String),
    /// None: nothing contributes (the attribute would be removed).
    Value(Option<String>),
}

/// One line of `simulate`: a counter's summed `delta`, or the `value` of a max, min, latest or
/// distinct (null: nothing contributes). A sharded target's line is its total's, and names
/// the sub-items the delta is spread over (each stream shard writes one of them; a record
/// file does not say which shard a record came from).
#[derive(serde::Serialize)]
struct SimLine<'a> {
    target: TargetJson<'a>,
    attribute: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    value: Option<Option<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sub_items: Option<SubItems>,
}

/// The sub-items of a sharded target, by the first and last partition key.
#[derive(serde::Serialize)]
struct SubItems {
    write_shards: u16,
    first: String,
    last: String,
}

fn sub_items(engine: &Engine, target: &TargetKey, attribute: &str) -> Option<SubItems> {
    use ddb_aggregator::rules::shards;
    let n = engine
        .rules
        .iter()
        .find(|r| {
            r.target.iter().zip(target.0.iter()).all(|((_, t), v)| t.matches_expansion(v))
                && r.measures.iter().any(|m| m.name.matches_expansion(attribute))
        })?
        .write_shards?;
    let pk = |i: u16| shards::sub_key(target, i).0.first().map(|p| p.to_string()).unwrap_or_default();
    Some(SubItems { write_shards: n, first: pk(0), last: pk(n - 1) })
}

/// One line of `simulate` for a copy rule: the copies one source's last change sets on the
/// items `to` finds, and those it removes.
#[derive(serde::Serialize)]
struct CopyLine<'a> {
    rule: &'a str,
    source: &'a BTreeMap<String, serde_json::Value>,
    to: serde_json::Map<String, serde_json::Value>,
    set: serde_json::Map<String, serde_json::Value>,
    remove: &'a [String],
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    deleted: bool,
}

/// Prints a line per source whose copies change, by rule and source key: how many.
fn print_copies(engine: &Engine, copies: CopyBatch, out: &mut impl Write) -> anyhow::Result<u64> {
    use ddb_aggregator::rules::copy::SortValue;
    let mut lines = 0;
    for (i, change, _) in copies.into_changes() {
        let Some(rule) = engine.copies.get(i) else { continue };
        let mut to = serde_json::Map::new();
        if let Some(index) = &change.find.index {
            to.insert("index".into(), index.clone().into());
        }
        to.insert(change.find.partition.0.clone(), change.find.partition.1.clone().into());
        match &change.find.sort {
            Some((name, SortValue::Equals(v))) => drop(to.insert(name.clone(), v.clone().into())),
            Some((name, SortValue::BeginsWith(v))) => drop(to.insert(format!("{name}_begins_with"), v.clone().into())),
            None => {}
        }
        let set = change.set.iter().cloned().collect();
        let line = CopyLine { rule: &rule.name, source: &change.source, to, set, remove: &change.remove, deleted: change.deleted };
        serde_json::to_writer(&mut *out, &line).context("writing output")?;
        out.write_all(b"\n")?;
        lines += 1;
    }
    Ok(lines)
}

/// `validate --against-state`: whether `run` would start or refuse, from the ledger registry
/// in the aggregates table; a refusal exits 2 with run's message.
fn print_registry(config: &Config) -> anyhow::Result<()> {
    use ddb_aggregator::registry::{self, Decision, Starting};
    let (entries, state_is_new) = runtime()?.block_on(async {
        let sdk = ddb_aggregator::aws::sdk_config(&config.aws).await;
        let ddb = aws_sdk_dynamodb::Client::new(&sdk);
        let leases = ddb_aggregator::state::dynamodb::DynamoDbLeases::new(ddb.clone(), config.state.table.clone(), String::new());
        let state_is_new = !leases.has_read_a_stream().await.with_context(|| format!("reading state table {}", config.state.table))?;
        let reg = registry::dynamodb::Registry::new(ddb, &config.aggregates_table, &config.engine.key_names);
        let (entries, _) = reg.read().await?;
        anyhow::Ok((entries, state_is_new))
    })?;
    let this = Starting {
        aggregates_table: &config.aggregates_table,
        source_table: &config.source.table,
        state_table: &config.state.table,
        stream_arn: "",
        namespace: &config.ledger_namespace,
        explicit: config.ledger_namespace_explicit,
        state_is_new,
    };
    if let Decision::Refuse(r) = registry::decide(&entries, &this) {
        return Err(bad(format!("ledger registry: run would refuse to start: {r}")));
    }
    let mine = entries.iter().find(|e| e.namespace == config.ledger_namespace && e.source_table == config.source.table);
    let mut out = std::io::stdout().lock();
    match mine {
        Some(e) if e.state_table == config.state.table => {
            writeln!(out, "ledger registry: namespace \"{}\" is registered with state table {}", e.namespace, e.state_table)?
        }
        Some(e) => writeln!(
            out,
            "ledger registry: namespace \"{}\" is registered with state table {}; a start registers it with {}",
            e.namespace, e.state_table, config.state.table
        )?,
        None => writeln!(
            out,
            "ledger registry: a start registers namespace \"{}\" with state table {}",
            config.ledger_namespace, config.state.table
        )?,
    }
    Ok(())
}

/// A duration in ms as `25h`, `90s`: the largest whole unit.
fn duration_text(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        _ if s >= 3600 && s.is_multiple_of(3600) => format!("{}h", s / 3600),
        _ if s >= 60 && s.is_multiple_of(60) => format!("{}m", s / 60),
        _ => format!("{s}s"),
    }
}

/// `validate --against-state`: which rules a deploy would rebuild, and which old definitions'
/// leftovers it would zero.
fn print_rebuilds(config: &Config) -> anyhow::Result<()> {
    let plan = runtime()?.block_on(async {
        let sdk = ddb_aggregator::aws::sdk_config(&config.aws).await;
        ddb_aggregator::reconcile::rebuild::against_state(&sdk, config).await
    });
    let plan = plan.with_context(|| format!("reading the rule definitions in state table {}", config.state.table))?;
    let mut out = std::io::stdout().lock();
    if plan.first_start {
        writeln!(
            out,
            "state table {}: no rule definitions recorded yet; a first start records them and rebuilds nothing",
            config.state.table
        )?;
        return Ok(());
    }
    if let Some(reason) = plan.never_committed {
        return Err(bad(format!("a deploy of this config would hold no lease ({}): {}", reason.as_str(), reason.explain())));
    }
    for (rule, why) in plan.rules {
        let what = match why {
            None => "unchanged".to_string(),
            Some(ddb_aggregator::rules::fingerprint::Rebuild::New) => "would be rebuilt: new since the definitions were recorded".into(),
            Some(ddb_aggregator::rules::fingerprint::Rebuild::Changed { was }) => format!("would be rebuilt: changed (recorded {was})"),
        };
        writeln!(out, "rule {rule}: {what}")?;
    }
    if plan.copies_changed {
        writeln!(
            out,
            "copy rules: changed since the definitions were recorded; the deploy waits for the old replicas, then run reconcile --all to set the copies that exist"
        )?;
    }
    let after_ms = u64::try_from(config.remove_leftovers_after.as_millis()).unwrap_or(u64::MAX);
    for old in plan.retire {
        match old.zeroed_ms {
            None => writeln!(
                out,
                "old definition of rule {} would be retired: what it wrote and no rule of this config writes is zeroed, then removed {} later ({})",
                old.name,
                duration_text(after_ms),
                old.definition
            )?,
            Some(at) => {
                let due = chrono::DateTime::from_timestamp_millis(i64::try_from(at.saturating_add(after_ms)).unwrap_or(i64::MAX))
                    .map_or_else(|| "later".to_string(), |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
                writeln!(out, "old definition of rule {}: its leftovers are zeroed and are removed after {due} ({})", old.name, old.definition)?
            }
        }
    }
    Ok(())
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
    let mut copies = CopyBatch::default();
    for (origin, record) in &records {
        let report = engine.apply(record, &mut batch);
        // A record file does not say which shard a record came from: its version is ordered
        // by sequence number alone.
        let copied = engine.apply_copies(record, Some(0), &mut copies);
        if !report.matched.is_empty() || !copied.matched.is_empty() {
            matched += 1;
        }
        for p in report.poisons.iter().chain(&copied.poisons) {
            poisoned += 1;
            writeln!(err, "{origin}: poison record: {p}")?;
        }
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let targets = batch.into_targets();
    // (target, attribute) -> delta, or value: helper items are the service's own, not shown.
    let mut shown: BTreeMap<(&TargetKey, String), Shown> = BTreeMap::new();
    for (target, delta) in targets.iter().filter(|(k, _)| !k.0.last().is_some_and(|sk| sk.contains(helper::MARK))) {
        for (attribute, value) in &delta.attributes {
            shown.insert((target, attribute.clone()), Shown::Delta(value.to_string()));
        }
    }
    let values = ddb_aggregator::sink::derive::values_of_batch(engine, &targets);
    for (target, attribute, value) in &values {
        let text = value.as_ref().map(|v| match v {
            Scalar::N(n) => n.to_string(),
            Scalar::S(s) => s.clone(),
        });
        shown.insert((target, attribute.clone()), Shown::Value(text));
    }
    let mut lines = 0u64;
    for ((target, attribute), what) in shown {
        let (delta, value) = match what {
            Shown::Delta(d) => (Some(d), None),
            Shown::Value(v) => (None, Some(v)),
        };
        let sub_items = sub_items(engine, target, &attribute);
        let line = SimLine { target: TargetJson(&engine.key_names, target), attribute: &attribute, delta, value, sub_items };
        serde_json::to_writer(&mut out, &line).context("writing output")?;
        out.write_all(b"\n")?;
        lines += 1;
    }
    let copy_lines = print_copies(engine, copies, &mut out)?;
    out.flush()?;
    writeln!(
        err,
        "simulate: {} records, {matched} matched a rule, {poisoned} poison, {lines} target attributes changed, {copy_lines} sources' copies changed",
        records.len()
    )?;
    if records.is_empty() && !text.trim().is_empty() {
        return Err(anyhow!("no records read"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_pages_go_back_at_once_unless_the_user_set_the_delay() {
        // The option's place in mimalloc.h's enum, next to one the bindings name.
        assert_eq!(MI_OPTION_PURGE_DELAY + 1, libmimalloc_sys::mi_option_use_numa_nodes);
        // SAFETY: as in tune_allocator; mi_option_get only reads the table.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 10) };
        tune_allocator();
        let user_set = ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"].iter().any(|v| std::env::var_os(v).is_some());
        let now = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(now, if user_set { 10 } else { 0 });
    }
}
