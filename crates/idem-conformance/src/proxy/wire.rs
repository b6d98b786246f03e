//! Just enough of the PostgreSQL and MySQL wire protocols to cut a connection's byte
//! streams into whole messages and find the statements in them.
//!
//! Drivers cache prepared statements: sqlx sends a statement's text once per connection
//! (`Parse` under a name), then only `Bind`/`Execute` by that name; mysql_async sends
//! `COM_STMT_PREPARE` once (the server answers with a statement id), then
//! `COM_STMT_EXECUTE` by id. A [`Session`] remembers names and ids per connection, so
//! every execution carries its SQL text, and keeps the bound parameters' bytes beside it
//! (a key is usually a parameter, not part of the text). A text query (PostgreSQL's
//! simple `Query`, MySQL's `COM_QUERY`) may carry several statements, or one compound
//! statement, and its values as hex literals ([`Statement::text_query`]): faults follow
//! its statements in order.
//!
//! Replies are counted per connection so that a fault can wait for "the reply to this
//! request": PostgreSQL answers every `Sync` and every simple `Query` with one
//! `ReadyForQuery`; MySQL answers every command but `COM_STMT_CLOSE`,
//! `COM_STMT_SEND_LONG_DATA` and `COM_QUIT` with a reply whose first packet has
//! sequence number 1.
//!
//! Anything the session cannot follow (TLS after `SSLRequest`, a MySQL SSL request)
//! turns it opaque: bytes are then passed on in the chunks they came in, without
//! statements.

use std::collections::HashMap;
use std::fmt;

/// The protocol a proxy's connections speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// PostgreSQL's frontend/backend protocol 3.0 (without TLS: `sslmode=disable`).
    Postgres,
    /// The MySQL/MariaDB client/server protocol (without TLS or compression).
    Mysql,
    /// Bytes only: no statements, no replies (counting round trips needs nothing more).
    Opaque,
}

/// A statement the client sent, as the session understood it.
#[derive(Clone, PartialEq, Eq)]
pub struct Statement {
    kind: String,
    next_word: String,
    text: String,
    params: Vec<u8>,
    /// The bytes of the text's hex literals (`X'…'`, with or without an introducer):
    /// values a MySQL text query carries in its text.
    literals: Vec<Vec<u8>>,
    /// The statements of a MySQL text query that holds several (`…; …`) or a compound
    /// statement (`BEGIN NOT ATOMIC … END`), in order; empty for one plain statement.
    parts: Vec<Statement>,
    /// A statement inside a compound statement: its `END` closes a block, never a
    /// transaction.
    in_compound: bool,
}

impl fmt::Debug for Statement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Statement")
            .field("kind", &self.kind)
            .field("text", &self.summary())
            .field("params", &String::from_utf8_lossy(&self.params))
            .finish()
    }
}

impl Statement {
    /// A statement with this SQL text and bound parameter bytes.
    pub fn new(text: impl Into<String>, params: Vec<u8>) -> Self {
        let text = text.into();
        let (kind, next_word) = {
            let mut words = keywords(&text);
            let kind = words.next().unwrap_or_default();
            let next = words.next().unwrap_or_default();
            if kind == "SET" && next == "STATEMENT" {
                // MariaDB's `SET STATEMENT var = value, … FOR <statement>`: the statement
                // after `FOR` is what runs.
                let mut words = words.skip_while(|w| w != "FOR").skip(1);
                let kind = words.next().unwrap_or_default();
                (kind, words.next().unwrap_or_default())
            } else if kind == "BEGIN" && next == "NOT" {
                // MariaDB's compound statement `BEGIN NOT ATOMIC <statement>; … END`: its
                // first statement is what runs first.
                let mut words = words.skip_while(|w| w != "ATOMIC").skip(1);
                let kind = words.next().unwrap_or_default();
                (kind, words.next().unwrap_or_default())
            } else {
                (kind, next)
            }
        };
        Self {
            kind,
            next_word,
            text,
            params,
            literals: Vec::new(),
            parts: Vec::new(),
            in_compound: false,
        }
    }

