-- idem: idempotency records for SQLite 3.37+ (STRICT tables).
-- TEXT with the default BINARY collation compares byte for byte.
-- Times are microseconds since the Unix epoch, from the database clock.
CREATE TABLE IF NOT EXISTS idem_request_result (
    principal   TEXT NOT NULL CHECK (length(CAST(principal AS BLOB)) BETWEEN 1 AND 255),
    operation   TEXT NOT NULL CHECK (length(CAST(operation AS BLOB)) BETWEEN 1 AND 255),
    request_key TEXT NOT NULL CHECK (length(CAST(request_key AS BLOB)) BETWEEN 1 AND 255),
    request     TEXT NOT NULL CHECK (json_valid(request)),
    response    TEXT NOT NULL CHECK (json_valid(response)),
    status      INTEGER NOT NULL DEFAULT 0 CHECK (status IN (0, 1)),
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (principal, operation, request_key)
) STRICT, WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idem_request_result_created_at ON idem_request_result (created_at);

CREATE TABLE IF NOT EXISTS idem_processed_message (
    subscriber   TEXT NOT NULL CHECK (length(CAST(subscriber AS BLOB)) BETWEEN 1 AND 255),
    message_id   TEXT NOT NULL CHECK (length(CAST(message_id AS BLOB)) BETWEEN 1 AND 255),
    fingerprint  TEXT CHECK (fingerprint IS NULL OR json_valid(fingerprint)),
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (subscriber, message_id)
) STRICT, WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idem_processed_message_processed_at ON idem_processed_message (processed_at);
