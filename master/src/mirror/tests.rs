//! The mirror against the history it follows: the property that seeding reads at any
//! revisions plus the changes from the oldest on give exactly the final records, and a
//! mirror following a real queue (the actor on the in-memory backend, then its watch)
//! yields what [`Store::load`] reads.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use edl_coord::{Backend, Fence, MemBackend};
use edl_job::JobName;
use edl_master_client::Answer;
use futures::StreamExt;
use proptest::prelude::*;

use super::*;
use crate::core::tests::{define, started};
use crate::queue::tests::{cfg, specs};
use crate::queue::{Queue, QueueConfig};
use crate::store::{Store, assemble};
use crate::testing::dataset;

fn keys() -> JobKeys {
    JobKeys::new(&JobName::new("mirror").unwrap())
}

/// A task record that differs by `version`.
fn task_value(n: u32, version: u64) -> Vec<u8> {
    let q = Queue::new(cfg(1, 3), specs(n + 1));
    let mut t = q.tasks()[n as usize].clone();
    t.generation = version;
    serde_json::to_vec(&t).unwrap()
}

/// The keys the histories write: tasks, kept records, and keys the mirror ignores.
fn key_of(keys: &JobKeys, i: usize) -> (String, Option<u32>) {
    match i {
        0..=3 => (keys.task(&format!("t{i}")), Some(i as u32)),
        4 => (keys.queue(), None),
        5 => (keys.failed_in(1), None),
        6 => (keys.dataset_files_part(0), None),
        7 => (keys.journal(), None),
        _ => (format!("{}trainers/x{i}", keys.root()), None),
    }
}

/// The state after each revision of `ops` (revision `r` is `ops[r - 1]`).
type State = BTreeMap<String, KeyValue>;

fn states(keys: &JobKeys, ops: &[(usize, Option<u64>)]) -> (Vec<State>, Vec<WatchEvent>) {
    let mut state = State::new();
    let mut states = vec![state.clone()];
    let mut events = Vec::new();
    for (r, &(i, put)) in ops.iter().enumerate() {
        let revision = r as Revision + 1;
        let (key, task) = key_of(keys, i);
        let ev = match put {
            Some(v) => {
                let value = match task {
                    Some(n) => task_value(n, v),
                    None => format!("v{v}").into_bytes(),
                };
                let kv = KeyValue {
                    key: key.clone(),
                    value,
                    create_revision: state.get(&key).map_or(revision, |kv| kv.create_revision),
                    mod_revision: revision,
                    version: 1,
                    lease: None,
                };
                state.insert(key, kv.clone());
                WatchEvent {
                    kind: EventKind::Put,
                    kv,
                }
            }
            None => {
                state.remove(&key);
                WatchEvent {
                    kind: EventKind::Delete,
                    kv: KeyValue {
                        key,
                        value: Vec::new(),
                        create_revision: 0,
                        mod_revision: revision,
                        version: 0,
                        lease: None,
                    },
                }
            }
        };
        states.push(state.clone());
        events.push(ev);
    }
    (states, events)
}

