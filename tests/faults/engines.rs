//! What each engine supplies to the fault suite: the effect (a debit plus a ledger row),
//! a way to find and kill a session, a gate that stops a transaction at its commit, and
//! a snapshot of the state the invariant checker reads.

use std::future::Future;
use std::time::Duration;

use idem::core::{Backend, BoxFuture, DbError, ErrorKind};
use idem_conformance::Bank;
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// The account every trial debits, and its starting balance.
pub(crate) const ACCOUNT: i64 = 1;
pub(crate) const INITIAL: i64 = 1_000_000_000;
/// No wait in the suite lasts longer than this: a hang fails the trial instead.
pub(crate) const HANG_GUARD: Duration = Duration::from_secs(60);

/// What a trial runs with.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub(crate) url: String,
    pub(crate) scale: u32,
    pub(crate) trial: &'static str,
}

/// Where the effect stops to let the test act on its session.
#[derive(Debug)]
pub(crate) enum Hook {
    /// Report the session's ID, then wait for `go` (if any) before going on.
    Pause {
        at: oneshot::Sender<i64>,
        go: Option<oneshot::Receiver<()>>,
    },
    /// In a child process: print `READY <session>` and go on.
    Announce,
    /// In a child process: print `READY <session>` and hang until killed.
    Hang,
}

impl Hook {
    pub(crate) async fn reached(self, session: i64) {
        match self {
            Hook::Pause { at, go } => {
                let _ = at.send(session);
                if let Some(go) = go {
                    let _ = tokio::time::timeout(HANG_GUARD, go).await;
                }
            }
            Hook::Announce => crate::child::say(&format!("READY {session}")),
            Hook::Hang => {
                crate::child::say(&format!("READY {session}"));
                tokio::time::sleep(HANG_GUARD).await;
            }
        }
    }
}

/// One stored record, as read back with plain SQL.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub(crate) key: String,
    pub(crate) request: String,
    pub(crate) response: Option<String>,
}

/// The state the invariant checker reads.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    pub(crate) balance: i64,
    /// One row per application of the effect: `(key, amount)`.
    pub(crate) ledger: Vec<(String, i64)>,
    pub(crate) records: Vec<Record>,
}

/// The response every debit returns and stores.
pub(crate) fn response(balance: i64, key: &str) -> Value {
    json!({"balance": balance, "key": key})
}

pub(crate) fn fault(message: impl Into<String>) -> DbError {
    DbError::new("faults", ErrorKind::Other, message)
}

pub(crate) type Tx<K> = <<K as Bank>::B as Backend>::Tx;

/// An engine's part of the fault suite.
pub(crate) trait Faulty: Bank {
    /// Whether sessions can be killed from a second connection (not SQLite).
    const SESSIONS_KILLABLE: bool;

    /// Creates the account, the ledger and (where the engine has them) the commit gate.
    fn prepare(&self) -> impl Future<Output = Result<(), DbError>> + Send;

    /// What a child process needs to reach the same private namespace: `(url, ns)`.
    fn child_location(&self, url: &str, ns: &str) -> (String, String) {
        (url.to_owned(), ns.to_owned())
    }

    /// Connects a child process to the namespace the parent prepared.
    fn attach(url: &str, ns: &str) -> impl Future<Output = Result<Self::B, DbError>> + Send;

    /// The effect, inside idem's transaction: debits `amount`, calls `hook` with the
    /// session's ID, then writes the ledger row; with `gate`, its commit stops at the
    /// gate while the test holds it.
    fn apply(
        tx: &mut Tx<Self>,
        key: String,
        amount: i64,
        gate: bool,
        hook: Option<Hook>,
    ) -> BoxFuture<'_, Result<Value, DbError>>;

    /// The broken protocol's effect: the same debit and ledger row in a transaction of
    /// its own (outside idem); with `hang`, prints `READY` before its ledger row and
    /// hangs until the process is killed.
    fn apply_alone(
        backend: &Self::B,
        key: String,
        amount: i64,
        hang: bool,
    ) -> impl Future<Output = Result<Value, DbError>> + Send;

