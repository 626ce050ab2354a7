//! `edl operator`: edl on Kubernetes. `crd` prints the TrainingJob resource's definition
//! (`deploy/crd.yaml`); `render` prints the TrainingJob of a job spec and the objects the
//! operator creates for it, without a cluster (what `kubectl apply --dry-run` would
//! get).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use edl_job::JobSpec;
use edl_operator::TrainingJob;
use edl_operator::crd::VolumeSource;
use edl_operator::reconcile::{Observed, Progress, reconcile};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// `edl operator` subcommands.
#[derive(Debug, Subcommand)]
pub enum OperatorCommand {
    /// Print the TrainingJob CustomResourceDefinition as YAML (deploy/crd.yaml).
    Crd,
    /// Print, as YAML, the TrainingJob of a job spec (JOB.toml) or of a TrainingJob
    /// file, then the pods and services the operator creates for it.
    Render(RenderArgs),
}

/// Arguments of `edl operator render`.
#[derive(Debug, Args)]
pub struct RenderArgs {
    /// A job spec (`.toml`) or a TrainingJob (`.yaml`, `.json`).
    pub file: PathBuf,
    /// The edl image of the job's pods (required for a job spec).
    #[arg(long)]
    pub image: Option<String>,
    /// The namespace.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// A PersistentVolumeClaim holding the data, mounted at /data.
    #[arg(long)]
    pub data_claim: Option<String>,
}

/// Runs an `edl operator` subcommand.
pub fn run(cmd: OperatorCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        OperatorCommand::Crd => {
            print!("{}", edl_operator::crd::crd_yaml());
            Ok(ExitCode::SUCCESS)
        }
        OperatorCommand::Render(args) => {
            print!("{}", render(&args)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The TrainingJob `args` names, as the API server would hold it.
fn load(args: &RenderArgs) -> anyhow::Result<TrainingJob> {
    let path = &args.file;
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut tj = if path.extension().is_some_and(|e| e == "toml") {
        let spec = JobSpec::parse_toml(&text).with_context(|| format!("{}", path.display()))?;
        let image = args.image.as_deref().with_context(|| {
            format!(
                "{}: a job spec needs --image (the edl image its pods run)",
                path.display()
            )
        })?;
        TrainingJob::from_job_spec(&spec, image, Some(&args.namespace))
    } else {
        let mut tj: TrainingJob = serde_norway::from_str(&text)
            .with_context(|| format!("{}: not a TrainingJob", path.display()))?;
        if tj.metadata.namespace.is_none() {
            tj.metadata.namespace = Some(args.namespace.clone());
        }
        if let Some(image) = &args.image {
            tj.spec.image.clone_from(image);
        }
        tj
    };
    if let Some(claim) = &args.data_claim {
        tj.spec.volumes.data = Some(VolumeSource {
            claim_name: Some(claim.clone()),
            ..VolumeSource::default()
        });
    }
    Ok(tj)
}

/// The YAML documents of `args`' job and of the objects its first reconcile creates.
pub fn render(args: &RenderArgs) -> anyhow::Result<String> {
    let tj = load(args)?;
    tj.job_spec()
        .with_context(|| format!("{}: the operator would fail this job", args.file.display()))?;
    // The objects of a job whose resource exists (its uid is the API server's).
    let mut created = tj.clone();
    created.metadata.uid = Some("00000000-0000-0000-0000-000000000000".to_owned());
    created.metadata.generation = Some(1);
    let plan = reconcile(&Observed {
        job: &created,
        pods: Vec::new(),
        services: BTreeSet::new(),
        etcd: Ok(Progress::default()),
        now: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    });
    let mut docs = vec![serde_norway::to_string(&tj)?];
    for s in &plan.create_services {
        docs.push(serde_norway::to_string(s)?);
    }
    for p in &plan.create_pods {
        docs.push(serde_norway::to_string(p)?);
    }
    Ok(docs.into_iter().map(|d| format!("---\n{d}")).collect())
}
