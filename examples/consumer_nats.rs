//! An idempotent consumer on NATS JetStream with its effect on SQLite: each message ID
//! (`Nats-Msg-Id`) is recorded in the transaction of its credit, and acknowledged only
//! after the commit. The example creates a stream, publishes a few messages (a duplicate
//! and bad ones on purpose), consumes until idle, prints each decision, then deletes
//! its stream.
//!
//! cargo run -p idem-examples --features nats --example consumer_nats
//!
//! The server is `IDEM_NATS_URL` (default `nats://127.0.0.1:4222`).

use std::time::Duration;

use anyhow::{Context, ensure};
use idem::consumer::async_nats::HeaderMap;
use idem::consumer::async_nats::jetstream::{self, stream};
use idem::consumer::nats::{MSG_ID_HEADER, NatsConfig, connect, run};
use idem::consumer::{CancellationToken, Consumer, Decision, Event, Handler, Options, Stats};
use idem::sqlite::rusqlite::{self, OptionalExtension};
use idem::sqlite::{SqliteBackend, SqliteTx};
use idem::{BoxFuture, Idem, Request, Subscriber};
use serde_json::json;

/// JetStream itself drops a message published again with the same `Nats-Msg-Id` inside
/// the stream's duplicate window (2 minutes by default; short here): idem recognises the
/// copies published later, and every redelivery.
const DUPLICATE_WINDOW: Duration = Duration::from_millis(200);

#[derive(Clone)]
struct Credit {
    account: i64,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum CreditError {
    #[error("no account {0}")]
    NoAccount(i64),
    #[error(transparent)]
    Db(#[from] rusqlite::Error),
}

struct Credits;

impl Handler<SqliteBackend> for Credits {
    type Message = Credit;
    type Response = i64;
    type Error = CreditError;

    /// The message and the canonical payload stored with its ID (a redelivery must
    /// repeat it). An `Err` dead-letters the message as `malformed-body`.
    fn decode(&self, body: &[u8]) -> Result<(Credit, Request), String> {
        let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let (Some(account), Some(amount)) = (v["account"].as_i64(), v["amount"].as_i64()) else {
            return Err("expected {\"account\": N, \"amount\": N}".into());
        };
        if amount <= 0 {
            return Err(format!("amount {amount} is not positive"));
        }
        let payload = Request::new(json!({ "account": account, "amount": amount }));
        Ok((Credit { account, amount }, payload))
    }

    /// The effect, in the transaction that also stores (subscriber, message ID).
    fn apply<'t>(
        &self,
        tx: &'t mut SqliteTx,
        c: Credit,
    ) -> BoxFuture<'t, Result<i64, CreditError>> {
        Box::pin(tx.run(move |conn| {
            conn.query_row(
                "UPDATE account SET balance = balance + ?2 WHERE id = ?1 RETURNING balance",
                [c.account, c.amount],
                |row| row.get(0),
            )
            .optional()?
            .ok_or(CreditError::NoAccount(c.account))
        }))
    }

    /// Called with each decision, before the broker is told.
    fn observe(&self, event: &Event<'_>) {
        let id = event.message_id.unwrap_or("(no message ID)");
        match event.decision {
            Decision::Applied => println!("{id}: applied"),
            Decision::Duplicate => println!("{id}: duplicate, acknowledged without effect"),
            Decision::DeadLetter { reason, detail } => {
                println!("{id}: dead-lettered, {reason}: {detail}")
            }
            Decision::Redeliver { detail } => println!("{id}: returned for redelivery: {detail}"),
            other => println!("{id}: {other:?}"),
        }
    }
}

/// Publishes through JetStream with a message ID; `false` when the stream dropped the
/// message as a duplicate inside its window.
async fn publish(
    js: &jetstream::Context,
    subject: &str,
    id: &str,
    body: String,
) -> anyhow::Result<bool> {
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID_HEADER, id);
    let ack = js
        .publish_with_headers(subject.to_owned(), headers, body.into())
        .await?
        .await?;
    let what = if ack.duplicate {
        "dropped by the stream, a duplicate inside its window"
    } else {
        "stored"
    };
    println!("published {id}: {what}");
    Ok(!ack.duplicate)
}

/// Publishes the test messages and consumes them until idle.
async fn publish_and_consume(
    js: &jetstream::Context,
    idem: Idem<SqliteBackend>,
    config: &NatsConfig,
    subject: &str,
) -> anyhow::Result<Stats> {
    let credit = |amount: i64| json!({ "account": 1, "amount": amount }).to_string();
    ensure!(publish(js, subject, "credit-1", credit(50)).await?);
    ensure!(!publish(js, subject, "credit-1", credit(50)).await?);
    publish(js, subject, "credit-2", credit(25)).await?;
    let unknown = json!({ "account": 99, "amount": 10 }).to_string();
    publish(js, subject, "credit-3", unknown).await?;
    publish(js, subject, "credit-4", "not json".to_owned()).await?;
    tokio::time::sleep(DUPLICATE_WINDOW * 3).await;
    // After the window: the stream keeps these copies, idem tells them apart.
    ensure!(publish(js, subject, "credit-1", credit(50)).await?);
    publish(js, subject, "credit-2", credit(26)).await?;

    let consumer = Consumer::new(idem, Subscriber::new("balance-projection")?, Credits)
        .with_options(Options::default().max_idle(Some(Duration::from_secs(1))));
    Ok(run(&consumer, config, CancellationToken::new()).await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let idem = Idem::new(SqliteBackend::connect("sqlite::memory:").await?);
    idem.migrate().await?;
    idem.backend()
        .interact(|c| {
            c.execute_batch(
                "CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
                 INSERT INTO account VALUES (1, 1000);",
            )
        })
        .await?;

    // A stream of its own: credits come in on one subject, dead letters go to another
    // that the consumer's filter leaves out.
    let js = connect(&url)
        .await
        .with_context(|| format!("connecting to {}", idem::redact(&url)))?;
    let name = format!("idem-example-{}", std::process::id());
    let (credits, dead_letters) = (format!("{name}.credits"), format!("{name}.dead-letter"));
    let stream_name = name.replace('-', "_").to_uppercase();
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![credits.clone(), dead_letters.clone()],
        duplicate_window: DUPLICATE_WINDOW,
        ..Default::default()
    })
    .await?;
    let config = NatsConfig::new(&url, &stream_name, "balance-projection")
        .filter_subject(Some(credits.clone()))
        .dead_letter_subject(dead_letters);
    let consumed = publish_and_consume(&js, idem.clone(), &config, &credits).await;
    js.delete_stream(&stream_name).await?;
    let stats = consumed?;
    println!("{stats}");

    let balance: i64 = idem
        .backend()
        .interact(|c| c.query_row("SELECT balance FROM account WHERE id = 1", [], |r| r.get(0)))
        .await?;
    println!("balance: {balance}");
    ensure!(
        (
            stats.applied,
            stats.duplicates,
            stats.dead_lettered,
            stats.returned
        ) == (2, 1, 3, 0),
        "expected 2 applied, 1 duplicate, 3 dead letters: {stats}"
    );
    ensure!(
        balance == 1075,
        "credits of 50 and 25 leave 1075, not {balance}"
    );
    Ok(())
}
