//! The connection pool of the backends on **blocking** drivers (rusqlite, the `oracle`
//! crate): [deadpool](https://docs.rs/deadpool)'s managed pool, with each driver call on
//! tokio's blocking pool.
//!
//! deadpool does the pooling: a semaphore bounds the connections, idle ones wait in a
//! queue, acquisition is bounded by a wait timeout ([`PoolOptions::acquire_timeout`]),
//! and a connection is checked by `recycle` at its next checkout, never in `Drop`. This
//! module adds only what a blocking driver needs around it:
//!
//! - every driver call, opening included, runs on [`tokio::task::spawn_blocking`], never on
//!   an async worker thread: a [`Lease`] hands its connection to the blocking pool for
//!   each [`Lease::run`];
//! - a connection left inside a transaction (a cancelled call, a panicking effect, an
//!   error path), or with a session setting a lease changed and never gave back
//!   ([`Manager::altered`]: Oracle's call timeout, when a claim's future is dropped), is
//!   reset by [`Manager::reset`] at its next checkout (on the blocking pool), and thrown
//!   away when that fails or the session is not [`reusable`](Manager::reusable);
//! - returning a lease does no I/O: whether the connection is clean is noted after each
//!   `run`, on the blocking thread, and only a connection that is not clean costs a
//!   round trip, at the next checkout;
//! - a panic of the closure given to [`Lease::run`] is re-raised, and the connection it
//!   panicked on is never reused;
//! - [`BlockingPool::close`] waits for every lease to come back; later leases fail with
//!   "connection pool closed".
//!
//! A caller that is already on a blocking thread and runs a whole call there
//! ([`on_this_thread`]: SQLite's `execute_blocking`) makes each [`Lease::run`] of that
//! thread call its closure in place, with the same checks, instead of handing it to
//! another blocking thread: one trip to the blocking pool per call instead of one per
//! statement.
//!
//! Why not deadpool-sync's `SyncWrapper`: its `Drop` calls `spawn_blocking(..).unwrap()`,
//! which panics when the last clone of a backend is dropped outside a Tokio runtime, and
//! its constructor panics when opening panics; the [`Blocking`] wrapper here drops the
//! connection inline when no runtime exists and never panics in `Drop`.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool::Runtime;
use deadpool::managed::{self, Metrics, Object, Pool, PoolError, RecycleError, RecycleResult};

use crate::error::{DbError, ErrorKind};

/// How long a checkout waits for a free connection by default.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// The pool settings every engine takes under the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolOptions {
    /// The most connections open at once (at least 1).
    pub max_connections: usize,
    /// How long a checkout waits for a free connection before it fails with
    /// [`ErrorKind::Connection`].
    pub acquire_timeout: Duration,
    /// The checks that cost a round trip per checkout or return (see [`PoolChecks`]).
    pub checks: PoolChecks,
}

/// The pool checks that cost a round trip per call, by engine. Every pool, whatever
/// this says, rolls back a connection returned inside a transaction and throws away one
/// that cannot be rolled back, so none is ever handed out inside a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PoolChecks {
    /// The engine's default: [`PoolChecks::On`] on PostgreSQL (a dead connection is
    /// found before a call uses it, and idem's fault suite relies on the ping's timing;
    /// see `docs/performance.md`), [`PoolChecks::Off`] on MySQL/MariaDB (unless the URL
    /// sets `reset_connection`). SQLite, SQL Server and Oracle check connections on the
    /// client, without a round trip, whatever this says.
    #[default]
    Default,
    /// PostgreSQL: sqlx pings every connection it hands out (`test_before_acquire`),
    /// one round trip per checkout. MySQL/MariaDB: mysql_async resets the session of
    /// every returned connection (`COM_RESET_CONNECTION`), which also empties its
    /// prepared-statement cache.
    On,
    /// Neither: a broken connection is found by the call that uses it (a connection
    /// error, which idem retries); on MySQL/MariaDB what an effect changed in its session
    /// (`SET SESSION`, user variables, temporary tables, named locks) carries over.
    Off,
}

impl PoolOptions {
    /// `max_connections` connections, waited for at most [`DEFAULT_ACQUIRE_TIMEOUT`],
    /// with the engine's default [`PoolChecks`].
    pub const fn new(max_connections: usize) -> Self {
        Self {
            max_connections,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            checks: PoolChecks::Default,
        }
    }

