//! A small connection pool for **blocking** drivers (rusqlite, the `oracle` crate),
//! shared by the backends that wrap them.
//!
//! Every driver call runs on tokio's blocking pool ([`tokio::task::spawn_blocking`]),
//! never on an async worker thread: a [`Lease`] moves its connection there for each
//! [`Lease::run`] and takes it back afterwards. The pool:
//!
//! - opens connections lazily (on the blocking pool), up to `max_size` at a time, and
//!   reuses idle ones;
//! - bounds concurrent leases with a semaphore: a lease holds one permit until its
//!   connection is back in the idle list or closed;
//! - gives a connection back on drop of its lease: as it is when it has no open
//!   transaction and [`Manager::reusable`] agrees; otherwise, on the blocking pool,
//!   after [`Manager::reset`] (rolling the transaction back) if that succeeds, or else
//!   through [`Manager::close`] (a round trip is never made on an async worker);
//! - re-raises a panic of the closure given to [`Lease::run`] (the connection is lost
//!   with it, and the lease's permit is released when the lease is dropped);
//! - closes ([`BlockingPool::close`]) by waiting for every lease to come back, then
//!   closing the idle connections; later leases fail with "connection pool closed".
//!
//! The engine-specific parts (how to open a connection, whether it is inside a
//! transaction, whether it still works, how to roll it back and close it) are the
//! hooks of the [`Manager`] trait.

use std::fmt;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{DbError, ErrorKind};

/// The per-driver hooks of a [`BlockingPool`]: opening, inspecting, resetting and
/// closing one kind of blocking connection.
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

    /// Whether `conn` has an open transaction. Runs on the blocking pool after every
    /// [`Lease::run`]; the answer decides how the connection is given back.
    fn in_transaction(&self, conn: &Self::Connection) -> bool;

    /// Whether `conn` may go back to the idle list (a health check). Called when a lease
    /// is dropped, possibly on an async worker thread, so it must not make a round trip.
    /// `true` by default.
    fn reusable(&self, _conn: &Self::Connection) -> bool {
        true
    }

    /// Ends the transaction a lease left open (a rollback), so the connection can be
    /// reused; `false` when that failed or is not supported, and the connection is then
    /// closed instead. Runs on the blocking pool (inline when no tokio runtime exists).
    /// The default returns `false`: a connection left inside a transaction is closed.
    fn reset(&self, _conn: &Self::Connection) -> bool {
        false
    }

    /// Closes a connection that is not reused, or an idle one when the pool closes. Runs
    /// on the blocking pool (inline when no tokio runtime exists). Drops it by default.
    fn close(&self, conn: Self::Connection) {
        drop(conn);
    }
}

struct Shared<M: Manager> {
    manager: M,
    idle: Mutex<Vec<M::Connection>>,
    permits: Arc<Semaphore>,
    max_size: usize,
}

impl<M: Manager> Shared<M> {
    /// Puts a connection back in the idle list (dropped if the list is poisoned).
    fn push_idle(&self, conn: M::Connection) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
    }

    /// Gives back a connection that needs a round trip first: reset when a transaction
    /// is open, closed when it cannot be reused. Blocking.
    fn give_back_blocking(&self, conn: M::Connection, in_transaction: bool) {
        let reusable =
            self.manager.reusable(&conn) && (!in_transaction || self.manager.reset(&conn));
        if reusable {
            self.push_idle(conn);
        } else {
            self.manager.close(conn);
        }
    }
}

/// A pool of up to `max_size` blocking connections, opened lazily by a [`Manager`].
///
/// Cloning is cheap and shares the pool.
pub struct BlockingPool<M: Manager> {
    shared: Arc<Shared<M>>,
}

