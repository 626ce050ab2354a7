//! The objects the operator creates for a TrainingJob: pod names and labels, the pod of
//! each process slot (the managed etcd's members included), its services, its
//! NetworkPolicy ([`network_policy`]), the claims of its pservers' checkpoints and its
//! managed etcd's members ([`claims`]), its TLS Secret ([`tls_secret`]), the Secret
//! with its own etcd credentials and token ([`credentials_secret`]) and the Secret with
//! its managed etcd's root password ([`etcd_root_secret`]).
//!
//! Every object carries the job's labels and an owner reference to the TrainingJob
//! (`controller: true`), so deleting the job deletes them (Kubernetes' garbage
//! collector) and the operator finds them by label.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar, EnvVarSource,
    HTTPGetAction, HostPathVolumeSource, ObjectFieldSelector, PersistentVolumeClaimVolumeSource,
    Pod, PodAffinityTerm, PodAntiAffinity, PodSecurityContext, PodSpec, Probe,
    ResourceRequirements, SecretEnvSource, SecurityContext, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;

use crate::crd::{CHECKPOINT_MOUNT, DATA_MOUNT, ETCD_IMAGE, TrainingJob, VolumeSource};
use edl_job::{MasterLaunch, PserverLaunch, TrainerLaunch};

mod claims;
mod disruption;
mod network;
mod resources;
mod secrets;
mod slots;
mod volcano;
mod workload;

pub use claims::{checkpoint_claim_name, checkpoint_claims, claims, etcd_claim_name, etcd_claims};
pub use disruption::disruption_budgets;
pub use network::{DNS, JobNetwork, OPERATOR_LABEL, network_policy};
pub use resources::{default_requests, with_requests};
pub use secrets::{
    CA_KEYS, CREDENTIAL_KEYS, CredentialsRef, ETCD_ROOT_KEY, ETCD_TLS_MOUNT, LEGACY_CA_KEY,
    TLS_KEYS, TLS_MOUNT, ca_secret, ca_secret_name, credentials_secret, credentials_secret_name,
    etcd_root_secret, etcd_root_secret_name, job_etcd_user, legacy_tls_secret_name, metrics_secret,
    metrics_secret_name, role_certificate, tls_domain, tls_names, tls_secret, tls_secret_name,
};
use secrets::{mount_tls, tls_vars};
pub use slots::{Role, Slot, desired_slots, desired_trainers, etcd_member_slots};
pub use volcano::{
    POD_GROUP_ANNOTATION, POD_GROUP_API, VOLCANO_SCHEDULER, min_member, min_resources, pod_group,
    pod_group_name,
};
pub use workload::{
    FLAVOR_API, FlavorPlacement, WORKLOAD_API, WorkloadState, admitted_flavors, finished_workload,
    flavor_placement, queue_name, released_workload, set_workload_condition, workload,
    workload_name, workload_state,
};

/// The label naming a pod's job.
pub const JOB_LABEL: &str = "edl.dev/job";
/// The label naming a pod's role.
pub const ROLE_LABEL: &str = "edl.dev/role";
/// The label naming a pod's slot index in its role.
pub const INDEX_LABEL: &str = "edl.dev/index";
/// The label naming the shard a pserver pod holds a replica of (slot `s` holds shard
/// `s % pservers`): the pods of one shard repel one another (anti-affinity).
pub const SHARD_LABEL: &str = "edl.dev/shard";
/// Kueue's label naming the LocalQueue a job is admitted through: copied from the
/// TrainingJob to every object the operator makes for it, so the job's pods are
/// accounted to that queue.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// Kueue's label gathering pods into one workload (its pod integration's pod groups):
/// the managed etcd's members of a queued job are one group, admitted and preempted
/// together, so that Kueue never takes part of a quorum.
pub const KUEUE_POD_GROUP_LABEL: &str = "kueue.x-k8s.io/pod-group-name";
/// Kueue's annotation giving a pod group's size: the group is admitted once that many
/// of its pods exist.
pub const KUEUE_POD_GROUP_TOTAL: &str = "kueue.x-k8s.io/pod-group-total-count";
/// The node label that pserver anti-affinity spreads one shard's replicas over.
pub const NODE_TOPOLOGY: &str = "kubernetes.io/hostname";

/// Where every job container has its scratch space (an emptyDir; `TMPDIR`): the root
/// filesystem is read-only.
pub const TMP_MOUNT: &str = "/tmp";

