//! The job's state in etcd into the status: EtcdReachable, and the master's pause
//! (EtcdSpaceAlarm).

use super::EtcdState;
use super::draft::Draft;

impl<'a> Draft<'a> {
    /// The job's state in etcd into the status and the `EtcdReachable` condition;
    /// `None` (one event) when etcd cannot be read.
    pub(super) fn etcd_state(&mut self) -> Option<&'a EtcdState> {
        let p = match &self.obs.etcd {
            Ok(p) => p,
            Err(e) => {
                let message = format!("cannot read the job's state from etcd: {e}");
                if self.condition("EtcdReachable", false, "EtcdUnreachable", message.clone()) {
                    self.plan.event(true, "EtcdUnreachable", message);
                }
                return None;
            }
        };
        self.condition("EtcdReachable", true, "Reachable", String::new());
        match &p.paused {
            Some(why) => {
                let message = format!("the master paused the job: {why}");
                if self.condition("EtcdSpaceAlarm", true, "EtcdFull", message.clone()) {
                    self.plan.event(true, "EtcdSpaceAlarm", message);
                }
            }
            None if self
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "EtcdSpaceAlarm") =>
            {
                self.condition(
                    "EtcdSpaceAlarm",
                    false,
                    "Cleared",
                    "the job's etcd takes writes again".to_owned(),
                );
            }
            None => {}
        }
        self.status.pass = p.pass;
        self.status.tasks = p.tasks.clone();
        self.status.trainers.registered = p.trainers;
        self.status.pservers = p.pservers;
        self.status.leader = p.leader.clone();
        Some(p)
    }
}
