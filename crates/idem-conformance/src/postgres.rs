//! The PostgreSQL fixture.

use std::str::FromStr;

use idem::core::{BoxFuture, DbError, ErrorKind, Maintenance};
use idem::postgres::sqlx::postgres::{PgConnectOptions, PgPool};
use idem::postgres::sqlx::{self, Row};
use idem::postgres::{ClaimStyle, PgBackend, PgTx, PurgeStyle, db_error};

use crate::bank::{Balance, Bank, BankError, Capabilities};

/// The worked example's account table, in PostgreSQL.
pub const CREATE_ACCOUNT: &str = "CREATE TABLE IF NOT EXISTS idem_demo_account (\
    account_id bigint PRIMARY KEY, balance bigint NOT NULL CHECK (balance >= 0))";

/// The card-charge example's orders, in PostgreSQL.
pub const CREATE_ORDER: &str = "CREATE TABLE IF NOT EXISTS idem_demo_order (\
    order_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, principal text NOT NULL, \
    amount bigint NOT NULL CHECK (amount > 0), \
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid', 'failed')), \
    charge_id text NULL)";

/// The fixture: a backend and, with a namespace, a private schema.
#[derive(Debug)]
pub struct PgBank {
    backend: PgBackend,
    private_schema: Option<(PgPool, String)>,
}

fn effect(
    tx: &mut PgTx,
    account: i64,
    amount: i64,
    debit: bool,
) -> BoxFuture<'_, Result<Balance, BankError>> {
    Box::pin(async move {
        let sql = if debit {
            "UPDATE idem_demo_account SET balance = balance - $2 WHERE account_id = $1 AND balance >= $2 RETURNING balance"
        } else {
            "UPDATE idem_demo_account SET balance = balance + $2 WHERE account_id = $1 RETURNING balance"
        };
        let updated: Option<i64> = sqlx::query_scalar(sql)
            .bind(account)
            .bind(amount)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
        if let Some(balance) = updated {
            return Ok(Balance { balance });
        }
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM idem_demo_account WHERE account_id = $1")
                .bind(account)
                .fetch_optional(&mut **tx)
                .await
                .map_err(db_error)?;
        Err(if exists.is_some() {
            BankError::Insufficient
        } else {
            BankError::NoAccount(account)
        })
    })
}

/// The claim style the fixture's backends use: `IDEM_POSTGRES_CLAIM_STYLE` = `auto` (or
/// unset: the backend's default), `key-lock` or `placeholder`, so that CI runs the cases
/// with each.
pub fn claim_style() -> Result<ClaimStyle, DbError> {
    match std::env::var("IDEM_POSTGRES_CLAIM_STYLE").as_deref() {
        Err(_) | Ok("" | "auto") => Ok(ClaimStyle::Auto),
        Ok("key-lock") => Ok(ClaimStyle::KeyLock),
        Ok("placeholder") => Ok(ClaimStyle::Placeholder),
        Ok(other) => Err(DbError::new(
            "postgres",
            ErrorKind::Configuration,
            format!("IDEM_POSTGRES_CLAIM_STYLE={other:?}: expected auto, key-lock or placeholder"),
        )),
    }
}

impl Bank for PgBank {
    type B = PgBackend;
    const ENGINE: &'static str = "postgres";

