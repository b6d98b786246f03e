//! What makes two HTTP requests "the same request": method, matched route, path
//! parameters, query parameters and the canonical JSON body (the principal is the
//! key's scope).

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
/// route matched), the path parameters (`{"id": "1"}`) and the query parameters.
///
/// Combine it with the body through [`Fingerprint::request`]; the result is the
/// normalized request idem stores with the key and compares on every retry:
///
/// ```json
/// {"body": {"amount": 100}, "method": "POST", "params": {"id": "1"},
///  "query": [["currency", "EUR"]], "route": "/accounts/{id}/debits"}
/// ```
///
/// The query is decoded as HTML forms and axum's `Query` decode it (`+` is a space,
/// `%XX` a byte, the result UTF-8), and its pairs are sorted by name; repeated names keep
/// their order (`?tag=a&tag=b` and `?tag=b&tag=a` are two requests). A request without
/// query parameters has no `query` member, so records stored before queries were
/// fingerprinted still match. Leave the query out with [`Fingerprint::without_query`],
/// or some of its parameters with [`Fingerprint::query_except`].
///
/// The principal is not in it: it is part of the key's [`idem_core::Scope`], so equal
/// keys of two principals never meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    method: Method,
    route: String,
    params: Map<String, Value>,
    query: Vec<(String, String)>,
}

/// Decodes a query string into its pairs, sorted by name (stably: repeated names keep
/// their order). `+` is a space and `%XX` a byte, as in HTML forms; empty segments are
/// skipped and a segment without `=` has an empty value. A name or value that is not
/// UTF-8 once decoded is refused, so two different queries never decode alike.
fn parse_query(raw: &str) -> Result<Vec<(String, String)>, String> {
    let decode = |part: &str| -> Result<String, String> {
        let spaced = part.replace('+', " ");
        percent_encoding::percent_decode_str(&spaced)
            .decode_utf8()
            .map(|text| text.into_owned())
            .map_err(|_| format!("the query parameter {part:?} is not UTF-8 once percent-decoded"))
    };
    let mut pairs = raw
        .split('&')
        .filter(|segment| !segment.is_empty())
        .map(|segment| {
            let (name, value) = segment.split_once('=').unwrap_or((segment, ""));
            Ok((decode(name)?, decode(value)?))
        })
        .collect::<Result<Vec<_>, String>>()?;
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(pairs)
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
    /// A fingerprint from its parts, without query parameters (for handlers that build
    /// requests without the extractor, and for tests; add a query with
    /// [`Fingerprint::with_query`]).
    pub fn new(method: Method, route: impl Into<String>, params: Map<String, Value>) -> Self {
        Self {
            method,
            route: route.into(),
            params,
            query: Vec::new(),
        }
    }

    /// This fingerprint with the query parameters of `raw` (a URI's query, without the
    /// `?`), decoded as the extractor decodes them.
    pub fn with_query(mut self, raw: &str) -> Result<Self, PathRejection> {
        self.query = parse_query(raw).map_err(PathRejection)?;
        Ok(self)
    }

    /// This fingerprint without the query: the same key with any query string is the
    /// same request (the opt-out, for routes whose query never changes the effect).
    #[must_use]
    pub fn without_query(mut self) -> Self {
        self.query.clear();
        self
    }

    /// This fingerprint without the named query parameters (a cache buster, a tracking
    /// tag); the others stay in the identity.
    #[must_use]
    pub fn query_except<I: IntoIterator<Item = S>, S: AsRef<str>>(mut self, names: I) -> Self {
        let names: Vec<S> = names.into_iter().collect();
        self.query
            .retain(|(name, _)| !names.iter().any(|n| n.as_ref() == name));
        self
    }

    /// The decoded query parameters in the identity, sorted by name.
    pub fn query(&self) -> &[(String, String)] {
        &self.query
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
    /// The `query` member is present only when the fingerprint has query parameters.
    pub fn request(&self, body: &Value, fields: &BodyFields) -> IdemRequest {
        let mut request = json!({
            "method": self.method.as_str(),
            "route": self.route,
            "params": self.params,
            "body": fields.select(body),
        });
        if !self.query.is_empty()
            && let Value::Object(members) = &mut request
        {
            let pairs = self
                .query
                .iter()
                .map(|(name, value)| json!([name, value]))
                .collect();
            members.insert("query".into(), Value::Array(pairs));
        }
        IdemRequest::new(request)
    }
}

/// The request's path or query could not be decoded (a path parameter, or a query
/// parameter, that is not UTF-8).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request target cannot be decoded: {0}")]
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
        let query = parse_query(parts.uri.query().unwrap_or_default()).map_err(PathRejection)?;
        Ok(Self {
            method: parts.method.clone(),
            route,
            params,
            query,
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

    #[test]
    fn queries_are_decoded_sorted_and_optional() {
        let fp = |q: &str| {
            Fingerprint::new(Method::POST, "/r", Map::new())
                .with_query(q)
                .unwrap()
        };
        let body = json!({});
        let req = |f: &Fingerprint| f.request(&body, &BodyFields::All).to_json();
        // Sorted by name; `+`, `%20` and a literal space decode alike; `%2B` is a plus.
        assert_eq!(req(&fp("b=2&a=x+y")), req(&fp("a=x%20y&b=2")));
        assert_eq!(fp("a=x%2By").query(), &[("a".into(), "x+y".into())]);
        assert_eq!(
            req(&fp("b=2&a=1")),
            r#"{"body":{},"method":"POST","params":{},"query":[["a","1"],["b","2"]],"route":"/r"}"#
        );
        // Repeated names keep their order; values and names are case-sensitive.
        assert_ne!(req(&fp("t=a&t=b")), req(&fp("t=b&t=a")));
        assert_ne!(req(&fp("a=1")), req(&fp("A=1")));
        // `a`, `a=` and empty segments; no query at all leaves the member out.
        assert_eq!(req(&fp("a")), req(&fp("&a=&")));
        let bare = Fingerprint::new(Method::POST, "/r", Map::new());
        assert_eq!(req(&fp("")), req(&bare));
        assert!(!req(&bare).contains("query"));
        // The opt-outs.
        assert_eq!(req(&fp("a=1&b=2").without_query()), req(&bare));
        assert_eq!(req(&fp("a=1&utm=x").query_except(["utm"])), req(&fp("a=1")));
        // Bytes that are not UTF-8 are refused, never decoded to a replacement character.
        let bad = Fingerprint::new(Method::POST, "/r", Map::new()).with_query("a=%FF");
        assert!(bad.unwrap_err().to_string().contains("not UTF-8"));
    }
}
