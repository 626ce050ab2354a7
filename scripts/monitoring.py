#!/usr/bin/env python3
"""Writes deploy/monitoring.yaml (or the file given): edl's Grafana dashboard and its
Prometheus alert rules, each in a ConfigMap. The repository keeps the output; run this
after an edit (`target/pyvenv/bin/python scripts/monitoring.py`, PyYAML needed).
deploy/tests checks the two agree and that every expression parses; the e2e test
monitoring::every_metric_the_dashboard_and_the_alerts_name_is_served checks that every
metric named is served."""
import json
import pathlib
import sys

import yaml

def panel(i, title, exprs, unit="short", kind="timeseries", w=12):
    return {
        "id": i, "type": kind, "title": title,
        "gridPos": {"h": 8, "w": w, "x": (0 if i % 2 else 12) if w == 12 else 0, "y": 8 * ((i - 1) // 2)},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(65 + k), "expr": e, "legendFormat": l} for k, (e, l) in enumerate(exprs)],
    }

J = 'job=~"$job"'
panels = [
    panel(1, "Queue depth (tasks of the current pass)", [(f'sum by (job, state) (edl_master_tasks{{{J}}})', "{{job}} {{state}}")]),
    panel(2, "Pass", [(f'max by (job) (edl_master_pass{{{J}}})', "{{job}} pass"), (f'max by (job) (edl_master_passes{{{J}}})', "{{job}} passes")]),
    panel(3, "Samples per second", [(f'sum by (job) (edl_trainer_samples_per_second{{{J}}})', "{{job}}")], unit="ops"),
    panel(4, "Records trained per second", [(f'sum by (job) (rate(edl_master_records_trained_total{{{J}}}[5m]))', "{{job}}")], unit="ops"),
    panel(5, "Lease expiries (task timeouts, trainers lost)", [
        (f'sum by (job) (increase(edl_master_task_timeouts_total{{{J}}}[15m]))', "{{job}} timeouts"),
        (f'sum by (job) (increase(edl_master_trainer_lost_total{{{J}}}[15m]))', "{{job}} trainers lost")]),
    panel(6, "Recoveries", [
        (f'sum by (job) (changes(edl_pserver_incarnation{{{J}}}[15m]))', "{{job}} pserver restores"),
        (f'sum by (job) (increase(edl_master_failovers_total{{{J}}}[15m]))', "{{job}} master failovers"),
        ('sum(increase(edl_operator_recoveries_total[15m]))', "pods replaced by the operator")]),
    panel(7, "Pserver push latency (p50, p99)", [
        (f'histogram_quantile(0.5, sum by (job, shard, le) (rate(edl_pserver_push_seconds_bucket{{{J}}}[5m])))', "{{job}} shard {{shard}} p50"),
        (f'histogram_quantile(0.99, sum by (job, shard, le) (rate(edl_pserver_push_seconds_bucket{{{J}}}[5m])))', "{{job}} shard {{shard}} p99")], unit="s"),
    panel(8, "Pushes applied per second", [(f'sum by (job, shard) (rate(edl_pserver_pushes_applied_total{{{J}}}[5m]))', "{{job}} shard {{shard}}")], unit="ops"),
    panel(9, "Trainers and loss", [
        (f'count by (job) (edl_trainer_pass{{{J}}})', "{{job}} trainers"),
        (f'avg by (job) (edl_trainer_loss{{{J}}})', "{{job}} loss")]),
    panel(10, "Lost and duplicate records", [
        (f'sum by (job) (edl_master_lost_records_total{{{J}}})', "{{job}} lost"),
        (f'sum by (job) (edl_master_duplicate_records_total{{{J}}})', "{{job}} trained twice")]),
    panel(11, "Checkpoints", [
        (f'sum by (job) (increase(edl_pserver_checkpoints_written_total{{{J}}}[15m]))', "{{job}} written"),
        (f'sum by (job) (increase(edl_pserver_checkpoints_failed_total{{{J}}}[15m]))', "{{job}} failed")]),
    panel(12, "Operator", [
        ('sum(rate(edl_operator_reconciles_total[5m]))', "reconciles/s"),
        ('sum(rate(edl_operator_reconcile_errors_total[5m]))', "errors/s"),
        ('sum(increase(edl_operator_scale_events_total[15m]))', "scale events")]),
    # Seconds per second per bucket: how many trainers' time goes to each (docs/design.md,
    # "Goodput"); the buckets of a job sum to its trainer count.
    panel(13, "Goodput: where the trainers' time goes", [
        (f'sum by (job, bucket) (rate(edl_trainer_goodput_seconds_total{{{J}}}[5m]))', "{{job}} {{bucket}}")]),
]
dashboard = {
    "uid": "edl-jobs", "title": "edl training jobs", "tags": ["edl"], "schemaVersion": 39,
    "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus"},
        {"name": "job", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": "label_values(edl_master_leader, job)", "includeAll": True, "multi": True,
         "current": {"text": "All", "value": "$__all"}},
    ]},
    "panels": panels,
}

def rule(name, expr, for_, severity, summary, action):
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": action}}

