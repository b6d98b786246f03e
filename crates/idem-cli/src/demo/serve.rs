//! `idem demo serve`: the demo bank over HTTP on any engine, built on `idem-axum`.
//!
//! The principal is the bearer token as sent (`Authorization: Bearer account-1`): a demo
//! convention standing in for real authentication, which would verify a token and put
//! the principal it names into the request extensions the same way.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use idem::axum::problem::types;
use idem::axum::{
    Authenticated, BodyFields, Fingerprint, HttpError, HttpIdem, IdempotencyKey, JsonBody,
    JsonResponse, Problem,
};
use idem::{
    Consumed, Idem, MessageId, Operation, Principal, Request as IdemRequest, Scope, Subscriber,
};
use idem_conformance::{Bank, BankError};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::task::TaskTracker;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use super::orders::{self, OrderBody, OrderRequest, Stepper};
use crate::fail::Fail;

/// The demo's problem types (besides idem's own, in `idem::axum::problem::types`).
pub(crate) mod demo_types {
    /// The debit would make the balance negative (402, not stored).
    pub(crate) const INSUFFICIENT: &str = "urn:idem:demo:insufficient-balance";
    /// No such account (404).
    pub(crate) const NO_ACCOUNT: &str = "urn:idem:demo:no-account";
}

/// What `idem demo serve` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Where to listen (port 0 picks a free port; the address is printed).
    pub(crate) listen: SocketAddr,
    /// A private namespace created at start and removed at shutdown.
    pub(crate) namespace: Option<String>,
    /// How long a request waits for a concurrent one with the same key before 409.
    pub(crate) wait: Duration,
    /// Test aid: hold each debit's transaction this long after its SQL ran.
    pub(crate) debit_delay: Option<Duration>,
    /// The payment provider of `POST /orders` (the route exists only with it).
    pub(crate) provider: Option<String>,
    /// How long a charge request to the provider may take.
    pub(crate) provider_timeout: Duration,
    /// The lease of an order's run.
    pub(crate) lease: Duration,
}

struct App<K: Bank> {
    bank: K,
    http: HttpIdem<K::B>,
    debit_delay: Option<Duration>,
    /// The `order:v1` step, when `--provider` was given.
    orders: Option<Stepper>,
    /// Effects run in tasks of their own: a client that disconnects does not cancel a
    /// transaction halfway, and shutdown waits for them.
    tasks: TaskTracker,
}

type Shared<K> = Arc<App<K>>;

/// The effect's errors, answered as problems. Insufficient balance is a 402 (Stripe's
/// "request failed" status), neither 409 nor 422, which idem's own answers use.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct ApiError(#[from] BankError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self.0 {
            BankError::Insufficient => Problem::new(
                StatusCode::PAYMENT_REQUIRED,
                demo_types::INSUFFICIENT,
                "Insufficient balance",
            )
            .with_detail("the debit would make the balance negative; nothing was stored")
            .into_response(),
            BankError::NoAccount(id) => no_account(id).into_response(),
            // Orders are answered by `orders::answer`; no account route meets one.
            BankError::NoOrder(_) => internal("an order was not in the expected state"),
            BankError::Db(e) => {
                HttpError::<std::convert::Infallible>(idem::Error::Backend(e)).into_response()
            }
        }
    }
}

fn no_account(id: i64) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        demo_types::NO_ACCOUNT,
        "No such account",
    )
    .with_detail(format!("there is no account {id}"))
}

fn bad_request(detail: impl Into<String>) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        types::INVALID_BODY,
        "Invalid request",
    )
    .with_detail(detail)
}

fn account_id(raw: &str) -> Result<i64, Problem> {
    raw.parse::<i64>()
        .map_err(|_| bad_request(format!("account ID {raw:?} is not a whole number")))
}

fn internal(what: &str) -> Response {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::INTERNAL,
        "Internal error",
    )
    .with_detail(what.to_owned())
    .into_response()
}

/// An account and its balance.
#[derive(Debug, Serialize, ToSchema)]
struct Account {
    id: i64,
    balance: i64,
}

/// The body of `PUT /accounts/{id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct SetBalance {
    /// The new balance, zero or more.
    balance: i64,
}

/// The body of a debit: the request's identity with method, route and account.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct Debit {
    /// A positive whole amount.
    amount: i64,
}

