//! The MySQL/MariaDB fixture.

use idem::core::{BoxFuture, DbError, ErrorKind, Maintenance};
use idem::mysql::mysql_async::prelude::Queryable;
use idem::mysql::mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, Row};
use idem::mysql::{MysqlBackend, MysqlTx, db_error, parse_url};

use crate::bank::{Balance, Bank, BankError, Capabilities};

/// The worked example's account table, in MySQL/MariaDB.
pub const CREATE_ACCOUNT: &str = "CREATE TABLE IF NOT EXISTS idem_demo_account (\
    account_id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0)) ENGINE=InnoDB";

/// The card-charge example's orders, in MySQL/MariaDB (`order_id` from `AUTO_INCREMENT`).
pub const CREATE_ORDER: &str = "CREATE TABLE IF NOT EXISTS idem_demo_order (\
    order_id BIGINT AUTO_INCREMENT PRIMARY KEY, principal VARCHAR(255) NOT NULL, \
    amount BIGINT NOT NULL CHECK (amount > 0), \
    status VARCHAR(16) NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid', 'failed')), \
    charge_id VARCHAR(255) NULL) ENGINE=InnoDB";

/// The fixture: a backend and, with a namespace, a private database.
#[derive(Debug)]
pub struct MysqlBank {
    backend: MysqlBackend,
    /// The URL's options (its own database) and the private database's name.
    private_database: Option<(Opts, String)>,
}

fn bad(message: String) -> DbError {
    DbError::new("mysql", ErrorKind::Configuration, message)
}

/// Runs one statement on a short-lived single-connection pool of `opts`.
async fn admin(opts: &Opts, statement: String) -> Result<(), DbError> {
    let constraints = PoolConstraints::new(0, 1).ok_or_else(|| bad("pool constraints".into()))?;
    let pool = Pool::new(
        OptsBuilder::from_opts(opts.clone())
            .pool_opts(PoolOpts::default().with_constraints(constraints)),
    );
    let result = async {
        let mut conn = pool.get_conn().await?;
        conn.query_drop(statement).await
    }
    .await;
    let closed = pool.disconnect().await;
    result.map_err(db_error)?;
    closed.map_err(db_error)
}

async fn read_i64(tx: &mut MysqlTx, sql: &str, account: i64) -> Result<Option<i64>, DbError> {
    let row: Option<Row> = tx.exec_first(sql, (account,)).await.map_err(db_error)?;
    match row {
        None => Ok(None),
        Some(mut row) => match row.take_opt::<i64, usize>(0) {
            Some(Ok(v)) => Ok(Some(v)),
            _ => Err(DbError::new(
                "mysql",
                ErrorKind::Other,
                "balance is not an integer",
            )),
        },
    }
}

/// Debit or credit without `RETURNING`: a guarded `UPDATE`, its affected-row count, then
/// the balance read in the same transaction (its own write is visible to it).
fn effect(
    tx: &mut MysqlTx,
    account: i64,
    amount: i64,
    debit: bool,
) -> BoxFuture<'_, Result<Balance, BankError>> {
    Box::pin(async move {
        if debit {
            tx.exec_drop(
                "UPDATE idem_demo_account SET balance = balance - ? WHERE account_id = ? AND balance >= ?",
                (amount, account, amount),
            )
            .await
        } else {
            tx.exec_drop(
                "UPDATE idem_demo_account SET balance = balance + ? WHERE account_id = ?",
                (amount, account),
            )
            .await
        }
        .map_err(db_error)?;
        let changed = tx.affected_rows() == 1;
        let balance = read_i64(
            tx,
            "SELECT balance FROM idem_demo_account WHERE account_id = ?",
            account,
        )
        .await?;
        match balance {
            None => Err(BankError::NoAccount(account)),
            // A zero amount changes nothing and is not a refusal.
            Some(balance) if changed || amount == 0 => Ok(Balance { balance }),
            Some(_) => Err(BankError::Insufficient),
        }
    })
}

/// How [`MysqlBank`]'s `server_version` starts on a Galera node.
pub const GALERA_PREFIX: &str = "MariaDB Galera node";

impl Bank for MysqlBank {
    type B = MysqlBackend;
    const ENGINE: &'static str = "mysql";

