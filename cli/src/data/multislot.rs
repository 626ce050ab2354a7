//! `edl data convert --format multislot`: PaddlePaddle's MultiSlot text (what its
//! `InMemoryDataset` and `QueueDataset` read), one sample a line, each slot written as
//! its value count then its values: `n v1 .. vn`. `--slots` says what each slot is, in
//! order, e.g. `dense,sparse*26,label` for CTR-DNN's data (13 features in one slot, 26
//! one-id slots, the click):
//! - `dense`: real values, appended to the sample's features;
//! - `sparse`: non-negative integer ids, appended to its sparse ids;
//! - `label`: one value, the label (`--label class`: a class id; `value`: a real);
//! - `skip`: read and dropped.

use anyhow::{Context, bail};
use edl_proto::sample::{self, Sample};

use super::LabelKind;

/// What one slot of a MultiSlot line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    Dense,
    Sparse,
    Label,
    Skip,
}

/// Parses `--slots`: kinds separated by commas, `kind*N` for N slots of a kind.
pub(super) fn parse_slots(spec: &str) -> anyhow::Result<Vec<Slot>> {
    let mut slots = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (kind, n) = match part.split_once('*') {
            Some((k, n)) => {
                let n: usize = n.trim().parse().ok().filter(|&n| n > 0).with_context(|| {
                    format!("--slots: {part:?}: the count after '*' must be a positive integer")
                })?;
                (k.trim(), n)
            }
            None => (part, 1),
        };
        let slot = match kind {
            "dense" => Slot::Dense,
            "sparse" => Slot::Sparse,
            "label" => Slot::Label,
            "skip" => Slot::Skip,
            other => {
                bail!("--slots: unknown slot kind {other:?}; use dense, sparse, label or skip")
            }
        };
        slots.extend(std::iter::repeat_n(slot, n));
    }
    if slots.is_empty() {
        bail!("--format multislot needs --slots, e.g. --slots dense,sparse*26,label");
    }
    if slots.iter().filter(|&&s| s == Slot::Label).count() > 1 {
        bail!("--slots: at most one label slot");
    }
    Ok(slots)
}

/// One line as a sample; errors name the slot (1-based) and what is wrong with it.
pub(super) fn sample(line: &str, slots: &[Slot], label: LabelKind) -> anyhow::Result<Sample> {
    let mut tokens = line.split_ascii_whitespace();
    let mut s = Sample {
        version: sample::SAMPLE_VERSION,
        ..Default::default()
    };
    for (i, slot) in slots.iter().enumerate() {
        let at = || format!("slot {}", i + 1);
        let n: usize = tokens
            .next()
            .with_context(|| {
                format!(
                    "{}: missing (the line has {i} slots, --slots names {})",
                    at(),
                    slots.len()
                )
            })?
            .parse()
            .with_context(|| format!("{}: the value count is not a non-negative integer", at()))?;
        for _ in 0..n {
            let v = tokens
                .next()
                .with_context(|| format!("{}: {n} values announced, fewer found", at()))?;
            match slot {
                Slot::Dense => {
                    let f: f32 = v
                        .parse()
                        .ok()
                        .filter(|f: &f32| f.is_finite())
                        .with_context(|| format!("{}: {v:?} is not a finite number", at()))?;
                    s.dense.push(f);
                }
                Slot::Sparse => s.sparse_ids.push(v.parse().with_context(|| {
                    format!("{}: {v:?} is not a non-negative integer id", at())
                })?),
                Slot::Label => {
                    if n != 1 {
                        bail!("{}: a label slot holds one value, found {n}", at());
                    }
                    s.label = Some(label_of(v, label).with_context(at)?);
                }
                Slot::Skip => {}
            }
        }
    }
    if tokens.next().is_some() {
        bail!("more values than the {} slots --slots names", slots.len());
    }
    Ok(s)
}

fn label_of(v: &str, kind: LabelKind) -> anyhow::Result<sample::sample::Label> {
    match kind {
        LabelKind::Class => Ok(sample::sample::Label::ClassId(
            v.parse()
                .with_context(|| format!("class label {v:?} is not a non-negative integer"))?,
        )),
        LabelKind::Value => {
            let f: f32 = v
                .parse()
                .ok()
                .filter(|f: &f32| f.is_finite())
                .with_context(|| format!("label {v:?} is not a finite number"))?;
            Ok(sample::sample::Label::Value(f))
        }
        LabelKind::None => bail!("a label slot with --label none"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ctr_line_becomes_a_sample() {
        let slots = parse_slots("dense, sparse*3 ,label,skip").unwrap();
        assert_eq!(slots.len(), 6);
        let s = sample(
            "2 0.5 -1 1 7 1 900000 1 3 1 1 2 9 9",
            &slots,
            LabelKind::Class,
        )
        .unwrap();
        assert_eq!(s.dense, vec![0.5, -1.0]);
        assert_eq!(s.sparse_ids, vec![7, 900000, 3]);
        assert_eq!(s.label, Some(sample::sample::Label::ClassId(1)));
        // A slot may hold several ids, or none.
        let slots = parse_slots("sparse*2").unwrap();
        let s = sample("3 1 2 3 0", &slots, LabelKind::None).unwrap();
        assert_eq!(s.sparse_ids, vec![1, 2, 3]);
    }

    #[test]
    fn bad_lines_and_specs_are_named() {
        let slots = parse_slots("dense,sparse,label").unwrap();
        let err = |line: &str| format!("{:#}", sample(line, &slots, LabelKind::Class).unwrap_err());
        assert!(err("1 0.5 1 x 1 0").contains("slot 2: \"x\" is not a non-negative integer id"));
        assert!(err("1 nan 1 3 1 0").contains("slot 1: \"nan\" is not a finite number"));
        assert!(err("1 0.5 1 3").contains("slot 3: missing"));
        assert!(err("1 0.5 2 3").contains("slot 2: 2 values announced, fewer found"));
        assert!(err("1 0.5 1 3 2 0 1").contains("slot 3: a label slot holds one value"));
        assert!(err("1 0.5 1 3 1 0 5").contains("more values than the 3 slots"));
        assert!(err("1 0.5 1 3 1 -1").contains("class label \"-1\""));
        for (spec, want) in [
            ("", "needs --slots"),
            ("dense,wide", "unknown slot kind \"wide\""),
            ("sparse*0", "positive integer"),
            ("label,label", "at most one label"),
        ] {
            let e = parse_slots(spec).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
