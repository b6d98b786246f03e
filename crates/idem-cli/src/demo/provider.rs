//! `idem demo fake-provider`: a stand-in card provider for the card-charge walkthrough. Like a
//! real one it honours its own `Idempotency-Key` (a repeated key returns the first
//! charge instead of charging again), and it fails on demand: before the charge, or
//! after it (the charge is made but the answer is a 500 or never comes).
//!
//! State lives in memory and is gone when the process stops.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::fail::Fail;

/// How long a charge answered "never" holds its connection before giving up.
const HOLD: Duration = Duration::from_secs(30);

/// What `idem demo fake-provider` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Where to listen (port 0 picks a free port; the address is printed).
    pub(crate) listen: SocketAddr,
    /// Probability that a new charge fails with 500 before anything is charged.
    pub(crate) fail_before: f64,
    /// Probability that a new charge is made and then answered with 500 or not at all.
    pub(crate) fail_after: f64,
    /// Wait after recording a new charge, before answering it.
    pub(crate) delay: Duration,
    /// Where the random fault draws start (`--seed`), for a repeatable run.
    pub(crate) seed: Option<u64>,
}

/// A probability for clap: a number from 0 to 1.
pub(crate) fn parse_probability(s: &str) -> Result<f64, String> {
    let refused = || format!("{s:?} is not a probability: use a number from 0 to 1");
    let p: f64 = s.trim().parse().map_err(|_| refused())?;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(refused())
    }
}

/// One charge, as `POST /charges` answers it and `GET /charges` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct Charge {
    id: String,
    idempotency_key: String,
    amount: u64,
}

/// The counters of `GET /stats`.
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct Stats {
    charges: u64,
    failed_before: u64,
    failed_after: u64,
    replays: u64,
}

/// Everything the provider remembers, behind one lock: a key is looked up, drawn for
/// and charged in one critical section, so concurrent requests with one key charge once.
#[derive(Debug)]
struct Ledger {
    charges: Vec<Charge>,
    by_key: HashMap<String, usize>,
    stats: Stats,
    rng: fastrand::Rng,
}

#[derive(Debug)]
struct Provider {
    ledger: Mutex<Ledger>,
    fail_before: f64,
    fail_after: f64,
    delay: Duration,
    /// Cancelled at shutdown: held connections end at once.
    shutdown: CancellationToken,
}

impl Provider {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What happens after a new charge was recorded.
enum After {
    Answer,
    Fail500,
    Hold,
}

enum Decision {
    Replay(Charge),
    Mismatch(u64),
    FailBefore,
    Charged(Charge, After),
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// The one `Idempotency-Key` header: 1 to 255 visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<String, String> {
    let mut values = headers.get_all("idempotency-key").iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err("send exactly one Idempotency-Key header".into());
    };
    let key = value
        .to_str()
        .map_err(|_| "the Idempotency-Key must be visible ASCII".to_owned())?
        .trim();
    if key.is_empty() || key.len() > 255 || !key.chars().all(|c| c.is_ascii_graphic()) {
        return Err("the Idempotency-Key must be 1 to 255 visible ASCII characters".into());
    }
    Ok(key.to_owned())
}

/// The body `{"amount": N}` with N a positive whole number.
fn amount(body: &[u8]) -> Result<u64, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    value
        .get("amount")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .ok_or_else(|| "send {\"amount\": N} with N a positive whole number".to_owned())
}

