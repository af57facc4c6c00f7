//! Criterion micro-benchmarks of the dedup kernels: the keep-max table over prepared
//! batches, per key shape, with the specialised single-integer table and the generic
//! encoded-bytes table side by side. The end-to-end comparison with other tools is a
//! separate suite.

use std::sync::Arc;

use arrow::array::{ArrayRef, DictionaryArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::Int32Type;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem_core::rng::SplitMix64;
use idem_core::{DedupSpec, KeepMaxTable};

const ROWS: usize = 1 << 20;
const BATCH: usize = 8192;

/// `ROWS` rows in batches, keys drawn from `distinct` values, with the given key shape.
fn batches(shape: &str, distinct: u64) -> Vec<RecordBatch> {
    let mut rng = SplitMix64::new(7);
    (0..ROWS / BATCH)
        .map(|_| {
            let ids: Vec<u64> = (0..BATCH).map(|_| rng.below(distinct)).collect();
            let lsn: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (0..BATCH).map(|_| rng.below(1000) as i64),
            ));
            let text = || -> Vec<String> {
                ids.iter()
                    .map(|i| format!("{:08x}-4e1c-8f00-{:012x}", i, i * 31))
                    .collect()
            };
            let mut columns: Vec<(&str, ArrayRef)> = match shape {
                "int" => vec![(
                    "id",
                    Arc::new(Int64Array::from_iter_values(ids.iter().map(|&i| i as i64))),
                )],
                "string" => vec![("id", Arc::new(StringArray::from(text())))],
                "dictionary" => vec![(
                    "id",
                    Arc::new(
                        text()
                            .iter()
                            .map(String::as_str)
                            .collect::<DictionaryArray<Int32Type>>(),
                    ),
                )],
                _ => vec![
                    ("id", Arc::new(StringArray::from(text()))),
                    (
                        "seq",
                        Arc::new(Int64Array::from_iter_values(
                            ids.iter().map(|&i| (i % 3) as i64),
                        )),
                    ),
                ],
            };
            columns.push(("lsn", lsn));
            RecordBatch::try_from_iter(columns).expect("batch")
        })
        .collect()
}

fn keep_max(c: &mut Criterion) {
    let mut group = c.benchmark_group("keep_max_update");
    group.throughput(Throughput::Elements(ROWS as u64));
    group.sample_size(10);
    for shape in ["int", "string", "dictionary", "string+int"] {
        for distinct in [1_000u64, 700_000] {
            let input = batches(shape, distinct);
            let keys: Vec<&str> = if shape == "string+int" {
                vec!["id", "seq"]
            } else {
                vec!["id"]
            };
            let spec = DedupSpec::new(keys, ["lsn"]);
            let schema = input[0].schema();
            let tables: &[(&str, bool)] = if shape == "int" {
                &[("narrow", false), ("generic", true)]
            } else {
                &[("generic", true)]
            };
            for &(table_kind, generic) in tables {
                let id = BenchmarkId::new(format!("{shape}/{table_kind}"), distinct);
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

criterion_group!(benches, keep_max);
criterion_main!(benches);
