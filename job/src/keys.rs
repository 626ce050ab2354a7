//! [`JobKeys`]: every etcd key of a job, in one place.
//!
//! All keys of a job live under `/edl/<job>/` ([`ROOT`] then the [`JobName`]); nothing in
//! edl builds a job key by hand. The tree (docs/design.md, "etcd keys", says who writes
//! and reads each one, under which lease, and the record stored):
//!
//! ```text
//! /edl/<job>/job/spec                  the job spec (edl run, edl trainer --spec)
//! /edl/<job>/job/run                   the run that started the job (edl run)
//! /edl/<job>/job/state                 the job's final state (edl run)
//! /edl/<job>/job/control               a request to the job (edl kill)
//! /edl/<job>/job/dataset, job/queue    the master's dataset and queue records
//! /edl/<job>/job/files/<n>             the dataset's file list, in parts
//! /edl/<job>/job/failures              the tasks failed for good, with reasons
//! /edl/<job>/job/journal[/<id>/<n>]    a queue commit too large for one transaction
//! /edl/<job>/scale/trainers            the desired trainer count (edl scale)
//! /edl/<job>/master/election/<lease>   master candidates; the oldest leads
//! /edl/<job>/tasks/<id>                task records (master)
//! /edl/<job>/trainers/<id>             trainer registrations (lease)
//! /edl/<job>/ps/desired, ps/<index>    shard count; shard claims (lease)
//! /edl/<job>/params/...                parameter initialisation (trainers)
//! /edl/<job>/checkpoints/...           checkpoint parts, manifests, latest, request
//! ```

use crate::name::JobName;

/// The prefix of every job's keys.
pub const ROOT: &str = "/edl/";

/// Keys of one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobKeys {
    root: String,
}

impl JobKeys {
    /// The keys of job `job`.
    pub fn new(job: &JobName) -> JobKeys {
        JobKeys {
            root: format!("{ROOT}{job}/"),
        }
    }

    /// `/edl/<job>/`: every key of the job starts with it.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The job whose spec is stored at `key`, if `key` is a `/edl/<job>/job/spec` key (for
    /// listing jobs with one range over [`ROOT`]).
    pub fn job_of_spec_key(key: &str) -> Option<JobName> {
        let rest = key.strip_prefix(ROOT)?;
        let (job, tail) = rest.split_once('/')?;
        (tail == "job/spec").then(|| JobName::new(job).ok())?
    }

    fn key(&self, tail: &str) -> String {
        format!("{}{tail}", self.root)
    }

    // --- the job as a whole ---

    /// Every key of the job as a whole and of its queue's own records (`job/`): the
    /// spec, the run, the state, the dataset, the queue and failure records, the journal.
    pub fn job_records(&self) -> String {
        self.key("job/")
    }

    /// The stored job spec.
    pub fn spec(&self) -> String {
        self.key("job/spec")
    }

    /// The run that started the job ([`crate::RunRecord`]).
    pub fn run(&self) -> String {
        self.key("job/run")
    }

    /// The job's final state ([`crate::JobStateRecord`]).
    pub fn state(&self) -> String {
        self.key("job/state")
    }

    /// A request to the running job ([`crate::ControlRecord`]).
    pub fn control(&self) -> String {
        self.key("job/control")
    }

    /// The desired trainer count ([`crate::ScaleRecord`]).
    pub fn scale_trainers(&self) -> String {
        self.key("scale/trainers")
    }

    // --- the master and its task queue ---

    /// The master election prefix; the leader's value is its gRPC address.
    pub fn master_election(&self) -> String {
        self.key("master/election/")
    }

    /// Where a master given an [instance](crate::env::INSTANCE) writes its address under
    /// the lease it campaigns with, so that whoever sees its process end finds that
    /// lease by the instance ([`crate::holders`]).
    pub fn master_instance(&self, instance: &str) -> String {
        self.key(&format!("master/instances/{instance}"))
    }

    /// The prefix of [`Self::master_instance`].
    pub fn master_instances(&self) -> String {
        self.key("master/instances/")
    }

    /// Written by a master as it takes the lead (its address): a standby's copy of the
    /// queue that has seen this write has seen every write of the leaders before.
    pub fn master_takeover(&self) -> String {
        self.key("master/takeover")
    }

    /// A few bytes the leading master writes to learn whether a full etcd has space
    /// again (a cheap write, where reloading the queue would read every task).
    pub fn space_probe(&self) -> String {
        self.key("master/space-probe")
    }

    /// The indexed dataset, written once after all its tasks and file lists.
    pub fn dataset(&self) -> String {
        self.key("job/dataset")
    }

    /// The prefix of the dataset's file lists `job/files/<n>` (a dataset of many files
    /// does not fit one record).
    pub fn dataset_files(&self) -> String {
        self.key("job/files/")
    }

    /// Part `n` of the dataset's file list.
    pub fn dataset_files_part(&self, n: u32) -> String {
        self.key(&format!("job/files/{n:06}"))
    }

    /// The queue record: current pass, finished flag, counters, failed tasks.
    pub fn queue(&self) -> String {
        self.key("job/queue")
    }

