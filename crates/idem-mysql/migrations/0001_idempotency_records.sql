-- idem: idempotency records for MySQL 8.4 and MariaDB 10.11+ (InnoDB).
-- Scope and key columns are VARBINARY, compared byte for byte: utf8mb4_bin is PAD SPACE
-- ('k' = 'k '), and MariaDB 10.11 has no utf8mb4_0900_bin.
-- JSON is kept as text (LONGTEXT, not MySQL's binary JSON, which reorders keys) and
-- compared as values in Rust. Times are UTC_TIMESTAMP(6), set by the database clock.
CREATE TABLE IF NOT EXISTS idem_request_result (
    principal   VARBINARY(255) NOT NULL,
    operation   VARBINARY(255) NOT NULL,
    request_key VARBINARY(255) NOT NULL,
    request     LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    -- NULL only inside the transaction that claimed the key (never visible to others).
    response    LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    -- 0: the effect succeeded; 1: a final rejection stored by explicit opt-in.
    status      TINYINT NOT NULL DEFAULT 0,
    created_at  DATETIME(6) NOT NULL,
    PRIMARY KEY (principal, operation, request_key),
    KEY idem_request_result_created_at (created_at),
    CONSTRAINT idem_request_result_status CHECK (status IN (0, 1)),
    CONSTRAINT idem_request_result_principal CHECK (LENGTH(principal) BETWEEN 1 AND 255),
    CONSTRAINT idem_request_result_operation CHECK (LENGTH(operation) BETWEEN 1 AND 255),
    CONSTRAINT idem_request_result_key CHECK (LENGTH(request_key) BETWEEN 1 AND 255)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS idem_processed_message (
    subscriber   VARBINARY(255) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    fingerprint  LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    processed_at DATETIME(6) NOT NULL,
    PRIMARY KEY (subscriber, message_id),
    KEY idem_processed_message_processed_at (processed_at),
    CONSTRAINT idem_processed_message_subscriber CHECK (LENGTH(subscriber) BETWEEN 1 AND 255),
    CONSTRAINT idem_processed_message_message_id CHECK (LENGTH(message_id) BETWEEN 1 AND 255)
) ENGINE = InnoDB;