    /// Reads balance, ledger and records.
    fn snapshot(&self) -> impl Future<Output = Result<Snapshot, DbError>> + Send;

    /// Kills a session from another connection.
    fn kill(&self, _session: i64) -> impl Future<Output = Result<(), DbError>> + Send {
        async { Err(fault("sessions cannot be killed on this engine")) }
    }

    /// The session waiting for a lock that session `blocker` holds, if any.
    fn lock_waiter(
        &self,
        _blocker: i64,
    ) -> impl Future<Output = Result<Option<i64>, DbError>> + Send {
        async { Err(fault("no lock waits on this engine")) }
    }

    /// Closes the commit gate (held on a connection of its own until opened).
    fn close_gate(&self) -> impl Future<Output = Result<Gate, DbError>> + Send {
        async { Err(fault("no commit gate on this engine")) }
    }

    /// Whether `session` is stopped at the commit gate.
    fn at_gate(&self, _session: i64) -> impl Future<Output = Result<bool, DbError>> + Send {
        async { Err(fault("no commit gate on this engine")) }
    }
}

/// A closed commit gate: the connection holding the lock.
pub(crate) enum Gate {
    #[cfg(feature = "postgres")]
    Postgres(
        idem::postgres::sqlx::pool::PoolConnection<idem::postgres::sqlx::Postgres>,
        String,
    ),
    #[cfg(feature = "mysql")]
    Mysql(idem::mysql::mysql_async::Conn),
}

