//! What an engine supplies for phased runs (external effects) and the transactional
//! outbox: a handful of statements and its transactions. The protocol around them
//! (leases, takeover, fencing, recovery points, the ordered skip-locked drain) is
//! written once, in [`crate::Idem::start`], [`crate::Run`] and [`crate::Idem::relay`].

use std::future::Future;
use std::time::Duration;

use crate::backend::{Backend, Status};
use crate::error::DbError;
use crate::ident::{Key, Scope};

/// The recovery point every run starts at.
pub const STARTED: &str = "started";

/// A run's row as the backend read it, under a row lock (inside the transaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRow {
    /// The canonical request stored at the run's start.
    pub request: String,
    /// The current owner's token.
    pub owner: String,
    /// The fencing generation: raised by every takeover.
    pub fence: i64,
    /// The last committed recovery point.
    pub point: String,
    /// The state committed with it (JSON text), if any.
    pub state: Option<String>,
    /// `Some` once the run stored its final answer.
    pub status: Option<Status>,
    /// The final answer (JSON text), with `status`.
    pub response: Option<String>,
    /// The owner's lease has ended (`lease_until <=` the database clock).
    pub lease_over: bool,
    /// The record's retention has ended (`expires_at <=` the database clock).
    pub expired: bool,
}

/// A new run's row: the database clock sets `created_at`, `lease_until` (+ `lease`)
/// and `expires_at` (+ `retention`); the status and response are `NULL`.
#[derive(Debug, Clone, Copy)]
pub struct NewRun<'a> {
    /// The canonical request.
    pub request: &'a str,
    /// The owner's token.
    pub owner: &'a str,
    /// The fencing generation.
    pub fence: i64,
    /// The recovery point ([`STARTED`]).
    pub point: &'a str,
    /// How long the owner's lease lasts from now.
    pub lease: Duration,
    /// How long the record lives from now.
    pub retention: Duration,
}

/// A guarded write of a run's row: it changes the row only while its owner is still
/// the expected one (`WHERE … AND owner = expected`), so a stale owner's write changes
/// nothing. Every column it names is set; `lease_until` becomes the database clock +
/// `lease` (zero releases the lease at once).
#[derive(Debug, Clone, Copy)]
pub struct RunWrite<'a> {
    /// The owner after the write (the expected one, or a new one taking over).
    pub owner: &'a str,
    /// The fencing generation after the write.
    pub fence: i64,
    /// The recovery point after the write.
    pub point: &'a str,
    /// The state after the write (JSON text).
    pub state: Option<&'a str>,
    /// The final status, when the run ends with this write.
    pub status: Option<Status>,
    /// The final answer (JSON text), with `status`.
    pub response: Option<&'a str>,
    /// The lease from now.
    pub lease: Duration,
}

/// A run whose owner's lease ended before it stored a final answer, as the completer
/// lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StalledRow {
    /// The principal.
    pub principal: String,
    /// The operation, `name:vN`.
    pub operation: String,
    /// The client's key.
    pub key: String,
    /// The last committed recovery point.
    pub point: String,
}

/// One engine's statements for phased runs. Every method but `begin_runs` and
/// `stalled_runs` runs inside the transaction `begin_runs` opened, and only
/// `commit_runs` or `rollback_runs` end it.
pub trait RunStore: Backend + Clone {
    /// Opens a transaction for run statements (and a phase's effect). With `wait`, every
    /// lock wait in it is bounded by `wait` (a lock timeout); the engine answers an
    /// error of kind [`crate::ErrorKind::LockTimeout`] when it elapses, and gives the
    /// session its own bound back when the transaction ends.
    fn begin_runs(
        &self,
        wait: Option<Duration>,
    ) -> impl Future<Output = Result<Self::Tx, DbError>> + Send;