impl<M: Manager> Clone for BlockingPool<M> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<M: Manager> fmt::Debug for BlockingPool<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockingPool")
            .field("engine", &M::ENGINE)
            .field("max_size", &self.shared.max_size)
            .field("available", &self.shared.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl<M: Manager> BlockingPool<M> {
    /// A pool of at most `max_size` connections (clamped to `1 ..= u32::MAX`). Nothing
    /// is opened until the first [`lease`](Self::lease).
    pub fn new(manager: M, max_size: usize) -> Self {
        let max_size = max_size
            .clamp(1, Semaphore::MAX_PERMITS)
            .min(usize::try_from(u32::MAX).unwrap_or(usize::MAX));
        Self {
            shared: Arc::new(Shared {
                manager,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(max_size)),
                max_size,
            }),
        }
    }

    /// The manager this pool was built with.
    pub fn manager(&self) -> &M {
        &self.shared.manager
    }

    /// The most connections leased at once.
    pub fn max_size(&self) -> usize {
        self.shared.max_size
    }

    /// Waits for a free slot, then takes an idle connection or opens one on the
    /// blocking pool.
    ///
    /// # Errors
    ///
    /// "connection pool closed" ([`ErrorKind::Other`]) after [`close`](Self::close);
    /// the error of [`Manager::open`] when opening fails.
    pub async fn lease(&self) -> Result<Lease<M>, DbError> {
        let permit = Arc::clone(&self.shared.permits)
            .acquire_owned()
            .await
            .map_err(|_| DbError::new(M::ENGINE, ErrorKind::Other, "connection pool closed"))?;
        let idle = self.shared.idle.lock().map(|mut v| v.pop()).unwrap_or(None);
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let shared = Arc::clone(&self.shared);
                tokio::task::spawn_blocking(move || shared.manager.open())
                    .await
                    .map_err(|e| {
                        DbError::new(
                            M::ENGINE,
                            ErrorKind::Other,
                            format!("opening a connection failed: {e}"),
                        )
                    })??
            }
        };
        Ok(Lease {
            slot: Arc::new(tokio::sync::Mutex::new(Slot {
                conn: Some(conn),
                in_transaction: false,
            })),
            permit: Some(permit),
            shared: Arc::clone(&self.shared),
        })
    }

    /// Closes the pool: waits until every leased connection has come back (including
    /// leases whose rollback or close is still running on the blocking pool), then
    /// closes the idle connections on the blocking pool. Later leases, on this pool or
    /// its clones, fail with "connection pool closed".
    pub async fn close(&self) {
        let all = u32::try_from(self.shared.max_size).unwrap_or(u32::MAX);
        let held = Arc::clone(&self.shared.permits)
            .acquire_many_owned(all)
            .await;
        self.shared.permits.close();
        let idle = self
            .shared
            .idle
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default();
        if !idle.is_empty() {
            let shared = Arc::clone(&self.shared);
            let closing = tokio::task::spawn_blocking(move || {
                for conn in idle {
                    shared.manager.close(conn);
                }
            });
            let _ = closing.await;
        }
        drop(held);
    }
}

/// One leased connection and its pool slot, given back on drop.
///
/// Dropping a lease whose connection has no open transaction (as of its last
/// [`run`](Self::run)) and is [`reusable`](Manager::reusable) puts it back in the idle
/// list at once. Otherwise the connection is [reset](Manager::reset) or
/// [closed](Manager::close) on the blocking pool (inline outside a tokio runtime), and
/// the slot stays taken until that is done.
pub struct Lease<M: Manager> {
    /// The connection, locked by whichever call is using it on the blocking pool. A
    /// `run` whose future was dropped (a timeout around a statement) keeps the lock
    /// until its statement ends and then puts the connection back, so the next call on
    /// this lease (the protocol's rollback) waits for it instead of finding it gone.
    slot: Arc<tokio::sync::Mutex<Slot<M::Connection>>>,
    permit: Option<OwnedSemaphorePermit>,
    shared: Arc<Shared<M>>,
}

struct Slot<C> {
    /// `None` only after a panic of a closure took the connection down with it.
    conn: Option<C>,
    in_transaction: bool,
}

impl<M: Manager> fmt::Debug for Lease<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Lease");
        d.field("engine", &M::ENGINE);
        match self.slot.try_lock() {
            Ok(slot) => d
                .field("connected", &slot.conn.is_some())
                .field("in_transaction", &slot.in_transaction),
            Err(_) => d.field("busy", &true),
        };
        d.finish_non_exhaustive()
    }
}

