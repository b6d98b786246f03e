//! The idempotency-record protocol, independent of any database driver.
//!
//! A client sends a key with a write. [`Idem`] stores the key, scoped by the
//! authenticated principal and the versioned operation ([`Scope`]), with the canonical
//! [`Request`] and the final response, in the same transaction as the local effect.
//! A retry with the same key and request returns the stored response
//! ([`Outcome::Replayed`]); the same key with a different request is refused
//! ([`Error::KeyReused`]); concurrent retries are resolved by the primary key.
//!
//! Engines implement the small [`Backend`] trait (`idem-sqlite`, `idem-postgres`,
//! `idem-mysql`, `idem-mssql`, `idem-oracle`); the protocol itself lives here once.
//! Backends on blocking drivers share the connection pool in [`blocking`], which runs
//! every driver call on tokio's blocking pool.

mod backend;
pub mod blocking;
pub mod claim;
mod effect;
mod error;
mod ident;
pub mod maintain;
mod migrate;
pub mod observe;
pub mod outbox;
mod phased;
mod protocol;
mod redact;
mod request;
pub mod runs;

pub use backend::{Backend, Claim, Claimed, Finish, Identity, Maintenance, Status, Stored, Table};
pub use blocking::{DEFAULT_ACQUIRE_TIMEOUT, PoolChecks, PoolOptions};
pub use effect::{EffectError, ReportMarker, StdErrorMarker};
pub use error::{DbError, Error, ErrorKind, InvalidInput};
pub use ident::{
    DEFAULT_RETENTION, Key, MAX_IDENT_BYTES, MessageId, Operation, Principal, Scope, Subscriber,
};
pub use migrate::Migration;
pub use outbox::{
    DEFAULT_MAX_PAYLOAD_BYTES, Outgoing, Publisher, RelayError, RelayFailure, RelayOptions,
    RelayReport,
};
pub use phased::{
    CompleteReport, DEFAULT_LEASE, Finished, MIN_LEASE, OperationReport, Run, Started,
};
pub use protocol::{
    BoxFuture, Consumed, DEFAULT_MAX_JSON_BYTES, DEFAULT_WAIT, Idem, MIN_RETENTION, Outcome,
    PurgeReport, RetryPolicy,
};
pub use redact::{redact, url_secrets};
pub use request::{MAX_JSON_DEPTH, Request};
pub use runs::{OutboxStore, RunStore};
pub use serde_json;
