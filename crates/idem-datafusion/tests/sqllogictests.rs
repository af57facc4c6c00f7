//! Runs the sqllogictest files under `tests/slt/` against a DataFusion session with idem
//! registered. Each file gets a fresh session.

use std::path::PathBuf;

use async_trait::async_trait;
use datafusion::arrow::array::Array;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::error::DataFusionError;
use datafusion::prelude::{SessionConfig, SessionContext};
use sqllogictest::{AsyncDB, DBOutput, DefaultColumnType};

struct Idem {
    ctx: SessionContext,
}

#[async_trait]
impl AsyncDB for Idem {
    type Error = DataFusionError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, DataFusionError> {
        let frame = self.ctx.sql(sql).await?;
        if frame.schema().fields().is_empty() {
            frame.collect().await?;
            return Ok(DBOutput::StatementComplete(0));
        }
        let width = frame.schema().fields().len();
        let batches = frame.collect().await?;
        let options = FormatOptions::default().with_null("NULL");
        let mut rows = Vec::new();
        for batch in &batches {
            let formatters = batch
                .columns()
                .iter()
                .map(|c| ArrayFormatter::try_new(c.as_ref(), &options))
                .collect::<Result<Vec<_>, _>>()?;
            for row in 0..batch.num_rows() {
                let values: Vec<String> = formatters
                    .iter()
                    .zip(batch.columns())
                    .map(|(f, c)| {
                        let text = f.value(row).to_string();
                        if c.is_valid(row) && text.is_empty() {
                            "(empty)".to_owned()
                        } else {
                            text
                        }
                    })
                    .collect();
                // A multi-line value (an EXPLAIN plan) becomes one result line per line.
                if values.iter().any(|v| v.contains('\n')) {
                    rows.extend(values.join(" ").lines().map(|line| vec![line.to_owned()]));
                } else {
                    rows.push(values);
                }
            }
        }
        Ok(DBOutput::Rows {
            types: vec![DefaultColumnType::Any; width],
            rows,
        })
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "idem-datafusion"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqllogictests() {
    // Cargo sets the variable for the test process too; read it at run time, because a
    // test binary built from another checkout of the same sources may be reused.
    let manifest_dir =
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let dir = PathBuf::from(manifest_dir).join("tests/slt");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/slt")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .slt files in {}", dir.display());
    let mut failures = Vec::new();
    for file in &files {
        let mut runner = sqllogictest::Runner::new(|| async {
            let ctx =
                SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
            idem_datafusion::register(&ctx);
            Ok(Idem { ctx })
        });
        runner.with_column_validator(|_, _| true);
        if let Err(e) = runner.run_file_async(file).await {
            failures.push(format!("{}: {e}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