/// The master's gRPC port.
pub const MASTER_PORT: i32 = 7164;
/// The pserver's port.
pub const PSERVER_PORT: i32 = 7165;
/// etcd's client port.
pub const ETCD_PORT: i32 = 2379;
/// etcd's peer port (between the members of a managed etcd).
pub const ETCD_PEER_PORT: i32 = 2380;
/// Where a managed etcd member serves `/health` and `/metrics` in plain HTTP, without
/// client certificates (`--listen-metrics-urls`): what its probes ask.
pub const ETCD_METRICS_PORT: i32 = 2381;
/// Where a managed etcd member's claim is mounted.
pub const ETCD_MOUNT: &str = "/var/lib/etcd";
/// A managed etcd member's data directory, on its claim.
pub const ETCD_DATA_DIR: &str = "/var/lib/etcd/data";
/// Where pservers and trainers serve `/metrics` (`EDL_METRICS_ADDR`); masters serve it
/// on their gRPC port.
pub const METRICS_PORT: i32 = 9090;

/// The labels of every object of `job`.
pub fn job_labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "edl".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "edl-operator".to_owned(),
        ),
        (JOB_LABEL.to_owned(), job.to_owned()),
    ])
}

/// The label selector of `job`'s pods of `role`, as the scale subresource gives it.
pub fn selector(job: &str, role: Role) -> String {
    format!("{JOB_LABEL}={job},{ROLE_LABEL}={}", role.name())
}

