//! Citus: placing idem's tables on a cluster ([`PgBackend::distribute`], behind
//! `idem migrate --distribute-citus`).
//!
//! Citus requires a distributed table's primary key to contain its distribution column,
//! and routes a statement keyed by it to one shard. So:
//!
//! - `idem_request_result` and `idem_run` are distributed by `principal`, and
//!   `idem_processed_message` by `subscriber`, all three in one co-location group of
//!   their own (`colocate_with => 'none'` for `idem_request_result`, the others with
//!   it). Not Citus's default group for `text`: idem's keys are `text COLLATE "C"`, and
//!   Citus refuses to mix collations in one group, so joining it failed when an ordinary
//!   `text`-keyed table of yours was there first. (Citus before 14.0 records every
//!   `text` group under the default collation, and `create_distributed_table`'s default
//!   co-location joins the oldest such group with the same shard count: when idem's
//!   group is the oldest, distribute your ordinary `text`-keyed tables with an explicit
//!   `colocate_with`.) Co-locate a table with idem's on purpose with `colocate_with =>
//!   'idem_request_result'` and a `COLLATE "C"` key. Every protocol statement on them
//!   is keyed by the full primary key.
//! - `idem_outbox` stays on the coordinator as a **Citus local table**
//!   (`citus_add_local_table_to_metadata`). The relay reads the oldest unsent messages
//!   with `FOR UPDATE SKIP LOCKED` and publishes them in order of one `id` sequence per
//!   destination: a distributed outbox would spread that read over shards, which Citus
//!   refuses, and a reference table would write every message on every node. Writes to
//!   a Citus local table run through Citus's local execution, which commits with
//!   two-phase commit together with the shards the effect wrote, so a message commits
//!   exactly when its effect does. (A plain table on the coordinator would not: Citus
//!   commits the workers first, then the coordinator.)
//!   Citus 13.2 restarts an identity column's sequence when it adds a table to its
//!   metadata; idem sets it back past every `id` already used, so new messages still
//!   sort after the old ones.
//! - `idem_schema_migrations` stays a plain table on the coordinator: run `idem migrate`
//!   there.
//!
//! Every table is checked before any changes, so a table placed otherwise stops it with
//! nothing changed, and running it again reports what is already in place.

use std::fmt;

use idem_core::{DbError, ErrorKind};
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Row};

use crate::{PgBackend, db_error};

/// The installed Citus version, if any.
pub(crate) const CITUS_VERSION: &str =
    "SELECT extversion FROM pg_extension WHERE extname = 'citus'";
/// Whether this node is the coordinator (Citus 11 and later).
pub(crate) const IS_COORDINATOR: &str = "SELECT citus_is_coordinator()";
/// Serializes concurrent distributors of one schema (a session lock on the dedicated
/// connection, released at the end or when the connection closes).
pub(crate) const DISTRIBUTE_LOCK: &str =
    "SELECT pg_advisory_lock(hashtext(current_schema() || '.idem_distribute'))";
/// Releases [`DISTRIBUTE_LOCK`].
pub(crate) const DISTRIBUTE_UNLOCK: &str =
    "SELECT pg_advisory_unlock(hashtext(current_schema() || '.idem_distribute'))";
/// The table's name as `regclass` text (schema-qualified when the search path needs
/// it), or NULL when it does not exist. Params: table.
pub(crate) const TABLE_NAME: &str = "SELECT to_regclass($1)::text";
/// How Citus places a table: its method (`h` hash, `n` none), replication model (`t`
/// for a reference table, `s` otherwise), distribution column and co-location group;
/// no row for a table Citus does not know. Params: the table's `regclass` text.
pub(crate) const PLACEMENT: &str = "SELECT partmethod::text, repmodel::text, \
     CASE WHEN partmethod = 'h' THEN column_to_column_name(logicalrelid, partkey) END, \
     colocationid FROM pg_dist_partition WHERE logicalrelid = $1::regclass";
