//! Errors: bad input, engine errors classified by code, and the protocol's error enum.

use std::error::Error as StdError;
use std::fmt;

use serde_json::Value;

/// A value a caller supplied that idem refuses before any SQL runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what}: {problem}")]
pub struct InvalidInput {
    what: &'static str,
    problem: String,
}

impl InvalidInput {
    /// `what` names the input (`"idempotency key"`), `problem` says what is wrong with it.
    pub fn new(what: &'static str, problem: impl Into<String>) -> Self {
        Self {
            what,
            problem: problem.into(),
        }
    }

    /// Which input was refused.
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// What is wrong with it.
    pub fn problem(&self) -> &str {
        &self.problem
    }
}

/// What an engine error means for the protocol, decided from the engine's error code
/// (never from message text, which is localized; the one exception is SQLite's missing
/// table or column, whose generic `SQLITE_ERROR` says no more and whose messages are
/// not localized).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A unique or primary key refused a row (23505, 1062, 2627/2601, ORA-00001, 1555/2067).
    UniqueViolation,
    /// The database was busy or locked (SQLite `SQLITE_BUSY`).
    Busy,
    /// This transaction was chosen as a deadlock victim (40P01, 1213, 1205 on SQL Server).
    Deadlock,
    /// A serialization failure (40001, ORA-08177).
    SerializationFailure,
    /// A lock wait timed out (MySQL 1205, SQL Server 1222).
    LockTimeout,
    /// A race inside the protocol that a fresh attempt resolves (a conflicting record
    /// vanished between the claim and the re-read).
    Transient,
    /// The connection could not be made or was lost.
    Connection,
    /// The server refused the credentials: an unknown user or a wrong password
    /// (PostgreSQL 28P01/28000, MySQL 1045, SQL Server 18456, ORA-01017).
    Authentication,
    /// The database named in the URL does not exist or cannot be opened (PostgreSQL
    /// 3D000, MySQL 1049, SQL Server 4060, ORA-12514, SQLite `SQLITE_CANTOPEN`).
    MissingDatabase,
    /// A table, or a column of one, that a statement names does not exist (PostgreSQL
    /// 42P01/42703, MySQL 1146/1054, SQL Server 208/207, ORA-00942/ORA-00904, SQLite's
    /// `no such table`/`no such column`). From idem's own statements it means idem's
    /// migrations have not run on this database, or not all of them (run
    /// [`crate::Idem::migrate`] or `idem migrate`), or the session cannot see idem's
    /// tables (another schema on its search path; on Oracle, no grant). Not retried:
    /// nothing ran.
    MissingTable,
    /// The engine's client library is missing (Oracle's DPI-1047).
    ClientLibraryMissing,
    /// A stored record that breaks the protocol's invariants (an unfinished response
    /// seen outside its transaction, or unreadable JSON).
    CorruptRecord,
    /// Configuration or URL errors.
    Configuration,
    /// Anything else.
    Other,
}

impl ErrorKind {
    /// Whether a fresh transaction with the same key may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::Busy
                | Self::Deadlock
                | Self::SerializationFailure
                | Self::LockTimeout
                | Self::Transient
        )
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::UniqueViolation => "unique violation",
            Self::Busy => "busy",
            Self::Deadlock => "deadlock",
            Self::SerializationFailure => "serialization failure",
            Self::LockTimeout => "lock wait timeout",
            Self::Transient => "transient conflict",
            Self::Connection => "connection error",
            Self::Authentication => "authentication failed",
            Self::MissingDatabase => "database not found",
            Self::MissingTable => "table or column not found",
            Self::ClientLibraryMissing => "client library missing",
            Self::CorruptRecord => "corrupt record",
            Self::Configuration => "configuration error",
            Self::Other => "database error",
        };
        f.write_str(s)
    }
}

/// An error from a backend, with the engine's own code kept.
#[derive(Debug)]
pub struct DbError {
    kind: ErrorKind,
    engine: &'static str,
    code: Option<String>,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl DbError {
    /// A new error of `kind` from `engine`.
    pub fn new(engine: &'static str, kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            engine,
            code: None,
            message: message.into(),
            source: None,
        }
    }

    /// Keeps the engine's error code (SQLSTATE, error number, `ORA-nnnnn`).
    #[must_use]
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Keeps the driver's error as the source.
    #[must_use]
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Keeps an already boxed error as the source.
    #[must_use]
    pub fn with_boxed_source(mut self, source: Box<dyn StdError + Send + Sync + 'static>) -> Self {
        self.source = Some(source);
        self
    }

