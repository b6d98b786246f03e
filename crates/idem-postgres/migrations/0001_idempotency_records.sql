-- idem: idempotency records for PostgreSQL 15+.
-- Key columns use COLLATE "C": equality and ordering are byte for byte.
-- `text` cannot hold NUL; idem rejects control characters before any SQL.
CREATE TABLE IF NOT EXISTS idem_request_result (
    principal   text COLLATE "C" NOT NULL CHECK (octet_length(principal) BETWEEN 1 AND 255),
    operation   text COLLATE "C" NOT NULL CHECK (octet_length(operation) BETWEEN 1 AND 255),
    request_key text COLLATE "C" NOT NULL CHECK (octet_length(request_key) BETWEEN 1 AND 255),
    request     jsonb NOT NULL,
    -- NULL only inside the transaction that claimed the key (never visible to others).
    response    jsonb,
    -- 0: the effect succeeded; 1: a final rejection stored by explicit opt-in.
    status      smallint NOT NULL DEFAULT 0 CHECK (status IN (0, 1)),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT idem_request_result_pkey PRIMARY KEY (principal, operation, request_key)
);
CREATE INDEX IF NOT EXISTS idem_request_result_created_at ON idem_request_result (created_at);

CREATE TABLE IF NOT EXISTS idem_processed_message (
    subscriber   text COLLATE "C" NOT NULL CHECK (octet_length(subscriber) BETWEEN 1 AND 255),
    message_id   text COLLATE "C" NOT NULL CHECK (octet_length(message_id) BETWEEN 1 AND 255),
    fingerprint  jsonb,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT idem_processed_message_pkey PRIMARY KEY (subscriber, message_id)
);
CREATE INDEX IF NOT EXISTS idem_processed_message_processed_at ON idem_processed_message (processed_at);
