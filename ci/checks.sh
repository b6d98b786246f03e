#!/usr/bin/env bash
# The static checks, which need no server and build nothing the tests use: clippy with
# warnings denied, the documentation (warnings denied), the feature combinations
# (ci/features.sh), the minimum Rust versions (ci/msrv.sh) and the packages (ci/package.sh).
# ci/test.sh runs this beside its build and tests, at the lowest CPU and I/O priority and
# in a target directory of its own (target/checks: cargo locks a target directory per
# build, so sharing the tests' would make them wait); it fails the run when this fails.
# Runnable alone: ci/checks.sh (CARGO_TARGET_DIR chooses where it builds).
set -euo pipefail
cd "$(dirname "$0")/.."

steps=()
step() {
  steps+=("$SECONDS $*")
  printf '\n--> [%ss] %s\n' "$SECONDS" "$*"
}
summary() {
  local i start next
  printf '\n--> static check durations (s)\n'
  for ((i = 0; i < ${#steps[@]}; i++)); do
    start=${steps[i]%% *}
    if ((i + 1 < ${#steps[@]})); then next=${steps[i + 1]%% *}; else next=$SECONDS; fi
    printf '%6s  %s\n' "$((next - start))" "${steps[i]#* }"
  done
  printf '%6s  total\n' "$SECONDS"
}
trap summary EXIT

step "the minimum Rust versions' toolchains, installed when missing (ci/msrv.sh install: a download, done while the tests' build has the CPU)"
ci/msrv.sh install

step "clippy (warnings denied)"
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings

step "documentation (warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --locked

step "feature combinations: the facade with each engine and integration alone, the CLI lean and per engine (ci/features.sh)"
ci/features.sh

step "minimum Rust versions: 1.88, and 1.94 for PostgreSQL (ci/msrv.sh)"
ci/msrv.sh

step "packages: cargo package and publish --dry-run of every crate, the packaged facade built alone (ci/package.sh)"
ci/package.sh
