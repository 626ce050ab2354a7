//! NetworkPolicy (`networking.k8s.io/v1`) as a cluster whose network plugin enforces it
//! decides: whether a TCP connection from one pod to a port of another is allowed by the
//! policies stored in the stand-in. The stand-in's pods share this host's loopback, so
//! nothing filters their sockets; a test asks [`FakeApi::network_allows`] what a real
//! cluster would let through. Written from the API reference and the concept page
//! (<https://kubernetes.io/docs/concepts/services-networking/network-policies/>):
//!
//! - A pod is isolated for ingress (egress) when a policy in its namespace selects it
//!   (`spec.podSelector`; `{}` selects every pod) and has `Ingress` (`Egress`) among its
//!   `policyTypes`. Without `policyTypes`, a policy is `Ingress`, and `Egress` too when
//!   it has `egress` rules. A pod no policy isolates allows everything that way.
//! - A connection is allowed when both ends allow it: the destination's ingress (any
//!   rule of any policy isolating it matches the source and the port) and the source's
//!   egress (likewise with the destination). Policies add up; none denies.
//! - A rule without `from` (`to`) matches every peer, without `ports` every port. A peer
//!   with `podSelector` alone is a pod of the policy's namespace; with
//!   `namespaceSelector` alone, any pod of a matching namespace; with both, a matching
//!   pod of a matching namespace. A namespace's labels are those of its Namespace
//!   object, if stored, and always `kubernetes.io/metadata.name`.
//! - A port is a number or the name of one of the destination container's ports, with
//!   `endPort` for a range; the protocol defaults to TCP.
//! - Label selectors: `matchLabels` and `matchExpressions` (`In`, `NotIn`, `Exists`,
//!   `DoesNotExist`), all terms together.
//!
//! Not covered: `ipBlock` peers (they match no pod here: pods have no addresses of
//! their own), other protocols than TCP, traffic from outside the cluster, and the
//! connections a plugin always allows (to a pod from its own node).

use serde_json::Value;

use super::FakeApi;

/// One end of a connection: a pod object and its namespace's labels.
#[derive(Debug, Clone, Copy)]
pub struct End<'a> {
    /// The pod (as stored).
    pub pod: &'a Value,
    /// Its namespace's labels (a JSON object).
    pub namespace_labels: &'a Value,
}

/// Which way a policy rule faces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        }
    }

    /// The rules of this direction and the key of their peers.
    fn rules(self, spec: &Value) -> (&Value, &'static str) {
        match self {
            Direction::Ingress => (&spec["ingress"], "from"),
            Direction::Egress => (&spec["egress"], "to"),
        }
    }
}

/// Whether `selector` (a LabelSelector; absent: `{}`) matches `labels`.
pub fn selector_matches(selector: &Value, labels: &Value) -> bool {
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    let equal = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| label(k) == v.as_str());
    let expressions = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            let key = e["key"].as_str().unwrap_or_default();
            let values: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            match e["operator"].as_str() {
                Some("In") => label(key).is_some_and(|v| values.contains(&v)),
                Some("NotIn") => !label(key).is_some_and(|v| values.contains(&v)),
                Some("Exists") => label(key).is_some(),
                Some("DoesNotExist") => label(key).is_none(),
                // An operator the API server would have refused selects nothing.
                _ => false,
            }
        });
    equal && expressions
}

fn labels(pod: &Value) -> &Value {
    &pod["metadata"]["labels"]
}

/// Whether `policy` isolates `pod` (in the policy's namespace) in `direction`.
fn isolates(policy: &Value, pod: &Value, direction: Direction) -> bool {
    let spec = &policy["spec"];
    let types: Vec<&str> = match spec["policyTypes"].as_array() {
        Some(t) => t.iter().filter_map(Value::as_str).collect(),
        None if spec["egress"].is_array() => vec!["Ingress", "Egress"],
        None => vec!["Ingress"],
    };
    types.contains(&direction.name()) && selector_matches(&spec["podSelector"], labels(pod))
}

