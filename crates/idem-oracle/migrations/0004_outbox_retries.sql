-- idem 0004: outbox retries and dead messages. Expected from documentation; see
-- crates/idem-oracle. A re-run after an interruption converges: ORA-01430 (column
-- already exists) and ORA-00955 (name in use) are tolerated.
--
-- A relay pass claims a batch (claim_token, claimed_until), commits, publishes outside
-- any transaction and records each outcome in a second short transaction. attempts
-- counts the attempts begun; a failed one sets last_error and next_attempt_at
-- (exponential backoff with jitter), the last one dead_at: a dead message is no longer
-- published and no longer holds its destination back, until an operator retries or
-- drops it. A relay that dies mid-pass leaves its claim to run out (claimed_until).
-- Times are SYS_EXTRACT_UTC(SYSTIMESTAMP), the database clock in UTC.
ALTER TABLE idem_outbox ADD (
    attempts NUMBER(10) DEFAULT 0 NOT NULL,
    next_attempt_at TIMESTAMP(6),
    claim_token RAW(64),
    claimed_until TIMESTAMP(6),
    last_error CLOB,
    dead_at TIMESTAMP(6)
);
CREATE INDEX idem_outbox_dead ON idem_outbox (dead_at);
