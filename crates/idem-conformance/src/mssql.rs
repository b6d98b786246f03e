//! The SQL Server fixture.
//!
//! Namespace isolation: with a namespace, the fixture runs `CREATE DATABASE <ns>` on the
//! URL's database (usually `master`), connects idem to the new database, and in `close`
//! drops it (`ALTER DATABASE … SET SINGLE_USER WITH ROLLBACK IMMEDIATE`, then `DROP
//! DATABASE`), so cases run in parallel without seeing each other. The login needs
//! `CREATE DATABASE` permission (for example `dbcreator`). Databases are cheap on a
//! boxed SQL Server or in a container; on Azure SQL Database creating one is slow and
//! billed, so run the suite against SQL Server or Azure SQL Managed Instance.
//!
//! Not run live on this project's machines: expected from documentation.

use idem::core::{BoxFuture, DbError, ErrorKind, Maintenance};
use idem::mssql::tiberius::ToSql;
use idem::mssql::tiberius::error::Error as TdsError;
use idem::mssql::{MssqlBackend, MssqlClient, MssqlOptions, MssqlTx, db_error};

use crate::bank::{Balance, Bank, BankError, Capabilities};

/// The worked example's account table, in SQL Server.
pub const CREATE_ACCOUNT: &str = "IF OBJECT_ID(N'idem_demo_account', N'U') IS NULL \
    CREATE TABLE idem_demo_account (account_id bigint NOT NULL PRIMARY KEY, \
    balance bigint NOT NULL CONSTRAINT idem_demo_account_balance_ck CHECK (balance >= 0))";

/// The card-charge example's orders, in SQL Server (`order_id` from `IDENTITY`).
pub const CREATE_ORDER: &str = "IF OBJECT_ID(N'idem_demo_order', N'U') IS NULL \
    CREATE TABLE idem_demo_order (order_id bigint IDENTITY(1, 1) NOT NULL PRIMARY KEY, \
    principal nvarchar(255) NOT NULL, \
    amount bigint NOT NULL CONSTRAINT idem_demo_order_amount_ck CHECK (amount > 0), \
    status varchar(16) NOT NULL CONSTRAINT idem_demo_order_status_df DEFAULT 'pending' \
    CONSTRAINT idem_demo_order_status_ck CHECK (status IN ('pending', 'paid', 'failed')), \
    charge_id nvarchar(255) NULL)";

/// Runs an order's guarded status change; [`BankError::NoOrder`] unless exactly one
/// pending order changed.
async fn change_order(
    tx: &mut MssqlTx,
    sql: &str,
    params: &[&dyn ToSql],
    order_id: i64,
) -> Result<(), BankError> {
    let changed = tx
        .client()
        .execute(sql, params)
        .await
        .map_err(db_error)?
        .total();
    if changed == 1 {
        Ok(())
    } else {
        Err(BankError::NoOrder(order_id))
    }
}

/// The fixture: a backend and, with a namespace, a private database dropped by `close`.
#[derive(Debug)]
pub struct MssqlBank {
    backend: MssqlBackend,
    private_database: Option<(MssqlBackend, String)>,
}

fn effect(
    tx: &mut MssqlTx,
    account: i64,
    amount: i64,
    debit: bool,
) -> BoxFuture<'_, Result<Balance, BankError>> {
    Box::pin(async move {
        let sql = if debit {
            "UPDATE idem_demo_account SET balance = balance - @P2 OUTPUT inserted.balance \
             WHERE account_id = @P1 AND balance >= @P2"
        } else {
            "UPDATE idem_demo_account SET balance = balance + @P2 OUTPUT inserted.balance \
             WHERE account_id = @P1"
        };
        let client = tx.client();
        let row = client
            .query(sql, &[&account, &amount])
            .await
            .map_err(db_error)?
            .into_row()
            .await
            .map_err(db_error)?;
        if let Some(row) = row {
            let balance = row
                .try_get::<i64, _>(0)
                .map_err(db_error)?
                .ok_or_else(|| DbError::new("mssql", ErrorKind::Other, "NULL balance"))?;
            return Ok(Balance { balance });
        }
        let exists = client
            .query(
                "SELECT 1 FROM idem_demo_account WHERE account_id = @P1",
                &[&account],
            )
            .await
            .map_err(db_error)?
            .into_row()
            .await
            .map_err(db_error)?;
        Err(if exists.is_some() {
            BankError::Insufficient
        } else {
            BankError::NoAccount(account)
        })
    })
}

/// Runs one unparameterized batch, draining its results.
fn batch(
    sql: String,
) -> impl for<'c> FnOnce(&'c mut MssqlClient) -> BoxFuture<'c, Result<(), TdsError>> {
    move |c| {
        Box::pin(async move {
            c.simple_query(sql).await?.into_results().await?;
            Ok(())
        })
    }
}

