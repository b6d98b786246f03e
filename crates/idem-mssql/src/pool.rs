//! A small connection pool (tiberius has none): a semaphore bounds the connections,
//! idle ones wait in a list, and a connection goes back only when it is known to be in
//! sync with the server and outside any transaction.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{DbError, ErrorKind};
use tiberius::error::Error as TdsError;
use tiberius::{Client, Row, ToSql};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use crate::ENGINE;
use crate::error_codes::kind_of;
use crate::options::MssqlOptions;
use crate::sql;

/// The tiberius client idem's connections use.
pub type MssqlClient = Client<Compat<TcpStream>>;

/// A connection idle for longer than this is checked with `SELECT 1` before reuse.
const PING_AFTER: Duration = Duration::from_secs(30);

struct Idle {
    client: MssqlClient,
    since: Instant,
}

pub(crate) struct Pool {
    pub(crate) options: MssqlOptions,
    idle: Mutex<Vec<Idle>>,
    permits: Arc<Semaphore>,
    closed: AtomicBool,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("options", &self.options)
            .field("available", &self.permits.available_permits())
            .field("closed", &self.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

fn connect_error(addr: &str, kind: ErrorKind, detail: String) -> DbError {
    DbError::new(
        ENGINE,
        kind,
        format!("cannot connect to SQL Server at {addr}: {detail}"),
    )
}

/// Opens one connection: TCP, then TLS and login, all bounded by the connect timeout.
/// Follows one routing redirect (Azure SQL gateways).
pub(crate) async fn open(options: &MssqlOptions) -> Result<MssqlClient, DbError> {
    let mut options = options.clone();
    for _ in 0..2 {
        let addr = options.addr();
        let timeout = options.connect_timeout;
        let attempt = async {
            let (host, port) = options.endpoint();
            let tcp = TcpStream::connect((host, port)).await.map_err(|e| {
                connect_error(&addr, ErrorKind::Connection, e.to_string()).with_source(e)
            })?;
            // Latency only; a failure here changes nothing that matters.
            let _ = tcp.set_nodelay(true);
            Ok::<_, DbError>(Client::connect(options.config.clone(), tcp.compat_write()).await)
        };
        let outcome = match tokio::time::timeout(timeout, attempt).await {
            Ok(outcome) => outcome?,
            Err(_) => {
                return Err(connect_error(
                    &addr,
                    ErrorKind::Connection,
                    format!("no answer within {timeout:?} (connect timeout)"),
                ));
            }
        };
        match outcome {
            Ok(client) => return Ok(client),
            Err(TdsError::Routing { host, port }) => options.redirect(&host, port),
            Err(e) => {
                let kind = match &e {
                    TdsError::Server(t) => match kind_of(t.code()) {
                        ErrorKind::Other => ErrorKind::Connection,
                        kind => kind,
                    },
                    _ => ErrorKind::Connection,
                };
                let code = e.code();
                let err = connect_error(&addr, kind, e.to_string());
                let err = match code {
                    Some(n) => err.with_code(n.to_string()),
                    None => err,
                };
                return Err(err.with_source(e));
            }
        }
    }
    Err(connect_error(
        &options.addr(),
        ErrorKind::Connection,
        "the server redirected the connection more than once".into(),
    ))
}

impl Pool {
    pub(crate) fn new(options: MssqlOptions) -> Self {
        let max = options.max_connections.max(1);
        Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max)),
            closed: AtomicBool::new(false),
        }
    }

    /// Takes a connection: an idle one (checked if it idled long), or a new one.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<Lease, DbError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::Connection,
                "the connection pool is closed",
            ));
        }
        let wait = self.options.acquire_timeout;
        let permit =
            match tokio::time::timeout(wait, Arc::clone(&self.permits).acquire_owned()).await {
                Ok(Ok(permit)) => permit,
                Ok(Err(_)) => {
                    return Err(DbError::new(
                        ENGINE,
                        ErrorKind::Connection,
                        "the connection pool is closed",
                    ));
                }
                Err(_) => {
                    return Err(DbError::new(
                        ENGINE,
                        ErrorKind::Connection,
                        format!(
                            "no pooled connection to {} became free within {wait:?} (pool size {})",
                            self.options.addr(),
                            self.options.max_connections
                        ),
                    ));
                }
            };
        let mut permit = permit;
        loop {
            let idle = self.idle.lock().map(|mut v| v.pop()).unwrap_or(None);
            let Some(Idle { client, since }) = idle else {
                return self.fresh(permit).await;
            };
            let mut lease = Lease::new(client, permit, Arc::clone(self));
            if since.elapsed() < PING_AFTER || lease.batch(sql::PING).await.is_ok() {
                return Ok(lease);
            }
            // A stale connection (server restart, idle kill): close it, try the next.
            lease.broken = true;
            permit = lease.take_permit().ok_or_else(|| {
                DbError::new(ENGINE, ErrorKind::Other, "a lease lost its pool permit")
            })?;
        }
    }

    async fn fresh(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Result<Lease, DbError> {
        let client = open(&self.options).await?;
        Ok(Lease::new(client, permit, Arc::clone(self)))
    }

    /// Closes idle connections and refuses new leases; leased ones close when returned.
    pub(crate) async fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.permits.close();
        let idle = self
            .idle
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default();
        for Idle { client, .. } in idle {
            let _ = client.close().await;
        }
    }
}

