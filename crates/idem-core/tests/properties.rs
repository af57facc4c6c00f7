//! Seeded randomised tests of the kernels against a naive, sort-based reference.
//!
//! Each case draws a schema (key and version column types), several batches with small
//! value domains (so keys repeat, versions tie and nulls collide), and layouts that differ
//! from batch to batch (dictionary or plain strings, 32-bit or view offsets). The kernel's
//! winners and every counter must equal the reference's.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Decimal128Array, DictionaryArray, FixedSizeBinaryArray, Int32Array,
    Int64Array, RecordBatch, StringArray, StringViewArray, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Int32Type, Schema, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use idem_core::key::KeyRouter;
use idem_core::rng::SplitMix64;
use idem_core::{
    DedupOptions, DedupSpec, DeletePolicy, KeepMaxTable, PositionBits, PreparedRows, TieCheck,
    TiePolicy, parse_pg_lsn,
};

#[derive(Clone, Copy, Debug)]
enum KeyType {
    Int,
    Text,
    Uuid,
    /// UUIDs as text, in lower, upper or mixed case: spellings of one UUID in different
    /// cases are different keys.
    UuidText,
}

#[derive(Clone, Copy, Debug)]
enum VersionType {
    Signed,
    Unsigned,
    Lsn,
    Decimal,
}

/// A column's logical cells, before a physical layout is chosen for a batch.
enum Cells {
    Int(Vec<Option<i64>>),
    Text(Vec<Option<String>>),
    Uuid(Vec<Option<[u8; 16]>>),
    Unsigned(Vec<Option<u64>>),
    Decimal(Vec<Option<i128>>),
}

fn key_cells(rng: &mut SplitMix64, ty: KeyType, n: usize, domain: u64, null_pct: u64) -> Cells {
    if let KeyType::UuidText = ty {
        let spellings: Vec<(Option<u64>, u64)> = (0..n)
            .map(|_| {
                (
                    (!rng.chance(null_pct)).then(|| rng.below(domain)),
                    rng.below(3),
                )
            })
            .collect();
        let spell = |(value, case): (Option<u64>, u64)| {
            value.map(|v| {
                let text = format!("{v:08x}-0000-4000-8000-00000000a{:03x}", v % 3);
                match case {
                    0 => text,
                    1 => text.to_uppercase(),
                    _ => text.replacen('a', "A", 1),
                }
            })
        };
        return Cells::Text(spellings.into_iter().map(spell).collect());
    }
    let mut pick = || (!rng.chance(null_pct)).then(|| rng.below(domain));
    match ty {
        KeyType::Int => Cells::Int((0..n).map(|_| pick().map(|v| v as i64 - 3)).collect()),
        KeyType::Text => Cells::Text((0..n).map(|_| pick().map(|v| format!("k{v}"))).collect()),
        KeyType::UuidText => unreachable!("handled above"),
        KeyType::Uuid => Cells::Uuid(
            (0..n)
                .map(|_| pick().map(|v| (u128::from(v) * 0x1234_5678_9abc).to_le_bytes()))
                .collect(),
        ),
    }
}

fn version_cells(rng: &mut SplitMix64, ty: VersionType, n: usize, domain: u64) -> Cells {
    let mut pick = || (!rng.chance(5)).then(|| rng.below(domain));
    match ty {
        VersionType::Signed => Cells::Int((0..n).map(|_| pick().map(|v| v as i64 - 2)).collect()),
        VersionType::Unsigned => Cells::Unsigned(
            (0..n)
                .map(|_| pick().map(|v| if v == 0 { u64::MAX } else { v + (1 << 63) - 3 }))
                .collect(),
        ),
        VersionType::Lsn => Cells::Text(
            (0..n)
                .map(|_| pick().map(|v| format!("{:X}/{:X}", v % 3, (v * 37) % 300)))
                .collect(),
        ),
        VersionType::Decimal => Cells::Decimal(
            (0..n)
                .map(|_| pick().map(|v| i128::from(v) * 10 - 25))
                .collect(),
        ),
    }
}

