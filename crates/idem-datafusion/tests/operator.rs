//! `DedupExec` through DataFusion: equality with the `ROW_NUMBER()` formulation on random
//! data for several partition counts, determinism, spilling under a tiny memory pool,
//! filter placement, the `dedup` table function, and `max_by` against the same reference.

use std::sync::Arc;

use datafusion::arrow::array::{Int64Array, RecordBatch, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::datasource::MemTable;
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::{collect, displayable};
use datafusion::prelude::*;
use idem_core::rng::SplitMix64;
use idem_datafusion::{DataFrameDedupExt, DedupOptions, DeletePolicy};

/// Random events in `partitions` partitions: small key and version domains so that keys
/// repeat, versions tie (with differing payloads) and nulls occur. `seq` is each row's
/// position in partition-major order, the order DedupExec breaks ties by.
fn events(
    seed: u64,
    rows_per_partition: usize,
    partitions: usize,
) -> (SchemaRef, Vec<Vec<RecordBatch>>) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, true),
        Field::new("s", DataType::Int64, true),
        Field::new("v", DataType::Int64, true),
        Field::new("op", DataType::Utf8, false),
        Field::new("seq", DataType::Int64, false),
        Field::new("payload", DataType::Utf8, false),
    ]));
    let mut rng = SplitMix64::new(seed);
    let mut seq = 0i64;
    let data = (0..partitions)
        .map(|_| {
            (0..rows_per_partition.div_ceil(1000))
                .map(|_| {
                    let n = 1000;
                    let k: Vec<Option<String>> = (0..n)
                        .map(|_| (!rng.chance(2)).then(|| format!("key{}", rng.below(3000))))
                        .collect();
                    let s: Vec<Option<i64>> = (0..n)
                        .map(|_| (!rng.chance(2)).then(|| rng.below(2) as i64))
                        .collect();
                    let v: Vec<Option<i64>> = (0..n)
                        .map(|_| (!rng.chance(3)).then(|| rng.below(5) as i64))
                        .collect();
                    let op: Vec<&str> = (0..n)
                        .map(|_| if rng.chance(10) { "d" } else { "u" })
                        .collect();
                    let seqs: Vec<i64> = (0..n as i64).map(|i| seq + i).collect();
                    seq += n as i64;
                    let payload: Vec<String> =
                        (0..n).map(|_| format!("p{}", rng.below(4))).collect();
                    RecordBatch::try_new(
                        Arc::clone(&schema),
                        vec![
                            Arc::new(StringArray::from(k)),
                            Arc::new(Int64Array::from(s)),
                            Arc::new(Int64Array::from(v)),
                            Arc::new(StringArray::from(op)),
                            Arc::new(Int64Array::from(seqs)),
                            Arc::new(StringArray::from(payload)),
                        ],
                    )
                    .expect("batch")
                })
                .collect()
        })
        .collect();
    (schema, data)
}

fn context(target_partitions: usize) -> SessionContext {
    let ctx = SessionContext::new_with_config(
        SessionConfig::new().with_target_partitions(target_partitions),
    );
    idem_datafusion::register(&ctx);
    ctx
}

async fn sorted(df: DataFrame) -> Vec<String> {
    let batches = df
        .sort(vec![col("seq").sort(true, true)])
        .expect("sort")
        .collect()
        .await
        .expect("collect");
    pretty_format_batches(&batches)
        .expect("format")
        .to_string()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Table `t` deduplicated the `ROW_NUMBER()` way: highest `v`, ties to the lowest `seq`
/// (input order), and with `deletes` the keys whose winner is a tombstone dropped.
async fn row_number_reference(ctx: &SessionContext, deletes: bool) -> DataFrame {
    ctx.sql(&format!(
        "SELECT k, s, v, op, seq, payload FROM (
            SELECT *, row_number() OVER (PARTITION BY k, s ORDER BY v DESC NULLS LAST, seq) AS rn FROM t
         ) WHERE rn = 1 {}",
        if deletes { "AND op <> 'd'" } else { "" }
    ))
    .await
    .expect("reference")
}

