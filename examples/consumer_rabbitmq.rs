//! An idempotent consumer on RabbitMQ with its effect on PostgreSQL: each message ID is
//! recorded in the transaction of its credit, and acknowledged only after the commit.
//! The example publishes a few messages (duplicates and bad ones on purpose), consumes
//! until the queue is idle, prints each decision, then removes its queues and schema.
//!
//! cargo run -p idem-examples --features postgres,amqp --example consumer_rabbitmq
//!
//! The servers are `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`)
//! and `IDEM_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, ensure};
use idem::consumer::amqp::{AmqpConfig, connect, declare_queue, publish_confirmed, run};
use idem::consumer::lapin::BasicProperties;
use idem::consumer::lapin::options::{ConfirmSelectOptions, QueueDeleteOptions};
use idem::consumer::{
    CancellationToken, Consumer, DEFAULT_BROKER_TIMEOUT, Decision, Event, Handler, Options, Stats,
};
use idem::postgres::sqlx::postgres::{PgConnectOptions, PgPool};
use idem::postgres::sqlx::{self, AssertSqlSafe};
use idem::postgres::{PgBackend, PgTx};
use idem::{BoxFuture, Idem, Request, Subscriber};
use serde_json::json;

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
    Db(#[from] sqlx::Error),
}

struct Credits;

impl Handler<PgBackend> for Credits {
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
    fn apply<'t>(&self, tx: &'t mut PgTx, c: Credit) -> BoxFuture<'t, Result<i64, CreditError>> {
        Box::pin(async move {
            let balance: Option<i64> = sqlx::query_scalar(
                "UPDATE account SET balance = balance + $2 WHERE id = $1 RETURNING balance",
            )
            .bind(c.account)
            .bind(c.amount)
            .fetch_optional(&mut **tx)
            .await?;
            balance.ok_or(CreditError::NoAccount(c.account))
        })
    }

    // `on_effect_error` keeps its default: `NoAccount` (no database error inside) is
    // dead-lettered as `effect-rejected`; a lost connection or a deadlock inside `Db`
    // (found by the engine's error code) is returned for redelivery.

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

/// Publishes the test messages, consumes until idle; the counts and the balance.
async fn publish_and_consume(
    backend: PgBackend,
    amqp: &str,
    queue: &str,
) -> anyhow::Result<(Stats, i64)> {
    let idem = Idem::new(backend);
    idem.migrate().await?;
    let pool = idem.backend().pool();
    sqlx::raw_sql(
        "CREATE TABLE account (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO account VALUES (1, 1000);",
    )
    .execute(pool)
    .await?;

    let connection = connect(amqp).await?;
    let channel = connection.create_channel().await?;
    let config = AmqpConfig::new(amqp, queue);
    let consumed: anyhow::Result<Stats> = async {
        declare_queue(&channel, queue).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let credit = |amount: i64| json!({ "account": 1, "amount": amount }).to_string();
        let messages = [
            (Some("credit-1"), credit(50)),
            (Some("credit-1"), credit(50)), // a publisher's retry
            (Some("credit-1"), credit(50)),
            (Some("credit-2"), credit(25)),
            (Some("credit-2"), credit(26)), // the same ID with another payload
            (None, credit(10)),             // no message ID
            (
                Some("credit-3"),
                json!({ "account": 99, "amount": 10 }).to_string(),
            ),
            (Some("credit-4"), "not json".to_owned()),
        ];
        for (id, body) in &messages {
            let mut properties = BasicProperties::default().with_delivery_mode(2);
            if let Some(id) = id {
                properties = properties.with_message_id((*id).into());
            }
            publish_confirmed(
                &connection,
                &channel,
                queue,
                body.as_bytes(),
                properties,
                DEFAULT_BROKER_TIMEOUT,
            )
            .await?;
        }
        println!("published {} messages to {queue}", messages.len());

        let subscriber = Subscriber::new("balance-projection")?;
        let consumer = Consumer::new(idem.clone(), subscriber, Credits)
            .with_options(Options::default().max_idle(Some(Duration::from_secs(1))));
        Ok(run(&consumer, &config, CancellationToken::new()).await?)
    }
    .await;
    for name in [&config.queue, &config.dead_letter_queue] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    connection.close(200, "done".into()).await?;
    let stats = consumed?;
    println!("{stats}");
    let balance = sqlx::query_scalar("SELECT balance FROM account WHERE id = 1")
        .fetch_one(pool)
        .await?;
    Ok((stats, balance))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let amqp = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let options = PgConnectOptions::from_str(&url)?;
    let admin = PgPool::connect_with(options.clone())
        .await
        .with_context(|| format!("connecting to {}", idem::redact(&url)))?;
    let name = format!("idem_example_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {name}")))
        .execute(&admin)
        .await?;

    let options = options.options([("search_path", name.as_str())]);
    let result = match PgBackend::connect_with(options, 4).await {
        Ok(backend) => publish_and_consume(backend, &amqp, &format!("{name}.credits")).await,
        Err(e) => Err(e.into()),
    };
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {name} CASCADE")))
        .execute(&admin)
        .await?;
    let (stats, balance) = result?;
    println!("balance: {balance}");
    ensure!(
        (
            stats.applied,
            stats.duplicates,
            stats.dead_lettered,
            stats.returned
        ) == (2, 2, 4, 0),
        "expected 2 applied, 2 duplicates, 4 dead letters: {stats}"
    );
    ensure!(
        balance == 1075,
        "credits of 50 and 25 leave 1075, not {balance}"
    );
    Ok(())
}