/// A leased connection. It goes back to the pool on drop only when no request is in
/// flight, no transaction is open and no transport error was seen; otherwise it is
/// closed, which makes the server roll back whatever it had open.
pub(crate) struct Lease {
    client: Option<MssqlClient>,
    permit: Option<OwnedSemaphorePermit>,
    pool: Arc<Pool>,
    busy: bool,
    in_tx: bool,
    broken: bool,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("busy", &self.busy)
            .field("in_tx", &self.in_tx)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Lease {
    fn new(client: MssqlClient, permit: OwnedSemaphorePermit, pool: Arc<Pool>) -> Self {
        Self {
            client: Some(client),
            permit: Some(permit),
            pool,
            busy: false,
            in_tx: false,
            broken: false,
        }
    }

    fn take_permit(&mut self) -> Option<OwnedSemaphorePermit> {
        self.permit.take()
    }

    /// The connection. A lease holds it from creation until it is dropped.
    pub(crate) fn client(&mut self) -> &mut MssqlClient {
        self.client
            .as_mut()
            .expect("a lease holds its connection until it is dropped")
    }

    /// Marks the lease as inside a transaction the caller (an effect) drives.
    pub(crate) fn set_in_tx(&mut self, in_tx: bool) {
        self.in_tx = in_tx;
    }

    fn settle<T>(&mut self, result: Result<T, TdsError>) -> Result<T, TdsError> {
        match &result {
            // A server error arrives after the whole response was read: in sync.
            Ok(_) | Err(TdsError::Server(_)) => self.busy = false,
            Err(_) => self.broken = true,
        }
        result
    }

    /// Runs a parameterized statement; returns the rows it affected.
    pub(crate) async fn execute(
        &mut self,
        sql: &str,
        params: &[&dyn ToSql],
    ) -> Result<u64, TdsError> {
        self.busy = true;
        let result = self
            .client()
            .execute(sql, params)
            .await
            .map(tiberius::ExecuteResult::total);
        self.settle(result)
    }

    /// Runs a parameterized query; returns its first row.
    pub(crate) async fn query_row(
        &mut self,
        sql: &str,
        params: &[&dyn ToSql],
    ) -> Result<Option<Row>, TdsError> {
        self.busy = true;
        let result = match self.client().query(sql, params).await {
            Ok(stream) => stream.into_row().await,
            Err(e) => Err(e),
        };
        self.settle(result)
    }

    /// Runs a parameterized query; returns every row of its first result.
    pub(crate) async fn query_all(
        &mut self,
        sql: &str,
        params: &[&dyn ToSql],
    ) -> Result<Vec<Row>, TdsError> {
        self.busy = true;
        let result = match self.client().query(sql, params).await {
            Ok(stream) => stream.into_first_result().await,
            Err(e) => Err(e),
        };
        self.settle(result)
    }

    /// Runs an unparameterized batch; returns its first row, if any.
    pub(crate) async fn batch(&mut self, sql: &str) -> Result<Option<Row>, TdsError> {
        self.busy = true;
        let result = match self.client().simple_query(Cow::Borrowed(sql)).await {
            Ok(stream) => stream.into_row().await,
            Err(e) => Err(e),
        };
        self.settle(result)
    }

    /// Opens a transaction with `begin` (one of the `BEGIN_*` batches); returns the
    /// batch's first row (`@@TRANCOUNT` before `BEGIN`).
    pub(crate) async fn begin(&mut self, begin: &str) -> Result<Option<Row>, TdsError> {
        self.in_tx = true;
        self.batch(begin).await
    }

    /// Notes that a checked commit ended the transaction; the lease is reusable.
    pub(crate) fn mark_committed(&mut self) {
        self.in_tx = false;
    }

    /// Closes the connection when the lease is dropped instead of pooling it (its
    /// session state cannot be trusted).
    pub(crate) fn discard(&mut self) {
        self.broken = true;
    }

    /// Commits; the lease is reusable afterwards.
    pub(crate) async fn commit(&mut self) -> Result<(), TdsError> {
        self.batch(sql::COMMIT).await?;
        self.in_tx = false;
        Ok(())
    }

    /// Rolls back if a transaction is still open; the lease is reusable afterwards.
    pub(crate) async fn rollback(&mut self) -> Result<(), TdsError> {
        self.batch(sql::ROLLBACK).await?;
        self.in_tx = false;
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        if self.busy || self.in_tx || self.broken || self.pool.closed.load(Ordering::Acquire) {
            // Dropping the client closes the socket; the server rolls back.
            return;
        }
        if let Ok(mut idle) = self.pool.idle.lock() {
            idle.push(Idle {
                client,
                since: Instant::now(),
            });
        }
        // The permit (a field) is released after this, with the connection back idle.
    }
}