/// `sql`'s result as a printed table.
async fn query_text(ctx: &SessionContext, sql: &str) -> String {
    let batches = ctx
        .sql(sql)
        .await
        .expect("sql")
        .collect()
        .await
        .expect("collect");
    pretty_format_batches(&batches).expect("format").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equals_row_number_for_1_2_and_8_partitions() {
    for (seed, target_partitions) in [(1, 1), (2, 2), (3, 8)] {
        for deletes in [false, true] {
            let ctx = context(target_partitions);
            let (schema, data) = events(seed, 4000, 3);
            ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
                .expect("register");
            let mut options = DedupOptions::default();
            if deletes {
                options = options.with_deletes(DeletePolicy::new("op"));
            }
            let ours = ctx
                .table("t")
                .await
                .expect("t")
                .dedup(["k", "s"], ["v"], options)
                .expect("dedup");
            let reference = row_number_reference(&ctx, deletes).await;
            let ours = sorted(ours).await;
            assert!(ours.len() > 100, "a real result");
            assert_eq!(
                ours,
                sorted(reference).await,
                "seed {seed}, {target_partitions} partitions, deletes {deletes}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_is_deterministic() {
    let run = || async {
        let ctx = context(4);
        let (schema, data) = events(9, 3000, 4);
        ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
            .expect("register");
        let df = ctx
            .sql("SELECT * FROM dedup('t', 'k,s', 'v')")
            .await
            .expect("sql");
        let plan = df.create_physical_plan().await.expect("plan");
        let partitions = datafusion::physical_plan::collect_partitioned(plan, ctx.task_ctx())
            .await
            .expect("collect");
        partitions
            .iter()
            .map(|p| pretty_format_batches(p).expect("format").to_string())
            .collect::<Vec<_>>()
    };
    let first = run().await;
    for _ in 0..3 {
        assert_eq!(run().await, first);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spills_under_a_tiny_memory_pool_with_the_same_result() {
    let (schema, data) = events(5, 20_000, 2);
    let unlimited = context(2);
    unlimited
        .register_table(
            "t",
            Arc::new(MemTable::try_new(Arc::clone(&schema), data.clone()).expect("mem")),
        )
        .expect("register");
    let expected = sorted(
        unlimited
            .sql("SELECT * FROM dedup('t', 'k,s', 'v')")
            .await
            .expect("sql"),
    )
    .await;

    let runtime = RuntimeEnvBuilder::new()
        .with_memory_pool(Arc::new(FairSpillPool::new(256 * 1024)))
        .build_arc()
        .expect("runtime");
    let ctx =
        SessionContext::new_with_config_rt(SessionConfig::new().with_target_partitions(2), runtime);
    idem_datafusion::register(&ctx);
    ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
        .expect("register");
    let df = ctx
        .sql("SELECT * FROM dedup('t', 'k,s', 'v')")
        .await
        .expect("sql");
    let plan = df.clone().create_physical_plan().await.expect("plan");
    let batches = collect(Arc::clone(&plan), ctx.task_ctx())
        .await
        .expect("collect under a tiny pool");
    let got: Vec<String> = {
        // Sorting needs more memory than the tiny pool has: sort in the unlimited session.
        let sorted_df = unlimited
            .read_batches(batches)
            .expect("read")
            .sort(vec![col("seq").sort(true, true)])
            .expect("sort");
        let out = sorted_df.collect().await.expect("collect");
        pretty_format_batches(&out)
            .expect("format")
            .to_string()
            .lines()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(got, expected);
    let metrics = displayable(plan.as_ref()).indent(true).to_string();
    let spilled = find_metric(&plan, "spill_files");
    assert!(spilled > 0, "expected spilling:\n{metrics}");
    let peak = find_metric(&plan, "peak_mem_used");
    // Summed over the two partitions, each of which stayed within the pool.
    assert!(
        peak > 0 && peak <= 2 * 256 * 1024,
        "peak {peak}:\n{metrics}"
    );
}

/// A hash repartition under memory pressure can hand a source's batches over out of order
/// (DataFusion's shared spill channel), so ties go to the lowest position, not the first
/// arrival: here the later row of a tied pair arrives first, and from two sources mixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ties_go_to_the_lowest_position_whatever_the_arrival_order() {
    use datafusion::arrow::array::UInt64Array;
    use datafusion::datasource::memory::MemorySourceConfig;
    use idem_datafusion::{DedupExec, DedupSpec, POSITION_COLUMN, TiePolicy};

    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, false),
        Field::new("v", DataType::Int64, false),
        Field::new("payload", DataType::Utf8, false),
        Field::new(POSITION_COLUMN, DataType::UInt64, false),
    ]));
    let source_1 = 1u64 << 40;
    let batch = |keys: &[&str], payloads: &[&str], positions: &[u64]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(keys.to_vec())),
                Arc::new(Int64Array::from(vec![7; keys.len()])),
                Arc::new(StringArray::from(payloads.to_vec())),
                Arc::new(UInt64Array::from(positions.to_vec())),
            ],
        )
        .expect("batch")
    };
    let arrivals = vec![
        batch(&["a", "b"], &["a-late", "b-late"], &[5, source_1 + 9]),
        batch(&["b"], &["b-early"], &[source_1 + 2]),
        batch(&["a"], &["a-early"], &[1]),
    ];
    for (ties, expected) in [
        (TiePolicy::First, ["a-early", "b-early"]),
        (TiePolicy::Last, ["a-late", "b-late"]),
    ] {
        let input = MemorySourceConfig::try_new_exec(
            std::slice::from_ref(&arrivals),
            Arc::clone(&schema),
            None,
        )
        .expect("input");
        let spec =
            DedupSpec::new(["k"], ["v"]).with_options(DedupOptions::default().with_on_tie(ties));
        let dedup = Arc::new(DedupExec::try_new(input, spec).expect("dedup"));
        let output = collect(dedup, SessionContext::new().task_ctx())
            .await
            .expect("collect");
        let mut winners: Vec<String> = pretty_format_batches(&output)
            .expect("format")
            .to_string()
            .lines()
            .filter_map(|line| line.split('|').nth(3))
            .map(|cell| cell.trim().to_owned())
            .filter(|cell| cell.ends_with("-early") || cell.ends_with("-late"))
            .collect();
        winners.sort();
        assert_eq!(winners, expected, "ties {ties:?}");
    }
}

