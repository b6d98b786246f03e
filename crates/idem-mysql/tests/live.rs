//! Live checks of the backend beyond the shared conformance cases: concurrent
//! migrators, the `mariadb://` alias, the lost-transaction guard, and errors.
//!
//! Needs the server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`);
//! fails if it is unreachable.

mod common;

use std::io;

use idem_core::{
    Consumed, Error, ErrorKind, Idem, Key, Maintenance, MessageId, Operation, Outcome, Principal,
    Request, Scope, Subscriber,
};
use idem_mysql::MysqlBackend;
use idem_mysql::mysql_async::{self, prelude::Queryable};

use common::PrivateDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrators_apply_each_version_once() {
    let db = PrivateDb::create_unmigrated("migrate").await;
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let backend = db.backend.clone();
            tokio::spawn(async move { backend.migrate().await })
        })
        .collect();
    let mut applied = Vec::new();
    for task in tasks {
        applied.extend(
            task.await
                .expect("task")
                .expect("a concurrent migrator failed"),
        );
    }
    applied.sort_unstable();
    assert_eq!(
        applied,
        vec![1, 2, 3, 4, 5],
        "each version applied exactly once"
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_schema_migrations")
            .await,
        5
    );
    assert_eq!(
        db.backend.migrate().await.expect("re-run"),
        Vec::<u32>::new()
    );
    assert_eq!(
        db.scalar(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() \
             AND table_name IN ('idem_request_result', 'idem_processed_message', 'idem_run', \
             'idem_outbox')"
        )
        .await,
        4
    );
    // 0005 dropped the claim-time indexes; the purge reads by expires_at.
    let claim_time_indexes = "SELECT COUNT(*) FROM information_schema.statistics \
        WHERE table_schema = DATABASE() AND index_name IN \
        ('idem_request_result_created_at', 'idem_processed_message_processed_at')";
    assert_eq!(db.scalar(claim_time_indexes).await, 0);
    // A run interrupted after 0005's first DROP INDEX (each DDL statement commits on its
    // own): the re-run meets an index that is already gone and still converges.
    let mut conn = db.backend.pool().get_conn().await.expect("connection");
    conn.query_drop(
        "ALTER TABLE idem_processed_message ADD KEY idem_processed_message_processed_at (processed_at)",
    )
    .await
    .expect("put one index back");
    conn.query_drop("DELETE FROM idem_schema_migrations WHERE version = 5")
        .await
        .expect("forget 0005");
    drop(conn);
    assert_eq!(db.backend.migrate().await.expect("re-run of 0005"), vec![5]);
    assert_eq!(db.scalar(claim_time_indexes).await, 0);
    db.drop_database().await;
}

#[tokio::test]
async fn mariadb_scheme_is_an_alias() {
    let url = common::url();
    let Some(rest) = url.strip_prefix("mysql://") else {
        panic!("IDEM_MYSQL_URL must start with mysql:// for this test: {url}");
    };
    let backend = MysqlBackend::connect(&format!("mariadb://{rest}"))
        .await
        .expect("mariadb:// connects");
    let mut conn = backend.pool().get_conn().await.expect("connection");
    let one: Option<i64> = conn.query_first("SELECT 1").await.expect("SELECT 1");
    assert_eq!(one, Some(1));
    drop(conn);
    backend.disconnect().await.expect("disconnect");
}

#[tokio::test]
async fn an_unreachable_server_is_a_connection_error() {
    // Port 1 on the loopback interface: nothing listens there.
    let err = MysqlBackend::connect("mysql://root@127.0.0.1:1/test")
        .await
        .expect_err("nothing listens on port 1");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
}

fn other(message: &str) -> mysql_async::Error {
    mysql_async::Error::Other(Box::new(io::Error::other(message.to_owned())))
}

