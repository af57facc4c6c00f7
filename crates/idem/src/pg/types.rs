//! Arrow types in PostgreSQL, and back.
//!
//! ```text
//!   batch (Arrow)                          table (PostgreSQL)   read back as (Arrow)
//!   Boolean                                boolean              Boolean
//!   Int8 / Int16 / UInt8                   smallint             Int16
//!   Int32 / UInt16                         integer              Int32
//!   Int64 / UInt32                         bigint               Int64
//!   UInt64                                 numeric(20,0)        Decimal128(20, 0)
//!   Float16 / Float32                      real                 Float32
//!   Float64                                double precision     Float64
//!   Decimal32/64/128(p, s), 256 with p≤38  numeric(p,s)         Decimal128(p, s)
//!   Utf8 / LargeUtf8 / Utf8View / dict     text                 Utf8
//!     … as a version column (X/Y)          pg_lsn               Utf8, as X/Y in capitals
//!   Binary / LargeBinary / BinaryView      bytea                Binary
//!   FixedSizeBinary(16)                    uuid                 FixedSizeBinary(16)
//!   other FixedSizeBinary                  bytea                Binary
//!   Date32 / Date64 (whole days)           date                 Date32
//!   Timestamp(any unit, no zone)           timestamp            Timestamp(µs)
//!   Timestamp(any unit, any zone)          timestamptz          Timestamp(µs, "UTC")
//! ```
//!
//! A table that exists is taken as it is: each batch column goes into the table's type
//! where it is the same, or `varchar` for text, or a wider integer or `numeric` for an
//! integer (every value checked on conversion), or `double precision` for a `real`.

use std::sync::Arc;

use arrow::datatypes::{DataType, TimeUnit};

/// Largest precision of a decimal idem converts (Arrow's `Decimal128`).
const MAX_DECIMAL_PRECISION: u8 = 38;

/// A column type idem reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PgType {
    Bool,
    Int2,
    Int4,
    Int8,
    Float4,
    Float8,
    /// `numeric(p,s)`, or unconstrained `numeric` (`None`).
    Numeric(Option<(u8, i8)>),
    Text,
    Varchar,
    Bytea,
    Uuid,
    Date,
    Timestamp,
    Timestamptz,
    PgLsn,
}

impl PgType {
    /// The type of a catalog column (`pg_attribute.atttypid`, `atttypmod`), if idem has it.
    pub(crate) fn from_catalog(oid: u32, typmod: i32) -> Option<Self> {
        Some(match oid {
            16 => Self::Bool,
            21 => Self::Int2,
            23 => Self::Int4,
            20 => Self::Int8,
            700 => Self::Float4,
            701 => Self::Float8,
            1700 => Self::Numeric((typmod >= 4).then(|| {
                let modifier = typmod - 4;
                (
                    ((modifier >> 16) & 0xffff) as u8,
                    (modifier & 0xffff) as i16 as i8,
                )
            })),
            25 => Self::Text,
            1043 => Self::Varchar,
            17 => Self::Bytea,
            2950 => Self::Uuid,
            1082 => Self::Date,
            1114 => Self::Timestamp,
            1184 => Self::Timestamptz,
            3220 => Self::PgLsn,
            _ => return None,
        })
    }

    /// The type idem creates a column of `data_type` with; `Err` says why there is none.
    pub(crate) fn for_arrow(data_type: &DataType, is_version: bool) -> Result<Self, String> {
        use DataType::*;
        Ok(match data_type {
            Boolean => Self::Bool,
            Int8 | Int16 | UInt8 => Self::Int2,
            Int32 | UInt16 => Self::Int4,
            Int64 | UInt32 => Self::Int8,
            UInt64 => Self::Numeric(Some((20, 0))),
            Float16 | Float32 => Self::Float4,
            Float64 => Self::Float8,
            Decimal32(p, s) | Decimal64(p, s) | Decimal128(p, s) | Decimal256(p, s) => {
                if *s < 0 || *p > MAX_DECIMAL_PRECISION {
                    return Err(format!(
                        "{data_type}: idem stores decimals of up to {MAX_DECIMAL_PRECISION} digits with a scale of 0 or more"
                    ));
                }
                Self::Numeric(Some((*p, *s)))
            }
            Utf8 | LargeUtf8 | Utf8View if is_version => Self::PgLsn,
            Utf8 | LargeUtf8 | Utf8View => Self::Text,
            Binary | LargeBinary | BinaryView => Self::Bytea,
            FixedSizeBinary(16) => Self::Uuid,
            FixedSizeBinary(_) => Self::Bytea,
            Dictionary(_, values) => Self::for_arrow(values, is_version)?,
            Date32 | Date64 => Self::Date,
            Timestamp(_, None) => Self::Timestamp,
            Timestamp(_, Some(_)) => Self::Timestamptz,
            other => {
                return Err(format!(
                    "{other} has no PostgreSQL column type in idem: cast it to one of the mapped types (see docs/postgres.md)"
                ));
            }
        })
    }

