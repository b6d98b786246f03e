//! HTTP `Idempotency-Key` for axum, with the idempotency record in the handler's own
//! database transaction.
//!
//! Middlewares that keep keys in a cache store them apart from the effect, which is the
//! gap idem closes; so this crate is built from extractors and a response type, not a
//! layer: the effect must run in the engine's transaction, which a layer cannot reach.
//!
//! - [`IdempotencyKey`] reads `Idempotency-Key` (the IETF draft's structured-field string
//!   `"…"` or a bare token); required, or optional as `Option<IdempotencyKey>`;
//!   missing, repeated, empty, too long or malformed → 400 before any SQL.
//! - [`Authenticated`] takes the principal that authentication put in the request
//!   extensions (never a client header or the body); it scopes the key.
//! - [`Fingerprint`] (method, matched route, path parameters, query parameters) and
//!   [`JsonBody`] (the canonical JSON body, with [`BodyFields`] to include or exclude
//!   members) make the normalized request that a retry must repeat.
//! - [`HttpIdem::execute`] runs the effect through `Idem::execute` in the engine's
//!   transaction and stores the [`JsonResponse`] (status, allow-listed headers, body);
//!   a replay returns it with `Idempotent-Replayed: true`. 5xx responses are never stored.
//! - [`HttpError`] maps the protocol's errors to RFC 9457 problems: key reused → 422,
//!   still in flight after the wait bound → 409 with `Retry-After`, retries exhausted or
//!   connection lost → 503 with `Retry-After`; the effect's own errors answer themselves.
//! - [`HttpIdem::advertise_retention`] and [`openapi::advertise_retention`] tell clients
//!   how long a key is remembered (`Idempotency-Key-Retention`, and the OpenAPI
//!   extension `x-idempotency-key-retention`).
//!
//! ```
//! use axum::{Router, extract::State, http::StatusCode, routing::post};
//! use idem_axum::{Authenticated, BodyFields, Fingerprint, HttpError, HttpIdem,
//!     IdempotencyKey, JsonBody, JsonResponse};
//! use idem_core::{Backend, Operation, Scope};
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("refused")]
//! struct Refused;
//! impl axum::response::IntoResponse for Refused {
//!     fn into_response(self) -> axum::response::Response {
//!         StatusCode::PAYMENT_REQUIRED.into_response()
//!     }
//! }
//!
//! async fn create_order<B: Backend>(
//!     State(http): State<HttpIdem<B>>,
//!     Authenticated(principal): Authenticated,
//!     IdempotencyKey(key): IdempotencyKey,
//!     fingerprint: Fingerprint,
//!     body: JsonBody,
//! ) -> Result<axum::response::Response, HttpError<Refused>> {
//!     let scope = Scope::new(principal, Operation::new("create-order", 1)?);
//!     let request = fingerprint.request(&body.0, &BodyFields::except(["client_time"]));
//!     http.execute(&scope, &key, &request, |_tx| {
//!         // Run the order's SQL on `_tx` here: it commits with the record.
//!         Box::pin(async { Ok(JsonResponse::new(StatusCode::CREATED, serde_json::json!({"order": 1}))) })
//!     })
//!     .await
//! }
//!
//! fn app<B: Backend + Clone + Send + Sync + 'static>(http: HttpIdem<B>) -> Router {
//!     Router::new().route("/orders", post(create_order::<B>)).with_state(http)
//! }
//! ```

mod execute;
mod fingerprint;
mod key;
pub mod openapi;
mod principal;
pub mod problem;
mod response;

pub use execute::{HttpIdem, IDEMPOTENCY_KEY_RETENTION, retention_seconds};
pub use fingerprint::{BodyFields, BodyRejection, Fingerprint, JsonBody, PathRejection};
pub use key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyRejection, key_from_headers, parse_key};
pub use principal::{Authenticated, Unauthenticated};
pub use problem::{PROBLEM_JSON, Problem};
pub use response::{
    DEFAULT_STORED_HEADERS, ErrorSource, HttpError, IDEMPOTENT_REPLAYED, JsonResponse, problem_for,
};
