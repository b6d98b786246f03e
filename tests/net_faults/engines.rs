//! What each engine supplies to the network-fault suite: its wire protocol, a backend
//! connected through the proxy to a private namespace, the effects (a ledger row per
//! application; a phase also writes the run's point it saw into a history table), and a
//! snapshot of everything the checker reads.

use std::future::Future;

use idem::core::{Backend, BoxFuture, DbError, ErrorKind};
use idem_conformance::Bank;
use idem_conformance::proxy::Wire;
use serde_json::{Value, json};

pub(crate) type Tx<K> = <<K as Bank>::B as Backend>::Tx;

pub(crate) fn fault(message: impl Into<String>) -> DbError {
    DbError::new("net_faults", ErrorKind::Other, message)
}

/// A request record as stored.
#[derive(Debug, Clone)]
pub(crate) struct RequestRow {
    pub(crate) key: String,
    pub(crate) status: Option<i64>,
    pub(crate) response: Option<String>,
}

/// A phased run as stored.
#[derive(Debug, Clone)]
pub(crate) struct RunRow {
    pub(crate) key: String,
    pub(crate) point: String,
    pub(crate) status: Option<i64>,
    pub(crate) response: Option<String>,
}

/// An outbox message as stored.
#[derive(Debug, Clone)]
pub(crate) struct OutboxRow {
    pub(crate) message_id: String,
    pub(crate) sent: bool,
}

/// Everything the checker reads, in one consistent read.
#[derive(Debug, Clone, Default)]
pub(crate) struct Snapshot {
    /// One row per application of an effect: `(key, step)`, in insert order.
    pub(crate) ledger: Vec<(String, String)>,
    /// One row per committed phase: `(key, the run's point the phase saw, its new
    /// point)`, in insert order.
    pub(crate) history: Vec<(String, Option<String>, String)>,
    pub(crate) requests: Vec<RequestRow>,
    /// Processed message IDs.
    pub(crate) messages: Vec<String>,
    pub(crate) runs: Vec<RunRow>,
    pub(crate) outbox: Vec<OutboxRow>,
}

/// An engine's part of the suite.
pub(crate) trait Net: Bank {
    /// The protocol the proxy follows.
    const WIRE: Wire;
    /// The server's port when the URL names none.
    const DEFAULT_PORT: u16;

    /// Creates the ledger and history tables in the private namespace.
    fn prepare(&self) -> impl Future<Output = Result<(), DbError>> + Send;

    /// A backend on `url` (already pointing at the proxy), in namespace `ns`, with at
    /// most `pool` connections.
    fn through(
        url: &str,
        ns: &str,
        pool: u32,
    ) -> impl Future<Output = Result<Self::B, DbError>> + Send;

    /// Writes one ledger row `(key, step)` in the transaction.
    fn ledger<'t>(
        tx: &'t mut Tx<Self>,
        key: String,
        step: &'static str,
    ) -> BoxFuture<'t, Result<(), DbError>>;

    /// A phase's effect: reads the run's committed point, writes a ledger row
    /// `(key, point)` and a history row `(key, seen, point)`; returns the phase's state.
    fn phase_effect<'t>(
        tx: &'t mut Tx<Self>,
        principal: String,
        operation: String,
        key: String,
        point: &'static str,
    ) -> BoxFuture<'t, Result<Value, DbError>>;

    /// Reads everything the checker needs.
    fn snapshot(&self) -> impl Future<Output = Result<Snapshot, DbError>> + Send;

    /// Outbox messages not marked sent.
    fn unsent(&self) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// Which statements claim a key and complete its record (the faults aim at them).
    fn shape() -> crate::paths::Shape {
        crate::paths::Shape::PLACEHOLDER
    }
}

fn phase_state(point: &str, seen: Option<&str>) -> Value {
    json!({ "point": point, "seen": seen })
}

mod postgres {
    use std::str::FromStr;

    use idem::postgres::sqlx::postgres::{PgConnectOptions, PgSslMode};
    use idem::postgres::sqlx::{self, Row};
    use idem::postgres::{PgBackend, PgTx, db_error};
    use idem_conformance::postgres::PgBank;

