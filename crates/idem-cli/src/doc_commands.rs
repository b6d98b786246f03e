//! No document shows a command the CLI refuses: every `idem …` command line in README.md
//! and docs/*.md, in shell code blocks and in inline code, parses with [`Cli`].
//!
//! What counts as a command:
//! - in a shell code block (```` ```sh ````, `bash`, `shell`, `console` or no language):
//!   each simple command (split at `&&`, `||`, `;`, `|`, `&`) whose program is `idem`,
//!   `$idem` or `cargo run … -p idem-cli … --`, after `NAME=value` prefixes, with
//!   backslash continuations joined and `#` comments and redirections removed;
//! - in inline code: a span that starts with `idem ` or `cargo run -p idem-cli`.
//!
//! A synopsis is expanded before parsing: `[optional]` groups are all left out, then all
//! put in; `(a | b)` and `x\|y` alternatives are taken one at a time; a lone `…` stands
//! for options shown elsewhere and is dropped. A span whose first word after `idem` ends
//! with `:` is output (`idem check: sqlite at …`), not a command.
//!
//! The documents are read from the repository, so this test runs in the workspace.

use std::path::{Path, PathBuf};

use clap::Parser;
use clap::error::ErrorKind;

use crate::Cli;

/// Where a command was found, for the failure message.
#[derive(Debug)]
struct Found {
    file: String,
    line: usize,
    text: String,
}

/// README.md and every docs/*.md of the repository.
fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![root.join("README.md")];
    let docs = std::fs::read_dir(root.join("docs"))
        .unwrap_or_else(|e| panic!("the repository's docs/ directory cannot be read: {e}"));
    let mut md: Vec<PathBuf> = docs
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    md.sort();
    files.extend(md);
    files
}

/// Every command in one Markdown text.
fn commands_in(file: &str, text: &str) -> Vec<Found> {
    let mut found = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut prose = String::new();
    let mut prose_lines: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(fence) = ["```", "~~~"].iter().find(|f| trimmed.starts_with(**f)) {
            let lang = trimmed
                .trim_start_matches(['`', '~'])
                .trim()
                .to_ascii_lowercase();
            let shell = matches!(lang.as_str(), "" | "sh" | "bash" | "shell" | "console");
            i += 1;
            let mut joined = String::new();
            let mut start = i;
            while i < lines.len() && !lines[i].trim_start().starts_with(fence) {
                if shell {
                    if joined.is_empty() {
                        start = i;
                    }
                    let l = lines[i];
                    if let Some(head) = l.strip_suffix('\\') {
                        joined.push_str(head);
                        joined.push(' ');
                    } else {
                        joined.push_str(l);
                        for text in shell_commands(&joined) {
                            found.push(Found {
                                file: file.to_owned(),
                                line: start + 1,
                                text,
                            });
                        }
                        joined.clear();
                    }
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        prose.push_str(line);
        prose.push('\n');
        prose_lines.push(i);
        i += 1;
    }
    for (offset, span) in inline_code(&prose) {
        let span = span.split_whitespace().collect::<Vec<_>>().join(" ");
        let is_command = span.starts_with("idem ") || span.starts_with("cargo run -p idem-cli");
        if is_command {
            let line_no = prose[..offset].matches('\n').count();
            found.push(Found {
                file: file.to_owned(),
                line: prose_lines.get(line_no).map_or(0, |l| l + 1),
                text: span.replace("\\|", "|"),
            });
        }
    }
    found
}

/// The inline code spans of prose, with their byte offsets.
fn inline_code(prose: &str) -> Vec<(usize, String)> {
    let bytes = prose.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|b| **b == b'`').count();
        let open = i + run;
        let fence = "`".repeat(run);
        let mut search = open;
        let mut close = None;
        while let Some(at) = prose[search..].find(&fence) {
            let at = search + at;
            let len = bytes[at..].iter().take_while(|b| **b == b'`').count();
            if len == run {
                close = Some(at);
                break;
            }
            search = at + len;
        }
        match close {
            Some(at) => {
                spans.push((i, prose[open..at].trim().to_owned()));
                i = at + run;
            }
            None => i = open,
        }
    }
    spans
}

