//! Criterion micro-benchmarks of the pure-Rust parts on every call's path: identifier
//! validation, the canonical request, and the comparison of a stored request with the
//! supplied one (byte-equal fast path, and the reparse for reformatted stored JSON),
//! and the name of an identity's key lock (`Identity::lock_key`: SHA-256 of its parts,
//! once per new request on PostgreSQL).
//! CI runs them once each in test mode (`cargo test --benches`); no timing is asserted.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use idem::{Key, Operation, Principal, Request};
use serde_json::{Value, json};

/// A realistic checkout request: nested objects, an array, keys out of order.
fn checkout() -> Value {
    json!({
        "currency": "EUR",
        "amount": 12_990,
        "customer": {"id": "cus_8f14e45fceea167a", "email": "buyer@example.com", "tier": 2},
        "items": [
            {"sku": "A-100", "qty": 1, "price": 9_990},
            {"sku": "B-200", "qty": 3, "price": 1_000}
        ],
        "metadata": {"channel": "web", "campaign": "winter", "note": "leave at the door"}
    })
}

fn identifiers(c: &mut Criterion) {
    let mut g = c.benchmark_group("identifiers");
    g.bench_function("key_36_ascii", |b| {
        b.iter(|| Key::new(black_box("3f2b8c1e-9d4a-4e7b-a2f0-5c6d7e8f9a0b")))
    });
    let long = "k".repeat(255);
    g.bench_function("key_255_ascii", |b| {
        b.iter(|| Key::new(black_box(long.as_str())))
    });
    g.bench_function("key_from_header_bytes", |b| {
        b.iter(|| Key::from_bytes(black_box(b"3f2b8c1e-9d4a-4e7b-a2f0-5c6d7e8f9a0b")))
    });
    g.bench_function("key_rejected_control_char", |b| {
        b.iter(|| Key::new(black_box("checkout\u{0}42")))
    });
    g.bench_function("principal_and_operation", |b| {
        b.iter(|| {
            (
                Principal::new(black_box("account-1")),
                Operation::new(black_box("debit"), black_box(1)),
            )
        })
    });
    g.finish();
}

fn canonical(c: &mut Criterion) {
    let mut g = c.benchmark_group("canonical_request");
    let small = json!({ "amount": 100 });
    let large = checkout();
    g.bench_function("small_value", |b| {
        b.iter(|| Request::new(black_box(small.clone())))
    });
    g.bench_function("checkout_value", |b| {
        b.iter(|| Request::new(black_box(large.clone())))
    });
    let text = serde_json::to_string(&large).unwrap_or_default();
    g.bench_function("checkout_parse_text", |b| {
        b.iter(|| Request::parse(black_box(text.as_str())))
    });
    g.finish();
}

/// What a replay does with the stored request text: the canonical texts are compared
/// first; only a stored text an engine reformatted is parsed and canonicalized again.
fn same(stored: &str, supplied: &Request) -> bool {
    if stored == supplied.as_json() {
        return true;
    }
    serde_json::from_str::<Value>(stored)
        .map(|v| Request::new(v).as_json() == supplied.as_json())
        .unwrap_or(false)
}

fn stored_comparison(c: &mut Criterion) {
    let mut g = c.benchmark_group("stored_comparison");
    let supplied = Request::new(checkout());
    let verbatim = supplied.to_json();
    // PostgreSQL's jsonb text: keys reordered by length, spaces after separators.
    let reformatted = serde_json::to_string_pretty(&checkout()).unwrap_or_default();
    let different = Request::new(json!({ "amount": 101 })).to_json();
    g.bench_function("verbatim", |b| {
        b.iter(|| assert!(same(black_box(verbatim.as_str()), &supplied)))
    });
    g.bench_function("reformatted", |b| {
        b.iter(|| assert!(same(black_box(reformatted.as_str()), &supplied)))
    });
    g.bench_function("different", |b| {
        b.iter(|| assert!(!same(black_box(different.as_str()), &supplied)))
    });
    let response = r#"{"balance":900}"#;
    g.bench_function("decode_stored_response", |b| {
        b.iter(|| serde_json::from_str::<idem_conformance::Balance>(black_box(response)))
    });
    g.finish();
}

fn lock_keys(c: &mut Criterion) {
    use idem::core::Identity;
    use idem::{MessageId, Subscriber};
    let mut g = c.benchmark_group("lock_key");
    let scope = match (Principal::new("account-1"), Operation::new("debit", 1)) {
        (Ok(p), Ok(o)) => idem::Scope::new(p, o),
        _ => panic!("scope"),
    };
    let key = Key::new("3f2b8c1e-9d4a-4e7b-a2f0-5c6d7e8f9a0b").unwrap_or_else(|e| panic!("{e}"));
    g.bench_function("request", |b| {
        b.iter(|| {
            Identity::Request {
                scope: black_box(&scope),
                key: black_box(&key),
            }
            .lock_key()
        })
    });
    let subscriber = Subscriber::new("billing").unwrap_or_else(|e| panic!("{e}"));
    let message = MessageId::new("msg-3f2b8c1e-9d4a").unwrap_or_else(|e| panic!("{e}"));
    g.bench_function("message", |b| {
        b.iter(|| {
            Identity::Message {
                subscriber: black_box(&subscriber),
                message_id: black_box(&message),
            }
            .lock_key()
        })
    });
    g.finish();
}

criterion_group!(hot, identifiers, canonical, stored_comparison, lock_keys);
criterion_main!(hot);
