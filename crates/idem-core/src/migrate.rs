//! Embedded, versioned migrations shared by every backend.

/// One versioned migration file, embedded in a backend crate.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Increasing from 1.
    pub version: u32,
    /// The file's name.
    pub name: &'static str,
    /// The file's SQL: statements end with `;` at the end of a line.
    pub sql: &'static str,
}

impl Migration {
    /// The statements, without full-line `--` comments and without the trailing `;`,
    /// ready for drivers that take one statement per call (SQL Server, Oracle).
    pub fn statements(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut cur = String::new();
        for line in self.sql.lines() {
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with("--") {
                continue;
            }
            if !cur.is_empty() {
                cur.push('\n');
            }
            cur.push_str(line.trim_end());
            if trimmed.ends_with(';') {
                cur.truncate(cur.trim_end().len() - 1);
                out.push(std::mem::take(&mut cur));
            }
        }
        if !cur.trim().is_empty() {
            out.push(cur);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_statements_and_drops_comments() {
        let m = Migration {
            version: 1,
            name: "x",
            sql: "-- c\nCREATE TABLE a (\n  x int -- inline\n);\n\nCREATE INDEX i ON a (x);\n",
        };
        assert_eq!(
            m.statements(),
            vec![
                "CREATE TABLE a (\n  x int -- inline\n)",
                "CREATE INDEX i ON a (x)"
            ]
        );
    }
}
