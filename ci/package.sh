#!/usr/bin/env bash
# The crates as a registry would ship them:
#  1. `cargo package` of every publishable crate, in dependency order; cargo verifies each
#     one by building it from its own package, with the packages of its idem siblings
#     served from a local registry (none is on crates.io yet), so no --no-verify is needed;
#  2. `cargo publish --dry-run` of the same set (nothing is uploaded; --no-verify, as step 1
#     has just built these very packages);
#  3. a registry user's program: the facade's README example, built and run against the
#     unpacked .crate files alone (a [patch.crates-io] per package), with the feature that
#     program uses (sqlite); step 1 has built every other package from its own contents.
# Run by ci/test.sh; runnable alone: ci/package.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
target=${CARGO_TARGET_DIR:-$root/target}

step() { printf -- '-- %s\n' "$*"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Cargo keeps what it builds from a registry by name and version, not by contents: the
# packages it verifies against (0.1.0 again at every run, its siblings served from a local
# registry) would be taken from an earlier run, both as sources unpacked in
# CARGO_HOME/registry/src and as compiled units in the target directory. So this script
# has a CARGO_HOME and a target directory of its own (sharing the real index and
# downloads), and removes every idem unit from them before each run; the crates.io
# dependencies stay built between runs.
home=${CARGO_HOME:-$HOME/.cargo}
export CARGO_HOME="$target/package-cargo-home"
mkdir -p "$CARGO_HOME/registry/src"
for shared in index cache; do
  mkdir -p "$home/registry/$shared"
  ln -sfn "$home/registry/$shared" "$CARGO_HOME/registry/$shared"
done
for config in config.toml config; do
  if [ -f "$home/$config" ]; then cp "$home/$config" "$CARGO_HOME/"; fi
done
build="$target/package-build"
# These builds prove that each package compiles from its own contents; debug information
# would only slow them down (the verification builds take the dev profile's default, full
# debug information, as they ignore the workspace's profile).
export CARGO_PROFILE_DEV_DEBUG=false
rm -rf "$CARGO_HOME"/registry/src/-* "$build/package" \
  "$build"/debug/.fingerprint/idem-* "$build"/debug/deps/*idem_* "$build"/debug/build/idem-*

step "cargo package (every publishable crate, verified, in dependency order)"
CARGO_TARGET_DIR="$build" cargo package --locked --workspace --exclude idem-tests --exclude idem-examples
crates=("$build"/package/*.crate)

step "cargo publish --dry-run (same set; nothing is uploaded; verified by the step above)"
CARGO_TARGET_DIR="$build" cargo publish --dry-run --no-verify --locked --workspace --exclude idem-tests --exclude idem-examples

step "a registry user's program against the unpacked packages alone"
mkdir -p "$work/unpacked" "$work/user/src"
patches=""
for crate in "${crates[@]}"; do
  tar -xzf "$crate" -C "$work/unpacked"
  dir=$(basename "$crate" .crate)
  name=${dir%-*}
  # The program's graph: the facade with SQLite (every idem package in it must come from here).
  case $name in idem-core | idem-sqlite | idem-db) ;; *) continue ;; esac
  patches+="$name = { path = \"../unpacked/$dir\" }"$'\n'
done
facade=$(ls -d "$work"/unpacked/idem-db-*)
# The program: the first Rust example of the packaged facade's README, as shipped.
awk '/^```rust/{on=1; next} /^```/{if(on){exit}} on' "$facade/README.md" > "$work/user/src/main.rs"
grep -q "fn main" "$work/user/src/main.rs"
cat > "$work/user/Cargo.toml" <<TOML
[package]
name = "idem-registry-user"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
idem-db = { version = "0.1.0", features = ["sqlite"] }
serde_json = "1"
thiserror = "2"
tokio = { version = "1", features = ["macros", "rt-multi-thread"] }

[patch.crates-io]
$patches
[workspace]

[profile.dev]
debug = "line-tables-only"

[profile.dev.package."*"]
debug = false
TOML
# The same dependency versions as the workspace (the lockfile is adjusted, not upgraded).
cp Cargo.lock "$work/user/Cargo.lock"
# Built where the verification built its dependencies: the crates.io ones are reused, every
# idem package is built again from the unpacked files (a path of its own).
(cd "$work/user" && CARGO_TARGET_DIR="$build" cargo run --quiet --offline)
# Nothing of the workspace was used: every idem package came from the unpacked files.
elsewhere=$(cd "$work/user" && cargo tree --offline --prefix none -e normal |
  grep '^idem-' | grep -v '^idem-registry-user ' | grep -v "$work/unpacked" || true)
if [ -n "$elsewhere" ]; then
  echo "idem packages not taken from the unpacked .crate files:" >&2
  echo "$elsewhere" >&2
  exit 1
fi
echo "the packaged facade builds and runs from its package contents alone"
