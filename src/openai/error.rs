//! Errors of the router's API in OpenAI's shape (`{"error": {message, type, param, code}}`),
//! and which status each request failure gets.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use pdkv_actors::error::RequestError;
use pdkv_core::wire::Failure;
use serde_json::{Value, json};

/// A 4xx or 5xx answer in OpenAI's error shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, starting with the field when one is at fault.
    pub message: String,
    /// OpenAI's error type.
    pub kind: &'static str,
    /// The field at fault.
    pub param: Option<String>,
    /// Seconds a client should wait before trying again (`Retry-After`).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            kind: "invalid_request_error",
            param: Some(param),
            retry_after: None,
        }
    }

    /// An error with no field at fault.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }

    /// A short name for the cause (metric label).
    pub fn outcome(&self) -> &'static str {
        match self.status.as_u16() {
            400..=499 => "bad_request",
            502 | 503 => "unavailable",
            504 => "timeout",
            _ => "error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry_after = self.retry_after;
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The answer to a request that failed at the router or on a leg.
pub fn request_error(error: &RequestError) -> ApiError {
    let (status, kind, retry_after) = match error {
        RequestError::EmptyPrompt | RequestError::PromptTooLong(_) | RequestError::SlotOverflow { .. } => {
            (StatusCode::BAD_REQUEST, "invalid_request_error", None)
        }
        RequestError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "timeout_error", None),
        RequestError::UnknownNode(_) | RequestError::NoLeg { .. } | RequestError::Mailbox { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", Some(1))
        }
        RequestError::Failed {
            failure: Failure::QueueFull { .. } | Failure::NoFreeBlocks { .. },
            ..
        } => (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", Some(1)),
        RequestError::Failed {
            failure: Failure::LegLost(_) | Failure::Unreachable { .. },
            ..
        } => (StatusCode::BAD_GATEWAY, "unavailable_error", Some(1)),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
    };
    let param = (status == StatusCode::BAD_REQUEST).then(|| "prompt".to_string());
    ApiError {
        status,
        message: error.to_string(),
        kind,
        param,
        retry_after,
    }
}

/// JSON answers for routes and methods the API does not have, in place of axum's empty ones.
pub fn with_json_errors(router: axum::Router) -> axum::Router {
    router
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                format!("{method} is not allowed on {}", uri.path()),
            )
        })
        .fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("no route {method} {}", uri.path()),
            )
        })
}
