use std::path::PathBuf;

use super::*;

fn write(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("job.toml");
    std::fs::write(&p, text).expect("write");
    p
}

const WINE: &str = r#"
name = "wine"
[data]
train = "data/wine-*.recordio"
test = "data/wine-test-*.recordio"
[model]
kind = "mlp"
inputs = 13
hidden = [32]
classes = 3
standardize = true
[train]
mode = "sync"
passes = 20
batch_size = 32
optimizer = "adam"
learning_rate = 0.01
[cluster]
masters = 1
pservers = 1
trainers = 2
min_trainers = 1
max_trainers = 4
lease_ttl = "3s"
checkpoint_every = "10s"
"#;

#[test]
fn the_issue_example_parses_and_resolves_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = JobSpec::load(&write(dir.path(), WINE)).expect("valid");
    assert_eq!(spec.name, "wine");
    assert_eq!(spec.train.passes, 20);
    assert_eq!(spec.train.mode, ModeName::Sync);
    assert_eq!(spec.cluster.max_trainers(), 4);
    assert_eq!(spec.cluster.lease_ttl, Duration::from_secs(3));
    let train = spec.data.train.patterns();
    assert!(
        Path::new(&train[0]).is_absolute() && train[0].ends_with("data/wine-*.recordio"),
        "{train:?}"
    );
    assert_eq!(spec.train.optimizer, OptimizerName::Adam);
    // The JSON stored in etcd round-trips, with its version.
    let stored = spec.to_stored();
    assert!(stored.starts_with(br#"{"version":2,"spec":"#));
    assert_eq!(JobSpec::from_stored(&stored).expect("parse"), spec);
}

#[test]
fn unknown_and_missing_keys_name_the_key_and_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = WINE.replace("batch_size = 32", "batch_size = 32\nbatch_sise = 3");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("unknown key");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("batch_sise") && msg.contains("job.toml"),
        "{msg}"
    );

    let bad = WINE.replace("classes = 3\n", "");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("missing key");
    let msg = format!("{e:#}");
    assert!(msg.contains("classes") && msg.contains("job.toml"), "{msg}");

    let bad = WINE.replace("kind = \"mlp\"", "kind = \"resnet\"");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("unknown model");
    assert!(format!("{e:#}").contains("resnet"), "{e:#}");

    let bad = WINE.replace("min_trainers = 1", "min_trainers = 3");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("bad bounds");
    assert!(format!("{e:#}").contains("min_trainers"), "{e:#}");

    let bad = WINE.replace("lease_ttl = \"3s\"", "lease_ttl = \"soon\"");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("bad duration");
    assert!(format!("{e:#}").contains("soon"), "{e:#}");

    let bad = WINE.replace("lease_ttl = \"3s\"", "healthy_after = \"500ms\"");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("too short");
    assert!(
        format!("{e:#}").contains("cluster.healthy_after: must be at least 1s"),
        "{e:#}"
    );

    let bad = WINE.replace("lease_ttl = \"3s\"", "min_task_timeout = \"500ms\"");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("too short");
    assert!(
        format!("{e:#}").contains("cluster.min_task_timeout: must be at least 1s"),
        "{e:#}"
    );
    // Stored only when set: a spec on the default stays readable by older processes.
    let set = WINE.replace("lease_ttl = \"3s\"", "min_task_timeout = \"2s\"");
    let set = JobSpec::load(&write(dir.path(), &set)).expect("a valid spec");
    assert_eq!(
        set.cluster.min_task_timeout,
        std::time::Duration::from_secs(2)
    );
    assert!(
        serde_json::to_string(&set)
            .unwrap()
            .contains("min_task_timeout")
    );
    let default = JobSpec::load(&write(dir.path(), WINE)).expect("a valid spec");
    assert_eq!(
        default.cluster.min_task_timeout,
        std::time::Duration::from_secs(10)
    );
    assert!(
        !serde_json::to_string(&default)
            .unwrap()
            .contains("min_task_timeout")
    );

    // Groups of batches per push: async only, 1..=1024; a spec without it stores
    // none (specs stored by an older edl read the same).
    let bad = WINE.replace("batch_size = 32", "batch_size = 32\nbatches_per_push = 4");
    let e = JobSpec::load(&write(dir.path(), &bad)).expect_err("sync with groups");
    assert!(
        format!("{e:#}").contains("train.batches_per_push: merges asynchronous pushes"),
        "{e:#}"
    );
    let bad = bad.replace("mode = \"sync\"", "mode = \"async\"");
    let ok = JobSpec::load(&write(dir.path(), &bad)).expect("async with groups");
    assert_eq!(ok.train.batches_per_push, PerPush::Fixed(4));
    let json = serde_json::to_string(&ok.train).expect("json");
    assert!(json.contains("\"batches_per_push\":4"), "{json}");
    let zero = bad.replace("batches_per_push = 4", "batches_per_push = 0");
    let e = JobSpec::load(&write(dir.path(), &zero)).expect_err("zero");
    assert!(format!("{e:#}").contains("must be 1..=1024"), "{e:#}");
    let word = bad.replace("batches_per_push = 4", "batches_per_push = \"lots\"");
    let e = JobSpec::load(&write(dir.path(), &word)).expect_err("a word");
    assert!(
        format!("{e:#}").contains("a number of batches or \"adaptive\", not \"lots\""),
        "{e:#}"
    );
    let adaptive = bad.replace("batches_per_push = 4", "batches_per_push = \"adaptive\"");
    let ok = JobSpec::load(&write(dir.path(), &adaptive)).expect("adaptive");
    assert_eq!(ok.train.batches_per_push, PerPush::Adaptive);
    let plain = JobSpec::load(&write(dir.path(), WINE)).expect("wine");
    assert_eq!(
        plain.train.batches_per_push,
        PerPush::Adaptive,
        "the default"
    );
    let json = serde_json::to_string(&plain.train).expect("json");
    assert!(!json.contains("batches_per_push"), "{json}");

    let e = JobSpec::load(&dir.path().join("missing.toml")).expect_err("no file");
    assert!(format!("{e:#}").contains("missing.toml"), "{e:#}");
}

