//! What `idem bench` needs from an engine beyond the demo bank: the bare debit and read
//! through the same driver and pool, the seed's server-side function, and the growth
//! figures. Every value is bound by the driver; only the bench's own namespace name
//! (checked by the fixture: lowercase ASCII, digits, `_`) is part of SQL text.

use std::future::Future;

use idem::DbError;
use idem_conformance::Bank;

/// How the bench's pool is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PoolMode {
    /// Whatever idem's `connect` does.
    Idem,
    /// The driver's defaults: sqlx pings on every checkout, mysql_async resets the
    /// session (`COM_RESET_CONNECTION`) on every return.
    Driver,
    /// Neither the checkout ping nor the reset; the drivers still roll back a returned
    /// connection's open transaction (and drop it if that fails).
    Lean,
}

impl PoolMode {
    /// How a report names the pool set-up on `engine`.
    pub(crate) fn describe(self, engine: &str) -> &'static str {
        match (engine, self) {
            ("postgres", Self::Idem) => "idem's connect (sqlx defaults: a ping per checkout)",
            ("postgres", Self::Driver) => "PoolChecks::On (sqlx's ping per checkout)",
            ("postgres", Self::Lean) => "PoolChecks::Off: no ping per checkout",
            ("mysql", Self::Idem) => "idem's connect (no session reset per return)",
            ("mysql", Self::Driver) => "PoolChecks::On (COM_RESET_CONNECTION per return)",
            ("mysql", Self::Lean) => "PoolChecks::Off: no session reset per return",
            _ => "idem's connect",
        }
    }
}

/// PostgreSQL's claim style, as `--claim` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ClaimChoice {
    /// `ClaimStyle::Auto`: the key lock on a single server.
    Auto,
    /// `ClaimStyle::KeyLock`.
    KeyLock,
    /// `ClaimStyle::Placeholder`.
    Placeholder,
}

impl ClaimChoice {
    /// How a report names it.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Auto => "auto (the key lock on a single server)",
            Self::KeyLock => "key lock",
            Self::Placeholder => "placeholder",
        }
    }
}

/// The rows the growth mode inserts in one statement.
pub(crate) const FILL_CHUNK: u64 = 100_000;

/// A typical stored request and response (the seed's walkthrough).
pub(crate) const TYPICAL_REQUEST: &str = r#"{"amount":100}"#;
/// See [`TYPICAL_REQUEST`].
pub(crate) const TYPICAL_RESPONSE: &str = r#"{"balance":900}"#;

/// An engine `idem bench` can measure.
pub(crate) trait BenchEngine: Bank {
    /// The server-side equivalent of the seed's `debit_once`, if the engine has one.
    const FUNCTION: Option<&'static str>;
    /// Whether the engine is reached over TCP (round trips are counted through a proxy).
    const NETWORK: bool;
    /// Whether the engine runs a synchronous effect in one trip (path (h)).
    const SYNC_EFFECT: bool = false;

    /// Path (h): an idempotent debit of 1 with `key` whose effect is synchronous code;
    /// `true` when it executed (`false`: replayed).
    fn new_sync(
        _idem: &idem::Idem<Self::B>,
        _scope: &idem::Scope,
        _key: &idem::Key,
        _request: &idem::Request,
        _account: i64,
    ) -> impl Future<Output = Result<bool, String>> + Send {
        async { Err("no synchronous-effect call on this engine".to_owned()) }
    }

    /// A second backend on the fixture's private namespace with a pool of `pool`
    /// connections, set up as `mode` says.
    fn attach(
        url: &str,
        ns: &str,
        pool: usize,
        mode: PoolMode,
        claim: ClaimChoice,
    ) -> impl Future<Output = Result<Self::B, DbError>> + Send;

    /// Closes a backend made by [`BenchEngine::attach`].
    fn release(b: Self::B) -> impl Future<Output = ()> + Send;

    /// The demo bank's debit statements in an explicit transaction of their own.
    fn bare_debit(b: &Self::B, account: i64) -> impl Future<Output = Result<(), DbError>> + Send;

    /// A primary-key read of one balance.
    fn bare_read(b: &Self::B, account: i64) -> impl Future<Output = Result<i64, DbError>> + Send;

