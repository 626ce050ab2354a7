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
//! - [`objects`]: names, labels, the slots a job wants, and the pods and services of a
//!   job.
//! - [`reconcile`]: observed objects -> a [`reconcile::Plan`].
//! - [`controller`]: the kube-rs edge: watches TrainingJobs and their pods, observes
//!   (the API server, the job's etcd), decides, applies.
//! - [`leader`]: leader election among operator replicas on a `coordination.k8s.io`
//!   Lease.
//! - [`metrics`]: the operator's `/metrics`.
//! - [`autoscale`]: `--autoscale`: edl's multi-job autoscaler (`edl-autoscaler`) over the
//!   cluster's nodes, pods and TrainingJobs, applied through the scale subresource.
//! - [`verbs`]: the user's verbs against a cluster (`edl submit`, `edl jobs`, and the
//!   cluster forms of `edl status`, `scale`, `kill`, `logs`).

#![warn(missing_docs)]

pub mod autoscale;
pub mod controller;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod objects;
pub mod reconcile;
pub mod verbs;

pub use crd::{TrainingJob, TrainingJobSpec, TrainingJobStatus};
