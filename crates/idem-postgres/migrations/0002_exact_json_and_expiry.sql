-- idem 0002: exact JSON text and a per-record expiry.
--
-- request, response and fingerprint become `text`: `jsonb` rewrites numbers (1e16 as
-- 10000000000000000), reorders keys and refuses "\u0000" inside strings; `text` keeps
-- the JSON exactly as idem wrote it (a JSON "\u0000" escape is six ASCII characters).
--
-- expires_at is set by the database clock at the claim (created_at + the operation's
-- retention). Lookups, claims and purges read it, so one purge is safe for every
-- operation whatever its window. Existing rows are backfilled as created_at + 24 hours
-- (the default retention); the column default (the database clock + 24 hours) only
-- serves rows written by hand, idem always sets it.
ALTER TABLE idem_request_result
    ALTER COLUMN request TYPE text USING request::text,
    ALTER COLUMN response TYPE text USING response::text,
    ADD COLUMN IF NOT EXISTS expires_at timestamptz;
UPDATE idem_request_result SET expires_at = created_at + interval '24 hours' WHERE expires_at IS NULL;
ALTER TABLE idem_request_result
    ALTER COLUMN expires_at SET DEFAULT clock_timestamp() + interval '24 hours',
    ALTER COLUMN expires_at SET NOT NULL;
CREATE INDEX IF NOT EXISTS idem_request_result_expires_at ON idem_request_result (expires_at);

ALTER TABLE idem_processed_message
    ALTER COLUMN fingerprint TYPE text USING fingerprint::text,
    ADD COLUMN IF NOT EXISTS expires_at timestamptz;
UPDATE idem_processed_message SET expires_at = processed_at + interval '24 hours' WHERE expires_at IS NULL;
ALTER TABLE idem_processed_message
    ALTER COLUMN expires_at SET DEFAULT clock_timestamp() + interval '24 hours',
    ALTER COLUMN expires_at SET NOT NULL;
CREATE INDEX IF NOT EXISTS idem_processed_message_expires_at ON idem_processed_message (expires_at);