    /// Path (i), the floor: the bare debit and, in the same transaction, one plain
    /// `INSERT` of a finished record of idem's shape (`id`: principal, operation, key; the
    /// bench's request, the debit's balance as the response), no idem code. What writing
    /// the record with the effect costs the engine before any protocol runs.
    fn floor_debit(
        b: &Self::B,
        account: i64,
        id: [&str; 3],
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Path (j): the primary-key read of a stored, live record (`id`), the statement of
    /// idem's replay read, no idem code; `true` when it found the record.
    fn record_read(
        b: &Self::B,
        id: [&str; 3],
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Creates the seed's tables and function in the namespace, with `accounts` accounts.
    fn install_function(
        b: &Self::B,
        accounts: i64,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// One call of the seed's function with a new key.
    fn call_function(
        b: &Self::B,
        account: i64,
        key: &str,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Inserts `FILL_CHUNK` typical request records (rows `from..from + FILL_CHUNK`),
    /// created two days ago with the default retention of 24 hours: expired one day ago.
    /// `expires_at` is set explicitly: its column default (PostgreSQL: the clock + 24
    /// hours; SQLite: 0; MySQL/MariaDB: none) is not what idem writes.
    fn fill_expired(b: &Self::B, from: u64) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Bytes the request table uses, table plus indexes, as the engine reports it.
    fn stored_bytes(b: &Self::B) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// How [`BenchEngine::stored_bytes`] measures.
    const SIZE_METHOD: &'static str;
}

/// The request path (i) stores: the bench's own request, as idem stores it.
pub(crate) const FLOOR_REQUEST: &str = r#"{"amount":1}"#;

/// The response path (i) stores: the balance the debit returned.
pub(crate) fn floor_response(balance: Option<i64>) -> String {
    match balance {
        Some(b) => format!(r#"{{"balance":{b}}}"#),
        None => "null".to_owned(),
    }
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

#[cfg(feature = "postgres")]
mod postgres {
    use std::str::FromStr;

    use idem::postgres::sqlx;
    use idem::postgres::sqlx::postgres::PgConnectOptions;
    use idem::postgres::{ClaimStyle, PgBackend, db_error};
    use idem::{DbError, PoolChecks, PoolOptions};
    use idem_conformance::postgres::PgBank;

    use super::{
        BenchEngine, ClaimChoice, FILL_CHUNK, FLOOR_REQUEST, PoolMode, TYPICAL_REQUEST,
        TYPICAL_RESPONSE, floor_response, to_u64,
    };

    /// The seed chapter's schema and function, verbatim but for the table names.
    const SEED: &str = r#"
CREATE TABLE seed_account (
  account_id bigint PRIMARY KEY,
  balance bigint NOT NULL CHECK (balance >= 0)
);
CREATE TABLE seed_request_result (
  account_id bigint NOT NULL REFERENCES seed_account (account_id),
  operation text COLLATE "C" NOT NULL,
  request_key text COLLATE "C" NOT NULL,
  request jsonb NOT NULL,
  response jsonb NOT NULL,
  created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
  CONSTRAINT seed_request_result_pkey PRIMARY KEY (account_id, operation, request_key)
);
CREATE FUNCTION debit_once(p_account bigint, p_key text, p_amount bigint)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  supplied jsonb := jsonb_build_object('amount', p_amount);
  saved_request jsonb;
  reply jsonb;
  remaining bigint;
BEGIN
  IF p_key IS NULL OR p_key = '' OR p_amount IS NULL OR p_amount <= 0 THEN
    RAISE EXCEPTION 'key and positive amount required' USING ERRCODE = '22023';
  END IF;
  INSERT INTO seed_request_result (account_id, operation, request_key, request, response)
  VALUES (p_account, 'debit:v1', p_key, supplied, '{}'::jsonb)
  ON CONFLICT (account_id, operation, request_key) DO NOTHING;
  IF NOT FOUND THEN
    SELECT request, response INTO STRICT saved_request, reply
    FROM seed_request_result
    WHERE account_id = p_account AND operation = 'debit:v1' AND request_key = p_key;
    IF saved_request IS DISTINCT FROM supplied THEN
      RAISE EXCEPTION 'idempotency key reused with different request' USING ERRCODE = '22023';
    END IF;
    RETURN reply;
  END IF;
  UPDATE seed_account SET balance = balance - p_amount
  WHERE account_id = p_account AND balance >= p_amount
  RETURNING balance INTO remaining;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'insufficient balance' USING ERRCODE = 'P0001';
  END IF;
  reply := jsonb_build_object('balance', remaining);
  UPDATE seed_request_result SET response = reply
  WHERE account_id = p_account AND operation = 'debit:v1' AND request_key = p_key;
  RETURN reply;
END;
$$;
"#;

    /// Paths (a) and (i): the demo bank's debit in a transaction of its own and, for the
    /// floor, a finished record of idem's shape inserted before the `COMMIT`.
    async fn debit_then_record(
        b: &PgBackend,
        account: i64,
        record: Option<[&str; 3]>,
    ) -> Result<(), DbError> {
        let mut tx = b.pool().begin().await.map_err(db_error)?;
        let balance: Option<i64> = sqlx::query_scalar(
            "UPDATE idem_demo_account SET balance = balance - $2 WHERE account_id = $1 AND balance >= $2 RETURNING balance",
        )
        .bind(account)
        .bind(1_i64)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
        if let Some(id) = record {
            sqlx::query(
                "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, 0, clock_timestamp(), clock_timestamp() + interval '24 hours')",
            )
            .bind(id[0])
            .bind(id[1])
            .bind(id[2])
            .bind(FLOOR_REQUEST)
            .bind(floor_response(balance))
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        }
        tx.commit().await.map_err(db_error)
    }

    impl BenchEngine for PgBank {
        const FUNCTION: Option<&'static str> = Some("PL/pgSQL debit_once");
        const NETWORK: bool = true;
        const SIZE_METHOD: &'static str = "pg_total_relation_size (heap, TOAST and indexes)";

        async fn attach(
            url: &str,
            ns: &str,
            pool: usize,
            mode: PoolMode,
            claim: ClaimChoice,
        ) -> Result<PgBackend, DbError> {
            let options = PgConnectOptions::from_str(url)
                .map_err(db_error)?
                .options([("search_path", ns)]);
            let max = u32::try_from(pool).unwrap_or(u32::MAX);
            // The library's own options, as a user sets them.
            let style = match claim {
                ClaimChoice::Auto => ClaimStyle::Auto,
                ClaimChoice::KeyLock => ClaimStyle::KeyLock,
                ClaimChoice::Placeholder => ClaimStyle::Placeholder,
            };
            let backend = match mode {
                PoolMode::Idem => PgBackend::connect_with(options, max).await?,
                PoolMode::Driver | PoolMode::Lean => {
                    let checks = if mode == PoolMode::Driver {
                        PoolChecks::On
                    } else {
                        PoolChecks::Off
                    };
                    PgBackend::connect_pooled(options, PoolOptions::new(pool).checks(checks))
                        .await?
                }
            };
            Ok(backend.with_claim_style(style))
        }

        async fn release(b: PgBackend) {
            b.pool().close().await;
        }

        async fn bare_debit(b: &PgBackend, account: i64) -> Result<(), DbError> {
            debit_then_record(b, account, None).await
        }

        async fn bare_read(b: &PgBackend, account: i64) -> Result<i64, DbError> {
            sqlx::query_scalar("SELECT balance FROM idem_demo_account WHERE account_id = $1")
                .bind(account)
                .fetch_one(b.pool())
                .await
                .map_err(db_error)
        }

        async fn floor_debit(b: &PgBackend, account: i64, id: [&str; 3]) -> Result<(), DbError> {
            debit_then_record(b, account, Some(id)).await
        }

        async fn record_read(b: &PgBackend, id: [&str; 3]) -> Result<bool, DbError> {
            let row: Option<(String, Option<String>, i16)> = sqlx::query_as(
                "SELECT request, response, status FROM idem_request_result \
                 WHERE principal = $1 AND operation = $2 AND request_key = $3 AND expires_at > clock_timestamp()",
            )
            .bind(id[0])
            .bind(id[1])
            .bind(id[2])
            .fetch_optional(b.pool())
            .await
            .map_err(db_error)?;
            Ok(row.is_some())
        }

        async fn install_function(b: &PgBackend, accounts: i64) -> Result<(), DbError> {
            sqlx::raw_sql(SEED)
                .execute(b.pool())
                .await
                .map_err(db_error)?;
            sqlx::query(
                "INSERT INTO seed_account (account_id, balance) SELECT g, $2 FROM generate_series(1, $1::bigint) AS g",
            )
            .bind(accounts)
            .bind(i64::MAX / 4)
            .execute(b.pool())
            .await
            .map(drop)
            .map_err(db_error)
        }

        async fn call_function(b: &PgBackend, account: i64, key: &str) -> Result<(), DbError> {
            let _: String = sqlx::query_scalar("SELECT debit_once($1, $2, $3)::text")
                .bind(account)
                .bind(key)
                .bind(1_i64)
                .fetch_one(b.pool())
                .await
                .map_err(db_error)?;
            Ok(())
        }

        async fn fill_expired(b: &PgBackend, from: u64) -> Result<(), DbError> {
            let from = i64::try_from(from).unwrap_or(i64::MAX);
            let to = from + i64::try_from(FILL_CHUNK).unwrap_or(0) - 1;
            sqlx::query(
                "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                 SELECT 'account-' || (g % 1000), 'debit:v1', gen_random_uuid()::text, $3, $4, 0, \
                 t - interval '2 days', t - interval '1 day' \
                 FROM generate_series($1::bigint, $2::bigint) AS g, clock_timestamp() AS t",
            )
            .bind(from)
            .bind(to)
            .bind(TYPICAL_REQUEST)
            .bind(TYPICAL_RESPONSE)
            .execute(b.pool())
            .await
            .map(drop)
            .map_err(db_error)
        }

        async fn stored_bytes(b: &PgBackend) -> Result<u64, DbError> {
            let n: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('idem_request_result')")
                .fetch_one(b.pool())
                .await
                .map_err(db_error)?;
            Ok(to_u64(n))
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use idem::mysql::mysql_async::prelude::Queryable;
    use idem::mysql::mysql_async::{OptsBuilder, PoolConstraints, TxOpts};
    use idem::mysql::{MysqlBackend, db_error, parse_url};
    use idem::{DbError, PoolChecks, PoolOptions};
    use idem_conformance::mysql::MysqlBank;

    use super::{
        BenchEngine, ClaimChoice, FILL_CHUNK, FLOOR_REQUEST, PoolMode, TYPICAL_REQUEST,
        TYPICAL_RESPONSE, floor_response, to_u64,
    };

    /// The seed's tables on InnoDB. Unlike the PostgreSQL original there is no foreign
    /// key from the record to the account: on InnoDB its check takes a shared lock on
    /// the account row that the debit then needs exclusively, which deadlocks at 16
    /// clients (idem's own table has no foreign key either).
    const SEED_TABLES: [&str; 2] = [
        "CREATE TABLE seed_account (account_id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0)) ENGINE = InnoDB",
        "CREATE TABLE seed_request_result (account_id BIGINT NOT NULL, operation VARBINARY(255) NOT NULL, \
         request_key VARBINARY(255) NOT NULL, request LONGTEXT NOT NULL, response LONGTEXT NOT NULL, \
         created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), \
         PRIMARY KEY (account_id, operation, request_key)) ENGINE = InnoDB",
    ];

    /// The seed's `debit_once` as a stored procedure: the claim by a plain INSERT whose
    /// duplicate-key error (1062) is handled, a locking re-read, the debit and the
    /// completion, all in one transaction the procedure opens and commits.
    const SEED_PROCEDURE: &str = r"CREATE PROCEDURE debit_once(IN p_account BIGINT, IN p_key VARCHAR(255), IN p_amount BIGINT)
BEGIN
  DECLARE supplied LONGTEXT;
  DECLARE saved_request LONGTEXT;
  DECLARE reply LONGTEXT;
  DECLARE remaining BIGINT;
  DECLARE dup INT DEFAULT 0;
  DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
  IF p_key IS NULL OR p_key = '' OR p_amount IS NULL OR p_amount <= 0 THEN
    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'key and positive amount required';
  END IF;
  SET supplied = JSON_OBJECT('amount', p_amount);
  START TRANSACTION;
  BEGIN
    DECLARE CONTINUE HANDLER FOR 1062 SET dup = 1;
    INSERT INTO seed_request_result (account_id, operation, request_key, request, response)
    VALUES (p_account, 'debit:v1', p_key, supplied, '{}');
  END;
  IF dup = 1 THEN
    SELECT request, response INTO saved_request, reply FROM seed_request_result
    WHERE account_id = p_account AND operation = 'debit:v1' AND request_key = p_key
    LOCK IN SHARE MODE;
    COMMIT;
    IF saved_request <> supplied THEN
      SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = 'idempotency key reused with different request';
    END IF;
  ELSE
    UPDATE seed_account SET balance = balance - p_amount
    WHERE account_id = p_account AND balance >= p_amount;
    IF ROW_COUNT() = 0 THEN
      SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'insufficient balance';
    END IF;
    SELECT balance INTO remaining FROM seed_account WHERE account_id = p_account;
    SET reply = JSON_OBJECT('balance', remaining);
    UPDATE seed_request_result SET response = reply
    WHERE account_id = p_account AND operation = 'debit:v1' AND request_key = p_key;
    COMMIT;
  END IF;
  SELECT reply AS response;
END";

    /// Ten rows (0..9), cross-joined five times for 100 000 numbers.
    const DIGITS: &str = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 \
         UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)";

    /// Paths (a) and (i): the demo bank's debit statements in a transaction of their own
    /// and, for the floor, a finished record of idem's shape inserted before the `COMMIT`.
    async fn debit_then_record(
        b: &MysqlBackend,
        account: i64,
        record: Option<[&str; 3]>,
    ) -> Result<(), DbError> {
        let mut tx = b
            .pool()
            .start_transaction(TxOpts::default())
            .await
            .map_err(db_error)?;
        tx.exec_drop(
            "UPDATE idem_demo_account SET balance = balance - ? WHERE account_id = ? AND balance >= ?",
            (1_i64, account, 1_i64),
        )
        .await
        .map_err(db_error)?;
        let balance: Option<i64> = tx
            .exec_first(
                "SELECT balance FROM idem_demo_account WHERE account_id = ?",
                (account,),
            )
            .await
            .map_err(db_error)?;
        if let Some(id) = record {
            tx.exec_drop(
                "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                 VALUES (?, ?, ?, ?, ?, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 24 HOUR)",
                (
                    id[0].as_bytes(),
                    id[1].as_bytes(),
                    id[2].as_bytes(),
                    FLOOR_REQUEST,
                    floor_response(balance),
                ),
            )
            .await
            .map_err(db_error)?;
        }
        tx.commit().await.map_err(db_error)
    }

    impl BenchEngine for MysqlBank {
        const FUNCTION: Option<&'static str> = Some("stored procedure debit_once");
        const NETWORK: bool = true;
        const SIZE_METHOD: &'static str =
            "information_schema.tables data_length + index_length after ANALYZE TABLE";

        async fn attach(
            url: &str,
            ns: &str,
            pool: usize,
            mode: PoolMode,
            _claim: ClaimChoice,
        ) -> Result<MysqlBackend, DbError> {
            let opts = parse_url(url)?;
            let mut pool_opts = opts.pool_opts().clone();
            if let Some(c) = PoolConstraints::new(pool.min(10), pool) {
                pool_opts = pool_opts.with_constraints(c);
            }
            let opts = OptsBuilder::from_opts(opts)
                .db_name(Some(ns))
                .pool_opts(pool_opts);
            // The library's own option, as a user sets it.
            let checks = match mode {
                PoolMode::Idem => return MysqlBackend::connect_with(opts).await,
                PoolMode::Driver => PoolChecks::On,
                PoolMode::Lean => PoolChecks::Off,
            };
            MysqlBackend::connect_pooled(opts, PoolOptions::new(pool).checks(checks)).await
        }

        async fn release(b: MysqlBackend) {
            // Closing cannot fail in a way that changes the figures.
            let _ = b.disconnect().await;
        }

        async fn bare_debit(b: &MysqlBackend, account: i64) -> Result<(), DbError> {
            debit_then_record(b, account, None).await
        }

        async fn bare_read(b: &MysqlBackend, account: i64) -> Result<i64, DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            let v: Option<i64> = conn
                .exec_first(
                    "SELECT balance FROM idem_demo_account WHERE account_id = ?",
                    (account,),
                )
                .await
                .map_err(db_error)?;
            Ok(v.unwrap_or_default())
        }

        async fn floor_debit(b: &MysqlBackend, account: i64, id: [&str; 3]) -> Result<(), DbError> {
            debit_then_record(b, account, Some(id)).await
        }

        async fn record_read(b: &MysqlBackend, id: [&str; 3]) -> Result<bool, DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            let row: Option<(String, Option<String>, i16)> = conn
                .exec_first(
                    "SELECT request, response, status FROM idem_request_result \
                     WHERE principal = ? AND operation = ? AND request_key = ? AND expires_at > UTC_TIMESTAMP(6)",
                    (id[0].as_bytes(), id[1].as_bytes(), id[2].as_bytes()),
                )
                .await
                .map_err(db_error)?;
            Ok(row.is_some())
        }

        async fn install_function(b: &MysqlBackend, accounts: i64) -> Result<(), DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            for sql in SEED_TABLES {
                conn.query_drop(sql).await.map_err(db_error)?;
            }
            conn.query_drop(SEED_PROCEDURE).await.map_err(db_error)?;
            conn.exec_batch(
                "INSERT INTO seed_account (account_id, balance) VALUES (?, ?)",
                (1..=accounts).map(|a| (a, i64::MAX / 4)),
            )
            .await
            .map_err(db_error)
        }

        async fn call_function(b: &MysqlBackend, account: i64, key: &str) -> Result<(), DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            conn.exec_drop("CALL debit_once(?, ?, ?)", (account, key, 1_i64))
                .await
                .map_err(db_error)
        }

        async fn fill_expired(b: &MysqlBackend, from: u64) -> Result<(), DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            let sql = format!(
                "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                 SELECT CONCAT('account-', (? + n) % 1000), 'debit:v1', UUID(), ?, ?, 0, \
                 UTC_TIMESTAMP(6) - INTERVAL 2 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 DAY \
                 FROM (SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n \
                 FROM {DIGITS} a, {DIGITS} b, {DIGITS} c, {DIGITS} e, {DIGITS} f) AS g WHERE n < ?"
            );
            conn.exec_drop(sql, (from, TYPICAL_REQUEST, TYPICAL_RESPONSE, FILL_CHUNK))
                .await
                .map_err(db_error)
        }

        async fn stored_bytes(b: &MysqlBackend) -> Result<u64, DbError> {
            let mut conn = b.pool().get_conn().await.map_err(db_error)?;
            conn.query_drop("ANALYZE TABLE idem_request_result")
                .await
                .map_err(db_error)?;
            let n: Option<i64> = conn
                .query_first(
                    "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.tables \
                     WHERE table_schema = DATABASE() AND table_name = 'idem_request_result'",
                )
                .await
                .map_err(db_error)?;
            Ok(to_u64(n.unwrap_or_default()))
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use std::time::Duration;

    use idem::sqlite::rusqlite::{self, OptionalExtension, params};
    use idem::sqlite::{Location, SqliteBackend};
    use idem::{DbError, ErrorKind};
    use idem_conformance::sqlite::SqliteBank;

    use super::{
        BenchEngine, ClaimChoice, FILL_CHUNK, FLOOR_REQUEST, PoolMode, TYPICAL_REQUEST,
        TYPICAL_RESPONSE, floor_response, to_u64,
    };

    fn in_transaction<T>(
        c: &rusqlite::Connection,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        c.execute_batch("BEGIN IMMEDIATE")?;
        match f(c) {
            Ok(v) => c.execute_batch("COMMIT").map(|()| v),
            Err(e) => {
                // The first error is the one to report.
                let _ = c.execute_batch("ROLLBACK");
                Err(e)
            }
        }
    }

    /// Paths (a) and (i): the demo bank's debit in a transaction of its own and, for the
    /// floor, a finished record of idem's shape inserted before the `COMMIT`.
    async fn debit_then_record(
        b: &SqliteBackend,
        account: i64,
        record: Option<[String; 3]>,
    ) -> Result<(), DbError> {
        b.interact(move |c| {
            in_transaction(c, |c| {
                let balance = c
                    .prepare_cached(
                        "UPDATE idem_demo_account SET balance = balance - ?2 WHERE account_id = ?1 AND balance >= ?2 RETURNING balance",
                    )?
                    .query_row(params![account, 1_i64], |r| r.get::<_, i64>(0))
                    .optional()?;
                let Some(id) = record else {
                    return Ok(());
                };
                c.prepare_cached(
                    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, 0, CAST(unixepoch('subsec') * 1000000 AS INTEGER), \
                     CAST(unixepoch('subsec') * 1000000 AS INTEGER) + 86400000000)",
                )?
                .execute(params![id[0], id[1], id[2], FLOOR_REQUEST, floor_response(balance)])
                .map(drop)
            })
        })
        .await
    }

    impl BenchEngine for SqliteBank {
        const FUNCTION: Option<&'static str> = None;
        const NETWORK: bool = false;
        const SYNC_EFFECT: bool = true;

        async fn new_sync(
            idem: &idem::Idem<SqliteBackend>,
            scope: &idem::Scope,
            key: &idem::Key,
            request: &idem::Request,
            account: i64,
        ) -> Result<bool, String> {
            use idem::sqlite::ExecuteBlocking;
            idem.execute_blocking(scope, key, request, move |c| {
                idem_conformance::sqlite::move_balance(c, account, 1, true)
            })
            .await
            .map(|out| !out.is_replayed())
            .map_err(|e| e.to_string())
        }
        const SIZE_METHOD: &'static str =
            "dbstat: pages of the table and its indexes (page size included)";

        async fn attach(
            url: &str,
            ns: &str,
            pool: usize,
            _mode: PoolMode,
            _claim: ClaimChoice,
        ) -> Result<SqliteBackend, DbError> {
            // The fixture's private file: `<stem>-<namespace>.db` beside the URL's file.
            let Location::File(path) = Location::parse(url)? else {
                return Err(DbError::new(
                    "sqlite",
                    ErrorKind::Configuration,
                    "idem bench needs a database file (sqlite://bench.db), not sqlite::memory:",
                ));
            };
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "idem".into());
            let file = path.with_file_name(format!("{stem}-{ns}.db"));
            SqliteBackend::open_with(Location::File(file), pool, Duration::from_secs(5)).await
        }

        async fn release(b: SqliteBackend) {
            drop(b);
        }

        async fn bare_debit(b: &SqliteBackend, account: i64) -> Result<(), DbError> {
            debit_then_record(b, account, None).await
        }

        async fn bare_read(b: &SqliteBackend, account: i64) -> Result<i64, DbError> {
            b.interact(move |c| {
                c.prepare_cached("SELECT balance FROM idem_demo_account WHERE account_id = ?1")?
                    .query_row(params![account], |r| r.get::<_, i64>(0))
            })
            .await
        }

        async fn floor_debit(
            b: &SqliteBackend,
            account: i64,
            id: [&str; 3],
        ) -> Result<(), DbError> {
            debit_then_record(b, account, Some(id.map(str::to_owned))).await
        }

        async fn record_read(b: &SqliteBackend, id: [&str; 3]) -> Result<bool, DbError> {
            let id = id.map(str::to_owned);
            b.interact(move |c| {
                c.prepare_cached(
                    "SELECT request, response, status FROM idem_request_result \
                     WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 \
                     AND expires_at > CAST(unixepoch('subsec') * 1000000 AS INTEGER)",
                )?
                .query_row(params![id[0], id[1], id[2]], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                    ))
                })
                .optional()
                .map(|row| row.is_some())
            })
            .await
        }

