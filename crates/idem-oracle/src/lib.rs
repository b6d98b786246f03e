//! Oracle backend for idem (work in progress).