fn find_metric(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>, name: &str) -> usize {
    let own = plan
        .metrics()
        .and_then(|m| m.sum_by_name(name))
        .map_or(0, |v| v.as_usize());
    own + plan
        .children()
        .iter()
        .map(|c| find_metric(c, name))
        .sum::<usize>()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_filters_go_below_the_dedup_and_others_stay_above() {
    let ctx = context(2);
    let (schema, data) = events(4, 1000, 1);
    ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
        .expect("register");
    let plan = |sql: &'static str| {
        let ctx = ctx.clone();
        async move {
            let df = ctx.sql(sql).await.expect("sql");
            let plan = df.create_physical_plan().await.expect("plan");
            displayable(plan.as_ref()).indent(false).to_string()
        }
    };
    let on_key = plan("SELECT * FROM dedup('t', 'k,s', 'v') WHERE k = 'key1'").await;
    let dedup_at = on_key.find("DedupExec").expect("DedupExec in plan");
    let filter_at = on_key.find("FilterExec").expect("FilterExec in plan");
    assert!(
        filter_at > dedup_at,
        "key filter below the dedup:\n{on_key}"
    );
    let on_payload = plan("SELECT * FROM dedup('t', 'k,s', 'v') WHERE payload = 'p1'").await;
    let dedup_at = on_payload.find("DedupExec").expect("DedupExec in plan");
    let filter_at = on_payload.find("FilterExec").expect("FilterExec in plan");
    assert!(
        filter_at < dedup_at,
        "payload filter above the dedup:\n{on_payload}"
    );

    // And the results agree with filtering after the dedup.
    let filtered = ctx
        .sql("SELECT * FROM dedup('t', 'k,s', 'v') WHERE k = 'key1'")
        .await
        .expect("sql");
    let after = ctx
        .sql("SELECT * FROM (SELECT * FROM dedup('t', 'k,s', 'v')) WHERE k = 'key1'")
        .await
        .expect("sql");
    assert_eq!(sorted(filtered).await, sorted(after).await);
}

