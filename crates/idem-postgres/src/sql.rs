//! Every statement the PostgreSQL backend sends.

use std::fmt::Write as _;

macro_rules! cutoff {
    ($n:literal) => {
        concat!("clock_timestamp() - make_interval(secs => $", $n, ")")
    };
}
macro_rules! request_pk {
    () => {
        "principal = $1 AND operation = $2 AND request_key = $3"
    };
}
macro_rules! message_pk {
    () => {
        "subscriber = $1 AND message_id = $2"
    };
}

/// A claim's `BEGIN` on a single node, one message: the session's own `lock_timeout`
/// (whatever set it: configuration, role, startup options or a `SET` on the pooled
/// connection) is kept in the transaction-local setting `idem.lock_timeout` for the
/// restore, then the bound is set: whole milliseconds formatted by the backend (an
/// integer, never user data), then `ms'`.
macro_rules! begin_claim {
    () => {
        "BEGIN; SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true); SET LOCAL lock_timeout = '"
    };
}
/// A run transaction's `BEGIN` on a single node with its bound (for the whole
/// transaction).
macro_rules! begin_bounded {
    () => {
        "BEGIN; SET LOCAL lock_timeout = '"
    };
}
/// The bound on Citus, a message of its own after `BEGIN` (Citus re-runs the whole text
/// of a message holding a propagated `SET LOCAL` on its workers, so nothing else may be
/// in it): `citus.propagate_set_commands = 'local'` makes Citus pass the `SET LOCAL` on
/// to the connections the transaction has or opens on its workers.
macro_rules! bound_citus {
    () => {
        "SET LOCAL citus.propagate_set_commands = 'local'; SET LOCAL lock_timeout = '"
    };
}
/// The claim's `BEGIN` with its bound, for `ms` milliseconds (single node).
pub(crate) fn begin_claim(ms: u128) -> String {
    format!("{}{ms}ms'", begin_claim!())
}
/// A run transaction's `BEGIN` with its bound, for `ms` milliseconds (single node).
pub(crate) fn begin_bounded(ms: u128) -> String {
    format!("{}{ms}ms'", begin_bounded!())
}
/// The bound on Citus, after a plain `BEGIN`, for `ms` milliseconds.
pub(crate) fn bound_citus(ms: u128) -> String {
    format!("{}{ms}ms'", bound_citus!())
}
/// A claim's `BEGIN` on a single node with the key lock (`ClaimStyle::KeyLock`), one
/// message with integers only, formatted by the backend (never user data): `BEGIN`, then
/// the transaction-scoped advisory lock named `lock` taken if it is free, which the
/// transaction-local `idem.locked` records (the re-read reports it: see
/// [`SELECT_REQUEST_LOCKED`]). A key held by another transaction costs nothing here: the
/// claim then waits for it with [`wait_key_lock`], bounded.
pub(crate) fn begin_key_lock(lock: i64) -> String {
    format!(
        "BEGIN; SELECT CASE WHEN pg_try_advisory_xact_lock({lock}) \
         THEN set_config('idem.locked', 'yes', true) END"
    )
}

/// The wait for a key another transaction holds, one message with integers only: the
/// session's own `lock_timeout` kept in the transaction-local `idem.lock_timeout` and
/// the bound set (one `SELECT`, its target list evaluated in order), then the lock
/// taken, waiting at most the bound (SQLSTATE 55P03 when it runs out), and the session's
/// value back; `idem.locked` and `idem.waited` record that it was taken after a wait.
/// The tests that the effect keeps the session's own value and that a held key answers
/// within the bound check that order.
pub(crate) fn wait_key_lock(ms: u128, lock: i64) -> String {
    format!(
        "SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true), \
         set_config('lock_timeout', '{ms}ms', true); \
         SELECT pg_advisory_xact_lock({lock}), \
         set_config('lock_timeout', current_setting('idem.lock_timeout'), true), \
         set_config('idem.locked', 'yes', true), set_config('idem.waited', 'yes', true)"
    )
}

/// The OIDs of idem's record tables, as the session's `search_path` finds them
/// (`NULL` before the migrations): the key lock's name mixes them in.
pub(crate) const TABLE_OIDS: &str = "SELECT to_regclass('idem_request_result')::oid::bigint, \
     to_regclass('idem_processed_message')::oid::bigint";

/// Whether the re-read after a key lock may not see a winner that committed while this
/// transaction waited for the lock: under REPEATABLE READ or SERIALIZABLE the snapshot
/// was taken by the `BEGIN` message's first `SELECT`, before the wait.
macro_rules! stale_snapshot {
    () => {
        "current_setting('idem.waited', true) = 'yes' AND current_setting('transaction_isolation') <> 'read committed' AS stale"
    };
}
/// A timestamp as whole microseconds since the epoch (`bigint`): exact, and read back by
/// [`from_us!`] whatever the session's `DateStyle` and `TimeZone`.
macro_rules! us {
    ($t:expr) => {
        concat!("(extract(epoch FROM ", $t, ") * 1000000)::bigint")
    };
}
/// [`us!`] read back as a `timestamptz`.
macro_rules! from_us {
    ($n:expr) => {
        concat!(
            "('epoch'::timestamptz + ",
            $n,
            " * interval '1 microsecond')"
        )
    };
}
/// What the key-lock re-read adds for the completion: the transaction's start
/// (`now()`: the completion's guard that it still runs in this transaction), the claim
/// time (the database clock after the lock's wait), the record's expiry (the claim time
/// plus the retention, `$n` µs), all [`us!`], the name under which this session prepared
/// the completion, if it did (the session setting `idem.complete_<table>`), and whether
/// this transaction holds the key lock.
macro_rules! claim_times {
    ($n:literal, $prepared:literal) => {
        concat!(
            us!("now()"),
            " AS begun, ",
            us!("clock_timestamp()"),
            " AS claimed, ",
            us!(concat!(
                "(clock_timestamp() + $",
                $n,
                " * interval '1 microsecond')"
            )),
            " AS expires, current_setting('",
            $prepared,
            "', true) AS prepared, current_setting('idem.locked', true) = 'yes' AS locked"
        )
    };
}
/// The key-lock claim's re-read: always one row, the record's columns (`NULL` when there
/// is none), whether it expired, whether it is absent, [`stale_snapshot!`] and
/// [`claim_times!`]. Params: principal, operation, key, retention (µs).
pub(crate) const SELECT_REQUEST_LOCKED: &str = concat!(
    "SELECT r.request, r.response, r.status, r.expires_at <= clock_timestamp() AS expired, r.expires_at IS NULL AS absent, ",
    stale_snapshot!(),
    ", ",
    claim_times!(4, "idem.complete_request"),
    " FROM (SELECT) AS one LEFT JOIN idem_request_result AS r ON r.principal = $1 AND r.operation = $2 AND r.request_key = $3"
);
/// [`SELECT_REQUEST_LOCKED`] for messages: fingerprint, expired, absent, stale, times.
/// Params: subscriber, message ID, retention (µs).
pub(crate) const SELECT_MESSAGE_LOCKED: &str = concat!(
    "SELECT m.fingerprint, m.expires_at <= clock_timestamp() AS expired, m.expires_at IS NULL AS absent, ",
    stale_snapshot!(),
    ", ",
    claim_times!(3, "idem.complete_message"),
    " FROM (SELECT) AS one LEFT JOIN idem_processed_message AS m ON m.subscriber = $1 AND m.message_id = $2"
);

