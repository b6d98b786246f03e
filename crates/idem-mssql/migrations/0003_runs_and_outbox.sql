-- idem 0003: phased runs (external effects: a lease, a fencing generation and recovery
-- points, committed before and between the calls to other systems) and the
-- transactional outbox (messages stored with the effect, published later by a relay).
-- Expected from documentation; see crates/idem-mssql.
-- Scope, key, owner, destination and message ID columns are varbinary, bound as bytes
-- and compared byte for byte like 0001's; JSON (request, state, response, payload) is
-- nvarchar(max), kept verbatim. Times are datetime2(7) from SYSUTCDATETIME(), the
-- database clock in UTC.
-- The outbox's id is an IDENTITY: it orders the messages of a destination (an id is
-- taken at the INSERT, so a relay can see a later id commit before an earlier one).
-- Each statement is its own batch, inside the migration's transaction (SQL Server DDL
-- is transactional): a failure leaves nothing half-applied.
IF OBJECT_ID(N'idem_run', N'U') IS NULL
CREATE TABLE idem_run (
    principal   varbinary(255) NOT NULL,
    operation   varbinary(255) NOT NULL,
    request_key varbinary(255) NOT NULL,
    request     nvarchar(max) NOT NULL,
    -- The current owner's token (32 hex characters).
    owner       varbinary(64) NOT NULL,
    -- The fencing generation: raised by every takeover.
    fence       bigint NOT NULL CONSTRAINT idem_run_fence_df DEFAULT 0,
    -- The last committed recovery point (at most 64 characters of [A-Za-z0-9_.-]).
    point       nvarchar(64) NOT NULL,
    state       nvarchar(max) NULL,
    -- NULL while the run is running; 0: succeeded, 1: a final rejection.
    status      tinyint NULL,
    response    nvarchar(max) NULL,
    lease_until datetime2(7) NOT NULL,
    created_at  datetime2(7) NOT NULL CONSTRAINT idem_run_created_df DEFAULT SYSUTCDATETIME(),
    updated_at  datetime2(7) NOT NULL CONSTRAINT idem_run_updated_df DEFAULT SYSUTCDATETIME(),
    expires_at  datetime2(7) NOT NULL,
    CONSTRAINT idem_run_pkey PRIMARY KEY CLUSTERED (principal, operation, request_key),
    CONSTRAINT idem_run_status_ck CHECK (status IN (0, 1)),
    CONSTRAINT idem_run_answer_ck CHECK ((status IS NULL AND response IS NULL) OR (status IS NOT NULL AND response IS NOT NULL)),
    CONSTRAINT idem_run_len_ck CHECK (DATALENGTH(principal) >= 1 AND DATALENGTH(operation) >= 1 AND DATALENGTH(request_key) >= 1)
);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_run_lease_until' AND object_id = OBJECT_ID(N'idem_run'))
CREATE INDEX idem_run_lease_until ON idem_run (lease_until);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_run_expires_at' AND object_id = OBJECT_ID(N'idem_run'))
CREATE INDEX idem_run_expires_at ON idem_run (expires_at);

IF OBJECT_ID(N'idem_outbox', N'U') IS NULL
CREATE TABLE idem_outbox (
    id          bigint IDENTITY(1, 1) NOT NULL,
    destination varbinary(255) NOT NULL,
    message_id  varbinary(255) NOT NULL,
    payload     nvarchar(max) NOT NULL,
    created_at  datetime2(7) NOT NULL CONSTRAINT idem_outbox_created_df DEFAULT SYSUTCDATETIME(),
    -- NULL until a relay published the message.
    sent_at     datetime2(7) NULL,
    CONSTRAINT idem_outbox_pkey PRIMARY KEY CLUSTERED (id),
    CONSTRAINT idem_outbox_len_ck CHECK (DATALENGTH(destination) >= 1 AND DATALENGTH(message_id) >= 1)
);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_outbox_unsent' AND object_id = OBJECT_ID(N'idem_outbox'))
CREATE INDEX idem_outbox_unsent ON idem_outbox (destination, id);

IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'idem_outbox_sent_at' AND object_id = OBJECT_ID(N'idem_outbox'))
CREATE INDEX idem_outbox_sent_at ON idem_outbox (sent_at);
