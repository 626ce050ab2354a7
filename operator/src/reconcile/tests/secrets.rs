//! The job's credentials: required by every job process when the operator made them,
//! hand-made ones taken, and ones it cannot make a condition and one event.

use super::*;

#[test]
fn job_processes_require_the_credentials_the_operator_made_and_take_hand_made_ones() {
    let tj = training_job("");
    let plan = reconcile(&Observed {
        credentials: JobCredentials::Ready,
        ..observe(&tj, vec![], Ok(EtcdState::default()))
    });
    assert_eq!(plan.create_pods.len(), 4);
    for p in &plan.create_pods {
        let r = env_from_secret(p).expect("the Secret");
        assert_eq!(r.name, "mnist-edl-credentials");
        assert_eq!(
            r.optional, None,
            "required: a pod without it does not start"
        );
    }
    let status = plan.status.expect("status");
    let c = condition(&status, "CredentialsReady");
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Issued"));
    assert!(c.message.contains("mnist-edl-credentials"), "{c:?}");

    // An operator without admin credentials: the Secret if an administrator made one.
    let plan = reconcile(&observe(&tj, vec![], Ok(EtcdState::default())));
    assert_eq!(plan.create_pods.len(), 4);
    for p in &plan.create_pods {
        let r = env_from_secret(p).expect("the Secret");
        assert_eq!(
            (r.name.as_str(), r.optional),
            ("mnist-edl-credentials", Some(true))
        );
    }
    let status = plan.status.expect("status");
    assert!(
        status
            .conditions
            .iter()
            .all(|c| c.type_ != "CredentialsReady")
    );

    // A job with its own etcd: none, whatever the operator has.
    let mut managed = training_job("");
    managed.spec.etcd = EtcdSpec {
        managed: true,
        ..EtcdSpec::default()
    };
    let plan = reconcile(&observe(&managed, vec![], Ok(EtcdState::default())));
    assert_eq!(
        plan.create_pods.len(),
        7,
        "the etcd's 3 members and the processes"
    );
    assert!(
        plan.create_pods
            .iter()
            .all(|p| env_from_secret(p).is_none())
    );
    // Once the operator made its token: every process requires it, no etcd member
    // takes it.
    let plan = reconcile(&Observed {
        credentials: JobCredentials::Ready,
        ..observe(&managed, vec![], Ok(EtcdState::default()))
    });
    for p in &plan.create_pods {
        let etcd = p
            .metadata
            .name
            .as_deref()
            .is_some_and(|n| n.contains("-etcd-"));
        let want = if etcd { None } else { Some(None) };
        assert_eq!(
            env_from_secret(p).map(|r| r.optional),
            want,
            "{:?}",
            p.metadata.name
        );
    }
    // Every process speaks to the managed etcd over TLS with the job's certificate.
    let master = plan
        .create_pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("mnist-master-0"))
        .expect("the master's pod");
    let vars =
        serde_json::to_value(master).expect("json")["spec"]["containers"][0]["env"].to_string();
    for want in [
        r#"{"name":"EDL_ETCD_CA","value":"/etc/edl/tls/ca.crt"}"#,
        r#"{"name":"EDL_ETCD_CERT","value":"/etc/edl/tls/tls.crt"}"#,
        r#"{"name":"EDL_ETCD_DOMAIN","value":"mnist.ml.edl.internal"}"#,
    ] {
        assert!(vars.contains(want), "{want} in {vars}");
    }
    let status = plan.status.expect("status");
    assert!(
        condition(&status, "CredentialsReady")
            .message
            .contains("the etcd user and token of Secret mnist-edl-credentials"),
        "{status:?}"
    );
}

#[test]
fn credentials_the_operator_cannot_make_are_a_condition_and_one_event_and_no_process_starts() {
    let mut tj = training_job("");
    let failed = |tj: &TrainingJob| {
        reconcile(&Observed {
            credentials: JobCredentials::Failed("etcd: permission denied".into()),
            ..observe(tj, vec![], Ok(EtcdState::default()))
        })
    };
    let plan = failed(&tj);
    assert!(
        plan.create_pods.is_empty(),
        "{:?}",
        names(&plan.create_pods)
    );
    let status = plan.status.clone().expect("status");
    let c = condition(&status, "CredentialsReady");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "CredentialsFailed")
    );
    assert!(c.message.contains("permission denied"), "{c:?}");
    let running = condition(&status, "Running");
    assert_eq!(running.reason, "CredentialsFailed");
    assert_eq!(status.phase, Phase::Pending);
    let warned = |plan: &Plan| {
        plan.events
            .iter()
            .filter(|e| e.warning && e.reason == "CredentialsFailed")
            .count()
    };
    assert_eq!(warned(&plan), 1, "{:?}", plan.events);
    // The same again: the condition stands, no second event.
    tj.status = Some(status);
    assert_eq!(warned(&failed(&tj)), 0);
}
