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