    /// The Arrow type values of this column are read back as, and compared in. An
    /// unconstrained `numeric` takes the batch's decimal scale (`batch`).
    pub(crate) fn arrow(&self, batch: &DataType) -> DataType {
        match self {
            Self::Bool => DataType::Boolean,
            Self::Int2 => DataType::Int16,
            Self::Int4 => DataType::Int32,
            Self::Int8 => DataType::Int64,
            Self::Float4 => DataType::Float32,
            Self::Float8 => DataType::Float64,
            Self::Numeric(Some((p, s))) => {
                DataType::Decimal128((*p).min(MAX_DECIMAL_PRECISION), *s)
            }
            Self::Numeric(None) => match batch {
                DataType::Decimal32(_, s)
                | DataType::Decimal64(_, s)
                | DataType::Decimal128(_, s)
                | DataType::Decimal256(_, s) => DataType::Decimal128(MAX_DECIMAL_PRECISION, *s),
                _ => DataType::Decimal128(MAX_DECIMAL_PRECISION, 0),
            },
            Self::Text | Self::Varchar | Self::PgLsn => DataType::Utf8,
            Self::Bytea => DataType::Binary,
            Self::Uuid => DataType::FixedSizeBinary(16),
            Self::Date => DataType::Date32,
            Self::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, None),
            Self::Timestamptz => DataType::Timestamp(TimeUnit::Microsecond, Some(Arc::from("UTC"))),
        }
    }

    /// The type's SQL name, for `CREATE TABLE` and messages.
    pub(crate) fn sql(&self) -> String {
        match self {
            Self::Bool => "boolean".to_owned(),
            Self::Int2 => "smallint".to_owned(),
            Self::Int4 => "integer".to_owned(),
            Self::Int8 => "bigint".to_owned(),
            Self::Float4 => "real".to_owned(),
            Self::Float8 => "double precision".to_owned(),
            Self::Numeric(Some((p, s))) => format!("numeric({p},{s})"),
            Self::Numeric(None) => "numeric".to_owned(),
            Self::Text => "text".to_owned(),
            Self::Varchar => "varchar".to_owned(),
            Self::Bytea => "bytea".to_owned(),
            Self::Uuid => "uuid".to_owned(),
            Self::Date => "date".to_owned(),
            Self::Timestamp => "timestamp".to_owned(),
            Self::Timestamptz => "timestamptz".to_owned(),
            Self::PgLsn => "pg_lsn".to_owned(),
        }
    }

    fn integral(&self) -> bool {
        matches!(
            self,
            Self::Int2
                | Self::Int4
                | Self::Int8
                | Self::Numeric(Some((_, 0)))
                | Self::Numeric(None)
        )
    }

    /// Whether a batch column idem would create as `self` can be written into a table
    /// column of type `table` (values are checked one by one on conversion).
    pub(crate) fn storable_in(&self, table: &Self) -> bool {
        let text = |t: &Self| matches!(t, Self::Text | Self::Varchar);
        self == table
            || (text(self) && text(table))
            || (self.integral() && table.integral())
            || matches!((self, table), (Self::Float4, Self::Float8))
            || matches!((self, table), (Self::Numeric(Some((_, a))), Self::Numeric(Some((_, b))))
                if a == b)
            || matches!((self, table), (Self::Numeric(Some(_)), Self::Numeric(None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_types_read_their_modifiers() {
        // numeric(20,0) is stored as typmod (20 << 16 | 0) + 4.
        assert_eq!(
            PgType::from_catalog(1700, (20 << 16) + 4),
            Some(PgType::Numeric(Some((20, 0))))
        );
        assert_eq!(
            PgType::from_catalog(1700, (12 << 16 | 3) + 4),
            Some(PgType::Numeric(Some((12, 3))))
        );
        assert_eq!(PgType::from_catalog(1700, -1), Some(PgType::Numeric(None)));
        assert_eq!(PgType::from_catalog(3220, -1), Some(PgType::PgLsn));
        assert_eq!(PgType::from_catalog(114, -1), None, "json is not mapped");
    }

    #[test]
    fn arrow_types_map_both_ways() {
        let u64_type = PgType::for_arrow(&DataType::UInt64, true).expect("u64");
        assert_eq!(u64_type.sql(), "numeric(20,0)");
        assert_eq!(
            u64_type.arrow(&DataType::UInt64),
            DataType::Decimal128(20, 0)
        );
        assert_eq!(PgType::for_arrow(&DataType::Utf8, true), Ok(PgType::PgLsn));
        assert_eq!(PgType::for_arrow(&DataType::Utf8, false), Ok(PgType::Text));
        assert_eq!(
            PgType::for_arrow(&DataType::FixedSizeBinary(16), false),
            Ok(PgType::Uuid)
        );
        assert_eq!(
            PgType::for_arrow(
                &DataType::Timestamp(TimeUnit::Nanosecond, Some("+02:00".into())),
                false
            )
            .map(|t| t.arrow(&DataType::Null)),
            Ok(DataType::Timestamp(
                TimeUnit::Microsecond,
                Some("UTC".into())
            ))
        );
        let err = PgType::for_arrow(&DataType::Time64(TimeUnit::Microsecond), false)
            .expect_err("no time type");
        assert!(err.contains("Time64"), "{err}");
    }

    #[test]
    fn existing_columns_take_compatible_types_only() {
        assert!(PgType::Int4.storable_in(&PgType::Int8));
        assert!(
            PgType::Int8.storable_in(&PgType::Int4),
            "checked value by value"
        );
        assert!(PgType::Text.storable_in(&PgType::Varchar));
        assert!(!PgType::Text.storable_in(&PgType::Int8));
        assert!(!PgType::Int8.storable_in(&PgType::Text));
        assert!(!PgType::Timestamp.storable_in(&PgType::Timestamptz));
        assert!(!PgType::Numeric(Some((10, 2))).storable_in(&PgType::Numeric(Some((10, 3)))));
    }
}