/// Builds a physical array for one batch; text may come as plain, dictionary or view.
fn array(cells: &Cells, rng: &mut SplitMix64, text_layout: bool) -> ArrayRef {
    match cells {
        Cells::Int(v) => Arc::new(Int64Array::from(v.clone())),
        Cells::Unsigned(v) => Arc::new(UInt64Array::from(v.clone())),
        Cells::Decimal(v) => Arc::new(
            Decimal128Array::from(v.clone())
                .with_precision_and_scale(20, 2)
                .expect("decimal"),
        ),
        Cells::Uuid(v) => Arc::new(
            FixedSizeBinaryArray::try_from_sparse_iter_with_size(v.iter().map(|o| o.as_ref()), 16)
                .expect("uuid"),
        ),
        Cells::Text(v) => {
            let strs: Vec<Option<&str>> = v.iter().map(|s| s.as_deref()).collect();
            match if text_layout { rng.below(3) } else { 0 } {
                0 => Arc::new(StringArray::from(strs)),
                1 => Arc::new(strs.into_iter().collect::<DictionaryArray<Int32Type>>()),
                _ => Arc::new(StringViewArray::from(strs)),
            }
        }
    }
}

/// A cell as the reference sees it: text for keys, a number for versions.
fn display(array: &ArrayRef, row: usize) -> Option<String> {
    let formatter = ArrayFormatter::try_new(array.as_ref(), &FormatOptions::default()).ok()?;
    array
        .is_valid(row)
        .then(|| formatter.value(row).to_string())
}

fn number(array: &ArrayRef, row: usize) -> Option<i128> {
    if array.is_null(row) {
        return None;
    }
    Some(match array.data_type() {
        DataType::Int64 => i128::from(
            array
                .as_primitive::<arrow::datatypes::Int64Type>()
                .value(row),
        ),
        DataType::UInt64 => i128::from(
            array
                .as_primitive::<arrow::datatypes::UInt64Type>()
                .value(row),
        ),
        DataType::Decimal128(_, _) => array
            .as_primitive::<arrow::datatypes::Decimal128Type>()
            .value(row),
        _ => i128::from(parse_pg_lsn(&display(array, row)?)?),
    })
}

struct Case {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    spec: DedupSpec,
}

fn draw_case(rng: &mut SplitMix64) -> Case {
    let key_types = [
        KeyType::Int,
        KeyType::Text,
        KeyType::Uuid,
        KeyType::UuidText,
    ];
    let version_types = [
        VersionType::Signed,
        VersionType::Unsigned,
        VersionType::Lsn,
        VersionType::Decimal,
    ];
    let num_keys = 1 + rng.below(2) as usize;
    let num_versions = rng.below(3) as usize; // 0: every row of a key ties
    let keys: Vec<KeyType> = (0..num_keys)
        .map(|_| key_types[rng.below(4) as usize])
        .collect();
    let versions: Vec<VersionType> = (0..num_versions)
        .map(|_| version_types[rng.below(4) as usize])
        .collect();
    let key_domain = 1 + rng.below(12);
    let version_domain = 1 + rng.below(6);
    let null_pct = [0, 5, 30][rng.below(3) as usize];
    let with_deletes = rng.chance(60);

    let mut batches = Vec::new();
    let mut schema: Option<SchemaRef> = None;
    for _ in 0..1 + rng.below(4) {
        let n = rng.below(40) as usize;
        let mut fields = Vec::new();
        let mut columns = Vec::new();
        for (i, ty) in keys.iter().enumerate() {
            let cells = key_cells(rng, *ty, n, key_domain, null_pct);
            columns.push(array(&cells, rng, true));
            fields.push(Field::new(
                format!("k{i}"),
                columns[columns.len() - 1].data_type().clone(),
                true,
            ));
        }
        for (i, ty) in versions.iter().enumerate() {
            let cells = version_cells(rng, *ty, n, version_domain);
            columns.push(array(&cells, rng, true));
            fields.push(Field::new(
                format!("v{i}"),
                columns[columns.len() - 1].data_type().clone(),
                true,
            ));
        }
        let ops: Vec<&str> = (0..n)
            .map(|_| if rng.chance(20) { "d" } else { "u" })
            .collect();
        columns.push(Arc::new(StringArray::from(ops)));
        fields.push(Field::new("op", DataType::Utf8, false));
        let payload: Vec<i32> = (0..n).map(|_| rng.below(2) as i32).collect();
        columns.push(Arc::new(Int32Array::from(payload)));
        fields.push(Field::new("payload", DataType::Int32, false));
        let batch_schema = Arc::new(Schema::new(fields));
        schema.get_or_insert_with(|| Arc::clone(&batch_schema));
        batches.push(RecordBatch::try_new(batch_schema, columns).expect("batch"));
    }
    let on_tie = [TiePolicy::First, TiePolicy::Last][rng.below(2) as usize];
    let mut options = DedupOptions::default().with_on_tie(on_tie);
    if with_deletes {
        let mut deletes = DeletePolicy::new("op");
        deletes.keep_tombstones = rng.chance(30);
        options = options.with_deletes(deletes);
    }
    let spec = DedupSpec::new(
        (0..num_keys).map(|i| format!("k{i}")),
        (0..num_versions).map(|i| format!("v{i}")),
    )
    .with_options(options);
    Case {
        schema: schema.expect("at least one batch"),
        batches,
        spec,
    }
}