/// The owner reference to `tj` that every object of the job carries.
pub fn owner(tj: &TrainingJob) -> OwnerReference {
    OwnerReference {
        api_version: TrainingJob::api_version(&()).into_owned(),
        kind: TrainingJob::kind(&()).into_owned(),
        name: tj.metadata.name.clone().unwrap_or_default(),
        uid: tj.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn meta(tj: &TrainingJob, name: String, slot: Option<Slot>) -> ObjectMeta {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let mut labels = job_labels(&job);
    if let Some(queue) = tj.metadata.labels.as_ref().and_then(|l| l.get(QUEUE_LABEL)) {
        labels.insert(QUEUE_LABEL.to_owned(), queue.clone());
    }
    if let Some(s) = slot {
        labels.insert(ROLE_LABEL.to_owned(), s.role.name().to_owned());
        labels.insert(INDEX_LABEL.to_owned(), s.index.to_string());
    }
    ObjectMeta {
        name: Some(name),
        namespace: tj.metadata.namespace.clone(),
        labels: Some(labels),
        owner_references: Some(vec![owner(tj)]),
        ..ObjectMeta::default()
    }
}

/// A pod incarnation's id, `<pod name>.<pod uid>` (a pod made again under the same name
/// has another uid): a trainer's id and a pserver's or master's
/// [instance](edl_job::env::INSTANCE), by which the operator revokes the leases of an
/// ended pod's process (`reconcile::pods`).
pub(crate) const INCARNATION: &str = "$(POD_NAME).$(POD_UID)";

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: None,
                field_path: path.to_owned(),
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// A variable from key `key` of Secret `secret` (never in the pod's spec itself).
fn env_secret_key(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(k8s_openapi::api::core::v1::SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: None,
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// `tj`'s name in its etcd: its keys are under `/edl/<it>/`, its etcd user is
/// `edl-job-<it>`, and its processes get it as `EDL_JOB`. It is `<namespace>.<name>`, so
/// that jobs of one name in two namespaces never meet on a shared etcd (a namespace has
/// no `.`, a TrainingJob's name neither); the status keeps it (`etcdJob`, written before
/// the job's first key or pod). A job that ran under an operator that keyed jobs by name
/// alone (a status it wrote, with the trainers' `selector`, and no `etcdJob`) keeps its
/// bare name, so that it goes on where its state is. A status naming anything else (the
/// operator writes only these two) is not followed.
pub fn etcd_job(tj: &TrainingJob) -> String {
    let name = tj.metadata.name.clone().unwrap_or_default();
    let ns = tj.metadata.namespace.as_deref().unwrap_or("default");
    let qualified = format!("{ns}.{name}");
    let Some(status) = tj.status.as_ref() else {
        return qualified;
    };
    match status.etcd_job.as_deref() {
        Some(kept) if kept == name => name,
        Some(_) => qualified,
        None if !status.selector.is_empty() => name,
        None => qualified,
    }
}

/// The etcd client URLs of `tj`'s processes.
pub fn etcd_endpoints(tj: &TrainingJob) -> Vec<String> {
    if tj.spec.etcd.managed {
        let job = tj.metadata.name.clone().unwrap_or_default();
        let ns = tj.metadata.namespace.as_deref().unwrap_or("default");
        (0..tj.spec.etcd.members.max(1))
            .map(|i| format!("{}:{ETCD_PORT}", member_host(&job, ns, i)))
            .map(|h| format!("{}://{h}", etcd_scheme(tj)))
            .collect()
    } else {
        tj.spec.etcd.endpoints.clone()
    }
}

/// How the managed etcd is spoken to, by its clients and by its members: `https`
/// (mutual TLS with the job's certificate) unless the job is `plaintext`.
fn etcd_scheme(tj: &TrainingJob) -> &'static str {
    if tj.spec.plaintext { "http" } else { "https" }
}

/// The DNS name of member `i` of `job`'s managed etcd (its pod's name under the job's
/// headless service).
fn member_host(job: &str, ns: &str, i: u32) -> String {
    let pod = Slot {
        role: Role::Etcd,
        index: i,
    }
    .pod_name(job);
    format!("{pod}.{job}.{ns}.svc")
}

/// The URL the other members of `tj`'s managed etcd reach member `i` at.
pub fn etcd_peer_url(tj: &TrainingJob, i: u32) -> String {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let ns = tj.metadata.namespace.as_deref().unwrap_or("default");
    format!(
        "{}://{}:{ETCD_PEER_PORT}",
        etcd_scheme(tj),
        member_host(&job, ns, i)
    )
}

/// The name of member `index` of a managed etcd (its etcd's `--name`).
fn etcd_member_name(index: u32) -> String {
    format!("etcd-{index}")
}

/// Every member of `tj`'s managed etcd as `name=peer URL`, comma-separated (etcd's
/// `--initial-cluster`).
fn etcd_initial_cluster(tj: &TrainingJob) -> String {
    (0..tj.spec.etcd.members.max(1))
        .map(|i| format!("{}={}", etcd_member_name(i), etcd_peer_url(tj, i)))
        .collect::<Vec<_>>()
        .join(",")
}

/// What etcd's tool needs to make member `index` of `tj`'s managed etcd from a
/// snapshot (`edl operator restore-etcd`, docs/kubernetes.md "Restoring the managed
/// etcd"): the name, data directory, members and peer URL of the member's own command
/// (its `etcd_member_args`), so the member's pod starts on the restored data as it is;
/// the token `<job>-restored` (the restored cluster's identity differs from the lost
/// one's, so no member of the lost cluster could talk to it).
pub fn etcd_restored_member(tj: &TrainingJob, index: u32) -> edl_coord::local_etcd::RestoredMember {
    let job = tj.metadata.name.clone().unwrap_or_default();
    edl_coord::local_etcd::RestoredMember {
        name: etcd_member_name(index),
        data_dir: ETCD_DATA_DIR.into(),
        initial_cluster: etcd_initial_cluster(tj),
        peer_url: etcd_peer_url(tj, index),
        token: format!("{job}-restored"),
    }
}

/// The command line of member `index` of `tj`'s managed etcd: named `etcd-<index>`, its
/// data on its claim, the members found by their pods' DNS names, old revisions
/// compacted every hour, a 2 GiB space quota (past it etcd raises its space alarm and
/// refuses writes; the job's master then pauses the job and says so). Clients and peers
/// over mutual TLS with the job's certificate (unless `plaintext`): only holders of a
/// certificate of the job's CA connect at all. A member that comes back on its claim
/// rejoins with its data; once the etcd has formed, one made on a new claim (its own
/// lost) joins it as the new member the operator added (`existing`). Authentication is turned on by the operator once the members
/// answer (`EtcdBackend::connect_as_root`).
fn etcd_member_args(tj: &TrainingJob, index: u32) -> Vec<String> {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let ns = tj.metadata.namespace.as_deref().unwrap_or("default");
    let scheme = etcd_scheme(tj);
    // Once formed, a member made again on an empty claim joins the cluster (after the
    // operator replaced it in the membership); one on its own claim ignores this.
    let formed = tj.status.as_ref().is_some_and(|s| s.etcd_formed);
    let state = if formed { "existing" } else { "new" };
    let me = member_host(&job, ns, index);
    let mut args = vec![
        "etcd".to_owned(),
        format!("--name={}", etcd_member_name(index)),
        format!("--data-dir={ETCD_DATA_DIR}"),
        format!("--listen-client-urls={scheme}://0.0.0.0:{ETCD_PORT}"),
        format!("--advertise-client-urls={scheme}://{me}:{ETCD_PORT}"),
        format!("--listen-peer-urls={scheme}://0.0.0.0:{ETCD_PEER_PORT}"),
        format!("--initial-advertise-peer-urls={scheme}://{me}:{ETCD_PEER_PORT}"),
        format!("--initial-cluster={}", etcd_initial_cluster(tj)),
        format!("--initial-cluster-state={state}"),
        format!("--initial-cluster-token={job}"),
        "--auto-compaction-mode=periodic".to_owned(),
        "--auto-compaction-retention=1h".to_owned(),
        format!("--quota-backend-bytes={}", 2u64 << 30),
        format!("--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}"),
    ];
    if !tj.spec.plaintext {
        let (ca, cert, key) = (
            format!("{TLS_MOUNT}/ca.crt"),
            format!("{TLS_MOUNT}/tls.crt"),
            format!("{TLS_MOUNT}/tls.key"),
        );
        args.extend([
            format!("--cert-file={cert}"),
            format!("--key-file={key}"),
            format!("--trusted-ca-file={ca}"),
            "--client-cert-auth".to_owned(),
            format!("--peer-cert-file={cert}"),
            format!("--peer-key-file={key}"),
            format!("--peer-trusted-ca-file={ca}"),
            "--peer-client-cert-auth".to_owned(),
            // A peer only with the members' certificate (valid for their names), not
            // with another role's of the same CA.
            format!("--peer-cert-allowed-hostname={}", member_host(&job, ns, 0)),
        ]);
    }
    args
}

fn volume(name: &str, source: &VolumeSource) -> Volume {
    Volume {
        name: name.to_owned(),
        persistent_volume_claim: source.claim_name.as_ref().map(|c| {
            PersistentVolumeClaimVolumeSource {
                claim_name: c.clone(),
                read_only: None,
            }
        }),
        host_path: source.host_path.as_ref().map(|p| HostPathVolumeSource {
            path: p.clone(),
            type_: Some("Directory".to_owned()),
        }),
        empty_dir: (source.claim_name.is_none() && source.host_path.is_none())
            .then(EmptyDirVolumeSource::default),
        ..Volume::default()
    }
}

/// A job container: no privileges, no capabilities, not root, and a read-only root
/// filesystem (what it writes goes to its volumes: /tmp, checkpoints, etcd's data).
fn hardened() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        ..SecurityContext::default()
    }
}

/// The pod of `slot` in `tj` (the job's spec must be valid: [`TrainingJob::job_spec`]);
/// its job processes take the job's credentials Secret as `credentials` says (the etcd
/// pod never does).
pub fn pod(tj: &TrainingJob, slot: Slot, credentials: CredentialsRef) -> Pod {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let s = &tj.spec;
    let name = slot.pod_name(&job);
    let c = &s.cluster;
    // What every job process has; each role then adds or takes away.
    let mut parts = Parts {
        vars: vec![
            env(edl_job::env::ETCD, etcd_endpoints(tj).join(",")),
            env(edl_job::env::JOB, etcd_job(tj)),
            env_field("POD_IP", "status.podIP"),
            env_field("POD_NAME", "metadata.name"),
            env_field("POD_UID", "metadata.uid"),
        ],
        volumes: Vec::new(),
        mounts: Vec::new(),
    };
    if let Some(d) = &s.volumes.data {
        parts.volumes.push(volume("data", d));
        parts.mounts.push(VolumeMount {
            name: "data".to_owned(),
            mount_path: DATA_MOUNT.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    let (command, ports, resources) = match slot.role {
        Role::Etcd => etcd_parts(tj, slot, &mut parts),
        Role::Master => master_parts(tj, &mut parts),
        Role::Pserver => pserver_parts(tj, slot, &mut parts),
        Role::Trainer => trainer_parts(tj, &mut parts),
    };
    let Parts {
        mut vars,
        mut volumes,
        mut mounts,
    } = parts;
    // The root filesystem is read-only: scratch space is an emptyDir at /tmp.
    volumes.push(volume("tmp", &VolumeSource::default()));
    mounts.push(VolumeMount {
        name: "tmp".to_owned(),
        mount_path: TMP_MOUNT.to_owned(),
        ..VolumeMount::default()
    });
    vars.push(env("TMPDIR", TMP_MOUNT));
    if !s.plaintext {
        mount_tls(&job, slot.role, &mut volumes, &mut mounts);
        if slot.role != Role::Etcd {
            let ns = tj.metadata.namespace.as_deref().unwrap_or("default");
            vars.extend(tls_vars(&job, ns, s.etcd.managed));
        }
    }
    if let Some(t) = s.etcd.tls.as_ref().filter(|_| slot.role != Role::Etcd) {
        vars.extend(secrets::shared_etcd_tls(t, &mut volumes, &mut mounts));
    }
    let image = match slot.role {
        Role::Etcd => s
            .etcd
            .image
            .clone()
            .unwrap_or_else(|| ETCD_IMAGE.to_owned()),
        _ => s.image.clone(),
    };
    let optional = match credentials {
        _ if slot.role == Role::Etcd => None,
        CredentialsRef::None => None,
        CredentialsRef::Optional => Some(Some(true)),
        CredentialsRef::Required => Some(None),
    };
    // `env` wins over `envFrom`: a Secret cannot change the variables the pod sets.
    let secret = |name: String, optional: Option<bool>| EnvFromSource {
        secret_ref: Some(SecretEnvSource { name, optional }),
        ..EnvFromSource::default()
    };
    let env_from: Vec<EnvFromSource> = s
        .storage_secret
        .iter()
        .filter(|_| slot.role != Role::Etcd)
        .map(|name| secret(name.clone(), None))
        .chain(optional.map(|optional| secret(credentials_secret_name(&job), optional)))
        .chain(optional.map(|optional| secret(metrics_secret_name(&job), optional)))
        .collect();
    let env_from = (!env_from.is_empty()).then_some(env_from);
    let container = Container {
        name: slot.role.name().to_owned(),
        image: Some(image),
        image_pull_policy: s.image_pull_policy.clone(),
        command: Some(command),
        env: (!vars.is_empty()).then_some(vars),
        env_from,
        ports: (!ports.is_empty()).then(|| {
            ports
                .into_iter()
                .map(|p| ContainerPort {
                    container_port: p,
                    // A PodMonitor selects them by name: `/metrics` is on both.
                    name: match p {
                        METRICS_PORT => Some("metrics".to_owned()),
                        MASTER_PORT => Some("grpc".to_owned()),
                        _ => None,
                    },
                    ..ContainerPort::default()
                })
                .collect()
        }),
        resources: Some(resources),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        security_context: Some(hardened()),
        ..Container::default()
    };
    let container = match slot.role {
        Role::Etcd => with_etcd_probes(container),
        _ => container,
    };
    let grace = match slot.role {
        // A trainer drains on SIGTERM: hands its task back, then leaves.
        Role::Trainer => i64::from(s.drain_seconds),
        // A pserver writes its final checkpoint; a master resigns.
        _ => 30,
    };
    let mut metadata = meta(tj, name.clone(), Some(slot));
    let scheduler_name = s.volcano.as_ref().map(|_| {
        metadata.annotations = Some(BTreeMap::from([(
            POD_GROUP_ANNOTATION.to_owned(),
            pod_group_name(&job),
        )]));
        VOLCANO_SCHEDULER.to_owned()
    });
    kueue_pod_group(tj, slot, &mut metadata);
    let placement = placement_of(tj, slot.role);
    let apart = match slot.role {
        Role::Pserver if c.pserver_replicas > 1 => {
            let shard = (slot.index % c.pservers.max(1)).to_string();
            if let Some(labels) = metadata.labels.as_mut() {
                labels.insert(SHARD_LABEL.to_owned(), shard.clone());
            }
            Some(replicas_apart(&job, &shard))
        }
        Role::Etcd if s.etcd.members > 1 => Some(members_apart(&job)),
        _ => None,
    };
    let affinity = with_affinity(placement.affinity, apart);
    Pod {
        metadata,
        spec: Some(PodSpec {
            affinity,
            containers: vec![container],
            // The operator replaces failed pods (counting crash loops), so a pod's own
            // restarts do not hide a failure from it.
            restart_policy: Some("Never".to_owned()),
            hostname: Some(name),
            subdomain: Some(job),
            scheduler_name,
            termination_grace_period_seconds: Some(grace),
            priority_class_name: s.priority_class_name.clone(),
            node_selector: (!placement.node_selector.is_empty()).then_some(placement.node_selector),
            tolerations: (!placement.tolerations.is_empty()).then_some(placement.tolerations),
            topology_spread_constraints: (!placement.topology_spread_constraints.is_empty())
                .then_some(placement.topology_spread_constraints),
            image_pull_secrets: (!placement.image_pull_secrets.is_empty())
                .then_some(placement.image_pull_secrets),
            service_account_name: placement.service_account_name,
            volumes: (!volumes.is_empty()).then_some(volumes),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(65532),
                fs_group: Some(65532),
                // With the containers' hardening, the "restricted" Pod Security Standard.
                seccomp_profile: Some(k8s_openapi::api::core::v1::SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    localhost_profile: None,
                }),
                ..PodSecurityContext::default()
            }),
            automount_service_account_token: Some(false),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The label of the pods that restore `<job>`'s managed etcd ([`etcd_restore_pods`]).
pub const ETCD_RESTORE_LABEL: &str = "edl.dev/etcd-restore";

/// The pods that make each member's claim of `tj`'s managed etcd hold the snapshot at
/// `snapshot` (an object URL, read with `spec.storageSecret`'s credentials, or a file
/// on the members' claims), one per member, each run once (`edl operator
/// restore-etcd-member`, with etcd's own tool in the edl image): the member pod's
/// claim, security and placement, the edl image, labelled [`ETCD_RESTORE_LABEL`] (no
/// job label: the operator neither counts nor deletes them). docs/kubernetes.md,
/// "Restoring the managed etcd".
pub fn etcd_restore_pods(tj: &TrainingJob, snapshot: &str) -> Vec<Pod> {
    let job = tj.metadata.name.clone().unwrap_or_default();
    etcd_member_slots(tj)
        .map(|slot| {
            let index = slot.index;
            let mut pod = pod(tj, slot, CredentialsRef::None);
            pod.metadata.name = Some(format!("{}-restore", slot.pod_name(&job)));
            pod.metadata.labels = Some(BTreeMap::from([(
                ETCD_RESTORE_LABEL.to_owned(),
                job.clone(),
            )]));
            pod.metadata.annotations = None;
            let member = etcd_restored_member(tj, index);
            let mut command = edl(&["operator", "restore-etcd-member", "--from", snapshot]);
            command.extend([
                "--name".to_owned(),
                member.name,
                "--data-dir".to_owned(),
                member.data_dir.display().to_string(),
                "--initial-cluster".to_owned(),
                member.initial_cluster,
                "--initial-advertise-peer-urls".to_owned(),
                member.peer_url,
                "--initial-cluster-token".to_owned(),
                member.token,
            ]);
            if let Some(spec) = pod.spec.as_mut() {
                spec.hostname = None;
                spec.subdomain = None;
                spec.affinity = None;
                spec.scheduler_name = None;
                spec.termination_grace_period_seconds = Some(30);
                for c in &mut spec.containers {
                    c.name = "restore".to_owned();
                    c.image = Some(tj.spec.image.clone());
                    c.command = Some(command.clone());
                    c.ports = None;
                    c.liveness_probe = None;
                    c.readiness_probe = None;
                    c.startup_probe = None;
                    c.env_from = tj.spec.storage_secret.as_ref().map(|name| {
                        vec![EnvFromSource {
                            secret_ref: Some(SecretEnvSource {
                                name: name.clone(),
                                optional: None,
                            }),
                            ..EnvFromSource::default()
                        }]
                    });
                }
            }
            pod
        })
        .collect()
}

/// A managed etcd member of a job queued through Kueue's pod integration joins the
/// members' pod group (`<job>-etcd`, all its members): Kueue admits and preempts them
/// as one workload. The job's other pods stay workloads of their own (trainers are
/// admitted one by one as quota allows). Their group cannot hold the other roles: those
/// are made once the etcd answers, which a group admitted whole would never do.
fn kueue_pod_group(tj: &TrainingJob, slot: Slot, metadata: &mut ObjectMeta) {
    let queued = metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(QUEUE_LABEL));
    if slot.role != Role::Etcd || !queued {
        return;
    }
    let job = tj.metadata.name.clone().unwrap_or_default();
    if let Some(labels) = metadata.labels.as_mut() {
        labels.insert(KUEUE_POD_GROUP_LABEL.to_owned(), format!("{job}-etcd"));
    }
    metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            KUEUE_POD_GROUP_TOTAL.to_owned(),
            tj.spec.etcd.members.max(1).to_string(),
        );
}

/// A pod that Kueue admitted as part of its job's Workload: without the labels that
/// would make Kueue's pod integration queue it again.
pub fn admitted_through_workload(pod: &mut Pod) {
    if let Some(labels) = pod.metadata.labels.as_mut() {
        labels.remove(QUEUE_LABEL);
        labels.remove(KUEUE_POD_GROUP_LABEL);
    }
    if let Some(annotations) = pod.metadata.annotations.as_mut() {
        annotations.remove(KUEUE_POD_GROUP_TOTAL);
    }
}

/// A managed etcd member's probes, on its plain-HTTP `/health`
/// ([`ETCD_METRICS_PORT`]; kubeadm's for its etcd): *startup* until the member answers
/// at all (up to 5 minutes: a member replaying a large log); *liveness* asks only this
/// member (`serializable=true`, and a full disk is not a reason to restart it), so a
/// member that hangs (a stopped process, a deadlock) is killed and its pod replaced
/// within about 15 s, while a lost quorum restarts no member; *readiness* asks for a
/// quorum read, so a member cut off from its peers is not Ready (and, for the
/// disruption budget, not healthy).
fn with_etcd_probes(container: Container) -> Container {
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::Int(ETCD_METRICS_PORT),
            scheme: Some("HTTP".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(3),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    let local = "/health?exclude=NOSPACE&serializable=true";
    Container {
        startup_probe: Some(probe(local, 5, 60)),
        liveness_probe: Some(probe(local, 5, 3)),
        readiness_probe: Some(probe("/health", 5, 1)),
        ..container
    }
}

/// What a role adds to its pod: variables, volumes and mounts.
struct Parts {
    vars: Vec<EnvVar>,
    volumes: Vec<Volume>,
    mounts: Vec<VolumeMount>,
}

/// A role's command line, its container ports and its resources.
type RoleCommand = (Vec<String>, Vec<i32>, ResourceRequirements);

/// `edl ARGS...`.
fn edl(args: &[&str]) -> Vec<String> {
    std::iter::once("edl")
        .chain(args.iter().copied())
        .map(str::to_owned)
        .collect()
}

/// Member `slot.index` of the managed etcd: its own claim for its data, none of the job
/// processes' variables or volumes.
fn etcd_parts(tj: &TrainingJob, slot: Slot, parts: &mut Parts) -> RoleCommand {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let args = etcd_member_args(tj, slot.index);
    // The data volume is the job processes', not the etcd's.
    parts.volumes.retain(|v| v.name != "data");
    parts.volumes.push(volume(
        "etcd-data",
        &VolumeSource {
            claim_name: Some(etcd_claim_name(&job, slot.index)),
            ..VolumeSource::default()
        },
    ));
    parts.mounts.retain(|m| m.name != "data");
    parts.mounts.push(VolumeMount {
        name: "etcd-data".to_owned(),
        mount_path: ETCD_MOUNT.to_owned(),
        ..VolumeMount::default()
    });
    parts.vars.clear();
    (
        args,
        vec![ETCD_PORT, ETCD_PEER_PORT, ETCD_METRICS_PORT],
        with_requests(Role::Etcd, tj.spec.resources.etcd.clone()),
    )
}

/// A master: the job's settings of a master (`edl_job::launch`), `/metrics` on its gRPC
/// port and in plain HTTP on [`METRICS_PORT`] (scraped without a job certificate).
fn master_parts(tj: &TrainingJob, parts: &mut Parts) -> RoleCommand {
    parts.vars.push(env(edl_job::env::INSTANCE, INCARNATION));
    parts.vars.push(env(
        edl_job::env::METRICS_ADDR,
        format!("0.0.0.0:{METRICS_PORT}"),
    ));
    let s = &tj.spec;
    let mut command = edl(&[
        "master",
        "--listen",
        &format!("0.0.0.0:{MASTER_PORT}"),
        "--advertise",
        &format!("$(POD_IP):{MASTER_PORT}"),
    ]);
    let mut launch = MasterLaunch::of(&s.data, &s.cluster);
    if s.etcd.managed {
        launch.snapshots = s.etcd.snapshots.launch(s.cluster.checkpoint_dir.as_deref());
    }
    if launch.snapshots.is_some() {
        // The managed etcd's root, which a snapshot needs.
        parts.vars.push(env_secret_key(
            edl_job::env::ETCD_SNAPSHOT_PASSWORD,
            &secrets::etcd_root_secret_name(&tj.metadata.name.clone().unwrap_or_default()),
            secrets::ETCD_ROOT_KEY,
        ));
    }
    command.extend(launch.args());
    (
        command,
        vec![MASTER_PORT, METRICS_PORT],
        with_requests(Role::Master, s.resources.master.clone()),
    )
}

/// Pserver slot `slot.index` (shard `index % pservers`): the job's settings of that slot
/// (`edl_job::launch`), its checkpoint volume (its own claim unless the job names one)
/// and `/metrics`.
fn pserver_parts(tj: &TrainingJob, slot: Slot, parts: &mut Parts) -> RoleCommand {
    parts.vars.push(env(edl_job::env::INSTANCE, INCARNATION));
    let job = tj.metadata.name.clone().unwrap_or_default();
    let s = &tj.spec;
    let c = &s.cluster;
    // Checkpoints in an object store need no volume.
    let checkpoint_dir = match &c.checkpoint_dir {
        Some(url) => url.clone(),
        None => {
            let ckpt = s
                .volumes
                .checkpoints
                .clone()
                .unwrap_or_else(|| VolumeSource {
                    claim_name: Some(checkpoint_claim_name(&job, slot.index)),
                    ..VolumeSource::default()
                });
            parts.volumes.push(volume("checkpoints", &ckpt));
            parts.mounts.push(VolumeMount {
                name: "checkpoints".to_owned(),
                mount_path: CHECKPOINT_MOUNT.to_owned(),
                ..VolumeMount::default()
            });
            format!("{CHECKPOINT_MOUNT}/{job}")
        }
    };
    parts.vars.push(env(
        edl_job::env::METRICS_ADDR,
        format!("0.0.0.0:{METRICS_PORT}"),
    ));
    let mut command = edl(&[
        "pserver",
        "--listen",
        &format!("0.0.0.0:{PSERVER_PORT}"),
        "--advertise",
        &format!("$(POD_IP):{PSERVER_PORT}"),
    ]);
    command.extend(PserverLaunch::of(c, slot.index, checkpoint_dir).args());
    (
        command,
        vec![PSERVER_PORT, METRICS_PORT],
        with_requests(Role::Pserver, s.resources.pserver.clone()),
    )
}

/// A trainer (`edl trainer`, or the job's own `trainer.entry` program): one id per pod
/// incarnation, the job's settings of a trainer (`edl_job::launch`), `/metrics`.
fn trainer_parts(tj: &TrainingJob, parts: &mut Parts) -> RoleCommand {
    let s = &tj.spec;
    let launch = TrainerLaunch::of(&s.trainer, &s.cluster);
    // One id per pod incarnation: a replacement pod (same name) must not meet the
    // registration its predecessor left until its lease ends.
    parts.vars.push(env(edl_job::env::TRAINER_ID, INCARNATION));
    parts.vars.push(env(
        edl_job::env::METRICS_ADDR,
        format!("0.0.0.0:{METRICS_PORT}"),
    ));
    parts
        .vars
        .extend(launch.vars().into_iter().map(|(k, v)| env(&k, v)));
    let command = if launch.entry.is_empty() {
        edl(&["trainer"])
    } else {
        launch.entry.clone()
    };
    (
        command,
        vec![METRICS_PORT],
        with_requests(Role::Trainer, s.resources.trainer.clone()),
    )
}

/// `role`'s placement in `tj` (`spec.placement`: the role's over `all`'s). The job was
/// checked ([`TrainingJob::job_spec`] reads every placement), so it reads; were it not,
/// the pod would get none of it rather than part.
fn placement_of(tj: &TrainingJob, role: Role) -> crate::crd::PodPlacement {
    let p = &tj.spec.placement;
    let own = match role {
        Role::Master => p.master.as_ref(),
        Role::Pserver => p.pserver.as_ref(),
        Role::Trainer => p.trainer.as_ref(),
        Role::Etcd => p.etcd.as_ref(),
    };
    crate::crd::Placement::over(own, p.all.as_ref())
        .read("spec.placement")
        .unwrap_or_default()
}

/// The user's affinity with the operator's own (a replicated pserver's anti-affinity)
/// added: its required pod anti-affinity terms join the user's.
fn with_affinity(user: Option<Affinity>, own: Option<Affinity>) -> Option<Affinity> {
    let Some(own) = own else {
        return user;
    };
    let Some(mut user) = user else {
        return Some(own);
    };
    let own_terms = own
        .pod_anti_affinity
        .and_then(|a| a.required_during_scheduling_ignored_during_execution)
        .unwrap_or_default();
    let anti = user
        .pod_anti_affinity
        .get_or_insert_with(PodAntiAffinity::default);
    anti.required_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new)
        .extend(own_terms);
    Some(user)
}

/// Keeps the replicas of one shard on different nodes: a pserver pod of shard `shard`
/// is never scheduled on a node that runs another of the same job and shard. Required,
/// not preferred: two replicas on one node would be lost together, which is the loss
/// replicas exist to survive. With fewer nodes than replicas, the extra pods stay
/// Pending and the job runs with fewer replicas (its status says which are in sync).
fn replicas_apart(job: &str, shard: &str) -> Affinity {
    apart(&[
        (JOB_LABEL, job),
        (ROLE_LABEL, Role::Pserver.name()),
        (SHARD_LABEL, shard),
    ])
}

/// Keeps the members of a managed etcd on different nodes, required as for replicas: a
/// node lost takes one member, never the quorum. With fewer nodes than members, the
/// extra members stay Pending; the etcd serves while a quorum runs.
fn members_apart(job: &str) -> Affinity {
    apart(&[(JOB_LABEL, job), (ROLE_LABEL, Role::Etcd.name())])
}

/// A required pod anti-affinity: never on a node ([`NODE_TOPOLOGY`]) that runs a pod
/// with all of `labels`.
fn apart(labels: &[(&str, &str)]) -> Affinity {
    Affinity {
        pod_anti_affinity: Some(PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(
                        labels
                            .iter()
                            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                            .collect(),
                    ),
                    match_expressions: None,
                }),
                topology_key: NODE_TOPOLOGY.to_owned(),
                ..PodAffinityTerm::default()
            }]),
            preferred_during_scheduling_ignored_during_execution: None,
        }),
        ..Affinity::default()
    }
}