/// A text value written into a simple query (which binds nothing): an escape string
/// constant, `E'…'`, whose meaning does not depend on `standard_conforming_strings`: each
/// backslash and quote of the value is doubled, the only two characters such a constant
/// treats specially, and everything else is the value's own UTF-8, which the server
/// reads in the session's `client_encoding` (UTF8, set by sqlx) exactly as it reads a
/// bound value. The value cannot hold a NUL (idem refuses one in keys, and JSON text
/// escapes it), which no PostgreSQL text can.
fn push_text_literal(out: &mut String, value: &str) {
    out.push_str("E'");
    let mut rest = value;
    // Both special characters are ASCII: a byte found is a whole character.
    while let Some(i) = rest.bytes().position(|b| b == b'\\' || b == b'\'') {
        let (head, tail) = rest.split_at(i + 1);
        out.push_str(head);
        out.push(char::from(head.as_bytes()[i]));
        rest = tail;
    }
    out.push_str(rest);
    out.push('\'');
}

/// A value written into a key-lock completion's text (see [`push_text_literal`]).
#[derive(Debug, Clone, Copy)]
enum Lit<'a> {
    Text(&'a str),
    Null,
    Int(i64),
}

impl<'a> Lit<'a> {
    fn text(value: Option<&'a str>) -> Self {
        value.map_or(Lit::Null, Lit::Text)
    }

    /// The most bytes [`Lit::push`] writes.
    fn max_len(self) -> usize {
        match self {
            Lit::Text(v) => 2 * v.len() + 3,
            Lit::Null => 4,
            Lit::Int(_) => 20,
        }
    }

    fn push(self, out: &mut String) {
        match self {
            Lit::Text(v) => push_text_literal(out, v),
            Lit::Null => out.push_str("NULL"),
            Lit::Int(n) => {
                let _ = write!(out, "{n}");
            }
        }
    }

    fn render(self) -> String {
        let mut out = String::with_capacity(self.max_len());
        self.push(&mut out);
        out
    }
}

/// The times a key-lock claim read ([`SELECT_REQUEST_LOCKED`]), in µs since the epoch,
/// and the name of the session's prepared completion, if it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClaimTimes {
    /// The transaction's start.
    pub(crate) begun: i64,
    /// The claim time: the record's `created_at`.
    pub(crate) claimed: i64,
    /// The record's `expires_at`.
    pub(crate) expires: i64,
    /// The name under which this session prepared the completion (`idem_c…`, checked).
    pub(crate) prepared: Option<String>,
}

