//! The key's retention advertised to clients: the `Idempotency-Key-Retention` header on
//! first answers and replays, and the `x-idempotency-key-retention` OpenAPI extension.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::openapi::{OpenApiError, RETENTION_EXTENSION, advertise_retention};
use idem_axum::{
    Authenticated, BodyFields, Fingerprint, HttpError, HttpIdem, IDEMPOTENCY_KEY_RETENTION,
    IdempotencyKey, JsonBody, JsonResponse,
};
use idem_core::{Operation, Principal, Scope};
use idem_sqlite::{SqliteBackend, SqliteTx};
use serde_json::json;
use tower::ServiceExt;

#[derive(Debug, thiserror::Error)]
#[error("refused")]
struct Refused;

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        StatusCode::PAYMENT_REQUIRED.into_response()
    }
}

type Http = HttpIdem<SqliteBackend>;

/// Two hours: the operation's retention, advertised in whole seconds.
const RETENTION: Duration = Duration::from_secs(2 * 60 * 60);

async fn pay(
    State(http): State<Http>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fp: Fingerprint,
    body: JsonBody,
) -> Result<Response, HttpError<Refused>> {
    let operation = Operation::new("pay", 1)?.with_retention(RETENTION);
    let request = fp.request(&body.0, &BodyFields::All);
    let refuse = body.0["refuse"].as_bool().unwrap_or(false);
    let reject = body.0["reject"].as_bool().unwrap_or(false);
    http.execute_final(
        &Scope::new(principal, operation),
        &key,
        &request,
        |_tx: &mut SqliteTx| {
            Box::pin(async move {
                if refuse {
                    return Err(Refused);
                }
                Ok(if reject {
                    Err(JsonResponse::new(
                        StatusCode::FORBIDDEN,
                        json!({"rejected": true}),
                    ))
                } else {
                    Ok(JsonResponse::new(
                        StatusCode::CREATED,
                        json!({"paid": true}),
                    ))
                })
            })
        },
    )
    .await
}

async fn auth(mut req: Request, next: Next) -> Response {
    req.extensions_mut()
        .insert(Principal::new("alice").unwrap());
    next.run(req).await
}

async fn app(advertise: bool) -> Router {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    let http = HttpIdem::new(idem_core::Idem::new(backend)).advertise_retention(advertise);
    assert_eq!(http.advertises_retention(), advertise);
    http.idem().migrate().await.unwrap();
    Router::new()
        .route("/payments", post(pay))
        .layer(middleware::from_fn(auth))
        .with_state(http)
}

async fn call(router: &Router, key: &str, body: &str) -> (StatusCode, Option<String>, bool) {
    let req = Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let res = router.clone().oneshot(req).await.unwrap();
    let retention = res
        .headers()
        .get(IDEMPOTENCY_KEY_RETENTION)
        .map(|v| v.to_str().unwrap().to_owned());
    let replayed = res.headers().contains_key("idempotent-replayed");
    let status = res.status();
    let _ = to_bytes(res.into_body(), 1 << 20).await.unwrap();
    (status, retention, replayed)
}

#[tokio::test]
async fn first_answers_and_replays_carry_the_retention() {
    let router = app(true).await;
    let seconds = Some("7200".to_owned());
    assert_eq!(
        call(&router, "k1", "{}").await,
        (StatusCode::CREATED, seconds.clone(), false)
    );
    assert_eq!(
        call(&router, "k1", "{}").await,
        (StatusCode::CREATED, seconds.clone(), true)
    );
    // A stored final rejection carries it too, first and replayed.
    assert_eq!(
        call(&router, "k2", r#"{"reject":true}"#).await,
        (StatusCode::FORBIDDEN, seconds.clone(), false)
    );
    assert_eq!(
        call(&router, "k2", r#"{"reject":true}"#).await,
        (StatusCode::FORBIDDEN, seconds.clone(), true)
    );
    // Answers that are not the key's stored answer do not: a reused key (422) and the
    // effect's own error (nothing stored, the key stays free).
    assert_eq!(
        call(&router, "k1", r#"{"other":1}"#).await,
        (StatusCode::UNPROCESSABLE_ENTITY, None, false)
    );
    assert_eq!(
        call(&router, "k3", r#"{"refuse":true}"#).await,
        (StatusCode::PAYMENT_REQUIRED, None, false)
    );
}

#[tokio::test]
async fn the_header_is_off_by_default() {
    let router = app(false).await;
    assert_eq!(
        call(&router, "k1", "{}").await,
        (StatusCode::CREATED, None, false)
    );
    assert_eq!(
        call(&router, "k1", "{}").await,
        (StatusCode::CREATED, None, true)
    );
}

#[test]
fn openapi_operations_carry_the_extension_and_document_the_header() {
    let mut doc = json!({
        "openapi": "3.1.0",
        "paths": {
            "/payments": {
                "post": {
                    "responses": {
                        "201": {"description": "paid"},
                        "422": {"description": "key reused"}
                    }
                },
                "get": {"responses": {"200": {"description": "list"}}}
            }
        }
    });
    advertise_retention(&mut doc, &Method::POST, "/payments", RETENTION).unwrap();
    let post = &doc["paths"]["/payments"]["post"];
    assert_eq!(post[RETENTION_EXTENSION], json!(7200));
    assert_eq!(RETENTION_EXTENSION, "x-idempotency-key-retention");
    let header = &post["responses"]["201"]["headers"]["Idempotency-Key-Retention"];
    assert_eq!(header["schema"]["type"], "integer");
    assert!(header["description"].as_str().unwrap().contains("7200"));
    assert_eq!(post["responses"]["422"].get("headers"), None);
    assert_eq!(
        doc["paths"]["/payments"]["get"].get(RETENTION_EXTENSION),
        None
    );
    // Again with another retention: replaced, not duplicated.
    advertise_retention(
        &mut doc,
        &Method::POST,
        "/payments",
        Duration::from_secs(60),
    )
    .unwrap();
    assert_eq!(
        doc["paths"]["/payments"]["post"][RETENTION_EXTENSION],
        json!(60)
    );
    assert_eq!(
        advertise_retention(&mut doc, &Method::PUT, "/payments", RETENTION),
        Err(OpenApiError::NoOperation {
            method: "PUT".into(),
            path: "/payments".into()
        })
    );
}
