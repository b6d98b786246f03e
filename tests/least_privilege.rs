//! Least privilege: `crates/idem-<engine>/migrations/grants.sql` run live, in a private schema or
//! database, with its roles renamed per run (roles are server-wide) and dropped after.
//! The writer runs the protocol (execute, replay; a phased run with an outbox message and
//! its relay; the relay's retries and dead messages, and an operator's retry) but cannot
//! rewrite, delete or re-key a stored record; the purger purges and drops dead outbox
//! messages but cannot rewrite; the guard holds the owner too.
//! PostgreSQL and MariaDB are required: unreachable fails the test.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use idem::core::runs::OutboxRow;
use idem::core::{
    BoxFuture, Error, Idem, Key, Operation, OutboxStore, Outcome, Outgoing, Principal, Publisher,
    Request, Run, Scope,
};
use idem_conformance::{Balance, Bank};
use serde_json::{Value, json};

/// Refuses everything.
struct Refuse;

impl Publisher for Refuse {
    type Error = std::io::Error;

    async fn publish(&self, _: &OutboxRow) -> Result<(), std::io::Error> {
        Err(std::io::Error::other("refused"))
    }
}

/// Counts what it is asked to publish.
#[derive(Default)]
struct Counter(std::sync::Mutex<Vec<String>>);

impl Publisher for Counter {
    type Error = std::io::Error;

    async fn publish(&self, message: &OutboxRow) -> Result<(), std::io::Error> {
        self.0.lock().unwrap().push(message.message_id.clone());
        Ok(())
    }
}

/// The phased step of [`phased_run_and_outbox`].
fn step<B: OutboxStore>(run: &mut Run<B>) -> BoxFuture<'_, Result<(), Error<std::io::Error>>> {
    Box::pin(async move {
        if run.point() == "started" {
            run.phase("noted", |_tx| {
                Box::pin(async { Ok::<_, std::io::Error>(json!({"noted": true})) })
            })
            .await?;
            return Ok(());
        }
        let message = Outgoing::new("order.paid", &run.message_id("order.paid"), &json!({}))?;
        let backend = run.backend().clone();
        run.finish(move |tx| {
            let (backend, message) = (backend.clone(), message.clone());
            Box::pin(async move {
                backend
                    .enqueue(tx, &message)
                    .await
                    .map_err(std::io::Error::other)?;
                Ok::<_, std::io::Error>(json!({"status": "paid"}))
            })
        })
        .await?;
        Ok(())
    })
}

/// As the writer role: a phased run (start, a phase, a finish that enqueues an outbox
/// message), its replay, and the relay marking the message sent.
async fn phased_run_and_outbox<B: OutboxStore + std::fmt::Debug>(writer: B) {
    let idem = Idem::new(writer);
    let scope = Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("order", 1).unwrap(),
    );
    let key = Key::new("order-1").unwrap();
    let request = Request::new(json!({"amount": 5}));
    let first = idem
        .execute_phased::<Value, _, _>(&scope, &key, &request, step::<B>)
        .await
        .unwrap();
    assert_eq!(first, Outcome::Executed(json!({"status": "paid"})));
    let again = idem
        .execute_phased::<Value, _, _>(&scope, &key, &request, step::<B>)
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(json!({"status": "paid"})));
    let counter = Counter::default();
    let report = idem.relay(&counter, 10).await.unwrap();
    assert_eq!((report.published, report.failed.len()), (1, 0));
    assert_eq!(idem.relay(&counter, 10).await.unwrap().published, 0);
}

