#![allow(clippy::unwrap_used)]

use super::through;

#[test]
fn urls_are_rewritten_to_the_proxy() {
    let proxy = "127.0.0.1:4000".parse().unwrap();
    assert_eq!(
        through("postgres://postgres@127.0.0.1:5432/postgres", proxy, 5432),
        Some((
            "postgres://postgres@127.0.0.1:4000/postgres".into(),
            "127.0.0.1:5432".into()
        ))
    );
    assert_eq!(
        through("mysql://root:p%40ss@db/test?x=1", proxy, 3306),
        Some((
            "mysql://root:p%40ss@127.0.0.1:4000/test?x=1".into(),
            "db:3306".into()
        ))
    );
    assert_eq!(through("nonsense", proxy, 1), None);
}

// ---------------------------------------------------------------- recorded sessions
//
// `testdata/*.txt` are real connections recorded through the proxy (see their first
// line; re-recorded by the `record_wire_fixtures` trial of the `net_faults` target): a
// statement prepared once and executed again from the driver's cache, then a
// transaction that commits and one that rolls back.

use super::wire::{ClientFrame, ServerFrame, Session, Statement, Wire};
use super::{Action, Direction, Fault, Faults, Marker, Trigger};

const POSTGRES: &str = include_str!("testdata/postgres.txt");
const MYSQL: &str = include_str!("testdata/mysql.txt");

fn chunks(text: &str) -> Vec<(Direction, Vec<u8>)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut parts = l.split(' ');
            let _conn = parts.next().unwrap();
            let dir = match parts.next().unwrap() {
                "U" => Direction::Up,
                _ => Direction::Down,
            };
            let hex = parts.next().unwrap_or("");
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (dir, bytes)
        })
        .collect()
}

/// What one direction's frames look like after a replay.
#[derive(Debug, Default)]
struct Replay {
    up: Vec<ClientFrame>,
    down: Vec<ServerFrame>,
    /// In arrival order: `Ok(index into up)` or `Err(index into down)`.
    order: Vec<Result<usize, usize>>,
}

/// Replays a recording through a session, each chunk whole or one byte at a time.
fn replay(wire: Wire, text: &str, byte_by_byte: bool) -> Replay {
    let mut session = Session::new(wire);
    let mut out = Replay::default();
    for (dir, bytes) in chunks(text) {
        let pieces: Vec<&[u8]> = if byte_by_byte {
            bytes.chunks(1).collect()
        } else {
            vec![&bytes[..]]
        };
        for piece in pieces {
            match dir {
                Direction::Up => {
                    for f in session.client(piece) {
                        out.order.push(Ok(out.up.len()));
                        out.up.push(f);
                    }
                }
                Direction::Down => {
                    for f in session.server(piece) {
                        out.order.push(Err(out.down.len()));
                        out.down.push(f);
                    }
                }
            }
        }
    }
    assert!(
        !session.is_opaque(),
        "the session gave up following the protocol"
    );
    out
}

fn statements(r: &Replay) -> Vec<&Statement> {
    r.up.iter().filter_map(|f| f.statement.as_ref()).collect()
}

fn kinds(r: &Replay) -> Vec<&str> {
    statements(r).iter().map(|s| s.kind()).collect()
}

/// The server frame that completes the reply answering client frame `at`: the first
/// server frame after it whose reply count reaches `answered_by`.
fn answer_of(r: &Replay, at: usize) -> &ServerFrame {
    let want = r.up[at].answered_by;
    let pos = r.order.iter().position(|o| *o == Ok(at)).unwrap();
    r.order[pos..]
        .iter()
        .filter_map(|o| o.err())
        .map(|i| &r.down[i])
        .find(|f| f.replies >= want)
        .unwrap()
}

/// Runs `fault` over the replay's statements; the index of the client frame it hits.
fn hit(r: &Replay, fault: Fault) -> Option<usize> {
    let mut faults = Faults::default();
    faults.arm(fault);
    r.up.iter().position(|f| {
        f.statement
            .as_ref()
            .is_some_and(|st| faults.decide(1, st).is_some())
    })
}

fn check_byte_exact(text: &str, r: &Replay) {
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for (dir, bytes) in chunks(text) {
        match dir {
            Direction::Up => up.extend(bytes),
            Direction::Down => down.extend(bytes),
        }
    }
    assert_eq!(
        r.up.iter()
            .flat_map(|f| f.bytes.clone())
            .collect::<Vec<_>>(),
        up
    );
    assert_eq!(
        r.down
            .iter()
            .flat_map(|f| f.bytes.clone())
            .collect::<Vec<_>>(),
        down
    );
}