fn under(state: &State, prefix: &str) -> Vec<KeyValue> {
    state
        .values()
        .filter(|kv| kv.key.starts_with(prefix))
        .cloned()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Two seeding reads (the tasks, the queue's records) at any revisions, then every
    /// change from the older read's next revision on: the mirror holds exactly the final
    /// records, and its revision is the last change's.
    #[test]
    fn reads_at_any_revisions_and_the_changes_since_give_the_final_records(
        ops in prop::collection::vec((0usize..10, prop::option::weighted(0.7, 0u64..5)), 1..40),
        a in 0usize..40,
        b in 0usize..40,
    ) {
        let keys = keys();
        let (states, events) = states(&keys, &ops);
        let (ra, rb) = (a.min(ops.len()), b.min(ops.len()));
        let mut m = Mirror::new(keys.clone());
        m.seed(&under(&states[ra], &keys.tasks()), ra as Revision).unwrap();
        let job = keys.job_records();
        m.seed(&under(&states[rb], &job), rb as Revision).unwrap();
        let from = ra.min(rb) + 1;
        for ev in &events[from - 1..] {
            m.apply(ev).unwrap();
        }
        let last = states.last().unwrap();
        let want_tasks: BTreeMap<String, Task> = under(last, &keys.tasks())
            .into_iter()
            .map(|kv| (kv.key.clone(), decode_task(&kv.key, &kv.value).unwrap()))
            .collect();
        let got_tasks: BTreeMap<String, Task> =
            m.tasks.iter().map(|(k, s)| (k.clone(), s.value.clone())).collect();
        prop_assert_eq!(got_tasks, want_tasks);
        let want: BTreeMap<String, Vec<u8>> = under(last, &job)
            .into_iter()
            .map(|kv| (kv.key, kv.value))
            .collect();
        let got: BTreeMap<String, Vec<u8>> =
            m.records.iter().map(|(k, s)| (k.clone(), s.value.clone())).collect();
        prop_assert_eq!(got, want);
        prop_assert_eq!(m.revision(), ops.len() as Revision);
    }
}

#[test]
fn a_journal_hands_the_load_to_the_store_and_no_dataset_is_said() {
    let keys = keys();
    let put = |key: String, r: Revision| KeyValue {
        key,
        value: b"{}".to_vec(),
        create_revision: r,
        mod_revision: r,
        version: 1,
        lease: None,
    };
    let m = Mirror::new(keys.clone());
    assert!(matches!(m.records(), Mirrored::NoDataset));
    let mut m = Mirror::new(keys.clone());
    m.seed(&[put(keys.dataset(), 1), put(keys.journal(), 2)], 2)
        .unwrap();
    assert!(matches!(m.records(), Mirrored::Journal));
    let mut m = Mirror::new(keys.clone());
    let entry = format!("{}x/000000", keys.journal_entries());
    m.seed(&[put(keys.dataset(), 1), put(entry, 2)], 2).unwrap();
    assert!(matches!(m.records(), Mirrored::Journal));
}

#[test]
fn a_corrupt_task_record_is_an_error_naming_its_key() {
    let keys = keys();
    let mut m = Mirror::new(keys.clone());
    let kv = KeyValue {
        key: keys.task("t0"),
        value: b"{not json".to_vec(),
        create_revision: 1,
        mod_revision: 1,
        version: 1,
        lease: None,
    };
    let e = m.seed(&[kv], 1).unwrap_err().to_string();
    assert!(e.contains(&keys.task("t0")), "{e}");
}

/// A queue trained part-way by the actor: a mirror seeded mid-way and fed the watch's
/// changes since yields, through [`assemble`], exactly what [`Store::load`] reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_following_a_queue_yields_what_the_store_loads() {
    let backend: Arc<dyn Backend> = Arc::new(MemBackend::new());
    let keys = keys();
    let (handle, _stop) = started(&backend, "mirror", QueueConfig::default()).await;
    // Reads only: its fence is never checked.
    let fence = Fence {
        key: String::new(),
        revision: 0,
    };
    let store = Store::new(backend.clone(), keys.clone(), fence);
    let dir = tempfile::tempdir().unwrap();
    let glob = dataset(dir.path(), 3, 20);
    define(&handle, glob, 4).await;
    let train = |n: usize| {
        let handle = handle.clone();
        async move {
            let mut request = 1000 * n as u64;
            for _ in 0..n {
                let pass = handle.status().await.unwrap().pass;
                request += 1;
                match handle
                    .get_task("t".into(), pass, request, Duration::ZERO)
                    .await
                    .unwrap()
                {
                    Answer::Task(t) => {
                        handle
                            .finished(t.id, t.generation, t.records, vec![1])
                            .await
                            .unwrap();
                    }
                    Answer::PassFinished(_) => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
    };
    train(7).await;
    // Seed: the tasks, then (after more transitions) the queue's records.
    let mut m = Mirror::new(keys.clone());
    let (tasks, ra) = backend.range(&keys.tasks()).await.unwrap();
    m.seed(&tasks, ra).unwrap();
    train(5).await;
    let (records, rb) = backend.range(&keys.job_records()).await.unwrap();
    m.seed(&records, rb).unwrap();
    assert!(rb > ra, "no transition between the seeding reads");
    // Leased, not finished: a task the load must see as held.
    let pass = handle.status().await.unwrap().pass;
    let Answer::Task(held) = handle
        .get_task("u".into(), pass, 1, Duration::ZERO)
        .await
        .unwrap()
    else {
        panic!("no task to hold");
    };
    train(9).await;
    // The takeover's marker: its change comes after every change before it (a
    // transaction's changes share a revision, so a revision seen is not yet a
    // transaction applied whole).
    let now = backend
        .put(&keys.master_takeover(), b"x".to_vec(), None)
        .await
        .unwrap();
    let mut watch = backend
        .watch_prefix(keys.root(), Some(ra.min(rb) + 1))
        .await
        .unwrap();
    while m.revision() < now {
        let ev = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("the watch delivers every change")
            .expect("the watch goes on")
            .unwrap();
        m.apply(&ev).unwrap();
    }
    let want = store.load().await.unwrap().expect("a dataset");
    let Mirrored::Records(records) = m.records() else {
        panic!("the mirror has no records");
    };
    let got = assemble(&keys, *records).unwrap();
    assert_eq!(got.dataset, want.dataset);
    assert_eq!(got.meta, want.meta);
    assert_eq!(got.tasks, want.tasks);
    assert_eq!(got.failed.len(), want.failed.len());
    assert!(
        got.tasks
            .iter()
            .any(|t| t.spec.id == held.id
                && matches!(t.state, crate::queue::TaskState::Pending { .. })),
        "the held task is leased in the mirror's records"
    );
    assert!(want.meta.pass >= 1, "the queue moved past its first pass");
}
