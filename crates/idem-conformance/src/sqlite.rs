//! The SQLite fixture.

use std::path::PathBuf;

use idem::core::{BoxFuture, DbError, ErrorKind, Maintenance};
use idem::sqlite::rusqlite::{self, OptionalExtension, params};
use idem::sqlite::{Location, SqliteBackend, SqliteTx, db_error};

use crate::bank::{Balance, Bank, BankError, Capabilities};

/// The worked example's account table, in SQLite.
pub const CREATE_ACCOUNT: &str = "CREATE TABLE IF NOT EXISTS idem_demo_account (\
    account_id INTEGER PRIMARY KEY, balance INTEGER NOT NULL CHECK (balance >= 0)) STRICT";

/// The card-charge example's orders, in SQLite.
pub const CREATE_ORDER: &str = "CREATE TABLE IF NOT EXISTS idem_demo_order (\
    order_id INTEGER PRIMARY KEY AUTOINCREMENT, principal TEXT NOT NULL, \
    amount INTEGER NOT NULL CHECK (amount > 0), \
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid', 'failed')), \
    charge_id TEXT NULL) STRICT";

/// The fixture: a backend and, with a namespace, a private database file.
#[derive(Debug)]
pub struct SqliteBank {
    backend: SqliteBackend,
    private_file: Option<PathBuf>,
}

fn namespaced(location: Location, namespace: Option<&str>) -> (Location, Option<PathBuf>) {
    match (location, namespace) {
        (Location::File(path), Some(ns)) => {
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "idem".into());
            let file = path.with_file_name(format!("{stem}-{ns}.db"));
            (Location::File(file.clone()), Some(file))
        }
        (location, _) => (location, None),
    }
}

fn run_effect(
    tx: &mut SqliteTx,
    account: i64,
    amount: i64,
    debit: bool,
) -> BoxFuture<'_, Result<Balance, BankError>> {
    Box::pin(tx.run(move |c| move_balance(c, account, amount, debit)))
}

/// The demo bank's debit (or credit) on a connection, as synchronous code: what an
/// effect runs through `SqliteTx::run` or `ExecuteBlocking::execute_blocking`.
pub fn move_balance(
    c: &rusqlite::Connection,
    account: i64,
    amount: i64,
    debit: bool,
) -> Result<Balance, BankError> {
    let sql = if debit {
        "UPDATE idem_demo_account SET balance = balance - ?2 WHERE account_id = ?1 AND balance >= ?2 RETURNING balance"
    } else {
        "UPDATE idem_demo_account SET balance = balance + ?2 WHERE account_id = ?1 RETURNING balance"
    };
    let updated = c
        .prepare_cached(sql)
        .and_then(|mut s| {
            s.query_row(params![account, amount], |r| r.get::<_, i64>(0))
                .optional()
        })
        .map_err(db_error)?;
    if let Some(balance) = updated {
        return Ok(Balance { balance });
    }
    let exists = c
        .query_row(
            "SELECT 1 FROM idem_demo_account WHERE account_id = ?1",
            [account],
            |_| Ok(()),
        )
        .optional()
        .map_err(db_error)?;
    Err(if exists.is_some() {
        BankError::Insufficient
    } else {
        BankError::NoAccount(account)
    })
}

impl Bank for SqliteBank {
    type B = SqliteBackend;
    const ENGINE: &'static str = "sqlite";
    // One writer: a second relay waits for the first instead of skipping its rows.
    const SKIP_LOCKED: bool = false;

