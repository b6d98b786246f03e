-- idem 0003: phased runs (external effects) and the transactional outbox.
-- Times are microseconds since the Unix epoch, from the database clock; idem's
-- statements set every time column.
--
-- idem_run holds one phased run per (principal, operation, request_key). Its record is
-- committed at the run's start; every later write is guarded by the owner's token
-- (`WHERE owner = …`), so once a retry has taken the run over after the lease ended
-- (lease_until), the previous owner's writes change nothing. fence rises with every
-- takeover; point is the last committed recovery point and state (JSON text) what was
-- committed with it. status and response are set together, once, when the run ends.
CREATE TABLE IF NOT EXISTS idem_run (
    principal   TEXT NOT NULL CHECK (length(CAST(principal AS BLOB)) BETWEEN 1 AND 255),
    operation   TEXT NOT NULL CHECK (length(CAST(operation AS BLOB)) BETWEEN 1 AND 255),
    request_key TEXT NOT NULL CHECK (length(CAST(request_key AS BLOB)) BETWEEN 1 AND 255),
    request     TEXT NOT NULL CHECK (json_valid(request)),
    -- The current owner's token: 32 hex characters.
    owner       TEXT NOT NULL,
    fence       INTEGER NOT NULL DEFAULT 0,
    -- The recovery point: at most 64 characters.
    point       TEXT NOT NULL,
    state       TEXT CHECK (state IS NULL OR json_valid(state)),
    -- NULL while the run goes on; 0 succeeded, 1 rejected (a final failure).
    status      INTEGER CHECK (status IN (0, 1)),
    response    TEXT CHECK (response IS NULL OR json_valid(response)),
    lease_until INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (principal, operation, request_key),
    CONSTRAINT idem_run_answer CHECK ((status IS NULL) = (response IS NULL))
) STRICT, WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idem_run_lease_until ON idem_run (lease_until);
CREATE INDEX IF NOT EXISTS idem_run_expires_at ON idem_run (expires_at);

-- Messages to publish, stored in the effect's transaction and published by a relay
-- (oldest first, in order per destination: the order of ids). AUTOINCREMENT: an id is
-- never handed out again, even after the row that had it was purged.
-- sent_at is set once the broker has the message; sent messages are purged after a
-- while, unsent ones never.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    destination TEXT NOT NULL CHECK (length(CAST(destination AS BLOB)) BETWEEN 1 AND 255),
    message_id  TEXT NOT NULL CHECK (length(CAST(message_id AS BLOB)) BETWEEN 1 AND 255),
    payload     TEXT NOT NULL CHECK (json_valid(payload)),
    created_at  INTEGER NOT NULL,
    sent_at     INTEGER
) STRICT;
-- Partial indexes: only unsent messages are in them, so the relay's reads stay small
-- however many sent messages wait for the purge.
CREATE INDEX IF NOT EXISTS idem_outbox_unsent ON idem_outbox (destination, id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_sent_at ON idem_outbox (sent_at);
