//! Hostile input, property-based: identifiers and JSON that clients can send.
//!
//! Each generated input is either accepted and replays exactly (a retry gets the very
//! same response text, floats bit for bit), or refused with a typed
//! `Error::InvalidInput` before any SQL; never a panic, and never two identities merged
//! (every distinct accepted identifier executes on its own, however alike it looks).
//!
//! Runs on SQLite, PostgreSQL and MySQL/MariaDB (required), and on SQL Server and Oracle
//! when `IDEM_MSSQL_URL` / `IDEM_ORACLE_URL` are set. `IDEM_PROPTEST_CASES` sets the
//! number of generated inputs per property (default 48).

#![allow(clippy::unwrap_used)] // test code: a broken setup should stop loudly

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use idem::core::serde_json::{self, Value, json};
use idem::core::{
    Error, Idem, Key, MessageId, Operation, Outcome, Principal, Request, Scope, Subscriber,
};
use idem_conformance::harness::namespace;
use idem_conformance::{Bank, BankError, Target};
use libtest_mimic::{Arguments, Failed, Trial};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

type Runtime = Arc<tokio::runtime::Runtime>;

fn cases() -> u32 {
    std::env::var("IDEM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

/// Identifiers built to collide: lookalikes, case and whitespace variants, NFC/NFD,
/// control characters, and the 255/256-byte boundary.
fn identifier() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(" ".to_owned()),
        Just("\t".to_owned()),
        Just("a\u{0}b".to_owned()),
        Just("line\nbreak".to_owned()),
        Just("k".repeat(255)),
        Just("k".repeat(256)),
        Just(format!("{}é", "k".repeat(253))),
        Just(format!("{}é", "k".repeat(254))),
        Just("k".to_owned()),
        Just("K".to_owned()),
        Just("k ".to_owned()),
        Just(" k".to_owned()),
        Just("café".to_owned()),
        Just("cafe\u{301}".to_owned()),
        Just("pаypal".to_owned()), // Cyrillic а
        Just("paypal".to_owned()),
        Just("\u{feff}k".to_owned()),
        Just("k\u{200b}".to_owned()),
        Just("🔑".to_owned()),
        "\\PC{1,12}",
        "[a-zA-Z0-9 _.:-]{0,12}",
    ]
}

