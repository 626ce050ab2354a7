//! [`load_samples`]: reading a whole RecordIO data set of [`Sample`]s into memory;
//! [`load_records`]: the same as raw records (held-out splits, models that decode
//! their own records); [`check_split`]: whether a split's records fit a model, with how
//! to fix them if not.

use edl_proto::sample::{self, Sample};
use edl_recordio::{ReadOptions, Scanner, expand_globs};

use crate::error::{Error, Result};
use crate::model::Model;

/// How many records of a file [`check_split`] tries on the model.
const CHECK_RECORDS: usize = 64;

/// Reads every record of the files matched by `globs` (sorted, see
/// [`edl_recordio::expand_globs`]) and decodes it as a [`Sample`]. Strict: a corrupt
/// chunk or an undecodable record is an error naming the file.
pub fn load_samples(globs: &[String]) -> Result<Vec<Sample>> {
    let paths = expand_globs(globs)?;
    let mut scanner = Scanner::open(paths, ReadOptions::default())?;
    let mut samples = Vec::new();
    let mut record = 0u64;
    while let Some(bytes) = scanner.next_record()? {
        match sample::decode(bytes) {
            Ok(s) => samples.push(s),
            Err(source) => {
                return Err(Error::Decode {
                    path: scanner.current_path().map(Into::into).unwrap_or_default(),
                    record,
                    error: source,
                });
            }
        }
        record += 1;
    }
    Ok(samples)
}

/// Reads every record of the files matched by `globs` (sorted) as raw bytes. Strict: a
/// corrupt chunk is an error naming the file.
pub fn load_records(globs: &[String]) -> Result<Vec<Vec<u8>>> {
    let paths = expand_globs(globs)?;
    let mut scanner = Scanner::open(paths, ReadOptions::default())?;
    let mut records = Vec::new();
    while let Some(bytes) = scanner.next_record()? {
        records.push(bytes.to_vec());
    }
    Ok(records)
}

/// Checks that the first records of each file of a split fit `model` (feature
/// count, label kind, class ids), so that a job whose data was converted for another
/// kind of model fails once, at the start, naming the file and the fix, instead of
/// failing task after task. Reads at most 64 records per file.
pub fn check_split(model: &dyn Model, globs: &[String]) -> Result<()> {
    for path in expand_globs(globs)? {
        let mut scanner = Scanner::open(vec![path.clone()], ReadOptions::default())?;
        let mut records = Vec::new();
        while records.len() < CHECK_RECORDS {
            let Some(bytes) = scanner.next_record()? else {
                break;
            };
            records.push(bytes.to_vec());
        }
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
