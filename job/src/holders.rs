//! The etcd leases a job's process holds, found from its records, so that whoever sees
//! the process die (`edl run`'s supervisor from `waitpid`; on Kubernetes, the kubelet's
//! status of its pod) revokes them at once instead of waiting for their TTL: a trainer's
//! registration (and with it its tasks, which the master hands out again when the
//! registration goes), a pserver's shard claim and replica registration, a master's
//! candidacy in the election. Revoking is what the lease's expiry would do a TTL later;
//! it is safe only for a process known dead (a live process's lease is its own), and the
//! TTL stays the detector for everything else (a partition, a hung process, a lost
//! machine).
//!
//! [`leases_held`] is the pure part: which of the keys read under [`Holder::prefixes`]
//! the holder's leases hold. A key counts only when its record names the holder (a
//! trainer by its id; a pserver by its process id, its address or its
//! [instance](crate::env::INSTANCE); a master by the address it leads with or its
//! instance): a replacement that already claimed the same shard or slot is never
//! touched. `edl run` names its processes by process id and address; the Kubernetes
//! operator, which knows neither, by instance (`<pod name>.<pod uid>`, one per pod
//! incarnation).

use std::sync::Arc;

use edl_coord::{Backend, KeyValue, LeaseId};

use crate::{JobKeys, MemberRecord, PserverRecord, Record};

/// A process of a job, as the one who saw it die knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// A trainer: its id (`trainers/<id>`).
    Trainer {
        /// The trainer id.
        id: String,
    },
    /// A pserver process: its shard claims (`ps/<index>`) and replica registration
    /// (`ps-member/<id>`) whose record names this process id (on this machine), this
    /// address (where it served) or this instance.
    Pserver {
        /// Its process id, where it ran on the caller's machine.
        pid: Option<u32>,
        /// The address it served at.
        addr: Option<String>,
        /// Its instance ([`crate::env::INSTANCE`]).
        instance: Option<String>,
    },
    /// A master: its keys under the election prefix whose value is the address it
    /// serves at, and its instance's key ([`JobKeys::master_instance`]), under the
    /// lease it campaigns with.
    Master {
        /// The address it advertised.
        addr: Option<String>,
        /// Its instance ([`crate::env::INSTANCE`]).
        instance: Option<String>,
    },
}

impl Holder {
    /// Its role: `trainer`, `pserver` or `master`.
    pub fn role(&self) -> &'static str {
        match self {
            Holder::Trainer { .. } => "trainer",
            Holder::Pserver { .. } => "pserver",
            Holder::Master { .. } => "master",
        }
    }

    /// The key prefixes (or whole keys) to read for [`leases_held`].
    pub fn prefixes(&self, keys: &JobKeys) -> Vec<String> {
        match self {
            Holder::Trainer { id } => vec![keys.trainer(id)],
            Holder::Pserver { .. } => vec![keys.ps_prefix(), keys.ps_members()],
            Holder::Master { .. } => vec![keys.master_election(), keys.master_instances()],
        }
    }
}

/// The leases (each once) that hold those of `kvs`, read under [`Holder::prefixes`],
/// that belong to `holder`. Keys without a lease and records that do not name the
/// holder are left alone.
pub fn leases_held(keys: &JobKeys, holder: &Holder, kvs: &[KeyValue]) -> Vec<LeaseId> {
    let mut leases: Vec<LeaseId> = kvs
        .iter()
        .filter(|kv| held_by(keys, holder, kv))
        .filter_map(|kv| kv.lease)
        .collect();
    leases.sort_by_key(|l| l.0);
    leases.dedup();
    leases
}

fn held_by(keys: &JobKeys, holder: &Holder, kv: &KeyValue) -> bool {
    match holder {
        Holder::Trainer { id } => kv.key == keys.trainer(id),
        Holder::Pserver {
            pid,
            addr,
            instance,
        } => {
            let names = |(p, a, i): (u32, &str, &str)| {
                pid.is_some_and(|pid| pid != 0 && pid == p)
                    || addr.as_deref() == Some(a)
                    || named(instance, i)
            };
            if keys.ps_index(&kv.key).is_some() {
                PserverRecord::decode(&kv.value).is_ok_and(|r| names((r.pid, &r.addr, &r.instance)))
            } else if keys.ps_member_id(&kv.key).is_some() {
                MemberRecord::decode(&kv.value).is_ok_and(|r| names((r.pid, &r.addr, &r.instance)))
            } else {
                false
            }
        }
        Holder::Master { addr, instance } => {
            let candidacy = kv.key.starts_with(&keys.master_election())
                && addr.as_ref().is_some_and(|a| kv.value == a.as_bytes());
            let own = kv.key.strip_prefix(&keys.master_instances());
            candidacy || own.is_some_and(|i| named(instance, i))
        }
    }
}

/// Whether a record's `recorded` instance is the holder's (an empty one names nobody).
fn named(instance: &Option<String>, recorded: &str) -> bool {
    !recorded.is_empty() && instance.as_deref() == Some(recorded)
}

