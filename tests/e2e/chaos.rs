//! `edl run --chaos`: the example under kills of every role and a stopped trainer.

use std::time::Duration;

use crate::run::{HOUSING_COST_BOUND, edl_run, example, metric};

/// The example in async mode with gradients pushed in groups of 3 batches
/// (`batches_per_push`) under kills of every role and a stopped trainer: nothing lost,
/// and a task trained again after a fault pushes the same groups, so each counts once
/// (the sync mode under the same faults: the soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_with_trainer_pserver_and_master_kills_loses_no_records() {
    const PASSES: u64 = 300;
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = example(dir.path(), "fit_a_line", "job.toml", |s| {
        // Fast failure detection for the chaos: a 2 s lease, set explicitly.
        assert!(
            s.contains("lease_ttl = \"10s\"") && s.contains("mode = \"sync\""),
            "the example's lease TTL or mode moved"
        );
        s.replace("mode = \"sync\"", "mode = \"async\"\nbatches_per_push = 3")
            // Long enough for every fault to land (async groups train fast).
            .replace("passes = 30", &format!("passes = {PASSES}"))
            .replace("masters = 1", "masters = 2")
            .replace("lease_ttl = \"10s\"", "lease_ttl = \"2s\"")
            .replace("checkpoint_every = \"10s\"", "checkpoint_every = \"2s\"")
    });
    let (ok, r, log) = edl_run(
        dir.path(),
        "chaos",
        &[
            &spec.display().to_string(),
            "--chaos",
            "kill-trainer=4s,kill-pserver=6s,kill-master=8s,stop-trainer=10s,seed=3",
        ],
        Duration::from_secs(600),
    )
    .await;
    assert!(ok, "edl run --chaos failed: {r}\n{log}");
    assert_eq!(r["lost_records"], 0, "{r}");
    assert_eq!(r["passes"], PASSES);
    // A killed pserver's restored shard lacks some acknowledged training: trained
    // again, counted apart, never lost.
    let again = r["recomputed_records"]
        .as_u64()
        .expect("recomputed_records");
    assert_eq!(r["records_trained"], PASSES * 405 + again, "{r}");
    let recoveries = r["recoveries"].as_array().expect("recoveries");
    for role in ["trainer", "pserver", "master"] {
        assert!(
            recoveries
                .iter()
                .any(|x| x["role"] == role && x["fault"] == "sigkill"),
            "no recovery of a killed {role}: {r}"
        );
    }
    assert!(
        recoveries.iter().any(|x| x["fault"] == "sigstop"),
        "no recovery of a stopped trainer: {r}"
    );
    assert!(
        recoveries
            .iter()
            .all(|x| x["seconds"].as_f64().is_some_and(|s| s < 30.0)),
        "{r}"
    );
    let (_, cost) = metric(&r);
    assert!(
        cost < HOUSING_COST_BOUND,
        "held-out cost after chaos {cost}"
    );
    eprintln!(
        "chaos: {} faults recovered; cost {cost:.3}; {}",
        recoveries.len(),
        r["wall_s"]
    );
}
