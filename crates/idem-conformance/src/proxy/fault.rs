//! Which statement a fault hits, and what it does there.
//!
//! A [`Trigger`] is a sequence of [`Marker`]s met in order on one connection, within one
//! transaction: "the `COMMIT` after a statement containing `order-17`" is
//! `Trigger::commit_after(Marker::containing("order-17"))`. A statement that starts or
//! ends a transaction without being the awaited marker starts the sequence over, so a
//! marker seen in a transaction that rolled back never arms the next one's `COMMIT`.

use std::collections::HashMap;
use std::time::Duration;

use super::wire::Statement;

/// What one statement must look like: its first keyword (optional) and byte strings
/// that must all occur in its text or bound parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marker {
    kind: Option<String>,
    contains: Vec<Vec<u8>>,
}

impl Marker {
    /// Any statement.
    pub fn any() -> Self {
        Self::default()
    }

    /// A statement whose first keyword is `kind` (`"COMMIT"`, `"UPDATE"`; any case).
    pub fn kind(kind: &str) -> Self {
        Self {
            kind: Some(kind.to_ascii_uppercase()),
            contains: Vec::new(),
        }
    }

    /// A statement containing `text` (in its SQL or its bound parameters).
    pub fn containing(text: impl AsRef<[u8]>) -> Self {
        Self::any().with(text)
    }

    /// `COMMIT`.
    pub fn commit() -> Self {
        Self::kind("COMMIT")
    }

    /// This marker, and `text` must occur too.
    #[must_use]
    pub fn with(mut self, text: impl AsRef<[u8]>) -> Self {
        self.contains.push(text.as_ref().to_vec());
        self
    }

    /// Whether `statement` fits.
    pub fn matches(&self, statement: &Statement) -> bool {
        self.kind.as_deref().is_none_or(|k| statement.kind() == k)
            && self.contains.iter().all(|c| statement.contains(c))
    }
}

/// Markers to meet in order on one connection, within one transaction; the fault hits
/// the statement that meets the last one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trigger {
    steps: Vec<Marker>,
}

impl Trigger {
    /// The first statement that fits `marker`.
    pub fn on(marker: Marker) -> Self {
        Self {
            steps: vec![marker],
        }
    }

    /// The `COMMIT` of a transaction in which a statement fitting `marker` ran.
    pub fn commit_after(marker: Marker) -> Self {
        Self::on(marker).then(Marker::commit())
    }

    /// After the markers so far, a statement fitting `marker`.
    #[must_use]
    pub fn then(mut self, marker: Marker) -> Self {
        self.steps.push(marker);
        self
    }
}

/// What a fault does to the statement it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Forward the statement, let the server run it and answer, drop the answer and
    /// close both sides: the client sees a broken connection, the statement ran.
    LoseReply,
    /// Forward only the first half of the statement's message and close both sides:
    /// the server never gets the whole statement.
    Cut,
    /// Forward the statement and hold the server's answer back this long.
    Delay(Duration),
}

/// A fault to arm on a proxy: where it hits, what it does, how often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    trigger: Trigger,
    action: Action,
    times: u32,
    skip: u32,
}

impl Fault {
    /// Lose the reply of the statement `trigger` finds ([`Action::LoseReply`]), once.
    pub fn lose_reply(trigger: Trigger) -> Self {
        Self::new(trigger, Action::LoseReply)
    }

    /// Cut the connection in the statement `trigger` finds ([`Action::Cut`]), once.
    pub fn cut(trigger: Trigger) -> Self {
        Self::new(trigger, Action::Cut)
    }

    /// Delay the reply of the statement `trigger` finds by `by`, once.
    pub fn delay(by: Duration, trigger: Trigger) -> Self {
        Self::new(trigger, Action::Delay(by))
    }

    /// `action` at the statement `trigger` finds, once.
    pub fn new(trigger: Trigger, action: Action) -> Self {
        Self {
            trigger,
            action,
            times: 1,
            skip: 0,
        }
    }

    /// Hit this many times (default 1) before the fault is spent.
    #[must_use]
    pub fn times(mut self, times: u32) -> Self {
        self.times = times;
        self
    }

    /// Let the first `skip` statements the trigger finds pass untouched.
    #[must_use]
    pub fn skip(mut self, skip: u32) -> Self {
        self.skip = skip;
        self
    }

    /// What it does.
    pub fn action(&self) -> Action {
        self.action
    }
}

/// An armed fault, for asking how often it hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FaultId(u64);

#[derive(Debug)]
struct Slot {
    id: FaultId,
    fault: Fault,
    remaining: u32,
    skip: u32,
    hits: u32,
    /// Per connection: how many of the trigger's markers were met.
    progress: HashMap<u64, usize>,
}

