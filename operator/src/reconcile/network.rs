//! The job's services and NetworkPolicy, made before its pods.

use super::draft::Draft;
use crate::objects;

impl Draft<'_> {
    /// Creates the services and the NetworkPolicy that are missing.
    pub(super) fn services(&mut self) {
        for s in objects::services(self.obs.job) {
            let name = s.metadata.name.clone().unwrap_or_default();
            if !self.obs.services.contains(&name) {
                self.plan.create_services.push(s);
            }
        }
        let policy = objects::network_policy(self.obs.job, &self.obs.operator_namespace);
        let name = policy.metadata.name.clone().unwrap_or_default();
        if !self.obs.network_policies.contains(&name) {
            self.plan.create_network_policies.push(policy);
        }
    }
}