    /// The header of a queue commit that spans several transactions: written after its
    /// entries, it makes the commit durable (a new leader rolls it forward).
    pub fn journal(&self) -> String {
        self.key("job/journal")
    }

    /// The prefix of every journal entry (`journal/<id>/<n>`).
    pub fn journal_entries(&self) -> String {
        self.key("job/journal/")
    }

    /// The list of tasks failed for good, with their reasons (for status; written only
    /// when a task fails for good, apart from the queue record every batch rewrites).
    pub fn failures(&self) -> String {
        self.key("job/failures")
    }

    /// The prefix of the failed-task records `job/failed/<pass>`.
    pub fn failed(&self) -> String {
        self.key("job/failed/")
    }

    /// The record of the tasks of pass `pass` that failed for good.
    pub fn failed_in(&self, pass: u32) -> String {
        self.key(&format!("job/failed/{pass}"))
    }

    /// The prefix of every task record.
    pub fn tasks(&self) -> String {
        self.key("tasks/")
    }

    /// One task record.
    pub fn task(&self, id: &str) -> String {
        self.key(&format!("tasks/{id}"))
    }

    // --- trainers ---

    /// The trainer registry prefix.
    pub fn trainers(&self) -> String {
        self.key("trainers/")
    }

    /// The registration of trainer `id` ([`crate::TrainerRecord`], under its lease).
    pub fn trainer(&self, id: &str) -> String {
        self.key(&format!("trainers/{id}"))
    }

