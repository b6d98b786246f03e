//! An axum service with `Idempotency-Key`: the record, the handler's UPDATE and the HTTP
//! response stored in one SQLite transaction. The example starts the service on an
//! ephemeral port, calls it with reqwest (the first call, its replay, the key reused
//! with another body), then shuts it down gracefully.
//!
//! cargo run -p idem-examples --features http --example axum_service

use anyhow::ensure;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::axum::{
    Authenticated, BodyFields, Fingerprint, HttpError, HttpIdem, IdempotencyKey, JsonBody,
    JsonResponse, Problem,
};
use idem::sqlite::{SqliteBackend, SqliteTx, rusqlite};
use idem::{Idem, InvalidInput, Operation, Principal, Scope};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
enum DebitError {
    #[error("insufficient balance")]
    Insufficient,
    #[error(transparent)]
    Db(#[from] rusqlite::Error),
}

// The effect's own errors answer for themselves; nothing is stored for them.
impl IntoResponse for DebitError {
    fn into_response(self) -> Response {
        match self {
            Self::Insufficient => Problem::new(
                StatusCode::PAYMENT_REQUIRED,
                "urn:example:insufficient-balance",
                "Insufficient balance",
            )
            .into_response(),
            Self::Db(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }
}

/// `POST /accounts/{id}/debits` with `{"amount": N}` and an `Idempotency-Key`.
async fn debit(
    State(http): State<HttpIdem<SqliteBackend>>,
    Authenticated(principal): Authenticated, // from the authentication layer (`bearer`)
    IdempotencyKey(key): IdempotencyKey,     // 400 when missing, repeated or malformed
    fingerprint: Fingerprint,                // method, matched route, path and query parameters
    Path(account): Path<i64>,
    body: JsonBody, // the body as JSON, last: 400 when it is not JSON
) -> Result<Response, HttpError<DebitError>> {
    let amount = body.0["amount"]
        .as_i64()
        .filter(|a| *a > 0)
        .ok_or_else(|| InvalidInput::new("amount", "must be a positive whole number"))?;
    let scope = Scope::new(principal, Operation::new("debit", 1)?);
    // The stored, compared request: the fingerprint and the body members that define intent.
    let request = fingerprint.request(&body.0, &BodyFields::only(["amount"]));
    http.execute(&scope, &key, &request, |tx: &mut SqliteTx| {
        // Runs in idem's transaction: the UPDATE commits with the record, or neither does.
        Box::pin(tx.run(move |c| {
            let balance: i64 = c
                .query_row(
                    "UPDATE account SET balance = balance - ?2
                     WHERE id = ?1 AND balance >= ?2 RETURNING balance",
                    [account, amount],
                    |row| row.get(0),
                )
                .map_err(|e| match e {
                    rusqlite::Error::QueryReturnedNoRows => DebitError::Insufficient,
                    e => e.into(),
                })?;
            Ok(JsonResponse::new(
                StatusCode::CREATED,
                json!({ "balance": balance }),
            ))
        }))
    })
    .await
}

/// A tiny authentication layer: `Authorization: Bearer <token>` becomes the principal
/// that scopes the keys. A real service verifies the token first (a signature, a
/// session), and never takes the principal from the body.
async fn bearer(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match token.map(Principal::new) {
        Some(Ok(principal)) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        _ => StatusCode::UNAUTHORIZED.into_response(),
    }
}

fn app(http: HttpIdem<SqliteBackend>) -> Router {
    Router::new()
        .route("/accounts/{id}/debits", post(debit))
        .route_layer(middleware::from_fn(bearer))
        .with_state(http)
}

/// One call as a client sees it: status, `Idempotent-Replayed`, body.
async fn call(
    client: &reqwest::Client,
    url: &str,
    amount: i64,
) -> anyhow::Result<(StatusCode, bool, Value)> {
    let response = client
        .post(url)
        .bearer_auth("account-1")
        .header("Idempotency-Key", "checkout-42")
        .json(&json!({ "amount": amount }))
        .send()
        .await?;
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body: Value = response.json().await?;
    let replay = if replayed {
        " (Idempotent-Replayed: true)"
    } else {
        ""
    };
    println!("POST amount {amount}: {status}{replay} {body}");
    Ok((status, replayed, body))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let backend = SqliteBackend::connect("sqlite::memory:").await?;
    let http = HttpIdem::new(Idem::new(backend.clone()));
    http.idem().migrate().await?;
    backend
        .interact(|c| {
            c.execute_batch(
                "CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
                 INSERT INTO account VALUES (1, 1000);",
            )
        })
        .await?;

    // An ephemeral port; the server stops gracefully when `stop` fires.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/accounts/1/debits", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app(http)).with_graceful_shutdown(async {
        let _ = stopped.await;
    });
    let server = tokio::spawn(server.into_future());
    println!("listening: {url}");

    let client = reqwest::Client::new();
    let (status, replayed, first) = call(&client, &url, 100).await?;
    ensure!(status == StatusCode::CREATED && !replayed && first["balance"] == 900);
    let (status, replayed, again) = call(&client, &url, 100).await?;
    ensure!(status == StatusCode::CREATED && replayed && again == first);
    let (status, _, _) = call(&client, &url, 101).await?;
    ensure!(status == StatusCode::UNPROCESSABLE_ENTITY);
    drop(client);

    let _ = stop.send(());
    server.await??;
    println!("stopped");
    let balance: i64 = backend
        .interact(|c| c.query_row("SELECT balance FROM account WHERE id = 1", [], |r| r.get(0)))
        .await?;
    println!("balance: {balance}");
    ensure!(balance == 900, "one debit of 100 leaves 900, not {balance}");
    Ok(())
}