    fn report_engine(server: &str) -> &'static str {
        if server.starts_with(GALERA_PREFIX) {
            "galera"
        } else {
            Self::ENGINE
        }
    }

    async fn connect(url: &str, namespace: Option<&str>) -> Result<Self, DbError> {
        let opts = parse_url(url)?;
        let Some(ns) = namespace else {
            return Ok(Self {
                backend: MysqlBackend::connect_with(opts).await?,
                private_database: None,
            });
        };
        if ns.is_empty()
            || ns.len() > 64
            || !ns
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(bad(format!("bad namespace {ns:?}")));
        }
        admin(
            &opts,
            format!("CREATE DATABASE {ns} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"),
        )
        .await?;
        let private = OptsBuilder::from_opts(opts.clone()).db_name(Some(ns));
        match MysqlBackend::connect_with(private).await {
            Ok(backend) => Ok(Self {
                backend,
                private_database: Some((opts, ns.to_owned())),
            }),
            Err(e) => {
                // Best effort: the connection error is the one to report.
                let _ = admin(&opts, format!("DROP DATABASE IF EXISTS {ns}")).await;
                Err(e)
            }
        }
    }

    fn backend(&self) -> &MysqlBackend {
        &self.backend
    }

    const DOCUMENTED: Capabilities = Capabilities {
        claim: "plain `INSERT` classified by error 1062 and bounded by `SET STATEMENT innodb_lock_wait_timeout = N FOR` (MariaDB; on a single MariaDB server sent in one message with `START TRANSACTION`, values as hex literals, not on Galera; MySQL 8 saves and restores the session's value), then a locking re-read (`LOCK IN SHARE MODE`, REPEATABLE READ); placeholder completed before `COMMIT` (single MariaDB server: the completion, guarded, and `COMMIT` in one message: a failed guard sets `NOT NULL` `status` to `NULL`, error 1048, and stops the `COMMIT`; Galera sends `COMMIT` alone); a replay is one plain read that also reports a READ UNCOMMITTED session (whose rows are not replayed), MySQL pins READ COMMITTED first",
        key_columns: "`VARBINARY(255)` (byte equality; `utf8mb4_bin` would pad spaces)",
        json_storage: "`LONGTEXT` `utf8mb4_bin`, stored verbatim (compared as canonical text)",
        retried: "1213 deadlock, 1205 lock wait timeout (3572 NOWAIT on MySQL); a claim's 1205 after `innodb_lock_wait_timeout` = the wait bound answers InProgress instead",
        concurrent_sessions: true,
        versions: "MariaDB 10.11 (tested live here); MySQL 8.4 written for, not tested live here",
    };

    async fn server_version(&self) -> Result<String, DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        let row: Option<Row> = conn
            .query_first("SELECT VERSION()")
            .await
            .map_err(db_error)?;
        let version = row
            .and_then(|mut r| r.take_opt::<String, usize>(0))
            .and_then(Result::ok)
            .unwrap_or_default();
        // A Galera node: wsrep is on (MySQL has no such variable, so an error means no).
        let wsrep: Option<Row> = conn.query_first("SELECT @@wsrep_on").await.ok().flatten();
        let galera = wsrep
            .and_then(|mut r| r.take_opt::<i64, usize>(0))
            .and_then(Result::ok)
            == Some(1);
        if galera {
            let status = |name: &'static str| format!("SHOW STATUS LIKE '{name}'");
            let mut value = async |name| -> String {
                let row: Option<(String, String)> =
                    conn.query_first(status(name)).await.ok().flatten();
                row.map(|r| r.1).unwrap_or_default()
            };
            let provider = value("wsrep_provider_version").await;
            let size = value("wsrep_cluster_size").await;
            return Ok(format!(
                "{GALERA_PREFIX} {version}, Galera {provider}, cluster of {size}"
            ));
        }
        Ok(if version.contains("MariaDB") {
            format!("MariaDB {version}")
        } else {
            format!("MySQL {version}")
        })
    }

    async fn setup(&self) -> Result<(), DbError> {
        self.backend.migrate().await?;
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        conn.query_drop(CREATE_ACCOUNT).await.map_err(db_error)?;
        conn.query_drop(CREATE_ORDER).await.map_err(db_error)
    }

    async fn set_balance(&self, account: i64, balance: i64) -> Result<(), DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        conn.exec_drop(
            "INSERT INTO idem_demo_account (account_id, balance) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE balance = ?",
            (account, balance, balance),
        )
        .await
        .map_err(db_error)
    }

    async fn balance(&self, account: i64) -> Result<i64, DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        let row: Option<Row> = conn
            .exec_first(
                "SELECT balance FROM idem_demo_account WHERE account_id = ?",
                (account,),
            )
            .await
            .map_err(db_error)?;
        match row.map(|mut r| r.take_opt::<i64, usize>(0)) {
            Some(Some(Ok(balance))) => Ok(balance),
            Some(_) => Err(DbError::new(
                "mysql",
                ErrorKind::Other,
                "balance is not an integer",
            )),
            None => Err(DbError::new(
                "mysql",
                ErrorKind::Other,
                format!("no account {account}"),
            )),
        }
    }

    async fn find_balance(&self, account: i64) -> Result<Option<i64>, DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        let row: Option<Row> = conn
            .exec_first(
                "SELECT balance FROM idem_demo_account WHERE account_id = ?",
                (account,),
            )
            .await
            .map_err(db_error)?;
        match row.map(|mut r| r.take_opt::<i64, usize>(0)) {
            None => Ok(None),
            Some(Some(Ok(balance))) => Ok(Some(balance)),
            Some(_) => Err(DbError::new(
                "mysql",
                ErrorKind::Other,
                "balance is not an integer",
            )),
        }
    }

    fn debit(
        tx: &mut MysqlTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, true)
    }

    fn credit(
        tx: &mut MysqlTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, false)
    }

    fn create_order(
        tx: &mut MysqlTx,
        principal: String,
        amount: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        Box::pin(async move {
            tx.exec_drop(
                "INSERT INTO idem_demo_order (principal, amount, status) VALUES (?, ?, 'pending')",
                (principal, amount),
            )
            .await
            .map_err(db_error)?;
            // The id the INSERT generated, from its OK packet (LAST_INSERT_ID()).
            let id = match tx.last_insert_id() {
                Some(id) => Some(id),
                None => tx
                    .query_first::<u64, _>("SELECT LAST_INSERT_ID()")
                    .await
                    .map_err(db_error)?,
            };
            id.and_then(|id| i64::try_from(id).ok())
                .filter(|&id| id > 0)
                .ok_or_else(|| {
                    BankError::Db(DbError::new(
                        "mysql",
                        ErrorKind::Other,
                        "the order INSERT generated no id",
                    ))
                })
        })
    }

    fn pay_order(
        tx: &mut MysqlTx,
        order_id: i64,
        charge_id: String,
    ) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            // The status changes, so the changed-row count is the matched-row count.
            tx.exec_drop(
                "UPDATE idem_demo_order SET status = 'paid', charge_id = ? \
                 WHERE order_id = ? AND status = 'pending'",
                (charge_id, order_id),
            )
            .await
            .map_err(db_error)?;
            if tx.affected_rows() == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        })
    }

    fn fail_order(tx: &mut MysqlTx, order_id: i64) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            tx.exec_drop(
                "UPDATE idem_demo_order SET status = 'failed' \
                 WHERE order_id = ? AND status = 'pending'",
                (order_id,),
            )
            .await
            .map_err(db_error)?;
            if tx.affected_rows() == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        })
    }

    async fn count_orders(&self, status: &str) -> Result<u64, DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        let n: Option<u64> = conn
            .exec_first(
                "SELECT COUNT(*) FROM idem_demo_order WHERE status = ?",
                (status,),
            )
            .await
            .map_err(db_error)?;
        n.ok_or_else(|| DbError::new("mysql", ErrorKind::Other, "COUNT(*) returned no row"))
    }

    async fn insert_record_directly(
        &self,
        principal: &str,
        operation: &str,
        key: &str,
        request: &str,
        response: &str,
    ) -> Result<(), DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        conn.exec_drop(
            "INSERT INTO idem_request_result \
             (principal, operation, request_key, request, response, status, created_at, expires_at) \
             VALUES (?, ?, ?, ?, ?, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY)",
            (
                principal.as_bytes(),
                operation.as_bytes(),
                key.as_bytes(),
                request,
                response,
            ),
        )
        .await
        .map_err(db_error)
    }

    async fn count_records(&self) -> Result<u64, DbError> {
        let mut conn = self.backend.pool().get_conn().await.map_err(db_error)?;
        let row: Option<Row> = conn
            .query_first("SELECT COUNT(*) FROM idem_request_result")
            .await
            .map_err(db_error)?;
        match row.map(|mut r| r.take_opt::<u64, usize>(0)) {
            Some(Some(Ok(n))) => Ok(n),
            _ => Err(DbError::new(
                "mysql",
                ErrorKind::Other,
                "COUNT(*) returned no number",
            )),
        }
    }

    async fn close(self) -> Result<(), DbError> {
        self.backend.disconnect().await?;
        if let Some((opts, ns)) = self.private_database {
            admin(&opts, format!("DROP DATABASE {ns}")).await?;
        }
        Ok(())
    }
}