impl<M: Manager> Lease<M> {
    /// Runs `f` on the connection on the blocking pool (noting whether a transaction is
    /// left open, see [`Manager::in_transaction`]). If an earlier call's future was
    /// dropped while its statement ran, this waits for that statement to end first.
    ///
    /// # Panics
    ///
    /// Re-raises a panic of `f`. The connection goes down with a panicking `f`, so a
    /// later call on the same lease panics too; so does a call after the runtime
    /// began shutting down (the blocking task was cancelled).
    pub async fn run<T, F>(&mut self, f: F) -> T
    where
        F: FnOnce(&M::Connection) -> T + Send + 'static,
        T: Send + 'static,
    {
        let mut slot = Arc::clone(&self.slot).lock_owned().await;
        let shared = Arc::clone(&self.shared);
        let ran = tokio::task::spawn_blocking(move || {
            // Taken out while `f` runs: if `f` panics, the connection is dropped
            // (closed, which rolls back) and the slot stays empty.
            let conn = slot.conn.take()?;
            let out = f(&conn);
            slot.in_transaction = shared.manager.in_transaction(&conn);
            slot.conn = Some(conn);
            Some(out)
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

/// Gives a connection back to the pool: straight to the idle list when it is clean and
/// healthy, else reset or closed on the blocking pool (never on an async worker). The
/// slot (`permit`) is freed only once the connection is back or closed.
fn release<M: Manager>(
    shared: Arc<Shared<M>>,
    conn: M::Connection,
    in_transaction: bool,
    permit: Option<OwnedSemaphorePermit>,
) {
    if !in_transaction && shared.manager.reusable(&conn) {
        shared.push_idle(conn);
        drop(permit);
        return;
    }
    let give_back = move || {
        shared.give_back_blocking(conn, in_transaction);
        drop(permit);
    };
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        drop(rt.spawn_blocking(give_back));
    } else {
        give_back();
    }
}

impl<M: Manager> Drop for Lease<M> {
    fn drop(&mut self) {
        let (shared, permit) = (Arc::clone(&self.shared), self.permit.take());
        match Arc::clone(&self.slot).try_lock_owned() {
            Ok(mut slot) => match slot.conn.take() {
                Some(conn) => release(shared, conn, slot.in_transaction, permit),
                None => drop(permit),
            },
            // A dropped `run` is still using the connection: give it back when its
            // statement ends.
            Err(_) => match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let slot = Arc::clone(&self.slot);
                    drop(rt.spawn(async move {
                        let mut slot = slot.lock_owned().await;
                        match slot.conn.take() {
                            Some(conn) => release(shared, conn, slot.in_transaction, permit),
                            None => drop(permit),
                        }
                    }));
                }
                // No runtime: the blocking task drops (closes) the connection when it
                // ends, which rolls back.
                Err(_) => drop(permit),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::thread::ThreadId;
    use std::time::Duration;

    use super::*;

    /// Counts what the pool does to its connections; no database involved.
    #[derive(Default)]
    struct Stats {
        opens: AtomicUsize,
        closes: AtomicUsize,
        resets: AtomicUsize,
        drops: AtomicUsize,
        fail_next_open: AtomicBool,
        /// The threads `reset` and `close` ran on.
        round_trip_threads: Mutex<Vec<ThreadId>>,
    }

    impl Stats {
        fn get(&self) -> (usize, usize, usize, usize) {
            (
                self.opens.load(SeqCst),
                self.resets.load(SeqCst),
                self.closes.load(SeqCst),
                self.drops.load(SeqCst),
            )
        }

        fn round_trip_threads(&self) -> Vec<ThreadId> {
            self.round_trip_threads
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default()
        }

        fn note_thread(&self) {
            if let Ok(mut v) = self.round_trip_threads.lock() {
                v.push(std::thread::current().id());
            }
        }
    }

    struct Fake {
        stats: Arc<Stats>,
        can_reset: bool,
        /// How long `reset` and `close` take (a round trip).
        delay: Duration,
    }

    struct FakeConn {
        id: usize,
        in_tx: AtomicBool,
        healthy: AtomicBool,
        stats: Arc<Stats>,
    }

    impl Drop for FakeConn {
        fn drop(&mut self) {
            self.stats.drops.fetch_add(1, SeqCst);
        }
    }

    impl Manager for Fake {
        type Connection = FakeConn;
        const ENGINE: &'static str = "fake";

        fn open(&self) -> Result<FakeConn, DbError> {
            if self.stats.fail_next_open.swap(false, SeqCst) {
                return Err(DbError::new("fake", ErrorKind::Connection, "refused"));
            }
            Ok(FakeConn {
                id: self.stats.opens.fetch_add(1, SeqCst) + 1,
                in_tx: AtomicBool::new(false),
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

        fn reset(&self, conn: &FakeConn) -> bool {
            self.stats.note_thread();
            std::thread::sleep(self.delay);
            self.stats.resets.fetch_add(1, SeqCst);
            if self.can_reset {
                conn.in_tx.store(false, SeqCst);
            }
            self.can_reset
        }

        fn close(&self, conn: FakeConn) {
            self.stats.note_thread();
            std::thread::sleep(self.delay);
            self.stats.closes.fetch_add(1, SeqCst);
            drop(conn);
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
        (BlockingPool::new(manager, max_size), stats)
    }

    /// Leases the pool and returns the connection's id and whether it is in a transaction.
    async fn which(pool: &BlockingPool<Fake>) -> (usize, bool) {
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| (c.id, c.in_tx.load(SeqCst))).await
    }

    async fn begin(lease: &mut Lease<Fake>) {
        lease.run(|c| c.in_tx.store(true, SeqCst)).await;
    }

    #[tokio::test]
    async fn idle_connections_are_reused() {
        let (pool, stats) = pool(4, true);
        for _ in 0..3 {
            assert_eq!(which(&pool).await, (1, false));
        }
        assert_eq!(stats.get(), (1, 0, 0, 0), "one open, nothing closed");

        let a = pool.lease().await.expect("lease a");
        let mut b = pool.lease().await.expect("lease b");
        assert_eq!(b.run(|c| c.id).await, 2, "a held lease is not shared");
        drop((a, b));
        assert_eq!(which(&pool).await.0, 2, "idle connections are a stack");
        assert_eq!(which(&pool).await.0, 2);
        assert_eq!(stats.get(), (2, 0, 0, 0));
        assert_eq!(pool.max_size(), 4);
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
        // Dropping a lease whose statement is still running gives the connection back
        // once it ends.
        let slow = lease.run(|c| {
            std::thread::sleep(Duration::from_millis(500));
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
            "back in the pool, then reused"
        );
        assert_eq!(stats.get().0, 1, "no second connection was opened");
    }

    #[tokio::test]
    async fn an_open_transaction_is_reset_off_the_async_thread_before_reuse() {
        let (pool, stats) = slow_pool(1, true, Duration::from_millis(50));
        let mut lease = pool.lease().await.expect("lease");
        begin(&mut lease).await;
        drop(lease);
        // One slot: the next lease waits until the reset (50 ms) is done.
        assert_eq!(which(&pool).await, (1, false), "reset, then reused");
        assert_eq!(stats.get(), (1, 1, 0, 0));
        let async_thread = std::thread::current().id();
        assert_eq!(stats.round_trip_threads().len(), 1);
        assert!(
            stats
                .round_trip_threads()
                .iter()
                .all(|t| *t != async_thread),
            "the rollback ran on the async worker"
        );
    }

    #[tokio::test]
    async fn an_open_transaction_is_closed_when_reset_is_refused() {
        let (pool, stats) = pool(1, false);
        let mut lease = pool.lease().await.expect("lease");
        begin(&mut lease).await;
        drop(lease);
        assert_eq!(which(&pool).await, (2, false), "a fresh connection");
        assert_eq!(stats.get(), (2, 1, 1, 1), "the first one was closed");
        let async_thread = std::thread::current().id();
        assert!(
            stats
                .round_trip_threads()
                .iter()
                .all(|t| *t != async_thread),
            "the close ran on the async worker"
        );
    }

    #[tokio::test]
    async fn the_default_reset_closes_a_connection_left_in_a_transaction() {
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
        let pool = BlockingPool::new(Minimal, 1);
        let mut lease = pool.lease().await.expect("lease");
        let first = lease.run(Arc::clone).await;
        lease.run(|c| c.store(true, SeqCst)).await;
        drop(lease);
        let mut lease = pool.lease().await.expect("lease");
        let second = lease.run(Arc::clone).await;
        assert!(!Arc::ptr_eq(&first, &second), "the first was not reused");
        drop(lease);
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
        assert_eq!(stats.get(), (1, 0, 0, 0));
    }

    #[tokio::test]
    async fn unhealthy_connections_are_closed_not_reused() {
        let (pool, stats) = pool(1, true);
        let mut lease = pool.lease().await.expect("lease");
        lease.run(|c| c.healthy.store(false, SeqCst)).await;
        drop(lease);
        assert_eq!(which(&pool).await, (2, false));
        assert_eq!(stats.get(), (2, 0, 1, 1), "closed without a reset");
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
        assert_eq!(stats.get(), (2, 0, 0, 0), "never more than two opened");
    }

    #[tokio::test]
    async fn a_panicking_closure_propagates_and_releases_its_slot() {
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
        assert_eq!(stats.get(), (2, 0, 0, 1), "the first went down with f");
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
    async fn close_waits_for_leases_then_closes_idle_connections() {
        // Resets and closes take 20 ms each: close must wait for them too.
        let (pool, stats) = slow_pool(3, true, Duration::from_millis(20));
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
        assert_eq!(stats.get(), (3, 1, 3, 3), "all three closed, one reset");

        let err = pool.lease().await.expect_err("closed");
        assert_eq!(err.message(), "connection pool closed");
        assert_eq!((err.engine(), err.kind()), ("fake", ErrorKind::Other));
        pool.close().await;
    }

    #[test]
    fn drop_outside_a_runtime_resets_inline() {
        let (pool, stats) = pool(1, true);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let lease = rt.block_on(async {
            let mut lease = pool.lease().await.expect("lease");
            begin(&mut lease).await;
            lease
        });
        drop(rt);
        drop(lease);
        assert_eq!(stats.get(), (1, 1, 0, 0));
        assert_eq!(
            stats.round_trip_threads(),
            vec![std::thread::current().id()],
            "no runtime: the reset ran here"
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        assert_eq!(rt.block_on(which(&pool)), (1, false), "reused");
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
