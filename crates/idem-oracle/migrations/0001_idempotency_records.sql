-- idem: idempotency records for Oracle Database 19c+ (23ai / 26ai included).
-- One statement per call: idem sends each statement separately, without its ';'.
-- Oracle DDL commits on its own and has no IF NOT EXISTS before 23ai: idem tolerates
-- ORA-00955 / ORA-01408 per statement, so an interrupted or concurrent run converges.
--
-- Scope and key columns are RAW, bound as bytes: comparison is binary whatever the
-- session's NLS_COMP / NLS_SORT (LINGUISTIC settings affect character types only).
-- Oracle stores '' (and an empty RAW) as NULL: idem rejects empty keys before any SQL,
-- and NOT NULL refuses them here too.
-- JSON is CLOB text in the database character set, which must be AL32UTF8 (checked by
-- idem's migrate). No IS JSON constraint: before 21c (or with COMPATIBLE < 20) it
-- refuses top-level scalars such as a stored rejection "insufficient balance"; idem
-- parses the JSON it reads back.
-- Times are SYS_EXTRACT_UTC(SYSTIMESTAMP): the database clock, in UTC.
CREATE TABLE idem_request_result (
    principal   RAW(255) NOT NULL,
    operation   RAW(255) NOT NULL,
    request_key RAW(255) NOT NULL,
    request     CLOB NOT NULL,
    -- NULL only inside the transaction that claimed the key (never visible to others).
    response    CLOB,
    -- 0: the effect succeeded; 1: a final rejection stored by explicit opt-in.
    status      NUMBER(1) DEFAULT 0 NOT NULL,
    created_at  TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) NOT NULL,
    CONSTRAINT idem_request_result_pk PRIMARY KEY (principal, operation, request_key),
    CONSTRAINT idem_request_result_status CHECK (status IN (0, 1))
);
CREATE INDEX idem_request_result_created_at ON idem_request_result (created_at);

CREATE TABLE idem_processed_message (
    subscriber   RAW(255) NOT NULL,
    message_id   RAW(255) NOT NULL,
    fingerprint  CLOB,
    processed_at TIMESTAMP(6) DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP) NOT NULL,
    CONSTRAINT idem_processed_message_pk PRIMARY KEY (subscriber, message_id)
);
-- Index names stay within 30 bytes (the limit before 12.2 / COMPATIBLE < 12.2).
CREATE INDEX idem_processed_message_at ON idem_processed_message (processed_at);