/// A debit's stored response: the balance right after it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
struct BalanceBody {
    /// The balance right after this debit (a replay returns it as stored).
    balance: i64,
}

/// The body of a message for the consumer route.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct Message {
    /// The account to credit.
    account: i64,
    /// A positive whole amount.
    amount: i64,
}

/// What a message did.
#[derive(Debug, Serialize, ToSchema)]
struct MessageOutcome {
    /// `applied` or `duplicate`.
    outcome: String,
    /// The balance after the credit (only when applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    balance: Option<i64>,
}

/// An RFC 9457 problem (`application/problem+json`).
#[derive(Debug, Serialize, ToSchema)]
struct ProblemBody {
    /// One of the `urn:idem:problem:*` or `urn:idem:demo:*` types.
    #[serde(rename = "type")]
    type_uri: String,
    /// A short summary of the type.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What went wrong this time (hidden for 5xx).
    detail: Option<String>,
}

/// `PUT /accounts/{id}`: sets a balance, creating the account (naturally idempotent).
#[utoipa::path(put, path = "/accounts/{id}", request_body = SetBalance,
    params(("id" = i64, Path, description = "The account's ID")),
    responses(
        (status = 200, description = "The account as set", body = Account),
        (status = 400, description = "`urn:idem:problem:invalid-body`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "`urn:idem:problem:unavailable`, with `Retry-After`", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn put_account<K: Bank>(
    State(app): State<Shared<K>>,
    Path(id): Path<String>,
    body: JsonBody,
) -> Result<Json<Account>, Response> {
    let id = account_id(&id).map_err(IntoResponse::into_response)?;
    let SetBalance { balance } = body.parse().map_err(IntoResponse::into_response)?;
    if balance < 0 {
        return Err(bad_request("balance must not be negative").into_response());
    }
    app.bank
        .set_balance(id, balance)
        .await
        .map_err(|e| ApiError(BankError::Db(e)).into_response())?;
    Ok(Json(Account { id, balance }))
}

/// `GET /accounts/{id}`: the current balance.
#[utoipa::path(get, path = "/accounts/{id}",
    params(("id" = i64, Path, description = "The account's ID")),
    responses(
        (status = 200, description = "The account", body = Account),
        (status = 400, description = "`urn:idem:problem:invalid-body`: the ID is not a whole number", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "`urn:idem:demo:no-account`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "`urn:idem:problem:unavailable`, with `Retry-After`", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn get_account<K: Bank>(
    State(app): State<Shared<K>>,
    Path(id): Path<String>,
) -> Result<Json<Account>, Response> {
    let id = account_id(&id).map_err(IntoResponse::into_response)?;
    match app.bank.find_balance(id).await {
        Ok(Some(balance)) => Ok(Json(Account { id, balance })),
        Ok(None) => Err(no_account(id).into_response()),
        Err(e) => Err(ApiError(BankError::Db(e)).into_response()),
    }
}

/// `POST /accounts/{id}/debits`: one idempotent debit per `Idempotency-Key`.
#[utoipa::path(post, path = "/accounts/{id}/debits", request_body = Debit,
    params(
        ("id" = i64, Path, description = "The account to debit"),
        ("Idempotency-Key" = String, Header, description = "Required: a structured-field string (\"…\") or a bare token, 1 to 255 bytes"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Debited; a replay returns the stored response with `Idempotent-Replayed: true`", body = BalanceBody,
            headers(("Location" = String, description = "The account"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, description = "`urn:idem:problem:invalid-idempotency-key` (missing, repeated, empty, too long, malformed) or `urn:idem:problem:invalid-body`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 401, description = "`urn:idem:problem:unauthenticated`: no bearer token", body = ProblemBody, content_type = "application/problem+json"),
        (status = 402, description = "`urn:idem:demo:insufficient-balance`: not stored, the key stays free", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "`urn:idem:demo:no-account`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "`urn:idem:problem:in-progress`: the same key is still running; retry after `Retry-After`", body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 422, description = "`urn:idem:problem:key-reused`: the key was used with a different request", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "`urn:idem:problem:unavailable`: retries exhausted or connection lost", body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ))]
async fn post_debit<K: Bank>(
    State(app): State<Shared<K>>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fingerprint: Fingerprint,
    Path(id): Path<String>,
    body: JsonBody,
) -> Response {
    let prepared = (|| {
        let id = account_id(&id)?;
        let Debit { amount } = body.parse().map_err(Problem::from)?;
        if amount <= 0 {
            return Err(bad_request(format!(
                "amount {amount} is not a positive whole number"
            )));
        }
        let operation = Operation::new("debit", 1).map_err(|e| bad_request(e.to_string()))?;
        Ok((id, amount, Scope::new(principal, operation)))
    })();
    let (id, amount, scope) = match prepared {
        Ok(p) => p,
        Err(problem) => return problem.into_response(),
    };
    let request = fingerprint.request(&body.0, &BodyFields::All);
    let task = Arc::clone(&app);
    let handle = app.tasks.spawn(async move {
        let delay = task.debit_delay;
        task.http
            .execute(&scope, &key, &request, |tx| {
                let debit = K::debit(tx, id, amount);
                Box::pin(async move {
                    let b = debit.await.map_err(ApiError)?;
                    if let Some(delay) = delay {
                        tokio::time::sleep(delay).await;
                    }
                    let location = HeaderValue::try_from(format!("/accounts/{id}"))
                        .unwrap_or(HeaderValue::from_static("/accounts"));
                    Ok::<_, ApiError>(
                        JsonResponse::new(
                            StatusCode::CREATED,
                            json!(BalanceBody { balance: b.balance }),
                        )
                        .with_header(header::LOCATION, location),
                    )
                })
            })
            .await
            .into_response()
    });
    handle
        .await
        .unwrap_or_else(|_| internal("the debit's task ended abnormally"))
}

/// `POST /subscribers/{name}/messages/{message_id}`: the idempotent consumer over HTTP.
#[utoipa::path(post, path = "/subscribers/{name}/messages/{message_id}", request_body = Message,
    params(
        ("name" = String, Path, description = "The subscriber (a projection's name)"),
        ("message_id" = String, Path, description = "The transport's message ID"),
    ),
    responses(
        (status = 201, description = "Applied: the account was credited and the ID recorded with it", body = MessageOutcome),
        (status = 200, description = "Duplicate: this subscriber already processed the message; nothing changed", body = MessageOutcome),
        (status = 400, description = "`urn:idem:problem:invalid-body`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "`urn:idem:demo:no-account`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "`urn:idem:problem:in-progress`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 422, description = "`urn:idem:problem:payload-mismatch`: the ID arrived with a different payload", body = ProblemBody, content_type = "application/problem+json"),
        (status = 503, description = "`urn:idem:problem:unavailable`", body = ProblemBody, content_type = "application/problem+json"),
    ))]
async fn post_message<K: Bank>(
    State(app): State<Shared<K>>,
    Path((name, message_id)): Path<(String, String)>,
    body: JsonBody,
) -> Response {
    let prepared = (|| {
        let subscriber = Subscriber::new(name).map_err(|e| bad_request(e.to_string()))?;
        let message_id = MessageId::new(message_id).map_err(|e| bad_request(e.to_string()))?;
        let Message { account, amount } = body.parse().map_err(Problem::from)?;
        if amount <= 0 {
            return Err(bad_request(format!(
                "amount {amount} is not a positive whole number"
            )));
        }
        Ok((subscriber, message_id, account, amount))
    })();
    let (subscriber, message_id, account, amount) = match prepared {
        Ok(p) => p,
        Err(problem) => return problem.into_response(),
    };
    let payload = IdemRequest::new(body.0);
    let task = Arc::clone(&app);
    let handle = app.tasks.spawn(async move {
        let out = task
            .http
            .idem()
            .consume(&subscriber, &message_id, Some(&payload), |tx| {
                let credit = K::credit(tx, account, amount);
                Box::pin(async move { credit.await.map_err(ApiError) })
            })
            .await;
        match out {
            Ok(Consumed::Applied(b)) => (
                StatusCode::CREATED,
                Json(MessageOutcome {
                    outcome: "applied".into(),
                    balance: Some(b.balance),
                }),
            )
                .into_response(),
            Ok(Consumed::Duplicate) => (
                StatusCode::OK,
                Json(MessageOutcome {
                    outcome: "duplicate".into(),
                    balance: None,
                }),
            )
                .into_response(),
            Err(e) => HttpError(e).into_response(),
        }
    });
    handle
        .await
        .unwrap_or_else(|_| internal("the message's task ended abnormally"))
}

/// `POST /orders`: one card-charge order per `Idempotency-Key` (with `--provider`): a
/// phased run that creates the order, charges the provider with a stable provider key
/// and marks the order paid with an `order.paid` outbox message.
#[utoipa::path(post, path = "/orders", request_body = OrderRequest,
    params(
        ("Idempotency-Key" = String, Header, description = "Required: a structured-field string (\"…\") or a bare token, 1 to 255 bytes"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Paid; a replay returns the stored answer with `Idempotent-Replayed: true`", body = OrderBody,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, description = "`urn:idem:problem:invalid-idempotency-key` or `urn:idem:problem:invalid-body`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 401, description = "`urn:idem:problem:unauthenticated`: no bearer token", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "The server was started without `--provider`"),
        (status = 409, description = "`urn:idem:problem:in-progress`: a request with the same key holds the run's lease (or took it over from this one); retry after `Retry-After`", body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 422, description = "`urn:idem:problem:key-reused`: the key was used with a different request; or `urn:idem:demo:order-failed`: the run ended failed (`idem demo complete` abandoned it before the charge), replayed with `Idempotent-Replayed: true`", body = ProblemBody, content_type = "application/problem+json"),
        (status = 502, description = "`urn:idem:demo:provider-unavailable`: the provider failed, timed out or could not be reached; retry with the same key at once (the card is charged at most once)", body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 503, description = "`urn:idem:problem:unavailable`: retries exhausted or connection lost", body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ))]
async fn post_order<K: Bank>(
    State(app): State<Shared<K>>,
    Authenticated(principal): Authenticated,
    IdempotencyKey(key): IdempotencyKey,
    fingerprint: Fingerprint,
    body: JsonBody,
) -> Response {
    let Some(stepper) = app.orders.clone() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let prepared = (|| {
        let OrderRequest { amount } = body.parse().map_err(Problem::from)?;
        if amount <= 0 {
            return Err(bad_request(format!(
                "amount {amount} is not a positive whole number"
            )));
        }
        let operation = orders::operation().map_err(|e| bad_request(e.to_string()))?;
        Ok(Scope::new(principal, operation))
    })();
    let scope = match prepared {
        Ok(p) => p,
        Err(problem) => return problem.into_response(),
    };
    let request = fingerprint.request(&body.0, &BodyFields::All);
    let task = Arc::clone(&app);
    let handle = app.tasks.spawn(async move {
        let out = task
            .http
            .idem()
            .execute_phased(&scope, &key, &request, orders::step::<K>(stepper))
            .await;
        orders::answer(out)
    });
    handle
        .await
        .unwrap_or_else(|_| internal("the order's task ended abnormally"))
}

/// `GET /openapi.json`: this API, generated from the handlers above.
#[utoipa::path(get, path = "/openapi.json",
    responses((status = 200, description = "This OpenAPI 3.1 document", content_type = "application/json")))]
async fn openapi() -> Response {
    match ApiDoc::openapi().to_pretty_json() {
        Ok(text) => ([(header::CONTENT_TYPE, "application/json")], text).into_response(),
        Err(e) => internal(&format!("cannot render the OpenAPI document: {e}")),
    }
}

struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Demo convention: the token is the principal's name (`account-1`)",
                    ))
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "idem demo serve: the demo bank over HTTP", description = "Idempotent debits with the Idempotency-Key header, on any SQL engine idem supports. See docs/http.md."),
    paths(put_account, get_account, post_debit, post_message, post_order, openapi),
    components(schemas(Account, SetBalance, Debit, BalanceBody, Message, MessageOutcome, OrderRequest, OrderBody, ProblemBody)),
    modifiers(&BearerScheme)
)]
struct ApiDoc;