/// Params: table, distribution column, table to co-locate with (or `none`: a group of
/// its own).
pub(crate) const DISTRIBUTE: &str =
    "SELECT create_distributed_table($1::regclass, $2, colocate_with => $3)";
/// Params: table.
pub(crate) const ADD_LOCAL: &str = "SELECT citus_add_local_table_to_metadata($1::regclass)";
/// The last value of the outbox's `id` sequence (NULL before its first use). Params: the
/// outbox's `regclass` text.
pub(crate) const OUTBOX_SEQUENCE_LAST: &str =
    "SELECT pg_sequence_last_value(pg_get_serial_sequence($1, 'id')::regclass)";
/// The highest `id` in the outbox.
pub(crate) const OUTBOX_MAX_ID: &str = "SELECT max(id) FROM idem_outbox";
/// Puts the outbox's `id` sequence at a value (the next `id` is one more). Params: the
/// outbox's `regclass` text, the value.
pub(crate) const OUTBOX_SEQUENCE_SET: &str =
    "SELECT setval(pg_get_serial_sequence($1, 'id')::regclass, $2)";

/// Every statement of this module, for the snapshot test and the Citus rules.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("citus_version", CITUS_VERSION),
    ("citus_is_coordinator", IS_COORDINATOR),
    ("citus_distribute_lock", DISTRIBUTE_LOCK),
    ("citus_distribute_unlock", DISTRIBUTE_UNLOCK),
    ("citus_table_name", TABLE_NAME),
    ("citus_placement", PLACEMENT),
    ("citus_distribute", DISTRIBUTE),
    ("citus_add_local", ADD_LOCAL),
    ("citus_outbox_sequence_last", OUTBOX_SEQUENCE_LAST),
    ("citus_outbox_max_id", OUTBOX_MAX_ID),
    ("citus_outbox_sequence_set", OUTBOX_SEQUENCE_SET),
];

/// The table every other idem table is co-located with.
const ANCHOR: &str = "idem_request_result";

/// The hash-distributed tables, their distribution columns, and their primary keys
/// (the distribution column first). The checks of the statements' Citus rules read
/// this list too.
pub(crate) const DISTRIBUTED: &[(&str, &str, &[&str])] = &[
    (
        "idem_request_result",
        "principal",
        &["principal", "operation", "request_key"],
    ),
    (
        "idem_run",
        "principal",
        &["principal", "operation", "request_key"],
    ),
    (
        "idem_processed_message",
        "subscriber",
        &["subscriber", "message_id"],
    ),
];

/// The table kept on the coordinator as a Citus local table.
pub(crate) const COORDINATOR_LOCAL: &str = "idem_outbox";

/// How one of idem's tables is placed on a Citus cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placed {
    /// Hash-distributed by `column`, in the co-location group of `idem_request_result`.
    Distributed {
        /// The distribution column.
        column: &'static str,
    },
    /// A Citus local table on the coordinator.
    CoordinatorLocal,
    /// A reference table (a copy on every node), placed so before idem looked; kept.
    Reference,
    /// A plain table on the coordinator that Citus does not manage (the migrations).
    PlainLocal,
}

/// One table's placement after [`PgBackend::distribute`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Placement {
    /// The table.
    pub table: &'static str,
    /// Where it is.
    pub placed: Placed,
    /// Whether it was placed so before this call.
    pub already: bool,
}

impl fmt::Display for Placement {
    /// One line for the operator, such as `idem_run: distributed by principal,
    /// co-located with idem_request_result`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let already = if self.already { "already " } else { "" };
        match &self.placed {
            Placed::Distributed { column } if self.table == ANCHOR => {
                write!(f, "{}: {already}distributed by {column}", self.table)
            }
            Placed::Distributed { column } => write!(
                f,
                "{}: {already}distributed by {column}, co-located with {ANCHOR}",
                self.table
            ),
            Placed::CoordinatorLocal => write!(
                f,
                "{}: {already}kept on the coordinator as a Citus local table (it commits \
                 with the distributed tables in one two-phase commit; the relay reads it \
                 on one node)",
                self.table
            ),
            Placed::Reference => write!(
                f,
                "{}: already a reference table (a copy on every node); kept",
                self.table
            ),
            Placed::PlainLocal => write!(
                f,
                "{}: kept as a plain table on the coordinator (run idem migrate there)",
                self.table
            ),
        }
    }
}