    /// A text query: PostgreSQL's simple `Query` or MySQL's `COM_QUERY`. It may hold
    /// several statements separated by `;` (a simple query may; mysql_async sets
    /// `CLIENT_MULTI_STATEMENTS`) or be a compound statement (MariaDB's `BEGIN NOT ATOMIC
    /// … END`): each is then one of its [`Statement::parts`]. Its values may travel in
    /// its text as hex literals (MySQL `_utf8mb4 X'6B2D31'`, PostgreSQL
    /// `decode('6b2d31', 'hex')`), whose bytes [`Statement::contains`] searches too.
    pub fn text_query(text: impl Into<String>) -> Self {
        let text = text.into();
        let mut statement = Self::new(text.clone(), Vec::new());
        statement.literals = hex_literals(&text);
        let compound = {
            let mut words = keywords(&text);
            words.next().as_deref() == Some("BEGIN")
                && words.next().as_deref() == Some("NOT")
                && words.next().as_deref() == Some("ATOMIC")
        };
        let pieces = split_statements(&text);
        if pieces.len() > 1 || compound {
            statement.parts = pieces
                .into_iter()
                .map(|piece| {
                    let mut part = Self::new(piece, Vec::new());
                    part.literals = hex_literals(piece);
                    part.in_compound = compound;
                    part
                })
                .collect();
        }
        statement
    }

    /// The statements this message runs, in order: itself, or each statement of a
    /// multi-statement or compound text query ([`Statement::text_query`]).
    pub fn parts(&self) -> impl Iterator<Item = &Statement> {
        let own = self.parts.is_empty().then_some(self);
        own.into_iter().chain(self.parts.iter())
    }

    /// The statement's first keyword, upper case (`COMMIT`, `INSERT`, `SET`); comments
    /// and leading punctuation are skipped, and so is MariaDB's `SET STATEMENT … FOR`
    /// prefix (the kind of `SET STATEMENT x = 1 FOR INSERT …` is `INSERT`). Empty when
    /// the text has no word.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The SQL text: the message's own, or the text of the prepared statement it
    /// executes.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The bound parameters' bytes as they travelled (PostgreSQL `Bind` after the
    /// names; MySQL `COM_STMT_EXECUTE` after its header, with any long data sent for
    /// it). Empty for a statement sent as text.
    pub fn params(&self) -> &[u8] {
        &self.params
    }

    /// Whether `needle` occurs in the text or in the parameter bytes.
    pub fn contains(&self, needle: &[u8]) -> bool {
        find(self.text.as_bytes(), needle)
            || find(&self.params, needle)
            || self.literals.iter().any(|l| find(l, needle))
    }

    /// Whether this statement starts or ends a transaction (`BEGIN`, `START
    /// TRANSACTION`, `COMMIT`, `END`, `ROLLBACK` but not `ROLLBACK TO SAVEPOINT`; inside
    /// a compound statement `BEGIN` and `END` delimit blocks, not transactions).
    pub fn is_transaction_boundary(&self) -> bool {
        match self.kind.as_str() {
            "BEGIN" | "END" if self.in_compound => false,
            "BEGIN" | "START" | "COMMIT" | "END" | "ABORT" => true,
            "ROLLBACK" => self.next_word != "TO",
            _ => false,
        }
    }

    /// The text on one line, at most 120 characters, for logs and reports.
    pub fn summary(&self) -> String {
        let flat: String = self.text.split_whitespace().collect::<Vec<_>>().join(" ");
        match flat.char_indices().nth(120) {
            Some((i, _)) => format!("{}…", &flat[..i]),
            None => flat,
        }
    }
}

