-- idem: idempotency records for SQL Server 2019+ (expected from documentation; see
-- crates/idem-mssql). Each statement ends with `;` at the end of a line: idem runs them
-- one at a time, inside one transaction, under an sp_getapplock guard.
--
-- Scope and key columns are varbinary: string comparison pads trailing spaces even
-- under BIN2 collations ('k' = 'k '), varbinary compares bytes. varbinary comparison
-- ignores trailing 0x00, so idem rejects NUL (every control character) before any SQL.
-- JSON is nvarchar(max) (UTF-16, kept verbatim); idem compares requests as values in
-- Rust. No ISJSON check: before SQL Server 2022, ISJSON returns 0 for scalars such as
-- a stored rejection "insufficient balance".
-- created_at uses the database clock (SYSUTCDATETIME, UTC: no daylight-saving jumps).
-- The guards (IF OBJECT_ID …) make the file safe on a database where the tables were
-- created by hand; the version table still records it once.
IF OBJECT_ID(N'idem_request_result', N'U') IS NULL
CREATE TABLE idem_request_result (
    principal   varbinary(255) NOT NULL,
    operation   varbinary(255) NOT NULL,
    request_key varbinary(255) NOT NULL,
    request     nvarchar(max) NOT NULL,
    -- NULL only inside the transaction that claimed the key (never committed).
    response    nvarchar(max) NULL,
    -- 0: the effect succeeded; 1: a final rejection stored by explicit opt-in.
    status      tinyint NOT NULL CONSTRAINT idem_request_result_status_df DEFAULT 0,
    created_at  datetime2(7) NOT NULL CONSTRAINT idem_request_result_created_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT idem_request_result_pkey PRIMARY KEY CLUSTERED (principal, operation, request_key),
    CONSTRAINT idem_request_result_status_ck CHECK (status IN (0, 1)),
    CONSTRAINT idem_request_result_len_ck CHECK (DATALENGTH(principal) >= 1 AND DATALENGTH(operation) >= 1 AND DATALENGTH(request_key) >= 1)
);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_request_result_created_at' AND object_id = OBJECT_ID(N'idem_request_result'))
CREATE INDEX idem_request_result_created_at ON idem_request_result (created_at);

IF OBJECT_ID(N'idem_processed_message', N'U') IS NULL
CREATE TABLE idem_processed_message (
    subscriber   varbinary(255) NOT NULL,
    message_id   varbinary(255) NOT NULL,
    -- The payload's canonical JSON when the consumer supplied one.
    fingerprint  nvarchar(max) NULL,
    processed_at datetime2(7) NOT NULL CONSTRAINT idem_processed_message_at_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT idem_processed_message_pkey PRIMARY KEY CLUSTERED (subscriber, message_id),
    CONSTRAINT idem_processed_message_len_ck CHECK (DATALENGTH(subscriber) >= 1 AND DATALENGTH(message_id) >= 1)
);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_processed_message_processed_at' AND object_id = OBJECT_ID(N'idem_processed_message'))
CREATE INDEX idem_processed_message_processed_at ON idem_processed_message (processed_at);
