//! Advertising a key's retention in an OpenAPI document.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header) asks a server that expires
//! keys to publish its expiry policy in its documentation; it defines no field for it.
//! [`advertise_retention`] writes idem's own names into an OpenAPI 3 document (as JSON,
//! so it works with any generator: utoipa, aide, a hand-written file):
//!
//! - the operation gets the extension [`RETENTION_EXTENSION`]
//!   (`"x-idempotency-key-retention": 86400`, whole seconds);
//! - each of its 2xx responses documents the `Idempotency-Key-Retention` header that
//!   [`crate::HttpIdem::advertise_retention`] sends.

use std::time::Duration;

use axum::http::Method;
use serde_json::{Map, Value, json};

use crate::execute::retention_seconds;

/// The operation-level extension: how many seconds a key is remembered after the request
/// that first used it (idem's own name; OpenAPI reserves `x-` for extensions).
pub const RETENTION_EXTENSION: &str = "x-idempotency-key-retention";

/// Why an OpenAPI document could not be annotated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpenApiError {
    /// The document has no such operation (`paths` → path → method).
    #[error("the OpenAPI document has no operation {method} {path}")]
    NoOperation {
        /// The method asked for.
        method: String,
        /// The path template asked for.
        path: String,
    },
}

/// Marks the operation `method path` (the document's path template, such as
/// `/accounts/{id}/debits`) of an OpenAPI 3 document with `retention`: the extension
/// [`RETENTION_EXTENSION`] on the operation, and the `Idempotency-Key-Retention` header
/// on each of its 2xx responses. Existing members are replaced, so calling it again with
/// another retention updates the document.
pub fn advertise_retention(
    doc: &mut Value,
    method: &Method,
    path: &str,
    retention: Duration,
) -> Result<(), OpenApiError> {
    let missing = || OpenApiError::NoOperation {
        method: method.as_str().to_owned(),
        path: path.to_owned(),
    };
    let operation = doc
        .get_mut("paths")
        .and_then(|paths| paths.get_mut(path))
        .and_then(|item| item.get_mut(method.as_str().to_ascii_lowercase()))
        .and_then(Value::as_object_mut)
        .ok_or_else(missing)?;
    let seconds = retention_seconds(retention);
    operation.insert(RETENTION_EXTENSION.to_owned(), Value::from(seconds));
    let header = json!({
        "description": format!(
            "How many seconds this Idempotency-Key is remembered after the request that \
             first used it ({seconds} for this operation): a retry with the same key and \
             request within it gets this answer again; after it the key may start a new \
             request. Sent on the first answer and on replays."
        ),
        "schema": {"type": "integer", "minimum": 1},
    });
    if let Some(responses) = operation
        .get_mut("responses")
        .and_then(Value::as_object_mut)
    {
        for (status, response) in responses.iter_mut() {
            if !status.starts_with('2') {
                continue;
            }
            let Some(response) = response.as_object_mut() else {
                continue;
            };
            let headers = response
                .entry("headers")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(headers) = headers.as_object_mut() {
                headers.insert("Idempotency-Key-Retention".to_owned(), header.clone());
            }
        }
    }
    Ok(())
}
