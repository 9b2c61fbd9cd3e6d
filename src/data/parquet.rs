//! Parquet tables, read without Arrow: one string column (`tessera.data_field`), row group by
//! row group, each non-null value a document. Snappy and zstd pages are read (pyarrow and
//! Hugging Face `datasets` write Snappy by default); another codec is refused by the crate,
//! and the error names it and the file.

use std::fs::File;
use std::path::Path;

use ::parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use ::parquet::column::reader::ColumnReader;
use ::parquet::file::reader::{FileReader, SerializedFileReader};

use super::docs::{At, Origin, Unit};
use super::DataError;

/// Rows decoded from a column at a time.
const BATCH_ROWS: usize = 1024;

fn problem(path: &Path, problem: String) -> DataError {
    DataError::Parquet { path: path.to_path_buf(), problem }
}

/// Reads the string column `field` of Parquet file `path` (input `file`); a null is skipped.
pub fn read_parquet(path: &Path, file: usize, field: &str, emit: &mut dyn FnMut(Unit) -> Result<(), DataError>) -> Result<(), DataError> {
    let handle = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let reader = SerializedFileReader::new(handle).map_err(|e| problem(path, e.to_string()))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let columns: Vec<String> = (0..schema.num_columns()).map(|i| schema.column(i).path().string()).collect();
    let Some(index) = columns.iter().position(|c| c == field) else {
        let shown: Vec<&str> = columns.iter().map(String::as_str).take(8).collect();
        return Err(problem(
            path,
            format!("has no column `{field}` (its columns: {}); tessera.data_field names the text's column", shown.join(", ")),
        ));
    };
    let column = schema.column(index);
    let is_string = matches!(column.logical_type_ref(), Some(LogicalType::String)) || column.converted_type() == ConvertedType::UTF8;
    if column.physical_type() != PhysicalType::BYTE_ARRAY || !is_string || column.max_rep_level() > 0 {
        let kind = match column.max_rep_level() {
            0 => format!("{:?} ({:?})", column.physical_type(), column.logical_type_ref()),
            _ => "a list".to_string(),
        };
        return Err(problem(path, format!("column `{field}` holds {kind}, not strings")));
    }
    let required = column.max_def_level() == 0;
    let mut row = 0u64;
    for group in 0..reader.num_row_groups() {
        let group_reader = reader.get_row_group(group).map_err(|e| problem(path, format!("row group {group}: {e}")))?;
        let ColumnReader::ByteArrayColumnReader(mut values_reader) =
            group_reader.get_column_reader(index).map_err(|e| problem(path, format!("row group {group}: {e}")))?
        else {
            return Err(problem(path, format!("row group {group}: column `{field}` is not a byte-array column")));
        };
        let (mut values, mut levels) = (Vec::with_capacity(BATCH_ROWS), Vec::with_capacity(BATCH_ROWS));
        loop {
            values.clear();
            levels.clear();
            let (rows, _, _) = values_reader
                .read_records(BATCH_ROWS, (!required).then_some(&mut levels), None, &mut values)
                .map_err(|e| problem(path, format!("row group {group}: {e}")))?;
            if rows == 0 {
                break;
            }
            let mut present = values.drain(..);
            for r in 0..rows {
                // The values are packed: a null row (definition level below the max) has none.
                let is_null = !required && levels.get(r).is_none_or(|&l| l < column.max_def_level());
                if !is_null {
                    let value = present.next().ok_or_else(|| problem(path, format!("row {}: value missing", row + r as u64)))?;
                    emit(Unit::Value { bytes: value.data().to_vec(), origin: Origin { file, at: At::Row(row + r as u64) } })?;
                }
            }
            row += rows as u64;
        }
    }
    Ok(())
}