/// Whether `name` is one [`prepared_name`] makes (it is written into SQL text).
pub(crate) fn is_prepared_name(name: &str) -> bool {
    name.strip_prefix("idem_c")
        .and_then(|rest| rest.strip_prefix(['r', 'm']))
        .and_then(|rest| rest.strip_prefix('_'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A new name for a session's prepared completion (`idem_cr_<n>` for requests,
/// `idem_cm_<n>` for messages): unique in this process, so a name left behind in a
/// session by a transaction that failed after its `PREPARE` is never prepared again.
pub(crate) fn prepared_name(request: bool) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("idem_c{}_{n}", if request { 'r' } else { 'm' })
}

/// The guards of a key-lock completion, written into its `VALUES` (`$b`: the
/// transaction's start, `$c` the claim time, `$e` the expiry, each [`us!`]). Every guard
/// that fails sets a `NOT NULL` column to `NULL`, so the `INSERT` fails with SQLSTATE
/// 23502 and the `COMMIT` after it in the same message never runs; the column says
/// which guard (a structured field, never message text): the key's last column when
/// `now()` is no longer the claiming transaction's start (that transaction ended: the
/// effect ran its own `COMMIT` or `ROLLBACK`), the time column when the record would be
/// born expired (its retention ran out while the effect ran). A live record of the key
/// written meanwhile by a session that did not take the key lock (an earlier idem, SQL
/// of the application's own) fails the `INSERT` with 23505.
macro_rules! locked_request_values {
    ($p:expr, $o:expr, $k:expr, $req:expr, $resp:expr, $status:expr, $b:expr, $c:expr, $e:expr) => {
        concat!(
            "INSERT INTO idem_request_result AS r (principal, operation, request_key, request, response, status, created_at, expires_at) VALUES (",
            $p, ", ", $o, ", CASE WHEN now() = ", from_us!($b), " THEN ", $k, " END, ", $req, ", ", $resp, ", ", $status,
            ", CASE WHEN statement_timestamp() < ", from_us!($e), " THEN ", from_us!($c), " END, ", from_us!($e), ")"
        )
    };
}
/// [`locked_request_values!`] for messages: `message_id` (the transaction ended),
/// `processed_at` (expired while the effect ran).
macro_rules! locked_message_values {
    ($s:expr, $m:expr, $fp:expr, $b:expr, $c:expr, $e:expr) => {
        concat!(
            "INSERT INTO idem_processed_message AS m (subscriber, message_id, fingerprint, processed_at, expires_at) VALUES (",
            $s, ", CASE WHEN now() = ", from_us!($b), " THEN ", $m, " END, ", $fp,
            ", CASE WHEN statement_timestamp() < ", from_us!($e), " THEN ", from_us!($c), " END, ", from_us!($e), ")"
        )
    };
}
/// The key-lock completion of a request as a prepared statement: parsed, analysed and
/// planned once per session, then only executed. Params: principal, operation, key,
/// request, response, status, begun, claimed, expires (µs).
pub(crate) const PREPARED_REQUEST: &str = concat!(
    "(text, text, text, text, text, int2, bigint, bigint, bigint) AS ",
    locked_request_values!("$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8", "$9")
);
/// [`PREPARED_REQUEST`] for messages. Params: subscriber, message ID, fingerprint,
/// begun, claimed, expires (µs).
pub(crate) const PREPARED_MESSAGE: &str = concat!(
    "(text, text, text, bigint, bigint, bigint) AS ",
    locked_message_values!("$1", "$2", "$3", "$4", "$5", "$6")
);
/// Replacing an expired record instead of inserting: `ON CONFLICT … DO UPDATE` of that
/// record only; a live one sets `expires_at` to `NULL` (23502). Only columns the
/// least-privilege writer may update (`grants.sql`) are set: never a key column.
const REPLACE_REQUEST: &str = " ON CONFLICT (principal, operation, request_key) DO UPDATE SET \
     request = excluded.request, response = excluded.response, status = excluded.status, \
     created_at = excluded.created_at, \
     expires_at = CASE WHEN r.expires_at <= statement_timestamp() THEN excluded.expires_at END";
/// [`REPLACE_REQUEST`] for messages.
const REPLACE_MESSAGE: &str = " ON CONFLICT (subscriber, message_id) DO UPDATE SET \
     fingerprint = excluded.fingerprint, processed_at = excluded.processed_at, \
     expires_at = CASE WHEN m.expires_at <= statement_timestamp() THEN excluded.expires_at END";

/// The key-lock completion and its `COMMIT` in one message. A new key executes the
/// session's prepared completion (preparing it first, under a new name kept in the
/// session setting `idem.complete_<table>`, when the session has none); an expired
/// record is replaced by a plain statement with `ON CONFLICT … DO UPDATE`. `values`:
/// the statement's parameters up to the times, in its order; `claim`: what the re-read
/// read (the times follow the values). The trailing `BEGIN` opens an empty transaction for sqlx's queued `ROLLBACK` to
/// end (see `PgTx::commit_with`).
fn complete_locked(request: bool, values: &[Lit<'_>], claim: &ClaimTimes, replace: bool) -> String {
    let times = [claim.begun, claim.claimed, claim.expires].map(Lit::Int);
    let args = || values.iter().chain(&times).copied();
    let (table, prepared_sql) = if request {
        ("request", PREPARED_REQUEST)
    } else {
        ("message", PREPARED_MESSAGE)
    };
    if replace {
        // Only for a record that expired: built with `format!`, once per such record.
        let values: Vec<String> = args().map(Lit::render).collect();
        let v = |i: usize| values[i].as_str();
        let insert = if request {
            format!(
                "INSERT INTO idem_request_result AS r (principal, operation, request_key, request, response, status, created_at, expires_at) \
                 VALUES ({}, {}, CASE WHEN now() = {b} THEN {} END, {}, {}, {}, CASE WHEN statement_timestamp() < {e} THEN {c} END, {e}){REPLACE_REQUEST}",
                v(0),
                v(1),
                v(2),
                v(3),
                v(4),
                v(5),
                b = from_us(v(6)),
                c = from_us(v(7)),
                e = from_us(v(8)),
            )
        } else {
            format!(
                "INSERT INTO idem_processed_message AS m (subscriber, message_id, fingerprint, processed_at, expires_at) \
                 VALUES ({}, CASE WHEN now() = {b} THEN {} END, {}, CASE WHEN statement_timestamp() < {e} THEN {c} END, {e}){REPLACE_MESSAGE}",
                v(0),
                v(1),
                v(2),
                b = from_us(v(3)),
                c = from_us(v(4)),
                e = from_us(v(5)),
            )
        };
        return format!("{insert}; COMMIT; BEGIN");
    }
    // The common case, written in one pass into one string, allocated once for the
    // longest the literals can be: the `EXECUTE` of the session's prepared completion,
    // preceded by its `PREPARE` when the session has none.
    let prepared = claim.prepared.as_deref().filter(|n| is_prepared_name(n));
    let new_name = prepared.is_none().then(|| prepared_name(request));
    let name = prepared.or(new_name.as_deref()).unwrap_or_default();
    let args_len: usize = args().map(|v| v.max_len() + 2).sum();
    let prepare_len = new_name.as_ref().map_or(0, |_| {
        "PREPARE  ; SELECT set_config('idem.complete_', '', false); ".len()
            + 2 * name.len()
            + prepared_sql.len()
            + table.len()
    });
    let mut out = String::with_capacity(
        prepare_len + "EXECUTE (); COMMIT; BEGIN".len() + name.len() + args_len,
    );
    if new_name.is_some() {
        let _ = write!(
            out,
            "PREPARE {name} {prepared_sql}; SELECT set_config('idem.complete_{table}', '{name}', false); "
        );
    }
    out.push_str("EXECUTE ");
    out.push_str(name);
    out.push('(');
    for (i, v) in args().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        v.push(&mut out);
    }
    out.push_str("); COMMIT; BEGIN");
    out
}

/// Forgets the session's prepared completions (after an `EXECUTE` found one gone), so
/// the next completion prepares them again.
pub(crate) const FORGET_PREPARED: &str = "SELECT set_config('idem.complete_request', '', false), \
     set_config('idem.complete_message', '', false)";

/// [`from_us!`] for a value known only at run time.
fn from_us(n: &str) -> String {
    format!("('epoch'::timestamptz + {n} * interval '1 microsecond')")
}

/// The key-lock completion of a request and its `COMMIT` (see [`complete_locked`]).
pub(crate) fn complete_request_locked(
    key: [&str; 3],
    request: Option<&str>,
    response: Option<&str>,
    status: i16,
    times: &ClaimTimes,
    replace: bool,
) -> String {
    let [principal, operation, key] = key;
    let values = [
        Lit::Text(principal),
        Lit::Text(operation),
        Lit::Text(key),
        Lit::text(request),
        Lit::text(response),
        Lit::Int(status.into()),
    ];
    complete_locked(true, &values, times, replace)
}

/// The key-lock completion of a message and its `COMMIT` (see [`complete_locked`]).
pub(crate) fn complete_message_locked(
    key: [&str; 2],
    fingerprint: Option<&str>,
    times: &ClaimTimes,
    replace: bool,
) -> String {
    let [subscriber, message_id] = key;
    let values = [
        Lit::Text(subscriber),
        Lit::Text(message_id),
        Lit::text(fingerprint),
    ];
    complete_locked(false, &values, times, replace)
}

/// On Citus, once the claim is won: the effect gets the default `lock_timeout` back, on
/// the coordinator and (propagated) on the workers. On a single node the claim's write
/// restores the session's exact value instead (see `then_restore!`).
pub(crate) const RESTORE_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout TO DEFAULT";
/// Appended to a claim write (an `INSERT … ON CONFLICT DO NOTHING` or the guarded
/// takeover) so that, when it wrote its row, the same statement gives the effect the
/// session's `lock_timeout` back: `RETURNING` is computed once the row is written, after
/// any wait, so the write itself stays bounded; no row, no restore. Single-node
/// PostgreSQL only: a `set_config` is not passed on to Citus workers, so on Citus the
/// write goes alone and [`RESTORE_LOCK_TIMEOUT`] follows. The claim's `BEGIN`
/// ([`begin_claim`]) kept the session's value.
macro_rules! then_restore {
    ($write:expr) => {
        concat!(
            $write,
            " RETURNING set_config('lock_timeout', current_setting('idem.lock_timeout'), true)"
        )
    };
}

/// The database clock of the claim's writes: `statement_timestamp()`, STABLE (one
/// reading per statement, shared by every column it sets), which Citus accepts in
/// modifications of distributed tables where it refuses the VOLATILE
/// `clock_timestamp()`.
macro_rules! insert_request {
    () => {
        concat!(
            "INSERT INTO idem_request_result (principal, operation, request_key, request, created_at, expires_at) ",
            "VALUES ($1, $2, $3, $4, statement_timestamp(), statement_timestamp() + make_interval(secs => $5)) ",
            "ON CONFLICT (principal, operation, request_key) DO NOTHING"
        )
    };
}
/// The claim: conflicts wait for the other transaction (bounded by `lock_timeout`) and
/// then do nothing. `VALUES`, not a `SELECT`: Citus counts the rows an `INSERT …
/// SELECT` sent, not the rows it inserted. Params: principal, operation, key, request,
/// retention (s).
pub(crate) const INSERT_REQUEST: &str = insert_request!();
/// [`INSERT_REQUEST`] restoring the session's `lock_timeout` when it inserted (one row
/// back) — see `then_restore!`.
pub(crate) const INSERT_REQUEST_RESTORE: &str = then_restore!(insert_request!());
/// The separate re-read after a conflict: under READ COMMITTED a new statement sees the
/// winner's committed row, which the INSERT's snapshot may not have.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status, expires_at <= clock_timestamp() AS expired FROM idem_request_result WHERE ",
    request_pk!()
);
macro_rules! replace_expired_request {
    () => {
        concat!(
            "UPDATE idem_request_result SET request = $4, response = NULL, status = 0, created_at = statement_timestamp(), ",
            "expires_at = statement_timestamp() + make_interval(secs => $5) WHERE ",
            request_pk!(),
            " AND expires_at <= statement_timestamp()"
        )
    };
}
/// Takes an expired record over as a fresh placeholder. Params: principal, operation,
/// key, request, retention (s).
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = replace_expired_request!();
/// [`REPLACE_EXPIRED_REQUEST`] restoring the session's `lock_timeout` when it replaced.
pub(crate) const REPLACE_EXPIRED_REQUEST_RESTORE: &str = then_restore!(replace_expired_request!());
/// Completes the placeholder just before `COMMIT`: exactly one row, still unfinished in
/// this transaction and not expired while the effect ran (else a waiting loser could
/// take the committed record over and run the effect again). Params: principal,
/// operation, key, response, status.
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET response = $4, status = $5 WHERE ",
    request_pk!(),
    " AND response IS NULL AND expires_at > statement_timestamp()"
);
/// Why a completion found no row: `Some(true)` when the record expired.
pub(crate) const EXPIRED_REQUEST: &str = concat!(
    "SELECT expires_at <= statement_timestamp() FROM idem_request_result WHERE ",
    request_pk!()
);
/// The replay fast path. Params: principal, operation, key.
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result WHERE ",
    request_pk!(),
    " AND expires_at > clock_timestamp()"
);

