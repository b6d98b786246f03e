-- idem 0005: the claim-time indexes go. Expected from documentation; see crates/idem-mssql.
--
-- 0001 indexed created_at and processed_at for the purge; since 0002 the purge finds
-- expired records by expires_at (its own index) and only filters on the claim time, and
-- no other statement reads by it. Each new record wrote a B-tree it never used. Each
-- statement is its own batch, inside the migration's transaction.
IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_request_result_created_at' AND object_id = OBJECT_ID(N'idem_request_result'))
DROP INDEX idem_request_result_created_at ON idem_request_result;

IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_processed_message_processed_at' AND object_id = OBJECT_ID(N'idem_processed_message'))
DROP INDEX idem_processed_message_processed_at ON idem_processed_message;
