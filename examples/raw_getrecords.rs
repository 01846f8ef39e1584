//! The ceiling of a catch-up: a bare GetRecords loop over every shard of a table's stream from
//! TRIM_HORIZON, doing nothing with the records but count them. `scripts/bench` runs it beside
//! ddb-aggregator on the same backlog, so the ratio of the two is measured in every run.
//!
//! Usage: raw_getrecords --table NAME --expect N [--limit 1000] [--timeout-secs 300]
//! Endpoints, region and credentials come from the standard chain (AWS_ENDPOINT_URL_DYNAMODB,
//! AWS_ENDPOINT_URL_DYNAMODBSTREAMS, ...). Reads until N records are counted (the shards of a
//! live stream stay open) or every shard has ended, then prints one JSON line:
//! `{"records": N, "seconds": S, "records_per_second": R, "calls": C, "shards": K}`.
//! Exits 1 with the reason on stderr if it cannot, or if the timeout passes first.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodbstreams::types::ShardIteratorType;

struct Args {
    table: String,
    expect: u64,
    limit: i32,
    timeout: Duration,
}

fn args() -> Result<Args, String> {
    let mut a = Args { table: String::new(), expect: 0, limit: 1000, timeout: Duration::from_secs(300) };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |what: &str| value.parse::<u64>().map_err(|_| format!("{what}: {value:?} is not a whole number"));
        match flag.as_str() {
            "--table" => a.table = value.clone(),
            "--expect" => a.expect = number("--expect")?,
            "--limit" => a.limit = i32::try_from(number("--limit")?.clamp(1, 1000)).unwrap_or(1000),
            "--timeout-secs" => a.timeout = Duration::from_secs(number("--timeout-secs")?),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.table.is_empty() || a.expect == 0 {
        return Err("usage: raw_getrecords --table NAME --expect N [--limit 1000] [--timeout-secs 300]".into());
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(line) => {
            println!("{line}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("raw_getrecords: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<String, String> {
    let a = args()?;
    let sdk = aws_config::load_from_env().await;
    let ddb = aws_sdk_dynamodb::Client::new(&sdk);
    let streams = aws_sdk_dynamodbstreams::Client::new(&sdk);
    let started = Instant::now();
    let table = ddb.describe_table().table_name(&a.table).send().await.map_err(|e| format!("DescribeTable: {e:?}"))?;
    let arn = table.table().and_then(|t| t.latest_stream_arn()).ok_or("the table has no stream")?.to_string();
    let shards = shard_ids(&streams, &arn).await?;
    let (records, calls) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for shard in &shards {
        let (streams, arn, shard) = (streams.clone(), arn.clone(), shard.clone());
        let (records, calls, expect, limit) = (records.clone(), calls.clone(), a.expect, a.limit);
        tasks.push(tokio::spawn(async move { read_shard(&streams, &arn, &shard, limit, expect, &records, &calls).await }));
    }
    let all = futures::future::join_all(tasks);
    let outcome = tokio::time::timeout(a.timeout, all).await.map_err(|_| format!("not done within {:?}", a.timeout))?;
    for r in outcome {
        r.map_err(|e| format!("a shard's task: {e}"))??;
    }
    let (n, seconds) = (records.load(Ordering::Relaxed), started.elapsed().as_secs_f64());
    if n < a.expect {
        return Err(format!("every shard ended after {n} of {} records", a.expect));
    }
    let rate = if seconds > 0.0 { n as f64 / seconds } else { 0.0 };
    Ok(format!(
        "{{\"records\": {n}, \"seconds\": {seconds:.3}, \"records_per_second\": {rate:.1}, \"calls\": {}, \"shards\": {}}}",
        calls.load(Ordering::Relaxed),
        shards.len()
    ))
}

async fn shard_ids(streams: &aws_sdk_dynamodbstreams::Client, arn: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut start: Option<String> = None;
    for _ in 0..10_000 {
        let resp = streams
            .describe_stream()
            .stream_arn(arn)
            .set_exclusive_start_shard_id(start.clone())
            .send()
            .await
            .map_err(|e| format!("DescribeStream: {e:?}"))?;
        let Some(d) = resp.stream_description() else { break };
        out.extend(d.shards().iter().filter_map(|s| s.shard_id().map(str::to_string)));
        match d.last_evaluated_shard_id() {
            Some(last) => start = Some(last.to_string()),
            None => return Ok(out),
        }
    }
    Err("DescribeStream did not finish paging".into())
}

/// Reads one shard from TRIM_HORIZON until it ends or every shard together counted `expect`.
async fn read_shard(
    streams: &aws_sdk_dynamodbstreams::Client,
    arn: &str,
    shard: &str,
    limit: i32,
    expect: u64,
    records: &AtomicU64,
    calls: &AtomicU64,
) -> Result<(), String> {
    let it = streams
        .get_shard_iterator()
        .stream_arn(arn)
        .shard_id(shard)
        .shard_iterator_type(ShardIteratorType::TrimHorizon)
        .send()
        .await
        .map_err(|e| format!("GetShardIterator {shard}: {e:?}"))?;
    let mut next = it.shard_iterator().map(str::to_string);
    while let Some(iterator) = next.take() {
        if records.load(Ordering::Relaxed) >= expect {
            return Ok(());
        }
        let page =
            streams.get_records().shard_iterator(iterator).limit(limit).send().await.map_err(|e| format!("GetRecords {shard}: {e:?}"))?;
        calls.fetch_add(1, Ordering::Relaxed);
        let got = page.records().len() as u64;
        records.fetch_add(got, Ordering::Relaxed);
        if got == 0 {
            // At the tip of an open shard: wait a little, as a consumer would.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        next = page.next_shard_iterator().map(str::to_string);
    }
    Ok(())
}