        async fn install_function(_b: &SqliteBackend, _accounts: i64) -> Result<(), DbError> {
            Ok(())
        }

        async fn call_function(
            _b: &SqliteBackend,
            _account: i64,
            _key: &str,
        ) -> Result<(), DbError> {
            Err(DbError::new(
                "sqlite",
                ErrorKind::Configuration,
                "SQLite has no server-side functions to compare with",
            ))
        }

        async fn fill_expired(b: &SqliteBackend, from: u64) -> Result<(), DbError> {
            let from = i64::try_from(from).unwrap_or(i64::MAX);
            let count = i64::try_from(FILL_CHUNK).unwrap_or(0);
            b.interact(move |c| {
                in_transaction(c, |c| {
                    c.execute(
                        "WITH RECURSIVE g(n) AS (SELECT ?1 UNION ALL SELECT n + 1 FROM g WHERE n + 1 < ?1 + ?2) \
                         INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
                         SELECT 'account-' || (n % 1000), 'debit:v1', lower(hex(randomblob(16))), ?3, ?4, 0, \
                         t - 172800000000, t - 86400000000 \
                         FROM g, (SELECT CAST(unixepoch('subsec') * 1000000 AS INTEGER) AS t)",
                        params![from, count, TYPICAL_REQUEST, TYPICAL_RESPONSE],
                    )
                    .map(drop)
                })
            })
            .await
        }

        async fn stored_bytes(b: &SqliteBackend) -> Result<u64, DbError> {
            b.interact(|c| {
                c.query_row(
                    "SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = 'idem_request_result' \
                     OR name IN (SELECT name FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'idem_request_result')",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .await
            .map(to_u64)
        }
    }
}