/// Whether `peer` (a NetworkPolicyPeer of a policy in namespace `policy_ns`) is `other`.
fn peer_matches(peer: &Value, policy_ns: &str, other: End<'_>, other_ns: &str) -> bool {
    let pods = &peer["podSelector"];
    let namespaces = &peer["namespaceSelector"];
    if pods.is_null() && namespaces.is_null() {
        // An ipBlock: no pod here has an address of its own.
        return false;
    }
    let namespace_ok = if namespaces.is_null() {
        other_ns == policy_ns
    } else {
        selector_matches(namespaces, other.namespace_labels)
    };
    namespace_ok && selector_matches(pods, labels(other.pod))
}

/// Whether a rule's `ports` (absent or empty: all) hold TCP `port` of `destination`.
fn port_matches(ports: &Value, port: u16, destination: &Value) -> bool {
    let Some(ports) = ports.as_array().filter(|p| !p.is_empty()) else {
        return true;
    };
    ports.iter().any(|p| {
        if p["protocol"].as_str().unwrap_or("TCP") != "TCP" {
            return false;
        }
        let first = match &p["port"] {
            Value::Null => return true,
            Value::Number(n) => n.as_u64(),
            Value::String(name) => named_port(destination, name),
            _ => None,
        };
        let last = p["endPort"].as_u64().or(first);
        first.is_some_and(|f| (f..=last.unwrap_or(f)).contains(&u64::from(port)))
    })
}

/// The number of the container port named `name` in `pod`.
fn named_port(pod: &Value, name: &str) -> Option<u64> {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"].as_str() == Some(name))
        .and_then(|p| p["containerPort"].as_u64())
}

/// Whether the policies of `own` (in namespace `own_ns`) let `own` take (ingress) or
/// make (egress) a connection with `other` on TCP `port` of the destination.
fn side_allows(
    policies: &[Value],
    own: End<'_>,
    own_ns: &str,
    other: End<'_>,
    other_ns: &str,
    port: u16,
    direction: Direction,
) -> bool {
    let destination = match direction {
        Direction::Ingress => own.pod,
        Direction::Egress => other.pod,
    };
    let mut isolating = policies
        .iter()
        .filter(|p| isolates(p, own.pod, direction))
        .peekable();
    if isolating.peek().is_none() {
        return true;
    }
    isolating.any(|policy| {
        let (rules, peers_key) = direction.rules(&policy["spec"]);
        rules.as_array().into_iter().flatten().any(|rule| {
            let peers_ok = match rule[peers_key].as_array().filter(|p| !p.is_empty()) {
                None => true,
                Some(peers) => peers
                    .iter()
                    .any(|peer| peer_matches(peer, own_ns, other, other_ns)),
            };
            peers_ok && port_matches(&rule["ports"], port, destination)
        })
    })
}

/// Whether a connection from `from` (in `from_ns`, whose policies are `from_policies`)
/// to TCP `port` of `to` (in `to_ns`, with `to_policies`) is allowed.
pub fn allows(
    from_policies: &[Value],
    from: End<'_>,
    from_ns: &str,
    to_policies: &[Value],
    to: End<'_>,
    to_ns: &str,
    port: u16,
) -> bool {
    side_allows(
        to_policies,
        to,
        to_ns,
        from,
        from_ns,
        port,
        Direction::Ingress,
    ) && side_allows(
        from_policies,
        from,
        from_ns,
        to,
        to_ns,
        port,
        Direction::Egress,
    )
}

impl FakeApi {
    /// The labels of namespace `ns`: its Namespace object's, if stored, and
    /// `kubernetes.io/metadata.name`, which a real API server sets on every namespace.
    fn namespace_labels(&self, ns: &str) -> Value {
        let mut labels = if self.serves("namespaces") {
            self.get("namespaces", "", ns)
                .map(|n| n["metadata"]["labels"].clone())
                .filter(Value::is_object)
                .unwrap_or_else(|| Value::Object(Default::default()))
        } else {
            Value::Object(Default::default())
        };
        labels["kubernetes.io/metadata.name"] = Value::String(ns.to_owned());
        labels
    }

