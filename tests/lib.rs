//! Test targets only: `cargo test -p idem-tests --test <engine>`.
