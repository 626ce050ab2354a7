//! The replica group's tests: a simulated world (etcd with leases and a watch that
//! lags, ordered connections that break, processes that are killed, stopped and cut
//! off) driving one [`Replica`] per process, scripted scenarios, and the property test
//! of the module's invariants over random interleavings.
//!
//! - this file: the simulated world;
//! - `invariants`: the checks after every step, and healing until the group settles;
//! - `scripted`: one scenario per rule;
//! - `property`: random interleavings of faults, the witness that they reach the states
//!   where the invariants could fail, and the regressions they found.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::*;

mod invariants;
mod property;
mod scripted;

const TTL: Millis = 3_000;
const LOG: usize = 6;

fn cfg(replicas: usize) -> ReplicaConfig {
    ReplicaConfig {
        replicas,
        timeout: 1_000,
        join_timeout: 4_000,
    }
}

/// What travels with a message.
#[derive(Debug, Clone)]
enum Payload {
    None,
    Op(u64),
    Snapshot(Vec<u64>),
}

/// One pserver process: its replica and the shard state it holds (the op ids applied,
/// in order: seq `s` is `data[s - 1]`).
#[derive(Debug)]
struct Node {
    rep: Replica,
    data: Vec<u64>,
    /// The payloads of the last ops applied (the shell's log).
    log: BTreeMap<Seq, u64>,
    stopped: bool,
    etcd_cut: bool,
    /// The next record change its watch delivers.
    watched: usize,
    /// Ops it assigned as primary, not yet answered: seq -> op id.
    pending: BTreeMap<Seq, u64>,
    /// Retries found already applied, answered once acknowledged: (seq, op id).
    retries: Vec<(Seq, u64)>,
    /// The epoch it last acted as primary of.
    primary_of: Option<u64>,
    /// A compare-and-swap whose outcome it did not learn (etcd unreachable): sent again.
    unsent: Option<Effect>,
    /// Its next compare-and-swap is carried out but its answer is lost.
    answer_lost: bool,
}

#[derive(Debug)]
struct World {
    now: Millis,
    cfg: ReplicaConfig,
    nodes: BTreeMap<MemberId, Node>,
    /// Every change of the group record (index = change - 1).
    history: Vec<GroupRecord>,
    /// Member keys and when etcd expires them.
    members: BTreeMap<MemberId, Millis>,
    /// Ordered connections: (from, to) -> messages in flight.
    net: BTreeMap<(MemberId, MemberId), VecDeque<(Msg, Payload)>>,
    /// Cut pairs (both directions).
    cut: BTreeSet<(MemberId, MemberId)>,
    /// Acknowledged op ids, per incarnation.
    acked: BTreeMap<u64, BTreeSet<u64>>,
    /// Op ids answered "not primary" or lost with their primary (clients retry them).
    unanswered: Vec<u64>,
    /// The one member that acted as primary in each epoch.
    acted: BTreeMap<u64, MemberId>,
    next_op: u64,
    next_member: u64,
    /// Counters for the positive witnesses: promotions, restores, snapshots installed,
    /// acks.
    promotions: u64,
    restores: u64,
    installs: u64,
    acks: u64,
}

impl World {
    fn new(cfg: ReplicaConfig) -> World {
        World {
            now: 0,
            cfg,
            nodes: BTreeMap::new(),
            history: Vec::new(),
            members: BTreeMap::new(),
            net: BTreeMap::new(),
            cut: BTreeSet::new(),
            acked: BTreeMap::new(),
            unanswered: Vec::new(),
            acted: BTreeMap::new(),
            next_op: 1,
            next_member: 0,
            promotions: 0,
            restores: 0,
            installs: 0,
            acks: 0,
        }
    }

    fn record(&self) -> Option<&GroupRecord> {
        self.history.last()
    }

    fn live(&self) -> Vec<MemberId> {
        self.members.keys().cloned().collect()
    }

    fn is_live(&self, m: &str) -> bool {
        self.members.contains_key(m)
    }

    /// Starts a process: a new member registered under a fresh lease.
    fn start(&mut self) -> MemberId {
        self.next_member += 1;
        let id = format!("m{:03}", self.next_member);
        let mut rep = Replica::new(id.clone(), self.cfg.clone());
        rep.set_lease(self.now + TTL);
        self.members.insert(id.clone(), self.now + TTL);
        self.nodes.insert(
            id.clone(),
            Node {
                rep,
                data: Vec::new(),
                log: BTreeMap::new(),
                stopped: false,
                etcd_cut: false,
                watched: 0,
                pending: BTreeMap::new(),
                retries: Vec::new(),
                primary_of: None,
                unsent: None,
                answer_lost: false,
            },
        );
        id
    }

