//! Pod Security admission, as the API server's built-in admission plugin enforces the
//! Pod Security Standards (<https://kubernetes.io/docs/concepts/security/pod-security-standards/>):
//! a pod created in a namespace labelled `pod-security.kubernetes.io/enforce: baseline`
//! or `restricted` is refused (`403 Forbidden`, the message naming every check it
//! fails, as the real plugin words it) unless it meets that level.
//!
//! Checked, per the standards' `latest` version: *baseline*: no host namespaces
//! (`hostNetwork`, `hostPID`, `hostIPC`), no privileged container, capabilities added
//! only from the baseline set, no `hostPath` volume, no host ports, `procMount`
//! `Default`, no `Unconfined` seccomp profile, only the safe sysctls; *restricted*, in
//! addition: volumes only of the listed kinds, `allowPrivilegeEscalation: false`,
//! `runAsNonRoot: true` and no `runAsUser: 0` (pod or every container), a
//! `RuntimeDefault` or `Localhost` seccomp profile (pod or every container), and
//! capabilities dropping `ALL`, adding at most `NET_BIND_SERVICE`.
//!
//! Where it differs from a real cluster: only `enforce` is read (not `audit`, `warn` or
//! a `-version` pin; no cluster-wide defaults or exemptions from an admission
//! configuration), only pods are checked (a real plugin also warns on workload
//! templates), an update of a pod is not checked again, and the Windows, AppArmor and
//! SELinux checks are left out (no job sets those fields).

use serde_json::Value;

/// The namespace label that selects the enforced level.
pub const ENFORCE_LABEL: &str = "pod-security.kubernetes.io/enforce";

const BASELINE_CAPABILITIES: [&str; 13] = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

const SAFE_SYSCTLS: [&str; 9] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
];

const RESTRICTED_VOLUMES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// The level a namespace's labels enforce: `Some("baseline")` or `Some("restricted")`,
/// `None` for `privileged` or no label.
pub fn enforced(namespace_labels: &Value) -> Option<&str> {
    match namespace_labels[ENFORCE_LABEL].as_str() {
        Some(level @ ("baseline" | "restricted")) => Some(level),
        _ => None,
    }
}

