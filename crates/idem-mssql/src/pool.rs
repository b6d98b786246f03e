//! The connection pool (tiberius has none): [deadpool](https://docs.rs/deadpool)'s
//! managed pool with SQL Server's manager. `create` opens a connection (bounded by the
//! connect timeout); `recycle`, at the next checkout, reuses a connection only when it
//! is known to be in sync with the server (no request was cut off) and outside any
//! transaction, and pings one that idled longer than 30 s. Returning a lease does no
//! I/O; a connection that fails the check is dropped, which closes its socket and makes
//! the server roll back whatever it had open. The claim itself checks `@@TRANCOUNT`
//! before `BEGIN` and at commit.

use std::borrow::Cow;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use deadpool::Runtime;
use deadpool::managed::{self, Metrics, Object, PoolError, RecycleError, RecycleResult};

use idem_core::{DbError, ErrorKind};
use tiberius::error::Error as TdsError;
use tiberius::{Client, Row, ToSql};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use crate::ENGINE;
use crate::error_codes::kind_of;
use crate::options::MssqlOptions;
use crate::sql;

/// The tiberius client idem's connections use.
pub type MssqlClient = Client<Compat<TcpStream>>;

/// A connection idle for longer than this is checked with `SELECT 1` before reuse.
const PING_AFTER: Duration = Duration::from_secs(30);

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

/// A pooled connection and what the pool must know before reusing it.
pub(crate) struct Conn {
    client: MssqlClient,
    /// A request was sent and its whole response not yet read (a cancelled call).
    busy: bool,
    /// A transaction this lease began is still open.
    in_tx: bool,
    /// A transport error was seen, or the session state cannot be trusted.
    broken: bool,
}

/// SQL Server's deadpool manager.
pub(crate) struct Manager {
    options: MssqlOptions,
}

impl managed::Manager for Manager {
    type Type = Conn;
    type Error = DbError;

    async fn create(&self) -> Result<Conn, DbError> {
        open(&self.options).await.map(|client| Conn {
            client,
            busy: false,
            in_tx: false,
            broken: false,
        })
    }

    async fn recycle(&self, conn: &mut Conn, metrics: &Metrics) -> RecycleResult<DbError> {
        match verdict(conn.busy, conn.in_tx, conn.broken, metrics.last_used()) {
            // Dropping it closes the socket; the server rolls back.
            Verdict::Discard => Err(RecycleError::message(
                "left inside a transaction, mid-request or after a transport error",
            )),
            Verdict::Reuse => Ok(()),
            // A stale connection (server restart, idle kill) is dropped; the pool tries
            // the next one or opens a new one.
            Verdict::Ping => {
                let ping = match conn.client.simple_query(Cow::Borrowed(sql::PING)).await {
                    Ok(stream) => stream.into_results().await.map(drop),
                    Err(e) => Err(e),
                };
                ping.map_err(|_| RecycleError::message("the idle connection did not answer a ping"))
            }
        }
    }
}

/// What `recycle` does with a returned connection.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Reuse,
    Ping,
    Discard,
}

/// A connection mid-request, inside a transaction or after a transport error is never
/// reused; one idle for [`PING_AFTER`] or longer is pinged first.
fn verdict(busy: bool, in_tx: bool, broken: bool, idle_for: Duration) -> Verdict {
    if busy || in_tx || broken {
        Verdict::Discard
    } else if idle_for >= PING_AFTER {
        Verdict::Ping
    } else {
        Verdict::Reuse
    }
}

pub(crate) struct Pool {
    pub(crate) options: MssqlOptions,
    pool: managed::Pool<Manager>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("Pool")
            .field("options", &self.options)
            .field("size", &status.size)
            .field("available", &status.available)
            .field("closed", &self.pool.is_closed())
            .finish_non_exhaustive()
    }
}

impl Pool {
    pub(crate) fn new(options: MssqlOptions) -> Result<Self, DbError> {
        let pool = managed::Pool::builder(Manager {
            options: options.clone(),
        })
        .max_size(options.max_connections.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.acquire_timeout))
        .build()
        .map_err(|e| {
            DbError::new(
                ENGINE,
                ErrorKind::Configuration,
                format!("cannot build the connection pool: {e}"),
            )
        })?;
        Ok(Self { options, pool })
    }

    /// Takes a connection: an idle one that passes `recycle`, or a new one, waiting at
    /// most the acquire timeout for a free slot. deadpool's checkout future holds
    /// tiberius's whole connect path (about 55 KiB): it is boxed, so that no future above
    /// it carries that size (`tests::checkout_future_is_boxed` in `lib.rs`), and built in
    /// the box (`Box::write` into an uninitialized one), since `Box::pin` would build it on
    /// the stack and copy it to the heap on every checkout.
    pub(crate) async fn acquire(&self) -> Result<Lease, DbError> {
        let checkout = Box::into_pin(Box::write(Box::new_uninit(), self.pool.get()));
        match checkout.await {
            Ok(obj) => Ok(Lease { obj }),
            Err(PoolError::Backend(e)) => Err(e),
            Err(PoolError::Timeout(_)) => Err(DbError::new(
                ENGINE,
                ErrorKind::Connection,
                format!(
                    "no pooled connection to {} became free within {:?} (the acquire timeout; \
                     max_connections {}); raise max_connections or acquire_timeout",
                    self.options.addr(),
                    self.options.acquire_timeout,
                    self.options.max_connections
                ),
            )),
            Err(PoolError::Closed) => Err(DbError::new(
                ENGINE,
                ErrorKind::Connection,
                "the connection pool is closed",
            )),
            Err(other) => Err(DbError::new(
                ENGINE,
                ErrorKind::Other,
                format!("connection pool: {other}"),
            )),
        }
    }

    /// Closes idle connections and refuses new leases; leased ones close when returned.
    pub(crate) fn close(&self) {
        self.pool.close();
    }
}