macro_rules! insert_message {
    () => {
        concat!(
            "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) ",
            "VALUES ($1, $2, $3, statement_timestamp(), statement_timestamp() + make_interval(secs => $4)) ",
            "ON CONFLICT (subscriber, message_id) DO NOTHING"
        )
    };
}
/// Params: subscriber, message ID, fingerprint, retention (s).
pub(crate) const INSERT_MESSAGE: &str = insert_message!();
/// [`INSERT_MESSAGE`] restoring the session's `lock_timeout` when it inserted.
pub(crate) const INSERT_MESSAGE_RESTORE: &str = then_restore!(insert_message!());
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint, expires_at <= clock_timestamp() AS expired FROM idem_processed_message WHERE ",
    message_pk!()
);
macro_rules! replace_expired_message {
    () => {
        concat!(
            "UPDATE idem_processed_message SET fingerprint = $3, processed_at = statement_timestamp(), ",
            "expires_at = statement_timestamp() + make_interval(secs => $4) WHERE ",
            message_pk!(),
            " AND expires_at <= statement_timestamp()"
        )
    };
}
/// Params: subscriber, message ID, fingerprint, retention (s).
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = replace_expired_message!();
/// [`REPLACE_EXPIRED_MESSAGE`] restoring the session's `lock_timeout` when it replaced.
pub(crate) const REPLACE_EXPIRED_MESSAGE_RESTORE: &str = then_restore!(replace_expired_message!());
/// Before a message's commit: `true` while the claimed row is live, `false` when it
/// expired while the effect ran, no row when it is gone (the effect ended the
/// transaction). A plain read: the transaction sees its own row.
pub(crate) const EXPIRED_MESSAGE: &str = concat!(
    "SELECT expires_at <= statement_timestamp() FROM idem_processed_message WHERE ",
    message_pk!()
);
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND expires_at > clock_timestamp()"
);