fn configuration(message: String) -> DbError {
    DbError::new("postgres", ErrorKind::Configuration, message)
}

/// How Citus places a table now: `(method, replication model, column, co-location
/// group)`, or `None` for a table Citus does not manage.
type Current = Option<(String, String, Option<String>, i32)>;

async fn current(conn: &mut PgConnection, table: &str) -> Result<Current, DbError> {
    let row = sqlx::query(PLACEMENT)
        .bind(table)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_error)?;
    row.map(|r| {
        Ok((
            r.try_get(0).map_err(db_error)?,
            r.try_get(1).map_err(db_error)?,
            r.try_get(2).map_err(db_error)?,
            r.try_get(3).map_err(db_error)?,
        ))
    })
    .transpose()
}

async fn regclass(conn: &mut PgConnection, table: &str) -> Result<String, DbError> {
    let name: Option<String> = sqlx::query_scalar(TABLE_NAME)
        .bind(table)
        .fetch_one(&mut *conn)
        .await
        .map_err(db_error)?;
    name.ok_or_else(|| {
        configuration(format!(
            "{table} does not exist in this schema: run idem migrate first"
        ))
    })
}

/// Describes an unexpected placement for an error.
fn described(current: &Current) -> String {
    match current {
        None => "a table Citus does not manage".into(),
        Some((method, model, column, _)) => match (method.as_str(), model.as_str(), column) {
            ("h", _, Some(column)) => format!("distributed by {column}"),
            ("n", "t", _) => "a reference table".into(),
            ("n", _, _) => "a Citus local table".into(),
            (method, _, _) => format!("a Citus table of method {method:?}"),
        },
    }
}

impl PgBackend {
    /// Places idem's tables on the Citus cluster this backend is connected to (its
    /// coordinator, in the schema the connection's `search_path` names): see the
    /// [module documentation](crate::citus) for where each table goes and why. Run it
    /// after [`idem_core::Maintenance::migrate`]; a second run changes nothing and
    /// reports every table as already placed.
    ///
    /// Fails with [`ErrorKind::Configuration`] when the server is not Citus (no `citus`
    /// extension in this database), when it is a Citus worker rather than the
    /// coordinator, when idem's tables are missing, or when a table is already placed
    /// otherwise than idem needs (Citus's `undistribute_table` turns it back).
    pub async fn distribute(&self) -> Result<Vec<Placement>, DbError> {
        let mut conn = PgConnection::connect_with(self.pool().connect_options().as_ref())
            .await
            .map_err(db_error)?;
        let placed = distribute_on(&mut conn).await;
        // Closing the session releases the lock too, should the unlock fail.
        let unlocked = match placed {
            Ok(_) => sqlx::query(DISTRIBUTE_UNLOCK)
                .execute(&mut conn)
                .await
                .map(drop)
                .map_err(db_error),
            Err(_) => Ok(()),
        };
        let _ = conn.close().await;
        let placed = placed?;
        unlocked?;
        Ok(placed)
    }
}

