use idem::sqlite::{SqliteBackend, SqliteTx, rusqlite};
use idem::{Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
enum DebitError {
    #[error("insufficient balance")]
    Insufficient,
    #[error(transparent)]
    Db(#[from] rusqlite::Error),
}

/// The effect runs in idem's transaction: its UPDATE commits with the record, or neither.
async fn debit(tx: &mut SqliteTx, account: i64, amount: i64) -> Result<Value, DebitError> {
    tx.run(move |c| {
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
        Ok(json!({ "balance": balance }))
    })
    .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
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

    // The principal comes from authentication, the operation from your code,
    // the key and the business parameters from the client.
    let scope = Scope::new(Principal::new("account-1")?, Operation::new("debit", 1)?);
    let key = Key::new("checkout-42")?;
    let request = Request::new(json!({ "account": 1, "amount": 100 }));

    // The first call runs the effect; the retry gets the stored response, and no effect.
    match idem
        .execute(&scope, &key, &request, |tx| Box::pin(debit(tx, 1, 100)))
        .await?
    {
        Outcome::Executed(r) if r["balance"] == 900 => println!("first call: executed, {r}"),
        other => panic!("expected the debit to run, got {other:?}"),
    }
    match idem
        .execute(&scope, &key, &request, |tx| Box::pin(debit(tx, 1, 100)))
        .await?
    {
        Outcome::Replayed(r) if r["balance"] == 900 => println!("retry: replayed, {r}"),
        other => panic!("expected the stored response, got {other:?}"),
    }

    // The same key with a different request is refused before any effect.
    let other = Request::new(json!({ "account": 1, "amount": 101 }));
    match idem
        .execute(&scope, &key, &other, |tx| Box::pin(debit(tx, 1, 101)))
        .await
    {
        Err(Error::KeyReused { stored, .. }) => {
            println!("amount 101: refused, key used for {stored}")
        }
        other => panic!("expected the reused key to be refused, got {other:?}"),
    }

    // One debit, whatever the retries.
    let balance: i64 = idem
        .backend()
        .interact(|c| c.query_row("SELECT balance FROM account WHERE id = 1", [], |r| r.get(0)))
        .await?;
    println!("balance: {balance}");
    assert_eq!(balance, 900);
    Ok(())
}
