//! Records decoded as edl `Sample`s into NumPy arrays, with no Python object per value:
//! `dense` (float32, one row per record), `label` (int64 class ids or float32 values, when
//! the records have labels), and when any record has sparse ids `sparse_ids` (uint64,
//! every record's ids one after another), `sparse_offsets` (int64, record `i`'s ids are
//! `sparse_ids[sparse_offsets[i]:sparse_offsets[i+1]]`) and, when any record weights
//! them, `sparse_values` (float32, beside `sparse_ids`; 1 where a record gives none).

use edl_proto::sample::{self, sample::Label};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::value_error;

/// The columns of a batch of samples.
#[derive(Debug, Default)]
struct Columns {
    n: usize,
    dim: usize,
    dense: Vec<f32>,
    classes: Vec<i64>,
    values: Vec<f32>,
    sparse_ids: Vec<u64>,
    sparse_values: Vec<f32>,
    weighted: bool,
    offsets: Vec<i64>,
}

/// Decodes `records` into columns; the first record that does not fit is the error.
fn columns(records: &[&[u8]]) -> Result<Columns, String> {
    let mut c = Columns {
        n: records.len(),
        offsets: vec![0],
        ..Columns::default()
    };
    let mut kind: Option<&'static str> = None;
    for (i, bytes) in records.iter().enumerate() {
        let s = sample::decode(bytes).map_err(|e| format!("record {i}: {e}"))?;
        if i == 0 {
            c.dim = s.dense.len();
            c.dense.reserve(c.dim * records.len());
        } else if s.dense.len() != c.dim {
            return Err(format!(
                "record {i} has {} dense features, record 0 has {}: decode records of \
                 different shapes one by one, or as bytes",
                s.dense.len(),
                c.dim
            ));
        }
        c.dense.extend_from_slice(&s.dense);
        let this = match s.label {
            Some(Label::ClassId(k)) => {
                c.classes.push(i64::from(k));
                "class ids"
            }
            Some(Label::Value(v)) => {
                c.values.push(v);
                "values"
            }
            None => "no label",
        };
        match kind {
            None => kind = Some(this),
            Some(k) if k != this => {
                return Err(format!(
                    "record {i} has {this} as its label, the records before it {k}"
                ));
            }
            Some(_) => {}
        }
        if !s.sparse_values.is_empty() {
            if s.sparse_values.len() != s.sparse_ids.len() {
                return Err(format!(
                    "record {i} has {} sparse ids and {} sparse values",
                    s.sparse_ids.len(),
                    s.sparse_values.len()
                ));
            }
            if !c.weighted {
                c.weighted = true;
                c.sparse_values = vec![1.0; c.sparse_ids.len()];
            }
            c.sparse_values.extend_from_slice(&s.sparse_values);
        } else if c.weighted {
            c.sparse_values
                .extend(std::iter::repeat_n(1.0, s.sparse_ids.len()));
        }
        c.sparse_ids.extend_from_slice(&s.sparse_ids);
        c.offsets.push(c.sparse_ids.len() as i64);
    }
    Ok(c)
}

/// Decodes `records` into a dict of NumPy arrays (the module docs say which); the GIL is
/// released while decoding.
pub(crate) fn decode<'py>(py: Python<'py>, records: &[Vec<u8>]) -> PyResult<Bound<'py, PyDict>> {
    let slices: Vec<&[u8]> = records.iter().map(Vec::as_slice).collect();
    to_dict(py, py.detach(|| columns(&slices)))
}

fn to_dict(py: Python<'_>, c: Result<Columns, String>) -> PyResult<Bound<'_, PyDict>> {
    let c = c.map_err(|e| value_error(format!("not edl samples: {e}")))?;
    let out = PyDict::new(py);
    let dense = PyArray1::from_vec(py, c.dense).reshape([c.n, c.dim])?;
    out.set_item("dense", dense)?;
    if !c.classes.is_empty() {
        out.set_item("label", PyArray1::from_vec(py, c.classes))?;
    } else if !c.values.is_empty() {
        out.set_item("label", PyArray1::from_vec(py, c.values))?;
    }
    if !c.sparse_ids.is_empty() {
        out.set_item("sparse_ids", PyArray1::from_vec(py, c.sparse_ids))?;
        out.set_item("sparse_offsets", PyArray1::from_vec(py, c.offsets))?;
        if c.weighted {
            out.set_item("sparse_values", PyArray1::from_vec(py, c.sparse_values))?;
        }
    }
    Ok(out)
}

/// Decodes records (`bytes`, as `Task.records` gives them) as edl `Sample`s into NumPy
/// arrays: `dense`, `label`, and the sparse columns when there are any.
#[pyfunction]
pub(crate) fn decode_samples<'py>(
    py: Python<'py>,
    records: Vec<Bound<'py, PyBytes>>,
) -> PyResult<Bound<'py, PyDict>> {
    let slices: Vec<&[u8]> = records.iter().map(|b| b.as_bytes()).collect();
    let decoded = py.detach(|| columns(&slices));
    to_dict(py, decoded)
}