impl Gate {
    /// Opens the gate: the transaction waiting at it goes on.
    pub(crate) async fn open(self) -> Result<(), DbError> {
        match self {
            #[cfg(feature = "postgres")]
            Gate::Postgres(mut conn, ns) => {
                use idem::postgres::{db_error, sqlx};
                sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
                    .bind(ns)
                    .execute(&mut *conn)
                    .await
                    .map_err(db_error)?;
                conn.close().await.map_err(db_error)
            }
            #[cfg(feature = "mysql")]
            Gate::Mysql(mut conn) => {
                use idem::mysql::db_error;
                use idem::mysql::mysql_async::prelude::Queryable;
                conn.query_drop("DO RELEASE_LOCK(CONCAT('idem_fault:', DATABASE()))")
                    .await
                    .map_err(db_error)?;
                conn.disconnect().await.map_err(db_error)
            }
            #[allow(unreachable_patterns)]
            _ => Ok(()),
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::str::FromStr;

    use idem::core::BoxFuture;
    use idem::postgres::sqlx::postgres::PgConnectOptions;
    use idem::postgres::sqlx::{self, Connection, Row};
    use idem::postgres::{PgBackend, PgTx, db_error};
    use idem_conformance::Bank;
    use idem_conformance::postgres::PgBank;

    use super::*;

    const SCHEMA: &str = "
        CREATE TABLE fault_account (id bigint PRIMARY KEY, balance bigint NOT NULL);
        CREATE TABLE fault_ledger (request_key text NOT NULL, amount bigint NOT NULL);
        -- The commit gate: a deferred trigger runs inside COMMIT and, when the effect
        -- asked for it, waits on an advisory lock the test holds.
        CREATE FUNCTION fault_commit_gate() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('idem_fault.gate', true) = 'on' THEN
                PERFORM pg_advisory_xact_lock(hashtext(current_schema()));
            END IF;
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER fault_commit_gate AFTER INSERT ON fault_ledger
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fault_commit_gate();
    ";

    async fn schema_name(bank: &PgBank) -> Result<String, DbError> {
        sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(bank.backend().pool())
            .await
            .map_err(db_error)
    }

    impl Faulty for PgBank {
        const SESSIONS_KILLABLE: bool = true;

        async fn prepare(&self) -> Result<(), DbError> {
            let pool = self.backend().pool();
            sqlx::raw_sql(SCHEMA)
                .execute(pool)
                .await
                .map_err(db_error)?;
            sqlx::query("INSERT INTO fault_account VALUES ($1, $2)")
                .bind(ACCOUNT)
                .bind(INITIAL)
                .execute(pool)
                .await
                .map(drop)
                .map_err(db_error)
        }

        async fn attach(url: &str, ns: &str) -> Result<PgBackend, DbError> {
            let options = PgConnectOptions::from_str(url)
                .map_err(db_error)?
                .options([("search_path", ns)]);
            PgBackend::connect_with(options, 4).await
        }

        fn apply(
            tx: &mut PgTx,
            key: String,
            amount: i64,
            gate: bool,
            hook: Option<Hook>,
        ) -> BoxFuture<'_, Result<Value, DbError>> {
            Box::pin(async move {
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut **tx)
                    .await
                    .map_err(db_error)?;
                if gate {
                    sqlx::query("SELECT set_config('idem_fault.gate', 'on', true)")
                        .execute(&mut **tx)
                        .await
                        .map_err(db_error)?;
                }
                let balance: i64 = sqlx::query_scalar(
                    "UPDATE fault_account SET balance = balance - $2 WHERE id = $1 RETURNING balance",
                )
                .bind(ACCOUNT)
                .bind(amount)
                .fetch_one(&mut **tx)
                .await
                .map_err(db_error)?;
                if let Some(hook) = hook {
                    hook.reached(i64::from(pid)).await;
                }
                sqlx::query("INSERT INTO fault_ledger (request_key, amount) VALUES ($1, $2)")
                    .bind(&key)
                    .bind(amount)
                    .execute(&mut **tx)
                    .await
                    .map_err(db_error)?;
                Ok(response(balance, &key))
            })
        }

        async fn apply_alone(
            backend: &PgBackend,
            key: String,
            amount: i64,
            hang: bool,
        ) -> Result<Value, DbError> {
            let mut tx = PgTx::begin(backend.pool()).await?;
            let value =
                Self::apply(&mut tx, key, amount, false, hang.then_some(Hook::Hang)).await?;
            tx.commit().await?;
            Ok(value)
        }

        async fn snapshot(&self) -> Result<Snapshot, DbError> {
            // One REPEATABLE READ transaction: a consistent picture of all three.
            let mut tx = self.backend().pool().begin().await.map_err(db_error)?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            let balance: i64 =
                sqlx::query_scalar("SELECT balance FROM fault_account WHERE id = $1")
                    .bind(ACCOUNT)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db_error)?;
            let ledger: Vec<(String, i64)> =
                sqlx::query_as("SELECT request_key, amount FROM fault_ledger")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?;
            let rows = sqlx::query(
                "SELECT request_key, request::text, response::text FROM idem_request_result",
            )
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?;
            let records = rows
                .iter()
                .map(|r| {
                    Ok(Record {
                        key: r.try_get(0)?,
                        request: r.try_get(1)?,
                        response: r.try_get(2)?,
                    })
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()
                .map_err(db_error)?;
            tx.rollback().await.map_err(db_error)?;
            Ok(Snapshot {
                balance,
                ledger,
                records,
            })
        }

        async fn kill(&self, session: i64) -> Result<(), DbError> {
            let pid = i32::try_from(session).map_err(|_| fault("pid out of range"))?;
            let pool = self.backend().pool();
            let mut conn = pool.acquire().await.map_err(db_error)?;
            let own: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .map_err(db_error)?;
            if own == pid {
                // The session finished its call first (a race round) and went back to
                // the pool, where this control connection picked it up:
                // pg_terminate_backend would end the control connection itself (57P01).
                // End it by disconnecting, then watch for it from another connection.
                conn.detach().close().await.map_err(db_error)?;
                return until_gone(pool, pid).await;
            }
            // Waits (up to 5 s) until the backend is gone, so the kill has landed.
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                .bind(pid)
                .fetch_one(&mut *conn)
                .await
                .map_err(db_error)?;
            if killed {
                Ok(())
            } else {
                Err(fault(format!(
                    "pg_terminate_backend({pid}) found no such session"
                )))
            }
        }

        async fn lock_waiter(&self, blocker: i64) -> Result<Option<i64>, DbError> {
            let blocker = i32::try_from(blocker).map_err(|_| fault("pid out of range"))?;
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
            )
            .bind(blocker)
            .fetch_optional(self.backend().pool())
            .await
            .map_err(db_error)?;
            Ok(pid.map(i64::from))
        }

        async fn close_gate(&self) -> Result<Gate, DbError> {
            let ns = schema_name(self).await?;
            let mut conn = self.backend().pool().acquire().await.map_err(db_error)?;
            sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
                .bind(&ns)
                .execute(&mut *conn)
                .await
                .map_err(db_error)?;
            Ok(Gate::Postgres(conn, ns))
        }

        async fn at_gate(&self, session: i64) -> Result<bool, DbError> {
            let pid = i32::try_from(session).map_err(|_| fault("pid out of range"))?;
            let waiting: Option<bool> = sqlx::query_scalar(
                "SELECT coalesce(wait_event_type = 'Lock' AND wait_event = 'advisory', false) \
                 FROM pg_stat_activity WHERE pid = $1",
            )
            .bind(pid)
            .fetch_optional(self.backend().pool())
            .await
            .map_err(db_error)?;
            Ok(waiting == Some(true))
        }
    }

