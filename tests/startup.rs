//! Start-up faults: a clear message and exit code, not a crash loop with a stack trace.

mod common;

use std::process::Command;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, StreamSpecification, StreamViewType,
};
use common::*;

fn run_service(config: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"));
    cmd.args(["run", "--config"])
        .arg(config)
        .args(["--log-format", "text"])
        .envs(aws_env())
        .env("DDB_AGGREGATOR__METRICS__LISTEN", format!("127.0.0.1:{}", free_port()));
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Bounded: every case here ends by itself within seconds.
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let started = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(60));
    out
}

async fn table_with_stream(c: &aws_sdk_dynamodb::Client, name: &str, view: Option<StreamViewType>) {
    let mut req = c
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(AttributeDefinition::builder().attribute_name("PK").attribute_type(ScalarAttributeType::S).build().unwrap())
        .attribute_definitions(AttributeDefinition::builder().attribute_name("SK").attribute_type(ScalarAttributeType::S).build().unwrap())
        .key_schema(KeySchemaElement::builder().attribute_name("PK").key_type(KeyType::Hash).build().unwrap())
        .key_schema(KeySchemaElement::builder().attribute_name("SK").key_type(KeyType::Range).build().unwrap());
    if let Some(v) = view {
        req = req.stream_specification(StreamSpecification::builder().stream_enabled(true).stream_view_type(v).build().unwrap());
    }
    req.send().await.unwrap();
}

fn err_text(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_faults_exit_with_a_clear_message() {
    let c = client().await;
    let dir = tempfile::tempdir().unwrap();

    // The source table does not exist.
    let config = write_config(dir.path(), &unique("missing"), &unique("state"), "2s");
    let o = run_service(&config, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_text(&o));
    assert!(err_text(&o).contains("does not exist"), "{}", err_text(&o));

    // No stream, and a KEYS_ONLY stream.
    for (view, message) in [
        (None, "has no stream; enable one with StreamViewType NEW_AND_OLD_IMAGES"),
        (Some(StreamViewType::KeysOnly), "has a KEYS_ONLY stream; deltas need NEW_AND_OLD_IMAGES"),
    ] {
        let table = unique("nostream");
        table_with_stream(&c, &table, view).await;
        let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
        let o = run_service(&config, &[]);
        assert_eq!(o.status.code(), Some(2), "{}", err_text(&o));
        assert!(err_text(&o).contains(message), "{}", err_text(&o));
    }

    // The state table is missing and may not be created.
    let table = unique("nostate");
    create_source_table(&c, &table).await;
    let config = write_config(dir.path(), &table, &format!("{table}-state"), "2s");
    let o = run_service(&config, &[("DDB_AGGREGATOR__STATE__CREATE_TABLE", "false")]);
    assert_eq!(o.status.code(), Some(2), "{}", err_text(&o));
    assert!(err_text(&o).contains("does not exist (set state.create_table: true to create it)"), "{}", err_text(&o));

    // DynamoDB cannot be reached at all (nothing listens there): exit 1 with the endpoint's error.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let o = run_service(
        &config,
        &[("AWS_ENDPOINT_URL_DYNAMODB", &dead), ("AWS_ENDPOINT_URL_DYNAMODB_STREAMS", &dead), ("AWS_MAX_ATTEMPTS", "1")],
    );
    assert_eq!(o.status.code(), Some(1), "{}", err_text(&o));
    assert!(err_text(&o).contains("describing source table"), "{}", err_text(&o));

    // No credentials anywhere.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddb-aggregator"));
    cmd.args(["run", "--config"]).arg(&config).args(["--log-format", "text"]);
    for (k, v) in aws_env().into_iter().filter(|(k, _)| !k.starts_with("AWS_ACCESS") && !k.starts_with("AWS_SECRET")) {
        cmd.env(k, v);
    }
    let o = cmd
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("AWS_CONFIG_FILE", "/nonexistent")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("DDB_AGGREGATOR__METRICS__LISTEN", format!("127.0.0.1:{}", free_port()))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_text(&o));
    assert!(err_text(&o).to_lowercase().contains("credentials"), "{}", err_text(&o));
    assert!(!err_text(&o).contains("panicked"), "{}", err_text(&o));

    // The metrics port is taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let o = run_service(&config, &[("DDB_AGGREGATOR__METRICS__LISTEN", &format!("127.0.0.1:{port}"))]);
    assert_eq!(o.status.code(), Some(2), "{}", err_text(&o));
    assert!(err_text(&o).contains(&format!("cannot listen on 127.0.0.1:{port} for metrics")), "{}", err_text(&o));
}

