-- idem 0002: a per-record expiry, set by the database clock at the claim (expected from
-- documentation; see crates/idem-mssql). expires_at = created_at + the operation's
-- retention (SYSUTCDATETIME(), evaluated once per statement). Lookups, claims and purges
-- read it, so one purge is safe for every operation whatever its window. Existing rows
-- are backfilled as created_at + 24 hours (the default retention); the column default
-- (the clock + 24 hours) only serves rows written by hand: idem always sets it.
-- JSON stays nvarchar(max): UTF-16 text, kept verbatim.
-- Each statement is its own batch, inside the migration's transaction (SQL Server DDL
-- is transactional): a failure leaves nothing half-applied.
IF COL_LENGTH(N'idem_request_result', N'expires_at') IS NULL
ALTER TABLE idem_request_result ADD expires_at datetime2(7) NOT NULL
    CONSTRAINT idem_request_result_expires_df DEFAULT DATEADD(hour, 24, SYSUTCDATETIME());

UPDATE idem_request_result SET expires_at = DATEADD(hour, 24, created_at);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_request_result_expires_at' AND object_id = OBJECT_ID(N'idem_request_result'))
CREATE INDEX idem_request_result_expires_at ON idem_request_result (expires_at);

IF COL_LENGTH(N'idem_processed_message', N'expires_at') IS NULL
ALTER TABLE idem_processed_message ADD expires_at datetime2(7) NOT NULL
    CONSTRAINT idem_processed_message_expires_df DEFAULT DATEADD(hour, 24, SYSUTCDATETIME());

UPDATE idem_processed_message SET expires_at = DATEADD(hour, 24, processed_at);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_processed_message_expires_at' AND object_id = OBJECT_ID(N'idem_processed_message'))
CREATE INDEX idem_processed_message_expires_at ON idem_processed_message (expires_at);
