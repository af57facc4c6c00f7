//! The aggregates `max_by(value, version)` and `min_by(value, version)`: the value of the
//! row with the greatest (smallest) version in each group, for any value type and the
//! version types idem orders (integers, dates, timestamps, decimals, pg_lsn text).
//!
//! ```sql
//! SELECT order_id, max_by(status, lsn) AS status FROM cdc GROUP BY order_id
//! ```
//!
//! Grouped aggregation runs [`PickByVersion`] through a [`GroupsAccumulator`]: one state
//! table for all groups, updated a batch at a time. Null versions are skipped; equal
//! versions go to the greater (`max_by`) or smaller (`min_by`) value, so results do not
//! depend on partitioning.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, BooleanArray};
use datafusion::arrow::datatypes::{DataType, Field, FieldRef};
use datafusion::arrow::error::ArrowError;
use datafusion::common::{Result, ScalarValue, internal_err, plan_datafusion_err};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, EmitTo, GroupsAccumulator, Signature, Volatility,
};
use idem_core::version::VersionLayout;
use idem_core::{Pick, PickByVersion, as_encoded_versions};

/// `max_by` or `min_by`; see the module docs.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct PickBy {
    pick: Pick,
    signature: Signature,
}

impl PickBy {
    /// The aggregate that keeps `pick`'s end of the version order.
    pub fn new(pick: Pick) -> Self {
        Self {
            pick,
            signature: Signature::any(2, Volatility::Immutable),
        }
    }
}

/// `max_by(value, version)` as a DataFusion aggregate.
pub fn max_by_udaf() -> AggregateUDF {
    AggregateUDF::from(PickBy::new(Pick::Max))
}

/// `min_by(value, version)` as a DataFusion aggregate.
pub fn min_by_udaf() -> AggregateUDF {
    AggregateUDF::from(PickBy::new(Pick::Min))
}

/// The version argument as a field, checked to be of a type idem can order.
fn version_field(name: &str, data_type: &DataType) -> Result<Field> {
    let field = Field::new("version", data_type.clone(), true);
    VersionLayout::try_new(std::slice::from_ref(&field)).map_err(|e| match e {
        ArrowError::InvalidArgumentError(message) => plan_datafusion_err!("{name}: {message}"),
        other => plan_datafusion_err!("{name}: {other}"),
    })?;
    Ok(field)
}

fn table(
    pick: Pick,
    name: &str,
    return_type: &DataType,
    fields: &[FieldRef],
) -> Result<PickByVersion> {
    let [_, version] = fields else {
        return internal_err!(
            "{name} takes (value, version), got {} arguments",
            fields.len()
        );
    };
    let version = version_field(name, version.data_type())?;
    Ok(PickByVersion::try_new(pick, return_type.clone(), &version)?)
}

impl AggregateUDFImpl for PickBy {
    fn name(&self) -> &str {
        match self.pick {
            Pick::Max => "max_by",
            Pick::Min => "min_by",
        }
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        let [value, version] = arg_types else {
            return internal_err!("{} takes (value, version)", self.name());
        };
        version_field(self.name(), version)?;
        Ok(value.clone())
    }

    fn is_nullable(&self) -> bool {
        true
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(Box::new(PickAccumulator {
            table: table(self.pick, self.name(), args.return_type(), args.expr_fields)?,
        }))
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        let width = table(
            self.pick,
            self.name(),
            args.return_type(),
            args.input_fields,
        )?
        .version_width();
        let width = i32::try_from(width).map_err(|_| plan_datafusion_err!("version too wide"))?;
        Ok(vec![
            Arc::new(Field::new(
                format_state_name(args.name, "value"),
                args.return_type().clone(),
                true,
            )),
            Arc::new(Field::new(
                format_state_name(args.name, "version"),
                DataType::FixedSizeBinary(width),
                true,
            )),
        ])
    }

    fn groups_accumulator_supported(&self, _args: AccumulatorArgs) -> bool {
        true
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        Ok(Box::new(PickGroupsAccumulator {
            table: table(self.pick, self.name(), args.return_type(), args.expr_fields)?,
        }))
    }
}

fn value_and_version(values: &[ArrayRef]) -> Result<(&ArrayRef, &ArrayRef)> {
    match values {
        [value, version] => Ok((value, version)),
        _ => internal_err!("max_by/min_by: expected 2 arrays, got {}", values.len()),
    }
}

fn emit_count(emit_to: EmitTo) -> Option<usize> {
    match emit_to {
        EmitTo::All => None,
        EmitTo::First(n) => Some(n),
    }
}

/// All groups of one `max_by` / `min_by` in one [`PickByVersion`].
#[derive(Debug)]
struct PickGroupsAccumulator {
    table: PickByVersion,
}

impl GroupsAccumulator for PickGroupsAccumulator {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        let (value, version) = value_and_version(values)?;
        Ok(self
            .table
            .update(value, version, group_indices, opt_filter, total_num_groups)?)
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        Ok(self.table.emit(emit_count(emit_to))?.0)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let (values, versions) = self.table.emit(emit_count(emit_to))?;
        Ok(vec![values, Arc::new(versions)])
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        let (value, versions) = value_and_version(values)?;
        Ok(self.table.merge(
            value,
            as_encoded_versions(versions)?,
            group_indices,
            total_num_groups,
        )?)
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        let (value, version) = value_and_version(values)?;
        let versions = self.table.encode_versions(version, opt_filter)?;
        Ok(vec![Arc::clone(value), Arc::new(versions)])
    }

    fn size(&self) -> usize {
        self.table.size()
    }
}

/// One group (an aggregate without `GROUP BY`, or a window frame).
#[derive(Debug)]
struct PickAccumulator {
    table: PickByVersion,
}

impl PickAccumulator {
    /// The current value and encoded version, leaving the state as it was (window frames
    /// evaluate repeatedly while rows keep arriving).
    fn current(&mut self) -> Result<(ArrayRef, ArrayRef)> {
        let (values, versions) = self.table.emit(None)?;
        if !values.is_empty() {
            self.table.merge(&values, &versions, &[0], 1)?;
        }
        Ok((values, Arc::new(versions)))
    }
}

fn first_or_null(array: &ArrayRef) -> Result<ScalarValue> {
    if array.is_empty() {
        ScalarValue::try_from(array.data_type())
    } else {
        ScalarValue::try_from_array(array, 0)
    }
}

impl Accumulator for PickAccumulator {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        let (value, version) = value_and_version(values)?;
        Ok(self
            .table
            .update(value, version, &vec![0; value.len()], None, 1)?)
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        first_or_null(&self.current()?.0)
    }

    fn size(&self) -> usize {
        std::mem::size_of_val(self) + self.table.size()
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        let (values, versions) = self.current()?;
        Ok(vec![first_or_null(&values)?, first_or_null(&versions)?])
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let (value, versions) = value_and_version(states)?;
        Ok(self.table.merge(
            value,
            as_encoded_versions(versions)?,
            &vec![0; value.len()],
            1,
        )?)
    }
}
