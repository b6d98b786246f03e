//! The card-charge walkthrough: operation `order:v1`, a phased run with one effect
//! outside the database (a charge at a payment provider).
//!
//! ```text
//!  started ──phase──▶ order_created ──POST {provider}/charges──▶ finish
//!           order row                 Idempotency-Key:           order paid, outbox
//!           (pending)                 run.external_key("charge") `order.paid`, answer
//! ```
//!
//! One step function ([`step`]) drives it, shared by `POST /orders` (`idem demo serve
//! --provider`) and `idem demo complete`. A run stopped anywhere resumes at its last
//! recovery point; the charge is repeated with the same provider key, so the provider
//! returns the first charge instead of charging twice.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idem::axum::problem::types;
use idem::axum::{IDEMPOTENT_REPLAYED, Problem, problem_for};
use idem::core::OperationReport;
use idem::core::runs::STARTED;
use idem::{
    BoxFuture, CompleteReport, Error, Idem, InvalidInput, Operation, OutboxStore, Outcome,
    Outgoing, Run,
};
use idem_conformance::{Bank, BankError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;

use crate::fail::{self, Fail};

/// The operation's stored name.
pub(crate) const OPERATION: &str = "order:v1";
/// The recovery point after the order row committed.
pub(crate) const ORDER_CREATED: &str = "order_created";
/// The outbox destination of a paid order.
pub(crate) const ORDER_PAID: &str = "order.paid";

/// The demo's problem types of `POST /orders`.
pub(crate) mod problem_types {
    /// The provider failed, timed out or could not be reached (502); retry with the key.
    pub(crate) const PROVIDER_UNAVAILABLE: &str = "urn:idem:demo:provider-unavailable";
    /// The run ended with a stored failure (422), replayed to every retry of the key.
    pub(crate) const ORDER_FAILED: &str = "urn:idem:demo:order-failed";
}

/// `order:v1`.
pub(crate) fn operation() -> Result<Operation, InvalidInput> {
    Operation::new("order", 1)
}

/// The body of `POST /orders`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct OrderRequest {
    /// A positive whole amount to charge.
    pub(crate) amount: i64,
}

/// A paid order: the run's stored answer, replayed to every retry of the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub(crate) struct OrderBody {
    /// The order's ID (the engine generated it in the run's first phase).
    pub(crate) order_id: i64,
    /// The provider's charge ID.
    pub(crate) charge_id: String,
    /// `paid`.
    pub(crate) status: String,
}

/// The state committed with `order_created`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Created {
    order_id: i64,
}

/// Why a step could not move a run forward.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OrderError {
    /// The order's SQL failed.
    #[error(transparent)]
    Bank(#[from] BankError),
    /// The provider failed, timed out or could not be reached: the charge's outcome is
    /// unknown until the same provider key is sent again.
    #[error("the payment provider {0}")]
    Provider(String),
    /// `idem demo complete` without `--provider` met a run whose charge may have been made.
    #[error("stopped after its order was created: needs --provider to learn the charge's outcome")]
    NeedsProvider,
    /// A stalled run of an operation this command does not know.
    #[error("no handler for operation {0}")]
    NoHandler(String),
    /// The run's stored request or state does not fit `order:v1`.
    #[error("{0}")]
    Corrupt(String),
}

/// The payment provider's HTTP client.
#[derive(Debug, Clone)]
pub(crate) struct ProviderClient {
    charges: String,
    http: reqwest::Client,
}

impl ProviderClient {
    /// A client for the provider at `base` (an `http://` URL), each call bounded by
    /// `timeout`.
    pub(crate) fn new(base: &str, timeout: Duration) -> Result<Self, Fail> {
        let refused = || {
            Fail::new(
                fail::INVALID_INPUT,
                format!(
                    "--provider {base:?} must be an http:// URL, such as the address \
                     `idem demo fake-provider` prints"
                ),
            )
        };
        let url = reqwest::Url::parse(base).map_err(|_| refused())?;
        if url.scheme() != "http" || url.host_str().is_none() {
            return Err(refused());
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| Fail::new(fail::OTHER, format!("cannot build an HTTP client: {e}")))?;
        Ok(Self {
            charges: format!("{}/charges", base.trim_end_matches('/')),
            http,
        })
    }

    /// Charges `amount` under the provider key `key`; the charge's ID.
    async fn charge(&self, key: &str, amount: i64) -> Result<String, OrderError> {
        let unreachable = |e: reqwest::Error| {
            OrderError::Provider(if e.is_timeout() {
                "did not answer in time".to_owned()
            } else if e.is_connect() {
                "cannot be reached".to_owned()
            } else {
                format!("failed: {e}")
            })
        };
        let response = self
            .http
            .post(&self.charges)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": amount }))
            .send()
            .await
            .map_err(unreachable)?;
        let status = response.status();
        let text = response.text().await.map_err(unreachable)?;
        if !status.is_success() {
            let text: String = text.chars().take(200).collect();
            return Err(OrderError::Provider(format!("answered {status}: {text}")));
        }
        serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_owned))
            .filter(|id| !id.is_empty())
            .ok_or_else(|| OrderError::Provider(format!("answered {status} without a charge id")))
    }
}

