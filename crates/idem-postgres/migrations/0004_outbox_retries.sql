-- idem 0004: outbox retries and dead messages.
--
-- A relay pass claims a batch (claim_token, claimed_until), commits, publishes outside
-- any transaction and records each outcome in a second short transaction. attempts
-- counts the attempts begun; a failed one sets last_error and next_attempt_at
-- (exponential backoff with jitter), the last one dead_at: a dead message is no longer
-- published and no longer holds its destination back, until an operator retries or
-- drops it. A relay that dies mid-pass leaves its claim to run out (claimed_until).
-- Times come from the database clock.
ALTER TABLE idem_outbox
    ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz,
    ADD COLUMN IF NOT EXISTS claim_token text COLLATE "C",
    ADD COLUMN IF NOT EXISTS claimed_until timestamptz,
    ADD COLUMN IF NOT EXISTS last_error text,
    ADD COLUMN IF NOT EXISTS dead_at timestamptz;
-- Named and added on its own (the name PostgreSQL gives a column's CHECK): Citus refuses
-- a column added with an unnamed constraint on a table it manages.
ALTER TABLE idem_outbox ADD CONSTRAINT idem_outbox_attempts_check CHECK (attempts >= 0);
-- Partial indexes over pending messages only (unsent, not dead), and over dead ones.
DROP INDEX IF EXISTS idem_outbox_unsent;
DROP INDEX IF EXISTS idem_outbox_pending;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (destination, id) WHERE sent_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_due ON idem_outbox (id) WHERE sent_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_dead ON idem_outbox (id) WHERE sent_at IS NULL AND dead_at IS NOT NULL;