/// An effect that ends the transaction itself (what the server does on a deadlock the
/// effect then swallows) must not be reported as a success, and no record may remain.
#[tokio::test]
async fn a_transaction_lost_inside_the_effect_is_not_a_success() {
    let db = PrivateDb::create("lost").await;
    let idem = Idem::new(db.backend.clone());
    let scope = Scope::new(
        Principal::new("account-1").expect("principal"),
        Operation::new("debit", 1).expect("operation"),
    );
    let key = Key::new("k-lost").expect("key");
    let out = idem
        .execute(
            &scope,
            &key,
            &Request::new(serde_json::json!({"amount": 1})),
            |tx| {
                Box::pin(async move {
                    tx.query_drop("ROLLBACK").await?;
                    Ok::<_, mysql_async::Error>(1)
                })
            },
        )
        .await;
    match out {
        Err(Error::Backend(e)) => assert_eq!(e.kind(), ErrorKind::Other, "{e}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        0
    );

    let sub = Subscriber::new("projection").expect("subscriber");
    let id = MessageId::new("m-1").expect("message id");
    let out = idem
        .consume(&sub, &id, None, |tx| {
            Box::pin(async move {
                tx.query_drop("ROLLBACK").await?;
                Ok::<_, mysql_async::Error>(())
            })
        })
        .await;
    match out {
        Err(Error::Backend(e)) => assert_eq!(e.kind(), ErrorKind::Other, "{e}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_processed_message")
            .await,
        0
    );

    // The key is still free: an honest effect now executes once and then replays.
    let request = Request::new(serde_json::json!({"amount": 1}));
    let first = idem
        .execute(&scope, &key, &request, |_tx| {
            Box::pin(async { Ok::<_, mysql_async::Error>(7) })
        })
        .await;
    assert!(matches!(first, Ok(Outcome::Executed(7))), "{first:?}");
    let again = idem
        .execute(&scope, &key, &request, |_tx| {
            Box::pin(async { Err::<i64, _>(other("a replay must not run the effect")) })
        })
        .await;
    assert!(matches!(again, Ok(Outcome::Replayed(7))), "{again:?}");
    let consumed = idem
        .consume(&sub, &id, None, |_tx| {
            Box::pin(async { Ok::<_, mysql_async::Error>(()) })
        })
        .await;
    assert!(
        matches!(consumed, Ok(Consumed::Applied(()))),
        "{consumed:?}"
    );
    drop(idem);
    db.drop_database().await;
}

/// An effect's own 1062 is classified by number as a unique violation: not retried, and
/// reported as the effect's error with nothing stored.
#[tokio::test]
async fn effect_errors_are_classified_by_number() {
    let db = PrivateDb::create("classify").await;
    db.exec("CREATE TABLE uniq (id BIGINT PRIMARY KEY) ENGINE=InnoDB")
        .await;
    db.exec("INSERT INTO uniq (id) VALUES (1)").await;
    let idem = Idem::new(db.backend.clone());
    let scope = Scope::new(
        Principal::new("p").expect("principal"),
        Operation::new("op", 1).expect("operation"),
    );
    let request = Request::new(serde_json::json!({}));
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = std::sync::Arc::clone(&runs);
    let out = idem
        .execute(
            &scope,
            &Key::new("dup").expect("key"),
            &request,
            move |tx| {
                r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Box::pin(async move {
                    tx.exec_drop("INSERT INTO uniq (id) VALUES (?)", (1,))
                        .await?;
                    Ok::<_, mysql_async::Error>(())
                })
            },
        )
        .await;
    match out {
        Err(Error::Effect(mysql_async::Error::Server(e))) => assert_eq!(e.code, 1062),
        other => panic!("expected the effect's 1062, got {other:?}"),
    }
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "1062 is not retried"
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        0
    );
    drop(idem);
    db.drop_database().await;
}

/// The foreign-key deadlock between two effects, one of which then *swallows* its 1213
/// and writes on: idem must not report it as a success nor store a record for it, and
/// what it wrote before the deadlock stays rolled back.
async fn swallowing_effect(
    tx: &mut idem_mysql::MysqlTx,
    tag: &str,
    barrier: &tokio::sync::Barrier,
    victims: &std::sync::atomic::AtomicUsize,
) -> Result<(), mysql_async::Error> {
    tx.exec_drop(
        "INSERT INTO sw_child (account_id, tag) VALUES (1, ?)",
        (tag.as_bytes(),),
    )
    .await?;
    barrier.wait().await;
    match tx
        .exec_drop(
            "UPDATE sw_account SET balance = balance - 1 WHERE id = 1",
            (),
        )
        .await
    {
        Ok(()) => Ok(()),
        Err(e) if idem_mysql::error_codes::classify(&e) == ErrorKind::Deadlock => {
            victims.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // The anti-pattern: carry on as if nothing happened.
            tx.exec_drop("INSERT INTO sw_log (tag) VALUES (?)", (tag.as_bytes(),))
                .await
        }
        Err(e) => Err(e),
    }
}