    /// Sets [`PoolOptions::checks`].
    #[must_use]
    pub const fn checks(mut self, checks: PoolChecks) -> Self {
        self.checks = checks;
        self
    }

    /// Sets [`PoolOptions::acquire_timeout`].
    #[must_use]
    pub const fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }
}

/// The per-driver knowledge of a [`BlockingPool`]: opening a connection and telling
/// whether it can be reused.
///
/// A manager is shared by the pool and its leases (behind an `Arc`), so it also holds
/// whatever opening a connection needs (a path, credentials, timeouts).
pub trait Manager: Send + Sync + 'static {
    /// The driver's connection.
    type Connection: Send + 'static;

    /// The engine name used in [`DbError`]s raised by the pool (`"sqlite"`, `"oracle"`).
    const ENGINE: &'static str;

    /// Opens a connection. Runs on the blocking pool.
    fn open(&self) -> Result<Self::Connection, DbError>;

    /// Whether `conn` has an open transaction (a client-side check, no round trip). Runs
    /// on the blocking pool after every [`Lease::run`].
    fn in_transaction(&self, conn: &Self::Connection) -> bool;

    /// Whether `conn` may be reused (a client-side health check, no round trip). Runs on
    /// the blocking pool after every [`Lease::run`]. `true` by default.
    fn reusable(&self, _conn: &Self::Connection) -> bool {
        true
    }

    /// Whether a lease changed a session setting of `conn` and did not give it back
    /// (Oracle: the call timeout a claim sets, when the claim's future was dropped before
    /// it restored it), so that [`Manager::reset`] must run before the connection is
    /// reused. A client-side check, no round trip; runs on the blocking pool after every
    /// [`Lease::run`]. `false` by default.
    fn altered(&self, _conn: &Self::Connection) -> bool {
        false
    }

    /// Ends the transaction a lease left open (a rollback) and gives back the session
    /// settings it changed ([`Manager::altered`]), so the connection can be reused;
    /// `false` when that failed, and the connection is then thrown away (the driver
    /// closes it on drop, which rolls back on the server). Runs on the blocking pool at
    /// the connection's next checkout. The default returns `false`.
    fn reset(&self, _conn: &Self::Connection) -> bool {
        false
    }
}

/// How many closures leases handed to tokio's blocking pool (see [`trips`]).
static TRIPS: AtomicU64 = AtomicU64::new(0);

/// How many times, since the process started, a [`Lease`] (or a checkout's check, or an
/// open) handed a closure to another thread of tokio's blocking pool: the blocking
/// engines' round trips, for `idem bench` and tests to count. Calls made in place
/// ([`on_this_thread`]) are not trips.
pub fn trips() -> u64 {
    TRIPS.load(Ordering::Relaxed)
}

thread_local! {
    /// Set by [`on_this_thread`]: this thread's leases run their closures in place.
    static IN_PLACE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every [`Lease::run`] (and every check at checkout) made by this thread
/// calling its closure in place, on this thread, instead of on another thread of the
/// blocking pool; afterwards the thread is as before (also when `f` panics).
///
/// For a caller that is itself on a blocking thread (inside
/// [`tokio::task::spawn_blocking`]) and drives a whole idem call there with
/// [`tokio::runtime::Handle::block_on`]: the call then costs one trip to the blocking
/// pool instead of one per statement. Never call it on an async worker thread: every
/// driver call would block that thread.
pub fn on_this_thread<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_PLACE.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(IN_PLACE.with(|p| p.replace(true)));
    f()
}

/// Runs `f` on a thread of tokio's blocking pool, as one trip (counted by [`trips`]),
/// with every [`Lease::run`] it makes there called in place ([`on_this_thread`]): a
/// whole call driven by `f` (with [`tokio::runtime::Handle::block_on`]) costs one trip.
///
/// # Errors
///
/// tokio's [`JoinError`](tokio::task::JoinError) when `f` panicked (re-raise it with
/// [`std::panic::resume_unwind`]) or the runtime is shutting down.
pub async fn in_one_trip<T, F>(f: F) -> Result<T, tokio::task::JoinError>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    TRIPS.fetch_add(1, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || on_this_thread(f)).await
}