/// JSON values with the numbers and strings that break naive storage.
fn json_value() -> impl Strategy<Value = Value> {
    let float = prop_oneof![
        (-1e3f64..1e3, -1e3f64..1e3).prop_map(|(a, b)| a - b),
        (1u32..1000, 1u32..1000).prop_map(|(a, b)| f64::from(a) / f64::from(b)),
        Just(0.3 - 0.1),
        Just(1e16),
        Just(-0.0),
        Just(f64::MIN_POSITIVE),
        Just(f64::MAX),
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
    ]
    .prop_map(|f| json!(f));
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        float,
        "\\PC{0,16}".prop_map(Value::from),
        Just(json!("nul \u{0} inside")),
        Just(json!("trailing space ")),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("\\PC{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

/// What a valid identifier executed with, to tell a replay from a merge.
type Seen = Arc<Mutex<HashMap<String, Value>>>;

/// Runs one request and checks it against what this identifier did before.
async fn once<K: Bank>(
    idem: &Idem<K::B>,
    seen: &Seen,
    label: &str,
    scope: &Scope,
    key: &Key,
) -> Result<(), TestCaseError> {
    let request = Request::new(json!({ "label": label }));
    let response = json!({ "label": label, "nonce": fastrand::u64(..) });
    let effect_response = response.clone();
    let out = idem
        .execute(scope, key, &request, move |_tx| {
            let r = effect_response.clone();
            Box::pin(async move { Ok::<_, BankError>(r) })
        })
        .await
        .map_err(|e| fail(format!("{label}: {e}")))?;
    let before = seen.lock().unwrap().get(label).cloned();
    match (before, out) {
        (None, Outcome::Executed(r)) => {
            seen.lock().unwrap().insert(label.to_owned(), r);
        }
        (Some(stored), Outcome::Replayed(r)) if stored == r => {}
        (before, out) => {
            return Err(fail(format!(
                "{label}: identities merged or lost: before {before:?}, now {out:?}"
            )));
        }
    }
    // An immediate retry replays the same response text.
    match idem
        .execute(scope, key, &request, |_tx| {
            Box::pin(async { Err::<Value, _>(BankError::Insufficient) })
        })
        .await
    {
        Ok(Outcome::Replayed(r)) if Some(&r) == seen.lock().unwrap().get(label) => Ok(()),
        other => Err(fail(format!("{label}: retry did not replay: {other:?}"))),
    }
}

/// Keys, principals, operations, subscribers and message IDs.
fn identifiers<K: Bank>(bank: &K, rt: &Runtime) -> Result<String, Failed> {
    let idem = Idem::new(bank.backend().clone());
    let seen: Seen = Arc::default();
    let (mut accepted, mut refused) = (0u32, 0u32);
    let counts = Arc::new(Mutex::new((0u32, 0u32)));
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let base_scope = Scope::new(
        Principal::new("hostile")?,
        Operation::new("identifiers", 1)?,
    );
    let result = runner.run(&identifier(), |s| {
        let (idem, seen, counts) = (&idem, &seen, counts.clone());
        rt.block_on(async {
            let mut ok = 0;
            let mut no = 0;
            // As a key.
            match Key::new(s.clone()) {
                Ok(key) => {
                    ok += 1;
                    once::<K>(idem, seen, &format!("key:{s}"), &base_scope, &key).await?
                }
                Err(e) if e.what() == "idempotency key" => no += 1,
                Err(e) => return Err(fail(format!("key {s:?}: wrong refusal {e}"))),
            }
            // As a principal (its own scope).
            match Principal::new(s.clone()) {
                Ok(p) => {
                    ok += 1;
                    let scope = Scope::new(p, Operation::new("identifiers", 1).unwrap());
                    let key = Key::new("fixed").unwrap();
                    once::<K>(idem, seen, &format!("principal:{s}"), &scope, &key).await?
                }
                Err(_) => no += 1,
            }
            // As an operation name (a restricted alphabet: most inputs are refused).
            match Operation::new(&s, 1) {
                Ok(op) => {
                    ok += 1;
                    let scope = Scope::new(Principal::new("hostile").unwrap(), op);
                    let key = Key::new("fixed").unwrap();
                    once::<K>(idem, seen, &format!("operation:{s}"), &scope, &key).await?
                }
                Err(e) if e.what() == "operation" => no += 1,
                Err(e) => return Err(fail(format!("operation {s:?}: wrong refusal {e}"))),
            }
            // As a subscriber and as a message ID.
            match (Subscriber::new(s.clone()), MessageId::new(s.clone())) {
                (Ok(sub), Ok(id)) => {
                    ok += 1;
                    let first = consume_once::<K>(idem, &sub, &id).await?;
                    let known = seen
                        .lock()
                        .unwrap()
                        .insert(format!("message:{s}"), Value::Null);
                    if first != known.is_none() {
                        return Err(fail(format!(
                            "message {s:?}: applied {first}, seen before {}",
                            known.is_some()
                        )));
                    }
                    if consume_once::<K>(idem, &sub, &id).await? {
                        return Err(fail(format!("message {s:?}: applied twice")));
                    }
                }
                (Err(_), Err(_)) => no += 1,
                (a, b) => {
                    return Err(fail(format!(
                        "{s:?}: subscriber and message ID disagree: {a:?} / {b:?}"
                    )));
                }
            }
            let mut c = counts.lock().unwrap();
            c.0 += ok;
            c.1 += no;
            Ok(())
        })
    });
    result.map_err(|e| Failed::from(format!("{}: {e}", K::ENGINE)))?;
    {
        let c = counts.lock().unwrap();
        accepted += c.0;
        refused += c.1;
    }
    let records = rt.block_on(bank.count_records())?;
    let executed = seen
        .lock()
        .unwrap()
        .keys()
        .filter(|k| !k.starts_with("message:"))
        .count() as u64;
    if records != executed {
        return Err(format!(
            "{} request records for {executed} distinct accepted identities",
            records
        )
        .into());
    }
    Ok(format!(
        "{} inputs: {accepted} accepted and replayed exactly, {refused} refused before SQL, {records} records",
        cases()
    ))
}

async fn consume_once<K: Bank>(
    idem: &Idem<K::B>,
    sub: &Subscriber,
    id: &MessageId,
) -> Result<bool, TestCaseError> {
    match idem
        .consume(sub, id, None, |_tx| {
            Box::pin(async { Ok::<_, BankError>(()) })
        })
        .await
    {
        Ok(idem::core::Consumed::Applied(())) => Ok(true),
        Ok(idem::core::Consumed::Duplicate) => Ok(false),
        Err(e) => Err(fail(format!("message {id:?}: {e}"))),
    }
}

/// Requests and responses: generated JSON stored and replayed exactly.
fn json<K: Bank>(bank: &K, rt: &Runtime) -> Result<String, Failed> {
    let idem = Idem::new(bank.backend().clone());
    let scope = Scope::new(Principal::new("hostile")?, Operation::new("json", 1)?);
    let n = Arc::new(Mutex::new(0u64));
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&json_value(), |value| {
            let key = {
                let mut n = n.lock().unwrap();
                *n += 1;
                Key::new(format!("json-{n}")).unwrap()
            };
            rt.block_on(async {
                let request = Request::new(json!({ "v": value }));
                let text = serde_json::to_string(&value).unwrap();
                let echo = value.clone();
                let first = idem
                    .execute(&scope, &key, &request, move |_tx| {
                        let r = echo.clone();
                        Box::pin(async move { Ok::<_, BankError>(r) })
                    })
                    .await;
                let Ok(Outcome::Executed(first)) = first else {
                    return Err(fail(format!("{text}: {first:?}")));
                };
                // The retry builds its request again from the same value.
                let again = Request::new(json!({ "v": value }));
                let replay = idem
                    .execute(&scope, &key, &again, |_tx| {
                        Box::pin(async { Err::<Value, _>(BankError::Insufficient) })
                    })
                    .await;
                match replay {
                    Ok(Outcome::Replayed(r))
                        if serde_json::to_string(&r).unwrap() == text
                            && serde_json::to_string(&first).unwrap() == text =>
                    {
                        Ok(())
                    }
                    other => Err(fail(format!("{text}: replay {other:?}"))),
                }
            })
        })
        .map_err(|e| Failed::from(format!("{}: {e}", K::ENGINE)))?;

    rt.block_on(exact_floats_and_refusals(bank, &idem, &scope))?;
    Ok(format!(
        "{} generated requests and responses replayed exactly; 6 computed f64 bit-exact; deep, oversized and duplicate-key requests refused",
        cases()
    ))
}

async fn exact_floats_and_refusals<K: Bank>(
    bank: &K,
    idem: &Idem<K::B>,
    scope: &Scope,
) -> Result<(), Failed> {
    // Computed floats as a bare f64 response: bit for bit.
    for (i, f) in [0.3 - 0.1, 0.1 + 0.2, 1.0 / 3.0, -0.0, 1e16, 2.5e-308]
        .into_iter()
        .enumerate()
    {
        let key = Key::new(format!("f64-{i}"))?;
        let request = Request::new(json!({ "f": f }));
        let out: Outcome<f64> = idem
            .execute(scope, &key, &request, move |_tx| {
                Box::pin(async move { Ok::<_, BankError>(f) })
            })
            .await?;
        let again: Outcome<f64> = idem
            .execute(scope, &key, &Request::new(json!({ "f": f })), |_tx| {
                Box::pin(async { Err::<f64, _>(BankError::Insufficient) })
            })
            .await?;
        if !again.is_replayed()
            || again.response().to_bits() != f.to_bits()
            || out.response().to_bits() != f.to_bits()
        {
            return Err(format!("f64 {f:?}: executed {out:?}, retry {again:?}").into());
        }
    }

    // Refused before any SQL, with a typed error naming the input.
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = json!([deep]);
    }
    let refused: Vec<(&str, Request, Idem<K::B>)> = vec![
        (
            "too deep",
            Request::new(deep),
            Idem::new(bank.backend().clone()),
        ),
        (
            "too large",
            Request::new(json!({ "blob": "x".repeat(4096) })),
            Idem::new(bank.backend().clone()).with_max_request_bytes(1024),
        ),
    ];
    for (what, request, idem) in refused {
        let key = Key::new(format!("refused-{what}"))?;
        match idem
            .execute(scope, &key, &request, |_tx| {
                Box::pin(async { Ok::<_, BankError>(0) })
            })
            .await
        {
            Err(Error::InvalidInput(e)) if e.what() == "request" => {}
            other => return Err(format!("{what}: expected InvalidInput, got {other:?}").into()),
        }
    }
    // A zero (or sub-second) retention would let a retry moments later run the effect again.
    let short = Scope::new(
        Principal::new("hostile")?,
        Operation::new("json", 1)?.with_retention(std::time::Duration::ZERO),
    );
    match idem
        .execute(
            &short,
            &Key::new("zero-retention")?,
            &Request::new(json!({})),
            |_tx| Box::pin(async { Ok::<_, BankError>(0) }),
        )
        .await
    {
        Err(Error::InvalidInput(e)) if e.what() == "operation retention" => {}
        other => {
            return Err(format!("zero retention: expected InvalidInput, got {other:?}").into());
        }
    }
    if Request::parse(r#"{"amount":1,"amount":2}"#).is_ok() {
        return Err("duplicate object keys were accepted".into());
    }
    Ok(())
}