/// The points `IDEM_SERVE_KILL_AT` may name.
pub(crate) const KILL_POINTS: [&str; 5] =
    [STARTED, ORDER_CREATED, "charging", "charged", "finished"];

/// The test hook of `idem demo serve`: kill the process (SIGKILL) at recovery points, to
/// show that a crash anywhere charges once. Read from the environment at startup:
/// `IDEM_SERVE_KILL_AT` (comma-separated points), `IDEM_SERVE_KILL_P` (probability each
/// time a listed point is reached, default 1), `IDEM_SERVE_KILL_DELAY_MS` (for
/// `charging`: how long after the provider request started, default 50).
#[derive(Debug, Clone)]
pub(crate) struct KillHook {
    points: Vec<String>,
    probability: f64,
    delay: Duration,
}

impl KillHook {
    /// The hook the environment asks for, if any.
    pub(crate) fn from_env() -> Result<Option<Self>, Fail> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let Some(at) = var("IDEM_SERVE_KILL_AT") else {
            return Ok(None);
        };
        let bad = |what: String| Fail::new(fail::INVALID_INPUT, what);
        let points = at
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                if KILL_POINTS.contains(&p) {
                    Ok(p.to_owned())
                } else {
                    Err(bad(format!(
                        "IDEM_SERVE_KILL_AT: unknown point {p:?}; use {}",
                        KILL_POINTS.join(", ")
                    )))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let probability = match var("IDEM_SERVE_KILL_P") {
            Some(p) => super::provider::parse_probability(&p)
                .map_err(|e| bad(format!("IDEM_SERVE_KILL_P: {e}")))?,
            None => 1.0,
        };
        let delay = match var("IDEM_SERVE_KILL_DELAY_MS") {
            Some(ms) => Duration::from_millis(ms.trim().parse().map_err(|_| {
                bad(format!(
                    "IDEM_SERVE_KILL_DELAY_MS: {ms:?} is not a whole number of milliseconds"
                ))
            })?),
            None => Duration::from_millis(50),
        };
        Ok(Some(Self {
            points,
            probability,
            delay,
        }))
    }

    fn fires(&self, point: &str) -> bool {
        self.points.iter().any(|p| p == point) && fastrand::f64() < self.probability
    }
}

/// SIGKILL to this process, after one line on stderr. Never returns.
fn kill_now(point: &str) -> ! {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "idem serve: killed at {point}");
    let _ = err.flush();
    drop(err);
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status();
    // `kill` could not be run: still never go past the point.
    std::process::abort()
}

/// What a step may use: the provider (none in `idem demo complete` without `--provider`)
/// and the test hook (serve only).
#[derive(Debug, Clone)]
pub(crate) struct Stepper {
    provider: Option<ProviderClient>,
    kill: Option<Arc<KillHook>>,
}

impl Stepper {
    /// A stepper with this provider and test hook.
    pub(crate) fn new(provider: Option<ProviderClient>, kill: Option<KillHook>) -> Self {
        Self {
            provider,
            kill: kill.map(Arc::new),
        }
    }

    fn reached(&self, point: &str) {
        if let Some(hook) = &self.kill
            && hook.fires(point)
        {
            kill_now(point);
        }
    }

    /// For `charging`: a task that kills the process a moment after the provider
    /// request started.
    fn arm_charging(&self) -> Option<tokio::task::JoinHandle<()>> {
        let hook = self.kill.as_ref().filter(|h| h.fires("charging"))?;
        let delay = hook.delay;
        Some(tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            kill_now("charging");
        }))
    }
}

/// The answer a run at `started` gets from `idem demo complete` without `--provider`.
fn abandoned() -> Value {
    json!({"status": "failed", "reason": "abandoned before the charge"})
}

/// The amount in the stored request: `body.amount` (HTTP) or `amount`.
fn stored_amount(request: &Value) -> Option<i64> {
    request
        .pointer("/body/amount")
        .or_else(|| request.get("amount"))
        .and_then(Value::as_i64)
        .filter(|n| *n > 0)
}

/// The step function of `order:v1`: moves a run one recovery point forward, or ends it.
pub(crate) fn step<K: Bank>(
    stepper: Stepper,
) -> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<OrderError>>> + Send {
    move |run| {
        let stepper = stepper.clone();
        Box::pin(async move { advance::<K>(run, &stepper).await })
    }
}

