//! Running a handler's effect through [`Idem`] and answering with the stored response.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use std::time::Duration;

use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use idem_core::{Backend, BoxFuture, Error, Idem, Key, Outcome, Request, Scope};

use crate::response::{DEFAULT_STORED_HEADERS, HttpError, JsonResponse};

/// `Idempotency-Key-Retention`, idem's own response header (not part of the IETF draft,
/// which asks servers to publish their expiry policy in their documentation): how many
/// seconds the key is remembered after the request that first used it, as whole
/// seconds (delta-seconds, like `Retry-After`). Sent on first answers and on replays when
/// [`HttpIdem::advertise_retention`] is on.
pub const IDEMPOTENCY_KEY_RETENTION: HeaderName =
    HeaderName::from_static("idempotency-key-retention");

/// The header value of a retention: whole seconds, rounded down, at least 1 (idem
/// refuses retentions under one second).
pub fn retention_seconds(retention: Duration) -> u64 {
    retention.as_secs().max(1)
}

/// [`Idem`] for HTTP handlers: the effect returns a [`JsonResponse`], which is stored with
/// the key in the effect's transaction (status, allow-listed headers, body) and replayed
/// as stored with `Idempotent-Replayed: true`.
///
/// A 5xx response is never stored: it rolls the effect back and is returned as it is,
/// so the key stays free for a retry.
#[derive(Debug)]
pub struct HttpIdem<B> {
    idem: Idem<B>,
    stored_headers: Arc<[HeaderName]>,
    advertise_retention: bool,
}

impl<B: Clone> Clone for HttpIdem<B> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            stored_headers: Arc::clone(&self.stored_headers),
            advertise_retention: self.advertise_retention,
        }
    }
}

/// Adds `Idempotency-Key-Retention` to an answer of `scope`'s operation when asked to.
fn advertised(mut response: Response, scope: &Scope, on: bool) -> Response {
    if on {
        let seconds = retention_seconds(scope.operation.retention());
        response
            .headers_mut()
            .insert(IDEMPOTENCY_KEY_RETENTION, HeaderValue::from(seconds));
    }
    response
}

/// The effect's error, or a 5xx response that must roll back and not be stored.
enum Unstored<E> {
    Effect(E),
    Server(JsonResponse),
}

impl<E> Unstored<E> {
    fn split(self) -> Result<E, JsonResponse> {
        match self {
            Self::Effect(e) => Ok(e),
            Self::Server(r) => Err(r),
        }
    }
}

impl<E: fmt::Debug> fmt::Debug for Unstored<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Effect(e) => e.fmt(f),
            Self::Server(r) => write!(f, "server error response {}", r.status()),
        }
    }
}

impl<E: fmt::Display> fmt::Display for Unstored<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Effect(e) => e.fmt(f),
            Self::Server(r) => write!(f, "the effect answered {} (not stored)", r.status()),
        }
    }
}

impl<E: StdError + 'static> StdError for Unstored<E> {
    // The effect's error is the source, so idem classifies what it wraps (a deadlock
    // inside the effect is retried with the same key).
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::Effect(e) => Some(e),
            Self::Server(_) => None,
        }
    }
}

fn keep<E>(
    r: Result<JsonResponse, E>,
    allowed: &[HeaderName],
) -> Result<JsonResponse, Unstored<E>> {
    match r {
        Ok(r) if r.status().is_server_error() => Err(Unstored::Server(r)),
        Ok(r) => Ok(r.retain_headers(allowed)),
        Err(e) => Err(Unstored::Effect(e)),
    }
}

fn answer<E>(error: Error<Unstored<E>>) -> Result<Response, HttpError<E>> {
    match error.try_map_effect(Unstored::split) {
        Ok(e) => Err(HttpError(e)),
        Err(server) => Ok(server.into_response()),
    }
}

impl<B: Backend> HttpIdem<B> {
    /// Wraps an [`Idem`]; stored headers are [`DEFAULT_STORED_HEADERS`].
    pub fn new(idem: Idem<B>) -> Self {
        Self {
            idem,
            stored_headers: Arc::from(DEFAULT_STORED_HEADERS.to_vec()),
            advertise_retention: false,
        }
    }