    /// The trainer id of a registration key, if it is one.
    pub fn trainer_id<'a>(&self, key: &'a str) -> Option<&'a str> {
        let id = key.strip_prefix(&self.root)?.strip_prefix("trainers/")?;
        (!id.is_empty()).then_some(id)
    }

    // --- parameter servers ---

    /// The number of shards (no lease).
    pub fn desired(&self) -> String {
        self.key("ps/desired")
    }

    /// The prefix of the shard claims `ps/<index>`.
    pub fn ps_prefix(&self) -> String {
        self.key("ps/")
    }

    /// The claim of shard `index` (under the pserver's lease).
    pub fn ps(&self, index: u32) -> String {
        self.key(&format!("ps/{index}"))
    }

    /// The index of a claim key (`ps/<canonical decimal>`), if it is one.
    pub fn ps_index(&self, key: &str) -> Option<u32> {
        let rest = key.strip_prefix(&self.ps_prefix())?;
        let i: u32 = rest.parse().ok()?;
        (i.to_string() == rest).then_some(i)
    }

    /// The prefix of the replica groups `ps-group/<index>`.
    pub fn ps_groups(&self) -> String {
        self.key("ps-group/")
    }

    /// The replica group of shard `index` (no lease; see `docs/replication.md`).
    pub fn ps_group(&self, index: u32) -> String {
        self.key(&format!("ps-group/{index}"))
    }

    /// The prefix of the pserver processes `ps-member/<id>`.
    pub fn ps_members(&self) -> String {
        self.key("ps-member/")
    }

    /// The registration of pserver process `id` (under its lease).
    pub fn ps_member(&self, id: &str) -> String {
        self.key(&format!("ps-member/{id}"))
    }

    /// The process id of a member key, if it is one.
    pub fn ps_member_id<'a>(&self, key: &'a str) -> Option<&'a str> {
        let id = key.strip_prefix(&self.root)?.strip_prefix("ps-member/")?;
        (!id.is_empty()).then_some(id)
    }

    /// The prefix of the restore records `restores/<index>`.
    pub fn restores(&self) -> String {
        self.key("restores/")
    }

    /// The restore record of shard `index` (no lease: the master reads it after the
    /// pserver is gone).
    pub fn restore(&self, index: u32) -> String {
        self.key(&format!("restores/{index}"))
    }

    /// Which trainer initialised the parameters, and when (no lease).
    pub fn params_init(&self) -> String {
        self.key("params/init")
    }

    /// The model spec and settings the parameters were initialised with (no lease).
    pub fn params_spec(&self) -> String {
        self.key("params/spec")
    }

    /// The election among trainers for the right to initialise.
    pub fn params_init_election(&self) -> String {
        self.key("params/init-election/")
    }

    // --- checkpoints ---

    /// Everything about checkpoints.
    pub fn checkpoints(&self) -> String {
        self.key("checkpoints/")
    }

    /// The manifest of the checkpoint of `step`.
    pub fn manifest(&self, step: u64) -> String {
        self.key(&format!("checkpoints/{step}"))
    }

    /// The step of a manifest key (`checkpoints/<digits>`), if it is one.
    pub fn manifest_step(&self, key: &str) -> Option<u64> {
        let rest = key.strip_prefix(&self.checkpoints())?;
        if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        rest.parse().ok()
    }

    /// While the leading master snapshots the job's etcd, the manifests are held:
    /// none is deleted and every file they name is kept (the key lives on the
    /// master's lease; `CheckpointPin` says why).
    pub fn checkpoint_hold(&self) -> String {
        self.key("checkpoints/hold")
    }

    /// Every pin of checkpoints an etcd snapshot names.
    pub fn checkpoint_pins(&self) -> String {
        self.key("checkpoints/pins/")
    }

    /// The pin of the checkpoints that etcd snapshot `snapshot` (its file name) names.
    pub fn checkpoint_pin(&self, snapshot: &str) -> String {
        self.key(&format!("checkpoints/pins/{snapshot}"))
    }

    /// The step of the newest complete manifest.
    pub fn latest(&self) -> String {
        self.key("checkpoints/latest")
    }

    /// The checkpoint requested by shard 0 (the checkpoint coordinator).
    pub fn request(&self) -> String {
        self.key("checkpoints/request")
    }

    /// The prefix of the shard files written for `step`, before its manifest.
    pub fn parts(&self, step: u64) -> String {
        self.key(&format!("checkpoints/parts/{step}/"))
    }

    /// The prefix of every part.
    pub fn all_parts(&self) -> String {
        self.key("checkpoints/parts/")
    }

    /// The file of shard `shard` written for `step`.
    pub fn part(&self, step: u64, shard: u32) -> String {
        self.key(&format!("checkpoints/parts/{step}/{shard}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(job: &str) -> JobKeys {
        JobKeys::new(&JobName::new(job).unwrap())
    }

    #[test]
    fn layout() {
        let k = keys("mnist");
        assert_eq!(k.root(), "/edl/mnist/");
        assert_eq!(k.spec(), "/edl/mnist/job/spec");
        assert_eq!(k.run(), "/edl/mnist/job/run");
        assert_eq!(k.state(), "/edl/mnist/job/state");
        assert_eq!(k.control(), "/edl/mnist/job/control");
        assert_eq!(k.scale_trainers(), "/edl/mnist/scale/trainers");
        assert_eq!(k.master_election(), "/edl/mnist/master/election/");
        assert_eq!(
            k.master_instance("m-0.u1"),
            "/edl/mnist/master/instances/m-0.u1"
        );
        assert!(k.master_instance("x").starts_with(&k.master_instances()));
        assert_eq!(
            k.task("00001-0000002-0000004"),
            "/edl/mnist/tasks/00001-0000002-0000004"
        );
        assert!(k.task("x").starts_with(&k.tasks()));
        assert_eq!(k.trainers(), "/edl/mnist/trainers/");
        assert_eq!(k.trainer("t1"), "/edl/mnist/trainers/t1");
        assert_eq!(k.trainer_id("/edl/mnist/trainers/t1"), Some("t1"));
        assert_eq!(k.trainer_id("/edl/mnist/trainers/"), None);
        assert_eq!(k.trainer_id("/edl/other/trainers/t1"), None);
    }

    #[test]
    fn pserver_and_checkpoint_keys() {
        let k = keys("j");
        assert_eq!(k.desired(), "/edl/j/ps/desired");
        assert_eq!(k.ps(3), "/edl/j/ps/3");
        assert_eq!(k.ps_index("/edl/j/ps/3"), Some(3));
        assert_eq!(k.ps_index("/edl/j/ps/desired"), None);
        assert_eq!(k.ps_index("/edl/j/ps/03"), None);
        // The replica records are outside the claims' prefix.
        assert_eq!(k.ps_group(3), "/edl/j/ps-group/3");
        assert!(!k.ps_group(3).starts_with(&k.ps_prefix()));
        assert!(!k.ps_member("m").starts_with(&k.ps_prefix()));
        assert_eq!(k.ps_member_id(&k.ps_member("p-12")), Some("p-12"));
        assert_eq!(k.ps_member_id(&k.ps_groups()), None);
        assert_eq!(k.manifest(12), "/edl/j/checkpoints/12");
        assert_eq!(k.manifest_step("/edl/j/checkpoints/12"), Some(12));
        assert_eq!(k.manifest_step("/edl/j/checkpoints/latest"), None);
        assert_eq!(k.manifest_step("/edl/j/checkpoints/"), None);
        assert_eq!(k.part(5, 1), "/edl/j/checkpoints/parts/5/1");
        assert!(k.part(5, 1).starts_with(&k.parts(5)));
        assert!(k.parts(5).starts_with(&k.all_parts()));
        // The hold and the pins are followed with the manifests, and are none.
        let pin = k.checkpoint_pin("snapshot-1764460800123-r42.db");
        assert_eq!(pin, "/edl/j/checkpoints/pins/snapshot-1764460800123-r42.db");
        assert!(pin.starts_with(&k.checkpoint_pins()));
        for key in [k.checkpoint_hold(), pin] {
            assert!(key.starts_with(&k.checkpoints()));
            assert_eq!(k.manifest_step(&key), None, "{key}");
        }
    }

    #[test]
    fn jobs_are_listed_by_their_spec_keys() {
        let k = keys("wine");
        assert_eq!(
            JobKeys::job_of_spec_key(&k.spec()),
            Some(JobName::new("wine").unwrap())
        );
        assert_eq!(JobKeys::job_of_spec_key(&k.state()), None);
        assert_eq!(JobKeys::job_of_spec_key("/edl/../job/spec"), None);
        assert_eq!(JobKeys::job_of_spec_key("/other/x/job/spec"), None);
    }
}
