//! A deadlock inside an effect is retried with the same key whatever shape the effect's
//! error type has: `#[error(transparent)]`, `#[from]`, `#[source]`, `anyhow::Error` or
//! `Box<dyn Error + Send + Sync>`. Two calls lock two rows in opposite order; InnoDB
//! picks one as the deadlock victim (1213), and idem must run that call again instead of
//! returning its effect's error.
//! Needs MySQL/MariaDB (`IDEM_MYSQL_URL`, default the local server); fails if unreachable.

#![allow(clippy::unwrap_used)] // test helpers: a failed setup should stop the test loudly

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::PrivateDb;
use idem_core::{EffectError, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use idem_mysql::MysqlTx;
use idem_mysql::mysql_async::{self, prelude::Queryable};

#[derive(Debug, thiserror::Error)]
enum Transparent {
    #[error(transparent)]
    Db(#[from] mysql_async::Error),
}

#[derive(Debug, thiserror::Error)]
enum Wrapped {
    #[error("database: {0}")]
    Db(#[from] mysql_async::Error),
}

#[derive(Debug, thiserror::Error)]
#[error("the debit failed")]
struct Sourced {
    #[source]
    cause: mysql_async::Error,
}

async fn bump(tx: &mut MysqlTx, id: i32) -> Result<(), mysql_async::Error> {
    tx.exec_drop("UPDATE pair SET v = v + 1 WHERE id = ?", (id,))
        .await
}

/// Two calls lock rows 1 and 2 in opposite order on their first attempt, so one of them
/// is a deadlock victim. Both must end `Executed`, the victim after a second attempt.
async fn deadlock_is_retried<E, M>(schema: &str, wrap: fn(mysql_async::Error) -> E)
where
    E: EffectError<M>,
{
    let db = PrivateDb::create(schema).await;
    db.exec("CREATE TABLE pair (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB")
        .await;
    db.exec("INSERT INTO pair VALUES (1, 0), (2, 0)").await;
    let idem = Arc::new(Idem::new(db.backend.clone()));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let attempts = Arc::new(AtomicUsize::new(0));
    let scope = Arc::new(Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("pair", 1).unwrap(),
    ));
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
                idem.execute(
                    &scope,
                    &key,
                    &Request::new(serde_json::json!({"first": first})),
                    move |tx| {
                        attempts.fetch_add(1, Ordering::SeqCst);
                        let attempt = mine.fetch_add(1, Ordering::SeqCst);
                        let barrier = barrier.clone();
                        Box::pin(async move {
                            bump(tx, first).await.map_err(wrap)?;
                            if attempt == 0 {
                                barrier.wait().await;
                            }
                            bump(tx, second).await.map_err(wrap)?;
                            Ok::<_, E>(first)
                        })
                    },
                )
                .await
            })
        })
        .collect();
    for call in calls {
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), call)
            .await
            .expect("hang guard")
            .unwrap();
        match outcome {
            Ok(Outcome::Executed(_)) => {}
            other => panic!("{schema}: expected both calls to execute, got {other:?}"),
        }
    }
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        3,
        "{schema}: the deadlock victim runs its effect a second time"
    );
    assert_eq!(
        db.scalar("SELECT CAST(SUM(v) AS SIGNED) FROM pair").await,
        4
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        2
    );
    println!("{schema}: deadlock victim retried; 3 effect attempts, 2 executed");
    drop(idem);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transparent_wrapper() {
    deadlock_is_retried("effect_transparent", Transparent::Db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_wrapper() {
    deadlock_is_retried("effect_from", Wrapped::Db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_field() {
    deadlock_is_retried("effect_source", |cause| Sourced { cause }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anyhow_error() {
    deadlock_is_retried("effect_anyhow", anyhow::Error::from).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boxed_error() {
    deadlock_is_retried("effect_boxed", |e| {
        Box::new(e) as Box<dyn std::error::Error + Send + Sync>
    })
    .await;
}
