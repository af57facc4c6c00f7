//! A run's statistics in Prometheus' text exposition format, for node_exporter's textfile
//! collector: `idem dedup … --metrics /var/lib/node_exporter/idem.prom` (and `idem merge`,
//! `idem verify`).
//!
//! Every series is a gauge describing the last run, labelled with the command and output, so
//! that one file per job can sit in the collector's directory. The file is replaced
//! atomically (written beside it, then renamed), since the collector may read it at any
//! moment.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::dedup::{DedupReport, FileRows};
use crate::error::Result;

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
    let mut series: Vec<(&str, &str, f64)> = vec![
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
    ];
    if let Some(state) = &report.state {
        series.extend(state_series(state));
    }
    render(&labels, &series, report.elapsed_seconds, &report.inputs)
}

/// The `--state` counts: alert on `idem_state_evicted_then_seen` (the retention is too
/// short) and on `idem_state_late`, watch `idem_state_bytes` grow to its plateau.
fn state_series(state: &crate::state::StateReport) -> [(&'static str, &'static str, f64); 9] {
    [
        (
            "state_new_keys",
            "Rows emitted whose key the state did not hold.",
            state.new_keys as f64,
        ),
        (
            "state_updated",
            "Rows emitted as newer versions or deletes of keys emitted before.",
            state.updated as f64,
        ),
        (
            "state_seen_before",
            "Rows dropped because an earlier run emitted their key at an equal or newer version.",
            state.seen_before as f64,
        ),
        (
            "state_late",
            "Rows older than the state's watermark whose key it no longer held.",
            state.late as f64,
        ),
        (
            "state_evicted_then_seen",
            "Rows whose key had expired from the state and came back (retention too short).",
            state.evicted_then_seen as f64,
        ),
        (
            "state_expired",
            "Keys expired from the state by this run's watermark.",
            state.expired as f64,
        ),
        ("state_keys", "Keys in the state.", state.keys as f64),
        (
            "state_bytes",
            "Bytes of the state's key files.",
            state.bytes as f64,
        ),
        (
            "state_version",
            "Version of the state's manifest.",
            state.version as f64,
        ),
    ]
}