/// `df.dedup(...)` puts a `Dedup` node in the logical plan, DataFusion prunes the columns
/// nobody reads through it, and it plans in a context where `register` was never called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dataframe_dedup_is_a_logical_node_with_projection_pushdown() {
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2));
    let (schema, data) = events(6, 2000, 2);
    ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
        .expect("register");
    let deduped = ctx
        .table("t")
        .await
        .expect("table")
        .dedup(["k", "s"], ["v"], DedupOptions::default())
        .expect("dedup")
        .select_columns(&["k", "payload"])
        .expect("select");
    let optimized = deduped
        .clone()
        .into_optimized_plan()
        .expect("optimize")
        .display_indent()
        .to_string();
    assert!(
        optimized.contains("Dedup: key=[k, s], version=[v]"),
        "{optimized}"
    );
    assert!(
        optimized.contains("TableScan: t projection=[k, s, v, payload]"),
        "only the selected, key and version columns are scanned:\n{optimized}"
    );
    let rows: usize = deduped
        .collect()
        .await
        .expect("collect")
        .iter()
        .map(RecordBatch::num_rows)
        .sum();
    let expected = ctx
        .sql("SELECT count(*) FROM (SELECT DISTINCT k, s FROM t)")
        .await
        .expect("sql")
        .collect()
        .await
        .expect("collect");
    let expected = pretty_format_batches(&expected)
        .expect("format")
        .to_string();
    assert!(
        expected.contains(&format!("| {rows} ")),
        "{rows} rows vs\n{expected}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_function_options_files_and_errors() {
    let ctx = context(2);
    ctx.sql(
        "CREATE TABLE cdc (id TEXT, lsn TEXT, op TEXT, status TEXT) AS VALUES
           ('a', '0/FF', 'c', 'new'), ('a', '0/100', 'u', 'paid'), ('b', '1/0', 'DEL', 'gone'),
           ('b', '0/1', 'c', 'new'), ('c', '0/5', 'c', 'x'), ('c', '0/5', 'c', 'y')",
    )
    .await
    .expect("create");
    let rows = |sql: &'static str| query_text(&ctx, sql);
    let out = rows(
        "SELECT id, status FROM dedup('cdc', 'id', 'lsn', 'op=op, delete_values=DEL') ORDER BY id",
    )
    .await;
    assert!(
        out.contains("| a  | paid   |") && !out.contains("gone") && out.contains("| c  | x      |"),
        "{out}"
    );
    let out =
        rows("SELECT id, status FROM dedup('cdc', 'id', 'lsn', 'on_tie=last') ORDER BY id").await;
    assert!(
        out.contains("| c  | y      |") && out.contains("gone"),
        "{out}"
    );

    for (sql, needle) in [
        (
            "SELECT * FROM dedup('cdc', 'id', 'lsn', 'on_tie=error')",
            "conflicting rows for key (id=c)",
        ),
        (
            "SELECT * FROM dedup('nope', 'id', 'lsn')",
            "no table named 'nope'",
        ),
        ("SELECT * FROM dedup('cdc', 'missing', 'lsn')", "'missing'"),
        (
            "SELECT * FROM dedup('cdc', 'id', 'lsn', 'colour=blue')",
            "unknown option 'colour'",
        ),
        ("SELECT * FROM dedup('cdc', 'id')", "3 or 4 arguments"),
    ] {
        let result = match ctx.sql(sql).await {
            Ok(df) => df.collect().await.map(|_| ()),
            Err(e) => Err(e),
        };
        let error = result.expect_err(sql).to_string();
        assert!(error.contains(needle), "{sql}: {error}");
    }

    // A directory of Parquet files as the source.
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("cdc.parquet");
    ctx.sql(&format!(
        "COPY cdc TO '{}' STORED AS PARQUET",
        path.display()
    ))
    .await
    .expect("copy")
    .collect()
    .await
    .expect("copy");
    let sql = format!(
        "SELECT count(*) AS n FROM dedup('{}', 'id', 'lsn')",
        path.display()
    );
    let batches = ctx
        .sql(&sql)
        .await
        .expect("sql")
        .collect()
        .await
        .expect("collect");
    assert!(
        pretty_format_batches(&batches)
            .expect("format")
            .to_string()
            .contains("| 3 |")
    );
}

/// `max_by(payload, v)` per group equals the `ROW_NUMBER()` formulation (ties to the
/// greater payload, null versions skipped) through every aggregation path DataFusion
/// takes: one partition, partial + final with merged states, and the path that skips
/// partial aggregation and converts rows straight to states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_by_equals_row_number_on_every_aggregation_path() {
    for (seed, target_partitions, skip_partial) in [(7, 1, false), (8, 2, false), (9, 8, true)] {
        let mut config = SessionConfig::new().with_target_partitions(target_partitions);
        if skip_partial {
            let options = config.options_mut();
            options
                .execution
                .skip_partial_aggregation_probe_rows_threshold = 10;
            options
                .execution
                .skip_partial_aggregation_probe_ratio_threshold = 0.0;
        }
        let ctx = SessionContext::new_with_config(config);
        idem_datafusion::register(&ctx);
        let (schema, data) = events(seed, 4000, 3);
        ctx.register_table("t", Arc::new(MemTable::try_new(schema, data).expect("mem")))
            .expect("register");
        let rows = |sql: &'static str| query_text(&ctx, sql);
        let ours = rows(
            "SELECT k, s, max_by(payload, v) AS latest, min_by(payload, v) AS earliest FROM t
             GROUP BY k, s HAVING max_by(payload, v) IS NOT NULL ORDER BY k, s",
        )
        .await;
        let reference = rows(
            "SELECT k, s, max(CASE WHEN hi = 1 THEN payload END) AS latest,
                    max(CASE WHEN lo = 1 THEN payload END) AS earliest FROM (
               SELECT *,
                 row_number() OVER (PARTITION BY k, s ORDER BY v DESC, payload DESC) AS hi,
                 row_number() OVER (PARTITION BY k, s ORDER BY v ASC, payload ASC) AS lo
               FROM t WHERE v IS NOT NULL
             ) GROUP BY k, s ORDER BY k, s",
        )
        .await;
        assert!(ours.lines().count() > 100, "a real result");
        assert_eq!(
            ours, reference,
            "seed {seed}, {target_partitions} partitions"
        );
    }
}