#[test]
fn defaults_fill_a_minimal_spec() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = JobSpec::load(&write(
        dir.path(),
        "name = \"h\"\n[data]\ntrain = [\"/x/a.recordio\"]\n[model]\nkind = \"fit_a_line\"\n",
    ))
    .expect("valid");
    assert_eq!(spec.train.passes, 1);
    assert_eq!(spec.train.batch_size, 32);
    assert_eq!(spec.train.mode, ModeName::Async);
    assert_eq!(spec.cluster.trainers, 2);
    assert_eq!(spec.cluster.max_restarts, 10);
    assert_eq!(spec.cluster.healthy_after, Duration::from_secs(30));
    assert_eq!(
        spec.data.train.patterns(),
        vec!["/x/a.recordio".to_string()]
    );
}

#[test]
fn a_trainer_entry_makes_the_model_optional_and_is_resolved_against_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = "name = \"own\"\n[data]\ntrain = [\"/x/a.recordio\"]\n";
    let e = JobSpec::load(&write(dir.path(), base)).expect_err("no model, no entry");
    assert!(format!("{e:#}").contains("[trainer] entry"), "{e:#}");
    let spec = JobSpec::load(&write(
        dir.path(),
        &format!(
            "{base}[trainer]\nentry = [\"./bin/net\", \"--width\", \"8\"]\n\
             env = {{ A = \"1\" }}\nregister_within = \"5s\"\n"
        ),
    ))
    .expect("valid");
    assert!(spec.model.is_none());
    let dir_abs = std::path::absolute(dir.path()).expect("absolute");
    assert_eq!(
        spec.trainer.entry,
        vec![
            dir_abs.join("./bin/net").display().to_string(),
            "--width".into(),
            "8".into()
        ]
    );
    assert_eq!(spec.trainer.register_within(), Duration::from_secs(5));
    // Stored and read back whole; a program on PATH stays a bare name.
    assert_eq!(
        JobSpec::from_stored(&spec.to_stored()).expect("stored"),
        spec
    );
    let spec = JobSpec::load(&write(
        dir.path(),
        &format!("{base}[trainer]\nentry = [\"python3\", \"train.py\"]\n"),
    ))
    .expect("valid");
    assert_eq!(
        spec.trainer.entry,
        vec!["python3".to_owned(), "train.py".into()]
    );
    let e = JobSpec::load(&write(
        dir.path(),
        &format!("{base}[trainer]\nentry = [\"\"]\n"),
    ))
    .expect_err("empty program");
    assert!(format!("{e:#}").contains("trainer.entry"), "{e:#}");
}

#[test]
fn stored_specs_of_a_newer_version_or_a_bad_name_are_refused() {
    let spec = JobSpec::parse_toml(
        "name = \"h\"\n[data]\ntrain = [\"/x/a.recordio\"]\n[model]\nkind = \"fit_a_line\"\n",
    )
    .expect("valid");
    let newer = String::from_utf8(spec.to_stored())
        .expect("utf-8")
        .replace(r#""version":2"#, r#""version":3"#);
    let e = JobSpec::from_stored(newer.as_bytes()).expect_err("newer");
    assert!(e.to_string().contains("upgrade edl"), "{e}");
    let bad = String::from_utf8(spec.to_stored())
        .expect("utf-8")
        .replace(r#""name":"h""#, r#""name":"../h""#);
    let e = JobSpec::from_stored(bad.as_bytes()).expect_err("bad name");
    assert!(e.to_string().contains("invalid job name"), "{e}");
}

#[test]
fn an_invalid_name_in_a_file_is_an_error_at_its_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = JobSpec::load(&write(dir.path(), &WINE.replace("\"wine\"", "\"a/b\"")))
        .expect_err("bad name");
    let msg = e.to_string();
    assert!(
        msg.contains("job.toml") && msg.contains("line 2") && msg.contains("invalid job name"),
        "{msg}"
    );
}