    use super::*;

    const SCHEMA: &str = "
        CREATE TABLE nf_ledger (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            k text NOT NULL, step text NOT NULL);
        CREATE TABLE nf_history (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            k text NOT NULL, seen text, point text NOT NULL);
    ";

    impl Net for PgBank {
        const WIRE: Wire = Wire::Postgres;
        const DEFAULT_PORT: u16 = 5432;

        fn shape() -> crate::paths::Shape {
            // A single server claims with the key lock unless the run asks otherwise.
            match idem_conformance::postgres::claim_style() {
                Ok(idem::postgres::ClaimStyle::Placeholder) => crate::paths::Shape::PLACEHOLDER,
                _ => crate::paths::Shape::KEY_LOCK,
            }
        }

        async fn prepare(&self) -> Result<(), DbError> {
            sqlx::raw_sql(SCHEMA)
                .execute(self.backend().pool())
                .await
                .map(drop)
                .map_err(db_error)
        }

        async fn through(url: &str, ns: &str, pool: u32) -> Result<PgBackend, DbError> {
            // The proxy follows the plain protocol: no TLS.
            let options = PgConnectOptions::from_str(url)
                .map_err(db_error)?
                .ssl_mode(PgSslMode::Disable)
                .options([("search_path", ns)]);
            Ok(PgBackend::connect_with(options, pool)
                .await?
                .with_claim_style(idem_conformance::postgres::claim_style()?))
        }