/// What runs behind the PostgreSQL protocol (read once per backend): whether Citus is
/// installed (the claim then sends its writes and the restore of `lock_timeout` as
/// separate statements), and `version()` (CockroachDB and YugabyteDB say so there).
pub(crate) const FLAVOR: &str =
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus'), version()";

/// Records that are expired **and** were claimed at least `$1` seconds ago, oldest
/// expiry first; rows locked by a live transaction are skipped. Params: older than (s),
/// limit.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE expires_at <= clock_timestamp() AND created_at <= ",
    cutoff!(1),
    " ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);
/// What the distributed purges delete: expired, and written (`$t`) at least `$1`
/// seconds ago, by `statement_timestamp()`: STABLE, which Citus accepts in a `DELETE`
/// where it refuses the VOLATILE `clock_timestamp()`.
macro_rules! purgeable {
    ($t:literal) => {
        concat!(
            "expires_at <= statement_timestamp() AND ",
            $t,
            " <= statement_timestamp() - make_interval(secs => $1)"
        )
    };
}
/// The purge for distributed PostgreSQL (Citus): the same bounded batch of expired
/// records without the multi-shard `FOR UPDATE SKIP LOCKED` Citus refuses. Concurrent
/// purgers may wait for each other instead of skipping rows. Without row locks the
/// batch can hold a key that a new request takes over before the `DELETE` reaches it
/// (on Citus the batch is read by a statement of its own), so the `DELETE` checks the
/// expiry again on the row it deletes. Params: older than (s), limit.
pub(crate) const PURGE_REQUESTS_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE ",
    purgeable!("created_at"),
    " ORDER BY expires_at LIMIT $2) AND ",
    purgeable!("created_at")
);
/// The message purge for distributed PostgreSQL (see [`PURGE_REQUESTS_DISTRIBUTED`]).
pub(crate) const PURGE_MESSAGES_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE ",
    purgeable!("processed_at"),
    " ORDER BY expires_at LIMIT $2) AND ",
    purgeable!("processed_at")
);
/// Like [`PURGE_REQUESTS`], for messages.
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE expires_at <= clock_timestamp() AND processed_at <= ",
    cutoff!(1),
    " ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);

// Phased runs and the outbox. The database clock is `statement_timestamp()` (STABLE:
// one value per statement), never a VOLATILE function such as `clock_timestamp()`, so
// every statement stays valid on Citus with `idem_run` distributed by `principal`
// (Citus refuses VOLATILE functions in modifications of distributed tables). Run
// statements are keyed by the full primary key, so each stays on one shard.

/// The database clock of run and outbox statements.
macro_rules! stmt_now {
    () => {
        "statement_timestamp()"
    };
}
/// `stmt_now!() + $n seconds`.
macro_rules! from_now {
    ($n:literal) => {
        concat!("statement_timestamp() + make_interval(secs => $", $n, ")")
    };
}
/// Microseconds from `$a` to `$b` (two timestamps), as a `bigint`.
macro_rules! micros_between {
    ($a:expr, $b:expr) => {
        concat!(
            "(extract(epoch FROM ",
            $b,
            " - ",
            $a,
            ") * 1000000)::bigint"
        )
    };
}
/// The pass's own claim, or no unexpired claim: `$n` is the pass's token.
macro_rules! ours_or_unclaimed {
    ($n:literal) => {
        concat!(
            "(claim_token = $",
            $n,
            " OR claimed_until IS NULL OR claimed_until <= statement_timestamp())"
        )
    };
}

/// A new phased run, committed at its start; a conflicting insert waits for the other
/// transaction, then does nothing. Params: principal, operation, key, request, owner,
/// fence, point, lease (s), retention (s).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, ",
    "lease_until, created_at, updated_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, ",
    from_now!(8),
    ", ",
    stmt_now!(),
    ", ",
    stmt_now!(),
    ", ",
    from_now!(9),
    ") ON CONFLICT (principal, operation, request_key) DO NOTHING"
);
/// A run, with its lease and retention read against the database clock, locked until
/// the transaction ends. Params: principal, operation, key.
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, lease_until <= ",
    stmt_now!(),
    " AS lease_over, expires_at <= ",
    stmt_now!(),
    " AS expired FROM idem_run WHERE ",
    request_pk!(),
    " FOR UPDATE"
);
/// The guarded write, a compare-and-set: only while the row holds the expected owner,
/// fence and point and has no final answer. Params: principal, operation, key,
/// expected owner, owner, fence, point, state, status, response, lease (s), expected
/// fence, expected point.
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = $5, fence = $6, point = $7, state = $8, status = $9, ",
    "response = $10, lease_until = ",
    from_now!(11),
    ", updated_at = ",
    stmt_now!(),
    " WHERE ",
    request_pk!(),
    " AND owner = $4 AND fence = $12 AND point = $13 AND status IS NULL"
);
/// The lease alone (heartbeat, release): never the point or the state. Params:
/// principal, operation, key, owner, fence, lease (s).
pub(crate) const RENEW_LEASE: &str = concat!(
    "UPDATE idem_run SET lease_until = ",
    from_now!(6),
    " WHERE ",
    request_pk!(),
    " AND owner = $4 AND fence = $5 AND status IS NULL"
);
/// Deletes a run while its owner is the expected one. Params: principal, operation,
/// key, expected owner.
pub(crate) const DELETE_RUN: &str = concat!(
    "DELETE FROM idem_run WHERE ",
    request_pk!(),
    " AND owner = $4"
);
/// After a start's lock wait ran out: the run's row, unless another transaction holds
/// it. Params: principal, operation, key.
pub(crate) const PROBE_RUN_LOCK: &str = concat!(
    "SELECT 1 FROM idem_run WHERE ",
    request_pk!(),
    " FOR UPDATE SKIP LOCKED"
);
/// Whether a committed row of the run exists (a plain read: never waits for row locks).
/// Params: principal, operation, key.
pub(crate) const PROBE_RUN_EXISTS: &str = concat!("SELECT 1 FROM idem_run WHERE ", request_pk!());
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first.
/// Params: limit.
pub(crate) const STALLED_RUNS: &str = concat!(
    "SELECT principal, operation, request_key, point FROM idem_run ",
    "WHERE status IS NULL AND lease_until <= ",
    stmt_now!(),
    " AND expires_at > ",
    stmt_now!(),
    " ORDER BY lease_until LIMIT $1"
);