async fn distribute_on(conn: &mut PgConnection) -> Result<Vec<Placement>, DbError> {
    let version: Option<String> = sqlx::query_scalar(CITUS_VERSION)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_error)?;
    if version.is_none() {
        return Err(configuration(
            "this server is not Citus: the citus extension is not installed in this database \
             (CREATE EXTENSION citus, on the coordinator and every worker); idem's tables \
             were left as they are"
                .into(),
        ));
    }
    let coordinator: bool = sqlx::query_scalar(IS_COORDINATOR)
        .fetch_one(&mut *conn)
        .await
        .map_err(db_error)?;
    if !coordinator {
        return Err(configuration(
            "this server is a Citus worker: distribute idem's tables through the coordinator"
                .into(),
        ));
    }
    sqlx::query(DISTRIBUTE_LOCK)
        .execute(&mut *conn)
        .await
        .map_err(db_error)?;
    // Everything is checked before anything changes.
    let mut plan = Vec::new();
    let mut anchor_group = None;
    for &(table, column, _) in DISTRIBUTED {
        let name = regclass(conn, table).await?;
        let already = match current(conn, &name).await? {
            None => false,
            Some((method, _, Some(col), group)) if method == "h" && col == column => {
                if table == ANCHOR {
                    anchor_group = Some(group);
                } else if anchor_group != Some(group) {
                    return Err(configuration(format!(
                        "{table} is distributed by {column} but not co-located with \
                         {ANCHOR}: undistribute it (undistribute_table) and run this again"
                    )));
                }
                true
            }
            other => {
                return Err(configuration(format!(
                    "{table} is already {}, but idem needs it distributed by {column}: \
                     undistribute it (undistribute_table) and run this again",
                    described(&other)
                )));
            }
        };
        plan.push((table, column, name, already));
    }
    let outbox = regclass(conn, COORDINATOR_LOCAL).await?;
    let outbox_now = match current(conn, &outbox).await? {
        None => None,
        Some((method, model, _, _)) if method == "n" && model == "t" => Some(Placed::Reference),
        Some((method, _, _, _)) if method == "n" => Some(Placed::CoordinatorLocal),
        other => {
            return Err(configuration(format!(
                "{COORDINATOR_LOCAL} is already {}: the relay's FOR UPDATE SKIP LOCKED \
                 cannot run over shards; undistribute it (undistribute_table) and run this \
                 again",
                described(&other)
            )));
        }
    };
    let mut placed = Vec::new();
    for (table, column, name, already) in plan {
        if !already {
            let colocate_with = if table == ANCHOR {
                "none".to_owned()
            } else {
                regclass(conn, ANCHOR).await?
            };
            sqlx::query(DISTRIBUTE)
                .bind(&name)
                .bind(column)
                .bind(colocate_with)
                .execute(&mut *conn)
                .await
                .map_err(db_error)?;
        }
        placed.push(Placement {
            table,
            placed: Placed::Distributed { column },
            already,
        });
    }
    let (kind, already) = match outbox_now {
        None => {
            add_local_keeping_ids(conn, &outbox).await?;
            (Placed::CoordinatorLocal, false)
        }
        Some(kind) => (kind, true),
    };
    placed.push(Placement {
        table: COORDINATOR_LOCAL,
        placed: kind,
        already,
    });
    placed.push(Placement {
        table: "idem_schema_migrations",
        placed: Placed::PlainLocal,
        already: true,
    });
    Ok(placed)
}

/// Adds the outbox to Citus's metadata, then puts its `id` sequence back past every
/// `id` used before (Citus 13.2 restarts it at 1, which would give new messages ids
/// below the unsent ones, or ids already taken).
async fn add_local_keeping_ids(conn: &mut PgConnection, outbox: &str) -> Result<(), DbError> {
    let last: Option<i64> = sqlx::query_scalar(OUTBOX_SEQUENCE_LAST)
        .bind(outbox)
        .fetch_one(&mut *conn)
        .await
        .map_err(db_error)?;
    sqlx::query(ADD_LOCAL)
        .bind(outbox)
        .execute(&mut *conn)
        .await
        .map_err(db_error)?;
    let max_id: Option<i64> = sqlx::query_scalar(OUTBOX_MAX_ID)
        .fetch_one(&mut *conn)
        .await
        .map_err(db_error)?;
    if let Some(used) = last.max(max_id).filter(|v| *v > 0) {
        sqlx::query(OUTBOX_SEQUENCE_SET)
            .bind(outbox)
            .bind(used)
            .execute(&mut *conn)
            .await
            .map_err(db_error)?;
    }
    Ok(())
}

