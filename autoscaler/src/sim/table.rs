//! A small reader of the numeric CSV tables of the Pollux artifact (`name,time,...`
//! headers, one record per line, no quoting): columns found by name, every error naming
//! the file and the line.

use std::collections::HashMap;

/// Why a table could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{file}:{line}: {why}")]
pub struct TableError {
    /// The file (or the name it was given by).
    pub file: String,
    /// The line, from 1 (0: the file as a whole).
    pub line: usize,
    /// What is wrong, and what was expected.
    pub why: String,
}

/// A table's header and records.
#[derive(Debug, Clone)]
pub struct Table {
    file: String,
    columns: HashMap<String, usize>,
    /// (line number, fields) of each record.
    rows: Vec<(usize, Vec<String>)>,
}

impl Table {
    /// Parses `text`, read from `file`; blank lines are skipped.
    pub fn parse(file: &str, text: &str) -> Result<Table, TableError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
            .filter(|(_, l)| !l.trim().is_empty());
        let Some((_, header)) = lines.next() else {
            return Err(TableError {
                file: file.to_owned(),
                line: 0,
                why: "empty: a header line was expected".into(),
            });
        };
        let columns: HashMap<String, usize> = header
            .split(',')
            .enumerate()
            .map(|(i, c)| (c.trim().to_owned(), i))
            .collect();
        let width = header.split(',').count();
        let mut rows = Vec::new();
        for (line, text) in lines {
            let fields: Vec<String> = text.split(',').map(|f| f.trim().to_owned()).collect();
            if fields.len() != width {
                return Err(TableError {
                    file: file.to_owned(),
                    line,
                    why: format!("{} fields, the header has {width}", fields.len()),
                });
            }
            rows.push((line, fields));
        }
        Ok(Table {
            file: file.to_owned(),
            columns,
            rows,
        })
    }

    /// The index of column `name`, or an error naming the columns wanted.
    pub fn column(&self, name: &str) -> Result<usize, TableError> {
        self.columns.get(name).copied().ok_or_else(|| {
            let mut have: Vec<&str> = self.columns.keys().map(String::as_str).collect();
            have.sort_unstable();
            TableError {
                file: self.file.clone(),
                line: 1,
                why: format!("no column `{name}` (the header has {})", have.join(",")),
            }
        })
    }

    /// The records, each with its line number.
    pub fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.rows.iter().map(move |(line, fields)| Row {
            file: &self.file,
            line: *line,
            fields,
        })
    }

    /// How many records.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no records.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

/// One record of a [`Table`].
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    file: &'a str,
    /// Its line in the file, from 1.
    pub line: usize,
    fields: &'a [String],
}

impl Row<'_> {
    /// An error about this record.
    pub fn error(&self, why: impl Into<String>) -> TableError {
        TableError {
            file: self.file.to_owned(),
            line: self.line,
            why: why.into(),
        }
    }

    /// Field `column` as text.
    pub fn text(&self, column: usize) -> &str {
        &self.fields[column]
    }

    /// Field `column` as a finite number (`name` says which in the error).
    pub fn number(&self, column: usize, name: &str) -> Result<f64, TableError> {
        let text = self.text(column);
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => Err(self.error(format!("`{name}` is {text:?}, not a number"))),
        }
    }

    /// Field `column` as a whole number of at least `min`.
    pub fn whole(&self, column: usize, name: &str, min: u64) -> Result<u64, TableError> {
        let text = self.text(column);
        match text.parse::<u64>() {
            Ok(v) if v >= min => Ok(v),
            _ => Err(self.error(format!(
                "`{name}` is {text:?}, not a whole number of at least {min}"
            ))),
        }
    }
}
