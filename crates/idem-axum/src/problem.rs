//! RFC 9457 problem details (`application/problem+json`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value};

/// The media type of a problem response.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The problem types idem's own responses use, as stable URNs. The OpenAPI document of
/// `idem serve` lists them; applications may use their own types beside them.
pub mod types {
    /// The `Idempotency-Key` header is missing (where required), repeated, empty, too long
    /// or malformed (400).
    pub const INVALID_KEY: &str = "urn:idem:problem:invalid-idempotency-key";
    /// The body is not JSON, repeats an object key, or does not fit the operation (400).
    pub const INVALID_BODY: &str = "urn:idem:problem:invalid-body";
    /// The same key was used with a different request (422).
    pub const KEY_REUSED: &str = "urn:idem:problem:key-reused";
    /// The same message ID arrived with a different payload (422).
    pub const PAYLOAD_MISMATCH: &str = "urn:idem:problem:payload-mismatch";
    /// A request with this key is still running (409, with `Retry-After`).
    pub const IN_PROGRESS: &str = "urn:idem:problem:in-progress";
    /// The database stayed busy, or the connection was lost (503, with `Retry-After`).
    pub const UNAVAILABLE: &str = "urn:idem:problem:unavailable";
    /// No authenticated principal (401).
    pub const UNAUTHENTICATED: &str = "urn:idem:problem:unauthenticated";
    /// An internal error; details are not shown (500).
    pub const INTERNAL: &str = "urn:idem:problem:internal";
}

/// An RFC 9457 problem response: `type`, `title`, `status`, `detail`, extension members,
/// and optionally a `Retry-After` header.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    status: StatusCode,
    type_uri: String,
    title: String,
    detail: Option<String>,
    retry_after: Option<u64>,
    extensions: Map<String, Value>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: &'a str,
    title: &'a str,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
    #[serde(flatten)]
    extensions: &'a Map<String, Value>,
}

impl Problem {
    /// A problem of type `type_uri` (see [`types`]) with a short, fixed `title`.
    pub fn new(status: StatusCode, type_uri: impl Into<String>, title: impl Into<String>) -> Self {
        Self {
            status,
            type_uri: type_uri.into(),
            title: title.into(),
            detail: None,
            retry_after: None,
            extensions: Map::new(),
        }
    }

    /// Adds the occurrence-specific explanation.
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds `Retry-After: seconds` to the response.
    #[must_use]
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Adds an extension member (ignored when `name` is one of the standard members).
    #[must_use]
    pub fn with_extension(mut self, name: &str, value: Value) -> Self {
        if !matches!(name, "type" | "title" | "status" | "detail") {
            self.extensions.insert(name.to_owned(), value);
        }
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The problem type URI.
    pub fn type_uri(&self) -> &str {
        &self.type_uri
    }

    /// The occurrence-specific explanation, if any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }

    /// The `Retry-After` seconds, if any.
    pub fn retry_after(&self) -> Option<u64> {
        self.retry_after
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = Body {
            type_uri: &self.type_uri,
            title: &self.title,
            status: self.status.as_u16(),
            detail: self.detail.as_deref(),
            extensions: &self.extensions,
        };
        // A map of strings and JSON values always serializes.
        let text = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = (self.status, text).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn problems_carry_the_rfc_9457_members() {
        let r = Problem::new(StatusCode::CONFLICT, types::IN_PROGRESS, "In progress")
            .with_detail("wait")
            .with_retry_after(2)
            .with_extension("status", Value::from(1))
            .with_extension("key", Value::from("k"))
            .into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
