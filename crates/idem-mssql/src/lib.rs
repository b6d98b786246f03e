//! SQL Server backend for idem (work in progress).
