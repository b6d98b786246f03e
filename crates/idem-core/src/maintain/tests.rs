//! The loop against a fake lock and fake tasks: who works, when it stops, what it
//! releases. The engines' locks are tested live in their crates and by
//! `crates/idem-cli/tests/maintain.rs`.
#![allow(clippy::unwrap_used)]

use std::error::Error as StdError;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::backend::{Claim, Claimed, Finish, Stored};
use crate::error::ErrorKind;

#[derive(Debug, Clone)]
struct NoBackend;

impl Backend for NoBackend {
    type Tx = ();
    async fn lookup(&self, _: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        Ok(None)
    }
    async fn claim(&self, _: &Claim<'_>) -> Result<Claimed<()>, DbError> {
        Err(DbError::new("fake", ErrorKind::Other, "no claims here"))
    }
    async fn finish(&self, _: (), _: &Claim<'_>, _: Finish<'_>) -> Result<(), DbError> {
        Ok(())
    }
    fn engine(&self) -> &'static str {
        "fake"
    }
    fn classify(&self, _: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        None
    }
}

/// A lock shared by the fakes of one test: `owner` is the holder's id, 0 when free.
#[derive(Debug, Default)]
struct Shared {
    owner: AtomicU32,
    released: AtomicU32,
}

#[derive(Debug, Clone)]
struct FakeLock {
    id: u32,
    shared: Arc<Shared>,
    /// While set, checks answer "not held" (the session was cut).
    cut: Arc<AtomicBool>,
}

