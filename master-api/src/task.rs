//! The task as it travels from the master to a trainer and back: [`LeasedTask`] (what a
//! trainer holds: which chunks to read, and the generation its reports must carry) and
//! [`Answer`] (the answer to `GetTask`). Both sides of the wire use these domain types;
//! this module is the one place they are converted to and from protobuf.
//!
//! The master and its client both depend on this crate for them; neither depends on the
//! other.
//!
//! Along `GetTask` → `TaskFinished`: the master's queue leases a `queue::Task` (its
//! state machine's record; the queue answers `queue::GetTask`), the leader's actor turns
//! it into a [`LeasedTask`] (with the file's path) inside an [`Answer`], the gRPC service
//! sends it as `pb::Task`, the client turns it back into a [`LeasedTask`], the trainer's
//! `cloud_reader` (`edl_trainer::tasks`) reads its records and the trainer reports it by
//! id and generation.

use edl_proto::master as pb;

/// A task leased to a trainer: a run of chunks of one RecordIO file, in one pass, at one
/// generation (a report with another generation is stale).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasedTask {
    /// The task id (`<file>-<first chunk>-<end chunk>`).
    pub id: String,
    /// The RecordIO file.
    pub path: String,
    /// First chunk (inclusive).
    pub chunk_begin: u32,
    /// Last chunk (exclusive).
    pub chunk_end: u32,
    /// Records in those chunks.
    pub records: u64,
    /// The pass.
    pub pass: u32,
    /// The lease's generation: reports must carry it.
    pub generation: u64,
    /// Failures of this task so far in this pass.
    pub failures: u32,
    /// Byte offset of the first chunk, as indexed (the reader checks it).
    pub offset_begin: u64,
    /// Byte offset just past the last chunk, as indexed.
    pub offset_end: u64,
    /// The task's index in the dataset (its pushes' origin names it so).
    pub index: u32,
    /// Tasks in the dataset.
    pub tasks: u32,
    /// Dispatches of this task in this pass, this lease included (a rewind counts as
    /// one); 0 when the master did not say. Only the first attempt (1) may group its
    /// batches into pushes as it likes: see `TaskOrigin` in `master.proto`.
    pub dispatches: u32,
    /// Where this attempt starts: after the batches an earlier holder of the lease
    /// applied before it handed the task back (a drain), or from the start (`None`).
    pub resume: Option<Resume>,
}

/// Where a task handed back by a draining trainer resumes: its first `batch` batches
/// (its first `records` records) were applied on every pserver shard before the hand-back.
/// Batches are the same in every attempt (consecutive records, seeded by their number in
/// the task), so the next attempt trains from batch `batch` on; the batches before it
/// are never trained again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// Batches applied, from the task's first.
    pub batch: u32,
    /// Their records.
    pub records: u64,
    /// Per pserver shard, the oldest incarnation that answered those batches' pushes (0:
    /// none): the attempt that finishes the task says it with its own in `TaskDone`, so
    /// that a shard restored since (which may lack those batches) has the task trained
    /// again whole.
    pub answered: Vec<u64>,
}

/// How a holder hands its task back (`ReleaseTask`): not a failure either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// Draining: `trained` records trained by this attempt; `resume`, where the next
    /// attempt starts (the batches applied on every shard, counted from the task's
    /// first; `None`: none, the next attempt trains the task whole).
    Drained {
        /// Records this attempt trained.
        trained: u64,
        /// What the next attempt resumes after.
        resume: Option<Resume>,
    },
    /// Trained whole (`trained` records), but a pserver shard restored meanwhile lacks
    /// some of it: trained again whole (counted as recomputed).
    Recompute {
        /// Records this attempt trained.
        trained: u64,
    },
}

impl Release {
    /// A task handed back before any of it was trained (read ahead, or leased during a
    /// drain): an earlier attempt's resume point stands.
    pub fn untrained() -> Release {
        Release::Drained {
            trained: 0,
            resume: None,
        }
    }

    /// The `ReleaseTask` request handing back `task`, held by `trainer`.
    pub fn request(&self, trainer: &str, task: &LeasedTask) -> pb::ReleaseTaskRequest {
        let (trained, recompute, resume) = match self {
            Release::Drained { trained, resume } => (*trained, false, resume.as_ref()),
            Release::Recompute { trained } => (*trained, true, None),
        };
        pb::ReleaseTaskRequest {
            trainer: trainer.to_owned(),
            task_id: task.id.clone(),
            generation: task.generation,
            records_trained: trained,
            recompute,
            resume_batch: resume.map_or(0, |r| r.batch),
            resume_records: resume.map_or(0, |r| r.records),
            resume_answered: resume.map(|r| r.answered.clone()).unwrap_or_default(),
        }
    }
}

