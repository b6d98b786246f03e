//! Criterion benchmarks of the protocol's paths on SQLite (and PostgreSQL when
//! `IDEM_POSTGRES_URL` is set, MySQL/MariaDB when `IDEM_MYSQL_URL` is and the `mysql`
//! feature is on): compare the paths' times within one run. `new_request` runs the
//! fast path's read and the claim together (`Backend::lookup_or_claim`: one pooled
//! connection on PostgreSQL); `new_request_no_fast_path` is the same without the read.
//! On SQLite, `sqlite_sync/new_request` is the same debit as synchronous code through
//! `ExecuteBlocking::execute_blocking` (the whole call in one trip to the blocking pool).
//! On PostgreSQL, `postgres_claim/*` compares the two claim styles on one new request
//! each: the key lock (the default on a single server) and the placeholder row.

use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use idem::{Idem, Key, Operation, Principal, Request, Scope};
use idem_conformance::Bank;
use idem_conformance::harness::namespace;
use serde_json::json;

/// A runtime, the demo bank in a private namespace of `url` (account 1 funded), idem on
/// its backend, the scope and the request every benchmark uses.
#[allow(clippy::type_complexity)]
fn prepare<K: Bank>(
    url: &str,
    ns: &str,
) -> (tokio::runtime::Runtime, K, Idem<K::B>, Scope, Request) {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => panic!("tokio: {e}"),
    };
    let bank = rt.block_on(async {
        let bank = K::connect(url, Some(&namespace(ns))).await?;
        bank.setup().await?;
        bank.set_balance(1, i64::MAX / 2).await?;
        Ok::<_, idem::DbError>(bank)
    });
    let bank = match bank {
        Ok(bank) => bank,
        Err(e) => panic!("cannot prepare {}: {e}", K::ENGINE),
    };
    let idem = Idem::new(bank.backend().clone());
    let scope = match (Principal::new("bench"), Operation::new("debit", 1)) {
        (Ok(p), Ok(o)) => Scope::new(p, o),
        _ => panic!("scope"),
    };
    (rt, bank, idem, scope, Request::new(json!({ "amount": 1 })))
}

fn paths<K: Bank>(c: &mut Criterion, url: &str) {
    let (rt, bank, idem, scope, request) = prepare::<K>(url, "criterion");
    let next = AtomicU64::new(0);
    let mut group = c.benchmark_group(K::ENGINE);
    group.bench_function("new_request", |b| {
        b.to_async(&rt).iter(|| async {
            let key = Key::new(format!("k-{}", next.fetch_add(1, Ordering::Relaxed)))
                .map_err(|e| e.to_string());
            let key = key.unwrap_or_else(|e| panic!("{e}"));
            let out = idem
                .execute(&scope, &key, &request, |tx| K::debit(tx, 1, 1))
                .await;
            assert!(out.is_ok());
        });
    });
    let direct = Idem::new(bank.backend().clone()).with_fast_path(false);
    group.bench_function("new_request_no_fast_path", |b| {
        b.to_async(&rt).iter(|| async {
            let key = Key::new(format!("n-{}", next.fetch_add(1, Ordering::Relaxed)))
                .map_err(|e| e.to_string());
            let key = key.unwrap_or_else(|e| panic!("{e}"));
            let out = direct
                .execute(&scope, &key, &request, |tx| K::debit(tx, 1, 1))
                .await;
            assert!(out.is_ok());
        });
    });
    group.bench_function("replay", |b| {
        let key = Key::new("k-0").unwrap_or_else(|e| panic!("{e}"));
        b.to_async(&rt).iter(|| async {
            let out = idem
                .execute(&scope, &key, &request, |tx| K::debit(tx, 1, 1))
                .await;
            assert!(matches!(out, Ok(idem::Outcome::Replayed(_))));
        });
    });
    group.finish();
    let _ = rt.block_on(bank.close());
}

/// A new request on SQLite whose effect is synchronous code, in one trip.
fn sqlite_sync(c: &mut Criterion, url: &str) {
    use idem::sqlite::ExecuteBlocking;
    use idem_conformance::sqlite::{SqliteBank, move_balance};
    let (rt, bank, idem, scope, request) = prepare::<SqliteBank>(url, "criterion-sync");
    let next = AtomicU64::new(0);
    let mut group = c.benchmark_group("sqlite_sync");
    group.bench_function("new_request", |b| {
        b.to_async(&rt).iter(|| async {
            let key = Key::new(format!("s-{}", next.fetch_add(1, Ordering::Relaxed)))
                .unwrap_or_else(|e| panic!("{e}"));
            let out = idem
                .execute_blocking(&scope, &key, &request, |c| move_balance(c, 1, 1, true))
                .await;
            assert!(matches!(out, Ok(idem::Outcome::Executed(_))));
        });
    });
    group.finish();
    let _ = rt.block_on(bank.close());
}

/// A new request on PostgreSQL with each claim style, in one group.
fn postgres_claims(c: &mut Criterion, url: &str) {
    use idem::postgres::ClaimStyle;
    use idem_conformance::postgres::PgBank;
    let (rt, bank, _, scope, request) = prepare::<PgBank>(url, "criterion_claims");
    let next = AtomicU64::new(0);
    let mut group = c.benchmark_group("postgres_claim");
    for (name, style) in [
        ("key_lock", ClaimStyle::KeyLock),
        ("placeholder", ClaimStyle::Placeholder),
    ] {
        let idem = Idem::new(bank.backend().clone().with_claim_style(style));
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let key = Key::new(format!("{name}-{}", next.fetch_add(1, Ordering::Relaxed)))
                    .unwrap_or_else(|e| panic!("{e}"));
                let out = idem
                    .execute(&scope, &key, &request, |tx| PgBank::debit(tx, 1, 1))
                    .await;
                assert!(matches!(out, Ok(idem::Outcome::Executed(_))), "{out:?}");
            });
        });
    }
    group.finish();
    let _ = rt.block_on(bank.close());
}

fn benches(c: &mut Criterion) {
    let dir = std::env::temp_dir().join("idem-bench");
    let sqlite = format!("sqlite://{}/bench.db", dir.display());
    paths::<idem_conformance::sqlite::SqliteBank>(c, &sqlite);
    sqlite_sync(c, &sqlite);
    if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
        paths::<idem_conformance::postgres::PgBank>(c, &url);
        postgres_claims(c, &url);
    }
    #[cfg(feature = "mysql")]
    if let Ok(url) = std::env::var("IDEM_MYSQL_URL") {
        paths::<idem_conformance::mysql::MysqlBank>(c, &url);
    }
}

criterion_group!(protocol, benches);
criterion_main!(protocol);