/// Puts the bearer token into the request extensions as the principal; without one
/// (or with a token that is not a valid principal) the request is refused with 401.
async fn bearer(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    match token.map(Principal::new) {
        Some(Ok(principal)) => {
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        other => {
            let detail = match other {
                Some(Err(e)) => e.to_string(),
                _ => "send `Authorization: Bearer <principal>` (demo convention)".to_owned(),
            };
            let mut response = Problem::new(
                StatusCode::UNAUTHORIZED,
                types::UNAUTHENTICATED,
                "Authentication required",
            )
            .with_detail(detail)
            .into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
    }
}

fn router<K: Bank>(app: Shared<K>) -> Router {
    let mut authenticated = Router::new().route("/accounts/{id}/debits", post(post_debit::<K>));
    if app.orders.is_some() {
        authenticated = authenticated.route("/orders", post(post_order::<K>));
    }
    let debits = authenticated.route_layer(middleware::from_fn(bearer));
    Router::new()
        .route(
            "/accounts/{id}",
            put(put_account::<K>).get(get_account::<K>),
        )
        .route(
            "/subscribers/{name}/messages/{message_id}",
            post(post_message::<K>),
        )
        .merge(debits)
        .route("/openapi.json", get(openapi))
        .with_state(app)
}

/// A namespace is a schema, database, user or file name on every engine: a lowercase
/// letter, then lowercase letters, digits or `_`, at most 48 characters.
fn check_namespace(ns: &str) -> Result<(), Fail> {
    let mut chars = ns.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if first_ok && rest_ok && ns.len() <= 48 {
        Ok(())
    } else {
        Err(Fail::new(
            crate::fail::INVALID_INPUT,
            format!(
                "invalid namespace {ns:?}: use a lowercase letter, then lowercase letters, digits \
                 or '_' (at most 48 characters)"
            ),
        ))
    }
}

pub(crate) async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
}

/// Runs the server until SIGINT or SIGTERM, then lets in-flight requests and their
/// transactions finish, closes the pool and removes the private namespace, if any.
pub(crate) async fn run<K: Bank>(url: &str, options: Options) -> Result<(), Fail> {
    if let Some(ns) = &options.namespace {
        check_namespace(ns)?;
    }
    let orders = match &options.provider {
        Some(provider) => Some(Stepper::new(
            Some(orders::ProviderClient::new(
                provider,
                options.provider_timeout,
            )?),
            orders::KillHook::from_env()?,
        )),
        None => None,
    };
    let bank = K::connect(url, options.namespace.as_deref()).await?;
    if let Err(e) = bank.setup().await {
        bank.close().await?;
        return Err(e.into());
    }
    let http = HttpIdem::new(
        Idem::new(bank.backend().clone())
            .with_wait_timeout(options.wait)
            .with_lease(options.lease),
    );
    let app = Arc::new(App {
        bank,
        http,
        debit_delay: options.debit_delay,
        orders,
        tasks: TaskTracker::new(),
    });
    let served = async {
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|e| Fail::new(1, format!("cannot listen on {}: {e}", options.listen)))?;
        let local = listener.local_addr()?;
        say!(
            "idem serve: {} listening on http://{local} (Ctrl-C or SIGTERM stops it)",
            K::ENGINE
        );
        axum::serve(listener, router(Arc::clone(&app)))
            .with_graceful_shutdown(shutdown_signal())
            .await
            .map_err(|e| Fail::new(1, format!("server error: {e}")))
    }
    .await;
    app.tasks.close();
    app.tasks.wait().await;
    // axum lets a finished connection task drop its copy of the router a moment after
    // graceful shutdown returns: wait (bounded) for the last copy.
    let mut app = app;
    let mut tries = 0;
    loop {
        match Arc::try_unwrap(app) {
            Ok(app) => {
                app.bank.close().await?;
                break;
            }
            Err(shared) if tries < 100 => {
                app = shared;
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => {
                eprintln!("warning: requests still hold the database; not closed cleanly");
                break;
            }
        }
    }
    say!("idem serve: stopped");
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_plain_names() {
        assert!(check_namespace("idem_http_1").is_ok());
        for bad in ["", "1abc", "A", "a-b", "../x", "a b", &"a".repeat(49)] {
            let err = check_namespace(bad).err().map(|f| (f.code, f.message));
            assert!(
                matches!(&err, Some((2, m)) if m.contains("invalid namespace")),
                "{bad:?}: {err:?}"
            );
        }
    }

    #[test]
    fn the_openapi_document_names_every_route() {
        let doc = ApiDoc::openapi();
        let paths: Vec<_> = doc.paths.paths.keys().cloned().collect();
        assert_eq!(
            paths,
            [
                "/accounts/{id}",
                "/accounts/{id}/debits",
                "/openapi.json",
                "/orders",
                "/subscribers/{name}/messages/{message_id}"
            ]
        );
    }
}
