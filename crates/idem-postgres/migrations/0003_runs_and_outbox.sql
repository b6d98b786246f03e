-- idem 0003: phased runs (external effects) and the transactional outbox.
--
-- idem_run holds one phased run per (principal, operation, request_key). Its record is
-- committed at the run's start; every later write is guarded by the owner's token
-- (`WHERE owner = …`), so once a retry has taken the run over after the lease ended
-- (`lease_until` by the database clock), the previous owner's writes change nothing.
-- `fence` rises with every takeover; `point` is the last committed recovery point and
-- `state` (JSON text) what was committed with it. `status` and `response` are set
-- together, once, when the run ends. Times come from the database clock.
CREATE TABLE IF NOT EXISTS idem_run (
    principal   text COLLATE "C" NOT NULL CHECK (octet_length(principal) BETWEEN 1 AND 255),
    operation   text COLLATE "C" NOT NULL CHECK (octet_length(operation) BETWEEN 1 AND 255),
    request_key text COLLATE "C" NOT NULL CHECK (octet_length(request_key) BETWEEN 1 AND 255),
    request     text NOT NULL,
    -- The current owner's token: 32 hex characters.
    owner       text COLLATE "C" NOT NULL,
    fence       bigint NOT NULL DEFAULT 0,
    -- The recovery point: at most 64 characters.
    point       text NOT NULL,
    state       text,
    -- NULL while the run goes on; 0 succeeded, 1 rejected (a final failure).
    status      smallint CHECK (status IN (0, 1)),
    response    text,
    lease_until timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT idem_run_pkey PRIMARY KEY (principal, operation, request_key),
    CONSTRAINT idem_run_answer CHECK ((status IS NULL) = (response IS NULL))
);
CREATE INDEX IF NOT EXISTS idem_run_lease_until ON idem_run (lease_until);
CREATE INDEX IF NOT EXISTS idem_run_expires_at ON idem_run (expires_at);

-- Messages to publish, stored in the effect's transaction and published by a relay
-- (oldest first, in order per destination). `sent_at` is set once the broker has the
-- message; sent messages are purged after a while, unsent ones never.
CREATE TABLE IF NOT EXISTS idem_outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination text COLLATE "C" NOT NULL CHECK (octet_length(destination) BETWEEN 1 AND 255),
    message_id  text COLLATE "C" NOT NULL CHECK (octet_length(message_id) BETWEEN 1 AND 255),
    payload     text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at     timestamptz
);
-- Partial indexes: only unsent messages are in them, so the relay's reads stay small
-- however many sent messages wait for the purge.
CREATE INDEX IF NOT EXISTS idem_outbox_unsent ON idem_outbox (destination, id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_sent_at ON idem_outbox (sent_at);