/// A leased connection. Dropping it only gives it back to the pool; the next checkout's
/// `recycle` decides from its flags whether it can be reused.
pub(crate) struct Lease {
    obj: Object<Manager>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("busy", &self.conn().busy)
            .field("in_tx", &self.conn().in_tx)
            .field("broken", &self.conn().broken)
            .finish_non_exhaustive()
    }
}

impl Lease {
    fn conn(&self) -> &Conn {
        self.obj.deref()
    }

    fn conn_mut(&mut self) -> &mut Conn {
        self.obj.deref_mut()
    }

    /// The connection.
    pub(crate) fn client(&mut self) -> &mut MssqlClient {
        &mut self.conn_mut().client
    }

    /// Marks the lease as inside a transaction the caller (an effect) drives.
    pub(crate) fn set_in_tx(&mut self, in_tx: bool) {
        self.conn_mut().in_tx = in_tx;
    }

    fn settle<T>(&mut self, result: Result<T, TdsError>) -> Result<T, TdsError> {
        let conn = self.conn_mut();
        match &result {
            // A server error arrives after the whole response was read: in sync.
            Ok(_) | Err(TdsError::Server(_)) => conn.busy = false,
            Err(_) => conn.broken = true,
        }
        result
    }

    /// Runs a parameterized statement; returns the rows it affected.
    pub(crate) async fn execute(
        &mut self,
        sql: &str,
        params: &[&dyn ToSql],
    ) -> Result<u64, TdsError> {
        self.conn_mut().busy = true;
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
        self.conn_mut().busy = true;
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
        self.conn_mut().busy = true;
        let result = match self.client().query(sql, params).await {
            Ok(stream) => stream.into_first_result().await,
            Err(e) => Err(e),
        };
        self.settle(result)
    }

    /// Runs an unparameterized batch; returns its first row, if any.
    pub(crate) async fn batch(&mut self, sql: &str) -> Result<Option<Row>, TdsError> {
        self.conn_mut().busy = true;
        let result = match self.client().simple_query(Cow::Borrowed(sql)).await {
            Ok(stream) => stream.into_row().await,
            Err(e) => Err(e),
        };
        self.settle(result)
    }

    /// Opens a transaction with `begin` (one of the `BEGIN_*` batches); returns the
    /// batch's first row (`@@TRANCOUNT` before `BEGIN`).
    pub(crate) async fn begin(&mut self, begin: &str) -> Result<Option<Row>, TdsError> {
        self.conn_mut().in_tx = true;
        self.batch(begin).await
    }

    /// Notes that a checked commit ended the transaction; the lease is reusable.
    pub(crate) fn mark_committed(&mut self) {
        self.conn_mut().in_tx = false;
    }

    /// Never reuse this connection: its session state cannot be trusted. It is dropped
    /// (closed) at its next checkout.
    pub(crate) fn discard(&mut self) {
        self.conn_mut().broken = true;
    }

    /// Commits; the lease is reusable afterwards.
    pub(crate) async fn commit(&mut self) -> Result<(), TdsError> {
        self.batch(sql::COMMIT).await?;
        self.conn_mut().in_tx = false;
        Ok(())
    }

    /// Rolls back if a transaction is still open; the lease is reusable afterwards.
    pub(crate) async fn rollback(&mut self) -> Result<(), TdsError> {
        self.batch(sql::ROLLBACK).await?;
        self.conn_mut().in_tx = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_clean_connections_are_reused_and_stale_ones_pinged() {
        let fresh = Duration::from_secs(1);
        assert_eq!(verdict(false, false, false, fresh), Verdict::Reuse);
        assert_eq!(verdict(false, false, false, PING_AFTER), Verdict::Ping);
        for (busy, in_tx, broken) in [
            (true, false, false),
            (false, true, false),
            (false, false, true),
            (true, true, true),
        ] {
            assert_eq!(
                verdict(busy, in_tx, broken, fresh),
                Verdict::Discard,
                "busy {busy}, in_tx {in_tx}, broken {broken}"
            );
            assert_eq!(verdict(busy, in_tx, broken, PING_AFTER), Verdict::Discard);
        }
    }
}
