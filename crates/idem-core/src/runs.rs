//! What an engine supplies for phased runs (external effects) and the transactional
//! outbox: a handful of statements and its transactions. The protocol around them
//! (leases, takeover, fencing, recovery points, the claim-publish-mark relay) is written
//! once, in [`crate::Idem::start`], [`crate::Run`] and [`crate::Idem::relay`].

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

/// What a guarded write expects to find in the run's row: its writer's owner token, its
/// fencing generation and the recovery point it last committed. A write is a
/// compare-and-set on all three (and on "no final answer yet"): a writer that does not
/// know the current point (its last commit's reply was lost) or whose run was taken over
/// changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunGuard<'a> {
    /// The owner token the row must hold.
    pub owner: &'a str,
    /// The fencing generation the row must hold.
    pub fence: i64,
    /// The recovery point the row must hold.
    pub point: &'a str,
}

/// A guarded write of a run's row ([`RunStore::write_run`]). Every column it names is
/// set; `lease_until` becomes the database clock + `lease`.
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

/// What [`RunStore::probe_run`] found: whether a call holding this run kept a waiting
/// call waiting, or something else did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunProbe {
    /// Another transaction holds the run's row (its owner committing a phase, a
    /// concurrent start or takeover of the same key).
    Held,
    /// Nothing holds the run's row now (or it has no committed row): what the call
    /// waited for was something else.
    Free,
}

/// One engine's statements for phased runs. Every method but `begin_runs` and
/// `stalled_runs` runs inside the transaction `begin_runs` opened, and only
/// `commit_runs` or `rollback_runs` end it.
pub trait RunStore: Backend + Clone {
    /// Opens a transaction for run statements (and a phase's effect). With `wait`, every
    /// lock wait in it is bounded by `wait` (a lock timeout, table locks included where
    /// the engine bounds them apart); the engine answers an error of kind
    /// [`crate::ErrorKind::LockTimeout`] (or [`crate::ErrorKind::Busy`]) when it
    /// elapses, and gives the session its own bound back when the transaction ends.
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

    /// The guarded write, a compare-and-set: changes the row only while it holds
    /// `expected` (owner, fence and point) and has no final answer. `true` when it
    /// changed the row (exactly one), `false` otherwise.
    fn write_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Sets the lease alone (`lease_until` = the database clock + `lease`; zero ends it
    /// now) while the row holds `owner` and `fence` and has no final answer: never the
    /// point or the state. `true` when it changed the row.
    fn renew_lease(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Deletes the run while its owner is `expected` (an expired run being replaced).
    fn delete_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Tells apart, after a lock wait ran out, "another transaction holds this run's row"
    /// from "something else kept us waiting": a locking read that skips a locked row
    /// (`SKIP LOCKED`, `READPAST`), then a plain read of whether a committed row exists.
    /// Runs in a transaction opened with a short bound; a wait that runs out here too is
    /// the caller's answer (something else holds the table).
    fn probe_run(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        key: &Key,
    ) -> impl Future<Output = Result<RunProbe, DbError>> + Send;

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

/// A message due for publishing, as [`OutboxStore::lock_due`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueRow {
    /// The message.
    pub row: OutboxRow,
    /// Publishing attempts begun so far (each claim counts one).
    pub attempts: i64,
}

/// Which unsent messages an operator call is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutboxState {
    /// Pending and dead messages: every message not sent.
    #[default]
    Unsent,
    /// Messages still to be published (attempts left).
    Pending,
    /// Dead messages: no attempts left; the relay skips them.
    Dead,
}

impl OutboxState {
    /// The code the statements compare with: 0 unsent, 1 pending, 2 dead.
    pub fn code(self) -> i64 {
        match self {
            Self::Unsent => 0,
            Self::Pending => 1,
            Self::Dead => 2,
        }
    }
}

/// The unsent messages an operator lists: by state, optionally one destination, in id
/// order after `after_id`, at most `limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxFilter {
    /// Which messages.
    pub state: OutboxState,
    /// Only this destination.
    pub destination: Option<String>,
    /// Only ids above this one (for paging).
    pub after_id: i64,
    /// At most this many (capped at [`MAX_RELAY_BATCH`]).
    pub limit: u32,
}

impl Default for OutboxFilter {
    fn default() -> Self {
        Self {
            state: OutboxState::Unsent,
            destination: None,
            after_id: 0,
            limit: 100,
        }
    }
}

