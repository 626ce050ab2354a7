//! [`Error`]: everything that can go wrong building a model, preparing a batch or
//! computing a step.

use std::path::PathBuf;

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the model layer. Data errors name the sample (its position in the batch) and
/// the model, so a bad record can be found. Only an I/O failure reading data is worth
/// retrying (see [`Error::is_retryable`]); [`Error::is_bad_data`] tells bad samples and
/// records apart from bad parameters or configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model spec is not valid (a zero size, stats of the wrong width, ...).
    #[error("invalid model spec for {model}: {reason}")]
    Spec {
        /// The model kind.
        model: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// The compute device cannot be used (no CUDA in this build, no driver, ...).
    #[error("device: {0}")]
    Device(String),

    /// A local training configuration is not valid.
    #[error("invalid local training config: {0}")]
    Config(String),

    /// A sample has the wrong number of dense features.
    #[error("sample {index} has {found} dense features, model {model} expects {expected}")]
    FeatureCount {
        /// The model kind.
        model: &'static str,
        /// Position of the sample in its batch (or data set).
        index: usize,
        /// Features found.
        found: usize,
        /// Features the model takes.
        expected: usize,
    },

    /// A feature is NaN or infinite.
    #[error(
        "sample {index} has a non-finite value {value} in dense feature {feature}, model {model}"
    )]
    NonFiniteFeature {
        /// The model kind.
        model: &'static str,
        /// Position of the sample in its batch.
        index: usize,
        /// The feature (0-based).
        feature: usize,
        /// The value found.
        value: f32,
    },

    /// A sample has no label, or a label of the wrong kind.
    #[error("sample {index} has {found}, model {model} needs {expected}")]
    Label {
        /// The model kind.
        model: &'static str,
        /// Position of the sample in its batch.
        index: usize,
        /// What was found ("no label", "a class id", "a real-valued label", "label NaN").
        found: String,
        /// What the model needs ("a class id", "a finite real-valued label").
        expected: &'static str,
    },

    /// A class id is not below the number of classes.
    #[error(
        "sample {index} has class id {class}, model {model} has {classes} classes (0..{classes})"
    )]
    ClassOutOfRange {
        /// The model kind.
        model: &'static str,
        /// Position of the sample in its batch.
        index: usize,
        /// The class id found.
        class: u32,
        /// Number of classes of the model.
        classes: usize,
    },

    /// A sparse id (word id) is not below the table size.
    #[error("sample {index} has sparse id {id}, model {model} has a vocabulary of {vocab_size}")]
    SparseIdOutOfRange {
        /// The model kind.
        model: &'static str,
        /// Position of the sample in its batch.
        index: usize,
        /// The id found.
        id: u64,
        /// Rows of the table.
        vocab_size: u64,
    },

    /// A batch has nothing to train on (no samples, or no word pairs).
    #[error("empty batch for model {model}: {reason}")]
    EmptyBatch {
        /// The model kind.
        model: &'static str,
        /// Why it is empty.
        reason: &'static str,
    },

    /// A batch prepared by one model was given to another.
    #[error("batch was prepared by model {batch}, not by {model}")]
    BatchMismatch {
        /// The model it was given to.
        model: &'static str,
        /// The model that prepared it.
        batch: &'static str,
    },

    /// The dense parameters given do not match the model's.
    #[error("model {model} has {expected} dense parameters, {found} were given")]
    ParamCount {
        /// The model kind.
        model: &'static str,
        /// Parameters given.
        found: usize,
        /// Parameters of the model.
        expected: usize,
    },

    /// A dense parameter has the wrong number of values.
    #[error("dense parameter {param} of model {model} has {found} values, expected {expected}")]
    ParamSize {
        /// The model kind.
        model: &'static str,
        /// The parameter's name.
        param: String,
        /// Values given.
        found: usize,
        /// Values expected (the product of its shape).
        expected: usize,
    },

    /// A sparse row the batch needs was not pulled.
    #[error("row {row} of sparse table {table} is missing from the parameters")]
    MissingSparseRow {
        /// The table.
        table: String,
        /// The row.
        row: u64,
    },

    /// A sparse row has the wrong width.
    #[error("row {row} of sparse table {table} has {found} values, expected {expected}")]
    SparseRowWidth {
        /// The table.
        table: String,
        /// The row.
        row: u64,
        /// Values given.
        found: usize,
        /// The table's dimension.
        expected: usize,
    },

    /// The loss came out NaN or infinite (diverged training or bad parameters).
    #[error("model {model} computed a non-finite loss ({loss})")]
    NonFiniteLoss {
        /// The model kind.
        model: &'static str,
        /// The loss value.
        loss: f64,
    },

    /// Feature statistics could not be computed.
    #[error("cannot compute feature statistics: {0}")]
    Stats(String),

    /// Reading a RecordIO data set failed.
    #[error(transparent)]
    RecordIo(#[from] edl_recordio::Error),

    /// Objects of a data set could not be listed or read.
    #[error(transparent)]
    Storage(#[from] edl_storage::Error),

    /// A record is not a valid sample.
    #[error("record {record} of {} is not a valid sample: {error}", path.display())]
    Decode {
        /// The file.
        path: PathBuf,
        /// Ordinal of the record in the data set (0-based, over all files).
        record: u64,
        /// Why it could not be decoded (in the message, so not a `source()` too).
        error: edl_proto::sample::DecodeError,
    },

    /// The data does not fit the model (checked on a split's first records before a
    /// job starts), with how to fix it.
    #[error("{}: {detail}; {hint}", path.display())]
    DataMismatch {
        /// The file whose records do not fit.
        path: PathBuf,
        /// What does not fit.
        detail: String,
        /// How to fix it.
        hint: String,
    },

    /// A record of a batch cannot be used: it does not decode, or does not fit the model
    /// (what a model of your own returns for bad data: its task is failed and retried,
    /// the trainer goes on).
    #[error("record {index} of the batch: {reason}")]
    BadRecord {
        /// Position of the record in its batch.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },

    /// A model failed on data that is not at fault (a bug, a device or shape error): what
    /// a model of your own returns for anything but bad data. The trainer stops.
    #[error("model: {0}")]
    Model(String),

    /// The tensor library failed (a bug or an unsupported device/dtype, not bad data).
    #[error("tensor computation failed: {0}")]
    Candle(candle_core::Error),
}

// The message includes the cause's text, so the cause is not also its `source()`
// (a report of the chain would say it twice).
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

impl Error {
    /// Whether retrying the same operation may succeed: only I/O errors reading data.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::RecordIo(e) if !e.is_corruption())
            || matches!(self, Error::Storage(e) if e.is_transient())
    }

    /// Whether the error is about the data (a bad sample or record) rather than the model,
    /// the parameters or the configuration.
    pub fn is_bad_data(&self) -> bool {
        matches!(
            self,
            Error::FeatureCount { .. }
                | Error::NonFiniteFeature { .. }
                | Error::Label { .. }
                | Error::ClassOutOfRange { .. }
                | Error::SparseIdOutOfRange { .. }
                | Error::EmptyBatch { .. }
                | Error::Decode { .. }
                | Error::BadRecord { .. }
        ) || matches!(self, Error::RecordIo(e) if e.is_corruption())
    }
}

impl From<edl_job::model::StatsError> for Error {
    fn from(e: edl_job::model::StatsError) -> Self {
        Error::Stats(e.0)
    }
}
