-- idem 0002: a per-record expiry, set by the database clock at the claim (expected from
-- documentation; see crates/idem-oracle). expires_at = created_at + the operation's
-- retention (SYS_EXTRACT_UTC(SYSTIMESTAMP), read once per statement). Lookups, claims
-- and purges read it, so one purge is safe for every operation whatever its window.
-- Existing rows are backfilled as created_at + 24 hours (the default retention); the
-- column default (the clock + 24 hours) only serves rows written by hand.
-- A re-run after an interruption converges: ORA-01430 (column exists) and ORA-00955 /
-- ORA-01408 (index exists) are tolerated; the backfill only touches old rows' values.
-- JSON stays CLOB text in AL32UTF8: kept verbatim.
ALTER TABLE idem_request_result ADD (expires_at TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) + INTERVAL '1' DAY NOT NULL);
UPDATE idem_request_result SET expires_at = created_at + INTERVAL '1' DAY WHERE response IS NOT NULL AND expires_at > created_at + INTERVAL '1' DAY;
CREATE INDEX idem_request_result_expires ON idem_request_result (expires_at);

ALTER TABLE idem_processed_message ADD (expires_at TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) + INTERVAL '1' DAY NOT NULL);
UPDATE idem_processed_message SET expires_at = processed_at + INTERVAL '1' DAY WHERE expires_at > processed_at + INTERVAL '1' DAY;
CREATE INDEX idem_processed_message_expires ON idem_processed_message (expires_at);
