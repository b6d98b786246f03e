//! A debit on MySQL or MariaDB: the effect in idem's transaction, the replay of a retry,
//! and the refusal of a reused key.
//!
//! cargo run -p idem-examples --features mysql --example debit_mysql
//!
//! The server is `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! Everything happens in a database of its own, dropped at the end.

use anyhow::{Context, ensure};
use idem::mysql::mysql_async::prelude::Queryable; // the driver, re-exported
use idem::mysql::mysql_async::{Conn, Opts, OptsBuilder, Pool};
use idem::mysql::{MysqlBackend, MysqlTx};
use idem::{Error, Idem, Key, Operation, Principal, Request, Scope};
use serde_json::{Value, json};

/// The effect, on idem's transaction. Any error type works; here `anyhow`: a deadlock
/// (1213) inside it is still found by its code and the whole transaction retried.
async fn debit(tx: &mut MysqlTx, account: i64, amount: i64) -> anyhow::Result<Value> {
    tx.exec_drop(
        "UPDATE account SET balance = balance - ? WHERE id = ? AND balance >= ?",
        (amount, account, amount),
    )
    .await?;
    anyhow::ensure!(tx.affected_rows() == 1, "insufficient balance");
    let balance: Option<i64> = tx
        .exec_first("SELECT balance FROM account WHERE id = ?", (account,))
        .await?;
    Ok(json!({ "balance": balance }))
}

/// The walkthrough in the database `opts` names; the balance it leaves.
async fn walkthrough(opts: Opts) -> anyhow::Result<i64> {
    let idem = Idem::new(MysqlBackend::connect_with(opts.clone()).await?);
    idem.migrate().await?;
    let mut conn = Conn::new(opts).await?;
    conn.query_drop("CREATE TABLE account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)")
        .await?;
    conn.query_drop("INSERT INTO account VALUES (1, 1000)")
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
    let balance: Option<i64> = conn
        .query_first("SELECT balance FROM account WHERE id = 1")
        .await?;
    conn.disconnect().await?;
    idem.backend().clone().disconnect().await?;
    balance.context("account 1 is gone")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let opts = idem::mysql::parse_url(&url)?;
    let admin = Pool::new(opts.clone());
    let mut conn = admin
        .get_conn()
        .await
        .with_context(|| format!("connecting to {}", idem::redact(&url)))?;
    let database = format!("idem_example_{}", std::process::id());
    conn.query_drop(format!("CREATE DATABASE {database}"))
        .await?;

    let result = walkthrough(OptsBuilder::from_opts(opts).db_name(Some(&database)).into()).await;
    conn.query_drop(format!("DROP DATABASE {database}")).await?;
    drop(conn);
    admin.disconnect().await?;
    let balance = result?;
    println!("balance: {balance}");
    ensure!(balance == 900, "one debit of 100 leaves 900, not {balance}");
    Ok(())
}