    /// Sends [`IDEMPOTENCY_KEY_RETENTION`] (`Idempotency-Key-Retention: 86400`) with
    /// every answer [`HttpIdem::execute`] and [`HttpIdem::execute_final`] give from the
    /// effect or from the stored record: the first answer and every replay. The value is
    /// the operation's retention ([`idem_core::Operation::with_retention`], 24 hours by
    /// default) in whole seconds: how long, after the request that first used the key,
    /// a retry with it still gets this answer. It is added when the answer is sent, never
    /// stored, so a replay states the current policy. Errors idem answers itself (400,
    /// 409, 422, 503) and 5xx answers of the effect do not carry it. Off by default:
    /// the header is idem's own name (see `docs/http.md`). Describe it in an OpenAPI
    /// document with [`crate::openapi::advertise_retention`].
    #[must_use]
    pub fn advertise_retention(mut self, on: bool) -> Self {
        self.advertise_retention = on;
        self
    }

    /// Whether answers carry [`IDEMPOTENCY_KEY_RETENTION`].
    pub fn advertises_retention(&self) -> bool {
        self.advertise_retention
    }

    /// Adds a header to the allow-list of headers stored and replayed with a response.
    /// Headers not on the list are dropped from the effect's response, so the first
    /// answer and every replay carry the same headers.
    #[must_use]
    pub fn store_header(self, name: HeaderName) -> Self {
        let mut names = self.stored_headers.to_vec();
        if !names.contains(&name) {
            names.push(name);
        }
        Self {
            stored_headers: Arc::from(names),
            ..self
        }
    }

    /// The protocol client.
    pub fn idem(&self) -> &Idem<B> {
        &self.idem
    }

    /// The allow-listed headers.
    pub fn stored_headers(&self) -> &[HeaderName] {
        &self.stored_headers
    }

    /// Runs `effect` once per `(scope, key)` with [`Idem::execute`]: the effect's SQL and
    /// the record commit together, and its response is stored unless it is a 5xx. A
    /// retry with an equal request gets the stored response and `Idempotent-Replayed:
    /// true`; an `Err` from the effect stores nothing and is answered by `E`'s
    /// [`IntoResponse`] through [`HttpError`].
    pub async fn execute<E, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        mut effect: F,
    ) -> Result<Response, HttpError<E>>
    where
        E: StdError + Send + Sync + 'static,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<JsonResponse, E>> + Send,
    {
        let allowed = Arc::clone(&self.stored_headers);
        let out = self
            .idem
            .execute(scope, key, request, |tx| {
                let fut = effect(tx);
                let allowed = Arc::clone(&allowed);
                Box::pin(async move { keep(fut.await, &allowed) })
            })
            .await;
        let on = self.advertise_retention;
        match out {
            Ok(Outcome::Executed(r)) => Ok(advertised(r.into_response(), scope, on)),
            Ok(Outcome::Replayed(r)) => Ok(advertised(r.replayed(), scope, on)),
            // A rejection stored by `execute_final` under the same key and request.
            Err(Error::StoredRejection(v)) => serde_json::from_value::<JsonResponse>(v)
                .map(|r| advertised(r.replayed(), scope, on))
                .map_err(|e| HttpError(Error::Decode(e))),
            Err(e) => answer(e),
        }
    }

    /// Like [`HttpIdem::execute`], with the explicit policy of storing final rejections:
    /// the effect returns `Ok(Err(response))` for a 4xx answer that must replay (its own
    /// writes are rolled back, the response is stored), `Ok(Ok(response))` for success,
    /// and `Err(e)` for a failure that stores nothing. 5xx responses are never stored.
    pub async fn execute_final<E, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        mut effect: F,
    ) -> Result<Response, HttpError<E>>
    where
        E: StdError + Send + Sync + 'static,
        F: for<'t> FnMut(
                &'t mut B::Tx,
            )
                -> BoxFuture<'t, Result<Result<JsonResponse, JsonResponse>, E>>
            + Send,
    {
        let allowed = Arc::clone(&self.stored_headers);
        let out = self
            .idem
            .execute_final(scope, key, request, |tx| {
                let fut = effect(tx);
                let allowed = Arc::clone(&allowed);
                Box::pin(async move {
                    match fut.await {
                        Ok(Ok(r)) => keep(Ok(r), &allowed).map(Ok),
                        Ok(Err(r)) => keep(Ok(r), &allowed).map(Err),
                        Err(e) => Err(Unstored::Effect(e)),
                    }
                })
            })
            .await;
        let on = self.advertise_retention;
        match out {
            Ok(Outcome::Executed(Ok(r) | Err(r))) => Ok(advertised(r.into_response(), scope, on)),
            Ok(Outcome::Replayed(Ok(r) | Err(r))) => Ok(advertised(r.replayed(), scope, on)),
            Err(e) => answer(e),
        }
    }
}