/// An unsent message as an operator sees it ([`crate::Idem::outbox_list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEntry {
    /// The outbox's sequence number.
    pub id: i64,
    /// Where it goes.
    pub destination: String,
    /// The message ID.
    pub message_id: String,
    /// Publishing attempts begun.
    pub attempts: i64,
    /// `true` once no attempts are left: the relay skips it until retried or dropped.
    pub dead: bool,
    /// The last attempt's error (truncated, URLs redacted), if any.
    pub last_error: Option<String>,
    /// How long ago it was enqueued, by the database clock.
    pub age: Duration,
    /// How long until the relay may try it again (`None`: now).
    pub next_attempt_in: Option<Duration>,
    /// Whether a relay holds an unexpired claim on it (it is being published).
    pub claimed: bool,
}

/// The outbox's backlog, as one statement counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// Messages still to be published.
    pub pending: u64,
    /// Dead messages.
    pub dead: u64,
    /// The age of the oldest pending message, by the database clock.
    pub oldest_pending_age: Option<Duration>,
}

/// One engine's statements for the transactional outbox. Times are the database clock;
/// `claim_token` is a relay pass's random token, and a claim lasts until
/// `claimed_until`. "Ours" in the outcome statements means: the row is unsent and
/// carries the pass's token, or no unexpired claim at all (a pass whose claim ran out
/// and that nobody claimed since still records what it did).
pub trait OutboxStore: RunStore {
    /// Stores a message to publish, inside the caller's transaction (an effect's, a
    /// phase's or a consumer's): it is published only if that transaction commits.
    fn enqueue(
        &self,
        tx: &mut Self::Tx,
        message: &crate::outbox::Outgoing,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Locks up to `limit` messages that are **due**, the oldest first, skipping rows
    /// other transactions hold (`FOR UPDATE SKIP LOCKED`, `READPAST`; SQLite has one
    /// writer). Due: unsent, not dead, its `next_attempt_at` passed (or none), no
    /// unexpired claim, and no older unsent, not dead message of its destination that
    /// is not due or is claimed (those wait behind their head).
    fn lock_due(
        &self,
        tx: &mut Self::Tx,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<DueRow>, DbError>> + Send;

    /// The ids of every unsent, not dead message of `destination` up to `up_to`, in
    /// order, including rows other relays hold, claimed ones and ones not due (a plain
    /// read, no locks taken).
    fn pending_ids(
        &self,
        tx: &mut Self::Tx,
        destination: &str,
        up_to: i64,
    ) -> impl Future<Output = Result<Vec<i64>, DbError>> + Send;

    /// Claims locked messages for a pass: `claim_token` = `token`, `claimed_until` = the
    /// database clock + `lease`, one more attempt counted. At most
    /// [`MAX_RELAY_BATCH`] ids ([`in_list`]).
    fn claim_due(
        &self,
        tx: &mut Self::Tx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Gives back claimed messages the pass did not try (an earlier message of their
    /// destination failed, or the pass ran out of time): claim cleared, the attempt
    /// uncounted. Only ours.
    fn release(
        &self,
        tx: &mut Self::Tx,
        ids: &[i64],
        token: &str,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Marks published messages sent (by the database clock), claim cleared. Only ours;
    /// returns how many it marked.
    fn mark_sent(
        &self,
        tx: &mut Self::Tx,
        ids: &[i64],
        token: &str,
    ) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// Records a failed attempt: `last_error`, claim cleared, and either
    /// `next_attempt_at` = the database clock + `retry_in`, or (`None`) dead now. Only
    /// ours; `false` when it changed nothing.
    fn record_failure(
        &self,
        tx: &mut Self::Tx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Counts the backlog (no transaction).
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats, DbError>> + Send;

    /// Lists unsent messages (no transaction, no locks).
    fn list_outbox(
        &self,
        filter: &OutboxFilter,
    ) -> impl Future<Output = Result<Vec<OutboxEntry>, DbError>> + Send;

    /// Puts unsent messages back to pending, due now, with their attempts reset (dead
    /// ones included): either the given `ids` (at most [`MAX_RELAY_BATCH`]), or, when
    /// `ids` is empty, every dead message (of `destination`, when given). Returns how
    /// many changed. A message a relay is publishing keeps its claim.
    fn retry_outbox(
        &self,
        ids: &[i64],
        destination: Option<&str>,
    ) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// Deletes unsent messages, never to be published: the given `ids` (at most
    /// [`MAX_RELAY_BATCH`]), or, when `ids` is empty, every dead message (of
    /// `destination`, when given). Returns how many it deleted.
    fn drop_outbox(
        &self,
        ids: &[i64],
        destination: Option<&str>,
    ) -> impl Future<Output = Result<u64, DbError>> + Send;
}

/// The most messages one relay pass takes (and so the most ids an `IN` list gets):
/// 1,000, which fits Oracle's `IN` list (ORA-01795) and SQL Server's 2,100 parameters.
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