/// The faults armed on a proxy, and each connection's progress through their triggers.
#[derive(Debug, Default)]
pub struct Faults {
    slots: Vec<Slot>,
    next: u64,
}

impl Faults {
    /// Arms `fault`.
    pub fn arm(&mut self, fault: Fault) -> FaultId {
        self.next += 1;
        let id = FaultId(self.next);
        self.slots.push(Slot {
            id,
            remaining: fault.times,
            skip: fault.skip,
            fault,
            hits: 0,
            progress: HashMap::new(),
        });
        id
    }

    /// Disarms a fault (its hits are still counted).
    pub fn disarm(&mut self, id: FaultId) {
        if let Some(slot) = self.slots.iter_mut().find(|s| s.id == id) {
            slot.remaining = 0;
        }
    }

    /// Disarms every fault.
    pub fn disarm_all(&mut self) {
        for slot in &mut self.slots {
            slot.remaining = 0;
        }
    }

    /// How many times the fault hit.
    pub fn hits(&self, id: FaultId) -> u32 {
        self.slots.iter().find(|s| s.id == id).map_or(0, |s| s.hits)
    }

    /// Faults armed and not spent.
    pub fn armed(&self) -> usize {
        self.slots.iter().filter(|s| s.remaining > 0).count()
    }

    /// Connection `conn` sends `statement`: every armed fault moves along its trigger,
    /// through each of the statements the message runs ([`Statement::parts`], in order:
    /// a multi-statement text query can both start a transaction and claim, or complete
    /// and `COMMIT`); the first one that completes it (and is not skipping) hits the
    /// message.
    pub fn decide(&mut self, conn: u64, statement: &Statement) -> Option<(FaultId, Action)> {
        let mut hit = None;
        for part in statement.parts() {
            self.advance(conn, part, &mut hit);
        }
        hit
    }

    /// Moves every armed fault along its trigger for one statement.
    fn advance(&mut self, conn: u64, statement: &Statement, hit: &mut Option<(FaultId, Action)>) {
        for slot in self.slots.iter_mut().filter(|s| s.remaining > 0) {
            let at = slot.progress.entry(conn).or_insert(0);
            let steps = &slot.fault.trigger.steps;
            if steps.get(*at).is_some_and(|m| m.matches(statement)) {
                *at += 1;
                if *at < steps.len() {
                    continue;
                }
                *at = 0;
                if slot.skip > 0 {
                    slot.skip -= 1;
                    continue;
                }
                if hit.is_none() {
                    slot.remaining -= 1;
                    slot.hits += 1;
                    *hit = Some((slot.id, slot.fault.action));
                }
            } else if statement.is_transaction_boundary() {
                *at = 0;
            }
        }
    }

