//! A card charge at a payment provider, made safe to retry: a phased run (the order row,
//! then the provider call with a stable idempotency key, then the order paid), with the
//! `order.paid` message written to the transactional outbox in the last phase and
//! published by one relay pass.
//!
//! The example runs its own fake provider, which charges once per key and loses its
//! first reply: the first attempt fails after the charge, the retry resumes at the last
//! recovery point and gets the same charge back, a third call replays the answer.
//!
//! cargo run -p idem-examples --features http --example phased_outbox

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::ensure;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::post};
use idem::core::runs::OutboxRow;
use idem::sqlite::SqliteBackend;
use idem::sqlite::rusqlite::{self, params};
use idem::{
    Error, Idem, Key, Operation, OutboxStore, Outcome, Outgoing, Principal, Publisher, Request,
    Run, Scope,
};
use serde_json::{Value, json};
use tokio::sync::Mutex;

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("the provider failed: {0}")]
    Provider(String),
    #[error("the run holds an unexpected state: {0}")]
    Corrupt(String),
    #[error(transparent)]
    Db(#[from] rusqlite::Error),
    #[error(transparent)]
    Outbox(#[from] idem::DbError),
}

/// The provider's client: a charge under the provider's own `Idempotency-Key`.
#[derive(Clone)]
struct ProviderClient {
    http: reqwest::Client,
    url: String,
}

impl ProviderClient {
    async fn charge(&self, key: &str, amount: i64) -> Result<String, OrderError> {
        let failed = |e: reqwest::Error| OrderError::Provider(e.to_string());
        let response = self
            .http
            .post(&self.url)
            .header("Idempotency-Key", key)
            .json(&json!({ "amount": amount }))
            .send()
            .await
            .map_err(failed)?;
        if !response.status().is_success() {
            return Err(OrderError::Provider(format!(
                "answered {}",
                response.status()
            )));
        }
        let charge: Value = response.json().await.map_err(failed)?;
        let id = charge["id"]
            .as_str()
            .ok_or(OrderError::Provider("no charge id".into()))?;
        Ok(id.to_owned())
    }
}

/// One step of the order's run, from its last recovery point. `execute_phased` calls it
/// until the run has its answer; a retry after a failure resumes where the run stands.
async fn advance(
    run: &mut Run<SqliteBackend>,
    provider: ProviderClient,
) -> Result<(), Error<OrderError>> {
    let corrupt = |what: &str| Error::Effect(OrderError::Corrupt(what.to_owned()));
    let amount = run.request()["amount"]
        .as_i64()
        .ok_or_else(|| corrupt("no amount"))?;
    println!("  step from {} (resumed: {})", run.point(), run.resumed());
    match run.point() {
        "started" => {
            // Phase 1: the order row, committed with the recovery point and its id.
            run.phase("order_created", move |tx| {
                Box::pin(tx.run(move |c| {
                    c.execute(
                        "INSERT INTO orders (amount, status) VALUES (?1, 'pending')",
                        [amount],
                    )?;
                    Ok::<i64, OrderError>(c.last_insert_rowid())
                }))
            })
            .await?;
        }
        "order_created" => {
            let order: i64 = run
                .state()
                .map_err(Error::Decode)?
                .ok_or_else(|| corrupt("no order id"))?;
            // Outside the database, with a key that is the same for every retry of this run.
            let charge = provider.charge(&run.external_key("charge"), amount).await;
            let charge = charge.map_err(Error::Effect)?;
            let payload = json!({ "order": order, "charge": charge, "amount": amount });
            let paid = Outgoing::new("order.paid", &run.message_id("order.paid"), &payload)?;
            let outbox = run.backend().clone();
            // Phase 2: the order paid, the message in the outbox and the run's answer, in
            // one transaction: the message is published only if this commits.
            run.finish(move |tx| {
                let (outbox, paid, charge) = (outbox.clone(), paid.clone(), charge.clone());
                Box::pin(async move {
                    let id = charge.clone();
                    tx.run(move |c| {
                        c.execute(
                            "UPDATE orders SET status = 'paid', charge_id = ?2 WHERE id = ?1",
                            params![order, id],
                        )
                    })
                    .await?;
                    outbox.enqueue(tx, &paid).await?;
                    Ok::<Value, OrderError>(
                        json!({ "order": order, "charge": charge, "status": "paid" }),
                    )
                })
            })
            .await?;
        }
        other => return Err(corrupt(&format!("unknown recovery point {other:?}"))),
    }
    Ok(())
}

/// The fake provider: `POST /charges` charges once per `Idempotency-Key` (a repeated key
/// gets its first charge back), and loses its reply when asked to.
#[derive(Default)]
struct FakeProvider {
    charges: Mutex<Vec<String>>,
    lose_next_reply: AtomicBool,
}

async fn charge(State(provider): State<Arc<FakeProvider>>, headers: HeaderMap) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut charges = provider.charges.lock().await;
    let n = match charges.iter().position(|k| k == key) {
        Some(n) => n,
        None => {
            charges.push(key.to_owned());
            charges.len() - 1
        }
    };
    if provider.lose_next_reply.swap(false, Ordering::SeqCst) {
        return StatusCode::BAD_GATEWAY.into_response(); // charged, but the client never knows
    }
    (
        StatusCode::CREATED,
        Json(json!({ "id": format!("ch_{}", n + 1) })),
    )
        .into_response()
}

