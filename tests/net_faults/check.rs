//! The invariants, read from the database after every client got its definite answer
//! (as Jepsen checks: an operation whose outcome was unknown may have happened or not,
//! never twice).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::client::{Figures, KeyLog};
use crate::engines::Snapshot;

/// What the checker found.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    pub(crate) lost: u64,
    pub(crate) doubled: u64,
    pub(crate) moved_back: u64,
    pub(crate) messages_lost: u64,
    pub(crate) violations: Vec<String>,
}

impl Verdict {
    pub(crate) fn violation(&mut self, v: impl Into<String>) {
        self.violations.push(v.into());
    }

    /// Counts one step's applications for a key: `want` expected.
    pub(crate) fn applications(&mut self, key: &str, step: &str, got: usize, want: usize) {
        if got > want {
            self.doubled += 1;
            self.violation(format!(
                "key {key}: step {step} applied {got} times (doubled)"
            ));
        } else if got < want {
            self.lost += 1;
            self.violation(format!(
                "key {key}: step {step} applied {got} times, expected {want} (lost)"
            ));
        }
    }

    /// Every definite answer the client got equals the stored one.
    pub(crate) fn answers(&mut self, log: &KeyLog, stored: Option<&str>) {
        let Some(stored) = stored else {
            self.violation(format!("key {}: no stored answer", log.key));
            return;
        };
        let Ok(stored) = serde_json::from_str::<Value>(stored) else {
            self.violation(format!("key {}: the stored answer is not JSON", log.key));
            return;
        };
        for answer in &log.answers {
            if *answer != stored {
                self.violation(format!(
                    "key {}: the client got {answer}, the stored answer is {stored}",
                    log.key
                ));
            }
        }
        if let Some(e) = &log.unexpected {
            self.violation(format!("key {}: unexpected answer: {e}", log.key));
        }
    }

    /// Folds the verdict into the figures; an error listing the violations if any.
    pub(crate) fn conclude(self, figures: &mut Figures) -> Result<(), String> {
        figures.lost += self.lost;
        figures.doubled += self.doubled;
        figures.moved_back += self.moved_back;
        figures.messages_lost += self.messages_lost;
        if self.violations.is_empty() {
            return Ok(());
        }
        let n = self.violations.len();
        let mut shown: Vec<String> = self.violations.into_iter().take(25).collect();
        if n > shown.len() {
            shown.push(format!("… {} more", n - shown.len()));
        }
        Err(format!(
            "{figures}\n{n} violations:\n  {}",
            shown.join("\n  ")
        ))
    }
}

/// Ledger rows per `(key, step)`.
pub(crate) fn ledger_counts(snapshot: &Snapshot) -> BTreeMap<(String, String), usize> {
    let mut counts = BTreeMap::new();
    for (k, step) in &snapshot.ledger {
        *counts.entry((k.clone(), step.clone())).or_insert(0) += 1;
    }
    counts
}

/// Ledger rows of keys the trial never ran (an effect that escaped its key).
pub(crate) fn strays(verdict: &mut Verdict, snapshot: &Snapshot, keys: &BTreeSet<String>) {
    for (k, step) in &snapshot.ledger {
        if !keys.contains(k) {
            verdict.violation(format!(
                "ledger row ({k}, {step}) belongs to no key of the trial"
            ));
        }
    }
}

/// The order of a phased run's recovery points.
pub(crate) fn rank(point: Option<&str>) -> usize {
    match point {
        None | Some("started") => 0,
        Some("reserved") => 1,
        Some("charged") => 2,
        Some(_) => 3,
    }
}

/// A run's point never moves backwards: every phase saw at least the point the
/// previous phase of its key committed. Counts keys whose run moved back.
pub(crate) fn history(verdict: &mut Verdict, snapshot: &Snapshot) {
    let mut by_key: BTreeMap<&str, Vec<(Option<&str>, &str)>> = BTreeMap::new();
    for (k, seen, point) in &snapshot.history {
        by_key
            .entry(k.as_str())
            .or_default()
            .push((seen.as_deref(), point.as_str()));
    }
    for (key, rows) in by_key {
        let mut back = false;
        for pair in rows.windows(2) {
            let ((_, before), (seen, after)) = (pair[0], pair[1]);
            if rank(seen) < rank(Some(before)) {
                back = true;
                verdict.violation(format!(
                    "key {key}: the run moved back: phase {after} saw point {} after phase \
                     {before} had committed",
                    seen.unwrap_or("(none)")
                ));
            }
        }
        if back {
            verdict.moved_back += 1;
        }
    }
}
