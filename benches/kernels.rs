//! Criterion micro-benchmarks of the dedup kernels over prepared batches, per key shape
//! (integer, UUID text, dictionary of UUID text, text + integer), distinct-key ratio and
//! share of null keys:
//!
//! * `key_hash` — hashing the key columns and encoding them for the key table;
//! * `keep_max_update` — the keep-max table (probe / insert, keep-max update, finish), the
//!   specialised single-integer table and the generic encoded-bytes one side by side;
//! * `split` — prepared rows (keys encoded and hashed, versions, positions) split by key
//!   hash between two key tables, as the two workers of a dedup's first pass split them;
//! * `winners` — the whole in-memory dedup, winning rows materialised.
//!
//! The end-to-end comparison with other tools is a separate suite (`peers.py`).

use std::sync::Arc;

use arrow::array::{ArrayRef, DictionaryArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::Int32Type;
use criterion::measurement::WallTime;
use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main,
};
use idem_core::key::{KeyLayout, KeyRows};
use idem_core::rng::SplitMix64;
use idem_core::{DedupSpec, KeepMaxTable, PreparedRows, dedup_batches};

const ROWS: usize = 1 << 20;
const BATCH: usize = 8192;

const SHAPES: [&str; 4] = ["int", "string", "dictionary", "string+int"];

/// `ROWS` rows in batches, keys drawn from `distinct` values with `null_pct` % nulls, with
/// the given key shape.
fn batches(shape: &str, distinct: u64, null_pct: u64) -> Vec<RecordBatch> {
    let mut rng = SplitMix64::new(7);
    (0..ROWS / BATCH)
        .map(|_| {
            let ids: Vec<Option<u64>> = (0..BATCH)
                .map(|_| (!rng.chance(null_pct)).then(|| rng.below(distinct)))
                .collect();
            let lsn: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (0..BATCH).map(|_| rng.below(1000) as i64),
            ));
            let text = || -> Vec<Option<String>> {
                ids.iter()
                    .map(|i| i.map(|i| format!("{:08x}-4e1c-8f00-0000-{:012x}", i, i * 31)))
                    .collect()
            };
            let mut columns: Vec<(&str, ArrayRef)> = match shape {
                "int" => vec![(
                    "id",
                    Arc::new(Int64Array::from_iter(
                        ids.iter().map(|i| i.map(|i| i as i64)),
                    )),
                )],
                "string" => vec![("id", Arc::new(StringArray::from(text())))],
                "dictionary" => vec![(
                    "id",
                    Arc::new(
                        text()
                            .iter()
                            .map(Option::as_deref)
                            .collect::<DictionaryArray<Int32Type>>(),
                    ),
                )],
                _ => vec![
                    ("id", Arc::new(StringArray::from(text()))),
                    (
                        "seq",
                        Arc::new(Int64Array::from_iter_values(
                            ids.iter().map(|i| i.map_or(0, |i| (i % 3) as i64)),
                        )),
                    ),
                ],
            };
            columns.push(("lsn", lsn));
            RecordBatch::try_from_iter(columns).expect("batch")
        })
        .collect()
}

fn key_columns(shape: &str) -> Vec<&'static str> {
    if shape == "string+int" {
        vec!["id", "seq"]
    } else {
        vec!["id"]
    }
}

/// A group whose every benchmark handles `ROWS` rows, 10 samples each (the larger inputs
/// take seconds per sample).
fn rows_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(ROWS as u64));
    group.sample_size(10);
    group
}

fn key_hash(c: &mut Criterion) {
    let mut group = rows_group(c, "key_hash");
    for shape in SHAPES {
        let input = batches(shape, 700_000, 0);
        let schema = input[0].schema();
        let names = key_columns(shape);
        let fields: Vec<_> = names
            .iter()
            .map(|n| schema.field_with_name(n).expect("key").clone())
            .collect();
        let layout = KeyLayout::try_new(&fields).expect("layout");
        let columns: Vec<Vec<ArrayRef>> = input
            .iter()
            .map(|b| {
                names
                    .iter()
                    .map(|n| Arc::clone(b.column_by_name(n).expect("key")))
                    .collect()
            })
            .collect();
        group.bench_with_input(BenchmarkId::new("hash", shape), &columns, |b, columns| {
            let mut hashes = Vec::new();
            b.iter(|| {
                for batch in columns {
                    layout
                        .canonicalise(batch)
                        .expect("keys")
                        .hash_rows(&mut hashes);
                }
                hashes.len()
            });
        });
        group.bench_with_input(BenchmarkId::new("encode", shape), &columns, |b, columns| {
            let mut rows = KeyRows::default();
            b.iter(|| {
                for batch in columns {
                    layout
                        .canonicalise(batch)
                        .expect("keys")
                        .encode_compact_rows(&mut rows);
                }
            });
        });
    }
    group.finish();
}

fn keep_max(c: &mut Criterion) {
    let mut group = rows_group(c, "keep_max_update");
    for shape in SHAPES {
        for (distinct, null_pct) in [(1_000u64, 0), (700_000, 0), (700_000, 10)] {
            let input = batches(shape, distinct, null_pct);
            let spec = DedupSpec::new(key_columns(shape), ["lsn"]);
            let schema = input[0].schema();
            let tables: &[(&str, bool)] = if shape == "int" {
                &[("narrow", false), ("generic", true)]
            } else {
                &[("generic", true)]
            };
            for &(table_kind, generic) in tables {
                let id =
                    BenchmarkId::new(format!("{shape}/{table_kind}/nulls-{null_pct}%"), distinct);
                group.bench_with_input(id, &input, |b, input| {
                    b.iter(|| {
                        let mut table = KeepMaxTable::try_new(&schema, &spec).expect("table");
                        if generic {
                            table = table.with_generic_keys();
                        }
                        for batch in input {
                            table.update(batch).expect("update");
                        }
                        table.finish().keep.len()
                    });
                });
            }
        }
    }
    group.finish();
}

fn split(c: &mut Criterion) {
    let mut group = rows_group(c, "split");
    for shape in SHAPES {
        let input = batches(shape, 700_000, 0);
        let spec = DedupSpec::new(key_columns(shape), ["lsn"]);
        let preparer = KeepMaxTable::try_new(&input[0].schema(), &spec)
            .expect("table")
            .preparer();
        let prepared: Vec<PreparedRows> = input
            .iter()
            .map(|batch| {
                let mut rows = PreparedRows::default();
                preparer
                    .prepare_into(batch, |row| row as u64, &mut rows)
                    .expect("prepare");
                rows
            })
            .collect();
        group.bench_with_input(BenchmarkId::new("two", shape), &prepared, |b, prepared| {
            b.iter(|| {
                prepared
                    .iter()
                    .map(|rows| rows.split(2).iter().map(PreparedRows::len).sum::<usize>())
                    .sum::<usize>()
            });
        });
    }
    group.finish();
}

fn winners(c: &mut Criterion) {
    let mut group = rows_group(c, "winners");
    for distinct in [1_000u64, 700_000] {
        let input = batches("string+int", distinct, 0);
        let spec = DedupSpec::new(key_columns("string+int"), ["lsn"]);
        let schema = input[0].schema();
        group.bench_with_input(
            BenchmarkId::new("string+int", distinct),
            &input,
            |b, input| {
                b.iter(|| {
                    let (out, _) = dedup_batches(&schema, input, &spec).expect("dedup");
                    out.iter().map(RecordBatch::num_rows).sum::<usize>()
                });
            },
        );
    }
    group.finish();
}

criterion_group!(benches, key_hash, keep_max, split, winners);
criterion_main!(benches);