    async fn connect(url: &str, namespace: Option<&str>) -> Result<Self, DbError> {
        let Some(ns) = namespace else {
            return Ok(Self {
                backend: PgBackend::connect(url)
                    .await?
                    .with_claim_style(claim_style()?),
                private_schema: None,
            });
        };
        if ns.is_empty()
            || !ns
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(DbError::new(
                "postgres",
                ErrorKind::Configuration,
                format!("bad namespace {ns:?}"),
            ));
        }
        let options = PgConnectOptions::from_str(url).map_err(db_error)?;
        // Connecting through the backend probes first: an unreachable server fails at once.
        let admin = PgBackend::connect_with(options.clone(), 1)
            .await?
            .pool()
            .clone();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {ns}")))
            .execute(&admin)
            .await
            .map_err(db_error)?;
        let backend = PgBackend::connect_with(options.options([("search_path", ns)]), 40)
            .await?
            .with_claim_style(claim_style()?);
        Ok(Self {
            backend,
            private_schema: Some((admin, ns.to_owned())),
        })
    }

    fn backend(&self) -> &PgBackend {
        &self.backend
    }

    const DOCUMENTED: Capabilities = Capabilities {
        claim: "single server (`ClaimStyle::KeyLock`, the default): `BEGIN` and `pg_try_advisory_xact_lock` of the identity's 64-bit name in one message (a held name: one bounded wait, `lock_timeout` saved, set and restored inside that statement), then a `SELECT` of the record; no placeholder: the record is written once, complete, by the session's prepared `INSERT … ON CONFLICT (pk) DO UPDATE` (an expired record only), executed with `COMMIT` in one message, its guards failing on purpose with 23502 so the `COMMIT` never runs. `ClaimStyle::Placeholder` (Citus, CockroachDB, YugabyteDB): `INSERT … ON CONFLICT DO NOTHING` of a placeholder, a conflict re-read by a separate `SELECT` (READ COMMITTED), completed before `COMMIT`",
        key_columns: "`text COLLATE \"C\"` (byte order and equality)",
        json_storage: "`text`, kept verbatim (not `jsonb`, which rewrites numbers and refuses `\\u0000`)",
        retried: "40001 serialization failure, 40P01 deadlock; a claim's 55P03 after `lock_timeout` = the wait bound answers InProgress instead",
        concurrent_sessions: true,
        versions: "PostgreSQL 15 (tested live here); written for 15–18",
    };

    async fn server_version(&self) -> Result<String, DbError> {
        let v: String =
            sqlx::query_scalar("SELECT 'PostgreSQL ' || current_setting('server_version')")
                .fetch_one(self.backend.pool())
                .await
                .map_err(db_error)?;
        Ok(v)
    }

    async fn setup(&self) -> Result<(), DbError> {
        self.backend.migrate().await?;
        for create in [CREATE_ACCOUNT, CREATE_ORDER] {
            sqlx::raw_sql(create)
                .execute(self.backend.pool())
                .await
                .map_err(db_error)?;
        }
        Ok(())
    }

    async fn set_balance(&self, account: i64, balance: i64) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO idem_demo_account (account_id, balance) VALUES ($1, $2) \
             ON CONFLICT (account_id) DO UPDATE SET balance = EXCLUDED.balance",
        )
        .bind(account)
        .bind(balance)
        .execute(self.backend.pool())
        .await
        .map(drop)
        .map_err(db_error)
    }

    async fn balance(&self, account: i64) -> Result<i64, DbError> {
        sqlx::query("SELECT balance FROM idem_demo_account WHERE account_id = $1")
            .bind(account)
            .fetch_one(self.backend.pool())
            .await
            .and_then(|r| r.try_get(0))
            .map_err(db_error)
    }

    async fn find_balance(&self, account: i64) -> Result<Option<i64>, DbError> {
        sqlx::query_scalar("SELECT balance FROM idem_demo_account WHERE account_id = $1")
            .bind(account)
            .fetch_optional(self.backend.pool())
            .await
            .map_err(db_error)
    }

    fn debit(
        tx: &mut PgTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, true)
    }

    fn credit(
        tx: &mut PgTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, false)
    }

    fn create_order(
        tx: &mut PgTx,
        principal: String,
        amount: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        Box::pin(async move {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO idem_demo_order (principal, amount, status) \
                 VALUES ($1, $2, 'pending') RETURNING order_id",
            )
            .bind(principal)
            .bind(amount)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)?;
            Ok(id)
        })
    }

    fn pay_order(
        tx: &mut PgTx,
        order_id: i64,
        charge_id: String,
    ) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            let changed = sqlx::query(
                "UPDATE idem_demo_order SET status = 'paid', charge_id = $2 \
                 WHERE order_id = $1 AND status = 'pending'",
            )
            .bind(order_id)
            .bind(charge_id)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
            if changed.rows_affected() == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        })
    }

    fn fail_order(tx: &mut PgTx, order_id: i64) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            let changed = sqlx::query(
                "UPDATE idem_demo_order SET status = 'failed' \
                 WHERE order_id = $1 AND status = 'pending'",
            )
            .bind(order_id)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
            if changed.rows_affected() == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        })
    }

    async fn count_orders(&self, status: &str) -> Result<u64, DbError> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_demo_order WHERE status = $1")
            .bind(status)
            .fetch_one(self.backend.pool())
            .await
            .map_err(db_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn insert_record_directly(
        &self,
        principal: &str,
        operation: &str,
        key: &str,
        request: &str,
        response: &str,
    ) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO idem_request_result (principal, operation, request_key, request, response) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(principal)
        .bind(operation)
        .bind(key)
        .bind(request)
        .bind(response)
        .execute(self.backend.pool())
        .await
        .map(drop)
        .map_err(db_error)
    }

    async fn count_records(&self) -> Result<u64, DbError> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_request_result")
            .fetch_one(self.backend.pool())
            .await
            .map_err(db_error)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn close(self) -> Result<(), DbError> {
        self.backend.pool().close().await;
        if let Some((admin, ns)) = self.private_schema {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {ns} CASCADE")))
                .execute(&admin)
                .await
                .map_err(db_error)?;
            admin.close().await;
        }
        Ok(())
    }
}

