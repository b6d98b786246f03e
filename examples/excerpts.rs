//! The Rust code of the README and the docs is cut from these examples, which CI builds
//! and runs (ci/examples.sh), so it cannot rot apart from them:
//!
//! - the first program of README.md, and of the facade's own README (crates/idem), is
//!   `debit_sqlite.rs`, whole;
//! - every `rust,ignore` block of the pages below is a verbatim excerpt of one of the
//!   examples that page links to (only its indentation may be shifted as a whole).

use std::fs;
use std::path::{Path, PathBuf};

/// Each page and the examples its excerpts come from.
const PAGES: &[(&str, &[&str])] = &[
    (
        "README.md",
        &["debit_postgres.rs", "debit_mysql.rs", "axum_service.rs"],
    ),
    (
        "docs/consumers.md",
        &["consumer_rabbitmq.rs", "consumer_nats.rs"],
    ),
    ("docs/http.md", &["axum_service.rs"]),
    ("docs/external-effects.md", &["phased_outbox.rs"]),
];

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fenced code blocks of a Markdown page: (info string, code, line of the fence).
fn blocks(page: &str) -> Vec<(String, String, usize)> {
    let mut found = Vec::new();
    let mut open: Option<(String, Vec<&str>, usize)> = None;
    for (n, line) in page.lines().enumerate() {
        match (open.take(), line.strip_prefix("```")) {
            (None, Some(info)) => open = Some((info.trim().to_owned(), Vec::new(), n + 1)),
            (Some((info, code, at)), Some(_)) => found.push((info, code.join("\n") + "\n", at)),
            (Some((info, mut code, at)), None) => {
                code.push(line);
                open = Some((info, code, at));
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "a code block is not closed");
    found
}

#[test]
fn the_first_program_of_each_readme_is_the_sqlite_example() {
    let example = read(&repository().join("examples/debit_sqlite.rs"));
    for readme in ["README.md", "crates/idem/README.md"] {
        let page = read(&repository().join(readme));
        let first = blocks(&page)
            .into_iter()
            .find(|(info, _, _)| info.starts_with("rust"))
            .unwrap_or_else(|| panic!("{readme} has no Rust block"));
        assert_eq!(
            (first.0.as_str(), first.1.as_str()),
            ("rust", example.as_str()),
            "the first Rust block of {readme} (line {}) must be examples/debit_sqlite.rs",
            first.2
        );
    }
}

/// The lines without their common indentation.
fn dedent<'a>(lines: &[&'a str]) -> Vec<&'a str> {
    let indent = lines
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    lines
        .iter()
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect()
}

/// Whether `excerpt` is a run of lines of `example`, indentation shifted as a whole.
fn contains(example: &str, excerpt: &str) -> bool {
    let wanted = dedent(&excerpt.lines().collect::<Vec<_>>());
    let lines: Vec<&str> = example.lines().collect();
    !wanted.is_empty()
        && lines
            .windows(wanted.len())
            .any(|window| dedent(window) == wanted)
}

#[test]
fn excerpts_are_matched_line_for_line() {
    let example = "fn f() {\n    let a = 1;\n    if a > 0 {\n        g(a);\n    }\n}\n";
    assert!(contains(example, "let a = 1;\nif a > 0 {\n    g(a);\n}\n"));
    assert!(!contains(example, "let a = 1;\nif a > 0 {\ng(a);\n}\n"));
    assert!(!contains(example, "let a = 2;\n"));
}

#[test]
fn every_excerpt_is_still_in_its_example() {
    for (page, sources) in PAGES {
        let text = read(&repository().join(page));
        let examples: Vec<String> = sources
            .iter()
            .map(|name| read(&repository().join("examples").join(name)))
            .collect();
        let excerpts: Vec<_> = blocks(&text)
            .into_iter()
            .filter(|(info, _, _)| info == "rust,ignore")
            .collect();
        assert!(!excerpts.is_empty(), "{page} has no excerpt of {sources:?}");
        for (_, code, line) in excerpts {
            assert!(
                examples.iter().any(|example| contains(example, &code)),
                "the block at {page}:{line} is not in {sources:?} any more: copy it again from \
                 the example, or change the example"
            );
        }
    }
}
