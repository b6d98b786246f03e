//! `idem bench`: the protocol's paths measured in one run, reported as ratios.

use std::time::{Duration, Instant};

use idem::{Idem, Key, Operation, Principal, Request, Scope};
use idem_conformance::Bank;
use idem_conformance::harness::namespace;
use serde_json::json;

use crate::fail::Fail;

async fn time_debits<K: Bank>(
    idem: &Idem<K::B>,
    scope: &Scope,
    keys: impl Iterator<Item = String>,
) -> Result<(Duration, u32), Fail> {
    let request = Request::new(json!({ "amount": 1 }));
    let start = Instant::now();
    let mut n = 0;
    for key in keys {
        let key = Key::new(key)?;
        idem.execute(scope, &key, &request, |tx| K::debit(tx, 1, 1))
            .await
            .map_err(|e| Fail::new(1, e.to_string()))?;
        n += 1;
    }
    Ok((start.elapsed(), n))
}

pub(crate) async fn run<K: Bank>(url: &str, iterations: u32) -> Result<(), Fail> {
    let bank = K::connect(url, Some(&namespace("bench"))).await?;
    let result = async {
        bank.setup().await?;
        bank.set_balance(1, i64::MAX / 2).await?;
        let scope = Scope::new(Principal::new("bench")?, Operation::new("debit", 1)?);
        let fast = Idem::new(bank.backend().clone());
        let slow = fast.clone().with_fast_path(false);
        // Warm up connections and statement caches.
        time_debits::<K>(&fast, &scope, (0..10).map(|i| format!("warm-{i}"))).await?;
        let rows = [
            ("new request, fast path on (read + transaction)", time_debits::<K>(&fast, &scope, (0..iterations).map(|i| format!("a-{i}"))).await?),
            ("new request, fast path off (transaction only)", time_debits::<K>(&slow, &scope, (0..iterations).map(|i| format!("b-{i}"))).await?),
            ("replay, fast path on (one read)", time_debits::<K>(&fast, &scope, (0..iterations).map(|i| format!("a-{i}"))).await?),
            ("replay, fast path off (claim in a transaction)", time_debits::<K>(&slow, &scope, (0..iterations).map(|i| format!("a-{i}"))).await?),
        ];
        let base = rows[0].1.0.as_secs_f64() / f64::from(rows[0].1.1);
        println!("idem bench on {} ({}), {iterations} calls per path, one after another", K::ENGINE, bank.server_version().await?);
        println!("{:<50} {:>12} {:>10}", "path", "µs per call", "ratio");
        for (name, (took, n)) in rows {
            let per = took.as_secs_f64() / f64::from(n);
            println!("{name:<50} {:>12.1} {:>10.2}", per * 1e6, per / base);
        }
        println!("(ratios are relative to the first row, measured in this run; absolute times depend on the machine)");
        if cfg!(debug_assertions) {
            println!("(this is a debug build: run `cargo run --release -p idem-cli -- bench` for representative figures)");
        }
        Ok(())
    }
    .await;
    bank.close().await?;
    result
}