/// Shell words of one line: quotes removed, a `#` word starting a comment.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    word.push(q);
                }
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.next() {
                    word.push(n);
                }
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            ';' | '&' | '|' | '(' | ')' => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
                let mut op = c.to_string();
                if (c == '&' || c == '|') && chars.peek() == Some(&c) {
                    chars.next();
                    op.push(c);
                }
                out.push(op);
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// The `idem` commands of one shell line, as text.
fn shell_commands(line: &str) -> Vec<String> {
    let line = line.trim_start().trim_start_matches("$ ");
    let mut commands = Vec::new();
    let mut simple: Vec<String> = Vec::new();
    let mut all = words(line);
    all.push(";".into());
    for w in all {
        if matches!(w.as_str(), ";" | "&" | "|" | "&&" | "||" | "(" | ")") {
            if let Some(args) = idem_args(&simple) {
                commands.push(format!("idem {}", args.join(" ")));
            }
            simple.clear();
        } else {
            simple.push(w);
        }
    }
    commands
}

/// The arguments `idem` gets from a simple command, if it runs `idem`.
fn idem_args(simple: &[String]) -> Option<Vec<String>> {
    let mut rest = simple
        .iter()
        .skip_while(|w| w.contains('=') && !w.starts_with('-'))
        .peekable();
    let program = rest.next()?;
    let mut args: Vec<String> = Vec::new();
    let mut skip_target = false;
    let mut collect = |w: &String, args: &mut Vec<String>| {
        if skip_target {
            skip_target = false;
        } else if w.starts_with('>') || w.starts_with("2>") || w.starts_with('<') {
            // A redirection; `>` alone takes the next word as its target.
            skip_target = matches!(w.as_str(), ">" | ">>" | "2>" | "<");
        } else {
            args.push(w.clone());
        }
    };
    match program.as_str() {
        "idem" | "$idem" | "${idem}" => {
            for w in rest {
                collect(w, &mut args);
            }
            Some(args)
        }
        "cargo" => {
            let words: Vec<&String> = rest.collect();
            let runs_cli = words.first().is_some_and(|w| *w == "run")
                && words.windows(2).any(|p| p[0] == "-p" && p[1] == "idem-cli");
            if !runs_cli {
                return None;
            }
            let after = words.iter().position(|w| *w == "--")?;
            for w in &words[after + 1..] {
                collect(w, &mut args);
            }
            Some(args)
        }
        _ => None,
    }
}

/// A synopsis's parts: words, `[optional]` groups and `(a | b)` alternatives.
#[derive(Debug, Clone)]
enum Part {
    Word(String),
    Optional(Vec<Part>),
    Choice(Vec<Vec<Part>>),
}

/// Parses a synopsis into parts (unbalanced brackets are kept as words).
fn synopsis(text: &str) -> Vec<Part> {
    fn seq(tokens: &[String], i: &mut usize, until: Option<&str>) -> Vec<Vec<Part>> {
        let mut alternatives: Vec<Vec<Part>> = Vec::new();
        let mut current: Vec<Part> = Vec::new();
        while *i < tokens.len() {
            let t = tokens[*i].as_str();
            *i += 1;
            match t {
                "[" => {
                    let mut inner = seq(tokens, i, Some("]"));
                    current.push(if inner.len() == 1 {
                        Part::Optional(inner.remove(0))
                    } else {
                        Part::Optional(vec![Part::Choice(inner)])
                    });
                }
                "(" => current.push(Part::Choice(seq(tokens, i, Some(")")))),
                "|" => alternatives.push(std::mem::take(&mut current)),
                t if Some(t) == until => break,
                t if t.contains('|') => current.push(Part::Choice(
                    t.split('|')
                        .map(|w| vec![Part::Word(w.to_owned())])
                        .collect(),
                )),
                t => current.push(Part::Word(t.to_owned())),
            }
        }
        alternatives.push(current);
        alternatives
    }
    let spaced = text
        .replace('[', " [ ")
        .replace(']', " ] ")
        .replace('(', " ( ")
        .replace(')', " ) ");
    let tokens: Vec<String> = spaced.split_whitespace().map(str::to_owned).collect();
    let mut i = 0;
    let mut alternatives = seq(&tokens, &mut i, None);
    if alternatives.len() == 1 {
        alternatives.remove(0)
    } else {
        vec![Part::Choice(alternatives)]
    }
}