/// The headless service that gives the job's pods DNS names (`<pod>.<job>`), and the
/// managed etcd's service (`<job>-etcd`) when asked.
pub fn services(tj: &TrainingJob) -> Vec<Service> {
    let job = tj.metadata.name.clone().unwrap_or_default();
    let mut out = vec![Service {
        metadata: meta(tj, job.clone(), None),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: Some(BTreeMap::from([(JOB_LABEL.to_owned(), job.clone())])),
            publish_not_ready_addresses: Some(true),
            ..ServiceSpec::default()
        }),
        status: None,
    }];
    if tj.spec.etcd.managed {
        out.push(Service {
            metadata: meta(tj, format!("{job}-etcd"), None),
            spec: Some(ServiceSpec {
                selector: Some(BTreeMap::from([
                    (JOB_LABEL.to_owned(), job.clone()),
                    (ROLE_LABEL.to_owned(), Role::Etcd.name().to_owned()),
                ])),
                ports: Some(vec![ServicePort {
                    name: Some("client".to_owned()),
                    port: ETCD_PORT,
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            status: None,
        });
    }
    out
}

/// The namespace of [`test_job`].
#[cfg(test)]
pub(crate) const TEST_NAMESPACE: &str = "ml";

/// A TrainingJob `mnist` in [`TEST_NAMESPACE`] with one trainer and one pserver, for
/// the objects' tests.
#[cfg(test)]
pub(crate) fn test_job() -> TrainingJob {
    let spec = edl_job::JobSpec::parse_toml(
        "name = \"mnist\"\n[data]\ntrain = [\"mnist-train-*.recordio\"]\n[model]\n\
         kind = \"mnist_mlp\"\n[cluster]\ntrainers = 1\n",
    )
    .expect("spec");
    TrainingJob::from_job_spec(&spec, "edl:test", Some(TEST_NAMESPACE))
}
