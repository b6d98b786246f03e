//! What makes two HTTP requests "the same request": method, matched route, path
//! parameters and the canonical JSON body (the principal is the key's scope).

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, MatchedPath, RawPathParams, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::Request as IdemRequest;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::problem::{Problem, types};

/// The parts of a request that belong to its identity, read from the head only:
/// the method, the matched route template (`/accounts/{id}/debits`, or the path when no
/// route matched) and the path parameters (`{"id": "1"}`).
///
/// Combine it with the body through [`Fingerprint::request`]; the result is the
/// normalized request idem stores with the key and compares on every retry:
///
/// ```json
/// {"body": {"amount": 100}, "method": "POST", "params": {"id": "1"},
///  "route": "/accounts/{id}/debits"}
/// ```
///
/// The principal is not in it: it is part of the key's [`idem_core::Scope`], so equal
/// keys of two principals never meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    method: Method,
    route: String,
    params: Map<String, Value>,
}

/// Which members of a JSON object body belong to the request's identity. Nested values
/// are compared whole; canonicalization sorts object keys, so key order never matters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyFields {
    /// The whole body (the default).
    #[default]
    All,
    /// Only these top-level members (absent ones are left out).
    Only(Vec<String>),
    /// Every top-level member except these (a client timestamp, a trace ID).
    Except(Vec<String>),
}

impl BodyFields {
    /// Only the named top-level members.
    pub fn only<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Self {
        Self::Only(names.into_iter().map(Into::into).collect())
    }

    /// Every top-level member but the named ones.
    pub fn except<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Self {
        Self::Except(names.into_iter().map(Into::into).collect())
    }

    /// Applies the selection; bodies that are not objects are kept whole.
    pub fn select(&self, body: &Value) -> Value {
        let Value::Object(map) = body else {
            return body.clone();
        };
        let keep = |name: &str| match self {
            Self::All => true,
            Self::Only(names) => names.iter().any(|n| n == name),
            Self::Except(names) => !names.iter().any(|n| n == name),
        };
        Value::Object(
            map.iter()
                .filter(|(k, _)| keep(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    }
}

impl Fingerprint {
    /// A fingerprint from its parts (for handlers that build requests without the
    /// extractor, and for tests).
    pub fn new(method: Method, route: impl Into<String>, params: Map<String, Value>) -> Self {
        Self {
            method,
            route: route.into(),
            params,
        }
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The matched route template.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// The normalized request: this fingerprint plus the selected members of `body`.
    pub fn request(&self, body: &Value, fields: &BodyFields) -> IdemRequest {
        IdemRequest::new(json!({
            "method": self.method.as_str(),
            "route": self.route,
            "params": self.params,
            "body": fields.select(body),
        }))
    }
}

/// The request's path could not be decoded (a path parameter that is not UTF-8).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request path cannot be decoded: {0}")]
pub struct PathRejection(String);

impl IntoResponse for PathRejection {
    fn into_response(self) -> Response {
        Problem::new(StatusCode::BAD_REQUEST, types::INVALID_BODY, "Invalid path")
            .with_detail(self.to_string())
            .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Fingerprint {
    type Rejection = PathRejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let route = match parts.extensions.get::<MatchedPath>() {
            Some(m) => m.as_str().to_owned(),
            None => parts.uri.path().to_owned(),
        };
        let params = RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|e| PathRejection(e.body_text()))?;
        let params = params
            .iter()
            .map(|(k, v)| (k.to_owned(), Value::from(v)))
            .collect();
        Ok(Self {
            method: parts.method.clone(),
            route,
            params,
        })
    }
}

/// A JSON body, checked the way idem compares requests: valid JSON with no repeated
/// object key (a request's identity must not depend on which duplicate a parser keeps).
/// Any other body is a 400 problem, whatever its `Content-Type`.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonBody(pub Value);

impl JsonBody {
    /// Deserializes the body into `T`; a mismatch is a 400 problem naming the field.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, BodyRejection> {
        serde_json::from_value(self.0.clone()).map_err(|e| BodyRejection::Shape(e.to_string()))
    }
}

/// Why a body was refused (400, or 413 when it is over axum's body limit).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BodyRejection {
    /// The body could not be read (too large, or the connection failed).
    #[error("the body cannot be read: {1}")]
    Unreadable(StatusCode, String),
    /// The body is not JSON, or repeats an object key.
    #[error("the body is not acceptable JSON: {0}")]
    NotJson(String),
    /// The JSON does not fit the operation.
    #[error("the body does not fit this operation: {0}")]
    Shape(String),
}

impl From<BodyRejection> for Problem {
    fn from(e: BodyRejection) -> Self {
        let status = match &e {
            BodyRejection::Unreadable(status, _) if status.is_client_error() => *status,
            _ => StatusCode::BAD_REQUEST,
        };
        Problem::new(status, types::INVALID_BODY, "Invalid request body").with_detail(e.to_string())
    }
}

impl IntoResponse for BodyRejection {
    fn into_response(self) -> Response {
        Problem::from(self).into_response()
    }
}

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = BodyRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| BodyRejection::Unreadable(e.status(), e.body_text()))?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| BodyRejection::NotJson(format!("not UTF-8 ({e})")))?;
        let request =
            IdemRequest::parse(text).map_err(|e| BodyRejection::NotJson(e.to_string()))?;
        Ok(Self(request.value().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_holds_route_params_and_selected_body() {
        let mut params = Map::new();
        params.insert("id".into(), Value::from("1"));
        let fp = Fingerprint::new(Method::POST, "/accounts/{id}/debits", params);
        let body = json!({"amount": 100, "trace": "t-1"});
        let all = fp.request(&body, &BodyFields::All);
        let only = fp.request(&body, &BodyFields::only(["amount"]));
        let except = fp.request(&body, &BodyFields::except(["trace"]));
        assert_ne!(all, only);
        assert_eq!(only, except);
        assert_eq!(
            only.to_json(),
            r#"{"body":{"amount":100},"method":"POST","params":{"id":"1"},"route":"/accounts/{id}/debits"}"#
        );
        let other = Fingerprint::new(Method::PUT, "/accounts/{id}/debits", Map::new());
        assert_ne!(other.request(&body, &BodyFields::All), all);
        assert_eq!(BodyFields::only(["a"]).select(&json!([1])), json!([1]));
    }
}
