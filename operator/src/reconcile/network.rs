//! The job's services, NetworkPolicy and PodDisruptionBudgets, made before its pods.

use super::draft::Draft;
use crate::objects;

impl Draft<'_> {
    /// Creates the services, the PodDisruptionBudgets and the NetworkPolicy that are
    /// missing, and replaces a
    /// NetworkPolicy that is not the one the operator's configuration makes (an earlier
    /// operator's, or one an admin changed by hand: the operator's wins).
    pub(super) fn services(&mut self) {
        for s in objects::services(self.obs.job) {
            let name = s.metadata.name.clone().unwrap_or_default();
            if !self.obs.services.contains(&name) {
                self.plan.create_services.push(s);
            }
        }
        for b in objects::disruption_budgets(self.obs.job) {
            let name = b.metadata.name.clone().unwrap_or_default();
            if !self.obs.disruption_budgets.contains(&name) {
                self.plan.create_disruption_budgets.push(b);
            }
        }
        let policy = objects::network_policy(self.obs.job, &self.obs.network);
        let name = policy.metadata.name.clone().unwrap_or_default();
        match self.obs.network_policies.get(&name) {
            None => self.plan.create_network_policies.push(policy),
            Some(spec) if *spec != policy.spec => {
                self.plan.replace_network_policies.push(policy);
            }
            Some(_) => {}
        }
    }
}