/// The statements of a migration file, each without its `;`: split at semicolons outside
/// string literals (`'…'`, `E'…'`), quoted identifiers, dollar-quoted bodies and
/// comments. Pieces holding nothing but whitespace and comments are left out.
pub(crate) fn statements(sql: &'static str) -> Vec<&'static str> {
    let bytes = sql.as_bytes();
    let at = |i: usize| bytes.get(i).copied().unwrap_or(0);
    let mut out = Vec::new();
    let (mut start, mut i, mut code) = (0, 0, false);
    while i < bytes.len() {
        match bytes[i] {
            b'-' if at(i + 1) == b'-' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'/' if at(i + 1) == b'*' => {
                let mut depth = 0;
                while i < bytes.len() {
                    if bytes[i] == b'/' && at(i + 1) == b'*' {
                        depth += 1;
                        i += 2;
                    } else if bytes[i] == b'*' && at(i + 1) == b'/' {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                continue;
            }
            quote @ (b'\'' | b'"') => {
                let escapes = quote == b'\'' && i > 0 && matches!(bytes[i - 1], b'e' | b'E');
                i += 1;
                while i < bytes.len() {
                    let doubled = bytes[i] == quote && at(i + 1) == quote;
                    if (escapes && bytes[i] == b'\\') || doubled {
                        i += 2;
                    } else if bytes[i] == quote {
                        break;
                    } else {
                        i += 1;
                    }
                }
            }
            b'$' => {
                let mut j = i + 1;
                while at(j).is_ascii_alphanumeric() || at(j) == b'_' {
                    j += 1;
                }
                if at(j) == b'$' && !at(i + 1).is_ascii_digit() {
                    let tag = &sql[i..=j];
                    i = sql[j + 1..]
                        .find(tag)
                        .map_or(bytes.len(), |k| j + 1 + k + tag.len() - 1);
                }
            }
            b';' => {
                if code {
                    out.push(sql[start..i].trim());
                }
                (start, code) = (i + 1, false);
                i += 1;
                continue;
            }
            _ => {}
        }
        code |= !bytes.get(i).is_some_and(u8::is_ascii_whitespace);
        i += 1;
    }
    if code {
        out.push(sql[start..].trim());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{Placed, Placement};

    #[test]
    fn migrations_split_into_statements() {
        let sql = "-- a comment; still a comment\nCREATE TABLE t (a text DEFAULT 'x;y'); \
                   /* a ; comment */ ALTER TABLE t ADD COLUMN \"b;c\" int;\n\
                   DO $body$ BEGIN PERFORM 1; END $body$;\n\
                   SELECT E'it\\'s;', $$;$$ -- trailing ; comment\n";
        assert_eq!(
            super::statements(sql),
            [
                "-- a comment; still a comment\nCREATE TABLE t (a text DEFAULT 'x;y')",
                "/* a ; comment */ ALTER TABLE t ADD COLUMN \"b;c\" int",
                "DO $body$ BEGIN PERFORM 1; END $body$",
                "SELECT E'it\\'s;', $$;$$ -- trailing ; comment",
            ]
        );
        for m in crate::MIGRATIONS {
            let parts = super::statements(m.sql);
            assert!(parts.len() > 1, "{}", m.name);
            assert!(
                parts.iter().all(|p| !p.is_empty() && !p.ends_with(';')),
                "{}",
                m.name
            );
        }
        assert_eq!(
            super::statements("  -- nothing\n/* here */ ;\n"),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn statements_snapshot() {
        let text: String = super::ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn one_line_per_table() {
        let line = |table, placed, already| {
            Placement {
                table,
                placed,
                already,
            }
            .to_string()
        };
        assert_eq!(
            line(
                "idem_request_result",
                Placed::Distributed {
                    column: "principal"
                },
                false
            ),
            "idem_request_result: distributed by principal"
        );
        assert_eq!(
            line(
                "idem_run",
                Placed::Distributed {
                    column: "principal"
                },
                true
            ),
            "idem_run: already distributed by principal, co-located with idem_request_result"
        );
        assert!(
            line("idem_outbox", Placed::CoordinatorLocal, false)
                .starts_with("idem_outbox: kept on the coordinator as a Citus local table")
        );
    }
}