async fn advance<K: Bank>(run: &mut Run<K::B>, stepper: &Stepper) -> Result<(), Error<OrderError>> {
    let operation = run.scope().operation.as_str();
    if operation != OPERATION {
        return Err(Error::Effect(OrderError::NoHandler(operation.to_owned())));
    }
    let amount = stored_amount(run.request()).ok_or_else(|| {
        Error::Effect(OrderError::Corrupt(
            "the stored request has no positive amount".into(),
        ))
    })?;
    let point = run.point().to_owned();
    match point.as_str() {
        STARTED => create_order::<K>(run, stepper, amount).await,
        ORDER_CREATED => charge_order::<K>(run, stepper, amount).await,
        other => Err(Error::Effect(OrderError::Corrupt(format!(
            "unknown recovery point {other:?}"
        )))),
    }
}

/// `started` → `order_created`: the order row, in the phase's transaction. Without a
/// provider (`idem demo complete`) the run ends failed instead: nothing was charged and no
/// order exists.
async fn create_order<K: Bank>(
    run: &mut Run<K::B>,
    stepper: &Stepper,
    amount: i64,
) -> Result<(), Error<OrderError>> {
    if stepper.provider.is_none() {
        run.fail(|_tx| Box::pin(async { Ok::<_, OrderError>(abandoned()) }))
            .await?;
        return Ok(());
    }
    stepper.reached(STARTED);
    let principal = run.scope().principal.as_str().to_owned();
    run.phase(ORDER_CREATED, move |tx| {
        let create = K::create_order(tx, principal.clone(), amount);
        Box::pin(async move {
            Ok::<_, OrderError>(Created {
                order_id: create.await?,
            })
        })
    })
    .await?;
    stepper.reached(ORDER_CREATED);
    Ok(())
}

/// `order_created` → the end: the charge at the provider (with the run's stable
/// provider key), then the order paid, the `order.paid` message and the answer in one
/// transaction.
async fn charge_order<K: Bank>(
    run: &mut Run<K::B>,
    stepper: &Stepper,
    amount: i64,
) -> Result<(), Error<OrderError>> {
    let Created { order_id } = run
        .state::<Created>()
        .map_err(Error::Decode)?
        .ok_or_else(|| {
            Error::Effect(OrderError::Corrupt(
                "the run at order_created has no order id".into(),
            ))
        })?;
    let Some(provider) = &stepper.provider else {
        return Err(Error::Effect(OrderError::NeedsProvider));
    };
    let key = run.external_key("charge");
    let kill = stepper.arm_charging();
    let charged = provider.charge(&key, amount).await;
    if let Some(kill) = kill {
        // The hook kills the process while the reply is held: never go past `charging`.
        let _ = kill.await;
    }
    let charge_id = charged.map_err(Error::Effect)?;
    stepper.reached("charged");
    let message = Outgoing::new(
        ORDER_PAID,
        &run.message_id(ORDER_PAID),
        &json!({
            "order_id": order_id,
            "charge_id": charge_id,
            "amount": amount,
            "principal": run.scope().principal.as_str(),
        }),
    )?;
    let backend = run.backend().clone();
    run.finish(move |tx| {
        let backend = backend.clone();
        let message = message.clone();
        let charge_id = charge_id.clone();
        Box::pin(async move {
            K::pay_order(tx, order_id, charge_id.clone()).await?;
            backend.enqueue(tx, &message).await.map_err(BankError::Db)?;
            Ok::<_, OrderError>(OrderBody {
                order_id,
                charge_id,
                status: "paid".into(),
            })
        })
    })
    .await?;
    stepper.reached("finished");
    Ok(())
}

fn internal() -> Problem {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::INTERNAL,
        "Internal error",
    )
}

fn replayed(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The HTTP answer of `POST /orders`.
pub(crate) fn answer(out: Result<Outcome<OrderBody>, Error<OrderError>>) -> Response {
    match out {
        Ok(Outcome::Executed(body)) => (StatusCode::CREATED, Json(body)).into_response(),
        Ok(Outcome::Replayed(body)) => replayed((StatusCode::CREATED, Json(body)).into_response()),
        Err(Error::StoredRejection(stored)) => {
            let reason = stored
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or("the order failed")
                .to_owned();
            replayed(
                Problem::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    problem_types::ORDER_FAILED,
                    "Order failed",
                )
                .with_detail(reason)
                .with_extension("order", stored)
                .into_response(),
            )
        }
        Err(Error::LeaseLost { .. }) => Problem::new(
            StatusCode::CONFLICT,
            types::IN_PROGRESS,
            "Request in progress",
        )
        .with_detail(
            "this request's run was taken over by a retry with the same key; \
             retry later with the same key to learn its answer",
        )
        .with_retry_after(1)
        .into_response(),
        Err(Error::Effect(OrderError::Provider(what))) => Problem::new(
            StatusCode::BAD_GATEWAY,
            problem_types::PROVIDER_UNAVAILABLE,
            "Payment provider unavailable",
        )
        .with_detail(format!(
            "the payment provider {what}; retry with the same Idempotency-Key \
             (the card is charged at most once)"
        ))
        .with_retry_after(1)
        .into_response(),
        Err(Error::Effect(OrderError::Bank(BankError::Db(e)))) => {
            problem_for::<OrderError>(&Error::Backend(e))
                .unwrap_or_else(internal)
                .into_response()
        }
        Err(Error::Effect(_)) => internal().into_response(),
        Err(e) => problem_for(&e).unwrap_or_else(internal).into_response(),
    }
}