type Property<K> = fn(&K, &Runtime) -> Result<String, Failed>;

fn trials<K: Bank>(target: &Target, rt: &Runtime) -> Vec<Trial> {
    let properties: [(&str, Property<K>); 2] =
        [("identifiers", identifiers::<K>), ("json", json::<K>)];
    properties
        .into_iter()
        .map(|(name, property)| {
            let trial = format!("hostile::{}::{name}", K::ENGINE);
            match target {
                Target::Skip(reason) => {
                    eprintln!("SKIPPED {trial}: {reason}");
                    Trial::test(trial, || Ok(())).with_ignored_flag(true)
                }
                Target::Url(url) => {
                    let (url, rt) = (url.clone(), Arc::clone(rt));
                    Trial::test(trial.clone(), move || {
                        let ns = namespace(name);
                        let bank = rt
                            .block_on(K::connect(&url, Some(&ns)))
                            .map_err(|e| format!("cannot connect to {}: {e}", K::ENGINE))?;
                        rt.block_on(bank.setup())?;
                        let out = property(&bank, &rt);
                        if let Err(e) = rt.block_on(bank.close()) {
                            eprintln!("warning: {trial}: cleanup failed: {e}");
                        }
                        let summary = out?;
                        println!("{trial}: {summary}");
                        Ok(())
                    })
                }
            }
        })
        .collect()
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let rt: Runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    );
    let dir = std::env::temp_dir().join("idem-hostile");
    let mut all = Vec::new();
    all.extend(trials::<idem_conformance::sqlite::SqliteBank>(
        &Target::required(
            "IDEM_SQLITE_URL",
            &format!("sqlite://{}/case.db", dir.display()),
        ),
        &rt,
    ));
    all.extend(trials::<idem_conformance::postgres::PgBank>(
        &Target::required(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        &rt,
    ));
    all.extend(trials::<idem_conformance::mysql::MysqlBank>(
        &Target::required("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        &rt,
    ));
    all.extend(trials::<idem_conformance::mssql::MssqlBank>(
        &Target::optional("IDEM_MSSQL_URL"),
        &rt,
    ));
    all.extend(trials::<idem_conformance::oracle::OracleBank>(
        &Target::optional("IDEM_ORACLE_URL"),
        &rt,
    ));
    libtest_mimic::run(&args, all).exit_code()
}
