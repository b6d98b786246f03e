//! The extractors and `HttpIdem` inside a real axum router, on a real (in-memory) SQLite.
#![allow(clippy::unwrap_used)]

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_axum::{
    Authenticated, BodyFields, Fingerprint, HttpError, HttpIdem, IdempotencyKey, JsonBody,
    JsonResponse, Problem,
};
use idem_core::{Operation, Principal, Scope};
use idem_sqlite::{SqliteBackend, SqliteTx, db_error};
use serde_json::{Value, json};
use tower::ServiceExt;

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct Failed(#[from] idem_core::DbError);

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "urn:test:failed",
            "Failed",
        )
        .into_response()
    }
}

type Http = HttpIdem<SqliteBackend>;

/// Inserts a row in the effect's transaction and answers with `status`.
fn insert(
    tx: &mut SqliteTx,
    id: i64,
    status: StatusCode,
) -> idem_core::BoxFuture<'_, Result<JsonResponse, Failed>> {
    Box::pin(tx.run(move |c| {
        c.execute("INSERT INTO item (id) VALUES (?1)", [id])
            .map_err(db_error)?;
        Ok(JsonResponse::new(status, json!({ "id": id }))
            .with_header(header::LOCATION, HeaderValue::from_static("/items"))
            .with_header(
                HeaderName::from_static("x-stored"),
                HeaderValue::from_static("yes"),
            )
            .with_header(
                HeaderName::from_static("x-dropped"),
                HeaderValue::from_static("no"),
            ))
    }))
}

fn scope(principal: Principal) -> Scope {
    Scope::new(principal, Operation::new("item", 1).unwrap())
}

async fn create(
    State(http): State<Http>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fp: Fingerprint,
    Path(id): Path<i64>,
    body: JsonBody,
) -> Result<Response, HttpError<Failed>> {
    let status = StatusCode::from_u16(body.0["status"].as_u64().unwrap_or(201) as u16).unwrap();
    let request = fp.request(&body.0, &BodyFields::except(["trace"]));
    http.execute(&scope(principal), &key, &request, |tx| {
        insert(tx, id, status)
    })
    .await
}

/// Like `create`, with the query left out of the identity (the opt-out).
async fn create_loose(
    State(http): State<Http>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fp: Fingerprint,
    Path(id): Path<i64>,
    body: JsonBody,
) -> Result<Response, HttpError<Failed>> {
    let request = fp.without_query().request(&body.0, &BodyFields::All);
    http.execute(&scope(principal), &key, &request, |tx| {
        insert(tx, id, StatusCode::CREATED)
    })
    .await
}

async fn create_final(
    State(http): State<Http>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fp: Fingerprint,
    Path(id): Path<i64>,
    body: JsonBody,
) -> Result<Response, HttpError<Failed>> {
    let reject = body.0["reject"].as_bool().unwrap_or(false);
    let request = fp.request(&body.0, &BodyFields::All);
    http.execute_final(&scope(principal), &key, &request, |tx| {
        let fut = insert(tx, id, StatusCode::CREATED);
        Box::pin(async move {
            let done = fut.await?;
            Ok(if reject {
                Err(JsonResponse::new(
                    StatusCode::FORBIDDEN,
                    json!({"refused": id}),
                ))
            } else {
                Ok(done)
            })
        })
    })
    .await
}

async fn optional(key: Option<IdempotencyKey>) -> String {
    key.map(|k| k.0.as_str().to_owned())
        .unwrap_or_else(|| "none".into())
}

