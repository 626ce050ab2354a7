//! [`load_samples`]: reading a whole RecordIO data set of [`Sample`]s into memory (local
//! files, and objects at `s3://`/`gs://`/`az://` URLs through `edl_storage`);
//! [`load_records`]: the same as raw records (held-out splits, models that decode
//! their own records); [`check_split`]: whether a split's records fit a model, with how
//! to fix them if not.

use edl_proto::sample::{self, Sample};
use std::path::{Path, PathBuf};

use edl_recordio::{ChunkReader, ReadOptions, Scanner, expand_globs};

use crate::error::{Error, Result};
use crate::model::Model;

/// How many records of a file [`check_split`] tries on the model.
const CHECK_RECORDS: usize = 64;

/// The files (and objects) `globs` match: local files first (sorted, see
/// [`edl_recordio::expand_globs`]), then the objects of the globs that are object URLs,
/// as the master indexes them.
fn sources(globs: &[String]) -> Result<Vec<PathBuf>> {
    let (urls, local): (Vec<String>, Vec<String>) = globs
        .iter()
        .cloned()
        .partition(|g| edl_storage::blocking::is_object_url(g));
    let mut out = if local.is_empty() {
        Vec::new()
    } else {
        expand_globs(&local)?
    };
    if !urls.is_empty() {
        out.extend(
            edl_storage::blocking::expand(&urls)?
                .into_iter()
                .map(|o| PathBuf::from(o.url)),
        );
    }
    Ok(out)
}

/// Calls `each` with every record of `source` (a file or an object URL), in order,
/// until it returns `false`. Strict: a corrupt chunk is an error naming the source.
fn for_each_record(source: &Path, mut each: impl FnMut(&[u8]) -> Result<bool>) -> Result<()> {
    let name = source.display().to_string();
    if edl_storage::blocking::is_object_url(&name) {
        let object = edl_storage::blocking::ObjectReader::open(&name)?;
        let mut chunks = ChunkReader::new(object, source.to_path_buf(), ReadOptions::default());
        while let Some(chunk) = chunks.next_chunk()? {
            for record in &chunk {
                if !each(record)? {
                    return Ok(());
                }
            }
        }
        return Ok(());
    }
    let mut scanner = Scanner::open(vec![source.to_path_buf()], ReadOptions::default())?;
    while let Some(bytes) = scanner.next_record()? {
        if !each(bytes)? {
            break;
        }
    }
    Ok(())
}

/// Reads every record of the files (and objects) matched by `globs` and decodes it as a
/// [`Sample`]. Strict: a corrupt chunk or an undecodable record is an error naming the
/// file.
pub fn load_samples(globs: &[String]) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    let mut record = 0u64;
    for source in sources(globs)? {
        for_each_record(&source, |bytes| {
            let s = sample::decode(bytes).map_err(|error| Error::Decode {
                path: source.clone(),
                record,
                error,
            })?;
            samples.push(s);
            record += 1;
            Ok(true)
        })?;
    }
    Ok(samples)
}

/// Reads every record of the files (and objects) matched by `globs` as raw bytes.
/// Strict: a corrupt chunk is an error naming the file.
pub fn load_records(globs: &[String]) -> Result<Vec<Vec<u8>>> {
    let mut records = Vec::new();
    for source in sources(globs)? {
        for_each_record(&source, |bytes| {
            records.push(bytes.to_vec());
            Ok(true)
        })?;
    }
    Ok(records)
}

/// Checks that the first records of each file of a split fit `model` (feature
/// count, label kind, class ids), so that a job whose data was converted for another
/// kind of model fails once, at the start, naming the file and the fix, instead of
/// failing task after task. Reads at most 64 records per file.
pub fn check_split(model: &dyn Model, globs: &[String]) -> Result<()> {
    for path in sources(globs)? {
        let mut records = Vec::new();
        for_each_record(&path, |bytes| {
            records.push(bytes.to_vec());
            Ok(records.len() < CHECK_RECORDS)
        })?;
        if records.is_empty() {
            continue;
        }
        if let Err(e) = model.prepare_records(&records, 0) {
            if !e.is_bad_data() {
                return Err(e);
            }
            return Err(Error::DataMismatch {
                path,
                hint: fix_hint(&e),
                detail: e.to_string(),
            });
        }
    }
    Ok(())
}

/// How to fix data that does not fit the model.
fn fix_hint(e: &Error) -> String {
    match e {
        Error::Label { expected, .. } if expected.contains("class id") => {
            "convert the data with `edl data convert --label class` (labels as integer class \
             ids), or use a regression model (linear, fit_a_line)"
                .into()
        }
        Error::Label { .. } => "convert the data with `edl data convert --label value` (the \
             default: real-valued labels), or use a classifier (mlp, mnist_mlp, mnist_cnn)"
            .into(),
        Error::FeatureCount { found, .. } => format!(
            "set `inputs = {found}` under [model] in the job spec, or convert the data with \
             the columns the model takes"
        ),
        Error::ClassOutOfRange { class, .. } => {
            format!("set `classes` under [model] to more than the largest class id ({class})")
        }
        _ => "check the data against the job spec's [model]".into(),
    }
}

#[cfg(test)]
mod tests {
    use edl_recordio::{FileWriter, WriterOptions};

    use super::*;

    #[test]
    fn loads_written_samples_and_names_bad_records() {
        let dir = tempfile::tempdir().unwrap();
        let samples = vec![
            Sample::regression(vec![1.0, 2.0], 3.0),
            Sample::classification(vec![0.5], 1),
            Sample::sparse(vec![0, 4, 2]),
        ];
        for (i, part) in [&samples[..2], &samples[2..]].iter().enumerate() {
            let mut w = FileWriter::create(
                dir.path().join(format!("part-{i}")),
                WriterOptions::default(),
            )
            .unwrap();
            for s in *part {
                w.write(&sample::encode(s)).unwrap();
            }
            w.finish().unwrap();
        }
        let glob = format!("{}/part-*", dir.path().display());
        assert_eq!(load_samples(std::slice::from_ref(&glob)).unwrap(), samples);
        let raw: Vec<Vec<u8>> = samples.iter().map(sample::encode).collect();
        assert_eq!(load_records(&[glob]).unwrap(), raw);

        let bad = dir.path().join("bad");
        let mut w = FileWriter::create(&bad, WriterOptions::default()).unwrap();
        w.write(&sample::encode(&samples[0])).unwrap();
        w.write(&[0xff, 0xff, 0xff]).unwrap();
        w.finish().unwrap();
        let err = load_samples(&[bad.display().to_string()]).unwrap_err();
        assert!(
            matches!(err, Error::Decode { record: 1, .. }),
            "expected a decode error for record 1, got {err:?}"
        );
        assert!(err.is_bad_data());
        assert!(err.to_string().contains("bad"), "{err}");

        let missing = format!("{}/nothing-*", dir.path().display());
        assert!(matches!(
            load_samples(&[missing]),
            Err(Error::RecordIo(edl_recordio::Error::NoMatch { .. }))
        ));
    }
}