/// The statements of a MySQL text query: split at each `;` outside quotes (`'…'`,
/// `"…"`, `` `…` ``, with backslash escapes) and comments, trimmed, empty ones left out.
fn split_statements(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let mut pieces = Vec::new();
    let (mut i, mut start) = (0, 0);
    while i < b.len() {
        match b[i] {
            q @ (b'\'' | b'"' | b'`') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' && q != b'`' { 2 } else { 1 };
                }
                i += 1;
            }
            b'/' if b[i..].starts_with(b"/*") => {
                i = b[i + 2..]
                    .windows(2)
                    .position(|w| w == b"*/")
                    .map_or(b.len(), |p| i + 2 + p + 2);
            }
            b'#' => {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p + 1);
            }
            b'-' if b[i..].starts_with(b"-- ") => {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p + 1);
            }
            b';' => {
                pieces.push(&text[start..i]);
                i += 1;
                start = i;
            }
            _ => i += 1,
        }
    }
    pieces.push(&text[start.min(text.len())..]);
    pieces
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

/// The bytes of every hex literal in a text: MySQL's `X'…'` (`x'…'`) and PostgreSQL's
/// `decode('…', 'hex')`; a literal with an odd number of digits or another character is
/// left out.
fn hex_literals(text: &str) -> Vec<Vec<u8>> {
    const DECODE: &[u8] = b"decode('";
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < b.len() {
        let mysql = (b[i] == b'X' || b[i] == b'x')
            && b[i + 1] == b'\''
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'));
        let postgres = b[i..]
            .get(..DECODE.len())
            .is_some_and(|w| w.eq_ignore_ascii_case(DECODE));
        if !mysql && !postgres {
            i += 1;
            continue;
        }
        if postgres {
            // Past `decode(`: the quote is where a MySQL literal's is.
            i += DECODE.len() - 2;
        }
        let digits = &b[i + 2..];
        let end = digits
            .iter()
            .position(|&c| c == b'\'')
            .unwrap_or(digits.len());
        let hex = &digits[..end];
        if hex.len().is_multiple_of(2) && hex.iter().all(u8::is_ascii_hexdigit) {
            out.push(
                hex.chunks(2)
                    .filter_map(|pair| {
                        std::str::from_utf8(pair)
                            .ok()
                            .and_then(|p| u8::from_str_radix(p, 16).ok())
                    })
                    .collect(),
            );
        }
        i += 2 + end + 1;
    }
    out
}

fn find(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// The words of a statement, upper case, skipping comments and anything that is not
/// an ASCII letter (so a MySQL query-attributes prefix or a `(` does not hide the
/// first keyword).
fn keywords(text: &str) -> impl Iterator<Item = String> + '_ {
    let b = text.as_bytes();
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < b.len() {
            if b[i..].starts_with(b"/*") {
                i = b[i + 2..]
                    .windows(2)
                    .position(|w| w == b"*/")
                    .map_or(b.len(), |p| i + 2 + p + 2);
            } else if b[i..].starts_with(b"--") || b[i] == b'#' {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p + 1);
            } else if b[i].is_ascii_alphabetic() {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                return Some(text[start..i].to_ascii_uppercase());
            } else {
                i += 1;
            }
        }
        None
    })
}

/// One whole message the client sent (a PostgreSQL message, a MySQL packet), or an
/// opaque chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientFrame {
    /// Its bytes, as they go to the server.
    pub bytes: Vec<u8>,
    /// The statement it runs: a simple `Query` or a `Bind` (PostgreSQL), `COM_QUERY`
    /// or `COM_STMT_EXECUTE` (MySQL). `None` for everything else (`Parse`, `Sync`,
    /// `COM_STMT_PREPARE`, the handshake).
    pub statement: Option<Statement>,
    /// The number of the reply that answers the request this frame belongs to
    /// (counted from 1 per connection; see [`ServerFrame::replies`]).
    pub answered_by: u64,
}

/// One whole message the server sent, or an opaque chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFrame {
    /// Its bytes, as they go to the client.
    pub bytes: Vec<u8>,
    /// Requests answered so far on this connection, this frame included: PostgreSQL
    /// counts `ReadyForQuery` messages (the request is done); MySQL counts the first
    /// packet of each reply (the server has run the command).
    pub replies: u64,
}

/// Both directions of one connection: framing, prepared statements, reply counts.
#[derive(Debug)]
pub struct Session {
    wire: Wire,
    opaque: bool,
    up: Vec<u8>,
    down: Vec<u8>,
    /// Requests sent that will be answered (PostgreSQL: `Sync` and `Query` messages;
    /// MySQL: commands with a reply).
    requests: u64,
    /// Requests answered.
    replies: u64,
    pg: PgState,
    my: MyState,
}

#[derive(Debug, Default)]
struct PgState {
    /// Typed messages start after the startup message.
    started: bool,
    /// The server answers `SSLRequest` / `GSSENCRequest` with one untyped byte.
    raw_byte_due: bool,
    /// Prepared statement name → SQL text (`""` is the unnamed statement).
    names: HashMap<Vec<u8>, String>,
}

#[derive(Debug, Default)]
struct MyState {
    /// The client sent its first command (seq 0): the handshake is over.
    commanding: bool,
    /// A command's payload split over several maximal packets.
    partial: Vec<u8>,
    /// Statement id → SQL text.
    statements: HashMap<u32, String>,
    /// Long data sent for a statement's next execution.
    long_data: HashMap<u32, Vec<u8>>,
    /// The text of a `COM_STMT_PREPARE` waiting for its id.
    preparing: Option<String>,
    /// The server's next packet with sequence 1 starts a reply.
    reply_due: bool,
    /// The server is inside a multi-packet payload.
    server_partial: bool,
}

const PG_SSL_REQUEST: u32 = 80_877_103;
const PG_GSSENC_REQUEST: u32 = 80_877_104;
const PG_PROTOCOL_3: u32 = 196_608;
const MY_MAX_PAYLOAD: usize = 0xff_ffff;

fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

fn le32(b: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(..4)?.try_into().ok()?))
}

/// A NUL-terminated string at the start of `b`: `(string, rest)`.
fn cstr(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = b.iter().position(|&c| c == 0)?;
    Some((&b[..end], &b[end + 1..]))
}

impl Session {
    /// A new connection's session.
    pub fn new(wire: Wire) -> Self {
        Self {
            wire,
            opaque: wire == Wire::Opaque,
            up: Vec::new(),
            down: Vec::new(),
            requests: 0,
            replies: 0,
            pg: PgState::default(),
            my: MyState::default(),
        }
    }

    /// Whether the session gave up following the protocol (TLS, say).
    pub fn is_opaque(&self) -> bool {
        self.opaque
    }

    /// Takes bytes the client sent; returns the whole frames they complete (an
    /// incomplete message waits for its remaining bytes).
    pub fn client(&mut self, bytes: &[u8]) -> Vec<ClientFrame> {
        if self.opaque {
            return vec![ClientFrame {
                bytes: bytes.to_vec(),
                statement: None,
                answered_by: self.requests + 1,
            }];
        }
        self.up.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            if self.opaque {
                // Whatever follows the switch (TLS) goes on as it came.
                if !self.up.is_empty() {
                    out.push(ClientFrame {
                        bytes: std::mem::take(&mut self.up),
                        statement: None,
                        answered_by: self.requests + 1,
                    });
                }
                return out;
            }
            let next = match self.wire {
                Wire::Postgres => self.pg_client(),
                Wire::Mysql => self.my_client(),
                Wire::Opaque => None,
            };
            match next {
                Some(frame) => out.push(frame),
                None => return out,
            }
        }
    }

    /// Takes bytes the server sent; returns the whole frames they complete.
    pub fn server(&mut self, bytes: &[u8]) -> Vec<ServerFrame> {
        if self.opaque {
            return vec![ServerFrame {
                bytes: bytes.to_vec(),
                replies: self.replies,
            }];
        }
        self.down.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            if self.opaque {
                if !self.down.is_empty() {
                    out.push(ServerFrame {
                        bytes: std::mem::take(&mut self.down),
                        replies: self.replies,
                    });
                }
                return out;
            }
            let next = match self.wire {
                Wire::Postgres => self.pg_server(),
                Wire::Mysql => self.my_server(),
                Wire::Opaque => None,
            };
            match next {
                Some(frame) => out.push(frame),
                None => return out,
            }
        }
    }

    // ------------------------------------------------------------ PostgreSQL

    fn pg_client(&mut self) -> Option<ClientFrame> {
        if !self.pg.started {
            // Untyped: Int32 length (itself included), Int32 code, body.
            let len = be32(&self.up)? as usize;
            if len < 8 {
                self.opaque = true;
                return None;
            }
            if self.up.len() < len {
                return None;
            }
            let bytes: Vec<u8> = self.up.drain(..len).collect();
            match be32(&bytes[4..]) {
                Some(PG_SSL_REQUEST | PG_GSSENC_REQUEST) => self.pg.raw_byte_due = true,
                Some(PG_PROTOCOL_3) => {
                    // Answered, once authenticated, by a ReadyForQuery.
                    self.pg.started = true;
                    self.requests += 1;
                }
                // A CancelRequest or an unknown version: nothing more to follow.
                _ => self.opaque = true,
            }
            let answered_by = if self.pg.started {
                self.requests
            } else {
                self.requests + 1
            };
            return Some(ClientFrame {
                bytes,
                statement: None,
                answered_by,
            });
        }
        // Typed: Byte1 type, Int32 length (itself included), body.
        let len = be32(self.up.get(1..)?)? as usize;
        if len < 4 {
            self.opaque = true;
            return None;
        }
        if self.up.len() < 1 + len {
            return None;
        }
        let bytes: Vec<u8> = self.up.drain(..1 + len).collect();
        let body = &bytes[5..];
        let mut statement = None;
        match bytes[0] {
            b'Q' => {
                let text = cstr(body).map_or(body, |(t, _)| t);
                statement = Some(Statement::text_query(
                    String::from_utf8_lossy(text).into_owned(),
                ));
                self.requests += 1;
            }
            b'P' => {
                if let Some((name, rest)) = cstr(body) {
                    let text = cstr(rest).map_or(rest, |(t, _)| t);
                    self.pg
                        .names
                        .insert(name.to_vec(), String::from_utf8_lossy(text).into_owned());
                }
            }
            b'B' => {
                if let Some((_portal, rest)) = cstr(body)
                    && let Some((name, params)) = cstr(rest)
                {
                    let text = self.pg.names.get(name).cloned().unwrap_or_default();
                    statement = Some(Statement::new(text, params.to_vec()));
                }
            }
            b'C' => {
                // Close: 'S' statement or 'P' portal, then the name.
                if body.first() == Some(&b'S')
                    && let Some((name, _)) = cstr(&body[1..])
                {
                    self.pg.names.remove(name);
                }
            }
            b'S' => self.requests += 1,
            _ => {}
        }
        // A Query is its own request; any other message belongs to the request its
        // next Sync ends.
        let answered_by = if bytes[0] == b'Q' || bytes[0] == b'S' {
            self.requests
        } else {
            self.requests + 1
        };
        Some(ClientFrame {
            bytes,
            statement,
            answered_by,
        })
    }

    fn pg_server(&mut self) -> Option<ServerFrame> {
        if self.pg.raw_byte_due {
            let byte = *self.down.first()?;
            self.down.drain(..1);
            self.pg.raw_byte_due = false;
            if byte != b'N' {
                // 'S' / 'G': TLS or GSSAPI encryption follows.
                self.opaque = true;
            }
            return Some(ServerFrame {
                bytes: vec![byte],
                replies: self.replies,
            });
        }
        let len = be32(self.down.get(1..)?)? as usize;
        if len < 4 {
            self.opaque = true;
            return None;
        }
        if self.down.len() < 1 + len {
            return None;
        }
        let bytes: Vec<u8> = self.down.drain(..1 + len).collect();
        if bytes[0] == b'Z' {
            self.replies += 1;
        }
        Some(ServerFrame {
            bytes,
            replies: self.replies,
        })
    }

    // ------------------------------------------------------------ MySQL

    /// One packet: 3-byte length, sequence, payload.
    fn my_packet(buf: &mut Vec<u8>) -> Option<(Vec<u8>, u8, usize)> {
        let head = buf.get(..4)?;
        let len = usize::from(head[0]) | usize::from(head[1]) << 8 | usize::from(head[2]) << 16;
        let seq = head[3];
        if buf.len() < 4 + len {
            return None;
        }
        Some((buf.drain(..4 + len).collect(), seq, len))
    }

    fn my_client(&mut self) -> Option<ClientFrame> {
        let (bytes, seq, len) = Self::my_packet(&mut self.up)?;
        let payload = &bytes[4..];
        if seq != 0 && self.my.partial.is_empty() {
            // The handshake (or an auth exchange): a 32-byte response is an SSL
            // request, after which TLS follows.
            if !self.my.commanding && len == 32 {
                self.opaque = true;
            }
            return Some(ClientFrame {
                bytes,
                statement: None,
                answered_by: self.requests + 1,
            });
        }
        self.my.commanding = true;
        self.my.partial.extend_from_slice(payload);
        if len == MY_MAX_PAYLOAD {
            // More of this command follows.
            return Some(ClientFrame {
                bytes,
                statement: None,
                answered_by: self.requests + 1,
            });
        }
        let command = std::mem::take(&mut self.my.partial);
        let mut statement = None;
        let mut replied = true;
        match command.first() {
            // COM_QUERY
            Some(0x03) => {
                statement = Some(Statement::text_query(
                    String::from_utf8_lossy(&command[1..]).into_owned(),
                ));
            }
            // COM_STMT_PREPARE
            Some(0x16) => {
                self.my.preparing = Some(String::from_utf8_lossy(&command[1..]).into_owned());
            }
            // COM_STMT_EXECUTE: id, flags, iteration count, then the parameters.
            Some(0x17) => {
                if let Some(id) = command.get(1..).and_then(le32) {
                    let text = self.my.statements.get(&id).cloned().unwrap_or_default();
                    let mut params = command.get(10..).unwrap_or_default().to_vec();
                    if let Some(long) = self.my.long_data.remove(&id) {
                        params.extend_from_slice(&long);
                    }
                    statement = Some(Statement::new(text, params));
                }
            }
            // COM_STMT_SEND_LONG_DATA: id, parameter, data (no reply).
            Some(0x18) => {
                if let Some(id) = command.get(1..).and_then(le32) {
                    self.my
                        .long_data
                        .entry(id)
                        .or_default()
                        .extend_from_slice(command.get(7..).unwrap_or_default());
                }
                replied = false;
            }
            // COM_STMT_CLOSE (no reply).
            Some(0x19) => {
                if let Some(id) = command.get(1..).and_then(le32) {
                    self.my.statements.remove(&id);
                    self.my.long_data.remove(&id);
                }
                replied = false;
            }
            // COM_STMT_RESET
            Some(0x1a) => {
                if let Some(id) = command.get(1..).and_then(le32) {
                    self.my.long_data.remove(&id);
                }
            }
            // COM_RESET_CONNECTION: the server forgets every prepared statement.
            Some(0x1f) => {
                self.my.statements.clear();
                self.my.long_data.clear();
            }
            // COM_QUIT (no reply).
            Some(0x01) => replied = false,
            _ => {}
        }
        if replied {
            self.requests += 1;
            self.my.reply_due = true;
        }
        Some(ClientFrame {
            bytes,
            statement,
            answered_by: if replied {
                self.requests
            } else {
                self.requests + 1
            },
        })
    }

    fn my_server(&mut self) -> Option<ServerFrame> {
        let (bytes, seq, len) = Self::my_packet(&mut self.down)?;
        let continued = self.my.server_partial;
        self.my.server_partial = len == MY_MAX_PAYLOAD;
        if !continued && seq == 1 && self.my.reply_due && self.replies < self.requests {
            self.replies += 1;
            self.my.reply_due = self.replies < self.requests;
            if let Some(text) = self.my.preparing.take() {
                // COM_STMT_PREPARE_OK: 0x00, statement id, …; an error prepares nothing.
                if bytes.get(4) == Some(&0x00)
                    && let Some(id) = bytes.get(5..).and_then(le32)
                {
                    self.my.statements.insert(id, text);
                }
            }
        }
        Some(ServerFrame {
            bytes,
            replies: self.replies,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn pg_msg(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn pg_startup() -> Vec<u8> {
        let mut body = PG_PROTOCOL_3.to_be_bytes().to_vec();
        body.extend_from_slice(b"user\0postgres\0\0");
        let mut m = u32::try_from(body.len() + 4)
            .unwrap()
            .to_be_bytes()
            .to_vec();
        m.extend_from_slice(&body);
        m
    }

    fn my_packet(seq: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut p = vec![
            (len & 0xff) as u8,
            ((len >> 8) & 0xff) as u8,
            ((len >> 16) & 0xff) as u8,
            seq,
        ];
        p.extend_from_slice(payload);
        p
    }

    #[test]
    fn keywords_skip_comments_and_punctuation() {
        let s = Statement::new("  /* x */ -- y\n (commit)", vec![]);
        assert_eq!(s.kind(), "COMMIT");
        assert!(s.is_transaction_boundary());
        let s = Statement::new("ROLLBACK TO SAVEPOINT idem_claimed", vec![]);
        assert_eq!(s.kind(), "ROLLBACK");
        assert!(!s.is_transaction_boundary());
        let s = Statement::new("SET TRANSACTION ISOLATION LEVEL READ COMMITTED", vec![]);
        assert_eq!(s.kind(), "SET");
        assert!(!s.is_transaction_boundary());
        // A MySQL query-attributes prefix (parameter count 0, one set).
        let s = Statement::new("\u{0}\u{1}START TRANSACTION", vec![]);
        assert_eq!(s.kind(), "START");
        assert_eq!(Statement::new("", vec![]).kind(), "");
        let s = Statement::new(
            "SET STATEMENT innodb_lock_wait_timeout = 1 FOR INSERT INTO t VALUES (?)",
            vec![],
        );
        assert_eq!(s.kind(), "INSERT");
        let s = Statement::new("SET STATEMENT max_statement_time = 2 FOR", vec![]);
        assert_eq!(s.kind(), "");
    }

    #[test]
    fn postgres_names_are_remembered_and_split_messages_wait() {
        let mut s = Session::new(Wire::Postgres);
        let startup = pg_startup();
        let frames = s.client(&startup);
        assert_eq!(frames.len(), 1);
        assert!(frames[0].statement.is_none());
        assert_eq!(frames[0].answered_by, 1);
        // Authentication ends with the startup's ReadyForQuery.
        let mut auth = pg_msg(b'R', &[0, 0, 0, 0]);
        auth.extend(pg_msg(b'Z', b"I"));
        assert_eq!(s.server(&auth).last().unwrap().replies, 1);
        // Parse under a name, Describe, Sync: no statement runs.
        let mut prepare = pg_msg(b'P', b"s1\0INSERT INTO t VALUES ($1)\0\0\0");
        prepare.extend(pg_msg(b'D', b"Ss1\0"));
        prepare.extend(pg_msg(b'S', b""));
        let frames = s.client(&prepare);
        assert_eq!(frames.len(), 3);
        assert!(frames.iter().all(|f| f.statement.is_none()));
        assert_eq!(frames[2].answered_by, 2);
        // Bind by name with a parameter, Execute, Sync, fed one byte at a time.
        let mut run = pg_msg(b'B', b"\0s1\0\0\x01\0\x01\0\0\0\x05key-7\0\x01\0\x01");
        run.extend(pg_msg(b'E', b"\0\0\0\0\0"));
        run.extend(pg_msg(b'S', b""));
        let mut frames = Vec::new();
        for b in &run {
            frames.extend(s.client(std::slice::from_ref(b)));
        }
        assert_eq!(frames.len(), 3);
        let st = frames[0].statement.as_ref().unwrap();
        assert_eq!(st.kind(), "INSERT");
        assert!(st.contains(b"key-7"));
        assert!(st.contains(b"INTO t"));
        assert_eq!(frames[0].answered_by, 3);
        // Replies: ParseComplete … ReadyForQuery, twice.
        let mut down = pg_msg(b'1', b"");
        down.extend(pg_msg(b'Z', b"I"));
        down.extend(pg_msg(b'2', b""));
        let frames = s.server(&down);
        assert_eq!(
            frames.iter().map(|f| f.replies).collect::<Vec<_>>(),
            [1, 2, 2]
        );
        let frames = s.server(&pg_msg(b'Z', b"T"));
        assert_eq!(frames[0].replies, 3);
    }

    #[test]
    fn postgres_tls_turns_the_session_opaque() {
        let mut s = Session::new(Wire::Postgres);
        let mut ssl = 8_u32.to_be_bytes().to_vec();
        ssl.extend_from_slice(&PG_SSL_REQUEST.to_be_bytes());
        assert_eq!(s.client(&ssl).len(), 1);
        let frames = s.server(b"S\x16\x03");
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].bytes, b"S");
        assert!(s.is_opaque());
        let frames = s.client(b"\x16\x03\x01anything");
        assert_eq!(frames.len(), 1);
        assert!(frames[0].statement.is_none());
        // Refused: plain startup follows.
        let mut s = Session::new(Wire::Postgres);
        s.client(&ssl);
        assert_eq!(s.server(b"N").len(), 1);
        assert!(!s.is_opaque());
        let frames = s.client(&pg_startup());
        assert_eq!(frames.len(), 1);
        let frames = s.client(&pg_msg(b'Q', b"COMMIT\0"));
        assert_eq!(frames[0].statement.as_ref().unwrap().kind(), "COMMIT");
    }

    #[test]
    fn mysql_statement_ids_come_from_the_server() {
        let mut s = Session::new(Wire::Mysql);
        // Greeting (seq 0), handshake response (seq 1), OK (seq 2).
        assert_eq!(s.server(&my_packet(0, &[10; 60])).len(), 1);
        assert_eq!(s.client(&my_packet(1, &[1; 64])).len(), 1);
        assert_eq!(
            s.server(&my_packet(2, &[0, 0, 0, 2, 0, 0, 0]))[0].replies,
            0
        );
        // Prepare; the server answers id 7.
        let f = s.client(&my_packet(0, b"\x16UPDATE t SET a = ? WHERE k = ?"));
        assert!(f[0].statement.is_none());
        assert_eq!(f[0].answered_by, 1);
        let mut ok = vec![0x00];
        ok.extend_from_slice(&7_u32.to_le_bytes());
        ok.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0]);
        let frames = s.server(&my_packet(1, &ok));
        assert_eq!(frames[0].replies, 1);
        // Parameter definitions follow with later sequence numbers: not a new reply.
        assert_eq!(
            s.server(&my_packet(2, &[3, b'd', b'e', b'f']))[0].replies,
            1
        );
        // Execute id 7 with a string parameter.
        let mut exec = vec![0x17];
        exec.extend_from_slice(&7_u32.to_le_bytes());
        exec.extend_from_slice(&[0, 1, 0, 0, 0, 0, 1, 0xfe, 0, 0xfe, 0, 1, b'x', 5]);
        exec.extend_from_slice(b"key-9");
        let frames = s.client(&my_packet(0, &exec));
        let st = frames[0].statement.as_ref().unwrap();
        assert_eq!(st.kind(), "UPDATE");
        assert!(st.contains(b"key-9"));
        assert_eq!(frames[0].answered_by, 2);
        // COM_STMT_CLOSE has no reply; the next query is answered by reply 3.
        let mut close = vec![0x19];
        close.extend_from_slice(&7_u32.to_le_bytes());
        let mut both = my_packet(0, &close);
        both.extend(my_packet(0, b"\x03COMMIT"));
        let frames = s.client(&both);
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1].statement.as_ref().unwrap().kind(), "COMMIT");
        assert_eq!(frames[1].answered_by, 3);
        assert_eq!(
            s.server(&my_packet(1, &[0, 0, 0, 2, 0, 0, 0]))[0].replies,
            2
        );
        assert_eq!(
            s.server(&my_packet(1, &[0, 0, 0, 0, 0, 0, 0]))[0].replies,
            3
        );
    }

    #[test]
    fn mysql_ssl_request_turns_the_session_opaque() {
        let mut s = Session::new(Wire::Mysql);
        s.server(&my_packet(0, &[10; 60]));
        let frames = s.client(&my_packet(1, &[0; 32]));
        assert_eq!(frames.len(), 1);
        assert!(s.is_opaque());
    }
}