/// As the writer: a message the broker refuses is tried again, then dead (the relay's
/// bookkeeping of attempts), listed and retried; as the purger: a dead one dropped.
async fn retries_and_dead_messages<B: OutboxStore + std::fmt::Debug>(writer: B, purger: B) {
    let idem = Idem::new(writer.clone());
    let scope = Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("notify", 1).unwrap(),
    );
    for n in 1..=2 {
        let message = Outgoing::new("refused", &format!("m-{n}"), &json!({})).unwrap();
        let backend = writer.clone();
        idem.execute(
            &scope,
            &Key::new(format!("notify-{n}")).unwrap(),
            &Request::new(json!({ "n": n })),
            move |tx| {
                let (backend, message) = (backend.clone(), message.clone());
                Box::pin(async move {
                    backend.enqueue(tx, &message).await?;
                    Ok::<_, idem::DbError>(json!({}))
                })
            },
        )
        .await
        .unwrap();
    }
    let options = idem::core::RelayOptions {
        max_attempts: 2,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(20),
        ..idem::core::RelayOptions::default()
    };
    let first = idem.relay_with(&Refuse, &options).await.unwrap();
    assert_eq!((first.failed.len(), first.dead), (1, 0), "{first:?}");
    let mut dead = 0;
    for _ in 0..200 {
        dead += idem.relay_with(&Refuse, &options).await.unwrap().dead;
        if dead == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    assert_eq!(dead, 2);
    let listed = idem
        .outbox_list(&idem::core::runs::OutboxFilter::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 2);
    assert!(
        listed.iter().all(|e| e.dead && e.attempts == 2),
        "{listed:?}"
    );
    assert_eq!(idem.outbox_retry(&[listed[0].id], None).await.unwrap(), 1);
    let counter = Counter::default();
    assert_eq!(idem.relay(&counter, 10).await.unwrap().published, 1);
    let dropped = Idem::new(purger).outbox_drop(&[], None).await.unwrap();
    assert_eq!(dropped, 1, "the purger drops the dead one");
    assert_eq!(idem.outbox_stats().await.unwrap().dead, 0);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn suffix() -> String {
    format!("{}_{:08x}", std::process::id(), fastrand::u32(..))
}

/// A test login's password (whatever the server's authentication method, trust or not).
fn password(user: &str) -> String {
    format!("pw-{user}")
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("debit", 1).unwrap(),
    )
}