/// Params: destination, message ID, payload.
pub(crate) const ENQUEUE: &str = concat!(
    "INSERT INTO idem_outbox (destination, message_id, payload, created_at) VALUES ($1, $2, $3, ",
    stmt_now!(),
    ")"
);
/// The oldest due messages, locked; rows another relay holds are skipped. Due: unsent,
/// not dead, the next attempt's time passed, no unexpired claim, and no older pending
/// message of the destination that is not due or is claimed. Params: limit.
pub(crate) const LOCK_DUE: &str = concat!(
    "SELECT o.id, o.destination, o.message_id, o.payload, o.attempts::bigint FROM idem_outbox AS o ",
    "WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= ",
    stmt_now!(),
    ") AND (o.claimed_until IS NULL OR o.claimed_until <= ",
    stmt_now!(),
    ") AND NOT EXISTS (SELECT 1 FROM idem_outbox AS b WHERE b.destination = o.destination ",
    "AND b.id < o.id AND b.sent_at IS NULL AND b.dead_at IS NULL AND (b.next_attempt_at > ",
    stmt_now!(),
    " OR b.claimed_until > ",
    stmt_now!(),
    ")) ORDER BY o.id LIMIT $1 FOR UPDATE OF o SKIP LOCKED"
);
/// Every pending (unsent, not dead) message of a destination up to an id, including rows
/// other relays hold (a plain read). Params: destination, up to.
pub(crate) const PENDING_IDS: &str = "SELECT id FROM idem_outbox \
     WHERE destination = $1 AND sent_at IS NULL AND dead_at IS NULL AND id <= $2 ORDER BY id";
/// Claims messages for a pass (one more attempt each). Params: token, lease (s), ids
/// (`bigint[]`).
pub(crate) const CLAIM_DUE: &str = concat!(
    "UPDATE idem_outbox SET claim_token = $1, claimed_until = ",
    from_now!(2),
    ", attempts = attempts + 1 WHERE id = ANY($3) AND sent_at IS NULL"
);
/// Gives back claimed messages the pass did not try (the attempt uncounted). Params:
/// token, ids.
pub(crate) const RELEASE: &str = "UPDATE idem_outbox SET claim_token = NULL, claimed_until = NULL, \
     attempts = greatest(attempts - 1, 0) WHERE id = ANY($2) AND sent_at IS NULL AND claim_token = $1";
/// Marks the pass's published messages sent. Params: token, ids.
pub(crate) const MARK_SENT: &str = concat!(
    "UPDATE idem_outbox SET sent_at = ",
    stmt_now!(),
    ", claim_token = NULL, claimed_until = NULL WHERE id = ANY($2) AND sent_at IS NULL AND claim_token = $1"
);
/// A failed attempt with attempts left. Params: error, delay (s), id, token.
pub(crate) const RETRY_LATER: &str = concat!(
    "UPDATE idem_outbox SET last_error = $1, next_attempt_at = ",
    from_now!(2),
    ", claim_token = NULL, claimed_until = NULL WHERE id = $3 AND sent_at IS NULL AND ",
    ours_or_unclaimed!(4)
);
/// A failed attempt with none left: dead. Params: error, id, token.
pub(crate) const BURY: &str = concat!(
    "UPDATE idem_outbox SET last_error = $1, dead_at = ",
    stmt_now!(),
    ", claim_token = NULL, claimed_until = NULL WHERE id = $2 AND sent_at IS NULL AND ",
    ours_or_unclaimed!(3)
);
/// The backlog: pending messages, dead ones, the oldest pending one's age (µs).
pub(crate) const OUTBOX_STATS: &str = concat!(
    "SELECT count(*) FILTER (WHERE dead_at IS NULL), count(dead_at), ",
    micros_between!(
        "min(created_at) FILTER (WHERE dead_at IS NULL)",
        stmt_now!()
    ),
    " FROM idem_outbox WHERE sent_at IS NULL"
);
/// Unsent messages for an operator. Params: state (0 unsent, 1 pending, 2 dead),
/// destination or NULL, after id, limit.
pub(crate) const LIST_OUTBOX: &str = concat!(
    "SELECT id, destination, message_id, attempts::bigint, dead_at IS NOT NULL, last_error, ",
    micros_between!("created_at", stmt_now!()),
    ", CASE WHEN next_attempt_at > ",
    stmt_now!(),
    " THEN ",
    micros_between!(stmt_now!(), "next_attempt_at"),
    " END, coalesce(claimed_until > ",
    stmt_now!(),
    ", false) FROM idem_outbox WHERE sent_at IS NULL ",
    "AND ($1 = 0 OR ($1 = 1 AND dead_at IS NULL) OR ($1 = 2 AND dead_at IS NOT NULL)) ",
    "AND ($2::text IS NULL OR destination = $2) AND id > $3 ORDER BY id LIMIT $4"
);
/// Back to pending, due now, attempts reset. Params: ids.
pub(crate) const RETRY_IDS: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE id = ANY($1) AND sent_at IS NULL";
/// Every dead message back to pending. Params: destination or NULL.
pub(crate) const RETRY_DEAD: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE sent_at IS NULL AND dead_at IS NOT NULL AND ($1::text IS NULL OR destination = $1)";
/// Deletes unsent messages. Params: ids.
pub(crate) const DROP_IDS: &str = "DELETE FROM idem_outbox WHERE id = ANY($1) AND sent_at IS NULL";
/// Deletes every dead message. Params: destination or NULL.
pub(crate) const DROP_DEAD: &str = "DELETE FROM idem_outbox \
     WHERE sent_at IS NULL AND dead_at IS NOT NULL AND ($1::text IS NULL OR destination = $1)";

