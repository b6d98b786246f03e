//! [`ExecuteBlocking::execute_blocking`]: a whole call on one thread of the blocking pool.

use std::future::Future;
use std::sync::{Arc, Mutex};

use idem_core::blocking::in_one_trip;
use idem_core::{DbError, EffectError, Error, ErrorKind, Idem, Key, Outcome, Request, Scope};
use rusqlite::Connection;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{ENGINE, SqliteBackend};

/// [`Idem::execute`] for an effect that is plain synchronous rusqlite code.
///
/// `execute` makes one trip to tokio's blocking pool per step (the claim, the effect,
/// the completion); `execute_blocking` makes one trip for the whole call: the same
/// protocol, from the same code in idem-core, runs on one blocking thread, where each
/// statement is called in place ([`idem_core::blocking::in_one_trip`]). The effect
/// gets the transaction's connection: everything it writes commits or rolls back with
/// the record, exactly as with [`crate::SqliteTx::run`] inside `execute`.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{Idem, Key, Operation, Principal, Request, Scope};
/// use idem_sqlite::{ExecuteBlocking, SqliteBackend};
///
/// let idem = Idem::new(SqliteBackend::connect("sqlite://app.db").await?);
/// let scope = Scope::new(Principal::new("user-7")?, Operation::new("debit", 1)?);
/// let request = Request::new(serde_json::json!({"amount": 100}));
/// let outcome = idem
///     .execute_blocking(&scope, &Key::new("checkout-42")?, &request, |c| {
///         c.query_row(
///             "UPDATE account SET balance = balance - 100 WHERE id = 1 RETURNING balance",
///             [],
///             |r| r.get::<_, i64>(0),
///         )
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub trait ExecuteBlocking {
    /// Runs `effect` once per `(scope, key)`, like [`Idem::execute`]; see the trait.
    ///
    /// The effect may run more than once when an attempt fails with an error idem
    /// retries (a busy database, a deadlock): each attempt's writes were rolled back.
    /// A panic of the effect is re-raised here, and its connection is never reused.
    fn execute_blocking<R, E, M, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        effect: F,
    ) -> impl Future<Output = Result<Outcome<R>, Error<E>>> + Send
    where
        R: Serialize + DeserializeOwned + Send + 'static,
        E: EffectError<M>,
        M: 'static,
        F: FnMut(&Connection) -> Result<R, E> + Send + 'static;
}

impl ExecuteBlocking for Idem<SqliteBackend> {
    async fn execute_blocking<R, E, M, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        effect: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send + 'static,
        E: EffectError<M>,
        M: 'static,
        F: FnMut(&Connection) -> Result<R, E> + Send + 'static,
    {
        let idem = self.clone();
        let (scope, key, request) = (scope.clone(), key.clone(), request.clone());
        let effect = Arc::new(Mutex::new(effect));
        let runtime = tokio::runtime::Handle::current();
        let call = move || {
            runtime.block_on(idem.execute(&scope, &key, &request, move |tx| {
                let effect = Arc::clone(&effect);
                Box::pin(async move {
                    tx.run(move |c| {
                        // Only this call's attempts use it, one after the other.
                        let mut effect = effect
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        (*effect)(c)
                    })
                    .await
                })
            }))
        };
        match in_one_trip(call).await {
            Ok(out) => out,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(Error::Backend(DbError::new(
                ENGINE,
                ErrorKind::Other,
                format!(
                    "the blocking task of execute_blocking was cancelled (the runtime is shutting down): {e}"
                ),
            ))),
        }
    }
}