/// The PostgreSQL fixture on a Citus coordinator (`tests/citus.rs`): before each case,
/// idem's tables in the case's schema are placed by [`PgBackend::distribute`] (request,
/// run and message tables distributed, the outbox a Citus local table on the
/// coordinator), and the demo's tables are distributed by their keys, so a debit writes
/// two shards of different co-location groups and commits with two-phase commit. Its
/// backend purges in the [`PurgeStyle::Distributed`] style.
#[derive(Debug)]
pub struct CitusBank(PgBank);

/// Distributes the demo's tables by their primary keys.
pub const DISTRIBUTE_DEMO: &str = "SELECT create_distributed_table('idem_demo_account', 'account_id'); \
     SELECT create_distributed_table('idem_demo_order', 'order_id')";

impl Bank for CitusBank {
    type B = PgBackend;
    const ENGINE: &'static str = "citus";

    async fn connect(url: &str, namespace: Option<&str>) -> Result<Self, DbError> {
        let mut bank = PgBank::connect(url, namespace).await?;
        bank.backend = bank.backend.with_purge_style(PurgeStyle::Distributed);
        Ok(Self(bank))
    }

    fn backend(&self) -> &PgBackend {
        &self.0.backend
    }

    const DOCUMENTED: Capabilities = Capabilities {
        claim: "as PostgreSQL, on the shard of the key's principal (or subscriber), with idem's tables distributed",
        key_columns: "`text COLLATE \"C\"`; `principal` / `subscriber` are the distribution columns",
        json_storage: "`text`, kept verbatim",
        retried: "40001, 40P01 (also from a shard)",
        concurrent_sessions: true,
        versions: "Citus 13.2 on PostgreSQL 15 (3 nodes, tested live here)",
    };

    async fn server_version(&self) -> Result<String, DbError> {
        sqlx::query_scalar(
            "SELECT 'PostgreSQL ' || current_setting('server_version') || coalesce(', Citus ' || \
             (SELECT extversion FROM pg_extension WHERE extname = 'citus'), ', no Citus')",
        )
        .fetch_one(self.0.backend.pool())
        .await
        .map_err(db_error)
    }

    async fn setup(&self) -> Result<(), DbError> {
        self.0.setup().await?;
        self.0.backend.distribute().await?;
        sqlx::raw_sql(DISTRIBUTE_DEMO)
            .execute(self.0.backend.pool())
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn set_balance(&self, account: i64, balance: i64) -> Result<(), DbError> {
        self.0.set_balance(account, balance).await
    }

    async fn balance(&self, account: i64) -> Result<i64, DbError> {
        self.0.balance(account).await
    }

    async fn find_balance(&self, account: i64) -> Result<Option<i64>, DbError> {
        self.0.find_balance(account).await
    }

    fn debit(
        tx: &mut PgTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        PgBank::debit(tx, account, amount)
    }

    fn credit(
        tx: &mut PgTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        PgBank::credit(tx, account, amount)
    }

    fn create_order(
        tx: &mut PgTx,
        principal: String,
        amount: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        PgBank::create_order(tx, principal, amount)
    }

    fn pay_order(
        tx: &mut PgTx,
        order_id: i64,
        charge_id: String,
    ) -> BoxFuture<'_, Result<(), BankError>> {
        PgBank::pay_order(tx, order_id, charge_id)
    }

    fn fail_order(tx: &mut PgTx, order_id: i64) -> BoxFuture<'_, Result<(), BankError>> {
        PgBank::fail_order(tx, order_id)
    }

    async fn count_orders(&self, status: &str) -> Result<u64, DbError> {
        self.0.count_orders(status).await
    }

    async fn insert_record_directly(
        &self,
        principal: &str,
        operation: &str,
        key: &str,
        request: &str,
        response: &str,
    ) -> Result<(), DbError> {
        self.0
            .insert_record_directly(principal, operation, key, request, response)
            .await
    }

    async fn count_records(&self) -> Result<u64, DbError> {
        self.0.count_records().await
    }

    async fn close(self) -> Result<(), DbError> {
        let PgBank {
            backend,
            private_schema,
        } = self.0;
        backend.pool().close().await;
        let Some((admin, ns)) = private_schema else {
            return Ok(());
        };
        // Concurrent `DROP SCHEMA`s whose tables share Citus's default co-location group
        // can deadlock on the coordinator (40P01, seen with two cases ending at once):
        // the loser drops again.
        let mut attempt = 0;
        let dropped = loop {
            attempt += 1;
            let result = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {ns} CASCADE")))
                .execute(&admin)
                .await
                .map_err(db_error);
            match result {
                Err(e) if attempt < 10 && e.kind() == ErrorKind::Deadlock => {
                    tokio::time::sleep(std::time::Duration::from_millis(50 * attempt)).await;
                }
                other => break other.map(drop),
            }
        };
        admin.close().await;
        dropped
    }
}
