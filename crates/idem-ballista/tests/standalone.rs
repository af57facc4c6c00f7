//! idem's dedup on an in-process Ballista cluster (scheduler and executor on loopback):
//! the same rows as a local DataFusion session.

use std::path::Path;
use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

/// `files` Parquet files of events with replays (every key delivered up to 3 times across
/// files) and updates (a later file may carry a higher `lsn`).
fn write_events(dir: &Path, files: usize, rows_per_file: i64) {
    for file in 0..files {
        let n = rows_per_file;
        let ids: Vec<String> = (0..n)
            .map(|i| format!("e{}", (i * 7 + file as i64) % (n / 2)))
            .collect();
        let sequences: Vec<i64> = (0..n).map(|i| i % 2).collect();
        let lsns: Vec<i64> = (0..n).map(|i| (i * 13 + file as i64 * 5) % 97).collect();
        let statuses: Vec<String> = (0..n).map(|i| format!("s{}-{file}", i % 5)).collect();
        let batch = RecordBatch::try_from_iter([
            ("event_id", Arc::new(StringArray::from(ids)) as _),
            ("sequence", Arc::new(Int64Array::from(sequences)) as _),
            ("lsn", Arc::new(Int64Array::from(lsns)) as _),
            ("status", Arc::new(StringArray::from(statuses)) as _),
        ])
        .expect("batch");
        let path = dir.join(format!("events-{file:02}.parquet"));
        let mut writer = ArrowWriter::try_new(
            std::fs::File::create(path).expect("create"),
            batch.schema(),
            None,
        )
        .expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
    }
}

async fn sorted_rows(ctx: &SessionContext, sql: &str) -> String {
    let batches = ctx
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pretty_format_batches(&batches).expect("format").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_cluster_dedups_like_a_local_session() {
    let dir = tempfile::tempdir().expect("tmp");
    write_events(dir.path(), 4, 5_000);
    let source = dir.path().display().to_string();
    let queries = [
        format!(
            "SELECT event_id, sequence, lsn, status FROM dedup('{source}', 'event_id,sequence', 'lsn') \
             ORDER BY event_id, sequence"
        ),
        format!(
            "SELECT status, count(*) AS n FROM dedup('{source}', 'event_id,sequence', 'lsn', 'on_tie=last') \
             GROUP BY status ORDER BY status"
        ),
        "SELECT event_id, max_by(status, lsn) AS status FROM events \
         GROUP BY event_id ORDER BY event_id"
            .to_owned(),
    ];

    let local = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
    idem_datafusion::register(&local);
    let cluster = idem_ballista::standalone(SessionConfig::new().with_target_partitions(4))
        .await
        .expect("standalone cluster");
    for ctx in [&local, &cluster] {
        ctx.register_parquet("events", &source, ParquetReadOptions::default())
            .await
            .expect("register");
    }
    // The cluster's plan: a map stage that stamps positions and shuffles by key hash, then
    // DedupExec per key partition over the shuffled rows.
    let explained = sorted_rows(&cluster, &format!("EXPLAIN {}", queries[0])).await;
    let distributed = explained
        .split("distributed_plan")
        .nth(1)
        .unwrap_or_else(|| panic!("no distributed plan in {explained}"));
    let map = distributed.find("ShuffleWriterExec: partitioning=Hash([event_id@0, sequence@1], 4)");
    let position = distributed.find("PositionExec");
    let dedup = distributed.find("DedupExec: key=[event_id, sequence]");
    let shuffled = distributed.find("UnresolvedShuffleExec: stage=1");
    assert!(
        map < position && position < dedup && dedup < shuffled && map.is_some(),
        "{explained}"
    );
    for sql in &queries {
        let expected = sorted_rows(&local, sql).await;
        let found = sorted_rows(&cluster, sql).await;
        assert!(expected.lines().count() > 10, "{sql}: {expected}");
        assert_eq!(found, expected, "{sql}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executors_write_the_dedup_as_parts_and_return_their_counts() {
    use idem_ballista::{PartsLayout, WriteParts, part_file_name, parts_written};
    use idem_datafusion::{Dedup, DedupSpec};

    let dir = tempfile::tempdir().expect("tmp");
    write_events(dir.path(), 4, 5_000);
    let source = dir.path().display().to_string();
    let staging = dir.path().join("staging");
    let cluster = idem_ballista::standalone(SessionConfig::new().with_target_partitions(3))
        .await
        .expect("standalone cluster");
    cluster
        .register_parquet("events", &source, ParquetReadOptions::default())
        .await
        .expect("register");
    let layout = PartsLayout {
        directory: format!("file://{}/", staging.display()),
        max_rows_per_file: 1_000,
        chunk_rows: 256,
        row_group_rows: 512,
        dictionary_page_bytes: 4096,
        zstd_level: 1,
        fallback_encodings: Vec::new(),
    };
    let scan = cluster
        .table("events")
        .await
        .expect("table")
        .into_unoptimized_plan();
    let dedup = Dedup::try_new(scan, DedupSpec::new(["event_id", "sequence"], ["lsn"]))
        .expect("dedup")
        .into_plan();
    let plan = WriteParts::try_new(dedup, layout)
        .expect("write")
        .into_plan();
    let batches = cluster
        .execute_logical_plan(plan)
        .await
        .expect("plan")
        .collect()
        .await
        .expect("run");
    let parts = parts_written(&batches).expect("parts");

    // One result per key partition; together they hold the local dedup's rows.
    assert_eq!(
        parts.iter().map(|p| p.partition).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let local = SessionContext::new();
    idem_datafusion::register(&local);
    let expected = sorted_rows(
        &local,
        &format!(
            "SELECT * FROM dedup('{source}', 'event_id,sequence', 'lsn') ORDER BY event_id, sequence"
        ),
    )
    .await;
    let rows_out: u64 = parts.iter().map(|p| p.rows).sum();
    assert_eq!(rows_out as usize + 4, expected.lines().count());
    let rows_in: u64 = parts.iter().map(|p| p.counters["rows_in"]).sum();
    assert_eq!(rows_in, 20_000);
    let dropped: u64 = parts
        .iter()
        .map(|p| p.counters["duplicates"] + p.counters["superseded"])
        .sum();
    assert_eq!(rows_in, rows_out + dropped);
    let reader = SessionContext::new();
    idem_datafusion::register(&reader);
    for part in &parts {
        assert_eq!(part.files as u64, part.rows.div_ceil(1_000), "{part:?}");
        for index in 0..part.files {
            let file = staging.join(part_file_name(part.partition, index));
            assert!(file.is_file(), "{} missing", file.display());
        }
    }
    reader
        .register_parquet(
            "parts",
            &staging.display().to_string(),
            ParquetReadOptions::default(),
        )
        .await
        .expect("parts");
    let written = sorted_rows(
        &reader,
        "SELECT event_id, sequence, lsn, status FROM parts ORDER BY event_id, sequence",
    )
    .await;
    assert_eq!(written, expected);
}