fn check_namespace(ns: &str) -> Result<(), DbError> {
    let ok = !ns.is_empty()
        && ns.len() <= 100
        && ns
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(DbError::new(
            "mssql",
            ErrorKind::Configuration,
            format!("bad namespace {ns:?}"),
        ))
    }
}

/// `CREATE DATABASE`, retried a few times on 1807 ("could not obtain exclusive lock on
/// database 'model'"), which concurrent creations can hit.
async fn create_database(admin: &MssqlBackend, ns: &str) -> Result<(), DbError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match admin
            .interact(batch(format!("CREATE DATABASE [{ns}]")))
            .await
        {
            Err(e) if e.code() == Some("1807") && attempt < 5 => {
                tokio::time::sleep(std::time::Duration::from_millis(200 * attempt)).await;
            }
            other => return other,
        }
    }
}

async fn drop_database(admin: &MssqlBackend, ns: &str) -> Result<(), DbError> {
    admin
        .interact(batch(format!(
            "IF DB_ID(N'{ns}') IS NOT NULL BEGIN \
             ALTER DATABASE [{ns}] SET SINGLE_USER WITH ROLLBACK IMMEDIATE; \
             DROP DATABASE [{ns}]; END"
        )))
        .await
}

impl Bank for MssqlBank {
    type B = MssqlBackend;
    const ENGINE: &'static str = "mssql";

    async fn connect(url: &str, namespace: Option<&str>) -> Result<Self, DbError> {
        let Some(ns) = namespace else {
            return Ok(Self {
                backend: MssqlBackend::connect(url).await?,
                private_database: None,
            });
        };
        check_namespace(ns)?;
        let options = MssqlOptions::parse(url)?;
        let admin = MssqlBackend::connect_with(options.clone().max_connections(2)).await?;
        create_database(&admin, ns).await?;
        match MssqlBackend::connect_with(options.database(ns)).await {
            Ok(backend) => Ok(Self {
                backend,
                private_database: Some((admin, ns.to_owned())),
            }),
            Err(e) => {
                let _ = drop_database(&admin, ns).await;
                admin.close().await;
                Err(e)
            }
        }
    }

    fn backend(&self) -> &MssqlBackend {
        &self.backend
    }

    const DOCUMENTED: Capabilities = Capabilities {
        claim: "plain `INSERT` in READ COMMITTED, duplicate classified by 2627/2601 (waits for the \
                    holder of the key), then a separate re-read; no `MERGE`, no `IGNORE_DUP_KEY`; \
                    placeholder completed before `COMMIT`",
        key_columns: "`varbinary(255)` bound as bytes (string comparison pads trailing spaces even \
                          under BIN2; NUL refused before SQL)",
        json_storage: "`nvarchar(max)` (kept verbatim; compared as canonical text)",
        retried: "1205 deadlock victim, 1222 lock timeout, 3960/3961 snapshot conflicts \
                      (SNAPSHOT: an invisible winner is retried as a transient conflict); a claim's \
                      1222 after `SET LOCK_TIMEOUT` = the wait bound answers InProgress instead",
        concurrent_sessions: true,
        versions: "SQL Server 2019–2025: expected from documentation, not verified live here",
    };

    async fn server_version(&self) -> Result<String, DbError> {
        self.backend
            .interact(|c| {
                Box::pin(async move {
                    let row = c
                        .simple_query(
                            "SELECT CONCAT(N'SQL Server ', CAST(SERVERPROPERTY('ProductVersion') AS nvarchar(128)), \
                             N' (', CAST(SERVERPROPERTY('Edition') AS nvarchar(128)), N')')",
                        )
                        .await?
                        .into_row()
                        .await?;
                    Ok(row
                        .and_then(|r| r.get::<&str, _>(0).map(str::to_owned))
                        .unwrap_or_else(|| "SQL Server (unknown version)".to_owned()))
                })
            })
            .await
    }

    async fn setup(&self) -> Result<(), DbError> {
        self.backend.migrate().await?;
        self.backend
            .interact(batch(CREATE_ACCOUNT.to_owned()))
            .await?;
        self.backend.interact(batch(CREATE_ORDER.to_owned())).await
    }

    async fn set_balance(&self, account: i64, balance: i64) -> Result<(), DbError> {
        self.backend
            .interact(move |c| {
                Box::pin(async move {
                    c.execute(
                        "UPDATE idem_demo_account SET balance = @P2 WHERE account_id = @P1; \
                         IF @@ROWCOUNT = 0 INSERT INTO idem_demo_account (account_id, balance) VALUES (@P1, @P2)",
                        &[&account, &balance],
                    )
                    .await
                    .map(drop)
                })
            })
            .await
    }

