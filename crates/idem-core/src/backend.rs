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

impl Identity<'_> {
    /// A 64-bit name for this identity, the same in every process and version of idem:
    /// the first eight bytes of SHA-256 over a tag for the kind of record (`request` or
    /// `message`) and each part of the identity, length-prefixed, so no two identities
    /// share an input. Engines that serialize claims of one identity with a named lock
    /// instead of a placeholder row (PostgreSQL's transaction-scoped advisory locks) lock
    /// this name, with whatever tells their tables apart mixed in (PostgreSQL: the
    /// table's OID). Two identities may share a name (one in 2^64): they then wait for
    /// each other, and nothing else changes, because the record's primary key still
    /// decides.
    pub fn lock_key(&self) -> u64 {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut part = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_be_bytes());
            h.update(bytes);
        };
        match self {
            Identity::Request { scope, key } => {
                part(b"request");
                part(scope.principal.as_str().as_bytes());
                part(scope.operation.as_str().as_bytes());
                part(key.as_str().as_bytes());
            }
            Identity::Message {
                subscriber,
                message_id,
            } => {
                part(b"message");
                part(subscriber.as_str().as_bytes());
                part(message_id.as_str().as_bytes());
            }
        }
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_be_bytes(first)
    }
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
    // A `char` pattern: no substring searcher is built on every call (spans and errors
    // ask for the engine's name per call).
    let krate = type_name.split(':').next().unwrap_or(type_name);
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
    fn lock_keys_are_stable_and_tell_identities_apart() {
        use super::Identity;
        use crate::ident::{Key, MessageId, Operation, Principal, Scope, Subscriber};
        let scope = Scope::new(
            Principal::new("account-1").unwrap_or_else(|e| panic!("{e}")),
            Operation::new("debit", 1).unwrap_or_else(|e| panic!("{e}")),
        );
        let key = Key::new("checkout-42").unwrap_or_else(|e| panic!("{e}"));
        let request = Identity::Request {
            scope: &scope,
            key: &key,
        };
        // Fixed: every process and every version of idem must lock the same name
        // (checked against Python's hashlib over the same length-prefixed parts).
        assert_eq!(request.lock_key(), request.lock_key());
        assert_eq!(
            request.lock_key(),
            0x815c_24f5_38fb_34d7,
            "{:#x}",
            request.lock_key()
        );
        let subscriber = Subscriber::new("account-1").unwrap_or_else(|e| panic!("{e}"));
        let id = MessageId::new("debit:v1").unwrap_or_else(|e| panic!("{e}"));
        let message = Identity::Message {
            subscriber: &subscriber,
            message_id: &id,
        };
        assert_ne!(request.lock_key(), message.lock_key());
        let other = Key::new("checkout-43").unwrap_or_else(|e| panic!("{e}"));
        let other = Identity::Request {
            scope: &scope,
            key: &other,
        };
        assert_ne!(request.lock_key(), other.lock_key());
    }

    #[test]
    fn engine_names_come_from_the_crate() {
        assert_eq!(engine_of_type("idem_sqlite::SqliteBackend"), "sqlite");
        assert_eq!(engine_of_type("idem_mssql::MssqlBackend"), "mssql");
        assert_eq!(engine_of_type("my_crate::Backend"), "my_crate");
        assert_eq!(engine_of_type("Local"), "Local");
    }
}
