-- idem 0004: outbox retries and dead messages. Times are microseconds since the Unix
-- epoch, from the database clock.
--
-- A relay pass claims a batch (claim_token, claimed_until), commits, publishes outside
-- any transaction and records each outcome in a second short transaction. attempts
-- counts the attempts begun; a failed one sets last_error and next_attempt_at
-- (exponential backoff with jitter), the last one dead_at: a dead message is no longer
-- published and no longer holds its destination back, until an operator retries or
-- drops it. A relay that dies mid-pass leaves its claim to run out (claimed_until).
ALTER TABLE idem_outbox ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0);
ALTER TABLE idem_outbox ADD COLUMN next_attempt_at INTEGER;
ALTER TABLE idem_outbox ADD COLUMN claim_token TEXT;
ALTER TABLE idem_outbox ADD COLUMN claimed_until INTEGER;
ALTER TABLE idem_outbox ADD COLUMN last_error TEXT;
ALTER TABLE idem_outbox ADD COLUMN dead_at INTEGER;
-- Partial indexes over pending messages only (unsent, not dead), and over dead ones.
DROP INDEX IF EXISTS idem_outbox_unsent;
DROP INDEX IF EXISTS idem_outbox_pending;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (destination, id) WHERE sent_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_due ON idem_outbox (id) WHERE sent_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_dead ON idem_outbox (id) WHERE sent_at IS NULL AND dead_at IS NOT NULL;
