-- idem: idempotency records for SQL Server 2019+.
-- Scope and key columns are varbinary: string comparison pads trailing spaces even
-- under BIN2 collations. varbinary ignores trailing 0x00, so idem rejects NUL first.
CREATE TABLE idem_request_result (
    principal   varbinary(255) NOT NULL,
    operation   varbinary(255) NOT NULL,
    request_key varbinary(255) NOT NULL,
    request     nvarchar(max) NOT NULL,
    response    nvarchar(max) NULL,
    status      tinyint NOT NULL CONSTRAINT idem_request_result_status DEFAULT 0,
    created_at  datetime2(6) NOT NULL CONSTRAINT idem_request_result_created DEFAULT SYSUTCDATETIME(),
    CONSTRAINT idem_request_result_pkey PRIMARY KEY (principal, operation, request_key),
    CONSTRAINT idem_request_result_status_ck CHECK (status IN (0, 1))
);
CREATE INDEX idem_request_result_created_at ON idem_request_result (created_at);
CREATE TABLE idem_processed_message (
    subscriber   varbinary(255) NOT NULL,
    message_id   varbinary(255) NOT NULL,
    fingerprint  nvarchar(max) NULL,
    processed_at datetime2(6) NOT NULL CONSTRAINT idem_processed_message_at DEFAULT SYSUTCDATETIME(),
    CONSTRAINT idem_processed_message_pkey PRIMARY KEY (subscriber, message_id)
);
CREATE INDEX idem_processed_message_processed_at ON idem_processed_message (processed_at);
