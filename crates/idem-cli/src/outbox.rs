//! `idem outbox list|retry|drop`: the operator's view of the transactional outbox's
//! unsent messages (pending ones, and dead ones whose attempts ran out), and the two
//! things to do about a dead one: publish it again, or drop it.

use std::time::Duration;

use clap::{Args, Subcommand};
use idem::core::runs::{OutboxEntry, OutboxFilter, OutboxState, OutboxStats};
use idem::{Idem, OutboxStore};
use idem_conformance::Bank;
use serde_json::json;

use crate::fail::{Fail, connect_within};

/// What `idem outbox --help` shows after the commands.
pub(crate) const OUTBOX_HELP: &str = "\
MESSAGES:
  pending  not published yet: the relay tries it (again) once it is due, in order per
           destination; a failed attempt waits a growing pause before the next
  dead     no attempts left (idem relay --max-attempts): the relay skips it, and the rest
           of its destination goes on without it; retry or drop it
  Sent messages are not listed (`idem purge` deletes them after a while).
EXIT CODES: 0 done (also when nothing matched), 2 bad arguments, 7 cannot connect (all
codes: idem --help). `drop` needs the right to delete unsent messages (the purger role of
grants.sql).";

/// `idem outbox …`.
#[derive(Debug, Args)]
pub(crate) struct OutboxArgs {
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Debug, Subcommand)]
enum OutboxCommand {
    /// List unsent messages, the oldest first: id, destination, message ID, attempts,
    /// state, when it is tried next, age and the last attempt's error. The first line
    /// counts the backlog.
    List {
        /// Only dead messages.
        #[arg(long, conflicts_with = "pending")]
        dead: bool,
        /// Only pending messages.
        #[arg(long)]
        pending: bool,
        /// Only this destination.
        #[arg(long, value_name = "NAME")]
        destination: Option<String>,
        /// Only ids above this one (the last id of the previous page).
        #[arg(long, value_name = "ID", default_value_t = 0)]
        after: i64,
        /// At most this many messages (1 to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Print JSON (`{"backlog": …, "messages": […]}`) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Put messages back to pending, due now, with a fresh set of attempts: the given ids
    /// (pending or dead), or every dead message (of --destination). Prints `retried N`.
    Retry(Selection),
    /// Delete unsent messages so they are never published: the given ids (pending or
    /// dead), or every dead message (of --destination). Prints `dropped N`.
    Drop(Selection),
}

/// Which messages `retry` and `drop` act on.
#[derive(Debug, Args)]
#[group(skip)]
#[command(group(clap::ArgGroup::new("which").args(["ids", "dead"]).required(true)))]
struct Selection {
    /// A message's id (as `list` shows it); repeat for several.
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<i64>,
    /// Every dead message.
    #[arg(long)]
    dead: bool,
    /// With --dead: only this destination's.
    #[arg(long, value_name = "NAME", requires = "dead", conflicts_with = "ids")]
    destination: Option<String>,
}

pub(crate) async fn run<K: Bank>(url: &str, args: OutboxArgs) -> Result<(), Fail> {
    let bank = connect_within(url, K::connect(url, None)).await?;
    let idem = Idem::new(bank.backend().clone());
    let result = dispatch(&idem, args.command).await;
    let closed = bank.close().await;
    result?;
    closed.map_err(Fail::from)
}

async fn dispatch<B: OutboxStore>(idem: &Idem<B>, command: OutboxCommand) -> Result<(), Fail> {
    match command {
        OutboxCommand::List {
            dead,
            pending,
            destination,
            after,
            limit,
            json,
        } => {
            let state = match (dead, pending) {
                (true, _) => OutboxState::Dead,
                (_, true) => OutboxState::Pending,
                _ => OutboxState::Unsent,
            };
            let filter = OutboxFilter {
                state,
                destination,
                after_id: after,
                limit,
            };
            let stats = idem.outbox_stats().await?;
            let entries = idem.outbox_list(&filter).await?;
            if json {
                say!("{}", as_json(&stats, &entries));
            } else {
                say!("{}", backlog_line(&stats));
                for e in &entries {
                    say!("{}", entry_line(e));
                }
            }
            Ok(())
        }
        OutboxCommand::Retry(selection) => {
            let n = idem
                .outbox_retry(&selection.ids, selection.destination.as_deref())
                .await?;
            say!("retried {n}");
            Ok(())
        }
        OutboxCommand::Drop(selection) => {
            let n = idem
                .outbox_drop(&selection.ids, selection.destination.as_deref())
                .await?;
            say!("dropped {n}");
            Ok(())
        }
    }
}

/// `pending 3, dead 1, oldest pending 42 s`.
fn backlog_line(stats: &OutboxStats) -> String {
    let oldest = stats.oldest_pending_age.map_or(String::new(), |age| {
        format!(", oldest pending {}", human(age))
    });
    format!("pending {}, dead {}{oldest}", stats.pending, stats.dead)
}

/// One tab-separated line per message.
fn entry_line(e: &OutboxEntry) -> String {
    let state = if e.dead {
        "dead"
    } else if e.claimed {
        "publishing"
    } else {
        "pending"
    };
    let next = match (e.dead, e.next_attempt_in) {
        (true, _) => "-".to_owned(),
        (false, None) => "now".to_owned(),
        (false, Some(d)) => format!("in {}", human(d)),
    };
    format!(
        "{}\t{}\t{}\tattempts {}\t{state}\tnext {next}\tage {}\t{}",
        e.id,
        e.destination,
        e.message_id,
        e.attempts,
        human(e.age),
        e.last_error.as_deref().unwrap_or("-")
    )
}

fn as_json(stats: &OutboxStats, entries: &[OutboxEntry]) -> serde_json::Value {
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    json!({
        "backlog": {
            "pending": stats.pending,
            "dead": stats.dead,
            "oldest_pending_ms": stats.oldest_pending_age.map(millis),
        },
        "messages": entries.iter().map(|e| json!({
            "id": e.id,
            "destination": e.destination,
            "message_id": e.message_id,
            "attempts": e.attempts,
            "state": if e.dead { "dead" } else { "pending" },
            "publishing": e.claimed,
            "next_attempt_in_ms": e.next_attempt_in.map(millis),
            "age_ms": millis(e.age),
            "last_error": e.last_error,
        })).collect::<Vec<_>>(),
    })
}

/// `850 ms`, `42 s`, `12 min`, `3 h`, `2 d`.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{} ms", d.as_millis()),
        1..120 => format!("{secs} s"),
        120..7200 => format!("{} min", secs / 60),
        7200..172_800 => format!("{} h", secs / 3600),
        _ => format!("{} d", secs / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human(Duration::from_millis(850)), "850 ms");
        assert_eq!(human(Duration::from_secs(42)), "42 s");
        assert_eq!(human(Duration::from_secs(720)), "12 min");
        assert_eq!(human(Duration::from_secs(3 * 3600)), "3 h");
        assert_eq!(human(Duration::from_secs(3 * 86_400)), "3 d");
    }

    #[test]
    fn lines_say_the_state_and_the_next_attempt() {
        let mut e = OutboxEntry {
            id: 7,
            destination: "order.paid".into(),
            message_id: "msg-1".into(),
            attempts: 2,
            dead: false,
            last_error: Some("refused".into()),
            age: Duration::from_secs(90),
            next_attempt_in: Some(Duration::from_secs(4)),
            claimed: false,
        };
        assert_eq!(
            entry_line(&e),
            "7\torder.paid\tmsg-1\tattempts 2\tpending\tnext in 4 s\tage 90 s\trefused"
        );
        e.dead = true;
        assert!(entry_line(&e).contains("\tdead\tnext -\t"));
        let stats = OutboxStats {
            pending: 3,
            dead: 1,
            oldest_pending_age: Some(Duration::from_secs(42)),
        };
        assert_eq!(
            backlog_line(&stats),
            "pending 3, dead 1, oldest pending 42 s"
        );
        let v = as_json(&stats, &[e]);
        assert_eq!(v["messages"][0]["state"], "dead");
        assert_eq!(v["backlog"]["oldest_pending_ms"], 42_000);
    }
}
