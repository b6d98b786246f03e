//! Test targets only: `cargo test -p idem-tests --test <engine>`.

/// The repository README's Rust examples, run as this crate's doctests
/// (`cargo test -p idem-tests --all-features --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;
