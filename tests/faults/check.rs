//! The invariant checker: what must hold after any run, whatever was killed.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

use crate::engines::{INITIAL, Snapshot};

/// What the checker found.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// Every broken promise, one line each.
    pub(crate) violations: Vec<String>,
    /// Records stored.
    pub(crate) records: usize,
    /// Stored records whose effect never applied.
    pub(crate) lost: usize,
    /// Extra applications of an effect (beyond the first), or applications without a record.
    pub(crate) doubled: usize,
    /// Successful replies compared with the stored responses.
    pub(crate) replies: usize,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} records, {} replies checked, effects lost {}, doubled {}, violations {}",
            self.records,
            self.replies,
            self.lost,
            self.doubled,
            self.violations.len()
        )?;
        for v in &self.violations {
            write!(f, "\n  VIOLATION {v}")?;
        }
        Ok(())
    }
}

/// Checks a snapshot against the keys the run planned (`(key, amount)`; each must end
/// with exactly one record) and every successful reply a client received.
pub(crate) fn check(
    plan: &[(String, i64)],
    replies: &[(String, Value)],
    snap: &Snapshot,
) -> Verdict {
    let mut v = Verdict {
        records: snap.records.len(),
        replies: replies.len(),
        ..Verdict::default()
    };
    let mut records: BTreeMap<&str, Vec<&crate::engines::Record>> = BTreeMap::new();
    for r in &snap.records {
        records.entry(r.key.as_str()).or_default().push(r);
    }
    let mut applied: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (key, amount) in &snap.ledger {
        applied.entry(key.as_str()).or_default().push(*amount);
    }

    // Balance moved by exactly the sum of the stored debits.
    let mut stored_sum = 0i64;
    for r in &snap.records {
        match serde_json::from_str::<Value>(&r.request)
            .ok()
            .and_then(|req| req.get("amount").and_then(Value::as_i64))
        {
            Some(amount) => stored_sum += amount,
            None => v.violations.push(format!(
                "key {}: stored request {:?} has no amount",
                r.key, r.request
            )),
        }
    }
    let moved = INITIAL - snap.balance;
    if moved != stored_sum {
        v.violations.push(format!(
            "balance moved by {moved}, but the stored debits sum to {stored_sum}"
        ));
    }

    // One record per key, each effect applied exactly once, no visible placeholder.
    let mut keys: Vec<&str> = records.keys().chain(applied.keys()).copied().collect();
    keys.extend(plan.iter().map(|(k, _)| k.as_str()));
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let recs = records.get(key).map_or(&[][..], Vec::as_slice);
        let runs = applied.get(key).map_or(0, Vec::len);
        if recs.len() > 1 {
            v.violations
                .push(format!("key {key}: {} records", recs.len()));
        }
        if let Some(r) = recs.first() {
            if r.response.is_none() {
                v.violations.push(format!(
                    "key {key}: a record without its response is visible"
                ));
            }
            match runs {
                0 => {
                    v.lost += 1;
                    v.violations.push(format!(
                        "key {key}: the response is stored but the effect never applied (lost)"
                    ));
                }
                1 => {}
                n => {
                    v.doubled += n - 1;
                    v.violations
                        .push(format!("key {key}: the effect applied {n} times (doubled)"));
                }
            }
        } else {
            if runs > 0 {
                v.doubled += runs;
                v.violations.push(format!(
                    "key {key}: the effect applied {runs} time(s) without a record"
                ));
            }
            if plan.iter().any(|(k, _)| k == key) {
                v.violations
                    .push(format!("key {key}: never succeeded despite retries"));
            }
        }
    }

    // Every successful reply equals the stored response.
    for (key, reply) in replies {
        let stored = records
            .get(key.as_str())
            .and_then(|r| r.first())
            .and_then(|r| r.response.as_deref())
            .and_then(|s| serde_json::from_str::<Value>(s).ok());
        match stored {
            Some(stored) if &stored == reply => {}
            Some(stored) => v.violations.push(format!(
                "key {key}: a client was told {reply} but the stored response is {stored}"
            )),
            None => v.violations.push(format!(
                "key {key}: a client was told {reply} but nothing is stored"
            )),
        }
    }
    v
}