#[test]
fn postgres_recording_statements_from_the_cache() {
    let r = replay(Wire::Postgres, POSTGRES, false);
    assert_eq!(
        kinds(&r),
        [
            "CREATE", "BEGIN", "INSERT", "INSERT", "COMMIT", "BEGIN", "INSERT", "ROLLBACK", "SHOW"
        ]
    );
    // One Parse carries the INSERT's text; its later executions are Binds by name.
    let parses =
        r.up.iter()
            .filter(|f| f.bytes[0] == b'P' && f.bytes.windows(6).any(|w| w == b"INSERT"))
            .count();
    assert_eq!(parses, 1);
    let inserts: Vec<&Statement> = statements(&r)
        .into_iter()
        .filter(|s| s.kind() == "INSERT")
        .collect();
    for (st, key) in inserts.iter().zip(["wire-1", "wire-2", "wire-3"]) {
        assert!(st.text().contains("nf_wire"), "{st:?}");
        assert!(st.contains(key.as_bytes()), "{st:?}");
        assert!(!st.text().contains(key));
    }
    check_byte_exact(POSTGRES, &r);
    let bytewise = replay(Wire::Postgres, POSTGRES, true);
    assert_eq!(kinds(&bytewise), kinds(&r));
    check_byte_exact(POSTGRES, &bytewise);
}

#[test]
fn postgres_recording_the_commit_after_a_marker() {
    let r = replay(Wire::Postgres, POSTGRES, false);
    let at = hit(
        &r,
        Fault::lose_reply(Trigger::commit_after(Marker::containing("wire-2"))),
    )
    .unwrap();
    assert_eq!(r.up[at].statement.as_ref().unwrap().kind(), "COMMIT");
    // Its reply ends with ReadyForQuery, right after "COMMIT" CommandComplete.
    let answer = answer_of(&r, at);
    assert_eq!(answer.bytes[0], b'Z');
    let i = r.down.iter().position(|f| std::ptr::eq(f, answer)).unwrap();
    assert!(r.down[i - 1].bytes.starts_with(b"C\0\0\0\x0bCOMMIT\0"));
    // The key rolled back never arms a COMMIT; its ROLLBACK is found.
    assert_eq!(
        hit(
            &r,
            Fault::lose_reply(Trigger::commit_after(Marker::containing("wire-3")))
        ),
        None
    );
    let at = hit(
        &r,
        Fault::cut(Trigger::on(Marker::containing("wire-3")).then(Marker::kind("ROLLBACK"))),
    )
    .unwrap();
    assert_eq!(r.up[at].statement.as_ref().unwrap().kind(), "ROLLBACK");
    // A Bind's reply: the ReadyForQuery after its Sync.
    let at = hit(
        &r,
        Fault::new(
            Trigger::on(Marker::kind("INSERT").with("wire-1")),
            Action::LoseReply,
        ),
    )
    .unwrap();
    assert_eq!(r.up[at].bytes[0], b'B');
    assert_eq!(answer_of(&r, at).bytes[0], b'Z');
}

#[test]
fn mysql_recording_statements_from_the_cache() {
    let r = replay(Wire::Mysql, MYSQL, false);
    assert_eq!(
        kinds(&r),
        [
            "SELECT", "CREATE", "START", "INSERT", "INSERT", "COMMIT", "START", "INSERT",
            "ROLLBACK", "SELECT"
        ]
    );
    // One COM_STMT_PREPARE; every INSERT is a COM_STMT_EXECUTE by the server's id.
    let prepares =
        r.up.iter()
            .filter(|f| f.bytes.get(4) == Some(&0x16))
            .count();
    assert_eq!(prepares, 1);
    let inserts: Vec<&Statement> = statements(&r)
        .into_iter()
        .filter(|s| s.kind() == "INSERT")
        .collect();
    for (st, key) in inserts.iter().zip(["wire-1", "wire-2", "wire-3"]) {
        assert!(st.text().contains("nf_wire"), "{st:?}");
        assert!(st.contains(key.as_bytes()), "{st:?}");
    }
    check_byte_exact(MYSQL, &r);
    let bytewise = replay(Wire::Mysql, MYSQL, true);
    assert_eq!(kinds(&bytewise), kinds(&r));
    check_byte_exact(MYSQL, &bytewise);
}

#[test]
fn mysql_recording_the_commit_after_a_marker() {
    let r = replay(Wire::Mysql, MYSQL, false);
    let at = hit(
        &r,
        Fault::lose_reply(Trigger::commit_after(Marker::containing("wire-2"))),
    )
    .unwrap();
    assert_eq!(r.up[at].statement.as_ref().unwrap().kind(), "COMMIT");
    // The reply is the OK packet (sequence 1) that follows.
    let answer = answer_of(&r, at);
    assert_eq!(answer.bytes[3], 1);
    assert_eq!(answer.bytes[4], 0x00);
    let pos_commit = r.order.iter().position(|o| *o == Ok(at)).unwrap();
    let pos_answer = r
        .order
        .iter()
        .position(|o| matches!(o, Err(i) if std::ptr::eq(&r.down[*i], answer)))
        .unwrap();
    assert_eq!(pos_answer, pos_commit + 1);
    assert_eq!(
        hit(
            &r,
            Fault::lose_reply(Trigger::commit_after(Marker::containing("wire-3")))
        ),
        None
    );
    // SET … READ COMMITTED is not a COMMIT; START TRANSACTION restarts the sequence.
    assert_eq!(
        hit(
            &r,
            Fault::cut(
                Trigger::on(Marker::containing("@@max_allowed_packet")).then(Marker::commit())
            )
        ),
        None
    );
}
