-- idem 0004: outbox retries and dead messages. Expected from documentation; see
-- crates/idem-mssql.
--
-- A relay pass claims a batch (claim_token, claimed_until), commits, publishes outside
-- any transaction and records each outcome in a second short transaction. attempts
-- counts the attempts begun; a failed one sets last_error and next_attempt_at
-- (exponential backoff with jitter), the last one dead_at: a dead message is no longer
-- published and no longer holds its destination back, until an operator retries or
-- drops it. A relay that dies mid-pass leaves its claim to run out (claimed_until).
-- Times are datetime2(7) from SYSUTCDATETIME(). Each statement is its own batch, inside
-- the migration's transaction.
IF COL_LENGTH(N'idem_outbox', N'attempts') IS NULL
ALTER TABLE idem_outbox ADD
    attempts int NOT NULL CONSTRAINT idem_outbox_attempts_df DEFAULT 0
        CONSTRAINT idem_outbox_attempts_ck CHECK (attempts >= 0),
    next_attempt_at datetime2(7) NULL,
    claim_token varbinary(64) NULL,
    claimed_until datetime2(7) NULL,
    last_error nvarchar(max) NULL,
    dead_at datetime2(7) NULL;

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_outbox_dead' AND object_id = OBJECT_ID(N'idem_outbox'))
CREATE INDEX idem_outbox_dead ON idem_outbox (dead_at);