    /// Whether the NetworkPolicies stored here allow pod `from` (`(namespace, name)`) to
    /// connect to TCP `port` of pod `to`, as a cluster enforcing them would decide (see
    /// the module's notes). `Err` names a pod that is not there.
    pub fn network_allows(
        &self,
        from: (&str, &str),
        to: (&str, &str),
        port: u16,
    ) -> Result<bool, String> {
        let pod = |(ns, name): (&str, &str)| {
            self.get("pods", ns, name)
                .ok_or_else(|| format!("no pod {ns}/{name}"))
        };
        let (from_pod, to_pod) = (pod(from)?, pod(to)?);
        let (from_labels, to_labels) = (self.namespace_labels(from.0), self.namespace_labels(to.0));
        let policies = |ns: &str| {
            if self.serves("networkpolicies") {
                self.list("networkpolicies", ns)
            } else {
                Vec::new()
            }
        };
        Ok(allows(
            &policies(from.0),
            End {
                pod: &from_pod,
                namespace_labels: &from_labels,
            },
            from.0,
            &policies(to.0),
            End {
                pod: &to_pod,
                namespace_labels: &to_labels,
            },
            to.0,
            port,
        ))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(labels: Value, ports: Value) -> Value {
        json!({"metadata": {"labels": labels}, "spec": {"containers": [{"ports": ports}]}})
    }

    /// Whether `from` in `from_ns` may reach `port` of `to` in `to_ns` under `policies`
    /// (each `(namespace, policy)`); namespaces labelled only with their name.
    fn check(
        policies: &[(&str, Value)],
        from: (&str, &Value),
        to: (&str, &Value),
        port: u16,
    ) -> bool {
        let of = |ns: &str| -> Vec<Value> {
            policies
                .iter()
                .filter(|(n, _)| *n == ns)
                .map(|(_, p)| p.clone())
                .collect()
        };
        let (fl, tl) = (
            json!({"kubernetes.io/metadata.name": from.0}),
            json!({"kubernetes.io/metadata.name": to.0}),
        );
        allows(
            &of(from.0),
            End {
                pod: from.1,
                namespace_labels: &fl,
            },
            from.0,
            &of(to.0),
            End {
                pod: to.1,
                namespace_labels: &tl,
            },
            to.0,
            port,
        )
    }

    #[test]
    fn a_pod_no_policy_selects_takes_everything_and_a_selecting_policy_without_rules_nothing() {
        let a = pod(json!({"app": "a"}), json!([]));
        let b = pod(json!({"app": "b"}), json!([]));
        assert!(check(&[], ("x", &a), ("x", &b), 80));
        let deny_b = json!({"spec": {"podSelector": {"matchLabels": {"app": "b"}}}});
        assert!(!check(&[("x", deny_b.clone())], ("x", &a), ("x", &b), 80));
        // It isolates b only: a still takes connections, and the policy of another
        // namespace does not apply.
        assert!(check(&[("x", deny_b.clone())], ("x", &b), ("x", &a), 80));
        assert!(check(&[("y", deny_b)], ("x", &a), ("x", &b), 80));
        // `{}` selects every pod of its namespace.
        let deny_all = json!({"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}});
        assert!(!check(&[("x", deny_all)], ("x", &b), ("x", &a), 80));
    }

    #[test]
    fn peers_are_or_but_a_peer_with_both_selectors_is_and() {
        let db = pod(json!({"role": "db"}), json!([]));
        let front_x = pod(json!({"role": "front"}), json!([]));
        let other = pod(json!({"role": "other"}), json!([]));
        let both = json!({"spec": {"podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [{"from": [{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}},
                "podSelector": {"matchLabels": {"role": "front"}}}]}]}});
        assert!(check(
            &[("x", both.clone())],
            ("y", &front_x),
            ("x", &db),
            5432
        ));
        assert!(!check(
            &[("x", both.clone())],
            ("y", &other),
            ("x", &db),
            5432
        ));
        assert!(!check(&[("x", both)], ("x", &front_x), ("x", &db), 5432));
        let either = json!({"spec": {"podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [{"from": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "y"}}},
                {"podSelector": {"matchLabels": {"role": "front"}}}]}]}});
        assert!(check(
            &[("x", either.clone())],
            ("y", &other),
            ("x", &db),
            5432
        ));
        assert!(check(
            &[("x", either.clone())],
            ("x", &front_x),
            ("x", &db),
            5432
        ));
        assert!(!check(
            &[("x", either.clone())],
            ("x", &other),
            ("x", &db),
            5432
        ));
        // A podSelector alone means the policy's own namespace.
        assert!(!check(&[("x", either)], ("z", &front_x), ("x", &db), 5432));
    }

    #[test]
    fn ports_by_number_name_and_range_and_tcp_only() {
        let server = pod(
            json!({"app": "s"}),
            json!([{"name": "grpc", "containerPort": 8080}]),
        );
        let client = pod(json!({"app": "c"}), json!([]));
        let policy =
            |ports: Value| json!({"spec": {"podSelector": {}, "ingress": [{"ports": ports}]}});
        let ok = |ports: Value, port: u16| {
            check(
                &[("x", policy(ports))],
                ("x", &client),
                ("x", &server),
                port,
            )
        };
        assert!(ok(json!([{"port": 8080}]), 8080));
        assert!(!ok(json!([{"port": 8080}]), 9090));
        assert!(ok(json!([{"port": "grpc"}]), 8080));
        assert!(!ok(json!([{"port": "metrics"}]), 8080));
        assert!(ok(json!([{"port": 9000, "endPort": 9100}]), 9090));
        assert!(!ok(json!([{"port": 9000, "endPort": 9100}]), 9101));
        assert!(!ok(json!([{"port": 8080, "protocol": "UDP"}]), 8080));
        assert!(ok(json!([]), 1));
    }

    #[test]
    fn egress_rules_isolate_the_source_and_both_ends_must_allow() {
        let a = pod(json!({"app": "a"}), json!([]));
        let b = pod(json!({"app": "b"}), json!([]));
        let c = pod(json!({"app": "c"}), json!([]));
        // Without policyTypes, egress rules make it an Egress policy too.
        let a_only_to_b = json!({"spec": {"podSelector": {"matchLabels": {"app": "a"}},
            "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "b"}}}]}]}});
        assert!(check(
            &[("x", a_only_to_b.clone())],
            ("x", &a),
            ("x", &b),
            80
        ));
        assert!(!check(
            &[("x", a_only_to_b.clone())],
            ("x", &a),
            ("x", &c),
            80
        ));
        // ... and Ingress, with no ingress rules: nothing reaches a.
        assert!(!check(&[("x", a_only_to_b)], ("x", &b), ("x", &a), 80));
    }

    #[test]
    fn match_expressions() {
        let labels = json!({"tier": "db", "env": "prod"});
        let sel = |e: Value| json!({"matchExpressions": [e]});
        assert!(selector_matches(
            &sel(json!({"key": "tier", "operator": "In", "values": ["db", "cache"]})),
            &labels
        ));
        assert!(!selector_matches(
            &sel(json!({"key": "env", "operator": "NotIn", "values": ["prod"]})),
            &labels
        ));
        assert!(selector_matches(
            &sel(json!({"key": "team", "operator": "NotIn", "values": ["x"]})),
            &labels
        ));
        assert!(selector_matches(
            &sel(json!({"key": "env", "operator": "Exists"})),
            &labels
        ));
        assert!(!selector_matches(
            &sel(json!({"key": "env", "operator": "DoesNotExist"})),
            &labels
        ));
        assert!(selector_matches(&json!(null), &labels), "absent: every pod");
    }
}