        fn ledger<'t>(
            tx: &'t mut PgTx,
            key: String,
            step: &'static str,
        ) -> BoxFuture<'t, Result<(), DbError>> {
            Box::pin(async move {
                sqlx::query("INSERT INTO nf_ledger (k, step) VALUES ($1, $2)")
                    .bind(key)
                    .bind(step)
                    .execute(&mut **tx)
                    .await
                    .map(drop)
                    .map_err(db_error)
            })
        }

        fn phase_effect<'t>(
            tx: &'t mut PgTx,
            principal: String,
            operation: String,
            key: String,
            point: &'static str,
        ) -> BoxFuture<'t, Result<Value, DbError>> {
            Box::pin(async move {
                let seen: Option<String> = sqlx::query_scalar(
                    "SELECT point FROM idem_run WHERE principal = $1 AND operation = $2 AND request_key = $3",
                )
                .bind(principal)
                .bind(operation)
                .bind(&key)
                .fetch_optional(&mut **tx)
                .await
                .map_err(db_error)?;
                sqlx::query("INSERT INTO nf_ledger (k, step) VALUES ($1, $2)")
                    .bind(&key)
                    .bind(point)
                    .execute(&mut **tx)
                    .await
                    .map_err(db_error)?;
                sqlx::query("INSERT INTO nf_history (k, seen, point) VALUES ($1, $2, $3)")
                    .bind(&key)
                    .bind(&seen)
                    .bind(point)
                    .execute(&mut **tx)
                    .await
                    .map_err(db_error)?;
                Ok(phase_state(point, seen.as_deref()))
            })
        }

        async fn snapshot(&self) -> Result<Snapshot, DbError> {
            let mut tx = self.backend().pool().begin().await.map_err(db_error)?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            let ledger: Vec<(String, String)> =
                sqlx::query_as("SELECT k, step FROM nf_ledger ORDER BY id")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?;
            let history: Vec<(String, Option<String>, String)> =
                sqlx::query_as("SELECT k, seen, point FROM nf_history ORDER BY id")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?;
            let requests =
                sqlx::query("SELECT request_key, status::int8, response FROM idem_request_result")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?
                    .iter()
                    .map(|r| {
                        Ok(RequestRow {
                            key: r.try_get(0)?,
                            status: r.try_get(1)?,
                            response: r.try_get(2)?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()
                    .map_err(db_error)?;
            let messages: Vec<String> =
                sqlx::query_scalar("SELECT message_id FROM idem_processed_message")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?;
            let runs =
                sqlx::query("SELECT request_key, point, status::int8, response FROM idem_run")
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_error)?
                    .iter()
                    .map(|r| {
                        Ok(RunRow {
                            key: r.try_get(0)?,
                            point: r.try_get(1)?,
                            status: r.try_get(2)?,
                            response: r.try_get(3)?,
                        })
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()
                    .map_err(db_error)?;
            let outbox: Vec<(String, bool)> = sqlx::query_as(
                "SELECT message_id, sent_at IS NOT NULL FROM idem_outbox ORDER BY id",
            )
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?;
            tx.rollback().await.map_err(db_error)?;
            Ok(Snapshot {
                ledger,
                history,
                requests,
                messages,
                runs,
                outbox: outbox
                    .into_iter()
                    .map(|(message_id, sent)| OutboxRow { message_id, sent })
                    .collect(),
            })
        }

        async fn unsent(&self) -> Result<u64, DbError> {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL")
                    .fetch_one(self.backend().pool())
                    .await
                    .map_err(db_error)?;
            Ok(u64::try_from(n).unwrap_or(0))
        }
    }
}

mod mysql {
    use idem::mysql::mysql_async::prelude::Queryable;
    use idem::mysql::mysql_async::{OptsBuilder, Row, TxOpts};
    use idem::mysql::{MysqlBackend, MysqlTx, db_error, parse_url};
    use idem_conformance::mysql::MysqlBank;

    use super::*;

    const SCHEMA: [&str; 2] = [
        "CREATE TABLE nf_ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         k VARBINARY(255) NOT NULL, step VARBINARY(64) NOT NULL) ENGINE=InnoDB",
        "CREATE TABLE nf_history (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         k VARBINARY(255) NOT NULL, seen VARBINARY(64) NULL, point VARBINARY(64) NOT NULL) ENGINE=InnoDB",
    ];

    fn text(b: Option<Vec<u8>>) -> String {
        String::from_utf8_lossy(&b.unwrap_or_default()).into_owned()
    }

    impl Net for MysqlBank {
        const WIRE: Wire = Wire::Mysql;
        const DEFAULT_PORT: u16 = 3306;

        async fn prepare(&self) -> Result<(), DbError> {
            let mut conn = self.backend().pool().get_conn().await.map_err(db_error)?;
            for statement in SCHEMA {
                conn.query_drop(statement).await.map_err(db_error)?;
            }
            Ok(())
        }

        async fn through(url: &str, ns: &str, pool: u32) -> Result<MysqlBackend, DbError> {
            let constraints =
                idem::mysql::mysql_async::PoolConstraints::new(1, pool.max(1) as usize)
                    .ok_or_else(|| fault("bad pool size"))?;
            let opts = parse_url(url)?;
            let pool_opts = opts.pool_opts().clone().with_constraints(constraints);
            // A loopback URL would otherwise move to the server's Unix socket, past the
            // proxy.
            MysqlBackend::connect_with(
                OptsBuilder::from_opts(opts)
                    .db_name(Some(ns))
                    .prefer_socket(false)
                    .pool_opts(pool_opts),
            )
            .await
        }

        fn ledger<'t>(
            tx: &'t mut MysqlTx,
            key: String,
            step: &'static str,
        ) -> BoxFuture<'t, Result<(), DbError>> {
            Box::pin(async move {
                tx.exec_drop(
                    "INSERT INTO nf_ledger (k, step) VALUES (?, ?)",
                    (key.as_bytes(), step.as_bytes()),
                )
                .await
                .map_err(db_error)
            })
        }

        fn phase_effect<'t>(
            tx: &'t mut MysqlTx,
            principal: String,
            operation: String,
            key: String,
            point: &'static str,
        ) -> BoxFuture<'t, Result<Value, DbError>> {
            Box::pin(async move {
                let seen: Option<Vec<u8>> = tx
                    .exec_first(
                        "SELECT point FROM idem_run WHERE principal = ? AND operation = ? AND request_key = ?",
                        (principal.as_bytes(), operation.as_bytes(), key.as_bytes()),
                    )
                    .await
                    .map_err(db_error)?;
                let seen = seen.map(|s| String::from_utf8_lossy(&s).into_owned());
                tx.exec_drop(
                    "INSERT INTO nf_ledger (k, step) VALUES (?, ?)",
                    (key.as_bytes(), point.as_bytes()),
                )
                .await
                .map_err(db_error)?;
                tx.exec_drop(
                    "INSERT INTO nf_history (k, seen, point) VALUES (?, ?, ?)",
                    (
                        key.as_bytes(),
                        seen.as_ref().map(|s| s.as_bytes().to_vec()),
                        point.as_bytes(),
                    ),
                )
                .await
                .map_err(db_error)?;
                Ok(phase_state(point, seen.as_deref()))
            })
        }

        async fn snapshot(&self) -> Result<Snapshot, DbError> {
            let mut conn = self.backend().pool().get_conn().await.map_err(db_error)?;
            let mut opts = TxOpts::default();
            opts.with_consistent_snapshot(true);
            let mut tx = conn.start_transaction(opts).await.map_err(db_error)?;
            let ledger: Vec<(Vec<u8>, Vec<u8>)> = tx
                .query("SELECT k, step FROM nf_ledger ORDER BY id")
                .await
                .map_err(db_error)?;
            type HistoryRow = (Vec<u8>, Option<Vec<u8>>, Vec<u8>);
            let history: Vec<HistoryRow> = tx
                .query("SELECT k, seen, point FROM nf_history ORDER BY id")
                .await
                .map_err(db_error)?;
            let requests: Vec<Row> = tx
                .query(
                    "SELECT request_key, CAST(status AS SIGNED), response FROM idem_request_result",
                )
                .await
                .map_err(db_error)?;
            let messages: Vec<Vec<u8>> = tx
                .query("SELECT message_id FROM idem_processed_message")
                .await
                .map_err(db_error)?;
            let runs: Vec<Row> = tx
                .query("SELECT request_key, point, CAST(status AS SIGNED), response FROM idem_run")
                .await
                .map_err(db_error)?;
            let outbox: Vec<(Vec<u8>, i64)> = tx
                .query("SELECT message_id, sent_at IS NOT NULL FROM idem_outbox ORDER BY id")
                .await
                .map_err(db_error)?;
            tx.rollback().await.map_err(db_error)?;
            Ok(Snapshot {
                ledger: ledger
                    .into_iter()
                    .map(|(k, s)| (text(Some(k)), text(Some(s))))
                    .collect(),
                history: history
                    .into_iter()
                    .map(|(k, seen, p)| (text(Some(k)), seen.map(|s| text(Some(s))), text(Some(p))))
                    .collect(),
                requests: requests
                    .into_iter()
                    .map(|mut r| RequestRow {
                        key: text(r.take(0)),
                        status: r.take::<Option<i64>, _>(1).flatten(),
                        response: r.take::<Option<String>, _>(2).flatten(),
                    })
                    .collect(),
                messages: messages.into_iter().map(|m| text(Some(m))).collect(),
                runs: runs
                    .into_iter()
                    .map(|mut r| RunRow {
                        key: text(r.take(0)),
                        point: text(r.take(1)),
                        status: r.take::<Option<i64>, _>(2).flatten(),
                        response: r.take::<Option<String>, _>(3).flatten(),
                    })
                    .collect(),
                outbox: outbox
                    .into_iter()
                    .map(|(m, sent)| OutboxRow {
                        message_id: text(Some(m)),
                        sent: sent != 0,
                    })
                    .collect(),
            })
        }

        async fn unsent(&self) -> Result<u64, DbError> {
            let mut conn = self.backend().pool().get_conn().await.map_err(db_error)?;
            let n: Option<u64> = conn
                .query_first("SELECT COUNT(*) FROM idem_outbox WHERE sent_at IS NULL")
                .await
                .map_err(db_error)?;
            Ok(n.unwrap_or(0))
        }
    }
}