/// `POST /charges`.
async fn post_charge(
    State(provider): State<Arc<Provider>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = match idempotency_key(&headers) {
        Ok(k) => k,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
    };
    let amount = match amount(&body) {
        Ok(a) => a,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
    };
    let decision = {
        let mut ledger = provider.ledger();
        let ledger = &mut *ledger;
        if let Some(&i) = ledger.by_key.get(&key) {
            let charge = &ledger.charges[i];
            if charge.amount == amount {
                ledger.stats.replays += 1;
                Decision::Replay(charge.clone())
            } else {
                Decision::Mismatch(charge.amount)
            }
        } else if ledger.rng.f64() < provider.fail_before {
            ledger.stats.failed_before += 1;
            Decision::FailBefore
        } else {
            let charge = Charge {
                id: format!("ch_{}", ledger.charges.len() + 1),
                idempotency_key: key.clone(),
                amount,
            };
            ledger.by_key.insert(key, ledger.charges.len());
            ledger.charges.push(charge.clone());
            ledger.stats.charges += 1;
            let after = if ledger.rng.f64() < provider.fail_after {
                ledger.stats.failed_after += 1;
                if ledger.rng.bool() {
                    After::Fail500
                } else {
                    After::Hold
                }
            } else {
                After::Answer
            };
            Decision::Charged(charge, after)
        }
    };
    match decision {
        Decision::Replay(charge) => (StatusCode::OK, Json(charge)).into_response(),
        Decision::Mismatch(first) => refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("this Idempotency-Key was used with amount {first}, not {amount}"),
        ),
        Decision::FailBefore => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure before the charge: nothing was charged",
        ),
        Decision::Charged(_, After::Fail500) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated failure after the charge",
        ),
        Decision::Charged(_, After::Hold) => {
            tokio::select! {
                () = tokio::time::sleep(HOLD) => {}
                () = provider.shutdown.cancelled() => {}
            }
            refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "simulated failure after the charge: the answer was held back",
            )
        }
        Decision::Charged(charge, After::Answer) => {
            if !provider.delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(provider.delay) => {}
                    () = provider.shutdown.cancelled() => {}
                }
            }
            (StatusCode::CREATED, Json(charge)).into_response()
        }
    }
}

/// `GET /charges`: every charge made, in order.
async fn get_charges(State(provider): State<Arc<Provider>>) -> Json<Vec<Charge>> {
    Json(provider.ledger().charges.clone())
}

/// `GET /stats`: the counters.
async fn get_stats(State(provider): State<Arc<Provider>>) -> Json<Stats> {
    Json(provider.ledger().stats)
}

fn router(provider: Arc<Provider>) -> Router {
    Router::new()
        .route("/charges", post(post_charge).get(get_charges))
        .route("/stats", get(get_stats))
        .with_state(provider)
}

/// Serves until SIGINT or SIGTERM.
pub(crate) async fn run(options: Options) -> Result<(), Fail> {
    let rng = options
        .seed
        .map_or_else(fastrand::Rng::new, fastrand::Rng::with_seed);
    let shutdown = CancellationToken::new();
    let provider = Arc::new(Provider {
        ledger: Mutex::new(Ledger {
            charges: Vec::new(),
            by_key: HashMap::new(),
            stats: Stats::default(),
            rng,
        }),
        fail_before: options.fail_before,
        fail_after: options.fail_after,
        delay: options.delay,
        shutdown: shutdown.clone(),
    });
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|e| Fail::new(1, format!("cannot listen on {}: {e}", options.listen)))?;
    let local = listener.local_addr()?;
    say!("idem fake-provider: listening on http://{local} (Ctrl-C or SIGTERM stops it)");
    let stop = shutdown.clone();
    axum::serve(listener, router(Arc::clone(&provider)))
        .with_graceful_shutdown(async move {
            super::serve::shutdown_signal().await;
            stop.cancel();
        })
        .await
        .map_err(|e| Fail::new(1, format!("server error: {e}")))?;
    let stats = provider.ledger().stats;
    say!(
        "idem fake-provider: stopped ({} charges, {} failed before, {} failed after, {} replays)",
        stats.charges,
        stats.failed_before,
        stats.failed_after,
        stats.replays
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn probabilities_are_checked() {
        assert_eq!(parse_probability("0"), Ok(0.0));
        assert_eq!(parse_probability("0.25"), Ok(0.25));
        assert_eq!(parse_probability("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "NaN", "inf", "half", ""] {
            assert!(parse_probability(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn keys_and_amounts_are_checked() {
        let mut headers = HeaderMap::new();
        assert!(idempotency_key(&headers).is_err());
        headers.insert("idempotency-key", "k-1".parse().unwrap());
        assert_eq!(idempotency_key(&headers).as_deref(), Ok("k-1"));
        headers.append("idempotency-key", "k-2".parse().unwrap());
        assert!(idempotency_key(&headers).is_err());
        assert_eq!(amount(br#"{"amount": 5}"#), Ok(5));
        for bad in [
            &br#"{"amount": 0}"#[..],
            br#"{"amount": -1}"#,
            br#"{"amount": 1.5}"#,
            b"{}",
            b"x",
        ] {
            assert!(amount(bad).is_err());
        }
    }
}