rules = {"groups": [{"name": "edl", "rules": [
    rule("EdlJobWithoutLeader", "max by (job) (edl_master_leader) == 0", "2m", "critical",
         "Job {{ $labels.job }} has no leading master",
         "No master holds the job's leadership: trainers cannot lease tasks. Check the master pods and etcd (`edl status JOB --etcd`)."),
    rule("EdlJobStalled",
         "(sum by (job) (edl_master_tasks{state=~\"todo|pending\"}) > 0) and on (job) (sum by (job) (rate(edl_master_tasks_finished_total[10m])) == 0) and on (job) (max by (job) (edl_master_finished) == 0)",
         "10m", "warning", "Job {{ $labels.job }} finishes no task",
         "Tasks are waiting but none finished for 10 minutes: are trainers running and registered (`edl status JOB`)?"),
    rule("EdlJobPausedEtcdFull", "max by (job) (edl_master_paused) == 1", "5m", "critical",
         "Job {{ $labels.job }} is paused: its etcd is full",
         "etcd raised its space alarm: compact and defragment it, then disarm the alarm; the job goes on by itself."),
    rule("EdlTaskLeasesExpiring",
         "sum by (job) (rate(edl_master_task_timeouts_total[15m]) + rate(edl_master_trainer_lost_total[15m])) > 0.02",
         "15m", "warning", "Job {{ $labels.job }} keeps losing task leases",
         "Task leases time out or trainers vanish more than once a minute: look for trainers crash-looping, preempted or starved."),
    rule("EdlRecordsLost", "increase(edl_master_lost_records_total[30m]) > 0", "0m", "warning",
         "Job {{ $labels.job }} failed tasks for good",
         "Records were dropped from a pass (a damaged chunk, or a task failing every attempt): `edl status JOB` names the chunks."),
    rule("EdlPserverPushLatencyHigh",
         "histogram_quantile(0.99, sum by (job, shard, le) (rate(edl_pserver_push_seconds_bucket[5m]))) > 1",
         "10m", "warning", "Pserver shard {{ $labels.shard }} of {{ $labels.job }} answers pushes slowly",
         "The 99th percentile of push latency is above 1 s: the shard's pserver is overloaded or its replicas are slow."),
    rule("EdlPserverRestoring", "changes(edl_pserver_incarnation[30m]) > 2", "0m", "warning",
         "Pserver shard {{ $labels.shard }} of {{ $labels.job }} restored repeatedly",
         "The shard was restored from a checkpoint more than twice in 30 minutes: its pserver keeps dying."),
    rule("EdlPserverCheckpointsFailing", "increase(edl_pserver_checkpoints_failed_total[30m]) > 0", "0m", "warning",
         "Pserver shard {{ $labels.shard }} of {{ $labels.job }} cannot write checkpoints",
         "Checkpoint writes fail: check the checkpoint volume (full, read-only, gone)."),
    rule("EdlEtcdSnapshotsFailing", "increase(edl_master_etcd_snapshot_failures_total[1h]) > 2", "0m", "warning",
         "Job {{ $labels.job }} cannot snapshot its managed etcd",
         "The leading master keeps failing to write a snapshot of the job's etcd: its log says why (the object store, its credentials, or etcd's root password)."),
    rule("EdlNonFiniteGradients", "increase(edl_pserver_nonfinite_rejected_total[15m]) > 0 or increase(edl_trainer_skipped_batches_total[15m]) > 0", "0m", "warning",
         "Job {{ $labels.job }} produced NaN or infinite gradients",
         "Pushes were refused or batches skipped for non-finite values: lower the learning rate or check the data."),
    rule("EdlOperatorReconcileErrors", "sum(rate(edl_operator_reconcile_errors_total[10m])) > 0.1", "15m", "warning",
         "The edl operator keeps failing to reconcile",
         "Reconciles fail and are retried: the operator's log says why (API server, RBAC, etcd)."),
]}]}

def yaml_block(text):
    return "\n".join("    " + l if l else "" for l in text.splitlines())

out = ["# Monitoring for edl jobs (generated by scripts/monitoring.py; check: the e2e test",
       "# monitoring::every_metric_the_dashboard_and_the_alerts_name_is_served).",
       "# - edl-grafana-dashboard: a Grafana dashboard; Grafana's dashboard sidecar loads",
       "#   ConfigMaps labelled grafana_dashboard=\"1\".",
       "# - edl-prometheus-rules: alert rules, a Prometheus rule file (mount it and name it",
       "#   in rule_files, or copy its groups into a PrometheusRule).",
       "# Metrics are scraped from the masters (their gRPC port), pservers and trainers",
       "# (EDL_METRICS_ADDR) and the operator (--metrics-addr), with the job token as a",
       "# bearer token where the job has one (docs/kubernetes.md, Monitoring)."]
for name, labels, key, text in [
    ("edl-grafana-dashboard", {"grafana_dashboard": "1"}, "edl-jobs.json", json.dumps(dashboard, indent=2)),
    ("edl-prometheus-rules", {}, "edl.rules.yaml", yaml.safe_dump(rules, sort_keys=False, width=100)),
]:
    out.append("---")
    out.append("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: %s\n  namespace: edl-system" % name)
    out.append("  labels:\n    app.kubernetes.io/name: edl" + "".join("\n    %s: \"%s\"" % kv for kv in labels.items()))
    out.append("data:\n  %s: |\n%s" % (key, yaml_block(text)))
REPO = pathlib.Path(__file__).resolve().parent.parent
target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "deploy" / "monitoring.yaml"
target.write_text("\n".join(out) + "\n")
