//! edl on Kubernetes: the `TrainingJob` custom resource and the operator's decisions.
//!
//! The operator reconciles each TrainingJob into pods (masters, pservers, trainers, and
//! an etcd when asked), follows the scale subresource (`spec.cluster.trainers`) by
//! creating trainers or draining surplus ones, replaces failed pods (counting crash
//! loops), and reports the job's state from etcd in the resource's status. The decision
//! is a pure function ([`reconcile::reconcile`]); talking to the API server and to etcd
//! is the controller's, a thin edge around it.
//!
//! Layout:
//! - [`crd`]: the resource's types (spec, status, conditions), the CRD generated from
//!   them, and the conversion from and to a job spec.
//! - [`objects`]: names, labels, and the pods and services of a job.
//! - [`reconcile`]: observed objects -> a [`reconcile::Plan`].

#![warn(missing_docs)]

pub mod crd;
pub mod objects;
pub mod reconcile;

pub use crd::{TrainingJob, TrainingJobSpec, TrainingJobStatus};
