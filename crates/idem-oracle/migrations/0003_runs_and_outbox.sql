-- idem 0003: phased runs (external effects: a lease, a fencing generation and recovery
-- points, committed before and between the calls to other systems) and the
-- transactional outbox (messages stored with the effect, published later by a relay).
-- Expected from documentation; see crates/idem-oracle.
-- One statement per call, without its ';'. A re-run after an interruption converges:
-- ORA-00955 (name in use) and ORA-01408 (column list indexed) are tolerated.
-- Scope, key, owner, destination and message ID columns are RAW, bound as bytes:
-- binary comparison whatever NLS_COMP / NLS_SORT (an empty value would be NULL: idem
-- refuses it before any SQL). JSON (request, state, response, payload) is CLOB text in
-- AL32UTF8, kept verbatim. Times are SYS_EXTRACT_UTC(SYSTIMESTAMP): the database
-- clock, in UTC.
-- The outbox's id is an identity column (12c+): it orders the messages of a
-- destination (an id is taken at the INSERT, so a relay can see a later id commit
-- before an earlier one; on RAC, cached NOORDER identity values of two instances
-- interleave).
-- Names stay within 30 bytes (the limit before 12.2 / COMPATIBLE < 12.2).
CREATE TABLE idem_run (
    principal   RAW(255) NOT NULL,
    operation   RAW(255) NOT NULL,
    request_key RAW(255) NOT NULL,
    request     CLOB NOT NULL,
    -- The current owner's token (32 hex characters).
    owner       RAW(64) NOT NULL,
    -- The fencing generation: raised by every takeover.
    fence       NUMBER(19) DEFAULT 0 NOT NULL,
    -- The last committed recovery point (at most 64 characters of [A-Za-z0-9_.-]).
    point       VARCHAR2(64 CHAR) NOT NULL,
    state       CLOB,
    -- NULL while the run is running; 0: succeeded, 1: a final rejection.
    status      NUMBER(1),
    response    CLOB,
    lease_until TIMESTAMP(6) NOT NULL,
    created_at  TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) NOT NULL,
    updated_at  TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) NOT NULL,
    expires_at  TIMESTAMP(6) NOT NULL,
    CONSTRAINT idem_run_pk PRIMARY KEY (principal, operation, request_key),
    CONSTRAINT idem_run_status CHECK (status IN (0, 1)),
    CONSTRAINT idem_run_answer CHECK ((status IS NULL AND response IS NULL) OR (status IS NOT NULL AND response IS NOT NULL))
);
CREATE INDEX idem_run_lease_until ON idem_run (lease_until);
CREATE INDEX idem_run_expires_at ON idem_run (expires_at);

CREATE TABLE idem_outbox (
    id          NUMBER(19) GENERATED ALWAYS AS IDENTITY,
    destination RAW(255) NOT NULL,
    message_id  RAW(255) NOT NULL,
    payload     CLOB NOT NULL,
    created_at  TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) NOT NULL,
    -- NULL until a relay published the message.
    sent_at     TIMESTAMP(6),
    CONSTRAINT idem_outbox_pk PRIMARY KEY (id)
);
CREATE INDEX idem_outbox_unsent ON idem_outbox (destination, id);
CREATE INDEX idem_outbox_sent_at ON idem_outbox (sent_at);
