//! MySQL and MariaDB backend for idem (work in progress).