async fn swallow_setup(prefix: &str) -> PrivateDb {
    let db = PrivateDb::create(prefix).await;
    db.exec(
        "CREATE TABLE sw_account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE=InnoDB",
    )
    .await;
    db.exec(
        "CREATE TABLE sw_child (id BIGINT AUTO_INCREMENT PRIMARY KEY, account_id BIGINT NOT NULL, \
         tag VARBINARY(64) NOT NULL, FOREIGN KEY (account_id) REFERENCES sw_account (id)) ENGINE=InnoDB",
    )
    .await;
    db.exec("CREATE TABLE sw_log (tag VARBINARY(64) NOT NULL) ENGINE=InnoDB")
        .await;
    db.exec("INSERT INTO sw_account (id, balance) VALUES (1, 100)")
        .await;
    db
}

async fn swallow_check(db: PrivateDb, table: &str, ok: usize, failed: usize, victims: usize) {
    assert_eq!(
        (ok, failed, victims),
        (1, 1, 1),
        "(succeeded, refused, deadlock victims)"
    );
    // What the effect wrote *after* swallowing the deadlock is outside idem's reach: MariaDB
    // 10.11 runs it in autocommit (observed here), MySQL's manual says it opens a new
    // transaction, which idem then rolls back. Either way the call is refused above and
    // no record is stored for it.
    let after = db.scalar("SELECT COUNT(*) FROM sw_log").await;
    println!("{table}: writes after the swallowed deadlock that committed anyway: {after}");
    assert!(after <= 1);
    assert_eq!(db.scalar("SELECT COUNT(*) FROM sw_child").await, 1);
    assert_eq!(
        db.scalar("SELECT balance FROM sw_account WHERE id = 1")
            .await,
        99
    );
    assert_eq!(db.scalar(&format!("SELECT COUNT(*) FROM {table}")).await, 1);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_swallowed_deadlock_is_refused_requests() {
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    let db = swallow_setup("swreq").await;
    let idem = Arc::new(Idem::new(db.backend.clone()));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let victims = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|tag| {
            let (idem, barrier, victims) = (
                Arc::clone(&idem),
                Arc::clone(&barrier),
                Arc::clone(&victims),
            );
            tokio::spawn(async move {
                let scope = Scope::new(
                    Principal::new("p").expect("principal"),
                    Operation::new("op", 1).expect("operation"),
                );
                let key = Key::new(tag).expect("key");
                idem.execute(
                    &scope,
                    &key,
                    &Request::new(serde_json::json!({})),
                    move |tx| {
                        let (barrier, victims) = (Arc::clone(&barrier), Arc::clone(&victims));
                        Box::pin(
                            async move { swallowing_effect(tx, tag, &barrier, &victims).await },
                        )
                    },
                )
                .await
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        match t.await.expect("task") {
            Ok(Outcome::Executed(())) => ok += 1,
            Err(Error::Backend(e)) if e.kind() == ErrorKind::Other => failed += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    let victims = victims.load(std::sync::atomic::Ordering::SeqCst);
    swallow_check(db, "idem_request_result", ok, failed, victims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_swallowed_deadlock_is_refused_messages() {
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    let db = swallow_setup("swmsg").await;
    let idem = Arc::new(Idem::new(db.backend.clone()));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let victims = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|tag| {
            let (idem, barrier, victims) = (
                Arc::clone(&idem),
                Arc::clone(&barrier),
                Arc::clone(&victims),
            );
            tokio::spawn(async move {
                let sub = Subscriber::new("projection").expect("subscriber");
                let id = MessageId::new(tag).expect("message id");
                idem.consume(&sub, &id, None, move |tx| {
                    let (barrier, victims) = (Arc::clone(&barrier), Arc::clone(&victims));
                    Box::pin(async move { swallowing_effect(tx, tag, &barrier, &victims).await })
                })
                .await
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        match t.await.expect("task") {
            Ok(Consumed::Applied(())) => ok += 1,
            Err(Error::Backend(e)) if e.kind() == ErrorKind::Other => failed += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    let victims = victims.load(std::sync::atomic::Ordering::SeqCst);
    swallow_check(db, "idem_processed_message", ok, failed, victims).await;
}

/// A lock wait timeout (1205) inside the effect is classified by number and the whole
/// transaction retried with the same key; the retry succeeds once the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_wait_timeouts_in_the_effect_are_retried() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let db = PrivateDb::create("lockwait").await;
    db.exec("CREATE TABLE lw (id BIGINT PRIMARY KEY, v BIGINT NOT NULL) ENGINE=InnoDB")
        .await;
    db.exec("INSERT INTO lw (id, v) VALUES (1, 0)").await;

    // Another session holds the row.
    let mut holder = db
        .backend
        .pool()
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .expect("holder");
    holder
        .query_drop("SELECT v FROM lw WHERE id = 1 FOR UPDATE")
        .await
        .expect("lock the row");
    let timed_out = Arc::new(tokio::sync::Notify::new());
    let release = {
        let timed_out = Arc::clone(&timed_out);
        tokio::spawn(async move {
            timed_out.notified().await;
            holder.rollback().await.expect("release");
        })
    };

    let idem = Idem::new(db.backend.clone());
    let scope = Scope::new(
        Principal::new("p").expect("principal"),
        Operation::new("bump", 1).expect("operation"),
    );
    let (runs, timeouts) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, t, n) = (
        Arc::clone(&runs),
        Arc::clone(&timeouts),
        Arc::clone(&timed_out),
    );
    let out = idem
        .execute(
            &scope,
            &Key::new("bump-1").expect("key"),
            &Request::new(serde_json::json!({})),
            move |tx| {
                r.fetch_add(1, Ordering::SeqCst);
                let (t, n) = (Arc::clone(&t), Arc::clone(&n));
                Box::pin(async move {
                    // Session-scoped; the pool resets it when the connection returns.
                    tx.query_drop("SET SESSION innodb_lock_wait_timeout = 1")
                        .await?;
                    let result = tx.query_drop("UPDATE lw SET v = v + 1 WHERE id = 1").await;
                    if let Err(e) = &result
                        && idem_mysql::error_codes::classify(e) == ErrorKind::LockTimeout
                    {
                        t.fetch_add(1, Ordering::SeqCst);
                        n.notify_one();
                    }
                    result.map(|()| 1)
                })
            },
        )
        .await;
    assert!(matches!(out, Ok(Outcome::Executed(1))), "{out:?}");
    release.await.expect("release task");
    assert!(timeouts.load(Ordering::SeqCst) >= 1, "no 1205 happened");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        timeouts.load(Ordering::SeqCst) + 1,
        "every timed-out attempt was retried, and only those"
    );
    assert_eq!(db.scalar("SELECT v FROM lw WHERE id = 1").await, 1);
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        1
    );
    drop(idem);
    db.drop_database().await;
}

/// `max_connections` and `acquire_timeout`, the pool settings every engine takes under
/// the same names: with the only connection held, a call fails with a connection error
/// naming the acquire timeout instead of waiting on.
#[tokio::test]
async fn acquisition_is_bounded_by_the_acquire_timeout() {
    let db = PrivateDb::create("acquire").await;
    let opts = mysql_async::OptsBuilder::from_opts(idem_mysql::parse_url(&common::url()).unwrap())
        .db_name(Some(&db.name));
    let pool =
        idem_core::PoolOptions::new(1).acquire_timeout(std::time::Duration::from_millis(200));
    let small = MysqlBackend::connect_pooled(opts, pool).await.unwrap();
    let held = small.pool().get_conn().await.unwrap();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        small.purge_batch(idem_core::Table::Requests, std::time::Duration::ZERO, 10),
    )
    .await
    .expect("the acquire timeout bounds the wait")
    .expect_err("no free connection");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert!(err.to_string().contains("acquire timeout"), "{err}");
    drop(held);
    assert_eq!(
        small
            .purge_batch(idem_core::Table::Requests, std::time::Duration::ZERO, 10)
            .await
            .unwrap(),
        0,
        "the freed connection serves the next call"
    );
    small.disconnect().await.unwrap();
    db.drop_database().await;
}
