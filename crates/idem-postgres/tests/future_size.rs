//! The size of idem's futures over PostgreSQL. No server: the pool connects lazily and
//! nothing here is polled. sqlx's checkout future is about 8.5 KiB in a release build (it
//! holds the pool's whole connect path); awaited in place, it made `Idem::execute`'s
//! future 19.4 KiB, and the protocol copied futures of about 9 800 bytes three times per
//! call (docs/performance.md, thirteenth round). idem-postgres boxes it: `execute`'s
//! future is then about 4 KiB in release and debug builds alike (7.5 KiB in a debug build
//! without the box, whose checkout future is smaller).

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use idem_core::{Idem, Key, MessageId, Operation, Principal, Request, Scope, Subscriber};
use idem_postgres::PgBackend;
use idem_postgres::sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn execute_and_consume_futures_stay_small() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://postgres@127.0.0.1:1/unused")
        .unwrap();
    let checkout = std::mem::size_of_val(&pool.acquire());
    const BOUND: usize = 6 * 1024;
    let idem = Idem::new(PgBackend::from_pool(pool));
    let scope = Scope::new(
        Principal::new("account-7").unwrap(),
        Operation::new("debit", 1).unwrap(),
    );
    let key = Key::new("k-1").unwrap();
    let request = Request::new(serde_json::json!({"amount": 1}));
    let execute = std::mem::size_of_val(&idem.execute(&scope, &key, &request, |_tx| {
        Box::pin(async { Ok::<u8, std::io::Error>(1) })
    }));
    let subscriber = Subscriber::new("ledger").unwrap();
    let message = MessageId::new("m-1").unwrap();
    let consume = std::mem::size_of_val(&idem.consume(&subscriber, &message, None, |_tx| {
        Box::pin(async { Ok::<u8, std::io::Error>(1) })
    }));
    assert!(
        execute < BOUND && consume < BOUND,
        "Idem::execute's future is {execute} bytes and Idem::consume's {consume} (bound \
         {BOUND}; sqlx's checkout future is {checkout}): is a checkout awaited in place again?"
    );
}
