//! A job's process slots: roles, slot -> pod name, the slots its spec wants.

use crate::crd::TrainingJob;

/// A process role of a job on the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// The job's own etcd (`etcd.managed`).
    Etcd,
    /// A master.
    Master,
    /// A parameter server shard.
    Pserver,
    /// A trainer.
    Trainer,
}

impl Role {
    /// Every role, in start order.
    pub const ALL: [Role; 4] = [Role::Etcd, Role::Master, Role::Pserver, Role::Trainer];

    /// Its name in labels and pod names.
    pub fn name(self) -> &'static str {
        match self {
            Role::Etcd => "etcd",
            Role::Master => "master",
            Role::Pserver => "pserver",
            Role::Trainer => "trainer",
        }
    }

    /// The role named `s`.
    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }
}

/// A pod's place in its job: role and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot {
    /// The role.
    pub role: Role,
    /// The index in the role (0 for the etcd).
    pub index: u32,
}

impl Slot {
    /// The pod's name in job `job`: `<job>-<role>-<index>` (`<job>-etcd-<i>` for the
    /// managed etcd's member `i`).
    pub fn pod_name(self, job: &str) -> String {
        format!("{job}-{}-{}", self.role.name(), self.index)
    }
}

/// The trainers `tj` wants: `spec.cluster.trainers` within `[min_trainers,
/// max_trainers]`, or 0, which holds the job without trainers (its masters and
/// pservers keep its state; edl's autoscaler does so to make room for a job worth
/// more).
pub fn desired_trainers(tj: &TrainingJob) -> u32 {
    let c = &tj.spec.cluster;
    match c.trainers {
        0 => 0,
        n => n.clamp(c.min_trainers, c.max_trainers()),
    }
}

/// The slots of `tj`'s managed etcd's members (its `etcd.members`, at least one).
pub fn etcd_member_slots(tj: &TrainingJob) -> impl Iterator<Item = Slot> {
    (0..tj.spec.etcd.members.max(1)).map(|index| Slot {
        role: Role::Etcd,
        index,
    })
}

/// The slots `tj` wants, in start order.
pub fn desired_slots(tj: &TrainingJob) -> Vec<Slot> {
    let c = &tj.spec.cluster;
    let trainers = desired_trainers(tj);
    let mut out = Vec::new();
    if tj.spec.etcd.managed {
        out.extend(etcd_member_slots(tj));
    }
    for (role, n) in [
        (Role::Master, c.masters),
        (Role::Pserver, c.pservers * c.pserver_replicas.max(1)),
        (Role::Trainer, trainers),
    ] {
        out.extend((0..n).map(|index| Slot { role, index }));
    }
    out
}