#[derive(Debug, PartialEq, Default)]
struct Outcome {
    keep: Vec<u64>,
    rows_out: u64,
    duplicates: u64,
    superseded: u64,
    deleted: u64,
    conflicts: u64,
    null_keys: u64,
}

/// The reference: materialise every row, sort by (key, version descending, input order),
/// take the head of each key group.
fn reference(case: &Case) -> Outcome {
    struct Row {
        key: Vec<Option<String>>,
        version: Vec<Option<i128>>,
        tombstone: bool,
        content: (String, i32),
        position: u64,
    }
    let mut rows = Vec::new();
    let mut position = 0;
    for batch in &case.batches {
        for r in 0..batch.num_rows() {
            let col = |name: &str| Arc::clone(batch.column_by_name(name).expect("column"));
            rows.push(Row {
                key: case.spec.keys.iter().map(|k| display(&col(k), r)).collect(),
                version: case
                    .spec
                    .versions
                    .iter()
                    .map(|v| number(&col(v), r))
                    .collect(),
                tombstone: case.spec.options.deletes.is_some()
                    && display(&col("op"), r).as_deref() == Some("d"),
                content: (
                    format!(
                        "{:?} {:?}",
                        display(&col("op"), r),
                        case.spec
                            .versions
                            .iter()
                            .map(|v| number(&col(v), r))
                            .collect::<Vec<_>>()
                    ),
                    col("payload")
                        .as_primitive::<arrow::datatypes::Int32Type>()
                        .value(r),
                ),
                position,
            });
            position += 1;
        }
    }
    let last = case.spec.options.on_tie == TiePolicy::Last;
    rows.sort_by(|a, b| {
        a.key
            .cmp(&b.key)
            .then(b.version.cmp(&a.version))
            .then(if last {
                b.position.cmp(&a.position)
            } else {
                a.position.cmp(&b.position)
            })
    });
    let keep_tombstones = case
        .spec
        .options
        .deletes
        .as_ref()
        .is_some_and(|d| d.keep_tombstones);
    let mut out = Outcome::default();
    let mut groups: BTreeMap<Vec<Option<String>>, Vec<&Row>> = BTreeMap::new();
    for row in &rows {
        out.null_keys += u64::from(row.key.iter().any(Option::is_none));
        groups.entry(row.key.clone()).or_default().push(row);
    }
    for group in groups.values() {
        let winner = group[0];
        let tied: Vec<&&Row> = group
            .iter()
            .filter(|r| r.version == winner.version)
            .collect();
        out.duplicates += tied.len() as u64 - 1;
        out.superseded += (group.len() - tied.len()) as u64;
        if tied.iter().any(|r| r.content != winner.content) {
            out.conflicts += 1;
        }
        if winner.tombstone && !keep_tombstones {
            out.deleted += 1;
        } else {
            out.keep.push(winner.position);
            out.rows_out += 1;
        }
    }
    out.keep.sort_unstable();
    out
}

fn kernel(case: &Case, generic_keys: bool) -> Outcome {
    let mut table = KeepMaxTable::try_new(&case.schema, &case.spec).expect("table");
    if generic_keys {
        table = table.with_generic_keys();
    }
    for batch in &case.batches {
        table.update(batch).expect("update");
    }
    outcome(case, table.finish())
}

