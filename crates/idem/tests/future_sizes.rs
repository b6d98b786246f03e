//! The size of idem's futures over each engine that can be built without a server
//! (SQLite in memory; PostgreSQL, MySQL/MariaDB and SQL Server on lazy pools, nothing
//! polled). Two things made them large (docs/performance.md, thirteenth and fourteenth
//! rounds):
//!
//! - a pool checkout awaited in place: sqlx's is about 8.5 KiB in a release build and
//!   deadpool's with tiberius's connect path about 55 KiB, and every future above it
//!   carried that size (`Idem::execute`'s over PostgreSQL was 19.4 KiB). idem-postgres
//!   and idem-mssql box their checkouts;
//! - idem-core holding the call's whole future three times over (a local, an `async fn`
//!   parameter and the future awaiting it): `execute`'s future was 3 984 bytes over
//!   PostgreSQL, 4 920 over MySQL/MariaDB and 34 288 over SQL Server (debug build), about
//!   three times the backend's largest future. It is held once now.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::time::Duration;

use idem::core::{Claim, Finish, Identity};
use idem::mssql::{MssqlBackend, MssqlOptions};
use idem::mysql::MysqlBackend;
use idem::postgres::PgBackend;
use idem::postgres::sqlx::postgres::PgPoolOptions;
use idem::sqlite::SqliteBackend;
use idem::{Backend, Idem, Key, MessageId, Operation, Principal, Request, Scope, Subscriber};

/// The sizes of one backend's futures and of the protocol's futures over it.
#[derive(Debug)]
struct Sizes {
    /// The largest of the backend's lookup, claim, lookup-or-claim and completion futures.
    backend: usize,
    execute: usize,
    consume: usize,
}

/// The size of what `f` would return, without calling it.
fn output_size<A, R>(_: &impl FnOnce(A) -> R) -> usize {
    std::mem::size_of::<R>()
}

fn sizes<B: Backend + Clone>(backend: &B) -> Sizes {
    let scope = Scope::new(
        Principal::new("account-7").unwrap(),
        Operation::new("debit", 1).unwrap(),
    );
    let key = Key::new("k-1").unwrap();
    let claim = Claim {
        id: Identity::Request {
            scope: &scope,
            key: &key,
        },
        request: Some("{}"),
        retention: Duration::from_secs(60),
        wait: Duration::from_secs(1),
    };
    let finish = |tx: B::Tx| backend.finish(tx, &claim, Finish::Rollback);
    let largest = [
        std::mem::size_of_val(&backend.lookup(&claim)),
        std::mem::size_of_val(&backend.claim(&claim)),
        std::mem::size_of_val(&backend.lookup_or_claim(&claim)),
        output_size(&finish),
    ]
    .into_iter()
    .max()
    .unwrap();

    let idem = Idem::new(backend.clone());
    let request = Request::new(serde_json::json!({"amount": 1}));
    let execute = std::mem::size_of_val(&idem.execute(&scope, &key, &request, |_tx| {
        Box::pin(async { Ok::<u8, std::io::Error>(1) })
    }));
    let subscriber = Subscriber::new("ledger").unwrap();
    let message = MessageId::new("m-1").unwrap();
    let consume = std::mem::size_of_val(&idem.consume(&subscriber, &message, None, |_tx| {
        Box::pin(async { Ok::<u8, std::io::Error>(1) })
    }));
    Sizes {
        backend: largest,
        execute,
        consume,
    }
}

/// A call's future holds the backend's futures once, plus the protocol's own state.
fn assert_held_once(engine: &str, sizes: &Sizes) {
    eprintln!("{engine}: {sizes:?}");
    assert!(
        sizes.execute < 2 * sizes.backend && sizes.consume < 2 * sizes.backend,
        "{engine}: Idem::execute's future is {} bytes and Idem::consume's {}, against the \
         backend's largest future of {}: does idem-core hold a call's future more than once?",
        sizes.execute,
        sizes.consume,
        sizes.backend
    );
}

#[tokio::test]
async fn postgres_futures_hold_no_checkout_and_the_call_once() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://postgres@127.0.0.1:1/unused")
        .unwrap();
    let checkout = std::mem::size_of_val(&pool.acquire());
    let sizes = sizes(&PgBackend::from_pool(pool));
    assert!(
        sizes.backend < 1536,
        "the backend's largest future is {} bytes (sqlx's checkout future is {checkout}): \
         is a checkout awaited in place again?",
        sizes.backend
    );
    assert_held_once("postgres", &sizes);
}

#[tokio::test]
async fn mysql_futures_hold_the_call_once() {
    let pool = idem::mysql::mysql_async::Pool::new("mysql://root@127.0.0.1:1/unused");
    assert_held_once("mysql", &sizes(&MysqlBackend::from_pool(pool)));
}

#[tokio::test]
async fn mssql_futures_hold_the_call_once() {
    let options = MssqlOptions::parse("mssql://sa:unused@127.0.0.1:1/master").unwrap();
    let backend = MssqlBackend::connect_lazy(options).unwrap();
    assert_held_once("mssql", &sizes(&backend));
}

#[tokio::test]
async fn sqlite_futures_hold_the_call_once() {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    assert_held_once("sqlite", &sizes(&backend));
}