impl From<&pb::ReleaseTaskRequest> for Release {
    fn from(r: &pb::ReleaseTaskRequest) -> Self {
        if r.recompute {
            return Release::Recompute {
                trained: r.records_trained,
            };
        }
        Release::Drained {
            trained: r.records_trained,
            resume: (r.resume_batch > 0).then(|| Resume {
                batch: r.resume_batch,
                records: r.resume_records,
                answered: r.resume_answered.clone(),
            }),
        }
    }
}

impl LeasedTask {
    /// Whether this is the first attempt at the task in its pass, with no part of an
    /// earlier attempt possibly applied anywhere.
    pub fn first_attempt(&self) -> bool {
        self.dispatches == 1
    }
}

/// The answer to `GetTask`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A leased task.
    Task(LeasedTask),
    /// Nothing free before the wait ran out; ask again.
    Wait,
    /// The pass asked for is over; the current one is this.
    PassFinished(u32),
    /// Every pass is done.
    JobFinished,
}

impl From<LeasedTask> for pb::Task {
    fn from(t: LeasedTask) -> Self {
        pb::Task {
            id: t.id,
            path: t.path,
            chunk_begin: t.chunk_begin,
            chunk_end: t.chunk_end,
            records: t.records,
            pass: t.pass,
            generation: t.generation,
            failures: t.failures,
            offset_begin: t.offset_begin,
            offset_end: t.offset_end,
            index: t.index,
            tasks: t.tasks,
            dispatches: t.dispatches,
            resume_batch: t.resume.as_ref().map_or(0, |r| r.batch),
            resume_records: t.resume.as_ref().map_or(0, |r| r.records),
            resume_answered: t.resume.map(|r| r.answered).unwrap_or_default(),
        }
    }
}

impl From<pb::Task> for LeasedTask {
    fn from(t: pb::Task) -> Self {
        LeasedTask {
            id: t.id,
            path: t.path,
            chunk_begin: t.chunk_begin,
            chunk_end: t.chunk_end,
            records: t.records,
            pass: t.pass,
            generation: t.generation,
            failures: t.failures,
            offset_begin: t.offset_begin,
            offset_end: t.offset_end,
            index: t.index,
            tasks: t.tasks,
            dispatches: t.dispatches,
            resume: (t.resume_batch > 0).then_some(Resume {
                batch: t.resume_batch,
                records: t.resume_records,
                answered: t.resume_answered,
            }),
        }
    }
}

impl From<Answer> for pb::GetTaskResponse {
    fn from(n: Answer) -> Self {
        use pb::get_task_response::Result as R;
        let result = match n {
            Answer::Task(t) => R::Task(t.into()),
            Answer::Wait => R::Wait(pb::Empty {}),
            Answer::PassFinished(p) => R::PassFinished(p),
            Answer::JobFinished => R::JobFinished(pb::Empty {}),
        };
        pb::GetTaskResponse {
            result: Some(result),
        }
    }
}

impl From<pb::GetTaskResponse> for Answer {
    fn from(r: pb::GetTaskResponse) -> Self {
        use pb::get_task_response::Result as R;
        match r.result {
            Some(R::Task(t)) => Answer::Task(t.into()),
            Some(R::Wait(_)) | None => Answer::Wait,
            Some(R::PassFinished(p)) => Answer::PassFinished(p),
            Some(R::JobFinished(_)) => Answer::JobFinished,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_and_answers_round_trip_through_protobuf() {
        let t = LeasedTask {
            id: "00001-0000002-0000004".into(),
            path: "/d/part-001.recordio".into(),
            chunk_begin: 2,
            chunk_end: 4,
            records: 10,
            pass: 3,
            generation: 7,
            failures: 1,
            offset_begin: 100,
            offset_end: 900,
            index: 5,
            tasks: 9,
            dispatches: 2,
            resume: None,
        };
        let resumed = LeasedTask {
            resume: Some(Resume {
                batch: 3,
                records: 96,
                answered: vec![4, 0],
            }),
            ..t.clone()
        };
        for n in [
            Answer::Task(resumed.clone()),
            Answer::Task(t.clone()),
            Answer::Wait,
            Answer::PassFinished(4),
            Answer::JobFinished,
        ] {
            let wire: pb::GetTaskResponse = n.clone().into();
            assert_eq!(Answer::from(wire), n);
        }
        assert_eq!(
            Answer::from(pb::GetTaskResponse { result: None }),
            Answer::Wait
        );
        for r in [
            Release::Drained {
                trained: 64,
                resume: resumed.resume.clone(),
            },
            Release::Drained {
                trained: 5,
                resume: None,
            },
            Release::Recompute { trained: 10 },
        ] {
            assert_eq!(Release::from(&r.request("t1", &t)), r);
        }
    }
}