/// Compares the resolution's tie rows by content, batch by batch as a file reader would.
fn outcome(case: &Case, resolution: idem_core::Resolution) -> Outcome {
    let mut check =
        TieCheck::try_new(&case.schema, &case.spec, resolution.tie_groups).expect("check");
    let mut offset = 0u64;
    for batch in &case.batches {
        let end = offset + batch.num_rows() as u64;
        let (rows, groups): (Vec<u64>, Vec<u32>) = resolution
            .tie_rows
            .iter()
            .filter(|t| (offset..end).contains(&t.position))
            .map(|t| (t.position - offset, t.group))
            .unzip();
        let taken =
            arrow::compute::take_record_batch(batch, &UInt64Array::from(rows)).expect("take");
        check.observe(&taken, &groups).expect("observe");
        offset = end;
    }
    let stats = resolution.stats;
    assert!(stats.is_consistent(), "{stats:?}");
    Outcome {
        keep: resolution.keep,
        rows_out: stats.rows_out,
        duplicates: stats.duplicates,
        superseded: stats.superseded,
        deleted: stats.deleted,
        conflicts: check.conflicts(),
        null_keys: stats.null_keys,
    }
}

/// The kernel one key partition at a time, as a memory-limited run does: rows routed by
/// key hash, each partition's table fed its rows with their original positions (in
/// reverse batch order for even partition counts).
fn partitioned_kernel(case: &Case, partitions: u32) -> Outcome {
    let mut router = KeyRouter::try_new(&case.schema, &case.spec.keys).expect("router");
    let mut routed: Vec<Vec<(RecordBatch, UInt64Array)>> = vec![Vec::new(); partitions as usize];
    let mut offset = 0u64;
    let mut parts = Vec::new();
    for batch in &case.batches {
        router.route(batch, partitions, &mut parts).expect("route");
        for (p, rows) in routed.iter_mut().enumerate() {
            let mine: Vec<u64> = (0..batch.num_rows() as u64)
                .filter(|&r| parts[r as usize] == p as u32)
                .collect();
            let positions = UInt64Array::from(mine.iter().map(|r| r + offset).collect::<Vec<_>>());
            let taken =
                arrow::compute::take_record_batch(batch, &UInt64Array::from(mine)).expect("take");
            rows.push((taken, positions));
        }
        offset += batch.num_rows() as u64;
    }
    let mut total = Outcome::default();
    for mut rows in routed {
        // Interleaved partitions deliver batches out of order; ties must not notice.
        if partitions.is_multiple_of(2) {
            rows.reverse();
        }
        let mut table = KeepMaxTable::try_new(&case.schema, &case.spec).expect("table");
        for (batch, positions) in &rows {
            table.update_at(batch, positions).expect("update");
        }
        add_outcome(&mut total, outcome(case, table.finish()));
    }
    total.keep.sort_unstable();
    total
}

fn add_outcome(total: &mut Outcome, part: Outcome) {
    total.keep.extend(part.keep);
    total.rows_out += part.rows_out;
    total.duplicates += part.duplicates;
    total.superseded += part.superseded;
    total.deleted += part.deleted;
    total.conflicts += part.conflicts;
    total.null_keys += part.null_keys;
}

