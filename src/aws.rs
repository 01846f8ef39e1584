//! The AWS edge shared by the service modules: SDK configuration from the standard chain, and
//! the one place SDK errors are classified. Nothing outside `stream`, `state` and `sink` sees
//! SDK error types.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;

/// How an AWS call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Throttling or limits: back off and retry.
    Throttled,
    /// Timeouts, connection errors, 5xx: retry.
    Transient,
    /// A condition expression was false.
    ConditionFailed,
    /// The request can never succeed as it is (validation, type mismatch, item too large).
    Invalid,
    NotFound,
    /// Credentials, permissions and anything else that needs a person.
    Other,
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub kind: FailureKind,
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.code.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.code, self.message)
        }
    }
}

pub fn classify<E>(e: &SdkError<E, HttpResponse>) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let code = e.code().unwrap_or_default().to_string();
    let message = match e.message() {
        Some(m) => m.to_string(),
        None => aws_sdk_dynamodb::error::DisplayErrorContext(e).to_string(),
    };
    let kind = match code.as_str() {
        "ProvisionedThroughputExceededException"
        | "ThrottlingException"
        | "RequestLimitExceeded"
        | "LimitExceededException"
        | "TooManyRequestsException"
        | "Throttling"
        | "RequestThrottled"
        | "RequestThrottledException"
        | "AWS.SimpleQueueService.RequestThrottled" => FailureKind::Throttled,
        "InternalServerError" | "InternalFailure" | "ServiceUnavailable" | "InternalError" | "TransactionConflictException" => {
            FailureKind::Transient
        }
        "ConditionalCheckFailedException" => FailureKind::ConditionFailed,
        "ValidationException" | "ItemCollectionSizeLimitExceededException" | "SerializationException" => FailureKind::Invalid,
        "ResourceNotFoundException" | "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" => FailureKind::NotFound,
        "" => match e {
            SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => FailureKind::Transient,
            SdkError::ServiceError(s) if s.raw().status().as_u16() >= 500 => FailureKind::Transient,
            _ => FailureKind::Other,
        },
        _ => match e {
            SdkError::ServiceError(s) if s.raw().status().as_u16() >= 500 => FailureKind::Transient,
            _ => FailureKind::Other,
        },
    };
    Failure { kind, code, message }
}

/// A one-line description of any SDK error (code and message), for messages to people.
pub fn classify_any<E, R>(e: &SdkError<E, R>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match (e.code(), e.message()) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c.to_string(),
        _ => aws_sdk_dynamodb::error::DisplayErrorContext(e).to_string(),
    }
}

/// The SDK configuration from the standard chain (AWS_REGION, AWS_ENDPOINT_URL_*, profiles,
/// IRSA, ECS task roles), with the config's timeouts and retries: a call that hangs ends in
/// an error the caller retries, instead of a reader or reconcile waiting for ever.
pub async fn sdk_config(settings: &crate::config::AwsSettings) -> aws_config::SdkConfig {
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(settings.connect_timeout)
        .read_timeout(settings.read_timeout)
        .operation_timeout(settings.operation_timeout)
        .build();
    let retries =
        if settings.adaptive_retries { aws_config::retry::RetryConfig::adaptive() } else { aws_config::retry::RetryConfig::standard() };
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .timeout_config(timeouts)
        .retry_config(retries.with_max_attempts(settings.max_attempts))
        .load()
        .await
}

/// Typed DynamoDB JSON (`{"S": "x"}`, `{"N": "1"}`, ...) from an SDK attribute value. Total:
/// a variant the SDK adds later is an error, never a panic. One body for both SDKs' types.
macro_rules! attribute_json {
    ($name:ident, $m:ident) => {
        pub fn $name(v: &$m::types::AttributeValue) -> Result<serde_json::Value, String> {
            use base64::Engine as _;
            use serde_json::json;
            use $m::types::AttributeValue as A;
            let b64 = |b: &$m::primitives::Blob| base64::engine::general_purpose::STANDARD.encode(b.as_ref());
            let map = |m: &std::collections::HashMap<String, A>| -> Result<serde_json::Value, String> {
                let mut out = serde_json::Map::new();
                for (k, v) in m {
                    out.insert(k.clone(), $name(v).map_err(|e| format!("{k}: {e}"))?);
                }
                Ok(serde_json::Value::Object(out))
            };
            Ok(match v {
                A::S(s) => json!({ "S": s }),
                A::N(n) => json!({ "N": n }),
                A::B(b) => json!({ "B": b64(b) }),
                A::Bool(b) => json!({ "BOOL": b }),
                A::Null(b) => json!({ "NULL": b }),
                A::Ss(v) => json!({ "SS": v }),
                A::Ns(v) => json!({ "NS": v }),
                A::Bs(v) => json!({ "BS": v.iter().map(b64).collect::<Vec<_>>() }),
                A::L(items) => json!({ "L": items.iter().map($name).collect::<Result<Vec<_>, _>>()? }),
                A::M(m) => json!({ "M": map(m)? }),
                _ => return Err("an attribute type this version does not know".to_string()),
            })
        }
    };
}

attribute_json!(attribute_to_json, aws_sdk_dynamodb);
attribute_json!(stream_attribute_to_json, aws_sdk_dynamodbstreams);
