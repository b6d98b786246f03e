//! MariaDB Galera Cluster: what changes, and the one option it may want.
//!
//! idem runs unchanged on any node of a Galera cluster (synchronous multi-primary
//! replication with optimistic, certification-based conflict detection). What differs
//! from a single server, and how the backend handles it:
//!
//! - **Two nodes can accept the same key locally.** Row locks are local to a node: a
//!   claim on node B does not wait for an uncommitted claim of the same key on node A.
//!   Both `INSERT`s succeed, both effects run, and at `COMMIT` the second write set in
//!   the cluster's total order fails **certification** and is rolled back with error
//!   **1213** ([`ER_LOCK_DEADLOCK`](crate::error_codes::ER_LOCK_DEADLOCK)). A
//!   transaction of node B can also be aborted by a replicated write set while it runs
//!   (a "brute-force abort"), with the same 1213 on its next statement. Both are
//!   classified as [`ErrorKind::Deadlock`](idem_core::ErrorKind::Deadlock), so idem
//!   retries the whole transaction with the same key; the retry finds the winner's
//!   record and replays it. The primary key still decides, cluster-wide, at
//!   certification instead of at the lock. Rarely the server does not report a
//!   brute-force abort between the effect's last statement and idem's completion:
//!   idem's pre-commit check finds the transaction gone, rolls back, stores nothing and
//!   returns an error that says so (never a success); nothing of that call committed,
//!   and the client retries it with the same key, as after any error.
//! - **A node that is not part of the primary component** (cut off, or still joining)
//!   refuses statements with **1047**
//!   ([`ER_UNKNOWN_COM_ERROR`](crate::error_codes::ER_UNKNOWN_COM_ERROR), "WSREP has
//!   not yet prepared node for application use"): classified as
//!   [`ErrorKind::Connection`](idem_core::ErrorKind::Connection), like a lost
//!   connection. The outcome of an interrupted call is unknown: send the same key to
//!   another node.
//! - **Reads on another node can lag.** A node applies replicated write sets
//!   asynchronously after certification, so the replay fast path (`lookup`, a plain
//!   read) on node B can miss a record node A has just committed. That is safe: a miss
//!   only means the call goes on to claim, and the claim ends in a replay (directly, or
//!   after a certification failure and one retry). It costs a wasted claim.
//!   [`causal_reads`] sets `wsrep_sync_wait = 1` on every session, which the Galera
//!   documentation describes as making reads wait until the node has applied the write
//!   sets committed before them. Measured here (MariaDB 10.11.19, Galera 26.4.23,
//!   `tests/galera_cluster.rs`), it did **not** remove the misses (a few in 300 rounds
//!   with and without it), so correctness never relies on it; `docs/scale-out.md` has
//!   the figures.
//! - **Schema**: every table needs a primary key (idem's tables have one) and InnoDB;
//!   DDL (the migrations) is replicated in total order (TOI).
//!
//! Galera does not replicate `GET_LOCK`, which `migrate` uses to serialize concurrent
//! migrators: run migrations against one node at a time (they are idempotent).

use mysql_async::{Opts, OptsBuilder};

/// The `wsrep_sync_wait` bit for reads (`SELECT`, `SHOW`, `BEGIN`).
pub const WSREP_SYNC_WAIT_READS: u8 = 1;

/// The session statement [`causal_reads`] runs on each new or reset connection.
pub const CAUSAL_READS_INIT: &str = "SET SESSION wsrep_sync_wait = 1";

/// Connection options whose sessions ask for causal reads on a Galera node
/// (`SET SESSION wsrep_sync_wait = 1` on each new connection and after each reset by
/// the pool): by Galera's documentation, reads then wait until the node has applied the
/// write sets committed before them. Measured on MariaDB 10.11.19 with Galera 26.4.23,
/// the fast path still missed fresh records with it (see the module documentation);
/// idem's correctness never depends on it. Use it with
/// [`MysqlBackend::connect_with`](crate::MysqlBackend::connect_with):
///
/// ```no_run
/// # async fn f() -> Result<(), idem_core::DbError> {
/// let opts = idem_mysql::galera::causal_reads(idem_mysql::parse_url(
///     "mysql://app:secret@galera-2:3306/shop",
/// )?);
/// let backend = idem_mysql::MysqlBackend::connect_with(opts).await?;
/// # Ok(()) }
/// ```
///
/// On a MariaDB server without Galera the variable exists and changes nothing; MySQL
/// refuses it.
pub fn causal_reads(opts: impl Into<Opts>) -> Opts {
    let opts: Opts = opts.into();
    // `setup`, not `init`: the pool resets each connection it takes back
    // (`COM_RESET_CONNECTION`, which also resets session variables), and only the setup
    // statements run again after a reset.
    let mut setup: Vec<String> = opts.setup().to_vec();
    setup.push(CAUSAL_READS_INIT.to_owned());
    OptsBuilder::from_opts(opts).setup(setup).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_reads_adds_one_init_statement() {
        let opts = crate::parse_url("mysql://root@127.0.0.1:3306/test").expect("url");
        let opts = causal_reads(opts);
        assert_eq!(opts.setup(), [CAUSAL_READS_INIT.to_owned()]);
        assert_eq!(opts.tcp_port(), 3306, "the other options are kept");
        assert_eq!(opts.db_name(), Some("test"));
    }
}