/// The argument lists a synopsis stands for: optional groups all out, then all in, each
/// alternative once.
fn expansions(parts: &[Part]) -> Vec<Vec<String>> {
    fn expand(parts: &[Part], optional_in: bool) -> Vec<Vec<String>> {
        let mut out = vec![Vec::new()];
        for part in parts {
            let options: Vec<Vec<String>> = match part {
                Part::Word(w) if w == "…" || w == "..." => vec![Vec::new()],
                Part::Word(w) => vec![vec![w.clone()]],
                Part::Optional(inner) if optional_in => expand(inner, optional_in),
                Part::Optional(_) => vec![Vec::new()],
                Part::Choice(alternatives) => alternatives
                    .iter()
                    .flat_map(|a| expand(a, optional_in))
                    .collect(),
            };
            out = out
                .iter()
                .flat_map(|head| {
                    options.iter().map(move |tail| {
                        let mut v = head.clone();
                        v.extend(tail.iter().cloned());
                        v
                    })
                })
                .collect();
        }
        out
    }
    let mut all = expand(parts, false);
    for v in expand(parts, true) {
        if !all.contains(&v) {
            all.push(v);
        }
    }
    all
}

/// Why `args` does not parse, if it does not (help and version requests parse). Command
/// words alone name a command, which must exist.
fn refused(args: &[String]) -> Option<String> {
    let names_a_command = args.iter().all(|a| {
        !a.is_empty()
            && a.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            && !a.starts_with('-')
    });
    let mut args = args.to_vec();
    if names_a_command {
        args.push("--help".into());
    }
    match Cli::try_parse_from(&args) {
        Ok(_) => None,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => None,
        Err(e) => Some(e.render().to_string()),
    }
}

/// The argument lists of one found command; none for output lines.
fn argument_lists(text: &str) -> Vec<Vec<String>> {
    let text = match text.strip_prefix("cargo run -p idem-cli") {
        Some(rest) => match rest.split_once(" -- ") {
            Some((_, args)) => format!("idem {args}"),
            None => "idem".to_owned(),
        },
        None => text.to_owned(),
    };
    let first = text.split_whitespace().nth(1).unwrap_or_default();
    if first.ends_with(':') {
        return Vec::new();
    }
    expansions(&synopsis(&text))
}

#[test]
fn every_documented_command_parses() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for path in documents() {
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = if name == "README.md" {
            name
        } else {
            format!("docs/{name}")
        };
        for found in commands_in(&name, &text) {
            for args in argument_lists(&found.text) {
                checked += 1;
                if let Some(why) = refused(&args) {
                    failures.push(format!(
                        "{}:{}: `{}`\n  parsed as {:?}\n  {}",
                        found.file,
                        found.line,
                        found.text,
                        args,
                        why.trim().replace('\n', "\n  ")
                    ));
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} documented commands found");
    assert!(
        failures.is_empty(),
        "{} documented command(s) that `idem` refuses:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn the_extraction_finds_what_a_reader_would_run() {
    let md = "Run `idem purge --older-than 24h`, not `idem_demo_account` or `idem.db`.\n\
              Output `idem check: sqlite at x` is not a command.\n\
              ```sh\n\
              IDEM_URL=sqlite://a.db idem migrate && idem demo \\\n  debit --key k # comment\n\
              (cd d && \"$idem\" demo) >/dev/null\n\
              cargo run -p idem-cli --features postgres -- --url x migrate\n\
              ```\n\
              ```rust\nidem migrate\n```\n";
    let found: Vec<String> = commands_in("t.md", md)
        .into_iter()
        .map(|f| f.text)
        .collect();
    assert_eq!(
        found,
        [
            "idem migrate",
            "idem demo debit --key k",
            "idem demo",
            "idem --url x migrate",
            "idem purge --older-than 24h",
            "idem check: sqlite at x",
        ]
    );
    assert!(argument_lists("idem check: sqlite at x").is_empty());
    let lists = argument_lists("idem relay (--amqp URL [--exchange X] | --nats URL) [--once]");
    assert_eq!(
        lists,
        [
            vec!["idem", "relay", "--amqp", "URL"],
            vec!["idem", "relay", "--nats", "URL"],
            vec![
                "idem",
                "relay",
                "--amqp",
                "URL",
                "--exchange",
                "X",
                "--once"
            ],
            vec!["idem", "relay", "--nats", "URL", "--once"],
        ]
    );
    let lists = argument_lists("idem bench [--pool idem|lean] … [--json r.json]");
    assert_eq!(lists.len(), 3, "{lists:?}");
    // What the CLI refuses is caught.
    assert!(refused(&argument_lists("idem purge --older-than 0s")[0]).is_some());
    assert!(refused(&argument_lists("idem debit --key k")[0]).is_some());
    assert!(refused(&argument_lists("idem debit")[0]).is_some());
    assert!(refused(&argument_lists("idem demo debit")[0]).is_none());
    assert!(refused(&argument_lists("idem purge --batch")[0]).is_some());
    assert!(
        refused(&argument_lists("idem demo debit --account 1 --key k --amount 5")[0]).is_none()
    );
}
