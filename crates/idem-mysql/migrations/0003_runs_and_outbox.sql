-- idem 0003: phased runs (external effects: a lease, a fencing generation and recovery
-- points, committed before and between the calls to other systems) and the
-- transactional outbox (messages stored with the effect, published later by a relay).
-- Scope, key, owner, recovery point, destination and message ID columns are VARBINARY,
-- compared byte for byte like 0001's; JSON (request, state, response, payload) is
-- LONGTEXT utf8mb4_bin, stored verbatim. Times are DATETIME(6) in UTC, set by the
-- database clock (UTC_TIMESTAMP(6)): idem always writes created_at, updated_at,
-- lease_until and expires_at itself (MySQL 8.4 and MariaDB spell expression defaults
-- differently, so there are none).
-- The outbox's id is AUTO_INCREMENT: it orders the messages of a destination (an id is
-- taken at the INSERT, so a relay can see a later id commit before an earlier one).
-- SKIP LOCKED, which the relay's read uses, needs MariaDB 10.6+ or MySQL 8.0+.
-- MySQL commits each DDL statement on its own: every statement is IF NOT EXISTS, so a
-- run that stopped half-way can simply be re-run.
CREATE TABLE IF NOT EXISTS idem_run (
    principal   VARBINARY(255) NOT NULL,
    operation   VARBINARY(255) NOT NULL,
    request_key VARBINARY(255) NOT NULL,
    request     LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    -- The current owner's token (32 hex characters).
    owner       VARBINARY(64) NOT NULL,
    -- The fencing generation: raised by every takeover.
    fence       BIGINT NOT NULL DEFAULT 0,
    -- The last committed recovery point (at most 64 characters of [A-Za-z0-9_.-]).
    point       VARBINARY(64) NOT NULL,
    state       LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    -- NULL while the run is running; 0: succeeded, 1: a final rejection.
    status      TINYINT NULL,
    response    LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    lease_until DATETIME(6) NOT NULL,
    created_at  DATETIME(6) NOT NULL,
    updated_at  DATETIME(6) NOT NULL,
    expires_at  DATETIME(6) NOT NULL,
    PRIMARY KEY (principal, operation, request_key),
    KEY idem_run_lease_until (lease_until),
    KEY idem_run_expires_at (expires_at),
    CONSTRAINT idem_run_status CHECK (status IN (0, 1)),
    CONSTRAINT idem_run_answer CHECK ((status IS NULL) = (response IS NULL)),
    CONSTRAINT idem_run_principal CHECK (LENGTH(principal) BETWEEN 1 AND 255),
    CONSTRAINT idem_run_operation CHECK (LENGTH(operation) BETWEEN 1 AND 255),
    CONSTRAINT idem_run_key CHECK (LENGTH(request_key) BETWEEN 1 AND 255)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS idem_outbox (
    id          BIGINT NOT NULL AUTO_INCREMENT,
    destination VARBINARY(255) NOT NULL,
    message_id  VARBINARY(255) NOT NULL,
    payload     LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    created_at  DATETIME(6) NOT NULL,
    -- NULL until a relay published the message.
    sent_at     DATETIME(6) NULL,
    PRIMARY KEY (id),
    KEY idem_outbox_unsent (destination, id),
    KEY idem_outbox_sent_at (sent_at),
    CONSTRAINT idem_outbox_destination CHECK (LENGTH(destination) BETWEEN 1 AND 255),
    CONSTRAINT idem_outbox_message_id CHECK (LENGTH(message_id) BETWEEN 1 AND 255)
) ENGINE = InnoDB;