    /// Waits (up to 5 s) until backend `pid` has left `pg_stat_activity`.
    async fn until_gone(pool: &sqlx::PgPool, pid: i32) -> Result<(), DbError> {
        for _ in 0..500 {
            let present: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                    .bind(pid)
                    .fetch_one(pool)
                    .await
                    .map_err(db_error)?;
            if !present {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(fault(format!("backend {pid} survived its disconnect")))
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use idem::core::BoxFuture;
    use idem::mysql::mysql_async::prelude::Queryable;
    use idem::mysql::mysql_async::{OptsBuilder, Row, TxOpts};
    use idem::mysql::{MysqlBackend, MysqlTx, db_error, parse_url};
    use idem_conformance::Bank;
    use idem_conformance::mysql::MysqlBank;

    use super::*;

    const SCHEMA: [&str; 3] = [
        "CREATE TABLE fault_account (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE fault_ledger (request_key VARBINARY(255) NOT NULL, amount BIGINT NOT NULL) ENGINE=InnoDB",
        // The commit gate: MySQL has no deferred triggers, so the gate stops the
        // completion statement idem runs just before COMMIT, when the effect asked for it
        // (the session variable names the key, hex-encoded).
        "CREATE TRIGGER fault_commit_gate BEFORE UPDATE ON idem_request_result FOR EACH ROW \
         BEGIN \
           IF @idem_fault_gate IS NOT NULL AND @idem_fault_gate = HEX(NEW.request_key) THEN \
             DO GET_LOCK(CONCAT('idem_fault:', DATABASE()), 60); \
             DO RELEASE_LOCK(CONCAT('idem_fault:', DATABASE())); \
           END IF; \
         END",
    ];

    fn hex(key: &str) -> String {
        key.bytes().map(|b| format!("{b:02X}")).collect()
    }

    async fn session_apply<Q: Queryable + Send>(
        tx: &mut Q,
        key: String,
        amount: i64,
        gate: bool,
        hook: Option<Hook>,
    ) -> Result<Value, DbError> {
        let id: Option<u64> = tx
            .query_first("SELECT CONNECTION_ID()")
            .await
            .map_err(db_error)?;
        let id = id.ok_or_else(|| fault("no connection id"))?;
        tx.exec_drop("SET @idem_fault_gate = ?", (gate.then(|| hex(&key)),))
            .await
            .map_err(db_error)?;
        tx.exec_drop(
            "UPDATE fault_account SET balance = balance - ? WHERE id = ?",
            (amount, ACCOUNT),
        )
        .await
        .map_err(db_error)?;
        let balance: Option<i64> = tx
            .exec_first("SELECT balance FROM fault_account WHERE id = ?", (ACCOUNT,))
            .await
            .map_err(db_error)?;
        let balance = balance.ok_or_else(|| fault("no account"))?;
        if let Some(hook) = hook {
            hook.reached(i64::try_from(id).unwrap_or(i64::MAX)).await;
        }
        tx.exec_drop(
            "INSERT INTO fault_ledger (request_key, amount) VALUES (?, ?)",
            (key.as_bytes(), amount),
        )
        .await
        .map_err(db_error)?;
        Ok(response(balance, &key))
    }

    /// A pooled connection that answers: the race rounds kill sessions that may already
    /// be back in the pool, and the pool hands a dead one out once.
    async fn live_conn(bank: &MysqlBank) -> Result<idem::mysql::mysql_async::Conn, DbError> {
        let mut last = None;
        for _ in 0..5 {
            let mut conn = bank.backend().pool().get_conn().await.map_err(db_error)?;
            match conn.ping().await {
                Ok(()) => return Ok(conn),
                Err(e) => last = Some(db_error(e)),
            }
        }
        Err(last.unwrap_or_else(|| fault("no live connection")))
    }

    async fn scalar<T: idem::mysql::mysql_async::prelude::FromValue + Send + 'static>(
        bank: &MysqlBank,
        sql: &str,
        params: impl Into<idem::mysql::mysql_async::Params> + Send,
    ) -> Result<Option<T>, DbError> {
        let mut conn = live_conn(bank).await?;
        conn.exec_first(sql, params).await.map_err(db_error)
    }

    impl Faulty for MysqlBank {
        const SESSIONS_KILLABLE: bool = true;

        async fn prepare(&self) -> Result<(), DbError> {
            let mut conn = self.backend().pool().get_conn().await.map_err(db_error)?;
            for statement in SCHEMA {
                conn.query_drop(statement).await.map_err(db_error)?;
            }
            conn.exec_drop(
                "INSERT INTO fault_account VALUES (?, ?)",
                (ACCOUNT, INITIAL),
            )
            .await
            .map_err(db_error)
        }

        async fn attach(url: &str, ns: &str) -> Result<MysqlBackend, DbError> {
            MysqlBackend::connect_with(OptsBuilder::from_opts(parse_url(url)?).db_name(Some(ns)))
                .await
        }

        fn apply(
            tx: &mut MysqlTx,
            key: String,
            amount: i64,
            gate: bool,
            hook: Option<Hook>,
        ) -> BoxFuture<'_, Result<Value, DbError>> {
            Box::pin(session_apply(tx.conn(), key, amount, gate, hook))
        }

        async fn apply_alone(
            backend: &MysqlBackend,
            key: String,
            amount: i64,
            hang: bool,
        ) -> Result<Value, DbError> {
            let mut tx = backend
                .pool()
                .start_transaction(TxOpts::default())
                .await
                .map_err(db_error)?;
            let value =
                session_apply(&mut tx, key, amount, false, hang.then_some(Hook::Hang)).await?;
            tx.commit().await.map_err(db_error)?;
            Ok(value)
        }

        async fn snapshot(&self) -> Result<Snapshot, DbError> {
            // One consistent-snapshot transaction: a consistent picture of all three.
            let mut live = live_conn(self).await?;
            let mut conn = live
                .start_transaction({
                    let mut opts = TxOpts::default();
                    opts.with_consistent_snapshot(true);
                    opts
                })
                .await
                .map_err(db_error)?;
            let balance: Option<i64> = conn
                .exec_first("SELECT balance FROM fault_account WHERE id = ?", (ACCOUNT,))
                .await
                .map_err(db_error)?;
            let ledger: Vec<(Vec<u8>, i64)> = conn
                .query("SELECT request_key, amount FROM fault_ledger")
                .await
                .map_err(db_error)?;
            let rows: Vec<Row> = conn
                .query("SELECT request_key, request, response FROM idem_request_result")
                .await
                .map_err(db_error)?;
            conn.rollback().await.map_err(db_error)?;
            let mut records = Vec::new();
            for mut row in rows {
                let key: Option<Vec<u8>> = row.take(0);
                let request: Option<String> = row.take(1);
                let response: Option<Option<String>> = row.take(2);
                records.push(Record {
                    key: String::from_utf8_lossy(&key.unwrap_or_default()).into_owned(),
                    request: request.unwrap_or_default(),
                    response: response.flatten(),
                });
            }
            Ok(Snapshot {
                balance: balance.ok_or_else(|| fault("no account"))?,
                ledger: ledger
                    .into_iter()
                    .map(|(k, a)| (String::from_utf8_lossy(&k).into_owned(), a))
                    .collect(),
                records,
            })
        }

        async fn kill(&self, session: i64) -> Result<(), DbError> {
            let mut conn = live_conn(self).await?;
            if i64::from(conn.id()) == session {
                // The session finished its call first (a race round) and went back to
                // the pool, where this control connection picked it up: KILL would
                // kill the control connection itself (1927). End it by disconnecting,
                // then watch the process list from another connection.
                conn.disconnect().await.map_err(db_error)?;
                conn = live_conn(self).await?;
            } else {
                conn.query_drop(format!("KILL CONNECTION {session}"))
                    .await
                    .map_err(db_error)?;
            }
            // KILL only flags the thread: wait until it has left the process list.
            for _ in 0..500 {
                let gone: Option<u64> = conn
                    .exec_first(
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
                        (session,),
                    )
                    .await
                    .map_err(db_error)?;
                if gone == Some(0) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(fault(format!("session {session} survived KILL")))
        }

        async fn lock_waiter(&self, blocker: i64) -> Result<Option<i64>, DbError> {
            // The session of this private database running idem's claim (only the
            // holder and its waiter run here). MariaDB's INNODB_TRX does not list a
            // transaction whose first statement waits, so the process list it is. On
            // MariaDB the claim is `SET STATEMENT innodb_lock_wait_timeout = N FOR
            // INSERT …`, sent after `START TRANSACTION; ` in the same message (the
            // process list shows the statement of a multi-statement message that runs).
            let id: Option<Option<u64>> = scalar(
                self,
                "SELECT ID FROM information_schema.PROCESSLIST \
                 WHERE DB = DATABASE() AND ID <> ? AND ID <> CONNECTION_ID() \
                 AND (INFO LIKE 'INSERT INTO idem_request_result%' \
                 OR INFO LIKE 'SET STATEMENT % FOR INSERT INTO idem_request_result%') LIMIT 1",
                (blocker,),
            )
            .await?;
            Ok(id.flatten().and_then(|id| i64::try_from(id).ok()))
        }

        async fn close_gate(&self) -> Result<Gate, DbError> {
            let mut conn = live_conn(self).await?;
            let got: Option<i64> = conn
                .query_first("SELECT GET_LOCK(CONCAT('idem_fault:', DATABASE()), 5)")
                .await
                .map_err(db_error)?;
            if got != Some(1) {
                return Err(fault("could not take the gate's lock"));
            }
            Ok(Gate::Mysql(conn))
        }

        async fn at_gate(&self, session: i64) -> Result<bool, DbError> {
            let state: Option<Option<String>> = scalar(
                self,
                "SELECT STATE FROM information_schema.PROCESSLIST WHERE ID = ?",
                (session,),
            )
            .await?;
            Ok(state.flatten().as_deref() == Some("User lock"))
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use idem::core::BoxFuture;
    use idem::sqlite::rusqlite::params;
    use idem::sqlite::{Location, SqliteBackend, SqliteTx, db_error, url_for};
    use idem_conformance::Bank;
    use idem_conformance::sqlite::SqliteBank;

    use super::*;

    const SCHEMA: &str = "
        CREATE TABLE fault_account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL) STRICT;
        CREATE TABLE fault_ledger (request_key TEXT NOT NULL, amount INTEGER NOT NULL) STRICT;
    ";

    fn debit(c: &idem::sqlite::rusqlite::Connection, amount: i64) -> Result<i64, DbError> {
        c.query_row(
            "UPDATE fault_account SET balance = balance - ?2 WHERE id = ?1 RETURNING balance",
            params![ACCOUNT, amount],
            |r| r.get(0),
        )
        .map_err(db_error)
    }

    fn ledger(
        c: &idem::sqlite::rusqlite::Connection,
        key: &str,
        amount: i64,
    ) -> Result<(), DbError> {
        c.execute(
            "INSERT INTO fault_ledger (request_key, amount) VALUES (?1, ?2)",
            params![key, amount],
        )
        .map(drop)
        .map_err(db_error)
    }

    /// A process's "session": SQLite has none, the process ID stands in.
    fn session() -> i64 {
        i64::from(std::process::id())
    }

    impl Faulty for SqliteBank {
        const SESSIONS_KILLABLE: bool = false;

        async fn prepare(&self) -> Result<(), DbError> {
            self.backend()
                .interact(|c| {
                    c.execute_batch(SCHEMA)?;
                    c.execute(
                        "INSERT INTO fault_account VALUES (?1, ?2)",
                        params![ACCOUNT, INITIAL],
                    )
                    .map(drop)
                })
                .await
        }

        fn child_location(&self, _url: &str, _ns: &str) -> (String, String) {
            match self.backend().location() {
                Location::File(path) => (url_for(path), String::new()),
                Location::Memory => ("sqlite::memory:".into(), String::new()),
            }
        }

        async fn attach(url: &str, _ns: &str) -> Result<SqliteBackend, DbError> {
            SqliteBackend::connect(url).await
        }

        fn apply(
            tx: &mut SqliteTx,
            key: String,
            amount: i64,
            _gate: bool,
            hook: Option<Hook>,
        ) -> BoxFuture<'_, Result<Value, DbError>> {
            Box::pin(async move {
                let balance = tx.run(move |c| debit(c, amount)).await?;
                if let Some(hook) = hook {
                    hook.reached(session()).await;
                }
                let k = key.clone();
                tx.run(move |c| ledger(c, &k, amount)).await?;
                Ok(response(balance, &key))
            })
        }

        async fn apply_alone(
            backend: &SqliteBackend,
            key: String,
            amount: i64,
            hang: bool,
        ) -> Result<Value, DbError> {
            backend
                .interact(move |c| {
                    c.execute_batch("BEGIN IMMEDIATE")?;
                    let result = (|| {
                        let balance = debit(c, amount)?;
                        if hang {
                            // Blocking on purpose: this process is about to be killed.
                            crate::child::say(&format!("READY {}", session()));
                            std::thread::sleep(HANG_GUARD);
                        }
                        ledger(c, &key, amount)?;
                        Ok::<_, DbError>(response(balance, &key))
                    })();
                    match result {
                        Ok(v) => c.execute_batch("COMMIT").map(|()| Ok(v)),
                        Err(e) => c.execute_batch("ROLLBACK").map(|()| Err(e)),
                    }
                })
                .await?
        }

        async fn snapshot(&self) -> Result<Snapshot, DbError> {
            self.backend()
                .interact(|c| {
                    // One read transaction: a consistent picture of all three.
                    c.execute_batch("BEGIN")?;
                    let balance = c.query_row(
                        "SELECT balance FROM fault_account WHERE id = ?1",
                        [ACCOUNT],
                        |r| r.get(0),
                    )?;
                    let mut s = c.prepare("SELECT request_key, amount FROM fault_ledger")?;
                    let ledger = s
                        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut s = c.prepare(
                        "SELECT request_key, request, response FROM idem_request_result",
                    )?;
                    let records = s
                        .query_map([], |r| {
                            Ok(Record {
                                key: r.get(0)?,
                                request: r.get(1)?,
                                response: r.get(2)?,
                            })
                        })?
                        .collect::<Result<Vec<_>, _>>()?;
                    drop(s);
                    c.execute_batch("COMMIT")?;
                    Ok(Snapshot {
                        balance,
                        ledger,
                        records,
                    })
                })
                .await
        }
    }
}
