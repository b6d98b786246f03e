//! The child client: this test binary, started again with `IDEM_FAULT_CHILD` set, runs
//! idem calls on the parent's private namespace and is SIGKILLed by the parent.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use idem::core::Idem;
use serde::{Deserialize, Serialize};

use crate::engines::{Faulty, Hook};
use crate::scenarios::{broken_effect_first, broken_once, execute_once};

/// What the child does.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) enum Mode {
    /// One call whose effect prints `READY` and hangs.
    HangInEffect,
    /// One call whose commit stops at the gate; prints `READY` from the effect.
    AtGate,
    /// One call after another, printing `OK <key> <response>` after each.
    Stream,
    /// The broken protocol "record first": its separate effect transaction prints
    /// `READY` and hangs.
    Broken,
    /// The broken protocol "effect first": prints `READY` and hangs between the
    /// committed effect and the record.
    BrokenEffectFirst,
}

/// The child's instructions, passed as JSON in the environment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ChildSpec {
    pub(crate) engine: String,
    pub(crate) url: String,
    pub(crate) ns: String,
    pub(crate) mode: Mode,
    pub(crate) keys: Vec<(String, i64)>,
}

/// Prints one line for the parent, at once.
pub(crate) fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

pub(crate) fn main(spec: &str) -> ExitCode {
    let spec: ChildSpec = match serde_json::from_str(spec) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("child: bad spec: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("child: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = match spec.engine.as_str() {
        #[cfg(feature = "sqlite")]
        "sqlite" => rt.block_on(run::<idem_conformance::sqlite::SqliteBank>(spec)),
        #[cfg(feature = "postgres")]
        "postgres" => rt.block_on(run::<idem_conformance::postgres::PgBank>(spec)),
        #[cfg(feature = "mysql")]
        "mysql" => rt.block_on(run::<idem_conformance::mysql::MysqlBank>(spec)),
        other => Err(format!("engine {other} not compiled in")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("child: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run<K: Faulty>(spec: ChildSpec) -> Result<(), String> {
    let backend = K::attach(&spec.url, &spec.ns)
        .await
        .map_err(|e| e.to_string())?;
    let idem = Arc::new(Idem::new(backend));
    for (key, amount) in spec.keys {
        match spec.mode {
            Mode::HangInEffect | Mode::AtGate => {
                let (gate, hook) = match spec.mode {
                    Mode::AtGate => (true, Hook::Announce),
                    _ => (false, Hook::Hang),
                };
                execute_once::<K>(Arc::clone(&idem), key, amount, gate, Some(hook), false)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Mode::Stream => {
                let outcome =
                    execute_once::<K>(Arc::clone(&idem), key.clone(), amount, false, None, false)
                        .await
                        .map_err(|e| e.to_string())?;
                say(&format!("OK {key} {}", outcome.into_inner()));
            }
            Mode::Broken => {
                broken_once::<K>(&idem, key, amount, true).await?;
            }
            Mode::BrokenEffectFirst => {
                broken_effect_first::<K>(&idem, key, amount, true).await?;
            }
        }
    }
    Ok(())
}
