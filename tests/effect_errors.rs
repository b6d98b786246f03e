//! A deadlock inside an effect is retried with the same key whatever shape the effect's
//! error type has: `#[error(transparent)]`, `#[from]`, `#[source]`, `anyhow::Error` or
//! `Box<dyn Error + Send + Sync>` around the driver's own error.
//!
//! Two calls lock two rows in opposite order, so the engine picks one as the deadlock
//! victim (PostgreSQL 40P01, InnoDB 1213). idem must find the code inside the effect's
//! error, roll back, and run that call again: both calls end `Executed`, after at least
//! three effect attempts in all. Trials are named `effect_errors::<engine>::<shape>`.
//! Needs PostgreSQL and MySQL/MariaDB (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`); an
//! unreachable server fails the trial.

#![allow(clippy::unwrap_used)] // test code: a broken setup should stop loudly

use std::error::Error as StdError;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::core::serde_json::json;
use idem::core::{
    Backend, BoxFuture, EffectError, Idem, Key, Operation, Outcome, Principal, Request, Scope,
};
use idem::mysql::mysql_async::{self, prelude::Queryable};
use idem::postgres::sqlx;
use idem_conformance::harness::namespace;
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::{Bank, Target};
use libtest_mimic::{Arguments, Failed, Trial};

/// A table of two rows, written through the engine's own driver.
trait Pair: Bank {
    /// The driver's error type.
    type Driver: StdError + Send + Sync + 'static;

    /// Creates `pair` with rows 1 and 2 at 0.
    fn create(&self) -> BoxFuture<'_, Result<(), Failed>>;

    /// Adds 1 to row `id` inside idem's transaction.
    fn bump(tx: &mut <Self::B as Backend>::Tx, id: i32) -> BoxFuture<'_, Result<(), Self::Driver>>;

    /// The sum of both rows, read outside any idem transaction.
    fn sum(&self) -> BoxFuture<'_, Result<i64, Failed>>;
}

impl Pair for PgBank {
    type Driver = sqlx::Error;

    fn create(&self) -> BoxFuture<'_, Result<(), Failed>> {
        Box::pin(async move {
            sqlx::raw_sql(
                "CREATE TABLE pair (id int PRIMARY KEY, v int NOT NULL); \
                 INSERT INTO pair VALUES (1, 0), (2, 0)",
            )
            .execute(self.backend().pool())
            .await
            .map_err(|e| Failed::from(e.to_string()))
            .map(drop)
        })
    }

    fn bump(tx: &mut idem::postgres::PgTx, id: i32) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("UPDATE pair SET v = v + 1 WHERE id = $1")
                .bind(id)
                .execute(&mut **tx)
                .await
                .map(drop)
        })
    }

    fn sum(&self) -> BoxFuture<'_, Result<i64, Failed>> {
        Box::pin(async move {
            sqlx::query_scalar("SELECT sum(v)::bigint FROM pair")
                .fetch_one(self.backend().pool())
                .await
                .map_err(|e| Failed::from(e.to_string()))
        })
    }
}

impl Pair for MysqlBank {
    type Driver = mysql_async::Error;

