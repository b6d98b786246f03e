//! `idem demo …`: a demo bank that shows the pattern, kept apart from the operator's
//! commands. `idem demo` alone runs the walkthrough; the subcommands debit and credit
//! the demo's accounts one call at a time, consume and publish broker messages, serve the
//! bank over HTTP, and stand in for a payment provider.
//!
//! Their tables (`idem_demo_account`, `idem_demo_order`) belong to the demo, not to idem.
//! They default to a SQLite file in the current directory (`sqlite://idem.db`).

mod bank;
#[cfg(feature = "http")]
pub(crate) mod orders;
#[cfg(feature = "http")]
pub(crate) mod provider;
#[cfg(feature = "http")]
pub(crate) mod serve;
mod walkthrough;

use clap::{Args, Subcommand};

use crate::Fail;

/// The demo's database when no URL is given: a SQLite file in the current directory.
const DEFAULT_URL: &str = "sqlite://idem.db";

/// What `idem demo --help` shows before the commands.
pub(crate) const DEMO_HELP: &str = "\
The demo bank, not for production.

Without a command: the walkthrough of the pattern (debit twice with the same key, the same
key with another amount, a duplicate insert, a failed debit, a message consumed twice),
checked against its expected figures, in a private schema, database or file that is
removed afterwards.

The commands below work on the demo's own tables. Without --url or IDEM_URL they use
sqlite://idem.db in the current directory.";

/// `idem demo [COMMAND]`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(subcommand)]
    command: Option<DemoCommand>,
}

