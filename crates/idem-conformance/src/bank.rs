//! The demo domain each engine's fixture implements: the seed's account table.

use std::future::Future;

use idem::core::{Backend, BoxFuture, DbError, Maintenance};
use serde::{Deserialize, Serialize};

/// The response of a debit or credit, as in the seed: `{"balance": 900}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    /// The account's balance after the effect.
    pub balance: i64,
}

/// Why a bank effect failed.
#[derive(Debug, thiserror::Error)]
pub enum BankError {
    /// The debit would make the balance negative (the seed's `P0001`).
    #[error("insufficient balance")]
    Insufficient,
    /// The account does not exist.
    #[error("no account {0}")]
    NoAccount(i64),
    /// The engine failed.
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Documented facts about an engine, shown beside the measured ones in `docs/engines.md`.
#[derive(Debug, Clone, Copy)]
pub struct Capabilities {
    /// How a key is claimed.
    pub claim: &'static str,
    /// How scope and key columns are stored.
    pub key_columns: &'static str,
    /// How requests and responses are stored.
    pub json_storage: &'static str,
    /// What is retried, with the same key.
    pub retried: &'static str,
    /// Whether several sessions can open transactions at once (false for an in-memory
    /// SQLite database, which has one connection).
    pub concurrent_sessions: bool,
    /// Engine versions this column's results were written for.
    pub versions: &'static str,
}

/// One engine's test fixture: an idem backend plus the seed's `account` table.
///
/// A fixture connected with a namespace works in a private schema, database or file that
/// `close` removes, so cases run in parallel without seeing each other.
pub trait Bank: Sized + Send + Sync + 'static {
    /// The idem backend.
    type B: Backend + Maintenance + Clone + std::fmt::Debug;

    /// The engine's name in test names and reports (`"postgres"`).
    const ENGINE: &'static str;

    /// Connects to `url`, inside a fresh private `namespace` when one is given.
    fn connect(
        url: &str,
        namespace: Option<&str>,
    ) -> impl Future<Output = Result<Self, DbError>> + Send;

    /// The idem backend, connected to the same database.
    fn backend(&self) -> &Self::B;

    /// The engine's documented behaviour: shown by `idem check`, and the source of the
    /// engine's column in `docs/engines.md` when it was not run live.
    const DOCUMENTED: Capabilities;

    /// The behaviour of this connection (by default [`Bank::DOCUMENTED`]).
    fn capabilities(&self) -> Capabilities {
        Self::DOCUMENTED
    }

    /// The server's version string, as the server reports it.
    fn server_version(&self) -> impl Future<Output = Result<String, DbError>> + Send;

    /// Runs idem's migrations and creates the `account` table if missing.
    fn setup(&self) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Sets an account's balance, creating the account if needed.
    fn set_balance(
        &self,
        account: i64,
        balance: i64,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Reads a balance from a session of its own (outside any idem transaction).
    fn balance(&self, account: i64) -> impl Future<Output = Result<i64, DbError>> + Send;

    /// Like [`Bank::balance`], with `None` for an account that does not exist.
    fn find_balance(
        &self,
        account: i64,
    ) -> impl Future<Output = Result<Option<i64>, DbError>> + Send;

    /// The effect: debits `amount` in the idem transaction, refusing to go negative.
    fn debit(
        tx: &mut <Self::B as Backend>::Tx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>>;

    /// The effect: credits `amount` in the idem transaction.
    fn credit(
        tx: &mut <Self::B as Backend>::Tx,
        account: i64,
        amount: i64,
    ) -> BoxFuture<'_, Result<Balance, BankError>>;

    /// Inserts a finished request record with plain SQL, bypassing idem.
    fn insert_record_directly(
        &self,
        principal: &str,
        operation: &str,
        key: &str,
        request: &str,
        response: &str,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Counts request records.
    fn count_records(&self) -> impl Future<Output = Result<u64, DbError>> + Send;

    /// Closes the connections and drops the private namespace, if any.
    fn close(self) -> impl Future<Output = Result<(), DbError>> + Send;
}