    async fn connect(url: &str, namespace: Option<&str>) -> Result<Self, DbError> {
        let (location, private_file) = namespaced(Location::parse(url)?, namespace);
        // A private file for a test case may live in a directory not made yet.
        if let Some(dir) = private_file
            .as_deref()
            .and_then(|f| f.parent())
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir).map_err(|e| {
                DbError::new(
                    "sqlite",
                    ErrorKind::Connection,
                    format!("cannot create {}: {e}", dir.display()),
                )
            })?;
        }
        Ok(Self {
            backend: SqliteBackend::open(location).await?,
            private_file,
        })
    }

    fn backend(&self) -> &SqliteBackend {
        &self.backend
    }

    const DOCUMENTED: Capabilities = Capabilities {
        claim: "`BEGIN IMMEDIATE`, read the key, run the effect, write the record once (`INSERT … ON CONFLICT DO UPDATE` only replaces an expired record)",
        key_columns: "`TEXT` (BINARY collation: byte for byte), `STRICT` table",
        json_storage: "`TEXT` checked by `json_valid`",
        retried: "`SQLITE_BUSY` after the busy timeout (a claim waits at most the wait bound; the same key held by this process answers InProgress instead)",
        concurrent_sessions: true,
        versions: "SQLite 3 (bundled by rusqlite 0.39)",
    };

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            concurrent_sessions: self.backend.location() != &Location::Memory,
            ..Self::DOCUMENTED
        }
    }

    async fn server_version(&self) -> Result<String, DbError> {
        self.backend
            .interact(|c| c.query_row("SELECT 'SQLite ' || sqlite_version()", [], |r| r.get(0)))
            .await
    }

    async fn setup(&self) -> Result<(), DbError> {
        self.backend.migrate().await?;
        self.backend
            .interact(|c| {
                c.execute_batch(CREATE_ACCOUNT)?;
                c.execute_batch(CREATE_ORDER)
            })
            .await
    }

    async fn set_balance(&self, account: i64, balance: i64) -> Result<(), DbError> {
        self.backend
            .interact(move |c| {
                c.execute(
                    "INSERT INTO idem_demo_account (account_id, balance) VALUES (?1, ?2) \
                     ON CONFLICT (account_id) DO UPDATE SET balance = excluded.balance",
                    params![account, balance],
                )
                .map(drop)
            })
            .await
    }

    async fn balance(&self, account: i64) -> Result<i64, DbError> {
        self.backend
            .interact(move |c| {
                c.query_row(
                    "SELECT balance FROM idem_demo_account WHERE account_id = ?1",
                    [account],
                    |r| r.get(0),
                )
            })
            .await
    }

    async fn find_balance(&self, account: i64) -> Result<Option<i64>, DbError> {
        self.backend
            .interact(move |c| {
                c.query_row(
                    "SELECT balance FROM idem_demo_account WHERE account_id = ?1",
                    [account],
                    |r| r.get(0),
                )
                .optional()
            })
            .await
    }

    fn debit(
        tx: &mut SqliteTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        run_effect(tx, account, amount, true)
    }

    fn credit(
        tx: &mut SqliteTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        run_effect(tx, account, amount, false)
    }

    fn create_order(
        tx: &mut SqliteTx,
        principal: String,
        amount: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        Box::pin(tx.run(move |c| {
            c.query_row(
                "INSERT INTO idem_demo_order (principal, amount, status) \
                 VALUES (?1, ?2, 'pending') RETURNING order_id",
                params![principal, amount],
                |r| r.get::<_, i64>(0),
            )
            .map_err(|e| BankError::Db(db_error(e)))
        }))
    }

    fn pay_order(
        tx: &mut SqliteTx,
        order_id: i64,
        charge_id: String,
    ) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(tx.run(move |c| {
            let changed = c
                .execute(
                    "UPDATE idem_demo_order SET status = 'paid', charge_id = ?2 \
                     WHERE order_id = ?1 AND status = 'pending'",
                    params![order_id, charge_id],
                )
                .map_err(db_error)?;
            if changed == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        }))
    }

    fn fail_order(tx: &mut SqliteTx, order_id: i64) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(tx.run(move |c| {
            let changed = c
                .execute(
                    "UPDATE idem_demo_order SET status = 'failed' \
                     WHERE order_id = ?1 AND status = 'pending'",
                    [order_id],
                )
                .map_err(db_error)?;
            if changed == 1 {
                Ok(())
            } else {
                Err(BankError::NoOrder(order_id))
            }
        }))
    }

    async fn count_orders(&self, status: &str) -> Result<u64, DbError> {
        let status = status.to_owned();
        let n: i64 = self
            .backend
            .interact(move |c| {
                c.query_row(
                    "SELECT count(*) FROM idem_demo_order WHERE status = ?1",
                    [status],
                    |r| r.get(0),
                )
            })
            .await?;
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
        let row = [principal, operation, key, request, response].map(str::to_owned);
        self.backend
            .interact(move |c| {
                c.execute(
                    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, 0, 0)",
                    params![row[0], row[1], row[2], row[3], row[4]],
                )
                .map(drop)
            })
            .await
    }

    async fn count_records(&self) -> Result<u64, DbError> {
        let n: i64 = self
            .backend
            .interact(|c| c.query_row("SELECT count(*) FROM idem_request_result", [], |r| r.get(0)))
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn close(self) -> Result<(), DbError> {
        let Self {
            backend,
            private_file,
        } = self;
        drop(backend);
        if let Some(file) = private_file {
            for suffix in ["", "-wal", "-shm"] {
                let mut name = file.clone().into_os_string();
                name.push(suffix);
                let _ = std::fs::remove_file(name);
            }
        }
        Ok(())
    }
}