fn debit_request() -> Request {
    Request::new(json!({"account": 1, "amount": 100}))
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::str::FromStr;

    use idem::postgres::PgBackend;
    use idem::postgres::sqlx::postgres::{PgConnectOptions, PgPool};
    use idem::postgres::sqlx::{self, AssertSqlSafe};
    use idem_conformance::postgres::PgBank;

    use super::*;

    const GRANTS: &str = include_str!("../crates/idem-postgres/migrations/grants.sql");

    fn url() -> String {
        std::env::var("IDEM_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    /// The SQLSTATE of a refused statement (panics if it was not refused).
    async fn refused(pool: &PgPool, sql: &'static str) -> String {
        match sqlx::query(sql).execute(pool).await {
            Ok(done) => panic!("{sql:?} was allowed ({} rows)", done.rows_affected()),
            Err(e) => e
                .as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned())
                .unwrap_or_else(|| panic!("{sql:?} failed without a SQLSTATE: {e}")),
        }
    }

    async fn connect_as(url: &str, user: &str, ns: &str) -> PgBackend {
        let options = PgConnectOptions::from_str(url)
            .unwrap()
            .username(user)
            .password(&password(user))
            .options([("search_path", ns)]);
        PgBackend::connect_with(options, 2).await.unwrap()
    }

    async fn checks(url: &str, ns: &str, owner_db: &PgBackend, writer: &str, purger: &str) {
        let owner = owner_db.pool();
        let writer_db = connect_as(url, writer, ns).await;
        let idem = Idem::new(writer_db.clone());
        let key = Key::new("checkout-42").unwrap();

        // The protocol works as the writer: claim, effect, complete, then replay.
        let first = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                PgBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(first, Outcome::Executed(Balance { balance: 900 }));
        let again = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                PgBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(again, Outcome::Replayed(Balance { balance: 900 }));
        phased_run_and_outbox(writer_db.clone()).await;
        retries_and_dead_messages(writer_db.clone(), connect_as(url, purger, ns).await).await;

        // The writer cannot rewrite the stored response or request, re-key or delete it.
        let w = writer_db.pool();
        let update_response = "UPDATE idem_request_result SET response = '{\"balance\":1}'";
        assert_eq!(refused(w, update_response).await, "42501");
        assert_eq!(
            refused(
                w,
                "UPDATE idem_request_result SET request = '{\"amount\":1}'"
            )
            .await,
            "42501"
        );
        assert_eq!(
            refused(w, "UPDATE idem_request_result SET request_key = 'other'").await,
            "42501"
        );
        assert_eq!(refused(w, "DELETE FROM idem_request_result").await, "42501");
        assert_eq!(refused(w, "TRUNCATE idem_request_result").await, "42501");

        // The purger purges (nothing is old enough) but cannot rewrite either.
        let purger_db = connect_as(url, purger, ns).await;
        let report = Idem::new(purger_db.clone())
            .purge(Duration::from_secs(24 * 3600), 100)
            .await
            .unwrap();
        assert_eq!(report.requests, 0);
        assert_eq!(refused(purger_db.pool(), update_response).await, "42501");
        assert_eq!(
            refused(
                purger_db.pool(),
                "UPDATE idem_request_result SET expires_at = clock_timestamp()"
            )
            .await,
            "42501"
        );

        // The guard holds for the owner too: a live completed record is immutable.
        assert_eq!(refused(owner, update_response).await, "42501");

        // Nothing changed: the stored response still replays.
        let after = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                PgBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(after, Outcome::Replayed(Balance { balance: 900 }));
        let balance: i64 =
            sqlx::query_scalar("SELECT balance FROM idem_demo_account WHERE account_id = 1")
                .fetch_one(owner)
                .await
                .unwrap();
        assert_eq!(balance, 900);

        // An expired record is taken over by the writer (the guard lets it change).
        sqlx::query(
            "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
             VALUES ('account-1', 'debit:v1', 'expired-key', '{\"account\":1,\"amount\":5}', '{\"balance\":1}', 0, \
                     clock_timestamp() - interval '2 days', clock_timestamp() - interval '1 day')",
        )
        .execute(owner)
        .await
        .unwrap();
        let old = Key::new("expired-key").unwrap();
        let taken = idem
            .execute(&scope(), &old, &debit_request(), |tx| {
                PgBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(taken, Outcome::Executed(Balance { balance: 800 }));
        writer_db.pool().close().await;
        purger_db.pool().close().await;
    }

    #[test]
    fn writer_cannot_rewrite_a_stored_response() {
        runtime().block_on(async {
            let url = url();
            let s = suffix();
            let ns = format!("idem_lp_{s}");
            let (writer_role, purger_role) =
                (format!("idem_writer_{s}"), format!("idem_purger_{s}"));
            let (writer, purger) = (format!("idem_w_{s}"), format!("idem_p_{s}"));
            let bank = PgBank::connect(&url, Some(&ns))
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL is required at {url}: {e}"));
            let setup = async {
                bank.setup().await.unwrap();
                bank.set_balance(1, 1000).await.unwrap();
                let owner = bank.backend().pool();
                let script = GRANTS
                    .replace("idem_writer", &writer_role)
                    .replace("idem_purger", &purger_role);
                sqlx::raw_sql(AssertSqlSafe(script))
                    .execute(owner)
                    .await
                    .unwrap();
                // What the application grants on its own table, and the login roles.
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "GRANT SELECT, UPDATE ON idem_demo_account TO {writer_role}; \
                     CREATE ROLE {writer} LOGIN PASSWORD '{}' IN ROLE {writer_role}; \
                     CREATE ROLE {purger} LOGIN PASSWORD '{}' IN ROLE {purger_role};",
                    password(&writer),
                    password(&purger),
                )))
                .execute(owner)
                .await
                .unwrap();
            };
            setup.await;
            // Checks run in a task of their own so a failed assertion still drops the
            // schema and the roles below.
            let owner = bank.backend().clone();
            let result = tokio::spawn({
                let (url, ns, writer, purger) =
                    (url.clone(), ns.clone(), writer.clone(), purger.clone());
                async move { checks(&url, &ns, &owner, &writer, &purger).await }
            })
            .await;
            // Drop the schema (and every grant on it), then the roles.
            bank.close().await.unwrap();
            let admin = PgBackend::connect(&url).await.unwrap();
            for role in [&writer, &purger, &writer_role, &purger_role] {
                sqlx::raw_sql(AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
                    .execute(admin.pool())
                    .await
                    .unwrap();
            }
            if let Err(e) = result {
                std::panic::resume_unwind(e.into_panic());
            }
        });
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use idem::mysql::mysql_async::prelude::Queryable;
    use idem::mysql::mysql_async::{self, OptsBuilder, Pool};
    use idem::mysql::{MysqlBackend, parse_url};
    use idem_conformance::mysql::MysqlBank;

    use super::*;

    const GRANTS: &str = include_str!("../crates/idem-mysql/migrations/grants.sql");

    fn url() -> String {
        std::env::var("IDEM_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
    }

    /// The statements of a mysql-client script: `;`-terminated, with `DELIMITER` lines.
    fn statements(script: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut delimiter = ";".to_owned();
        let mut current = String::new();
        for line in script.lines() {
            if let Some(d) = line.trim().strip_prefix("DELIMITER ") {
                delimiter = d.trim().to_owned();
                continue;
            }
            if line.trim_start().starts_with("--") && current.trim().is_empty() {
                continue;
            }
            current.push_str(line);
            current.push('\n');
            if line.trim_end().ends_with(&delimiter) {
                let statement = current.trim_end().trim_end_matches(&*delimiter).trim();
                if !statement.is_empty() {
                    out.push(statement.to_owned());
                }
                current.clear();
            }
        }
        assert!(
            current.trim().is_empty(),
            "unterminated statement: {current}"
        );
        out
    }

    /// The server error code of a refused statement (panics if it was not refused).
    async fn refused(pool: &Pool, sql: &str) -> u16 {
        let mut conn = pool.get_conn().await.unwrap();
        match conn.query_drop(sql).await {
            Ok(()) => panic!("{sql:?} was allowed ({} rows)", conn.affected_rows()),
            Err(mysql_async::Error::Server(e)) => e.code,
            Err(e) => panic!("{sql:?} failed without a server error: {e}"),
        }
    }

    async fn connect_as(url: &str, user: &str, db: &str) -> MysqlBackend {
        let opts = OptsBuilder::from_opts(parse_url(url).unwrap())
            .user(Some(user))
            .pass(Some(password(user)))
            .db_name(Some(db));
        MysqlBackend::connect_with(opts).await.unwrap()
    }

    async fn checks(url: &str, db: &str, owner_db: &MysqlBackend, writer: &str, purger: &str) {
        let writer_db = connect_as(url, writer, db).await;
        let idem = Idem::new(writer_db.clone());
        let key = Key::new("checkout-42").unwrap();

        // The protocol works as the writer: claim, effect, complete, then replay.
        let first = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                MysqlBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(first, Outcome::Executed(Balance { balance: 900 }));
        let again = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                MysqlBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(again, Outcome::Replayed(Balance { balance: 900 }));
        phased_run_and_outbox(writer_db.clone()).await;
        retries_and_dead_messages(writer_db.clone(), connect_as(url, purger, db).await).await;

        // The writer cannot rewrite the stored response or request (the guard: 1644,
        // SIGNAL 45000), re-key it (no column grant: 1143) or delete it (1142).
        let w = writer_db.pool();
        let update_response = "UPDATE idem_request_result SET response = '{\"balance\":1}'";
        assert_eq!(refused(w, update_response).await, 1644);
        assert_eq!(
            refused(
                w,
                "UPDATE idem_request_result SET request = '{\"amount\":1}'"
            )
            .await,
            1644
        );
        assert_eq!(
            refused(w, "UPDATE idem_request_result SET request_key = 'other'").await,
            1143
        );
        assert_eq!(refused(w, "DELETE FROM idem_request_result").await, 1142);

        // The purger purges (nothing is old enough) but cannot rewrite (no UPDATE: 1142).
        let purger_db = connect_as(url, purger, db).await;
        let report = Idem::new(purger_db.clone())
            .purge(Duration::from_secs(24 * 3600), 100)
            .await
            .unwrap();
        assert_eq!(report.requests, 0);
        assert_eq!(refused(purger_db.pool(), update_response).await, 1142);

        // The guard holds for the owner too: a live completed record is immutable.
        assert_eq!(refused(owner_db.pool(), update_response).await, 1644);

        // Nothing changed: the stored response still replays.
        let after = idem
            .execute(&scope(), &key, &debit_request(), |tx| {
                MysqlBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(after, Outcome::Replayed(Balance { balance: 900 }));
        let mut conn = owner_db.pool().get_conn().await.unwrap();
        let balance: Option<i64> = conn
            .query_first("SELECT balance FROM idem_demo_account WHERE account_id = 1")
            .await
            .unwrap();
        assert_eq!(balance, Some(900));

        // An expired record is taken over by the writer (the guard lets it change).
        conn.query_drop(
            "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
             VALUES ('account-1', 'debit:v1', 'expired-key', '{\"account\":1,\"amount\":5}', '{\"balance\":1}', 0, \
                     UTC_TIMESTAMP(6) - INTERVAL 2 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 DAY)",
        )
        .await
        .unwrap();
        drop(conn);
        let old = Key::new("expired-key").unwrap();
        let taken = idem
            .execute(&scope(), &old, &debit_request(), |tx| {
                MysqlBank::debit(tx, 1, 100)
            })
            .await
            .unwrap();
        assert_eq!(taken, Outcome::Executed(Balance { balance: 800 }));
        writer_db.disconnect().await.unwrap();
        purger_db.disconnect().await.unwrap();
    }

    #[test]
    fn writer_cannot_rewrite_a_stored_response() {
        runtime().block_on(async {
            let url = url();
            let s = suffix();
            let db = format!("idem_lp_{s}");
            let (writer_role, purger_role) =
                (format!("idem_writer_{s}"), format!("idem_purger_{s}"));
            let (writer, purger) = (format!("idem_w_{s}"), format!("idem_p_{s}"));
            let bank = MysqlBank::connect(&url, Some(&db))
                .await
                .unwrap_or_else(|e| panic!("MariaDB/MySQL is required at {url}: {e}"));
            let owner = bank.backend().clone();
            let setup = async {
                bank.setup().await?;
                bank.set_balance(1, 1000).await?;
                let mut conn = owner
                    .pool()
                    .get_conn()
                    .await
                    .map_err(idem::mysql::db_error)?;
                let script = GRANTS
                    .replace("idem_writer", &writer_role)
                    .replace("idem_purger", &purger_role);
                let mut all = statements(&script);
                // What the application grants on its own table, and the login accounts
                // (MariaDB's spelling of SET DEFAULT ROLE).
                all.push(format!(
                    "GRANT SELECT, UPDATE ON idem_demo_account TO {writer_role}"
                ));
                for (user, role) in [(&writer, &writer_role), (&purger, &purger_role)] {
                    let pass = password(user);
                    all.push(format!("CREATE USER '{user}'@'%' IDENTIFIED BY '{pass}'"));
                    all.push(format!(
                        "CREATE USER '{user}'@'localhost' IDENTIFIED BY '{pass}'"
                    ));
                    all.push(format!("GRANT {role} TO '{user}'@'%'"));
                    all.push(format!("GRANT {role} TO '{user}'@'localhost'"));
                    all.push(format!("SET DEFAULT ROLE {role} FOR '{user}'@'%'"));
                    all.push(format!("SET DEFAULT ROLE {role} FOR '{user}'@'localhost'"));
                }
                for statement in all {
                    conn.query_drop(&statement)
                        .await
                        .map_err(idem::mysql::db_error)?;
                }
                Ok::<_, idem::core::DbError>(())
            }
            .await;
            // Checks run in a task of their own so a failed assertion still drops the
            // database, the accounts and the roles below.
            let result = match setup {
                Ok(()) => {
                    let (url, db, writer, purger, owner) = (
                        url.clone(),
                        db.clone(),
                        writer.clone(),
                        purger.clone(),
                        owner.clone(),
                    );
                    tokio::spawn(async move { checks(&url, &db, &owner, &writer, &purger).await })
                        .await
                        .map_err(|e| e.into_panic())
                }
                Err(e) => {
                    Err(Box::new(format!("setup failed: {e}")) as Box<dyn std::any::Any + Send>)
                }
            };
            drop(owner);
            bank.close().await.unwrap();
            let admin = MysqlBackend::connect(&url).await.unwrap();
            let mut conn = admin.pool().get_conn().await.unwrap();
            for user in [&writer, &purger] {
                for host in ["%", "localhost"] {
                    conn.query_drop(format!("DROP USER IF EXISTS '{user}'@'{host}'"))
                        .await
                        .unwrap();
                }
            }
            for role in [&writer_role, &purger_role] {
                conn.query_drop(format!("DROP ROLE IF EXISTS {role}"))
                    .await
                    .unwrap();
            }
            drop(conn);
            admin.disconnect().await.unwrap();
            if let Err(panic) = result {
                std::panic::resume_unwind(panic);
            }
        });
    }

    #[test]
    fn the_grants_script_splits_into_statements() {
        let all = statements(GRANTS);
        assert!(
            all.iter()
                .any(|s| s.starts_with("CREATE TRIGGER") && s.contains("SIGNAL"))
        );
        assert!(all.iter().all(|s| !s.contains("DELIMITER")));
    }
}

/// Offline, for every engine with roles (SQL Server and Oracle are not verified live):
/// each column grant names columns the migrations create, never a key column, and the
/// guard trigger is there.
#[test]
fn grants_scripts_grant_only_existing_non_key_columns() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    for engine in ["postgres", "mysql", "mssql", "oracle"] {
        let dir = root.join(format!("idem-{engine}")).join("migrations");
        let grants = std::fs::read_to_string(dir.join("grants.sql")).unwrap();
        let mut schema = String::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with('0') && name.ends_with(".sql") {
                schema.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
        let mut column_grants = 0;
        for part in grants.split("GRANT UPDATE (").skip(1) {
            let (columns, rest) = part.split_once(')').unwrap();
            let table = rest.split_whitespace().nth(1).unwrap();
            assert!(table.starts_with("idem_"), "{engine}: {table}");
            for column in columns.split(',').map(str::trim) {
                assert!(
                    ![
                        "principal",
                        "operation",
                        "request_key",
                        "subscriber",
                        "message_id"
                    ]
                    .contains(&column),
                    "{engine}: UPDATE granted on key column {column}"
                );
                assert!(
                    schema
                        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                        .any(|w| w == column),
                    "{engine}: grants.sql names {column}, which the migrations never create"
                );
            }
            column_grants += 1;
        }
        assert!(
            column_grants >= 2,
            "{engine}: column-level UPDATE grants expected"
        );
        assert!(
            grants.contains("idem_request_result_guard"),
            "{engine}: no guard trigger"
        );
        assert!(
            grants.contains("idem_writer") && grants.contains("idem_purger"),
            "{engine}"
        );
        assert!(!grants.contains("GRANT DELETE ON idem_request_result TO idem_writer"));
    }
}
