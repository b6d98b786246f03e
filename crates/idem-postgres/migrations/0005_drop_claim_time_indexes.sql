-- idem 0005: the claim-time indexes go.
--
-- 0001 indexed created_at and processed_at for the purge; since 0002 the purge finds
-- expired records by expires_at (its own index) and only filters on the claim time, and
-- no other statement reads by it. Each new record paid for a B-tree it never used: about
-- 14% of a debit-and-record transaction's WAL on PostgreSQL 15 (docs/performance.md).
-- One index per statement: Citus propagates a DROP INDEX on a table it manages.
DROP INDEX IF EXISTS idem_request_result_created_at;
DROP INDEX IF EXISTS idem_processed_message_processed_at;