/// Why `pod` fails `level` (`baseline` or `restricted`): each failed check with what to
/// set, as the real plugin words them; empty when it passes.
pub fn violations(level: &str, pod: &Value) -> Vec<String> {
    let spec = &pod["spec"];
    let containers: Vec<&Value> = ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
        .collect();
    let named = |pred: &dyn Fn(&Value) -> bool| -> Vec<String> {
        containers
            .iter()
            .filter(|c| pred(c))
            .map(|c| format!("{:?}", c["name"].as_str().unwrap_or("")))
            .collect()
    };
    let list = |names: &[String]| names.join(", ");
    let mut out = Vec::new();
    let host: Vec<&str> = ["hostNetwork", "hostPID", "hostIPC"]
        .into_iter()
        .filter(|k| spec[*k] == true)
        .collect();
    if !host.is_empty() {
        out.push(format!(
            "host namespaces ({})",
            host.iter()
                .map(|k| format!("{k}=true"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let privileged = named(&|c| c["securityContext"]["privileged"] == true);
    if !privileged.is_empty() {
        out.push(format!(
            "privileged (containers {} must not set securityContext.privileged=true)",
            list(&privileged)
        ));
    }
    let added = |c: &Value| -> Vec<String> {
        c["securityContext"]["capabilities"]["add"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    };
    let beyond = named(&|c| {
        added(c)
            .iter()
            .any(|a| !BASELINE_CAPABILITIES.contains(&a.as_str()))
    });
    if !beyond.is_empty() {
        out.push(format!(
            "non-default capabilities (containers {} must not include capabilities \
             beyond the baseline set in securityContext.capabilities.add)",
            list(&beyond)
        ));
    }
    let volumes: Vec<&Value> = spec["volumes"].as_array().into_iter().flatten().collect();
    let host_paths: Vec<String> = volumes
        .iter()
        .filter(|v| v.get("hostPath").is_some())
        .map(|v| format!("{:?}", v["name"].as_str().unwrap_or("")))
        .collect();
    if !host_paths.is_empty() {
        out.push(format!("hostPath volumes (volumes {})", list(&host_paths)));
    }
    let host_ports = named(&|c| {
        c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["hostPort"].as_i64().is_some_and(|h| h != 0))
    });
    if !host_ports.is_empty() {
        out.push(format!(
            "hostPort (containers {} use hostPorts)",
            list(&host_ports)
        ));
    }
    let proc_mount = named(&|c| {
        c["securityContext"]["procMount"]
            .as_str()
            .is_some_and(|m| m != "Default")
    });
    if !proc_mount.is_empty() {
        out.push(format!(
            "procMount (containers {} must not set securityContext.procMount)",
            list(&proc_mount)
        ));
    }
    let seccomp_type = |sc: &Value| sc["seccompProfile"]["type"].as_str().map(str::to_owned);
    let unconfined = seccomp_type(&spec["securityContext"]).as_deref() == Some("Unconfined")
        || containers
            .iter()
            .any(|c| seccomp_type(&c["securityContext"]).as_deref() == Some("Unconfined"));
    if unconfined {
        out.push("seccompProfile (pod or containers must not set type to \"Unconfined\")".into());
    }
    let unsafe_sysctls: Vec<&str> = spec["securityContext"]["sysctls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["name"].as_str())
        .filter(|n| !SAFE_SYSCTLS.contains(n))
        .collect();
    if !unsafe_sysctls.is_empty() {
        out.push(format!("forbidden sysctls ({})", unsafe_sysctls.join(", ")));
    }
    if level != "restricted" {
        return out;
    }
    let restricted_volumes: Vec<String> = volumes
        .iter()
        .filter(|v| {
            v.as_object().is_some_and(|o| {
                !o.keys()
                    .any(|k| k == "hostPath" || RESTRICTED_VOLUMES.contains(&k.as_str()))
                    && o.keys().any(|k| k != "name")
            })
        })
        .map(|v| format!("{:?}", v["name"].as_str().unwrap_or("")))
        .collect();
    if !restricted_volumes.is_empty() {
        out.push(format!(
            "restricted volume types (volumes {} use restricted volume types)",
            list(&restricted_volumes)
        ));
    }
    let escalation = named(&|c| c["securityContext"]["allowPrivilegeEscalation"] != false);
    if !escalation.is_empty() {
        out.push(format!(
            "allowPrivilegeEscalation != false (containers {} must set \
             securityContext.allowPrivilegeEscalation=false)",
            list(&escalation)
        ));
    }
    let caps = named(&|c| {
        let drops_all = c["securityContext"]["capabilities"]["drop"]
            .as_array()
            .is_some_and(|d| d.iter().any(|x| x == "ALL"));
        !drops_all || added(c).iter().any(|a| a != "NET_BIND_SERVICE")
    });
    if !caps.is_empty() {
        out.push(format!(
            "unrestricted capabilities (containers {} must set \
             securityContext.capabilities.drop=[\"ALL\"] and add at most \
             \"NET_BIND_SERVICE\")",
            list(&caps)
        ));
    }
    let pod_non_root = spec["securityContext"]["runAsNonRoot"] == true;
    let not_non_root = named(&|c| match c["securityContext"]["runAsNonRoot"].as_bool() {
        Some(v) => !v,
        None => !pod_non_root,
    });
    if !not_non_root.is_empty() {
        out.push(format!(
            "runAsNonRoot != true (pod or containers {} must set \
             securityContext.runAsNonRoot=true)",
            list(&not_non_root)
        ));
    }
    let root = spec["securityContext"]["runAsUser"] == 0
        || containers
            .iter()
            .any(|c| c["securityContext"]["runAsUser"] == 0);
    if root {
        out.push("runAsUser=0 (pod and containers must not set runAsUser=0)".into());
    }
    let confined = |t: Option<String>| matches!(t.as_deref(), Some("RuntimeDefault" | "Localhost"));
    let pod_seccomp = seccomp_type(&spec["securityContext"]);
    let no_seccomp = named(&|c| match seccomp_type(&c["securityContext"]) {
        Some(t) => !confined(Some(t)),
        None => !confined(pod_seccomp.clone()),
    });
    if !no_seccomp.is_empty() {
        out.push(format!(
            "seccompProfile (pod or containers {} must set \
             securityContext.seccompProfile.type to \"RuntimeDefault\" or \"Localhost\")",
            list(&no_seccomp)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn hardened() -> Value {
        json!({"spec": {
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {
                "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "d", "persistentVolumeClaim": {"claimName": "x"}}],
        }})
    }

    #[test]
    fn a_hardened_pod_passes_restricted_and_each_lapse_is_named() {
        assert_eq!(violations("restricted", &hardened()), Vec::<String>::new());
        let plain = json!({"spec": {"containers": [{"name": "c"}]}});
        assert!(
            violations("baseline", &plain).is_empty(),
            "baseline asks nothing of it"
        );
        let v = violations("restricted", &plain);
        for check in [
            "allowPrivilegeEscalation",
            "unrestricted capabilities",
            "runAsNonRoot",
            "seccompProfile",
        ] {
            assert!(v.iter().any(|m| m.starts_with(check)), "{check}: {v:?}");
        }
        let mut host = hardened();
        host["spec"]["volumes"][0] = json!({"name": "data", "hostPath": {"path": "/d"}});
        host["spec"]["hostNetwork"] = json!(true);
        host["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] =
            json!(["SYS_ADMIN"]);
        let v = violations("baseline", &host);
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(
            v[0].starts_with("host namespaces") && v[2].contains("\"data\""),
            "{v:?}"
        );
        let mut nfs = hardened();
        nfs["spec"]["volumes"][0] = json!({"name": "n", "nfs": {"server": "s", "path": "/"}});
        assert!(violations("baseline", &nfs).is_empty());
        assert_eq!(violations("restricted", &nfs).len(), 1);
        let mut root = hardened();
        root["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(0);
        assert_eq!(violations("restricted", &root).len(), 1);
        assert_eq!(
            enforced(&json!({ENFORCE_LABEL: "restricted"})),
            Some("restricted")
        );
        assert_eq!(enforced(&json!({ENFORCE_LABEL: "privileged"})), None);
    }
}
