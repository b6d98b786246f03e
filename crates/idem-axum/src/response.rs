//! The stored HTTP response, and protocol errors as problem responses.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::{Error, ErrorKind, InvalidInput};
use serde::de::{self, Deserializer};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::problem::{Problem, types};

/// `Idempotent-Replayed`, the response header that marks a replay (`true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The headers stored with every response unless the application adds more:
/// `Content-Type` and `Location`.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 2] = [header::CONTENT_TYPE, header::LOCATION];

/// An HTTP response with a JSON body: what an effect returns, what idem stores with the
/// key (status, allow-listed headers, body) and what a replay returns as stored.
///
/// Stored as `{"status": 201, "headers": [["location", "/accounts/1"]], "body": …}`.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonResponse {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Value,
}

impl JsonResponse {
    /// A response with this status and JSON body.
    pub fn new(status: StatusCode, body: Value) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body,
        }
    }

    /// A response whose body is `body` serialized as JSON.
    pub fn json<T: Serialize + ?Sized>(status: StatusCode, body: &T) -> Result<Self, InvalidInput> {
        serde_json::to_value(body)
            .map(|v| Self::new(status, v))
            .map_err(|e| InvalidInput::new("response", format!("cannot be serialized: {e}")))
    }

    /// Adds a header. Only allow-listed headers are stored and replayed.
    #[must_use]
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers.
    pub fn headers(&self) -> &[(HeaderName, HeaderValue)] {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Value {
        &self.body
    }

    /// Keeps only the headers named in `allowed` (compared case-insensitively).
    pub(crate) fn retain_headers(mut self, allowed: &[HeaderName]) -> Self {
        self.headers.retain(|(name, _)| allowed.contains(name));
        self
    }

    /// This response marked as a replay.
    pub(crate) fn replayed(self) -> Response {
        let mut response = self.into_response();
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

impl IntoResponse for JsonResponse {
    fn into_response(self) -> Response {
        let text = serde_json::to_vec(&self.body).unwrap_or_default();
        let mut response = (self.status, text).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut replaced = Vec::new();
        for (name, value) in self.headers {
            if !replaced.contains(&name) {
                headers.remove(&name);
                replaced.push(name.clone());
            }
            headers.append(name, value);
        }
        response
    }
}

#[derive(Serialize, Deserialize)]
struct Stored {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Serialize for JsonResponse {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let headers = self
            .headers
            .iter()
            .map(|(n, v)| {
                v.to_str()
                    .map(|v| (n.as_str().to_owned(), v.to_owned()))
                    .map_err(|_| {
                        serde::ser::Error::custom(format!(
                            "header {n} is not visible ASCII and cannot be stored"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Stored {
            status: self.status.as_u16(),
            headers,
            body: self.body.clone(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for JsonResponse {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let stored = Stored::deserialize(d)?;
        let status = StatusCode::from_u16(stored.status).map_err(de::Error::custom)?;
        let headers = stored
            .headers
            .into_iter()
            .map(|(n, v)| {
                Ok((
                    HeaderName::try_from(n).map_err(de::Error::custom)?,
                    HeaderValue::try_from(v).map_err(de::Error::custom)?,
                ))
            })
            .collect::<Result<_, D::Error>>()?;
        Ok(Self {
            status,
            headers,
            body: stored.body,
        })
    }
}

/// A protocol error as an HTTP response: a newtype around [`Error`], which the orphan
/// rule keeps from implementing [`IntoResponse`] itself.
///
/// | error | status |
/// |---|---|
/// | [`Error::InvalidInput`] | 400 (500 when the *response* could not be stored) |
/// | [`Error::KeyReused`], [`Error::PayloadMismatch`] | 422 |
/// | [`Error::InProgress`] | 409 with `Retry-After` (the wait bound, in whole seconds, at least 1) |
/// | [`Error::LeaseLost`] | 409 with `Retry-After: 1` (another call carries the run on) |
/// | [`Error::RetriesExhausted`], [`Error::Backend`] of kind [`ErrorKind::Connection`] | 503 with `Retry-After: 1` |
/// | [`Error::Effect`] | the effect error's own [`IntoResponse`] |
/// | anything else | 500, details hidden |
///
/// Every response except the effect's is `application/problem+json`; 5xx problems hide
/// the error, which is left in the response extensions as [`ErrorSource`] for a logging
/// layer.
#[derive(Debug)]
pub struct HttpError<E>(pub Error<E>);

impl<E> From<Error<E>> for HttpError<E> {
    fn from(e: Error<E>) -> Self {
        Self(e)
    }
}

impl<E> From<InvalidInput> for HttpError<E> {
    fn from(e: InvalidInput) -> Self {
        Self(Error::InvalidInput(e))
    }
}

impl<E: fmt::Display> fmt::Display for HttpError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<E: StdError + 'static> StdError for HttpError<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

/// The error behind a 5xx problem response, in the response's extensions.
#[derive(Debug, Clone)]
pub struct ErrorSource(pub Arc<dyn StdError + Send + Sync>);

/// The problem response for a protocol error, or `None` for [`Error::Effect`], which the
/// effect's error type answers itself.
pub fn problem_for<E>(error: &Error<E>) -> Option<Problem> {
    let internal = || {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::INTERNAL,
            "Internal error",
        )
    };
    let unavailable = |detail: &str| {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            types::UNAVAILABLE,
            "Service unavailable",
        )
        .with_detail(detail)
        .with_retry_after(1)
    };
    Some(match error {
        Error::Effect(_) => return None,
        Error::InvalidInput(e) if e.what() == "response" => internal(),
        Error::InvalidInput(e) => Problem::new(
            StatusCode::BAD_REQUEST,
            types::INVALID_BODY,
            "Invalid request",
        )
        .with_detail(e.to_string()),
        Error::KeyReused { .. } => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED,
            "Idempotency key reused",
        )
        .with_detail("this Idempotency-Key was already used with a different request"),
        Error::PayloadMismatch { .. } => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::PAYLOAD_MISMATCH,
            "Message ID reused",
        )
        .with_detail("this message ID was already processed with a different payload"),
        Error::InProgress { waited } => {
            let seconds = waited.as_secs() + u64::from(waited.subsec_nanos() > 0);
            Problem::new(
                StatusCode::CONFLICT,
                types::IN_PROGRESS,
                "Request in progress",
            )
            .with_detail(
                "a request with this Idempotency-Key is still being processed; \
                 retry later with the same key",
            )
            .with_retry_after(seconds.max(1))
        }
        Error::LeaseLost { .. } => Problem::new(
            StatusCode::CONFLICT,
            types::IN_PROGRESS,
            "Request in progress",
        )
        .with_detail(
            "another call took this request over and is carrying it on; \
             retry later with the same key",
        )
        .with_retry_after(1),
        Error::RetriesExhausted { .. } => {
            unavailable("the database stayed busy; retry with the same key")
        }
        Error::LockWait { waited } => unavailable(&format!(
            "waited {} ms for a lock on the idempotency table that another session holds \
             (a schema change, LOCK TABLE, a purge or a migration), not for a request with \
             this key; nothing ran; retry with the same key",
            waited.as_millis()
        )),
        Error::Backend(e) if e.kind() == ErrorKind::Connection => unavailable(
            "the database connection failed; retry with the same key to learn the outcome",
        ),
        _ => internal(),
    })
}

impl<E> IntoResponse for HttpError<E>
where
    E: IntoResponse + StdError + Send + Sync + 'static,
{
    fn into_response(self) -> Response {
        let problem = match &self.0 {
            Error::Effect(_) => None,
            other => problem_for(other),
        };
        let Some(problem) = problem else {
            return match self.0 {
                Error::Effect(e) => e.into_response(),
                _ => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            };
        };
        let server_error = problem.status().is_server_error();
        let mut response = problem.into_response();
        if server_error {
            response
                .extensions_mut()
                .insert(ErrorSource(Arc::new(self.0)));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use std::time::Duration;

    #[test]
    fn responses_round_trip_through_storage() {
        let r = JsonResponse::new(StatusCode::CREATED, json!({"balance": 900}))
            .with_header(header::LOCATION, HeaderValue::from_static("/accounts/1"))
            .with_header(
                HeaderName::from_static("x-trace"),
                HeaderValue::from_static("t"),
            );
        let kept = r.retain_headers(&DEFAULT_STORED_HEADERS);
        let text = serde_json::to_string(&kept).unwrap();
        assert_eq!(
            text,
            r#"{"status":201,"headers":[["location","/accounts/1"]],"body":{"balance":900}}"#
        );
        let back: JsonResponse = serde_json::from_str(&text).unwrap();
        assert_eq!(back, kept);
        let http = back.replayed();
        assert_eq!(http.status(), StatusCode::CREATED);
        assert_eq!(http.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(http.headers()[header::LOCATION], "/accounts/1");
        assert!(
            serde_json::from_str::<JsonResponse>(r#"{"status":99,"headers":[],"body":1}"#).is_err()
        );
    }

    #[test]
    fn errors_map_to_statuses() {
        let status =
            |e: Error<std::io::Error>| problem_for(&e).map(|p| (p.status(), p.retry_after()));
        assert_eq!(
            status(Error::KeyReused {
                stored: json!(1),
                supplied: json!(2)
            }),
            Some((StatusCode::UNPROCESSABLE_ENTITY, None))
        );
        assert_eq!(
            status(Error::InProgress {
                waited: Duration::from_millis(1500)
            }),
            Some((StatusCode::CONFLICT, Some(2)))
        );
        assert_eq!(
            status(Error::InProgress {
                waited: Duration::from_millis(10)
            }),
            Some((StatusCode::CONFLICT, Some(1)))
        );
        assert_eq!(
            status(Error::LeaseLost { fence: 3 }),
            Some((StatusCode::CONFLICT, Some(1)))
        );
        let conn = idem_core::DbError::new("x", ErrorKind::Connection, "gone");
        assert_eq!(
            status(Error::Backend(conn)),
            Some((StatusCode::SERVICE_UNAVAILABLE, Some(1)))
        );
        let other = idem_core::DbError::new("x", ErrorKind::Other, "secret detail");
        let p = problem_for::<std::io::Error>(&Error::Backend(other)).unwrap();
        assert_eq!(p.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(p.detail(), None, "5xx details are hidden");
        assert_eq!(status(Error::Effect(std::io::Error::other("e"))), None);
    }
}