    /// SIGKILL: the process is gone; its key stays until its lease ends.
    fn kill(&mut self, id: &str) {
        if let Some(n) = self.nodes.remove(id) {
            self.unanswered.extend(n.pending.values());
            self.unanswered.extend(n.retries.iter().map(|r| r.1));
        }
        self.net.retain(|(f, t), _| f != id && t != id);
    }

    fn cut_pair(&mut self, a: &str, b: &str) {
        let (a, b) = (a.to_string(), b.to_string());
        // A broken connection loses what was in flight.
        self.net.remove(&(a.clone(), b.clone()));
        self.net.remove(&(b.clone(), a.clone()));
        self.cut.insert((a.clone(), b.clone()));
        self.cut.insert((b, a));
    }

    /// Time passes: running processes reach etcd and renew their leases; etcd ends the
    /// leases not renewed; a running process whose lease ended exits; every running
    /// process ticks.
    fn advance(&mut self, ms: Millis) {
        self.now += ms;
        let now = self.now;
        for (id, n) in &mut self.nodes {
            if !n.stopped && !n.etcd_cut && self.members.get(id).is_some_and(|e| *e > now) {
                self.members.insert(id.clone(), now + TTL);
                n.rep.set_lease(now + TTL);
            }
        }
        self.members.retain(|_, e| *e > now);
        let lost: Vec<MemberId> = self
            .nodes
            .iter()
            .filter(|(id, n)| !n.stopped && !self.members.contains_key(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.kill(&id);
        }
        let ids: Vec<MemberId> = self.nodes.keys().cloned().collect();
        for id in ids {
            let Some(n) = self.nodes.get_mut(&id) else {
                continue;
            };
            if n.stopped {
                continue;
            }
            let mut fx: Vec<Effect> = if n.etcd_cut { None } else { n.unsent.take() }
                .into_iter()
                .collect();
            fx.extend(n.rep.tick(now));
            self.run(&id, fx, Payload::None);
        }
    }

    /// The watches (records and members) of `id` catch up by one record, or fully.
    fn watch(&mut self, id: &str, all: bool) {
        let live = self.live();
        let now = self.now;
        let Some(n) = self.nodes.get_mut(id) else {
            return;
        };
        if n.stopped || n.etcd_cut {
            return;
        }
        let mut fx = n.rep.members(now, live);
        while n.watched < self.history.len() {
            let r = self.history[n.watched].clone();
            n.watched += 1;
            fx.extend(n.rep.observe(now, r));
            if !all {
                break;
            }
        }
        self.run(id, fx, Payload::None);
    }

    /// The watch of `id` jumps to the newest record, skipping those between (a watch
    /// that only keeps the newest value).
    fn watch_newest(&mut self, id: &str) {
        let live = self.live();
        let now = self.now;
        let Some(n) = self.nodes.get_mut(id) else {
            return;
        };
        if n.stopped || n.etcd_cut || self.history.is_empty() {
            return;
        }
        let mut fx = n.rep.members(now, live);
        n.watched = self.history.len();
        fx.extend(n.rep.observe(now, self.history.last().unwrap().clone()));
        self.run(id, fx, Payload::None);
    }

    /// Delivers the next message of the connection `from -> to`.
    fn deliver(&mut self, from: &str, to: &str) {
        if self.nodes.get(to).is_none_or(|n| n.stopped) {
            return;
        }
        let key = (from.to_string(), to.to_string());
        let Some((msg, payload)) = self.net.get_mut(&key).and_then(VecDeque::pop_front) else {
            return;
        };
        let now = self.now;
        let fx = self
            .nodes
            .get_mut(to)
            .unwrap()
            .rep
            .on_message(now, from, msg);
        self.run(to, fx, payload);
    }

    /// A client's push at whoever `id` is.
    fn submit(&mut self, id: &str) {
        let now = self.now;
        let Some(n) = self.nodes.get_mut(id) else {
            return;
        };
        if n.stopped {
            return;
        }
        let op = self.next_op;
        self.next_op += 1;
        match n.rep.submit(now) {
            Ok((seq, fx)) => {
                n.pending.insert(seq, op);
                self.apply_local(id, seq, op);
                self.run(id, fx, Payload::None);
                let fx = self.nodes.get_mut(id).unwrap().rep.local_applied(now, seq);
                self.run(id, fx, Payload::None);
            }
            Err(_) => self.unanswered.push(op),
        }
    }

    /// A client retries an unanswered op at the primary `id`: answered once
    /// acknowledged if the state holds it, else submitted again.
    fn retry(&mut self, id: &str, k: usize) {
        if self.unanswered.is_empty() {
            return;
        }
        let Some(n) = self.nodes.get_mut(id) else {
            return;
        };
        if n.stopped || n.rep.primary_epoch().is_none() || self.now >= n.rep.lease_deadline {
            return;
        }
        let op = self.unanswered.swap_remove(k % self.unanswered.len());
        if let Some(pos) = n.data.iter().position(|o| *o == op) {
            let seq = pos as Seq + 1;
            if n.rep.acked().is_some_and(|a| a >= seq) {
                let inc = n.rep.record().unwrap().incarnation;
                self.acked.entry(inc).or_default().insert(op);
            } else {
                n.retries.push((seq, op));
            }
            return;
        }
        let now = self.now;
        match n.rep.submit(now) {
            Ok((seq, fx)) => {
                n.pending.insert(seq, op);
                self.apply_local(id, seq, op);
                self.run(id, fx, Payload::None);
                let fx = self.nodes.get_mut(id).unwrap().rep.local_applied(now, seq);
                self.run(id, fx, Payload::None);
            }
            Err(_) => self.unanswered.push(op),
        }
    }

    fn apply_local(&mut self, id: &str, seq: Seq, op: u64) {
        let n = self.nodes.get_mut(id).unwrap();
        assert_eq!(
            n.data.len() as Seq + 1,
            seq,
            "{id} applies op {seq} out of order"
        );
        n.data.push(op);
        n.log.insert(seq, op);
        // As the shell does: at most LOG ops, and none every peer confirmed.
        let needed = n.rep.log_needed_from().min(seq);
        while n.log.len() > LOG || n.log.first_key_value().is_some_and(|(&s, _)| s < needed) {
            n.log.pop_first();
        }
        let first = *n.log.keys().next().unwrap();
        n.rep.trimmed(first);
    }

    /// A process that is not in the group restores the shard (a checkpoint: nothing of
    /// the old incarnation is guaranteed).
    fn restore(&mut self, id: &str) {
        let now = self.now;
        let Some(n) = self.nodes.get_mut(id) else {
            return;
        };
        if n.stopped || n.etcd_cut || n.rep.role() != Role::Outside {
            return;
        }
        // The claim revision of the restorer: higher than any before.
        let incarnation = self.record().map_or(1, |r| r.incarnation + 1);
        let n = self.nodes.get_mut(id).unwrap();
        let fx = n.rep.restore(now, incarnation);
        if !fx.is_empty() {
            n.data.clear();
            n.log.clear();
        }
        self.run(id, fx, Payload::None);
    }

    /// Carries out `id`'s effects, in order, then checks the invariants.
    fn run(&mut self, id: &str, fx: Vec<Effect>, payload: Payload) {
        let mut queue: VecDeque<Effect> = fx.into();
        while let Some(e) = queue.pop_front() {
            if !self.nodes.contains_key(id) {
                return;
            }
            let now = self.now;
            match e {
                Effect::Send { to, msg } => {
                    let body = match &msg {
                        Msg::Op { seq, .. } => {
                            let n = &self.nodes[id];
                            let op = n.log.get(seq).copied().unwrap_or_else(|| {
                                panic!(
                                    "{id} sends op {seq} it does not have (log {:?})",
                                    n.log.keys()
                                )
                            });
                            Payload::Op(op)
                        }
                        _ => Payload::None,
                    };
                    let key = (id.to_string(), to);
                    if !self.cut.contains(&key) {
                        self.net.entry(key).or_default().push_back((msg, body));
                    }
                }
                Effect::SendSnapshot { to, epoch } => {
                    let n = self.nodes.get_mut(id).unwrap();
                    let data = n.data.clone();
                    let seq = data.len() as Seq;
                    let key = (id.to_string(), to.clone());
                    if !self.cut.contains(&key) {
                        self.net
                            .entry(key)
                            .or_default()
                            .push_back((Msg::Snapshot { epoch, seq }, Payload::Snapshot(data)));
                    }
                    queue.extend(n.rep.snapshot_sent(now, &to, seq));
                }
                Effect::Apply { seq } => {
                    let Payload::Op(op) = payload else {
                        panic!("apply without an op");
                    };
                    self.apply_local(id, seq, op);
                }
                Effect::Install { seq } => {
                    let Payload::Snapshot(data) = &payload else {
                        panic!("install without a snapshot");
                    };
                    assert_eq!(data.len() as Seq, seq);
                    let n = self.nodes.get_mut(id).unwrap();
                    n.data = data.clone();
                    n.log.clear();
                    n.rep.trimmed(seq + 1);
                    self.installs += 1;
                }
                Effect::Propose {
                    expect_change,
                    record,
                    guard,
                } => {
                    if self.nodes[id].etcd_cut {
                        // The outcome is not known: the shell sends it again later.
                        self.nodes.get_mut(id).unwrap().unsent = Some(Effect::Propose {
                            expect_change,
                            record,
                            guard,
                        });
                        continue;
                    }
                    let current = self.record().map_or(0, |r| r.change);
                    let holds =
                        self.is_live(&guard.alive) && guard.absent.iter().all(|m| !self.is_live(m));
                    let silent = std::mem::take(&mut self.nodes.get_mut(id).unwrap().answer_lost);
                    if silent {
                        // Written (or not) in etcd, but the answer is lost: the shell
                        // sends the same compare-and-swap again later.
                        self.nodes.get_mut(id).unwrap().unsent = Some(Effect::Propose {
                            expect_change,
                            record: record.clone(),
                            guard: guard.clone(),
                        });
                    }
                    if current == expect_change && holds {
                        let prev = self.record().cloned();
                        if let Some(p) = &prev {
                            assert!(record.epoch >= p.epoch, "the epoch went back");
                            if record.incarnation != p.incarnation {
                                self.restores += 1;
                            } else if record.epoch != p.epoch {
                                self.promotions += 1;
                                assert!(
                                    p.backups.contains(&record.primary),
                                    "{} promoted without being in sync",
                                    record.primary
                                );
                            }
                        }
                        self.history.push(record);
                        if silent {
                            continue;
                        }
                    } else if silent {
                        continue;
                    } else if current == expect_change {
                        // Refused by the guard: it did not land. (A record that moved on
                        // may be this very proposal, landed by an earlier attempt whose
                        // answer was lost: the read below settles it.)
                        queue.extend(self.nodes.get_mut(id).unwrap().rep.refused(now, &record));
                    }
                    // The shell reads the record back, whatever the outcome.
                    let live = self.live();
                    let n = self.nodes.get_mut(id).unwrap();
                    let mut more = n.rep.members(now, live);
                    while n.watched < self.history.len() {
                        let r = self.history[n.watched].clone();
                        n.watched += 1;
                        more.extend(n.rep.observe(now, r));
                    }
                    queue.extend(more);
                }
                Effect::Ack { upto } => {
                    let n = self.nodes.get_mut(id).unwrap();
                    let epoch = n.rep.primary_epoch().expect("only a primary acknowledges");
                    let record = self.history.last().unwrap();
                    assert_eq!(
                        record.epoch, epoch,
                        "{id} acknowledged in epoch {epoch} after epoch {} took over",
                        record.epoch
                    );
                    assert!(
                        now < self.members.get(id).copied().unwrap_or(0)
                            || now < n.rep.lease_deadline
                    );
                    let inc = record.incarnation;
                    let done: Vec<Seq> = n.pending.range(..=upto).map(|(s, _)| *s).collect();
                    for s in done {
                        let op = n.pending.remove(&s).unwrap();
                        assert_eq!(n.data[s as usize - 1], op);
                        self.acked.entry(inc).or_default().insert(op);
                        self.acks += 1;
                    }
                    let (now_done, later): (Vec<_>, Vec<_>) =
                        n.retries.drain(..).partition(|(s, _)| *s <= upto);
                    n.retries = later;
                    for (_, op) in now_done {
                        self.acked.entry(inc).or_default().insert(op);
                    }
                }
                Effect::Fail { from } => {
                    let n = self.nodes.get_mut(id).unwrap();
                    let failed = n.pending.split_off(&from);
                    self.unanswered.extend(failed.values());
                    let (fail, keep): (Vec<_>, Vec<_>) =
                        n.retries.drain(..).partition(|(s, _)| *s >= from);
                    n.retries = keep;
                    self.unanswered.extend(fail.iter().map(|r| r.1));
                }
                Effect::Discard => {
                    let n = self.nodes.get_mut(id).unwrap();
                    n.data.clear();
                    n.log.clear();
                    self.unanswered
                        .extend(std::mem::take(&mut n.pending).values());
                    self.unanswered.extend(n.retries.drain(..).map(|r| r.1));
                }
            }
        }
        self.check();
    }

    /// A group of `n` processes, the first one primary (a fresh job), settled.
    fn group(cfg: ReplicaConfig, n: usize) -> World {
        let mut w = World::new(cfg);
        let first = w.start();
        for _ in 1..n {
            w.start();
        }
        w.watch(&first, true);
        w.restore(&first);
        w.settle();
        w
    }

    fn primary(&self) -> MemberId {
        self.record().unwrap().primary.clone()
    }

    fn backup(&self) -> MemberId {
        self.record().unwrap().backups.first().unwrap().clone()
    }
}

/// Delivers every message queued from `from` to `to`.
fn drain(w: &mut World, from: &str, to: &str) {
    while w.nodes.get(to).is_some_and(|n| !n.stopped)
        && w.net
            .get(&(from.to_string(), to.to_string()))
            .is_some_and(|q| !q.is_empty())
    {
        w.deliver(from, to);
    }
}
