//! The maintenance lock on a live MySQL/MariaDB (`IDEM_MYSQL_URL`, default the local
//! server; fails if unreachable): one holder per name and database, a holder whose
//! session is killed finds out, and the lock is free again at once.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)] // shared helpers: this file does not use every one
mod common;

use std::time::{Duration, Instant};

use idem_core::maintain::LeaderLock;
use idem_mysql::mysql_async::prelude::Queryable;

use common::PrivateDb;

#[tokio::test]
async fn one_holder_per_name_and_database_and_a_killed_holder_knows() {
    let one = PrivateDb::create_unmigrated("leader_a").await;
    let two = PrivateDb::create_unmigrated("leader_b").await;
    let a = one.backend.leader_lock("idem-maintain").unwrap();
    let b = one.backend.leader_lock("idem-maintain").unwrap();
    let mut held = a.try_acquire().await.unwrap().expect("free at first");
    assert!(a.is_held(&mut held).await.unwrap());
    assert!(
        b.try_acquire().await.unwrap().is_none(),
        "one holder per name"
    );
    let elsewhere = two.backend.leader_lock("idem-maintain").unwrap();
    let other_db = elsewhere.try_acquire().await.unwrap();
    assert!(other_db.is_some(), "another database elects on its own");
    let other_name = one.backend.leader_lock("reports").unwrap();
    let other_name = other_name.try_acquire().await.unwrap();
    assert!(other_name.is_some(), "another name is another lock");

    // The holder's session is killed (as when its process dies): it finds out at its
    // next check, and the lock is free for another session.
    let mut admin = one.backend.pool().get_conn().await.unwrap();
    admin
        .query_drop(format!("KILL {}", held.session()))
        .await
        .unwrap();
    drop(admin);
    assert!(
        !a.is_held(&mut held).await.unwrap_or(false),
        "the check sees it"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut taken = loop {
        if let Some(h) = b.try_acquire().await.unwrap() {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the lock stayed taken after the session ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(b.is_held(&mut taken).await.unwrap());
    b.release(taken).await.unwrap();
    let again = a.try_acquire().await.unwrap();
    assert!(again.is_some(), "free again after release");
    drop((again, other_db, other_name));
    one.drop_database().await;
    two.drop_database().await;
}
