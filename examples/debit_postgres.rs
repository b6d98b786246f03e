//! A debit on PostgreSQL: the effect in idem's transaction, the replay of a retry, and
//! the refusal of a reused key.
//!
//! cargo run -p idem-examples --features postgres --example debit_postgres
//!
//! The server is `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
//! Everything happens in a schema of its own, dropped at the end.

use std::str::FromStr;

use anyhow::{Context, ensure};
use idem::postgres::sqlx::postgres::{PgConnectOptions, PgPool};
use idem::postgres::sqlx::{self, AssertSqlSafe};
use idem::postgres::{PgBackend, PgTx};
use idem::{Error, Idem, Key, Operation, Principal, Request, Scope};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
enum DebitError {
    #[error("insufficient balance")]
    Insufficient,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The effect: plain sqlx on idem's transaction, so it commits with the record.
async fn debit(tx: &mut PgTx, account: i64, amount: i64) -> Result<Value, DebitError> {
    let balance: Option<i64> = sqlx::query_scalar(
        "UPDATE account SET balance = balance - $2 WHERE id = $1 AND balance >= $2 RETURNING balance",
    )
    .bind(account)
    .bind(amount)
    .fetch_optional(&mut **tx)
    .await?;
    balance
        .map(|b| json!({ "balance": b }))
        .ok_or(DebitError::Insufficient)
}

/// The walkthrough; the balance it leaves.
async fn walkthrough(idem: &Idem<PgBackend>) -> anyhow::Result<i64> {
    idem.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE account (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO account VALUES (1, 1000);",
    )
    .execute(idem.backend().pool())
    .await?;

    let scope = Scope::new(Principal::new("account-1")?, Operation::new("debit", 1)?);
    let key = Key::new("checkout-42")?;
    let request = Request::new(json!({ "account": 1, "amount": 100 }));
    for (attempt, replayed) in [("first call", false), ("retry", true)] {
        let outcome = idem
            .execute(&scope, &key, &request, |tx| Box::pin(debit(tx, 1, 100)))
            .await?;
        let how = if outcome.is_replayed() {
            "replayed"
        } else {
            "executed"
        };
        println!("{attempt}: {how}, {}", outcome.response());
        ensure!(outcome.is_replayed() == replayed && outcome.response()["balance"] == 900);
    }
    let other = Request::new(json!({ "account": 1, "amount": 101 }));
    match idem
        .execute(&scope, &key, &other, |tx| Box::pin(debit(tx, 1, 101)))
        .await
    {
        Err(Error::KeyReused { stored, .. }) => {
            println!("amount 101: refused, key used for {stored}")
        }
        other => anyhow::bail!("expected the reused key to be refused, got {other:?}"),
    }
    let balance = sqlx::query_scalar("SELECT balance FROM account WHERE id = 1")
        .fetch_one(idem.backend().pool())
        .await?;
    Ok(balance)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let options = PgConnectOptions::from_str(&url)?;
    let admin = PgPool::connect_with(options.clone())
        .await
        .with_context(|| format!("connecting to {}", idem::redact(&url)))?;
    let schema = format!("idem_example_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;

    // idem's tables and the account table in that schema: the search path of every
    // connection of idem's pool.
    let options = options.options([("search_path", schema.as_str())]);
    let result = match PgBackend::connect_with(options, 4).await {
        Ok(backend) => walkthrough(&Idem::new(backend)).await,
        Err(e) => Err(e.into()),
    };
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await?;
    let balance = result?;
    println!("balance: {balance}");
    ensure!(balance == 900, "one debit of 100 leaves 900, not {balance}");
    Ok(())
}
