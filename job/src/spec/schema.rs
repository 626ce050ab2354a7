//! The JSON schema of the job spec (feature `schema`), for the Kubernetes `TrainingJob`
//! resource that embeds it (`edl-operator`).
//!
//! Most types derive theirs; the ones whose serde form a derived schema would get wrong
//! or make non-structural for Kubernetes are written here:
//!
//! - [`Globs`]: one string or a list in TOML; always a list in the resource (a Kubernetes
//!   structural schema gives every field one type; `edl submit` writes a list).
//! - [`JobName`]: a string with the name's pattern.
//! - [`ModelSpec`]: an object with a required `kind` from the built-in kinds; its other
//!   fields depend on the kind and are kept as written (`x-kubernetes-preserve-unknown-fields`).
//!   The variants share field names with different meanings and defaults, which a
//!   structural schema cannot express; the operator checks them by parsing the spec and
//!   names the field in the job's `Failed` condition.
//!
//! - [`PerPush`]: a number or `"adaptive"` (`x-kubernetes-int-or-string`).
//!
//! Durations are strings such as `"10s"` (`#[schemars(with = "String")]` on the fields).

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

use super::{Globs, PerPush};
use crate::model::ModelSpec;
use crate::name::JobName;

impl JsonSchema for Globs {
    fn schema_name() -> Cow<'static, str> {
        "Globs".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "RecordIO file globs.",
            "type": "array",
            "items": { "type": "string", "minLength": 1 },
            "minItems": 1
        })
    }
}

impl JsonSchema for JobName {
    fn schema_name() -> Cow<'static, str> {
        "JobName".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A job name: 1 to 128 letters, digits, '-', '_' and '.' (not '.' or '..').",
            "type": "string",
            "minLength": 1,
            "maxLength": crate::name::MAX_LEN,
            "pattern": "^[A-Za-z0-9._-]+$"
        })
    }
}

impl JsonSchema for ModelSpec {
    fn schema_name() -> Cow<'static, str> {
        "ModelSpec".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "The built-in model and its hyper-parameters, tagged by `kind` \
                            (docs/design.md lists each kind's fields).",
            "type": "object",
            "required": ["kind"],
            "properties": {
                "kind": {
                    "type": "string",
                    "enum": ModelSpec::KINDS
                }
            },
            "x-kubernetes-preserve-unknown-fields": true
        })
    }
}

impl JsonSchema for PerPush {
    fn schema_name() -> Cow<'static, str> {
        "PerPush".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Batches per push: a number (1 to 1024), or \"adaptive\" (the default).",
            "x-kubernetes-int-or-string": true
        })
    }
}