/// The report of an `idem merge` run as Prometheus text, labelled `command="merge"` and
/// the table.
#[cfg(any(feature = "delta", feature = "postgres"))]
pub fn merge_metrics(report: &crate::merge::MergeReport) -> String {
    let labels = format!(r#"command="merge",table="{}""#, label(&report.table));
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    let series: [(&str, &str, f64); 18] = [
        (
            "rows_in",
            "Rows read from the batch.",
            report.rows_in as f64,
        ),
        (
            "duplicates",
            "Batch rows equal in key and version to a kept row.",
            report.duplicates as f64,
        ),
        (
            "superseded",
            "Batch rows whose key has a newer row in the batch.",
            report.superseded as f64,
        ),
        (
            "conflicts",
            "Keys whose tied rows differ outside the key.",
            report.conflicts as f64,
        ),
        (
            "distinct_keys",
            "Distinct keys in the batch.",
            report.distinct_keys as f64,
        ),
        (
            "duplicate_rate",
            "(duplicates + superseded) / rows_in.",
            report.duplicate_rate,
        ),
        ("inserted", "Keys new to the table.", report.inserted as f64),
        (
            "updated",
            "Table rows replaced by a newer version.",
            report.updated as f64,
        ),
        (
            "deleted",
            "Table rows removed by a newer delete.",
            report.deleted as f64,
        ),
        (
            "stale",
            "Batch winners not newer than the table (replays, late events).",
            report.stale as f64,
        ),
        (
            "resurrections_blocked",
            "Updates dropped because a remembered delete is as new.",
            report.resurrections_blocked as f64,
        ),
        (
            "tombstones",
            "Deletes remembered after the merge.",
            report.tombstones as f64,
        ),
        (
            "files_scanned",
            "Table files whose key and version columns were read.",
            report.files_scanned as f64,
        ),
        (
            "files_removed",
            "Table files rewritten.",
            report.files_removed as f64,
        ),
        ("files_added", "Files written.", report.files_added as f64),
        (
            "table_version",
            "Table version after the merge.",
            report.table_version.map_or(f64::NAN, |v| v as f64),
        ),
        (
            "committed",
            "1 if the merge committed a table version.",
            flag(report.committed),
        ),
        (
            "already_applied",
            "1 if the batch had been applied before.",
            flag(report.already_applied),
        ),
    ];
    render(&labels, &series, report.elapsed_seconds, &report.inputs)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The report of an `idem verify` run as Prometheus text, labelled `command="verify"` and
/// the target (as given): alert on `idem_verify_matches == 0`.
pub fn verify_metrics(report: &crate::verify::VerifyReport, target: &str) -> String {
    let labels = format!(r#"command="verify",target="{}""#, label(target));
    let series: [(&str, &str, f64); 12] = [
        (
            "verify_matches",
            "1 when the target holds exactly the dedup of the sources, else 0.",
            if report.matches { 1.0 } else { 0.0 },
        ),
        (
            "expected_rows",
            "Rows the target should hold.",
            report.expected_rows as f64,
        ),
        (
            "target_rows",
            "Rows the target holds.",
            report.target_rows as f64,
        ),
        (
            "matching_rows",
            "Target rows equal to the expected row of their key.",
            report.matching_rows as f64,
        ),
        (
            "missing_rows",
            "Expected rows whose key the target lacks.",
            report.missing_rows as f64,
        ),
        (
            "extra_rows",
            "Target rows whose key is not expected.",
            report.extra_rows as f64,
        ),
        (
            "differing_rows",
            "Target rows whose key is expected with other values.",
            report.differing_rows as f64,
        ),
        (
            "duplicate_rows",
            "Target rows repeating a key already seen in the target.",
            report.duplicate_rows as f64,
        ),
        (
            "rows_in",
            "Rows read from the sources.",
            report.source.rows_in as f64,
        ),
        (
            "duplicate_rate",
            "(duplicates + superseded) / rows_in of the sources.",
            report.source.duplicate_rate(),
        ),
        (
            "input_files",
            "Source files read.",
            report.source_files as f64,
        ),
        (
            "target_files",
            "Target files read.",
            report.target_files as f64,
        ),
    ];
    render(&labels, &series, report.elapsed_seconds, &[])
}

/// What an `idem sql` statement's dedup operators counted, as Prometheus text, labelled
/// `command="sql"` and the output (empty when printed).
#[cfg(feature = "sql")]
pub fn sql_metrics(run: &crate::sql::SqlRun, output: &str) -> String {
    let labels = format!(r#"command="sql",output="{}""#, label(output));
    let count = |name: &str| run.dedup.get(name).copied().unwrap_or(0);
    let rows_in = count("rows_in");
    let rate = if rows_in == 0 {
        0.0
    } else {
        (count("duplicates") + count("superseded")) as f64 / rows_in as f64
    };
    let helps: Vec<(String, String, f64)> = run
        .dedup
        .iter()
        .map(|(name, &value)| {
            (
                name.clone(),
                format!("{name}, summed over the query's dedup operators."),
                value as f64,
            )
        })
        .chain([
            (
                "duplicate_rate".to_owned(),
                "(duplicates + superseded) / rows_in of the query's dedup operators.".to_owned(),
                rate,
            ),
            (
                "dedup_operators".to_owned(),
                "Dedup operators in the query's plan.".to_owned(),
                run.dedup_operators as f64,
            ),
        ])
        .collect();
    let series: Vec<(&str, &str, f64)> = helps
        .iter()
        .map(|(name, help, value)| (name.as_str(), help.as_str(), *value))
        .collect();
    render(&labels, &series, run.elapsed_seconds, &[])
}

/// One gauge per series, the run's wall time and end, then the rows of each input file.
fn render(labels: &str, series: &[(&str, &str, f64)], elapsed: f64, inputs: &[FileRows]) -> String {
    let mut text = String::new();
    let timing = [
        ("elapsed_seconds", "Wall time of the run.", elapsed),
        (
            "last_run_timestamp_seconds",
            "When the run ended, in seconds since the Unix epoch.",
            now(),
        ),
    ];
    for (name, help, value) in series.iter().chain(&timing) {
        let _ = writeln!(text, "# HELP idem_{name} {help}");
        let _ = writeln!(text, "# TYPE idem_{name} gauge");
        let _ = writeln!(text, "idem_{name}{{{labels}}} {value}");
    }
    if !inputs.is_empty() {
        let _ = writeln!(
            text,
            "# HELP idem_input_rows Rows read from one input file."
        );
        let _ = writeln!(text, "# TYPE idem_input_rows gauge");
    }
    for input in inputs {
        let _ = writeln!(
            text,
            r#"idem_input_rows{{{labels},file="{}"}} {}"#,
            label(&input.path),
            input.rows
        );
    }
    if inputs.iter().any(|i| i.dropped.is_some()) {
        let _ = writeln!(
            text,
            "# HELP idem_input_dropped_rows Rows of one input file not in the result \
             (duplicates, superseded versions, deletes, null keys)."
        );
        let _ = writeln!(text, "# TYPE idem_input_dropped_rows gauge");
        for input in inputs {
            if let Some(dropped) = input.dropped {
                let _ = writeln!(
                    text,
                    r#"idem_input_dropped_rows{{{labels},file="{}"}} {dropped}"#,
                    label(&input.path)
                );
            }
        }
    }
    text
}

/// Replaces `path` with `text` atomically (the collector reads only `*.prom`, so the hidden
/// temporary is never read).
///
/// # Errors
/// The directory cannot be written.
pub fn write_metrics(path: &Path, text: &str) -> Result<()> {
    crate::write::publish::replace_file(path, text, "--metrics")
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