/// Test authentication: `x-user` becomes the principal.
async fn auth(mut req: Request, next: Next) -> Response {
    if let Some(user) = req.headers().get("x-user").and_then(|v| v.to_str().ok()) {
        let p = Principal::new(user).unwrap();
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

async fn app() -> (Router, Http) {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    let http = HttpIdem::new(idem_core::Idem::new(backend))
        .store_header(HeaderName::from_static("x-stored"));
    http.idem().migrate().await.unwrap();
    http.idem()
        .backend()
        .interact(|c| c.execute_batch("CREATE TABLE item (id INTEGER PRIMARY KEY)"))
        .await
        .unwrap();
    let router = Router::new()
        .route("/items/{id}", post(create))
        .route("/final/{id}", post(create_final))
        .route("/loose/{id}", post(create_loose))
        .route("/optional", post(optional))
        .layer(middleware::from_fn(auth))
        .with_state(http.clone());
    (router, http)
}

async fn call(
    router: &Router,
    uri: &str,
    user: Option<&str>,
    keys: &[&str],
    body: &str,
) -> (StatusCode, Vec<(String, String)>, Value) {
    let mut req = Request::post(uri).header(header::CONTENT_TYPE, "application/json");
    if let Some(u) = user {
        req = req.header("x-user", u);
    }
    for k in keys {
        req = req.header("idempotency-key", *k);
    }
    let res = router
        .clone()
        .oneshot(req.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = res.status();
    let headers = res
        .headers()
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
        .collect();
    let bytes = to_bytes(res.into_body(), 1 << 20).await.unwrap();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, headers, body)
}

fn has(headers: &[(String, String)], name: &str, value: &str) -> bool {
    headers.iter().any(|(n, v)| n == name && v == value)
}

async fn rows(http: &Http) -> i64 {
    http.idem()
        .backend()
        .interact(|c| c.query_row("SELECT count(*) FROM item", [], |r| r.get(0)))
        .await
        .unwrap()
}

#[tokio::test]
async fn stored_headers_are_the_allow_list_and_replays_are_marked() {
    let (router, http) = app().await;
    let first = call(
        &router,
        "/items/1",
        Some("alice"),
        &["k1"],
        r#"{"trace":"a"}"#,
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert!(has(&first.1, "x-stored", "yes") && has(&first.1, "location", "/items"));
    assert!(
        !first
            .1
            .iter()
            .any(|(n, _)| n == "x-dropped" || n == "idempotent-replayed")
    );
    // `trace` is excluded from the identity: a different trace is the same request.
    let again = call(
        &router,
        "/items/1",
        Some("alice"),
        &["\"k1\""],
        r#"{"trace":"b"}"#,
    )
    .await;
    assert_eq!((again.0, &again.2), (first.0, &first.2));
    assert!(has(&again.1, "idempotent-replayed", "true") && has(&again.1, "x-stored", "yes"));
    assert!(!again.1.iter().any(|(n, _)| n == "x-dropped"));
    // Another principal's equal key is another key; another route parameter is another request.
    let bob = call(&router, "/items/2", Some("bob"), &["k1"], "{}").await;
    assert_eq!(bob.0, StatusCode::CREATED);
    let other = call(&router, "/items/3", Some("alice"), &["k1"], "{}").await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.2["type"], "urn:idem:problem:key-reused");
    assert_eq!(rows(&http).await, 2);
}

#[tokio::test]
async fn a_5xx_is_returned_but_never_stored() {
    let (router, http) = app().await;
    let r = call(
        &router,
        "/items/7",
        Some("alice"),
        &["k5"],
        r#"{"status":502}"#,
    )
    .await;
    assert_eq!(r.0, StatusCode::BAD_GATEWAY);
    assert_eq!(rows(&http).await, 0, "the effect's insert rolled back");
    let r = call(
        &router,
        "/items/7",
        Some("alice"),
        &["k5"],
        r#"{"status":502}"#,
    )
    .await;
    assert_eq!(r.0, StatusCode::BAD_GATEWAY);
    assert!(
        !has(&r.1, "idempotent-replayed", "true"),
        "nothing was stored to replay"
    );
}

#[tokio::test]
async fn final_rejections_replay_only_by_opt_in() {
    let (router, http) = app().await;
    let r = call(
        &router,
        "/final/1",
        Some("alice"),
        &["f1"],
        r#"{"reject":true}"#,
    )
    .await;
    assert_eq!(r.0, StatusCode::FORBIDDEN);
    assert_eq!(rows(&http).await, 0, "the rejection's writes rolled back");
    let r = call(
        &router,
        "/final/1",
        Some("alice"),
        &["f1"],
        r#"{"reject":true}"#,
    )
    .await;
    assert_eq!(
        (r.0, r.2.clone()),
        (StatusCode::FORBIDDEN, json!({"refused": 1}))
    );
    assert!(has(&r.1, "idempotent-replayed", "true"));
    let ok = call(&router, "/final/2", Some("alice"), &["f2"], "{}").await;
    assert_eq!(ok.0, StatusCode::CREATED);
    assert_eq!(rows(&http).await, 1);
}

#[tokio::test]
async fn refusals_come_before_any_sql() {
    let (router, http) = app().await;
    let r = call(&router, "/items/1", None, &["k"], "{}").await;
    assert_eq!(
        (r.0, r.2["type"].clone()),
        (
            StatusCode::UNAUTHORIZED,
            json!("urn:idem:problem:unauthenticated")
        )
    );
    for keys in [&[][..], &["a", "b"][..], &[""][..], &["a b"][..]] {
        let r = call(&router, "/items/1", Some("alice"), keys, "{}").await;
        assert_eq!(r.0, StatusCode::BAD_REQUEST, "{keys:?}");
        assert!(has(&r.1, "content-type", "application/problem+json"));
        assert_eq!(r.2["type"], "urn:idem:problem:invalid-idempotency-key");
    }
    let r = call(
        &router,
        "/items/1",
        Some("alice"),
        &["k"],
        "{\"a\":1,\"a\":1}",
    )
    .await;
    assert_eq!(
        (r.0, r.2["type"].clone()),
        (
            StatusCode::BAD_REQUEST,
            json!("urn:idem:problem:invalid-body")
        )
    );
    assert_eq!(rows(&http).await, 0);
    // Optional keys: missing is fine, malformed is not.
    assert_eq!(
        call(&router, "/optional", None, &[], "").await.2,
        json!("none")
    );
    assert_eq!(
        call(&router, "/optional", None, &["\"x\""], "").await.2,
        json!("x")
    );
    assert_eq!(
        call(&router, "/optional", None, &["\"x"], "").await.0,
        StatusCode::BAD_REQUEST
    );
}

/// The query string is part of the request's identity (issue 17.8): the same key with
/// another query is another request (422), never a replay of the first one's response.
#[tokio::test]
async fn the_query_string_is_part_of_the_request() {
    let (router, http) = app().await;
    let first = call(
        &router,
        "/items/1?currency=EUR",
        Some("alice"),
        &["q1"],
        "{}",
    )
    .await;
    assert_eq!(first.0, StatusCode::CREATED);
    let other = call(
        &router,
        "/items/1?currency=USD",
        Some("alice"),
        &["q1"],
        "{}",
    )
    .await;
    assert_eq!(
        (other.0, other.2["type"].clone()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!("urn:idem:problem:key-reused")
        ),
        "another query with the same key must not replay: {other:?}"
    );
    let none = call(&router, "/items/1", Some("alice"), &["q1"], "{}").await;
    assert_eq!(none.0, StatusCode::UNPROCESSABLE_ENTITY, "{none:?}");
    assert_eq!(rows(&http).await, 1);

    // Order of names and the spelling of a space do not matter; the decoded pairs do.
    let a = call(&router, "/items/2?b=2&a=x+y", Some("alice"), &["q2"], "{}").await;
    assert_eq!(a.0, StatusCode::CREATED);
    let b = call(
        &router,
        "/items/2?a=x%20y&b=2",
        Some("alice"),
        &["q2"],
        "{}",
    )
    .await;
    assert_eq!((b.0, &b.2), (a.0, &a.2));
    assert!(has(&b.1, "idempotent-replayed", "true"), "{b:?}");
    // A query that is not UTF-8 once decoded is refused before any SQL.
    let bad = call(&router, "/items/3?a=%FF", Some("alice"), &["q3"], "{}").await;
    assert_eq!(bad.0, StatusCode::BAD_REQUEST, "{bad:?}");
    assert_eq!(rows(&http).await, 2);

    // The opt-out: this route leaves the query out, so another query replays.
    let first = call(&router, "/loose/4?page=1", Some("alice"), &["q4"], "{}").await;
    assert_eq!(first.0, StatusCode::CREATED);
    let again = call(&router, "/loose/4?page=2", Some("alice"), &["q4"], "{}").await;
    assert_eq!((again.0, &again.2), (first.0, &first.2));
    assert!(has(&again.1, "idempotent-replayed", "true"), "{again:?}");
    assert_eq!(rows(&http).await, 3);
}