/// Reads `holder`'s keys and revokes the leases that hold them (a dead process's:
/// see the [module docs](self)); returns the leases revoked. A lease already gone
/// counts as revoked.
pub async fn revoke_held(
    backend: &Arc<dyn Backend>,
    keys: &JobKeys,
    holder: &Holder,
) -> edl_coord::Result<Vec<LeaseId>> {
    let mut kvs = Vec::new();
    for prefix in holder.prefixes(keys) {
        kvs.extend(backend.range(&prefix).await?.0);
    }
    let leases = leases_held(keys, holder, &kvs);
    for lease in &leases {
        match backend.lease_revoke(*lease).await {
            Ok(()) | Err(edl_coord::Error::LeaseLost) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(leases)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{JobName, TrainerRecord};

    fn kv(key: String, value: Vec<u8>, lease: i64) -> KeyValue {
        KeyValue {
            key,
            value,
            create_revision: 1,
            mod_revision: 1,
            version: 1,
            lease: (lease != 0).then_some(LeaseId(lease)),
        }
    }

    fn ps(addr: &str, pid: u32, instance: &str) -> Vec<u8> {
        PserverRecord {
            pid,
            instance: instance.into(),
            ..PserverRecord::at(addr)
        }
        .encode()
    }

    #[test]
    fn only_the_dead_holders_own_keys_count() {
        let keys = JobKeys::new(&JobName::new("j").unwrap());
        let trainer = TrainerRecord::model_less().encode();
        let member = |pid, instance: &str| {
            MemberRecord {
                version: 1,
                addr: "10.0.0.1:7000".into(),
                pid,
                started_ms: 0,
                instance: instance.into(),
            }
            .encode()
        };
        let kvs = vec![
            kv(keys.trainer("trainer-0.1"), trainer.clone(), 11),
            kv(keys.trainer("trainer-0.10"), trainer, 12),
            kv(keys.ps(0), ps("10.0.0.1:7000", 41, ""), 21),
            // The replacement's claim of shard 1, another process.
            kv(keys.ps(1), ps("10.0.0.2:7000", 42, ""), 22),
            kv(keys.ps_member("a"), member(41, ""), 23),
            // The same lease on two keys counts once.
            kv(keys.ps_member("b"), member(41, ""), 23),
            kv(keys.ps_group(0), b"{}".to_vec(), 0),
            // Pods (pid 1 in each container): by instance only.
            kv(keys.ps(2), ps("10.1.0.5:7000", 1, "j-ps-2.u1"), 24),
            kv(keys.ps_member("c"), member(1, "j-ps-2.u1"), 24),
            kv(keys.ps(3), ps("10.1.0.6:7000", 1, "j-ps-3.u2"), 25),
            kv(
                format!("{}0001", keys.master_election()),
                b"10.0.0.9:6000".to_vec(),
                31,
            ),
            kv(
                format!("{}0002", keys.master_election()),
                b"10.0.0.8:6000".to_vec(),
                32,
            ),
            kv(
                format!("{}0003", keys.master_election()),
                b"10.1.0.7:6000".to_vec(),
                33,
            ),
            kv(
                keys.master_instance("j-master-0.u3"),
                b"10.1.0.7:6000".to_vec(),
                33,
            ),
            kv(
                keys.master_instance("j-master-1.u4"),
                b"10.1.0.8:6000".to_vec(),
                34,
            ),
        ];
        let held = |h: Holder| leases_held(&keys, &h, &kvs);
        assert_eq!(
            held(Holder::Trainer {
                id: "trainer-0.1".into()
            }),
            [LeaseId(11)]
        );
        let pserver = |pid, addr: Option<&str>, instance: Option<&str>| Holder::Pserver {
            pid,
            addr: addr.map(Into::into),
            instance: instance.map(Into::into),
        };
        // By process id (its claim and its replica registrations), by address, or by
        // instance.
        assert_eq!(
            held(pserver(Some(41), None, None)),
            [LeaseId(21), LeaseId(23)]
        );
        assert_eq!(
            held(pserver(None, Some("10.0.0.2:7000"), None)),
            [LeaseId(22)]
        );
        assert_eq!(held(pserver(None, None, Some("j-ps-2.u1"))), [LeaseId(24)]);
        // A pid of 0 or an empty instance (a record that does not say) names nobody.
        assert!(held(pserver(Some(0), None, None)).is_empty());
        assert!(held(pserver(None, None, Some(""))).is_empty());
        let master = |addr: Option<&str>, instance: Option<&str>| Holder::Master {
            addr: addr.map(Into::into),
            instance: instance.map(Into::into),
        };
        assert_eq!(held(master(Some("10.0.0.8:6000"), None)), [LeaseId(32)]);
        assert_eq!(held(master(None, Some("j-master-0.u3"))), [LeaseId(33)]);
        assert!(held(master(None, Some("j-master-9.u9"))).is_empty());
        assert!(
            held(Holder::Trainer {
                id: "trainer-9.9".into()
            })
            .is_empty()
        );
    }
}
