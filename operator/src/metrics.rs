//! The operator's `/metrics` (Prometheus text format): reconciles, failed reconciles,
//! pods created and deleted, scale events, recoveries, the leases of ended pods'
//! processes revoked, the autoscaler's changes, and whether this replica leads.

use std::sync::atomic::AtomicI64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The operator's counters (cheap clones of shared atomics).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Reconciles run.
    pub reconciles: Counter,
    /// Reconciles that failed (retried).
    pub reconcile_errors: Counter,
    /// Pods created.
    pub pods_created: Counter,
    /// Pods deleted.
    pub pods_deleted: Counter,
    /// Scale events (up or down).
    pub scale_events: Counter,
    /// Pods replaced after a failure or a loss.
    pub recoveries: Counter,
    /// etcd leases of ended pods' processes revoked, by role (`role` = `trainer`,
    /// `pserver`, `master`): what each held passed on at once, not a lease TTL later.
    pub leases_revoked: Family<Vec<(String, String)>, Counter>,
    /// Trainer counts the autoscaler set (`--autoscale`).
    pub autoscaler_changes: Counter,
    /// 1 while this replica leads.
    pub leader: Gauge<i64, AtomicI64>,
}

impl Metrics {
    /// The metrics as Prometheus text.
    pub fn render(&self) -> String {
        let mut reg = Registry::with_prefix("edl_operator");
        reg.register("reconciles", "Reconciles run", self.reconciles.clone());
        reg.register(
            "reconcile_errors",
            "Reconciles that failed and were retried",
            self.reconcile_errors.clone(),
        );
        reg.register("pods_created", "Pods created", self.pods_created.clone());
        reg.register("pods_deleted", "Pods deleted", self.pods_deleted.clone());
        reg.register(
            "scale_events",
            "Trainer scale events",
            self.scale_events.clone(),
        );
        reg.register(
            "recoveries",
            "Pods replaced after a failure or a loss",
            self.recoveries.clone(),
        );
        reg.register(
            "leases_revoked",
            "etcd leases of ended pods' processes revoked, by role",
            self.leases_revoked.clone(),
        );
        reg.register(
            "autoscaler_changes",
            "Trainer counts the autoscaler set",
            self.autoscaler_changes.clone(),
        );
        reg.register("leader", "1 while this replica leads", self.leader.clone());
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        out
    }

    /// Counts `n` leases of an ended `role` process revoked.
    pub fn revoked(&self, role: &str, n: usize) {
        self.leases_revoked
            .get_or_create(&vec![("role".to_owned(), role.to_owned())])
            .inc_by(n as u64);
    }

    /// The leases of ended `role` processes revoked so far.
    pub fn revoked_of(&self, role: &str) -> u64 {
        self.leases_revoked
            .get_or_create(&vec![("role".to_owned(), role.to_owned())])
            .get()
    }

    /// Whether this replica leads, as the gauge says.
    pub fn is_leader(&self) -> bool {
        self.leader.get() == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter() {
        let m = Metrics::default();
        m.reconciles.inc();
        m.leader.set(1);
        m.revoked("pserver", 2);
        let text = m.render();
        for name in [
            "edl_operator_reconciles_total 1",
            "edl_operator_reconcile_errors_total 0",
            "edl_operator_pods_created_total 0",
            "edl_operator_scale_events_total 0",
            "edl_operator_recoveries_total 0",
            "edl_operator_autoscaler_changes_total 0",
            "edl_operator_leases_revoked_total{role=\"pserver\"} 2",
            "edl_operator_leader 1",
        ] {
            assert!(text.contains(name), "{name} in {text}");
        }
        assert!(m.is_leader());
    }
}