/// A blocking connection behind a mutex, used only on tokio's blocking pool.
pub struct Blocking<C: Send + 'static> {
    conn: Arc<Mutex<Option<C>>>,
    /// No transaction open and healthy, as of the end of the last call.
    clean: Arc<AtomicBool>,
}

impl<C: Send + 'static> fmt::Debug for Blocking<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blocking")
            .field("clean", &self.clean.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<C: Send + 'static> Blocking<C> {
    /// Runs `f` on the blocking pool; `Ok(None)` when an earlier closure panicked on
    /// this connection (it is then never reused).
    async fn interact<T, F>(&self, f: F) -> Result<Option<T>, tokio::task::JoinError>
    where
        F: FnOnce(&C, &AtomicBool) -> T + Send + 'static,
        T: Send + 'static,
    {
        if IN_PLACE.with(Cell::get) {
            // The caller is on a blocking thread already ([`on_this_thread`]). A panic of
            // `f` unwinds from here and poisons the lock, as on another thread.
            let guard = match self.conn.lock() {
                Ok(guard) => guard,
                Err(_) => return Ok(None),
            };
            return Ok(guard.as_ref().map(|conn| f(conn, &self.clean)));
        }
        let (conn, clean) = (Arc::clone(&self.conn), Arc::clone(&self.clean));
        TRIPS.fetch_add(1, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || {
            // A poisoned lock: a closure panicked while it held the connection.
            let guard = conn.lock().ok()?;
            let conn = guard.as_ref()?;
            Some(f(conn, &clean))
        })
        .await
    }
}

impl<C: Send + 'static> Drop for Blocking<C> {
    /// Closes the connection on the blocking pool (inline outside a runtime); waits
    /// there for a call still running on it. No I/O on the dropping thread.
    fn drop(&mut self) {
        let conn = Arc::clone(&self.conn);
        let close = move || {
            let taken = match conn.lock() {
                Ok(mut guard) => guard.take(),
                Err(poisoned) => poisoned.into_inner().take(),
            };
            drop(taken);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(close)),
            Err(_) => close(),
        }
    }
}

/// deadpool's view of a [`Manager`].
struct Adapter<M: Manager>(Arc<M>);

impl<M: Manager> managed::Manager for Adapter<M> {
    type Type = Blocking<M::Connection>;
    type Error = DbError;

    async fn create(&self) -> Result<Self::Type, DbError> {
        let manager = Arc::clone(&self.0);
        TRIPS.fetch_add(1, Ordering::Relaxed);
        match tokio::task::spawn_blocking(move || manager.open()).await {
            Ok(Ok(conn)) => Ok(Blocking {
                conn: Arc::new(Mutex::new(Some(conn))),
                clean: Arc::new(AtomicBool::new(true)),
            }),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(DbError::new(
                M::ENGINE,
                ErrorKind::Other,
                format!("opening a connection failed: {e}"),
            )),
        }
    }

    async fn recycle(&self, obj: &mut Self::Type, _: &Metrics) -> RecycleResult<DbError> {
        if obj.clean.load(Ordering::Acquire) {
            return Ok(());
        }
        let manager = Arc::clone(&self.0);
        let reset = obj
            .interact(move |conn, clean| {
                let ok = manager.reusable(conn)
                    && (!(manager.in_transaction(conn) || manager.altered(conn))
                        || manager.reset(conn));
                clean.store(ok, Ordering::Release);
                ok
            })
            .await;
        match reset {
            Ok(Some(true)) => Ok(()),
            _ => Err(RecycleError::message(
                "left inside a transaction or with a changed session setting that could not be \
                 reset, broken, or lost to a panic",
            )),
        }
    }
}

/// A pool of up to `max_connections` blocking connections, opened lazily by a
/// [`Manager`].
///
/// Cloning is cheap and shares the pool.
pub struct BlockingPool<M: Manager> {
    pool: Pool<Adapter<M>>,
    manager: Arc<M>,
    options: PoolOptions,
}

impl<M: Manager> Clone for BlockingPool<M> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            manager: Arc::clone(&self.manager),
            options: self.options,
        }
    }
}

impl<M: Manager> fmt::Debug for BlockingPool<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("BlockingPool")
            .field("engine", &M::ENGINE)
            .field("max_size", &status.max_size)
            .field("size", &status.size)
            .field("available", &status.available)
            .field("acquire_timeout", &self.options.acquire_timeout)
            .finish_non_exhaustive()
    }
}

