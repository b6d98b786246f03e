-- idem 0005: the claim-time indexes go.
--
-- 0001 indexed created_at and processed_at for the purge; since 0002 the purge finds
-- expired records by expires_at (its own index) and only filters on the claim time, and
-- no other statement reads by it. Each new record wrote a B-tree it never used.
-- Plain DROP INDEX (MySQL 8 has no IF EXISTS for it); InnoDB drops a secondary index in
-- place, without copying the table.
DROP INDEX idem_request_result_created_at ON idem_request_result;
DROP INDEX idem_processed_message_processed_at ON idem_processed_message;