    /// What the error means for the protocol.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The engine that raised it (`"postgres"`, `"sqlite"`, …).
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// The engine's code, if it gave one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// The engine's message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.engine, self.kind)?;
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl StdError for DbError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Why an idempotent call failed. Each variant is a distinct decision a caller can map,
/// for example to an HTTP status.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The key, scope or request was refused before any SQL ran.
    InvalidInput(InvalidInput),
    /// The key is known in this scope with a different request ("idempotency key reused
    /// with different request"; a server-side function would raise SQLSTATE 22023,
    /// invalid parameter value). Nothing ran.
    KeyReused {
        /// The request stored with the key.
        stored: Value,
        /// The request this call supplied.
        supplied: Value,
    },
    /// The message ID is known to this subscriber with a different payload.
    PayloadMismatch {
        /// The payload stored with the message ID.
        stored: Value,
        /// The payload this delivery carried.
        supplied: Value,
    },
    /// The effect failed; its work and the record were rolled back, so the key can be
    /// retried.
    Effect(E),
    /// Another call with the same key (or message ID) is still running and did not
    /// finish within the wait bound ([`crate::Idem::with_wait_timeout`]). Nothing ran
    /// in this call; retry later with the same key (HTTP 409 with `Retry-After`).
    InProgress {
        /// How long this call waited for the other one.
        waited: std::time::Duration,
    },
    /// A lock that is not another call's hold on this key (DDL, `LOCK TABLE`, a purge's
    /// or a migration's locks on idem's table) kept this call waiting past the wait bound
    /// ([`crate::Idem::with_wait_timeout`]). Nothing ran in this call; retry later with the
    /// same key (HTTP 503 with `Retry-After`). Distinct from [`Error::InProgress`], which
    /// means a concurrent call with the same key holds it.
    LockWait {
        /// How long this call waited.
        waited: std::time::Duration,
    },
    /// This call owned a phased run, but its lease ended and another call took the run
    /// over: this call's write was refused (fencing) and rolled back. The new owner
    /// carries the run on; retry with the same key to learn its answer.
    LeaseLost {
        /// This call's fencing generation (the new owner's is higher).
        fence: i64,
    },
    /// A stored final rejection was replayed by a call that expects successes only
    /// (the operation stored it with [`crate::Idem::execute_final`]).
    StoredRejection(Value),
    /// Every attempt hit a busy database, a deadlock or a serialization failure; none
    /// committed an effect.
    RetriesExhausted {
        /// How many transactions were tried.
        attempts: u32,
        /// What stopped the last one.
        last: DbError,
    },
    /// The stored response cannot be decoded into the caller's type.
    Decode(serde_json::Error),
    /// The engine failed. After a connection error the outcome is unknown: retry with
    /// the same key to learn it.
    Backend(DbError),
}

impl<E> Error<E> {
    /// The engine error behind this error, if there is one.
    pub fn db_error(&self) -> Option<&DbError> {
        match self {
            Self::Backend(e) | Self::RetriesExhausted { last: e, .. } => Some(e),
            _ => None,
        }
    }

    /// Converts the effect's error with `f`, keeping every other variant; `f` may instead
    /// return a value `X` that ends the conversion (an integration's own outcome
    /// carried through the effect's error type, such as an HTTP response not to store).
    pub fn try_map_effect<F, X>(self, f: impl FnOnce(E) -> Result<F, X>) -> Result<Error<F>, X> {
        Ok(match self {
            Self::Effect(e) => Error::Effect(f(e)?),
            Self::InvalidInput(e) => Error::InvalidInput(e),
            Self::KeyReused { stored, supplied } => Error::KeyReused { stored, supplied },
            Self::PayloadMismatch { stored, supplied } => {
                Error::PayloadMismatch { stored, supplied }
            }
            Self::InProgress { waited } => Error::InProgress { waited },
            Self::LockWait { waited } => Error::LockWait { waited },
            Self::LeaseLost { fence } => Error::LeaseLost { fence },
            Self::StoredRejection(v) => Error::StoredRejection(v),
            Self::RetriesExhausted { attempts, last } => Error::RetriesExhausted { attempts, last },
            Self::Decode(e) => Error::Decode(e),
            Self::Backend(e) => Error::Backend(e),
        })
    }
}

impl<E> From<InvalidInput> for Error<E> {
    fn from(e: InvalidInput) -> Self {
        Self::InvalidInput(e)
    }
}

impl<E> From<DbError> for Error<E> {
    fn from(e: DbError) -> Self {
        Self::Backend(e)
    }
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidInput(e) => write!(f, "{e}"),
            Self::KeyReused { stored, supplied } => write!(
                f,
                "idempotency key reused with different request (stored {stored}, supplied {supplied})"
            ),
            Self::PayloadMismatch { stored, supplied } => write!(
                f,
                "message ID reused with a different payload (stored {stored}, supplied {supplied})"
            ),
            Self::Effect(e) => write!(f, "{e}"),
            Self::InProgress { waited } => write!(
                f,
                "a request with this key is still in progress (waited {} ms); retry later with the same key",
                waited.as_millis()
            ),
            Self::LockWait { waited } => write!(
                f,
                "waited {} ms for a lock on idem's table that another session holds (DDL, LOCK \
                 TABLE, a purge or a migration), not for a call with this key; nothing ran; \
                 retry later with the same key",
                waited.as_millis()
            ),
            Self::LeaseLost { fence } => write!(
                f,
                "the lease of this run (fence {fence}) ended and another call took it over; \
                 this call's write was refused and rolled back"
            ),
            Self::StoredRejection(v) => write!(f, "the stored response is a final rejection: {v}"),
            Self::RetriesExhausted { attempts, last } => {
                write!(f, "gave up after {attempts} attempts: {last}")
            }
            Self::Decode(e) => write!(f, "stored response cannot be decoded: {e}"),
            Self::Backend(e) => write!(f, "{e}"),
        }
    }
}

/// `Error<E>` is a standard error for every effect error type, anyhow's and boxed
/// errors included, so `?` converts it into `anyhow::Error` or `Box<dyn Error>`. Its
/// `Display` for [`Error::Effect`] is the effect error's own message; `source()` then
/// continues with the effect error's source when `E` is `Box<dyn Error + Send + Sync>`
/// (other effect error types are reachable by matching [`Error::Effect`]).
impl<E: fmt::Debug + fmt::Display + 'static> StdError for Error<E> {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::InvalidInput(e) => Some(e),
            Self::Effect(e) => (e as &dyn std::any::Any)
                .downcast_ref::<Box<dyn StdError + Send + Sync>>()
                .and_then(|b| b.source()),
            Self::RetriesExhausted { last, .. } | Self::Backend(last) => Some(last),
            Self::Decode(e) => Some(e),
            _ => None,
        }
    }
}
