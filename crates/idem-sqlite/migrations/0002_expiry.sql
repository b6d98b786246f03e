-- idem 0002: a per-record expiry, set at the claim.
-- expires_at (microseconds since the Unix epoch, database clock) = the claim's time +
-- the operation's retention. Lookups, claims and purges read it, so one purge is safe
-- for every operation whatever its window. created_at now records the claim's time
-- (it used to record the completion). Existing rows are backfilled as
-- created_at + 24 hours (the default retention). SQLite needs a constant default to add
-- a NOT NULL column: 0 (already expired) only serves rows written by hand.
-- Request and response stay TEXT, stored verbatim.
ALTER TABLE idem_request_result ADD COLUMN expires_at INTEGER NOT NULL DEFAULT 0;
UPDATE idem_request_result SET expires_at = created_at + 86400000000;
CREATE INDEX IF NOT EXISTS idem_request_result_expires_at ON idem_request_result (expires_at);

ALTER TABLE idem_processed_message ADD COLUMN expires_at INTEGER NOT NULL DEFAULT 0;
UPDATE idem_processed_message SET expires_at = processed_at + 86400000000;
CREATE INDEX IF NOT EXISTS idem_processed_message_expires_at ON idem_processed_message (expires_at);
