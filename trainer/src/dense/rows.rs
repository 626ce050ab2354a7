//! A batch from dense samples, whether decoded ([`Sample`]) or read in place from their
//! records ([`edl_proto::sample::view`]: the features stay little-endian bytes until
//! they are copied into the batch, once, checked and standardised on the way).

use candle_core::Tensor;
use edl_proto::sample::{self, Sample, SampleView, sample::Label};
use edl_pserver_client::wire;

use super::{Arch, DenseModel, Task};
use crate::error::{Error, Result};
use crate::model::{Batch, BatchData, Target};

/// A record of a batch: read in place, or decoded when its layout asks for it.
pub(super) enum Parsed<'a> {
    View(SampleView<'a>),
    Decoded(Sample),
}

impl<'a> Parsed<'a> {
    /// Record `index` of a batch; a record that is no sample is [`Error::BadRecord`].
    pub(super) fn read(index: usize, record: &'a [u8]) -> Result<Self> {
        if let Some(v) = sample::view(record) {
            return Ok(Parsed::View(v));
        }
        sample::decode(record)
            .map(Parsed::Decoded)
            .map_err(|e| Error::BadRecord {
                index,
                reason: format!("not a valid sample: {e}"),
            })
    }

    pub(super) fn row(&self) -> Row<'_> {
        match self {
            Parsed::View(v) => Row {
                features: Features::Le(v.dense),
                label: v.label,
            },
            Parsed::Decoded(s) => Row::of_sample(s),
        }
    }
}

/// One sample as a batch reads it.
pub(super) struct Row<'a> {
    features: Features<'a>,
    label: Option<Label>,
}

impl<'a> Row<'a> {
    pub(super) fn of_sample(s: &'a Sample) -> Self {
        Row {
            features: Features::Floats(&s.dense),
            label: s.label,
        }
    }
}

/// Dense features: decoded, or a record's little-endian bytes.
enum Features<'a> {
    Floats(&'a [f32]),
    Le(&'a [u8]),
}

impl Features<'_> {
    fn len(&self) -> usize {
        match self {
            Features::Floats(f) => f.len(),
            Features::Le(b) => b.len() / 4,
        }
    }

    /// Appends the features to `x`, standardised by `(mean, 1 / std)` when given. A
    /// non-finite feature is `Err((its index, its value))`, and `x` is then unspecified.
    fn append(
        &self,
        x: &mut Vec<f32>,
        standardize: Option<&(Vec<f32>, Vec<f32>)>,
    ) -> std::result::Result<(), (usize, f32)> {
        let start = x.len();
        match self {
            Features::Floats(f) => x.extend_from_slice(f),
            Features::Le(b) => {
                x.resize(start + b.len() / 4, 0.0);
                wire::decode_into(b, &mut x[start..]);
            }
        }
        let new = &mut x[start..];
        if !wire::floats_finite(new) {
            let i = new.iter().position(|v| !v.is_finite()).unwrap_or_default();
            return Err((i, new[i]));
        }
        if let Some((mean, inv_std)) = standardize {
            for ((v, m), r) in new.iter_mut().zip(mean).zip(inv_std) {
                *v = (*v - m) * r;
            }
        }
        Ok(())
    }
}

impl DenseModel {
    /// The batch of `rows`: features counted and finite, labels of the model's kind.
    pub(super) fn prepare_rows(&self, samples: &[Row<'_>]) -> Result<Batch> {
        let model = self.kind;
        if samples.is_empty() {
            return Err(Error::EmptyBatch {
                model,
                reason: "no samples",
            });
        }
        let n = samples.len();
        let mut x = Vec::with_capacity(n * self.inputs);
        for (index, s) in samples.iter().enumerate() {
            let found = s.features.len();
            if found != self.inputs {
                return Err(Error::FeatureCount {
                    model,
                    index,
                    found,
                    expected: self.inputs,
                });
            }
            s.features
                .append(&mut x, self.standardize.as_ref())
                .map_err(|(feature, value)| Error::NonFiniteFeature {
                    model,
                    index,
                    feature,
                    value,
                })?;
        }
        let label_name = |label: &Option<Label>| match label {
            None => "no label".to_string(),
            Some(Label::Value(v)) => format!("a real-valued label ({v})"),
            Some(Label::ClassId(c)) => format!("a class id ({c})"),
        };
        let target = match self.task {
            Task::Regression => {
                let mut y = Vec::with_capacity(n);
                for (index, s) in samples.iter().enumerate() {
                    match s.label {
                        Some(Label::Value(v)) if v.is_finite() => y.push(v),
                        _ => {
                            return Err(Error::Label {
                                model,
                                index,
                                found: label_name(&s.label),
                                expected: "a finite real-valued label",
                            });
                        }
                    }
                }
                Target::Values(Tensor::from_vec(y, n, &self.device)?.to_dtype(self.dtype)?)
            }
            Task::Classification { classes } => {
                let mut ids = Vec::with_capacity(n);
                for (index, s) in samples.iter().enumerate() {
                    match s.label {
                        Some(Label::ClassId(class)) if (class as usize) < classes => {
                            ids.push(class)
                        }
                        Some(Label::ClassId(class)) => {
                            return Err(Error::ClassOutOfRange {
                                model,
                                index,
                                class,
                                classes,
                            });
                        }
                        _ => {
                            return Err(Error::Label {
                                model,
                                index,
                                found: label_name(&s.label),
                                expected: "a class id",
                            });
                        }
                    }
                }
                let tensor = Tensor::from_slice(&ids, n, &self.device)?;
                Target::Classes { tensor, ids }
            }
        };
        let x = match &self.arch {
            Arch::Fc { .. } => Tensor::from_vec(x, (n, self.inputs), &self.device)?,
            Arch::MnistCnn { .. } if self.conv0_on_device => {
                Tensor::from_vec(x, (n, self.inputs), &self.device)?
            }
            Arch::MnistCnn { conv0, .. } => {
                // A 28x28 image with one channel is its own NHWC layout.
                let rows = conv0.out_h * conv0.out_w;
                let mut patches = Vec::with_capacity(n * rows * conv0.patch());
                for image in x.chunks_exact(self.inputs) {
                    conv0.im2col_host(image, &mut patches);
                }
                Tensor::from_vec(patches, (n * rows, conv0.patch()), &self.device)?
            }
        }
        .to_dtype(self.dtype)?;
        Ok(Batch {
            model,
            samples: n,
            data: BatchData::Dense { x, target },
        })
    }
}
