//! The trait each engine implements, and the values it exchanges with the protocol.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use crate::error::{DbError, ErrorKind};
use crate::ident::{Key, MessageId, Scope, Subscriber};

/// Which record a call is about.
#[derive(Debug, Clone, Copy)]
pub enum Identity<'a> {
    /// A client request: `(principal, operation, key)`.
    Request {
        /// The principal and versioned operation.
        scope: &'a Scope,
        /// The client's key.
        key: &'a Key,
    },
    /// A consumed message: `(subscriber, message_id)`.
    Message {
        /// The consumer.
        subscriber: &'a Subscriber,
        /// The transport's message ID.
        message_id: &'a MessageId,
    },
}

/// What the protocol asks a backend to claim.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The record's identity.
    pub id: Identity<'a>,
    /// Canonical JSON of the request (or of the message's payload fingerprint).
    pub request: Option<&'a str>,
    /// The record's window: the backend stores `expires_at` = the database clock at the
    /// claim + this. Once it has passed the record is expired: it no longer replays, a
    /// claim replaces it, and a completion that finds it expired is refused.
    pub retention: Duration,
    /// How long a claim may wait for a concurrent holder of the same identity (an
    /// unfinished transaction that claimed it first). When it elapses, the backend
    /// answers [`Claimed::InFlight`] instead of waiting on; it never hangs.
    pub wait: Duration,
}

/// How a stored response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The effect succeeded; the response is its result.
    Succeeded,
    /// A final business rejection stored by explicit opt-in.
    Rejected,
}

impl Status {
    /// The stored code (`0` or `1`).
    pub fn code(self) -> i16 {
        match self {
            Self::Succeeded => 0,
            Self::Rejected => 1,
        }
    }

    /// Reads a stored code.
    pub fn from_code(code: i64) -> Result<Self, DbError> {
        match code {
            0 => Ok(Self::Succeeded),
            1 => Ok(Self::Rejected),
            other => Err(DbError::new(
                "idem",
                ErrorKind::CorruptRecord,
                format!("unknown status code {other}"),
            )),
        }
    }
}

/// A live (unexpired, committed) record as the backend read it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// The stored request (or payload fingerprint) as JSON text, if any.
    pub request: Option<String>,
    /// The stored response as JSON text. `None` only for messages; a request record
    /// without a response is an unfinished placeholder that must never be seen.
    pub response: Option<String>,
    /// How the stored response ended.
    pub status: Status,
}

/// The result of [`Backend::claim`].
#[derive(Debug)]
pub enum Claimed<Tx> {
    /// This caller owns the identity inside the open transaction `Tx`: run the effect.
    Won(Tx),
    /// A committed, live record exists; the backend has already ended its transaction.
    Found(Stored),
    /// Another transaction holds the identity and did not finish within
    /// [`Claim::wait`]; the backend has already ended its transaction.
    InFlight,
}

/// How to end a won transaction.
#[derive(Debug, Clone, Copy)]
pub enum Finish<'a> {
    /// Store `response` (JSON) with `status`, then commit record and effect together.
    Commit {
        /// The response to store; `None` for messages.
        response: Option<&'a str>,
        /// How it ended.
        status: Status,
    },
    /// Roll back record and effect.
    Rollback,
}

/// Which table a purge cleans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// Request records.
    Requests,
    /// Processed-message records.
    Messages,
    /// Phased runs (`idem_run`): expired ones, like request records.
    Runs,
    /// Outbox messages already sent (`idem_outbox`, `sent_at` set at least
    /// `older_than` ago); unsent messages are never purged.
    Outbox,
}

/// One engine's implementation of the idempotency-record protocol.
///
/// An engine supplies SQL, error codes and transactions; the protocol (fast-path replay,
/// claim, compare, effect, complete, retries) lives once in [`crate::Idem`].
///
/// A backend must guarantee:
/// - `claim` makes concurrent claims of one identity wait for each other: exactly one
///   gets [`Claimed::Won`]; the others wait until it ends and then get
///   [`Claimed::Found`] (it committed) or win themselves (it rolled back);
/// - an expired record (its `expires_at`, set at its claim from [`Claim::retention`],
///   has passed) is replaced by a claim and never returned by `lookup` or `claim`;
/// - a claim waits for a concurrent holder of the same identity at most
///   [`Claim::wait`], then answers [`Claimed::InFlight`];
/// - no session other than the winner ever sees a record without its response.
pub trait Backend: Send + Sync + 'static {
    /// The engine's open transaction, handed to effects so their SQL commits or rolls
    /// back with the record.
    type Tx: Send + 'static;

    /// Reads a live record without a write transaction (the replay fast path).
    fn lookup(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Option<Stored>, DbError>> + Send;

    /// Begins a transaction and claims the identity.
    fn claim(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Claimed<Self::Tx>, DbError>> + Send;

    /// The replay fast path followed, when it finds nothing, by the claim: what
    /// [`crate::Idem::execute`] runs first with the fast path on. `Ok(Claimed::Found)`
    /// is the lookup's record (or the claim's). The default is [`Backend::lookup`] then
    /// [`Backend::claim`]; an engine whose pool costs round trips per checkout
    /// (PostgreSQL: a ping when it is handed out and one when it is returned) overrides
    /// it to run both on one connection.
    fn lookup_or_claim(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Claimed<Self::Tx>, DbError>> + Send {
        async move {
            match self.lookup(claim).await? {
                Some(stored) => Ok(Claimed::Found(stored)),
                None => self.claim(claim).await,
            }
        }
    }

    /// Completes (stores the response, commits) or rolls back a won transaction.
    fn finish(
        &self,
        tx: Self::Tx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// The engine's short name in spans and metric labels (`"sqlite"`, `"postgres"`,
    /// `"mysql"`, `"mssql"`, `"oracle"`). The default takes it from the implementing
    /// crate's name without its `idem_` prefix (`idem_sqlite::SqliteBackend` → `sqlite`).
    fn engine(&self) -> &'static str {
        engine_of_type(std::any::type_name::<Self>())
    }

    /// Classifies a driver error found in an effect's error chain, by code, so that
    /// deadlocks and serialization failures inside the effect are retried too.
    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind>;
}

/// `idem_sqlite::SqliteBackend` → `sqlite`; a path without the prefix keeps its crate name.
pub(crate) fn engine_of_type(type_name: &'static str) -> &'static str {
    let krate = type_name.split("::").next().unwrap_or(type_name);
    krate.strip_prefix("idem_").unwrap_or(krate)
}

/// Schema and housekeeping, separate from the protocol.
pub trait Maintenance: Backend {
    /// Applies the embedded migrations not yet applied; returns the versions applied.
    fn migrate(&self) -> impl Future<Output = Result<Vec<u32>, DbError>> + Send;

    /// Deletes at most `limit` records of `table` that are expired (their own
    /// `expires_at` has passed) **and** were claimed at least `older_than` ago (by the
    /// database clock; zero is allowed), so one purge is safe for every operation
    /// whatever its window. One statement; returns how many it deleted.
    fn purge_batch(
        &self,
        table: Table,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, DbError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::engine_of_type;

    #[test]
    fn engine_names_come_from_the_crate() {
        assert_eq!(engine_of_type("idem_sqlite::SqliteBackend"), "sqlite");
        assert_eq!(engine_of_type("idem_mssql::MssqlBackend"), "mssql");
        assert_eq!(engine_of_type("my_crate::Backend"), "my_crate");
        assert_eq!(engine_of_type("Local"), "Local");
    }
}
