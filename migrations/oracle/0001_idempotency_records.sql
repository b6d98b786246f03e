-- idem: idempotency records for Oracle Database 19c+.
-- Scope and key columns are RAW: byte comparison whatever the session's NLS_COMP /
-- NLS_SORT. Oracle stores '' as NULL, so idem rejects empty keys before any SQL.
CREATE TABLE idem_request_result (
    principal   RAW(255) NOT NULL,
    operation   RAW(255) NOT NULL,
    request_key RAW(255) NOT NULL,
    request     CLOB NOT NULL,
    response    CLOB,
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
CREATE INDEX idem_processed_message_processed_at ON idem_processed_message (processed_at);