    fn create(&self) -> BoxFuture<'_, Result<(), Failed>> {
        Box::pin(async move {
            let mut conn = self.backend().pool().get_conn().await?;
            conn.query_drop("CREATE TABLE pair (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB")
                .await?;
            conn.query_drop("INSERT INTO pair VALUES (1, 0), (2, 0)")
                .await?;
            Ok(())
        })
    }

    fn bump(
        tx: &mut idem::mysql::MysqlTx,
        id: i32,
    ) -> BoxFuture<'_, Result<(), mysql_async::Error>> {
        Box::pin(async move {
            tx.exec_drop("UPDATE pair SET v = v + 1 WHERE id = ?", (id,))
                .await
        })
    }

    fn sum(&self) -> BoxFuture<'_, Result<i64, Failed>> {
        Box::pin(async move {
            let mut conn = self.backend().pool().get_conn().await?;
            let sum: Option<i64> = conn
                .query_first("SELECT CAST(SUM(v) AS SIGNED) FROM pair")
                .await?;
            sum.ok_or_else(|| Failed::from("no sum"))
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum Transparent<D: StdError + 'static> {
    #[error(transparent)]
    Db(#[from] D),
}

#[derive(Debug, thiserror::Error)]
enum Wrapped<D: StdError + 'static> {
    #[error("database: {0}")]
    Db(#[from] D),
}

#[derive(Debug, thiserror::Error)]
#[error("the debit failed")]
struct Sourced<D: StdError + 'static> {
    #[source]
    cause: D,
}

/// Two calls lock rows 1 and 2 in opposite order on their first attempt; one is the
/// deadlock victim. Both must end `Executed`, the victim after another attempt, each
/// effect committed once.
async fn deadlock_is_retried<K, E, M>(bank: &K, wrap: fn(K::Driver) -> E) -> Result<(), Failed>
where
    K: Pair,
    E: EffectError<M>,
{
    bank.create().await?;
    let idem = Arc::new(Idem::new(bank.backend().clone()));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let attempts = Arc::new(AtomicUsize::new(0));
    let scope = Arc::new(Scope::new(Principal::new("p")?, Operation::new("pair", 1)?));
    let calls: Vec<_> = [(1, 2), (2, 1)]
        .into_iter()
        .map(|(first, second)| {
            let (idem, barrier, attempts, scope) = (
                idem.clone(),
                barrier.clone(),
                attempts.clone(),
                scope.clone(),
            );
            tokio::spawn(async move {
                let mine = Arc::new(AtomicUsize::new(0));
                let key = Key::new(format!("k{first}")).unwrap();
                let request = Request::new(json!({ "first": first }));
                idem.execute(&scope, &key, &request, move |tx| {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    let attempt = mine.fetch_add(1, Ordering::SeqCst);
                    let barrier = barrier.clone();
                    Box::pin(async move {
                        K::bump(tx, first).await.map_err(wrap)?;
                        if attempt == 0 {
                            barrier.wait().await;
                        }
                        K::bump(tx, second).await.map_err(wrap)?;
                        Ok::<_, E>(first)
                    })
                })
                .await
            })
        })
        .collect();
    for call in calls {
        let outcome = tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .map_err(|_| "hang guard: a call did not end within 60 s")??;
        match outcome {
            Ok(Outcome::Executed(_)) => {}
            other => return Err(format!("expected both calls to execute, got {other:?}").into()),
        }
    }
    // Three at least: both first attempts and the victim's retry. A quick retry may
    // deadlock with the winner once more (4 attempts: once in a CI run and once in five
    // runs by hand, PostgreSQL 15.20, the trials in parallel), so more are allowed, as the
    // module's documentation says; the sum and the records below still show each effect
    // committed exactly once.
    let attempts = attempts.load(Ordering::SeqCst);
    if attempts < 3 {
        return Err(
            format!("{attempts} effect attempts; the deadlock victim must have run again").into(),
        );
    }
    let sum = bank.sum().await?;
    let records = bank.count_records().await?;
    if (sum, records) != (4, 2) {
        return Err(format!("sum {sum} (want 4), records {records} (want 2)").into());
    }
    println!(
        "{}: deadlock victim retried: {attempts} effect attempts, 2 executed, sum 4",
        K::ENGINE
    );
    Ok(())
}

type Shape<K> = fn(&K) -> BoxFuture<'_, Result<(), Failed>>;

fn shapes<K: Pair>() -> [(&'static str, Shape<K>); 5] {
    [
        ("transparent", |b| {
            Box::pin(deadlock_is_retried(b, Transparent::Db))
        }),
        ("from", |b| Box::pin(deadlock_is_retried(b, Wrapped::Db))),
        ("source", |b| {
            Box::pin(deadlock_is_retried(b, |cause| Sourced { cause }))
        }),
        ("anyhow", |b| {
            Box::pin(deadlock_is_retried(b, anyhow::Error::from))
        }),
        ("boxed", |b| {
            Box::pin(deadlock_is_retried(b, |e| {
                Box::new(e) as Box<dyn StdError + Send + Sync>
            }))
        }),
    ]
}

fn trials<K: Pair>(target: &Target, rt: &Arc<tokio::runtime::Runtime>) -> Vec<Trial> {
    shapes::<K>()
        .into_iter()
        .map(|(shape, run)| {
            let name = format!("effect_errors::{}::{shape}", K::ENGINE);
            match target {
                Target::Skip(reason) => {
                    eprintln!("SKIPPED {name}: {reason}");
                    Trial::test(name, || Ok(())).with_ignored_flag(true)
                }
                Target::Url(url) => {
                    let (url, rt) = (url.clone(), Arc::clone(rt));
                    Trial::test(name, move || {
                        rt.block_on(async {
                            let ns = namespace(&format!("effect_{shape}"));
                            let bank = K::connect(&url, Some(&ns))
                                .await
                                .map_err(|e| format!("cannot connect to {}: {e}", K::ENGINE))?;
                            bank.setup().await?;
                            let result = run(&bank).await;
                            if let Err(e) = bank.close().await {
                                eprintln!("warning: cleanup of {ns} failed: {e}");
                            }
                            result
                        })
                    })
                }
            }
        })
        .collect()
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    );
    let mut all = trials::<PgBank>(
        &Target::required(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        &rt,
    );
    all.extend(trials::<MysqlBank>(
        &Target::required("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        &rt,
    ));
    libtest_mimic::run(&args, all).exit_code()
}
