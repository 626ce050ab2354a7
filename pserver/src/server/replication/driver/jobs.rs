//! The driver's work off the machine's lock and off its loop: a compare-and-swap of the
//! group record in etcd, and a snapshot for a joiner (a slow etcd or a large shard must
//! not hold the timers); each outcome goes back to the machine.

use std::sync::Arc;
use std::time::Duration;

use edl_job::GroupRecord;

use super::super::record::Proposed;
use super::Replication;
use crate::replica::{Guard, Msg};
use crate::shard::lock;

/// Work the driver task does off the machine's lock.
#[derive(Debug)]
pub(super) enum Job {
    Propose {
        expect_change: u64,
        record: GroupRecord,
        guard: Guard,
    },
    Snapshot {
        to: String,
        epoch: u64,
    },
}

impl Replication {
    /// Carries out a job of the driver.
    pub(super) async fn job(self: Arc<Self>, job: Job) {
        match job {
            Job::Propose {
                expect_change,
                record,
                guard,
            } => {
                let outcome = self.store.propose(expect_change, &record, &guard).await;
                let now = self.now();
                let mut m = lock(&self.machine);
                let fx = match outcome {
                    Proposed::Written(r) => m.observe(now, r),
                    Proposed::Refused(r) => {
                        // Refused at the change it expected: the guard failed, it did not
                        // land. Past it: the record read back settles the proposal (it
                        // may be this one, landed by an attempt whose answer was lost).
                        let moved_on = r.as_ref().is_some_and(|r| r.change > expect_change);
                        let mut fx = if moved_on {
                            Vec::new()
                        } else {
                            m.refused(now, &record)
                        };
                        if let Some(r) = r {
                            fx.extend(m.observe(now, r));
                        }
                        fx
                    }
                    Proposed::Unknown(e) => {
                        tracing::warn!(shard = self.index, error = %e, "group record write not confirmed; sending it again");
                        let me = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            // Only while it is still the proposal not settled.
                            if lock(&me.machine).proposal() == Some(&record) {
                                let _ = me.jobs.send(Job::Propose {
                                    expect_change,
                                    record,
                                    guard,
                                });
                            }
                        });
                        Vec::new()
                    }
                };
                self.run(&mut m, fx, None);
            }
            Job::Snapshot { to, epoch } => {
                let me = self.clone();
                let taken = tokio::task::spawn_blocking(move || {
                    let core = me.shard.core()?;
                    // Taken between two ops: every op given a place is applied.
                    core.replica_snapshot(|| lock(&me.machine).last_assigned().unwrap_or(0))
                })
                .await;
                let (bytes, seq) = match taken {
                    Ok(Ok(x)) => x,
                    Ok(Err(e)) => {
                        tracing::debug!(shard = self.index, %to, error = %e, "no snapshot for a joiner yet");
                        lock(&self.machine).snapshot_failed(&to);
                        return;
                    }
                    Err(_) => return,
                };
                let mut m = lock(&self.machine);
                if let Some(tx) = lock(&self.outbox).get(&to) {
                    let _ = tx.send((Msg::Snapshot { epoch, seq }, bytes));
                }
                let fx = m.snapshot_sent(self.now(), &to, seq);
                self.run(&mut m, fx, None);
            }
        }
    }
}
