-- idem 0002: a per-record expiry, set by the database clock at the claim.
-- expires_at = created_at + the operation's retention (UTC_TIMESTAMP(6), one reading
-- per statement). Lookups, claims and purges read it, so one purge is safe for every
-- operation whatever its window. Existing rows are backfilled as created_at + 24 hours
-- (the default retention). Requests and responses stay LONGTEXT utf8mb4_bin: the text
-- idem wrote comes back byte for byte (MySQL's JSON type would normalize it).
-- MySQL commits each DDL statement on its own and has no ADD COLUMN IF NOT EXISTS: if
-- this file stops half-way, finish the remaining statements by hand, then re-run.
ALTER TABLE idem_request_result ADD COLUMN expires_at DATETIME(6) NULL;
UPDATE idem_request_result SET expires_at = created_at + INTERVAL 24 HOUR WHERE expires_at IS NULL;
ALTER TABLE idem_request_result MODIFY expires_at DATETIME(6) NOT NULL, ADD KEY idem_request_result_expires_at (expires_at);

ALTER TABLE idem_processed_message ADD COLUMN expires_at DATETIME(6) NULL;
UPDATE idem_processed_message SET expires_at = processed_at + INTERVAL 24 HOUR WHERE expires_at IS NULL;
ALTER TABLE idem_processed_message MODIFY expires_at DATETIME(6) NOT NULL, ADD KEY idem_processed_message_expires_at (expires_at);
