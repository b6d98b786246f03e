//! `docs/engines.md`, generated from `idem check` reports.
