//! The etcd key layout of a job (see docs/design.md): everything under `/edl/<job>/`.

/// Keys of one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// The keys of job `job`.
    pub fn new(job: &str) -> Keys {
        Keys {
            root: format!("/edl/{job}/"),
        }
    }

    /// `/edl/<job>/`.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The master election prefix; the leader's value is its gRPC address.
    pub fn master_election(&self) -> String {
        format!("{}master/election/", self.root)
    }

    /// The indexed dataset, written once after all its tasks.
    pub fn dataset(&self) -> String {
        format!("{}job/dataset", self.root)
    }

    /// The queue record: current pass, finished flag, counters, failed tasks.
    pub fn queue(&self) -> String {
        format!("{}job/queue", self.root)
    }

    /// The job state: running / succeeded / failed.
    pub fn state(&self) -> String {
        format!("{}job/state", self.root)
    }

    /// The prefix of every task record.
    pub fn tasks(&self) -> String {
        format!("{}tasks/", self.root)
    }

    /// One task record.
    pub fn task(&self, id: &str) -> String {
        format!("{}tasks/{id}", self.root)
    }

    /// The trainer registry prefix.
    pub fn trainers(&self) -> String {
        format!("{}trainers/", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::Keys;

    #[test]
    fn layout() {
        let k = Keys::new("mnist");
        assert_eq!(k.master_election(), "/edl/mnist/master/election/");
        assert_eq!(
            k.task("00001-0000002-0000004"),
            "/edl/mnist/tasks/00001-0000002-0000004"
        );
        assert!(k.task("x").starts_with(&k.tasks()));
        assert_eq!(k.trainers(), "/edl/mnist/trainers/");
    }
}