/// `statement_timestamp()` minus `$n` seconds: the purges' age cutoff (STABLE, as the
/// run and outbox statements' clock).
macro_rules! stmt_cutoff {
    ($n:literal) => {
        concat!("statement_timestamp() - make_interval(secs => $", $n, ")")
    };
}

/// Runs that are expired **and** were started at least `$1` seconds ago, oldest expiry
/// first; rows locked by a live transaction are skipped. Params: older than (s), limit.
pub(crate) const PURGE_RUNS: &str = concat!(
    "DELETE FROM idem_run WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_run WHERE expires_at <= statement_timestamp() AND created_at <= ",
    stmt_cutoff!(1),
    " ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);
/// [`PURGE_RUNS`] without row locks, rechecking the expiry on the row it deletes (see
/// [`PURGE_REQUESTS_DISTRIBUTED`]).
pub(crate) const PURGE_RUNS_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_run WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_run WHERE ",
    purgeable!("created_at"),
    " ORDER BY expires_at LIMIT $2) AND ",
    purgeable!("created_at")
);
/// Outbox messages sent at least `$1` seconds ago, oldest first; unsent messages
/// (pending or dead) are never purged. Params: older than (s), limit.
pub(crate) const PURGE_OUTBOX: &str = concat!(
    "DELETE FROM idem_outbox WHERE id IN (",
    "SELECT id FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    stmt_cutoff!(1),
    " ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)"
);
/// [`PURGE_OUTBOX`] without row locks (see [`PURGE_REQUESTS_DISTRIBUTED`]).
pub(crate) const PURGE_OUTBOX_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_outbox WHERE id IN (",
    "SELECT id FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    stmt_cutoff!(1),
    " ORDER BY id LIMIT $2)"
);

/// Serializes concurrent migrators of one schema.
pub(crate) const MIGRATION_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.idem_schema_migrations'))";
pub(crate) const CREATE_MIGRATIONS: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())";
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
pub(crate) const INSERT_MIGRATION: &str =
    "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)";

#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("begin_claim", concat!(begin_claim!(), "250ms'")),
    ("bound_citus", concat!(bound_citus!(), "250ms'")),
    ("insert_request", INSERT_REQUEST),
    ("insert_request_restore", INSERT_REQUEST_RESTORE),
    ("select_request", SELECT_REQUEST),
    ("select_request_locked", SELECT_REQUEST_LOCKED),
    ("select_message_locked", SELECT_MESSAGE_LOCKED),
    ("replace_expired_request", REPLACE_EXPIRED_REQUEST),
    (
        "replace_expired_request_restore",
        REPLACE_EXPIRED_REQUEST_RESTORE,
    ),
    ("complete_request", COMPLETE_REQUEST),
    ("expired_request", EXPIRED_REQUEST),
    ("lookup_request", LOOKUP_REQUEST),
    ("insert_message", INSERT_MESSAGE),
    ("insert_message_restore", INSERT_MESSAGE_RESTORE),
    ("select_message", SELECT_MESSAGE),
    ("replace_expired_message", REPLACE_EXPIRED_MESSAGE),
    (
        "replace_expired_message_restore",
        REPLACE_EXPIRED_MESSAGE_RESTORE,
    ),
    ("expired_message", EXPIRED_MESSAGE),
    ("lookup_message", LOOKUP_MESSAGE),
    ("flavor", FLAVOR),
    ("table_oids", TABLE_OIDS),
    ("forget_prepared", FORGET_PREPARED),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
    ("purge_requests_distributed", PURGE_REQUESTS_DISTRIBUTED),
    ("purge_messages_distributed", PURGE_MESSAGES_DISTRIBUTED),
    ("insert_run", INSERT_RUN),
    ("select_run", SELECT_RUN),
    ("write_run", WRITE_RUN),
    ("renew_lease", RENEW_LEASE),
    ("delete_run", DELETE_RUN),
    ("probe_run_lock", PROBE_RUN_LOCK),
    ("probe_run_exists", PROBE_RUN_EXISTS),
    ("stalled_runs", STALLED_RUNS),
    ("enqueue", ENQUEUE),
    ("lock_due", LOCK_DUE),
    ("pending_ids", PENDING_IDS),
    ("claim_due", CLAIM_DUE),
    ("release", RELEASE),
    ("mark_sent", MARK_SENT),
    ("retry_later", RETRY_LATER),
    ("bury", BURY),
    ("outbox_stats", OUTBOX_STATS),
    ("list_outbox", LIST_OUTBOX),
    ("retry_ids", RETRY_IDS),
    ("retry_dead", RETRY_DEAD),
    ("drop_ids", DROP_IDS),
    ("drop_dead", DROP_DEAD),
    ("purge_runs", PURGE_RUNS),
    ("purge_runs_distributed", PURGE_RUNS_DISTRIBUTED),
    ("purge_outbox", PURGE_OUTBOX),
    ("purge_outbox_distributed", PURGE_OUTBOX_DISTRIBUTED),
    ("begin_bounded", concat!(begin_bounded!(), "250ms'")),
    ("restore_lock_timeout", RESTORE_LOCK_TIMEOUT),
    ("migration_lock", MIGRATION_LOCK),
    ("create_migrations", CREATE_MIGRATIONS),
    ("select_migrations", SELECT_MIGRATIONS),
    ("insert_migration", INSERT_MIGRATION),
];

