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

/// The SDK configuration from the standard chain (AWS_REGION, AWS_ENDPOINT_URL_*, profiles,
/// IRSA, ECS task roles).
pub async fn sdk_config() -> aws_config::SdkConfig {
    aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await
}