/// The demo's commands.
#[derive(Debug, Subcommand)]
enum DemoCommand {
    /// Create an account or set its balance (the demo's `idem_demo_account` table), or show it.
    Account {
        /// The account's ID.
        #[arg(long)]
        id: i64,
        /// The balance to set; without it, the balance is shown.
        #[arg(long)]
        balance: Option<i64>,
    },
    /// One idempotent debit: prints the JSON response; says on stderr whether it executed or
    /// replayed. Exit codes: 3 key reused with a different request, 4 insufficient balance,
    /// 5 no such account, 2 invalid input (all codes: `idem --help`).
    Debit {
        /// The account to debit.
        #[arg(long)]
        account: i64,
        /// The client's idempotency key.
        #[arg(long)]
        key: String,
        /// A positive whole amount.
        #[arg(long, allow_negative_numbers = true)]
        amount: i64,
        /// The authenticated principal (default: `account-` followed by the account ID).
        #[arg(long)]
        principal: Option<String>,
    },
    /// The consumer variant: credit an account once per (subscriber, message ID).
    CreditMessage {
        /// The consumer's name.
        #[arg(long)]
        subscriber: String,
        /// The message's ID.
        #[arg(long)]
        message_id: String,
        /// The account to credit.
        #[arg(long)]
        account: i64,
        /// A positive whole amount.
        #[arg(long, allow_negative_numbers = true)]
        amount: i64,
    },
    /// Credit the demo account once per message from RabbitMQ (--amqp, --queue) or NATS
    /// JetStream (--nats, --stream, --consumer), acknowledging only after the commit.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = crate::consume::MESSAGE_FORMAT)]
    Consume(crate::consume::ConsumeArgs),
    /// Publish demo messages (chosen IDs, duplicates on purpose) to RabbitMQ or JetStream.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = crate::consume::MESSAGE_FORMAT)]
    Publish(crate::consume::PublishArgs),
    #[cfg(feature = "http")]
    /// Serve the demo bank over HTTP with Idempotency-Key (see docs/http.md): PUT/GET
    /// /accounts/{id}, POST /accounts/{id}/debits (bearer principal), POST
    /// /subscribers/{name}/messages/{message_id}, GET /openapi.json, and with --provider
    /// POST /orders (bearer principal; see docs/external-effects.md). Stops on SIGINT or
    /// SIGTERM after in-flight requests finish.
    Serve {
        /// The address to listen on (port 0 picks a free one; the address is printed).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Work in a private schema, database or file of this name, created now and removed
        /// at shutdown: for tests and throwaway demos. A lowercase letter, then lowercase
        /// letters, digits or `_`.
        #[arg(long, value_name = "NAME")]
        namespace: Option<String>,
        /// How long a request waits for a concurrent request with the same key before
        /// answering 409 with Retry-After.
        #[arg(long, default_value = "5s", value_parser = crate::commands::parse_duration)]
        wait_timeout: std::time::Duration,
        /// Test aid: hold each debit's transaction open this long after its SQL ran
        /// (to show 409 for a concurrent retry, or a client disconnecting mid-request).
        #[arg(long, value_parser = crate::commands::parse_duration)]
        debit_delay: Option<std::time::Duration>,
        /// The payment provider POST /orders charges (an http:// URL, such as the address
        /// `idem demo fake-provider` prints). Without it, POST /orders answers 404.
        #[arg(long, value_name = "URL")]
        provider: Option<String>,
        /// How long a charge request to the provider may take before POST /orders
        /// answers 502 (the retry with the same key resumes the order at once).
        #[arg(long, value_name = "MS", default_value_t = 2000,
            value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        provider_timeout_ms: u64,
        /// The lease of an order's run: while it lasts, a retry with the same key waits
        /// (then 409); once it has ended (the server died mid-order), the retry or
        /// `idem demo complete` takes the order over at its last recovery point.
        #[arg(long, value_name = "MS", default_value_t = 30_000,
            value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
        lease_ms: u64,
    },
    #[cfg(feature = "http")]
    /// A stand-in card provider for `idem demo serve --provider`, with its own Idempotency-Key
    /// and faults on demand.
    ///
    /// POST /charges with `Idempotency-Key` and {"amount": N}: a new key is charged (201);
    /// the same key and amount return the first charge (200, nothing charged); another
    /// amount 422; no key or a bad body 400. GET /charges lists every charge, GET /stats
    /// counts them. State in memory; stops on SIGINT or SIGTERM.
    FakeProvider {
        /// The address to listen on (port 0 picks a free one; the address is printed).
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: std::net::SocketAddr,
        /// Probability (0 to 1) that a new charge answers 500 before anything is charged.
        #[arg(long, value_name = "P", default_value_t = 0.0, allow_negative_numbers = true,
            value_parser = provider::parse_probability)]
        fail_before_charge: f64,
        /// Probability (0 to 1) that a new charge is made, then answered with 500 or not at
        /// all (the connection held about 30 s), half each.
        #[arg(long, value_name = "P", default_value_t = 0.0, allow_negative_numbers = true,
            value_parser = provider::parse_probability)]
        fail_after_charge: f64,
        /// Milliseconds to wait after recording a new charge before answering it.
        #[arg(long, value_name = "MS", default_value_t = 0)]
        delay: u64,
        /// Start the random fault draws from this number: the same number, the same faults.
        #[arg(long)]
        seed: Option<u64>,
    },
    #[cfg(feature = "http")]
    /// Finish orders an `idem demo serve` left halfway (it died mid-order), once their lease
    /// has ended.
    ///
    /// One pass over the phased runs whose owner stopped before their final answer: each
    /// is taken over and driven with its operation's step. order:v1 with --provider: driven
    /// to the end (the charge is repeated with its stable provider key, so never made
    /// twice); without --provider: runs that never reached the provider end failed, the
    /// others are left. Other operations are left. Prints one line per operation
    /// ("order:v1: succeeded 1, failed 0, busy 0, left 0", then the errors) or --json;
    /// exits 0 when the pass ran, even if some runs were left.
    Complete {
        /// The payment provider of order:v1 (an http:// URL).
        #[arg(long, value_name = "URL")]
        provider: Option<String>,
        /// How long a charge request to the provider may take.
        #[arg(long, value_name = "MS", default_value_t = 2000,
            value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        provider_timeout_ms: u64,
        /// The lease this completer holds on each run it takes over (as `serve
        /// --lease-ms`): longer than the provider timeout plus a phase.
        #[arg(long, value_name = "MS", default_value_t = 30_000,
            value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
        lease_ms: u64,
        /// At most this many stalled runs, the longest-stalled first.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `idem demo [COMMAND]` on `url`, the demo's default file without it.
pub(crate) async fn run(explicit: Option<&str>, args: DemoArgs) -> Result<(), Fail> {
    let url = explicit.unwrap_or(DEFAULT_URL);
    let Some(command) = args.command else {
        return with_bank!(url, K => walkthrough::run::<K>(url).await);
    };
    match command {
        DemoCommand::Account { id, balance } => {
            with_bank!(url, K => bank::account::<K>(url, id, balance).await)
        }
        DemoCommand::Debit {
            account,
            key,
            amount,
            principal,
        } => {
            with_bank!(url, K => bank::debit::<K>(url, account, &key, amount, principal).await)
        }
        DemoCommand::CreditMessage {
            subscriber,
            message_id,
            account,
            amount,
        } => {
            with_bank!(url, K => bank::credit_message::<K>(url, &subscriber, &message_id, account, amount).await)
        }
        #[cfg(any(feature = "amqp", feature = "nats"))]
        DemoCommand::Consume(args) => {
            with_bank!(url, K => crate::consume::consume::<K>(url, args).await)
        }
        #[cfg(any(feature = "amqp", feature = "nats"))]
        DemoCommand::Publish(args) => crate::consume::publish(args).await,
        #[cfg(feature = "http")]
        DemoCommand::Serve {
            listen,
            namespace,
            wait_timeout,
            debit_delay,
            provider,
            provider_timeout_ms,
            lease_ms,
        } => {
            let options = serve::Options {
                listen,
                namespace,
                wait: wait_timeout,
                debit_delay,
                provider,
                provider_timeout: std::time::Duration::from_millis(provider_timeout_ms),
                lease: std::time::Duration::from_millis(lease_ms),
            };
            with_bank!(url, K => serve::run::<K>(url, options).await)
        }
        #[cfg(feature = "http")]
        DemoCommand::FakeProvider {
            listen,
            fail_before_charge,
            fail_after_charge,
            delay,
            seed,
        } => {
            provider::run(provider::Options {
                listen,
                fail_before: fail_before_charge,
                fail_after: fail_after_charge,
                delay: std::time::Duration::from_millis(delay),
                seed,
            })
            .await
        }
        #[cfg(feature = "http")]
        DemoCommand::Complete {
            provider,
            provider_timeout_ms,
            lease_ms,
            limit,
            json,
        } => {
            // It works on runs an earlier `idem demo serve` left: never on a new file.
            let url = crate::explicit_url(explicit, "demo complete")?;
            let timeout = std::time::Duration::from_millis(provider_timeout_ms);
            let lease = std::time::Duration::from_millis(lease_ms);
            with_bank!(url, K => orders::complete::<K>(url, provider.as_deref(), timeout, lease, limit, json).await)
        }
    }
}