/// The kernel as pass 1 runs it in memory: every batch encoded once by a preparer, split
/// by key hash into `parts`, each part consumed by its own table. Pass 1's workers take
/// the input's pieces in no fixed order, so the batches reach the tables in an order
/// shuffled by `order_seed` (0: input order), each with their original positions.
fn split_kernel(case: &Case, parts: u32, generic_keys: bool, order_seed: u64) -> Outcome {
    let mut tables: Vec<KeepMaxTable> = (0..parts)
        .map(|_| {
            let table = KeepMaxTable::try_new(&case.schema, &case.spec).expect("table");
            if generic_keys {
                table.with_generic_keys()
            } else {
                table
            }
        })
        .collect();
    let preparer = tables[0].preparer();
    let mut first = 0u64;
    let mut splits = Vec::new();
    for batch in &case.batches {
        let mut prepared = PreparedRows::default();
        preparer
            .prepare_into(batch, |row| first + row as u64, &mut prepared)
            .expect("prepare");
        assert_eq!(prepared.len(), batch.num_rows());
        let split = prepared.split(parts);
        assert_eq!(
            split.iter().map(|p| p.len()).sum::<usize>(),
            batch.num_rows()
        );
        splits.push(split);
        first += batch.num_rows() as u64;
    }
    let mut rng = SplitMix64::new(order_seed);
    for i in (1..splits.len()).rev() {
        if order_seed != 0 {
            splits.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    for split in &splits {
        for (table, part) in tables.iter_mut().zip(split) {
            table.update_prepared(part).expect("update");
        }
    }
    // The winners of all tables in one set, as pass 1 gathers them.
    let mut keep = PositionBits::with_capacity(first / 2);
    let mut total = Outcome::default();
    for table in tables {
        let marked = table.finish_marking(&mut keep);
        add_outcome(&mut total, outcome(case, marked.with_keep(Vec::new())));
    }
    total.keep = keep.iter_in(0, first).collect();
    total
}

/// The case's batches cast to its first batch's schema (layouts differ from batch to batch).
fn conform_batches(case: &Case) -> Vec<RecordBatch> {
    case.batches
        .iter()
        .map(|b| {
            let columns = case
                .schema
                .fields()
                .iter()
                .map(|f| {
                    arrow::compute::cast(b.column_by_name(f.name()).expect("column"), f.data_type())
                        .expect("cast")
                })
                .collect();
            RecordBatch::try_new(Arc::clone(&case.schema), columns).expect("batch")
        })
        .collect()
}

#[test]
fn kernel_matches_reference_on_random_batches() {
    for seed in 0..600 {
        let mut rng = SplitMix64::new(seed);
        let case = draw_case(&mut rng);
        let expected = reference(&case);
        for generic in [false, true] {
            let got = kernel(&case, generic);
            assert_eq!(
                got, expected,
                "seed {seed}, generic keys {generic}, spec {:?}",
                case.spec
            );
        }
        let parts = 1 + (seed % 3) as u32;
        let generic = seed % 2 == 1;
        for order_seed in [0, seed + 1] {
            assert_eq!(
                split_kernel(&case, parts, generic, order_seed),
                expected,
                "seed {seed}, prepared rows split {parts} ways, generic keys {generic}, \
                 batch order {order_seed}, spec {:?}",
                case.spec
            );
        }
        let partitions = 1 + (seed % 5) as u32;
        assert_eq!(
            partitioned_kernel(&case, partitions),
            expected,
            "seed {seed}, {partitions} key partitions, spec {:?}",
            case.spec
        );
        // The in-memory pipeline gathers exactly the winning rows, in input order.
        let conformed = conform_batches(&case);
        let (out, stats) =
            idem_core::dedup_batches(&case.schema, &conformed, &case.spec).expect("in memory");
        assert_eq!(stats.conflicts, expected.conflicts, "seed {seed}");
        let all = arrow::compute::concat_batches(&case.schema, &conformed).expect("concat");
        let winners =
            arrow::compute::take_record_batch(&all, &UInt64Array::from(expected.keep.clone()))
                .expect("take");
        let out = arrow::compute::concat_batches(&case.schema, &out).expect("concat");
        assert_eq!(out, winners, "seed {seed}");
    }
}

#[test]
fn tie_error_names_the_key() {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("lsn", DataType::Int64, false),
        Field::new("status", DataType::Utf8, false),
    ]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(StringArray::from(vec!["a", "b", "a", "b"])),
            Arc::new(Int64Array::from(vec![1, 1, 1, 1])),
            Arc::new(StringArray::from(vec!["x", "y", "x", "z"])),
        ],
    )
    .expect("batch");
    let spec = DedupSpec::new(["id"], ["lsn"])
        .with_options(DedupOptions::default().with_on_tie(TiePolicy::Error));
    let err = idem_core::dedup_batches(&schema, std::slice::from_ref(&batch), &spec)
        .expect_err("conflict");
    assert!(err.to_string().contains("id=b"), "{err}");
    let (out, stats) = idem_core::dedup_batches(
        &schema,
        &[batch],
        &spec.with_options(DedupOptions::default()),
    )
    .expect("first");
    assert_eq!(
        (
            out.iter().map(RecordBatch::num_rows).sum::<usize>(),
            stats.duplicates,
            stats.conflicts
        ),
        (2, 2, 1)
    );
}