    /// Forgets a closed connection's progress.
    pub fn forget(&mut self, conn: u64) {
        for slot in &mut self.slots {
            slot.progress.remove(&conn);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn st(text: &str, params: &str) -> Statement {
        Statement::new(text, params.as_bytes().to_vec())
    }

    #[test]
    fn the_commit_after_a_marker_in_the_same_transaction() {
        let mut f = Faults::default();
        let id = f.arm(Fault::lose_reply(Trigger::commit_after(
            Marker::containing("idem_run").with("k-1"),
        )));
        // Another key's transaction, then one that rolls back: nothing.
        for s in [
            st("BEGIN", ""),
            st("UPDATE idem_run SET point = $7", "k-2"),
            st("COMMIT", ""),
            st("BEGIN", ""),
            st("UPDATE idem_run SET point = $7", "k-1"),
            st("ROLLBACK", ""),
            st("BEGIN", ""),
            st("SELECT 1", ""),
            st("COMMIT", ""),
        ] {
            assert_eq!(f.decide(1, &s), None, "{s:?}");
        }
        // A savepoint rollback stays inside the transaction.
        assert_eq!(f.decide(1, &st("BEGIN", "")), None);
        assert_eq!(
            f.decide(1, &st("UPDATE idem_run SET point = $7", "k-1")),
            None
        );
        assert_eq!(f.decide(1, &st("ROLLBACK TO SAVEPOINT a", "")), None);
        // Another connection's COMMIT is not this transaction's.
        assert_eq!(f.decide(2, &st("COMMIT", "")), None);
        assert_eq!(
            f.decide(1, &st("COMMIT", "")),
            Some((id, Action::LoseReply))
        );
        assert_eq!(f.hits(id), 1);
        // Spent.
        assert_eq!(
            f.decide(1, &st("UPDATE idem_run SET point = $7", "k-1")),
            None
        );
        assert_eq!(f.decide(1, &st("COMMIT", "")), None);
        assert_eq!(f.armed(), 0);
    }

    #[test]
    fn merged_mariadb_messages_are_followed_statement_by_statement() {
        // "k-1" as idem sends it in a text query: a hex literal.
        let claim = Statement::text_query(
            "START TRANSACTION; SET STATEMENT innodb_lock_wait_timeout = 3 FOR INSERT INTO \
             idem_request_result (principal, request_key) VALUES (_binary X'70', _binary X'6B2D31')",
        );
        let complete = Statement::text_query(
            "BEGIN NOT ATOMIC IF @@in_transaction = 0 THEN SIGNAL SQLSTATE '45000' SET \
             MESSAGE_TEXT = 'idem: lost; really'; END IF; UPDATE idem_request_result SET \
             response = _utf8mb4 X'7B7D' WHERE request_key = _binary X'6B2D31'; IF ROW_COUNT() \
             <> 1 THEN SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'x'; END IF; COMMIT; END",
        );
        let kinds: Vec<&str> = complete.parts().map(Statement::kind).collect();
        assert_eq!(kinds, ["IF", "END", "UPDATE", "IF", "END", "COMMIT", "END"]);
        let mut f = Faults::default();
        let insert = f.arm(Fault::lose_reply(Trigger::on(
            Marker::kind("INSERT")
                .with("idem_request_result")
                .with("k-1"),
        )));
        let commit = f.arm(Fault::lose_reply(Trigger::commit_after(
            Marker::kind("UPDATE")
                .with("idem_request_result")
                .with("k-1"),
        )));
        // Another key's messages hit nothing.
        let other = Statement::text_query(claim.text().replace("6B2D31", "6B2D32"));
        assert_eq!(f.decide(1, &other), None);
        assert_eq!(f.decide(1, &claim), Some((insert, Action::LoseReply)));
        // The completion's UPDATE and COMMIT travel together: the message is hit.
        assert_eq!(f.decide(1, &complete), Some((commit, Action::LoseReply)));
        assert_eq!((f.hits(insert), f.hits(commit)), (1, 1));
        // A single statement is its own only part.
        let one = st("COMMIT", "");
        assert_eq!(one.parts().count(), 1);
    }

    /// PostgreSQL's completion and `COMMIT` in one simple query, the key as hex digits:
    /// the `COMMIT` after the completion is found inside the message, and the message is
    /// what the fault hits.
    #[test]
    fn a_postgres_simple_query_is_followed_statement_by_statement() {
        let mut f = Faults::default();
        let commit = f.arm(Fault::lose_reply(Trigger::commit_after(
            Marker::kind("update")
                .with("idem_request_result")
                .with("k-1"),
        )));
        let message = |key_hex: &str| {
            Statement::text_query(format!(
                "UPDATE idem_request_result SET response = convert_from(decode('7b7d', 'hex'), \
                 'UTF8') WHERE request_key = convert_from(decode('{key_hex}', 'hex'), 'UTF8'); \
                 SELECT coalesce(NULL, 'idem: record gone; not')::integer; COMMIT; BEGIN"
            ))
        };
        assert_eq!(
            f.decide(1, &Statement::text_query("BEGIN; SET LOCAL x = '1'")),
            None
        );
        assert_eq!(f.decide(1, &message("6b2d32")), None, "another key");
        let hit = message("6B2D31");
        assert_eq!(hit.parts().count(), 4, "a quoted `;` splits nothing");
        assert_eq!(f.decide(1, &hit), Some((commit, Action::LoseReply)));
        assert_eq!(f.hits(commit), 1);
    }

    #[test]
    fn kinds_skips_and_times() {
        let mut f = Faults::default();
        let id = f.arm(
            Fault::cut(Trigger::on(Marker::kind("update").with("idem_outbox")))
                .skip(1)
                .times(2),
        );
        let update = st("UPDATE idem_outbox SET sent_at = now()", "");
        // COMMITTED is not COMMIT; SET is not UPDATE.
        assert_eq!(
            f.decide(1, &st("SET TRANSACTION ISOLATION LEVEL READ COMMITTED", "")),
            None
        );
        assert_eq!(f.decide(1, &st("SELECT * FROM idem_outbox", "")), None);
        assert_eq!(f.decide(1, &update), None); // skipped
        assert_eq!(f.decide(1, &update), Some((id, Action::Cut)));
        assert_eq!(f.decide(3, &update), Some((id, Action::Cut)));
        assert_eq!(f.decide(1, &update), None);
        assert_eq!(f.hits(id), 2);
    }

    #[test]
    fn disarmed_faults_never_hit() {
        let mut f = Faults::default();
        let a = f.arm(Fault::delay(
            Duration::from_millis(5),
            Trigger::on(Marker::any()),
        ));
        let b = f.arm(Fault::cut(Trigger::on(Marker::commit())));
        f.disarm(a);
        assert_eq!(f.decide(1, &st("COMMIT", "")), Some((b, Action::Cut)));
        f.disarm_all();
        assert_eq!(f.decide(1, &st("COMMIT", "")), None);
    }
}