/// `idem demo complete`: one pass of [`Idem::complete`] with the `order:v1` step.
pub(crate) async fn complete<K: Bank>(
    url: &str,
    provider: Option<&str>,
    timeout: Duration,
    lease: Duration,
    limit: u32,
    as_json: bool,
) -> Result<(), Fail> {
    let provider = provider
        .map(|p| ProviderClient::new(p, timeout))
        .transpose()?;
    let bank = crate::commands::connected::<K>(url).await?;
    let report = Idem::new(bank.backend().clone())
        .with_lease(lease)
        .complete(limit, step::<K>(Stepper::new(provider, None)))
        .await;
    bank.close().await?;
    let report = report?;
    if as_json {
        say!("{}", report_json(&report));
    } else {
        crate::out::write(format_args!("{}", report_text(&report)));
    }
    Ok(())
}

fn report_text(report: &CompleteReport) -> String {
    if report.operations.is_empty() {
        return "no stalled runs\n".into();
    }
    let mut out = String::new();
    for (operation, r) in &report.operations {
        out.push_str(&format!(
            "{operation}: succeeded {}, failed {}, busy {}, left {}\n",
            r.succeeded, r.failed, r.busy, r.left
        ));
        for e in &r.errors {
            out.push_str(&format!("  {e}\n"));
        }
    }
    out
}

fn report_json(report: &CompleteReport) -> String {
    let operations: serde_json::Map<String, Value> = report
        .operations
        .iter()
        .map(|(operation, r): (&String, &OperationReport)| {
            (
                operation.clone(),
                json!({
                    "succeeded": r.succeeded,
                    "failed": r.failed,
                    "busy": r.busy,
                    "left": r.left,
                    "errors": r.errors,
                }),
            )
        })
        .collect();
    json!({"found": report.found, "operations": operations}).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_amount_comes_from_the_stored_request() {
        let http =
            json!({"method": "POST", "route": "/orders", "params": {}, "body": {"amount": 250}});
        assert_eq!(stored_amount(&http), Some(250));
        assert_eq!(stored_amount(&json!({"amount": 7})), Some(7));
        assert_eq!(stored_amount(&json!({"body": {"amount": 0}})), None);
        assert_eq!(stored_amount(&json!({})), None);
    }

    #[test]
    fn the_operation_is_order_v1() {
        assert_eq!(operation().unwrap().as_str(), OPERATION);
        assert!(KILL_POINTS.contains(&"charging"));
    }

    #[test]
    fn reports_print_one_line_per_operation() {
        let mut report = CompleteReport {
            found: 3,
            ..CompleteReport::default()
        };
        report.operations.insert(
            OPERATION.into(),
            OperationReport {
                succeeded: 1,
                failed: 1,
                busy: 0,
                left: 1,
                errors: vec!["k: needs --provider".into()],
            },
        );
        assert_eq!(
            report_text(&report),
            "order:v1: succeeded 1, failed 1, busy 0, left 1\n  k: needs --provider\n"
        );
        let v: Value = serde_json::from_str(&report_json(&report)).unwrap();
        assert_eq!(v["found"], 3);
        assert_eq!(v["operations"]["order:v1"]["left"], 1);
        assert_eq!(report_text(&CompleteReport::default()), "no stalled runs\n");
    }

    #[test]
    fn provider_urls_are_checked() {
        let t = Duration::from_secs(1);
        assert!(ProviderClient::new("http://127.0.0.1:8081", t).is_ok());
        assert_eq!(
            ProviderClient::new("http://127.0.0.1:8081/", t)
                .unwrap()
                .charges,
            "http://127.0.0.1:8081/charges"
        );
        for bad in ["127.0.0.1:8081", "ftp://x", "https://x", ""] {
            assert_eq!(
                ProviderClient::new(bad, t).err().map(|f| f.code),
                Some(2),
                "{bad}"
            );
        }
    }
}