#[cfg(test)]
mod tests {
    #[test]
    fn literals_escape_their_two_special_characters() {
        let text_literal = |v| super::Lit::Text(v).render();
        assert_eq!(text_literal(""), "E''");
        assert_eq!(
            text_literal(r"k'); DROP TABLE x; -- \ é"),
            r"E'k''); DROP TABLE x; -- \\ é'"
        );
        assert_eq!(text_literal(r"\'"), r"E'\\'''");
        assert_eq!(text_literal(r"'é\"), r"E'''é\\'");
        // The most a literal can take: every character doubled.
        let worst = r"\'\'";
        assert_eq!(text_literal(worst).len(), super::Lit::Text(worst).max_len());
    }

    #[test]
    fn prepared_names_are_only_ever_ours() {
        let (r, m) = (super::prepared_name(true), super::prepared_name(false));
        assert!(
            super::is_prepared_name(&r) && r.starts_with("idem_cr_"),
            "{r}"
        );
        assert!(
            super::is_prepared_name(&m) && m.starts_with("idem_cm_"),
            "{m}"
        );
        assert_ne!(super::prepared_name(true), super::prepared_name(true));
        for bad in [
            "",
            "idem_cr_",
            "idem_cx_1",
            "idem_cr_1; DROP TABLE x",
            "sqlx_s_1",
        ] {
            assert!(!super::is_prepared_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn distributed_purges_take_no_row_locks() {
        for sql in [
            super::PURGE_REQUESTS_DISTRIBUTED,
            super::PURGE_MESSAGES_DISTRIBUTED,
            super::PURGE_RUNS_DISTRIBUTED,
            super::PURGE_OUTBOX_DISTRIBUTED,
        ] {
            assert!(!sql.contains("FOR UPDATE"), "{sql}");
            assert!(sql.contains("LIMIT $2"), "still bounded: {sql}");
        }
    }

    /// Every statement of phased runs and the outbox stays valid on Citus with idem's
    /// tables distributed: no VOLATILE function anywhere in them (the database clock is
    /// the STABLE `statement_timestamp()`), and the run's row lock is keyed by the full
    /// primary key (one shard).
    #[test]
    fn run_and_outbox_statements_follow_the_citus_rules() {
        const VOLATILE: [&str; 5] = [
            "clock_timestamp(",
            "random(",
            "timeofday(",
            "gen_random_uuid(",
            "nextval(",
        ];
        let runs = [
            super::INSERT_RUN,
            super::SELECT_RUN,
            super::WRITE_RUN,
            super::RENEW_LEASE,
            super::DELETE_RUN,
            super::PROBE_RUN_LOCK,
            super::PROBE_RUN_EXISTS,
            super::STALLED_RUNS,
            super::PURGE_RUNS,
            super::PURGE_RUNS_DISTRIBUTED,
        ];
        let outbox = [
            super::ENQUEUE,
            super::LOCK_DUE,
            super::PENDING_IDS,
            super::CLAIM_DUE,
            super::RELEASE,
            super::MARK_SENT,
            super::RETRY_LATER,
            super::BURY,
            super::OUTBOX_STATS,
            super::LIST_OUTBOX,
            super::RETRY_IDS,
            super::RETRY_DEAD,
            super::DROP_IDS,
            super::DROP_DEAD,
            super::PURGE_OUTBOX,
            super::PURGE_OUTBOX_DISTRIBUTED,
        ];
        for sql in runs.iter().chain(outbox.iter()) {
            for f in VOLATILE {
                assert!(!sql.contains(f), "a VOLATILE function in {sql}");
            }
        }
        for sql in [super::SELECT_RUN, super::PROBE_RUN_LOCK] {
            assert!(
                sql.contains("principal = $1 AND operation = $2 AND request_key = $3"),
                "a run's row lock keyed by the full primary key: {sql}"
            );
        }
        for sql in [super::WRITE_RUN, super::RENEW_LEASE, super::DELETE_RUN] {
            assert!(
                sql.contains("WHERE principal = $1 AND operation = $2 AND request_key = $3"),
                "{sql}"
            );
        }
    }

    #[test]
    fn statements_snapshot() {
        let times = |prepared: Option<&str>| super::ClaimTimes {
            begun: 1_764_629_333_123_456,
            claimed: 1_764_629_333_234_567,
            expires: 1_764_715_733_234_567,
            prepared: prepared.map(str::to_owned),
        };
        let request = |prepared, replace| {
            super::complete_request_locked(
                ["account-1", "debit:v1", "k'); DROP TABLE x; --"],
                Some(r#"{"amount":100}"#),
                Some(r#"{"balance":900}"#),
                0,
                &times(prepared),
                replace,
            )
        };
        // A session's first completion prepares it under the process's next name.
        let first = request(None, false);
        assert!(
            first.starts_with("PREPARE idem_cr_")
                && first.contains("; SELECT set_config('idem.complete_request', 'idem_cr_")
                && first.contains("; EXECUTE idem_cr_")
                && first.ends_with("; COMMIT; BEGIN"),
            "{first}"
        );
        let message = |prepared, replace| {
            super::complete_message_locked(["projection", "m-1"], None, &times(prepared), replace)
        };
        let built = [
            ("begin_key_lock", super::begin_key_lock(-7)),
            ("wait_key_lock", super::wait_key_lock(250, -7)),
            ("complete_request_locked", request(Some("idem_cr_7"), false)),
            ("complete_request_locked_replacing", request(None, true)),
            ("complete_message_locked", message(Some("idem_cm_8"), false)),
            ("complete_message_locked_replacing", message(None, true)),
            ("prepared_request", super::PREPARED_REQUEST.to_owned()),
            ("prepared_message", super::PREPARED_MESSAGE.to_owned()),
        ];
        let text: String = super::ALL
            .iter()
            .map(|(name, sql)| (*name, (*sql).to_owned()))
            .chain(built.iter().map(|(name, sql)| (*name, sql.clone())))
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }
}