    async fn balance(&self, account: i64) -> Result<i64, DbError> {
        let balance = self
            .backend
            .interact(move |c| {
                Box::pin(async move {
                    let row = c
                        .query(
                            "SELECT balance FROM idem_demo_account WHERE account_id = @P1",
                            &[&account],
                        )
                        .await?
                        .into_row()
                        .await?;
                    match row {
                        Some(row) => row.try_get::<i64, _>(0),
                        None => Ok(None),
                    }
                })
            })
            .await?;
        balance
            .ok_or_else(|| DbError::new("mssql", ErrorKind::Other, format!("no account {account}")))
    }

    async fn find_balance(&self, account: i64) -> Result<Option<i64>, DbError> {
        self.backend
            .interact(move |c| {
                Box::pin(async move {
                    let row = c
                        .query(
                            "SELECT balance FROM idem_demo_account WHERE account_id = @P1",
                            &[&account],
                        )
                        .await?
                        .into_row()
                        .await?;
                    match row {
                        Some(row) => row.try_get::<i64, _>(0),
                        None => Ok(None),
                    }
                })
            })
            .await
    }

    fn debit(
        tx: &mut MssqlTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, true)
    }

    fn credit(
        tx: &mut MssqlTx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>> {
        effect(tx, account, amount, false)
    }

    fn create_order(
        tx: &mut MssqlTx,
        principal: String,
        amount: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        Box::pin(async move {
            let row = tx
                .client()
                .query(
                    "INSERT INTO idem_demo_order (principal, amount, status) \
                     OUTPUT inserted.order_id VALUES (@P1, @P2, 'pending')",
                    &[&principal.as_str(), &amount],
                )
                .await
                .map_err(db_error)?
                .into_row()
                .await
                .map_err(db_error)?;
            row.and_then(|r| r.try_get::<i64, _>(0).ok().flatten())
                .ok_or_else(|| {
                    BankError::Db(DbError::new(
                        "mssql",
                        ErrorKind::Other,
                        "the order INSERT returned no id",
                    ))
                })
        })
    }

    fn pay_order(
        tx: &mut MssqlTx,
        order_id: i64,
        charge_id: String,
    ) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            change_order(
                tx,
                "SET NOCOUNT OFF; UPDATE idem_demo_order SET status = 'paid', charge_id = @P2 \
                 WHERE order_id = @P1 AND status = 'pending'",
                &[&order_id, &charge_id.as_str()],
                order_id,
            )
            .await
        })
    }

    fn fail_order(tx: &mut MssqlTx, order_id: i64) -> BoxFuture<'_, Result<(), BankError>> {
        Box::pin(async move {
            change_order(
                tx,
                "SET NOCOUNT OFF; UPDATE idem_demo_order SET status = 'failed' \
                 WHERE order_id = @P1 AND status = 'pending'",
                &[&order_id],
                order_id,
            )
            .await
        })
    }

    async fn count_orders(&self, status: &str) -> Result<u64, DbError> {
        let status = status.to_owned();
        let n = self
            .backend
            .interact(move |c| {
                Box::pin(async move {
                    let row = c
                        .query(
                            "SELECT COUNT_BIG(*) FROM idem_demo_order WHERE status = @P1",
                            &[&status.as_str()],
                        )
                        .await?
                        .into_row()
                        .await?;
                    Ok(row.and_then(|r| r.get::<i64, _>(0)).unwrap_or(0))
                })
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
        let (principal, operation, key) = (
            principal.as_bytes().to_vec(),
            operation.as_bytes().to_vec(),
            key.as_bytes().to_vec(),
        );
        let (request, response) = (request.to_owned(), response.to_owned());
        self.backend
            .interact(move |c| {
                Box::pin(async move {
                    c.execute(
                        "INSERT INTO idem_request_result (principal, operation, request_key, request, response) \
                         VALUES (@P1, @P2, @P3, @P4, @P5)",
                        &[&principal, &operation, &key, &request, &response],
                    )
                    .await
                    .map(drop)
                })
            })
            .await
    }

    async fn count_records(&self) -> Result<u64, DbError> {
        let n = self
            .backend
            .interact(|c| {
                Box::pin(async move {
                    let row = c
                        .simple_query("SELECT COUNT_BIG(*) FROM idem_request_result")
                        .await?
                        .into_row()
                        .await?;
                    Ok(row.and_then(|r| r.get::<i64, _>(0)).unwrap_or(0))
                })
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn close(self) -> Result<(), DbError> {
        self.backend.close().await;
        if let Some((admin, ns)) = self.private_database {
            let dropped = drop_database(&admin, &ns).await;
            admin.close().await;
            dropped?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_plain_identifiers() {
        assert!(check_namespace("idem_t_keys_are_byte_exact_123_abcdef").is_ok());
        assert!(check_namespace("").is_err());
        assert!(check_namespace("x]; DROP DATABASE master; --").is_err());
        assert!(check_namespace("Upper").is_err());
    }
}
