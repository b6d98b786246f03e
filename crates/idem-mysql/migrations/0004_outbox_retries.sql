-- idem 0004: outbox retries and dead messages.
--
-- A relay pass claims a batch (claim_token, claimed_until), commits, publishes outside
-- any transaction and records each outcome in a second short transaction. attempts
-- counts the attempts begun; a failed one sets last_error and next_attempt_at
-- (exponential backoff with jitter), the last one dead_at: a dead message is no longer
-- published and no longer holds its destination back, until an operator retries or
-- drops it. A relay that dies mid-pass leaves its claim to run out (claimed_until).
-- Times are DATETIME(6) in UTC from the database clock (UTC_TIMESTAMP(6)).
-- One ALTER TABLE: MySQL runs it as one DDL statement, so it applies whole or not at all.
ALTER TABLE idem_outbox
    ADD COLUMN attempts INT NOT NULL DEFAULT 0,
    ADD COLUMN next_attempt_at DATETIME(6) NULL,
    ADD COLUMN claim_token VARBINARY(64) NULL,
    ADD COLUMN claimed_until DATETIME(6) NULL,
    ADD COLUMN last_error TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD COLUMN dead_at DATETIME(6) NULL,
    ADD CONSTRAINT idem_outbox_attempts CHECK (attempts >= 0),
    ADD KEY idem_outbox_dead (dead_at);