    /// Commits.
    fn commit_runs(&self, tx: Self::Tx) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Rolls back. A connection that cannot be rolled back is never reused.
    fn rollback_runs(&self, tx: Self::Tx) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Inserts a new run; `false` when the identity is taken (after waiting for an
    /// uncommitted insert of it to end). Never an error for the conflict itself.
    fn insert_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Reads the run, locking its row until the transaction ends (`FOR UPDATE`,
    /// `UPDLOCK, HOLDLOCK`; SQLite's write transaction already excludes writers).
    fn read_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
    ) -> impl Future<Output = Result<Option<RunRow>, DbError>> + Send;

    /// The guarded write; `true` when it changed the row (exactly one), `false` when
    /// the owner is no longer `expected` (or the row is gone).
    fn write_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        expected: &str,
        write: &RunWrite<'_>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Deletes the run while its owner is `expected` (an expired run being replaced).
    fn delete_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Up to `limit` unexpired runs without a final answer whose lease has ended, the
    /// longest-stalled first (no transaction, no locks).
    fn stalled_runs(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<StalledRow>, DbError>> + Send;
}

/// A message to publish, as it is stored in the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The outbox's sequence number (the order of enqueueing).
    pub id: i64,
    /// Where it goes: a queue, a routing key or a subject.
    pub destination: String,
    /// The message ID consumers deduplicate by.
    pub message_id: String,
    /// The payload, JSON text.
    pub payload: String,
}

/// One engine's statements for the transactional outbox.
pub trait OutboxStore: RunStore {
    /// Stores a message to publish, inside the caller's transaction (an effect's, a
    /// phase's or a consumer's): it is published only if that transaction commits.
    fn enqueue(
        &self,
        tx: &mut Self::Tx,
        message: &crate::outbox::Outgoing,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Locks up to `limit` unsent messages, the oldest first, skipping rows another
    /// relay holds (`FOR UPDATE SKIP LOCKED`, `READPAST`; SQLite has one writer).
    fn lock_unsent(
        &self,
        tx: &mut Self::Tx,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, DbError>> + Send;

    /// The ids of every unsent message for `destination` up to `up_to`, in order,
    /// including rows other relays hold (a plain read, no locks taken).
    fn unsent_ids(
        &self,
        tx: &mut Self::Tx,
        destination: &str,
        up_to: i64,
    ) -> impl Future<Output = Result<Vec<i64>, DbError>> + Send;

    /// Marks messages sent (by the database clock). The relay passes at most
    /// [`MAX_RELAY_BATCH`] ids, so one statement with an `IN` list of bind parameters
    /// ([`in_list`]) fits every engine's limits.
    fn mark_sent(
        &self,
        tx: &mut Self::Tx,
        ids: &[i64],
    ) -> impl Future<Output = Result<(), DbError>> + Send;
}

/// The most messages one relay pass takes (and so the most ids [`OutboxStore::mark_sent`]
/// gets): 1,000, which fits Oracle's `IN` list (ORA-01795) and SQL Server's 2,100
/// parameters.
pub const MAX_RELAY_BATCH: u32 = 1000;

/// `prefix` followed by `n` placeholders (`placeholder(1)` … `placeholder(n)`, at least
/// one, so never an empty `IN ()`) separated by `", "`, and `)`: an engine's statement
/// over a list of bound ids (`… WHERE id IN (` + `@P1, @P2` + `)`).
pub fn in_list(prefix: &str, n: usize, placeholder: impl Fn(usize) -> String) -> String {
    let items: Vec<String> = (1..=n.max(1)).map(placeholder).collect();
    format!("{prefix}{})", items.join(", "))
}

#[cfg(test)]
mod tests {
    use super::in_list;

    #[test]
    fn in_lists_have_one_placeholder_per_item_and_never_none() {
        assert_eq!(in_list("IN (", 3, |i| format!(":{i}")), "IN (:1, :2, :3)");
        assert_eq!(in_list("IN (", 0, |_| "?".into()), "IN (?)");
    }
}
