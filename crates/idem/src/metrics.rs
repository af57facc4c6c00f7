//! A run's statistics in Prometheus' text exposition format, for node_exporter's textfile
//! collector: `idem dedup … --metrics /var/lib/node_exporter/idem.prom`.
//!
//! Every series is a gauge describing the last run, labelled with the command and output, so
//! that one file per job can sit in the collector's directory. The file is replaced
//! atomically (written beside it, then renamed), since the collector may read it at any
//! moment.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::dedup::DedupReport;
use crate::error::{Error, Result};

/// Escapes a label value as the exposition format wants (`\`, `"` and newlines).
fn label(value: &str) -> String {
    value
        .replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

/// The report of an `idem dedup` run as Prometheus text.
pub fn dedup_metrics(report: &DedupReport) -> String {
    let labels = format!(r#"command="dedup",output="{}""#, label(&report.output));
    let stats = &report.stats;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let series: [(&str, &str, f64); 17] = [
        (
            "rows_in",
            "Rows read from the inputs.",
            stats.rows_in as f64,
        ),
        ("rows_out", "Rows written.", stats.rows_out as f64),
        (
            "duplicates",
            "Rows equal in key and version to a kept row (replays).",
            stats.duplicates as f64,
        ),
        (
            "superseded",
            "Rows whose key has a row with a higher version (stale updates).",
            stats.superseded as f64,
        ),
        (
            "deleted",
            "Rows dropped because their key's winner is a delete.",
            stats.deleted as f64,
        ),
        (
            "conflicts",
            "Keys whose tied rows differ outside the key.",
            stats.conflicts as f64,
        ),
        (
            "null_keys",
            "Rows with a null key column.",
            stats.null_keys as f64,
        ),
        (
            "distinct_keys",
            "Distinct keys.",
            stats.distinct_keys as f64,
        ),
        (
            "tombstones_kept",
            "Winning deletes written (--keep-tombstones).",
            stats.tombstones_kept as f64,
        ),
        (
            "duplicate_rate",
            "(duplicates + superseded) / rows_in.",
            stats.duplicate_rate(),
        ),
        (
            "input_files",
            "Input files read.",
            report.input_files as f64,
        ),
        (
            "key_partitions",
            "Key partitions of the first pass (more than 1 under a memory limit).",
            f64::from(report.key_partitions),
        ),
        (
            "table_bytes",
            "Largest size of the key table, in bytes.",
            report.table_bytes as f64,
        ),
        (
            "decide_seconds",
            "Wall time of the first pass.",
            report.decide_seconds,
        ),
        (
            "write_seconds",
            "Wall time of the second pass.",
            report.write_seconds,
        ),
        (
            "elapsed_seconds",
            "Wall time of the run.",
            report.elapsed_seconds,
        ),
        (
            "last_run_timestamp_seconds",
            "When the run ended, in seconds since the Unix epoch.",
            now,
        ),
    ];
    let mut text = String::new();
    for (name, help, value) in series {
        let _ = writeln!(text, "# HELP idem_{name} {help}");
        let _ = writeln!(text, "# TYPE idem_{name} gauge");
        let _ = writeln!(text, "idem_{name}{{{labels}}} {value}");
    }
    let _ = writeln!(
        text,
        "# HELP idem_input_rows Rows read from one input file."
    );
    let _ = writeln!(text, "# TYPE idem_input_rows gauge");
    for input in &report.inputs {
        let _ = writeln!(
            text,
            r#"idem_input_rows{{{labels},file="{}"}} {}"#,
            label(&input.path),
            input.rows
        );
    }
    text
}

/// Replaces `path` with `text` atomically.
///
/// # Errors
/// The directory cannot be written.
pub fn write_metrics(path: &Path, text: &str) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::InvalidArgument(format!("--metrics '{}' has no file name", path.display()))
    })?;
    // The textfile collector reads only `*.prom`: a hidden temporary is never half-read.
    let temporary = path.with_file_name(format!(".{name}.idem-tmp-{}", std::process::id()));
    std::fs::write(&temporary, text).map_err(Error::io(&temporary))?;
    std::fs::rename(&temporary, path).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        Error::io(path)(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(label("x\ny"), r"x\ny");
    }
}
