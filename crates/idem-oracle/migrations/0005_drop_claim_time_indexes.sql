-- idem 0005: the claim-time indexes go. Expected from documentation; see
-- crates/idem-oracle. A re-run after an interruption converges: ORA-01418 (index does
-- not exist) is tolerated.
--
-- 0001 indexed created_at and processed_at for the purge; since 0002 the purge finds
-- expired records by expires_at (its own index) and only filters on the claim time, and
-- no other statement reads by it. Each new record wrote a B-tree it never used.
DROP INDEX idem_request_result_created_at;
DROP INDEX idem_processed_message_at;