/// The error of a failed checkout, named for the engine.
fn checkout_error<M: Manager>(e: PoolError<DbError>, timeout: Duration) -> DbError {
    match e {
        PoolError::Backend(e) => e,
        PoolError::Timeout(_) => DbError::new(
            M::ENGINE,
            ErrorKind::Connection,
            format!(
                "no {} connection became free within the acquire timeout ({timeout:?}); raise                  max_connections or acquire_timeout, or hold connections for less time",
                M::ENGINE
            ),
        ),
        PoolError::Closed => DbError::new(M::ENGINE, ErrorKind::Other, "connection pool closed"),
        other => DbError::new(
            M::ENGINE,
            ErrorKind::Other,
            format!("connection pool: {other}"),
        ),
    }
}

impl<M: Manager> BlockingPool<M> {
    /// A pool of at most `options.max_connections` connections (at least 1). Nothing is
    /// opened until the first [`lease`](Self::lease).
    pub fn new(manager: M, options: PoolOptions) -> Result<Self, DbError> {
        let options = PoolOptions {
            max_connections: options.max_connections.max(1),
            ..options
        };
        let manager = Arc::new(manager);
        let pool = Pool::builder(Adapter(Arc::clone(&manager)))
            .max_size(options.max_connections)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(options.acquire_timeout))
            .build()
            .map_err(|e| {
                DbError::new(
                    M::ENGINE,
                    ErrorKind::Configuration,
                    format!("cannot build the connection pool: {e}"),
                )
            })?;
        Ok(Self {
            pool,
            manager,
            options,
        })
    }

    /// The manager this pool was built with.
    pub fn manager(&self) -> &M {
        &self.manager
    }

    /// The most connections leased at once.
    pub fn max_size(&self) -> usize {
        self.options.max_connections
    }

    /// The options this pool was built with.
    pub fn options(&self) -> PoolOptions {
        self.options
    }

    /// Waits (at most the acquire timeout) for a free slot, then takes an idle
    /// connection (rolled back first if it was left inside a transaction) or opens one
    /// on the blocking pool.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Connection`] when no connection came in time; "connection pool
    /// closed" ([`ErrorKind::Other`]) after [`close`](Self::close); the error of
    /// [`Manager::open`] when opening fails.
    pub async fn lease(&self) -> Result<Lease<M>, DbError> {
        let obj = self
            .pool
            .get()
            .await
            .map_err(|e| checkout_error::<M>(e, self.options.acquire_timeout))?;
        Ok(Lease {
            obj,
            manager: Arc::clone(&self.manager),
        })
    }

    /// Closes the pool: later leases, on this pool or its clones, fail with
    /// "connection pool closed"; idle connections are closed on the blocking pool, and
    /// this waits until every leased connection has come back and been closed too.
    pub async fn close(&self) {
        self.pool.close();
        // Bounded by the leases themselves, as before: a lease held forever keeps this
        // waiting, which is what "close waits for the leases" means.
        while self.pool.status().size > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// One leased connection, given back to the pool on drop (no I/O: a connection that
/// is not clean is rolled back or thrown away at its next checkout).
pub struct Lease<M: Manager> {
    obj: Object<Adapter<M>>,
    manager: Arc<M>,
}

impl<M: Manager> fmt::Debug for Lease<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("engine", &M::ENGINE)
            .field("clean", &self.obj.clean.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<M: Manager> Lease<M> {
    /// Runs `f` on the connection on the blocking pool, then notes there whether it is
    /// still clean (no open transaction, healthy). If an earlier call's future was
    /// dropped while its statement ran, this waits for that statement to end first.
    ///
    /// # Panics
    ///
    /// Re-raises a panic of `f`. The connection it panicked on is never reused, and a
    /// later call on the same lease panics too; so does a call after the runtime began
    /// shutting down (the blocking task was cancelled).
    pub async fn run<T, F>(&mut self, f: F) -> T
    where
        F: FnOnce(&M::Connection) -> T + Send + 'static,
        T: Send + 'static,
    {
        let manager = Arc::clone(&self.manager);
        let ran = self
            .obj
            .interact(move |conn, clean| {
                // Unclean until proven otherwise: a panic of `f` leaves it so.
                clean.store(false, Ordering::Release);
                let out = f(conn);
                let ok = manager.reusable(conn)
                    && !manager.in_transaction(conn)
                    && !manager.altered(conn);
                clean.store(ok, Ordering::Release);
                out
            })
            .await;
        match ran {
            Ok(Some(out)) => out,
            Ok(None) => panic!(
                "this {} connection was lost when an earlier closure on it panicked",
                M::ENGINE
            ),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("blocking {} task was cancelled: {e}", M::ENGINE),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::thread::ThreadId;

    use super::*;

    /// Counts what the pool does to its connections; no database involved.
    #[derive(Default)]
    struct Stats {
        opens: AtomicUsize,
        resets: AtomicUsize,
        drops: AtomicUsize,
        fail_next_open: AtomicBool,
        /// The threads `open`, `reset` and a connection's drop ran on.
        round_trip_threads: Mutex<Vec<ThreadId>>,
    }

    impl Stats {
        /// (opened, reset, dropped)
        fn get(&self) -> (usize, usize, usize) {
            (
                self.opens.load(SeqCst),
                self.resets.load(SeqCst),
                self.drops.load(SeqCst),
            )
        }

        fn round_trip_threads(&self) -> Vec<ThreadId> {
            self.round_trip_threads.lock().unwrap().clone()
        }

        fn note_thread(&self) {
            self.round_trip_threads
                .lock()
                .unwrap()
                .push(std::thread::current().id());
        }
    }

    struct Fake {
        stats: Arc<Stats>,
        can_reset: bool,
        /// How long `reset` takes (a round trip).
        delay: Duration,
    }

    struct FakeConn {
        id: usize,
        in_tx: AtomicBool,
        /// A session setting changed and not given back (Oracle's call timeout).
        altered: AtomicBool,
        healthy: AtomicBool,
        stats: Arc<Stats>,
    }

    impl Drop for FakeConn {
        fn drop(&mut self) {
            self.stats.note_thread();
            self.stats.drops.fetch_add(1, SeqCst);
        }
    }

    impl Manager for Fake {
        type Connection = FakeConn;
        const ENGINE: &'static str = "fake";

        fn open(&self) -> Result<FakeConn, DbError> {
            self.stats.note_thread();
            if self.stats.fail_next_open.swap(false, SeqCst) {
                return Err(DbError::new("fake", ErrorKind::Connection, "refused"));
            }
            Ok(FakeConn {
                id: self.stats.opens.fetch_add(1, SeqCst) + 1,
                in_tx: AtomicBool::new(false),
                altered: AtomicBool::new(false),
                healthy: AtomicBool::new(true),
                stats: Arc::clone(&self.stats),
            })
        }

        fn in_transaction(&self, conn: &FakeConn) -> bool {
            conn.in_tx.load(SeqCst)
        }

        fn reusable(&self, conn: &FakeConn) -> bool {
            conn.healthy.load(SeqCst)
        }

        fn altered(&self, conn: &FakeConn) -> bool {
            conn.altered.load(SeqCst)
        }

        fn reset(&self, conn: &FakeConn) -> bool {
            self.stats.note_thread();
            std::thread::sleep(self.delay);
            self.stats.resets.fetch_add(1, SeqCst);
            if self.can_reset {
                conn.in_tx.store(false, SeqCst);
                conn.altered.store(false, SeqCst);
            }
            self.can_reset
        }
    }

    fn pool(max_size: usize, can_reset: bool) -> (BlockingPool<Fake>, Arc<Stats>) {
        slow_pool(max_size, can_reset, Duration::ZERO)
    }

    fn slow_pool(
        max_size: usize,
        can_reset: bool,
        delay: Duration,
    ) -> (BlockingPool<Fake>, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        let manager = Fake {
            stats: Arc::clone(&stats),
            can_reset,
            delay,
        };
        let options = PoolOptions::new(max_size).acquire_timeout(Duration::from_secs(10));
        (BlockingPool::new(manager, options).unwrap(), stats)
    }

    /// Leases the pool and returns the connection's id and whether it is in a transaction.
    async fn which(pool: &BlockingPool<Fake>) -> (usize, bool) {
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| (c.id, c.in_tx.load(SeqCst))).await
    }

    async fn begin(lease: &mut Lease<Fake>) {
        lease.run(|c| c.in_tx.store(true, SeqCst)).await;
    }

    /// Lets the blocking pool finish what a drop handed to it.
    async fn settle(stats: &Stats, drops: usize) {
        for _ in 0..500 {
            if stats.drops.load(SeqCst) >= drops {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn idle_connections_are_reused() {
        let (pool, stats) = pool(4, true);
        for _ in 0..3 {
            assert_eq!(which(&pool).await, (1, false));
        }
        assert_eq!(stats.get(), (1, 0, 0), "one open, nothing closed");

        let a = pool.lease().await.expect("lease a");
        let mut b = pool.lease().await.expect("lease b");
        assert_eq!(b.run(|c| c.id).await, 2, "a held lease is not shared");
        drop((a, b));
        assert_eq!(stats.get(), (2, 0, 0));
        assert_eq!(pool.max_size(), 4);
    }

    /// A current-thread runtime: its only async worker is the test's own thread.
    #[tokio::test]
    async fn blocking_calls_never_run_on_an_async_worker() {
        let (pool, stats) = pool(1, true);
        let async_thread = std::thread::current().id();
        let mut lease = pool.lease().await.expect("lease");
        let ran_on = lease.run(|_| std::thread::current().id()).await;
        assert_ne!(
            ran_on, async_thread,
            "the driver call ran on the async worker"
        );
        begin(&mut lease).await;
        drop(lease);
        assert_eq!(which(&pool).await, (1, false), "reset at checkout");
        assert_eq!(stats.round_trip_threads().len(), 2, "open and reset");
        assert_off(&stats, async_thread, "open or reset");
        drop(pool);
        settle(&stats, 1).await;
        assert_eq!(stats.round_trip_threads().len(), 3, "and the close");
        assert_off(&stats, async_thread, "the close");
    }

    /// Every round trip so far ran off `async_thread`.
    fn assert_off(stats: &Stats, async_thread: ThreadId, what: &str) {
        assert!(
            stats
                .round_trip_threads()
                .iter()
                .all(|t| *t != async_thread),
            "{what} ran on the async worker"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_run_keeps_the_connection_for_the_next_call() {
        let (pool, stats) = pool(1, true);
        let mut lease = pool.lease().await.expect("lease");
        // A caller times out a slow statement: its future is dropped mid-flight.
        let slow = lease.run(|c| {
            std::thread::sleep(Duration::from_millis(500));
            c.id
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(10), slow)
                .await
                .is_err()
        );
        // The next call waits for that statement and gets the same connection.
        assert_eq!(lease.run(|c| c.id).await, 1);
        // Dropping a lease whose statement is still running gives the connection back;
        // its next checkout waits for the statement.
        let slow = lease.run(|c| {
            c.in_tx.store(true, SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            c.id
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(10), slow)
                .await
                .is_err()
        );
        drop(lease);
        assert_eq!(
            which(&pool).await,
            (1, false),
            "back in the pool, rolled back, then reused"
        );
        assert_eq!(stats.get(), (1, 1, 0), "no second connection was opened");
    }

    #[tokio::test]
    async fn an_open_transaction_is_reset_before_reuse() {
        let (pool, stats) = slow_pool(1, true, Duration::from_millis(50));
        let mut lease = pool.lease().await.expect("lease");
        begin(&mut lease).await;
        drop(lease);
        assert_eq!(stats.get(), (1, 0, 0), "no I/O when the lease is dropped");
        assert_eq!(which(&pool).await, (1, false), "reset, then reused");
        assert_eq!(stats.get(), (1, 1, 0));
    }

    /// A lease dropped after it changed a session setting and before it gave it back
    /// (Oracle: a claim cancelled once it set the call timeout, before any statement
    /// opened a transaction) comes back with the change; the pool resets it at the
    /// next checkout, so the next caller does not inherit it.
    #[tokio::test]
    async fn a_session_setting_left_changed_is_reset_before_reuse() {
        let (pool, stats) = pool(1, true);
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| c.altered.store(true, SeqCst)).await;
        drop(lease);
        assert_eq!(stats.get(), (1, 0, 0), "no I/O when the lease is dropped");
        let mut lease = pool.lease().await.expect("lease");
        let seen = lease.run(|c| (c.id, c.altered.load(SeqCst))).await;
        assert_eq!(
            seen,
            (1, false),
            "the same connection, its setting given back"
        );
        assert_eq!(stats.get(), (1, 1, 0), "one reset");
        drop(lease);

        // A setting changed and given back inside the lease costs nothing.
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| c.altered.store(true, SeqCst)).await;
        lease.run(|c| c.altered.store(false, SeqCst)).await;
        drop(lease);
        assert_eq!(which(&pool).await, (1, false));
        assert_eq!(stats.get(), (1, 1, 0), "no second reset");
    }

    #[tokio::test]
    async fn a_session_setting_that_cannot_be_given_back_throws_the_connection_away() {
        let (pool, stats) = pool(1, false);
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| c.altered.store(true, SeqCst)).await;
        drop(lease);
        assert_eq!(which(&pool).await, (2, false), "a fresh connection");
        settle(&stats, 1).await;
        assert_eq!(stats.get(), (2, 1, 1), "the first one was dropped");
    }

    #[tokio::test]
    async fn an_open_transaction_is_thrown_away_when_reset_fails() {
        let (pool, stats) = pool(1, false);
        let mut lease = pool.lease().await.expect("lease");
        begin(&mut lease).await;
        drop(lease);
        assert_eq!(which(&pool).await, (2, false), "a fresh connection");
        settle(&stats, 1).await;
        assert_eq!(stats.get(), (2, 1, 1), "the first one was dropped");
        assert_off(&stats, std::thread::current().id(), "the close");
    }

    #[tokio::test]
    async fn the_default_reset_throws_away_a_connection_left_in_a_transaction() {
        struct Minimal;
        impl Manager for Minimal {
            type Connection = Arc<AtomicBool>;
            const ENGINE: &'static str = "minimal";
            fn open(&self) -> Result<Arc<AtomicBool>, DbError> {
                Ok(Arc::new(AtomicBool::new(false)))
            }
            fn in_transaction(&self, conn: &Arc<AtomicBool>) -> bool {
                conn.load(SeqCst)
            }
        }
        let pool = BlockingPool::new(Minimal, PoolOptions::new(1)).unwrap();
        let mut lease = pool.lease().await.expect("lease");
        let first = lease.run(Arc::clone).await;
        lease.run(|c| c.store(true, SeqCst)).await;
        drop(lease);
        let mut lease = pool.lease().await.expect("lease");
        let second = lease.run(Arc::clone).await;
        assert!(!Arc::ptr_eq(&first, &second), "the first was not reused");
        drop(lease);
        for _ in 0..500 {
            if Arc::strong_count(&first) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(Arc::strong_count(&first), 1, "the first was dropped");
        assert_eq!(Arc::strong_count(&second), 2, "the second is idle");
    }

    #[tokio::test]
    async fn a_transaction_ended_inside_run_needs_no_reset() {
        let (pool, stats) = pool(1, false);
        let mut lease = pool.lease().await.expect("lease");
        begin(&mut lease).await;
        lease.run(|c| c.in_tx.store(false, SeqCst)).await;
        drop(lease);
        assert_eq!(which(&pool).await, (1, false));
        assert_eq!(stats.get(), (1, 0, 0));
    }

    #[tokio::test]
    async fn unhealthy_connections_are_thrown_away_not_reused() {
        let (pool, stats) = pool(1, true);
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| c.healthy.store(false, SeqCst)).await;
        drop(lease);
        assert_eq!(which(&pool).await, (2, false));
        settle(&stats, 1).await;
        assert_eq!(stats.get(), (2, 0, 1), "dropped without a reset");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_pool_size_bounds_concurrent_leases() {
        let (pool, stats) = pool(2, true);
        let a = pool.lease().await.expect("lease a");
        let b = pool.lease().await.expect("lease b");
        let third = tokio::time::timeout(Duration::from_millis(50), pool.lease()).await;
        assert!(third.is_err(), "a third lease while two are held");
        drop(a);
        let c = tokio::time::timeout(Duration::from_secs(5), pool.lease()).await;
        assert!(matches!(c, Ok(Ok(_))), "a slot was freed");
        drop((b, c));

        let active = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (pool, active, peak) = (pool.clone(), Arc::clone(&active), Arc::clone(&peak));
                tokio::spawn(async move {
                    let mut lease = pool.lease().await.expect("lease");
                    lease
                        .run(move |_| {
                            let now = active.fetch_add(1, SeqCst) + 1;
                            peak.fetch_max(now, SeqCst);
                            std::thread::sleep(Duration::from_millis(20));
                            active.fetch_sub(1, SeqCst);
                        })
                        .await;
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        assert!(peak.load(SeqCst) <= 2, "peak {}", peak.load(SeqCst));
        assert_eq!(stats.get(), (2, 0, 0), "never more than two opened");
    }

    #[tokio::test]
    async fn acquisition_is_bounded_with_a_clear_error() {
        let stats = Arc::new(Stats::default());
        let manager = Fake {
            stats: Arc::clone(&stats),
            can_reset: true,
            delay: Duration::ZERO,
        };
        let options = PoolOptions::new(1).acquire_timeout(Duration::from_millis(50));
        let pool = BlockingPool::new(manager, options).unwrap();
        let held = pool.lease().await.expect("lease");
        let err = tokio::time::timeout(Duration::from_secs(10), pool.lease())
            .await
            .expect("the acquire timeout bounds the wait")
            .expect_err("no free connection");
        assert_eq!((err.engine(), err.kind()), ("fake", ErrorKind::Connection));
        assert!(err.message().contains("acquire timeout"), "{err}");
        assert!(err.message().contains("max_connections"), "{err}");
        drop(held);
        assert_eq!(which(&pool).await, (1, false));
    }

    #[tokio::test]
    async fn a_panicking_closure_propagates_and_its_connection_is_not_reused() {
        let (pool, stats) = pool(1, true);
        let task = tokio::spawn({
            let pool = pool.clone();
            async move {
                let mut lease = pool.lease().await.expect("lease");
                let _: usize = lease
                    .run(|_| -> usize { panic!("boom in the driver call") })
                    .await;
            }
        });
        let err = task.await.expect_err("the panic propagates");
        let payload = err.into_panic();
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"boom in the driver call")
        );
        let next = tokio::time::timeout(Duration::from_secs(5), which(&pool)).await;
        assert_eq!(next.ok(), Some((2, false)), "the slot was released");
        settle(&stats, 1).await;
        assert_eq!(stats.get(), (2, 0, 1), "the first went down with f");
    }

    #[tokio::test]
    async fn open_errors_are_returned_and_release_the_slot() {
        let (pool, stats) = pool(1, true);
        stats.fail_next_open.store(true, SeqCst);
        let err = pool.lease().await.expect_err("open fails");
        assert_eq!(
            (err.engine(), err.kind(), err.message()),
            ("fake", ErrorKind::Connection, "refused")
        );
        assert_eq!(which(&pool).await, (1, false));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn close_waits_for_leases_then_closes_every_connection() {
        let (pool, stats) = pool(3, true);
        let held = pool.lease().await.expect("lease");
        let mut in_tx = pool.lease().await.expect("lease");
        begin(&mut in_tx).await;
        drop(pool.lease().await.expect("lease"));

        let closing = tokio::spawn({
            let pool = pool.clone();
            async move { pool.close().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!closing.is_finished(), "close returned with a lease out");
        drop(in_tx);
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), closing)
            .await
            .expect("close finishes once every lease is back")
            .expect("close task");
        settle(&stats, 3).await;
        assert_eq!(stats.get(), (3, 0, 3), "all three dropped");

        let err = pool.lease().await.expect_err("closed");
        assert_eq!(err.message(), "connection pool closed");
        assert_eq!((err.engine(), err.kind()), ("fake", ErrorKind::Other));
        pool.close().await;
    }

    #[test]
    fn dropping_outside_a_runtime_closes_inline_without_panicking() {
        let (pool, stats) = pool(1, true);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let lease = rt.block_on(async {
            let mut lease = pool.lease().await.expect("lease");
            begin(&mut lease).await;
            lease
        });
        drop(rt);
        drop(lease);
        assert_eq!(stats.get(), (1, 0, 0), "returned without I/O");
        drop(pool);
        assert_eq!(stats.get(), (1, 0, 1), "no runtime: closed here");
    }

    #[test]
    fn sizes_are_clamped_and_debug_names_the_engine() {
        let (pool, _) = pool(0, true);
        assert_eq!(pool.max_size(), 1);
        let text = format!("{pool:?}");
        assert!(
            text.contains("\"fake\"") && text.contains("max_size: 1"),
            "{text}"
        );
    }
}