/// An in-process publisher for the relay. In production: `idem::consumer::amqp::AmqpPublisher`
/// or `idem::consumer::nats::NatsPublisher` (features `amqp`, `nats`), or `idem relay`.
struct Printer;

impl Publisher for Printer {
    type Error = Infallible;

    async fn publish(&self, message: &OutboxRow) -> Result<(), Infallible> {
        let (to, id, payload) = (&message.destination, &message.message_id, &message.payload);
        println!("published to {to}: {payload} (message ID {id})");
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let provider = Arc::new(FakeProvider::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/charges", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let app = Router::new()
        .route("/charges", post(charge))
        .with_state(Arc::clone(&provider));
    let server = axum::serve(listener, app).with_graceful_shutdown(async {
        let _ = stopped.await;
    });
    let server = tokio::spawn(server.into_future());

    let idem = Idem::new(SqliteBackend::connect("sqlite::memory:").await?);
    idem.migrate().await?;
    idem.backend()
        .interact(|c| {
            c.execute_batch(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL,
                                      status TEXT NOT NULL, charge_id TEXT)",
            )
        })
        .await?;

    let client = ProviderClient {
        http: reqwest::Client::new(),
        url,
    };
    let scope = Scope::new(Principal::new("shop-1")?, Operation::new("order", 1)?);
    let key = Key::new("order-7")?;
    let request = Request::new(json!({ "amount": 100 }));
    provider.lose_next_reply.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for attempt in 1..=3 {
        let outcome: Result<Outcome<Value>, _> = idem
            .execute_phased(&scope, &key, &request, |run| {
                Box::pin(advance(run, client.clone()))
            })
            .await;
        match &outcome {
            Ok(Outcome::Executed(r)) => println!("attempt {attempt}: executed, {r}"),
            Ok(Outcome::Replayed(r)) => println!("attempt {attempt}: replayed, {r}"),
            Err(e) => println!("attempt {attempt}: {e}"),
        }
        answers.push(outcome);
    }

    // One relay pass publishes the message the last phase committed; a second has nothing.
    let first = idem.relay(&Printer, 100).await?;
    let second = idem.relay(&Printer, 100).await?;
    let _ = stop.send(());
    server.await??;

    let charges = provider.charges.lock().await.len();
    let orders: Vec<(String, Option<String>)> = idem
        .backend()
        .interact(|c| {
            let mut select = c.prepare("SELECT status, charge_id FROM orders")?;
            let rows = select.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })
        .await?;
    println!("charges at the provider: {charges}; orders: {orders:?}");
    ensure!(
        matches!(&answers[0], Err(Error::Effect(OrderError::Provider(_))))
            && matches!(&answers[1], Ok(Outcome::Executed(r)) if r["charge"] == "ch_1")
            && matches!(&answers[2], Ok(Outcome::Replayed(r)) if r["charge"] == "ch_1"),
        "expected a provider failure, then the run finished, then its answer replayed"
    );
    ensure!(
        charges == 1,
        "one charge whatever the retries, not {charges}"
    );
    ensure!(orders == [("paid".to_owned(), Some("ch_1".to_owned()))]);
    ensure!((first.published, second.published) == (1, 0));
    Ok(())
}
