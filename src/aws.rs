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
/// a variant the SDK adds later is an error, never a panic. (Stream records have their own,
/// taking the value: [`crate::stream::dynamodb::attribute_to_json`].)
pub fn attribute_to_json(v: &aws_sdk_dynamodb::types::AttributeValue) -> Result<serde_json::Value, String> {
    use aws_sdk_dynamodb::types::AttributeValue as A;
    use base64::Engine as _;
    use serde_json::json;
    let b64 = |b: &aws_sdk_dynamodb::primitives::Blob| base64::engine::general_purpose::STANDARD.encode(b.as_ref());
    let map = |m: &std::collections::HashMap<String, A>| -> Result<serde_json::Value, String> {
        let mut out = serde_json::Map::new();
        for (k, v) in m {
            out.insert(k.clone(), attribute_to_json(v).map_err(|e| format!("{k}: {e}"))?);
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
        A::L(items) => json!({ "L": items.iter().map(attribute_to_json).collect::<Result<Vec<_>, _>>()? }),
        A::M(m) => json!({ "M": map(m)? }),
        _ => return Err("an attribute type this version does not know".to_string()),
    })
}

/// An SDK attribute value from typed DynamoDB JSON (`{"S": "x"}`, `{"M": {...}}`, binary as
/// base64), the inverse of [`attribute_to_json`]. Anything else is an error naming what is
/// wrong, never a panic.
pub fn json_to_attribute(v: &serde_json::Value) -> Result<aws_sdk_dynamodb::types::AttributeValue, String> {
    use aws_sdk_dynamodb::primitives::Blob;
    use aws_sdk_dynamodb::types::AttributeValue as A;
    use base64::Engine as _;
    use serde_json::Value;
    let typed = v.as_object().filter(|m| m.len() == 1).ok_or("a typed value is an object with one type key")?;
    let Some((ty, inner)) = typed.iter().next() else { return Err("a typed value is an object with one type key".into()) };
    let text = |v: &Value| v.as_str().map(str::to_string).ok_or_else(|| format!("{ty} holds a string"));
    let texts =
        |v: &Value| -> Result<Vec<String>, String> { v.as_array().ok_or_else(|| format!("{ty} holds a list"))?.iter().map(text).collect() };
    let blob =
        |s: String| base64::engine::general_purpose::STANDARD.decode(s).map(Blob::new).map_err(|e| format!("{ty}: not base64 ({e})"));
    Ok(match ty.as_str() {
        "S" => A::S(text(inner)?),
        "N" => A::N(text(inner)?),
        "B" => A::B(blob(text(inner)?)?),
        "BOOL" => A::Bool(inner.as_bool().ok_or("BOOL holds true or false")?),
        "NULL" => A::Null(inner.as_bool().ok_or("NULL holds true")?),
        "SS" => A::Ss(texts(inner)?),
        "NS" => A::Ns(texts(inner)?),
        "BS" => A::Bs(texts(inner)?.into_iter().map(blob).collect::<Result<_, _>>()?),
        "L" => A::L(inner.as_array().ok_or("L holds a list")?.iter().map(json_to_attribute).collect::<Result<_, _>>()?),
        "M" => A::M(
            inner
                .as_object()
                .ok_or("M holds an object")?
                .iter()
                .map(|(k, v)| json_to_attribute(v).map(|a| (k.clone(), a)).map_err(|e| format!("{k}: {e}")))
                .collect::<Result<_, _>>()?,
        ),
        other => return Err(format!("{other:?} is not a DynamoDB type")),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn typed_json_goes_to_the_sdk_and_back_unchanged() {
        let v = json!({"M": {"a": {"L": [{"S": "x"}, {"N": "1.5"}, {"BOOL": true}, {"NULL": true}]}, "b": {"B": "AAEC"}, "s": {"SS": ["p", "q"]}, "n": {"NS": ["1"]}, "bs": {"BS": ["AA=="]}}});
        assert_eq!(attribute_to_json(&json_to_attribute(&v).unwrap()).unwrap(), v);
        for bad in
            [json!("x"), json!({"S": 1}), json!({"Q": "x"}), json!({"B": "%%"}), json!({"S": "a", "N": "1"}), json!({"M": {"k": {"N": 2}}})]
        {
            assert!(json_to_attribute(&bad).is_err(), "{bad}");
        }
    }
}