/// The ledger registry item's entry of (namespace, source table): (state table, stream ARN).
async fn registered(c: &aws_sdk_dynamodb::Client, table: &str, namespace: &str) -> Option<(String, String)> {
    let key = ddb_aggregator::registry::KEY;
    let item = get(c, table, key, key).await;
    let entry = item.get(&ddb_aggregator::registry::entry_attribute(namespace, table))?.as_m().ok()?.clone();
    let s = |k: &str| entry.get(k).and_then(|v| v.as_s().ok()).cloned().unwrap_or_default();
    Some((s("state_table"), s("stream_arn")))
}

/// A deployment moved to a state table with another name reads the stream again from its trim
/// horizon: with the default namespace it would count every record again, so it is refused;
/// with the old namespace the ledger refuses the replay; a new one starts on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_deployment_keeps_its_namespace_or_does_not_start() {
    let c = client().await;
    let logs = tempfile::tempdir().unwrap();
    let table = unique("moved");
    create_source_table(&c, &table).await;
    let (state1, state2) = (format!("{table}-state1"), format!("{table}-state2"));
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let config1 = write_config(dir1.path(), &table, &state1, "2s");
    let config2 = write_config(dir2.path(), &table, &state2, "2s");
    let old = ddb_aggregator::sink::ledger::default_namespace(&state1);

    // The deployment on state table 1 aggregates a workload exactly and registers itself.
    let writes = workload(&c, &table, 300, 15, 3, 41).await;
    let mut first = Service::start(&config1, logs.path(), "first", &[]);
    wait_exact_or(&c, &table, Duration::from_secs(120), || first.log_tail()).await;
    assert_eq!(first.terminate().0, Some(0), "{}", first.log_tail());
    let (state, arn) = registered(&c, &table, &old).await.expect("registered");
    assert_eq!(state, state1);
    assert!(arn.starts_with("arn:"), "{arn}");

    // Moved to state table 2 with the default namespace: refused, nothing counted again.
    let o = run_service(&config2, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_text(&o));
    let message = err_text(&o);
    assert!(message.contains("aggregates.ledger_namespace"), "{message}");
    assert!(message.contains(&format!("to \"{old}\" if this is the same deployment moved to state table {state2}")), "{message}");
    assert!(message.contains("or to a new value if this is a second deployment on purpose"), "{message}");
    assert!(c.describe_table().table_name(&state2).send().await.is_err(), "the refused start wrote nothing to its state table");
    wait_exact(&c, &table, Duration::from_secs(5)).await;
    // validate --against-state says so before a deploy.
    let v = run_cli(&["validate", "--config", config2.to_str().unwrap(), "--against-state"]);
    assert_eq!(v.status.code(), Some(2), "{}", err_text(&v));
    assert!(err_text(&v).contains("run would refuse to start") && err_text(&v).contains(&format!("to \"{old}\"")), "{}", err_text(&v));
    let v = run_cli(&["validate", "--config", config1.to_str().unwrap(), "--against-state"]);
    let shown = String::from_utf8_lossy(&v.stdout);
    assert!(v.status.success() && shown.contains(&format!("namespace \"{old}\" is registered with state table {state1}")), "{shown}");

    // With the old namespace: the stream is read again from its trim horizon, the ledger
    // refuses what was applied, and new writes count once.
    let quoted = format!("\"{old}\"");
    let env = [("DDB_AGGREGATOR__AGGREGATES__LEDGER_NAMESPACE", quoted.as_str())];
    let mut moved = Service::start(&config2, logs.path(), "moved", &env);
    let started = std::time::Instant::now();
    while metric(&moved.metrics(), "ddb_aggregator_records_read_total") < writes as f64 {
        assert!(started.elapsed() < Duration::from_secs(120), "the stream was not read again:\n{}", moved.log_tail());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    wait_exact_or(&c, &table, Duration::from_secs(30), || moved.log_tail()).await;
    workload(&c, &table, 60, 15, 3, 42).await;
    wait_exact_or(&c, &table, Duration::from_secs(120), || moved.log_tail()).await;
    assert_eq!(registered(&c, &table, &old).await.map(|r| r.0), Some(state2.clone()), "the namespace now runs with state table 2");
    assert_eq!(moved.terminate().0, Some(0), "{}", moved.log_tail());

    // A new namespace is a second deployment on purpose: it starts and registers.
    let state3 = format!("{table}-state3");
    let dir3 = tempfile::tempdir().unwrap();
    let config3 = write_config(dir3.path(), &table, &state3, "2s");
    let mut second = Service::start(&config3, logs.path(), "second", &[("DDB_AGGREGATOR__AGGREGATES__LEDGER_NAMESPACE", "second")]);
    let started = std::time::Instant::now();
    while registered(&c, &table, "second").await.is_none() {
        assert!(started.elapsed() < Duration::from_secs(30), "not registered:\n{}", second.log_tail());
        assert!(second.child.try_wait().unwrap().is_none(), "exited:\n{}", second.log_tail());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(second.terminate().0, Some(0), "{}", second.log_tail());
}