/// Writes each partition of `data` as a Parquet file `part-N.parquet` in `dir`, so that a
/// listing table reads them back in the same order.
fn write_files(dir: &std::path::Path, schema: &SchemaRef, data: &[Vec<RecordBatch>]) {
    for (i, batches) in data.iter().enumerate() {
        let file = std::fs::File::create(dir.join(format!("part-{i}.parquet"))).expect("create");
        let mut writer =
            datafusion::parquet::arrow::ArrowWriter::try_new(file, Arc::clone(schema), None)
                .expect("writer");
        for batch in batches {
            writer.write(batch).expect("write");
        }
        writer.close().expect("close");
    }
}

/// Over files, the dedup is `LateDedupExec`: the same rows as the `ROW_NUMBER()`
/// formulation for 1, 2 and 8 partitions, with and without deletes, and again when the
/// memory pool is too small for its key table (it then decides in key partitions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_materialisation_over_files_equals_row_number() {
    let dir = tempfile::tempdir().expect("tmp");
    let (schema, data) = events(21, 6000, 4);
    write_files(dir.path(), &schema, &data);
    for (target_partitions, pool) in [(1, None), (2, None), (8, None), (2, Some(64 * 1024))] {
        let mut runtime = RuntimeEnvBuilder::new();
        if let Some(bytes) = pool {
            runtime = runtime.with_memory_pool(Arc::new(FairSpillPool::new(bytes)));
        }
        let ctx = SessionContext::new_with_config_rt(
            SessionConfig::new().with_target_partitions(target_partitions),
            runtime.build_arc().expect("runtime"),
        );
        idem_datafusion::register(&ctx);
        ctx.register_parquet(
            "t",
            dir.path().to_str().expect("path"),
            ParquetReadOptions::default(),
        )
        .await
        .expect("register");
        // The reference (and sorting for the comparison) runs without the tiny pool.
        let free = context(target_partitions);
        free.register_parquet(
            "t",
            dir.path().to_str().expect("path"),
            ParquetReadOptions::default(),
        )
        .await
        .expect("register");
        for deletes in [false, true] {
            let options = if deletes { "'op=op'" } else { "''" };
            let ours = ctx
                .sql(&format!("SELECT * FROM dedup('t', 'k,s', 'v', {options})"))
                .await
                .expect("dedup");
            let plan = ours.clone().create_physical_plan().await.expect("plan");
            let shown = displayable(plan.as_ref()).indent(false).to_string();
            assert!(shown.contains("LateDedupExec"), "{shown}");
            let reference = row_number_reference(&free, deletes).await;
            let batches = collect(Arc::clone(&plan), ctx.task_ctx())
                .await
                .expect("run");
            assert!(batches.iter().map(RecordBatch::num_rows).sum::<usize>() > 100);
            assert_eq!(
                sorted(free.read_batches(batches).expect("frame")).await,
                sorted(reference).await,
                "{target_partitions} partitions, pool {pool:?}, deletes {deletes}"
            );
            if pool.is_some() {
                assert!(find_metric(&plan, "key_partitions") > 1, "{shown}");
            }
            assert!(find_metric(&plan, "peak_mem_used") > 0, "{shown}");
        }
        // Tied rows that differ are conflicts, and under on_tie=error an error naming a key.
        let refused = ctx
            .sql("SELECT * FROM dedup('t', 'k,s', 'v', 'on_tie=error')")
            .await
            .expect("plan")
            .collect()
            .await
            .expect_err("conflicting ties");
        assert!(
            refused.to_string().contains("conflicting rows for key"),
            "{refused}"
        );
    }
}