impl LeaderLock for FakeLock {
    type Held = u32;
    async fn try_acquire(&self) -> Result<Option<u32>, DbError> {
        Ok(self
            .shared
            .owner
            .compare_exchange(0, self.id, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| self.id))
    }
    async fn is_held(&self, held: &mut u32) -> Result<bool, DbError> {
        if self.cut.load(Ordering::SeqCst) {
            return Ok(false);
        }
        Ok(self.shared.owner.load(Ordering::SeqCst) == *held)
    }
    async fn release(&self, held: u32) -> Result<(), DbError> {
        let _ = self
            .shared
            .owner
            .compare_exchange(held, 0, Ordering::SeqCst, Ordering::SeqCst);
        self.shared.released.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// A task that records its runs in a shared log and can cut the lock while it runs.
struct Note {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
    cut: Option<Arc<AtomicBool>>,
}

impl Task<NoBackend> for Note {
    fn name(&self) -> &'static str {
        self.name
    }
    fn run<'a>(&'a mut self, _: &'a Idem<NoBackend>) -> BoxFuture<'a, Result<Work, DbError>> {
        Box::pin(async move {
            self.log.lock().unwrap().push(self.name.to_owned());
            if let Some(cut) = &self.cut {
                cut.store(true, Ordering::SeqCst);
            }
            Ok(Work {
                done: 1,
                ..Work::default()
            })
        })
    }
}

fn maintainer(
    id: u32,
    shared: &Arc<Shared>,
    log: &Arc<Mutex<Vec<String>>>,
) -> (Maintainer<NoBackend, FakeLock>, Arc<AtomicBool>) {
    let cut = Arc::new(AtomicBool::new(false));
    let lock = FakeLock {
        id,
        shared: Arc::clone(shared),
        cut: Arc::clone(&cut),
    };
    let note = |name| Note {
        name,
        log: Arc::clone(log),
        cut: None,
    };
    let m = Maintainer::new(Idem::new(NoBackend), lock)
        .with_interval(Duration::from_millis(10))
        .with_task(note("a"))
        .with_task(note("b"));
    (m, cut)
}

#[tokio::test]
async fn only_the_holder_works_and_it_releases_at_shutdown() {
    use tokio::sync::watch;
    let shared = Arc::new(Shared::default());
    let log = Arc::new(Mutex::new(Vec::new()));
    let events = Arc::new(Mutex::new(Vec::new()));
    // Runner ticks of the first, standby ticks of the second, as they happen.
    let (first_ticks, mut first_seen) = watch::channel(0u64);
    let (second_ticks, mut second_seen) = watch::channel(0u64);
    let (first, _) = maintainer(1, &shared, &log);
    let seen = Arc::clone(&events);
    let first = first.on_event(move |e| {
        let line = match e {
            Event::Acquired => "acquired".to_owned(),
            Event::Releasing => "releasing".to_owned(),
            Event::Tick(t) => {
                if t.runner {
                    first_ticks.send_modify(|n| *n += 1);
                }
                format!("tick runner={} tasks={}", t.runner, t.tasks.len())
            }
            other => format!("{other:?}"),
        };
        seen.lock().unwrap().push(line);
    });
    let (second, _) = maintainer(2, &shared, &log);
    let second = second.on_event(move |e| {
        if let Event::Tick(_) = e {
            second_ticks.send_modify(|n| *n += 1);
        }
    });
    let (stop_first, first_stop) = tokio::sync::oneshot::channel::<()>();
    let (stop_second, second_stop) = tokio::sync::oneshot::channel::<()>();
    let first = tokio::spawn(first.run(async {
        let _ = first_stop.await;
    }));
    // The second starts once the first holds the lock, and ticks twice beside it.
    first_seen.wait_for(|n| *n >= 1).await.unwrap();
    let second = tokio::spawn(second.run(async {
        let _ = second_stop.await;
    }));
    second_seen.wait_for(|n| *n >= 2).await.unwrap();
    stop_second.send(()).unwrap();
    let b = second.await.unwrap();
    let runner_ticks = *first_seen.borrow();
    first_seen.wait_for(|n| *n > runner_ticks).await.unwrap();
    stop_first.send(()).unwrap();
    let a = first.await.unwrap();
    assert_eq!(a.acquired, 1);
    assert!(a.runner_ticks >= 2, "{a:?}");
    assert_eq!(b.acquired, 0, "the lock was held: {b:?}");
    assert_eq!(b.runner_ticks, 0);
    assert!(b.ticks >= 2, "{b:?}");
    // Every tick of the runner ran a, then b; nothing else ran.
    let log = log.lock().unwrap();
    assert_eq!(log.len() as u64, 2 * a.runner_ticks, "{log:?}");
    assert!(log.chunks(2).all(|c| c == ["a", "b"]), "{log:?}");
    let events = events.lock().unwrap();
    assert_eq!(events.first().map(String::as_str), Some("acquired"));
    assert_eq!(events.last().map(String::as_str), Some("releasing"));
    assert!(events.contains(&"tick runner=true tasks=2".to_owned()));
    assert_eq!(shared.owner.load(Ordering::SeqCst), 0, "released");
}

#[tokio::test]
async fn a_lost_lock_stops_the_runner_before_its_next_task() {
    let shared = Arc::new(Shared::default());
    let log = Arc::new(Mutex::new(Vec::new()));
    let cut = Arc::new(AtomicBool::new(false));
    let lock = FakeLock {
        id: 1,
        shared: Arc::clone(&shared),
        cut: Arc::clone(&cut),
    };
    let lost = Arc::new(Mutex::new(Vec::new()));
    let seen_tick = Arc::clone(&lost);
    let m = Maintainer::new(Idem::new(NoBackend), lock)
        .with_interval(Duration::from_secs(3600))
        .with_task(Note {
            name: "cuts",
            log: Arc::clone(&log),
            cut: Some(Arc::clone(&cut)),
        })
        .with_task(Note {
            name: "never",
            log: Arc::clone(&log),
            cut: None,
        });
    // One tick, then shutdown during the (hour-long) pause.
    let (ticked, shutdown) = tokio::sync::oneshot::channel::<()>();
    let mut ticked = Some(ticked);
    let m = m.on_event(move |e| {
        if let Event::Tick(t) = e {
            seen_tick
                .lock()
                .unwrap()
                .push(format!("skipped {}", t.skipped));
            if let Some(tx) = ticked.take() {
                let _ = tx.send(());
            }
        } else if let Event::Lost { reason } = e {
            seen_tick.lock().unwrap().push((*reason).to_owned());
        }
    });
    let shutdown = async {
        let _ = shutdown.await;
    };
    let summary = m.run(shutdown).await;
    assert_eq!(*log.lock().unwrap(), ["cuts"], "the second task never ran");
    assert_eq!(summary.lost, 1);
    let lost = lost.lock().unwrap();
    assert_eq!(lost[0], "the lock belongs to another session now");
    assert_eq!(lost[1], "skipped 1");
    assert_eq!(
        shared.released.load(Ordering::SeqCst),
        1,
        "dropped once, not twice"
    );
}

#[tokio::test]
async fn shutdown_lets_the_task_in_hand_finish_then_stops() {
    let shared = Arc::new(Shared::default());
    let log = Arc::new(Mutex::new(Vec::new()));
    let (m, _) = maintainer(1, &shared, &log);
    let summary = m.run(std::future::ready(())).await;
    assert_eq!(summary, Summary::default(), "already shut down: no tick");
    assert!(log.lock().unwrap().is_empty());
}

#[test]
fn pauses_stay_within_the_interval() {
    let lock = FakeLock {
        id: 1,
        shared: Arc::default(),
        cut: Arc::default(),
    };
    let m = Maintainer::new(Idem::new(NoBackend), lock)
        .with_interval(Duration::from_secs(10))
        .with_jitter(0.5);
    for _ in 0..1000 {
        let p = m.pause();
        assert!(
            p <= Duration::from_secs(10) && p >= Duration::from_secs(5),
            "{p:?}"
        );
    }
    let m = m.with_jitter(f64::NAN).with_interval(Duration::ZERO);
    assert_eq!(m.jitter, DEFAULT_JITTER);
    assert_eq!(m.interval, Duration::from_millis(10));
}

#[test]
fn lock_names_are_checked() {
    assert!(check_lock_name(DEFAULT_LOCK_NAME).is_ok());
    assert!(check_lock_name("orders.v2_maintain").is_ok());
    for bad in ["", ".hidden", "a/b", "a b", "é", &"a".repeat(65)] {
        assert!(check_lock_name(bad).is_err(), "{bad:?}");
    }
}
