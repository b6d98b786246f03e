-- idem 0005: the claim-time indexes go.
--
-- 0001 indexed created_at and processed_at for the purge; since 0002 the purge finds
-- expired records by expires_at (its own index) and only filters on the claim time, and
-- no other statement reads by it. Each new record wrote a B-tree it never used.
DROP INDEX IF EXISTS idem_request_result_created_at;
DROP INDEX IF EXISTS idem_processed_message_processed_at;
