#!/usr/bin/env python
"""The harness's ps_train_fluid18.py (../shared/peers/paddle, Paddle 1.8.5) for the
1.8.5 rows of scripts/bench_peer.py, run through the harness's bench_launch.py
(--script; "fluid18" in this file's name is how the launcher labels its loop): its
roles, loop and events unchanged; its evaluations (before the first step, and after
every epoch) compute the loss and accuracy of the held-out set that edl's job evaluates
($EDL_PEER_TEST), not of the trainer's training shard (scripts/peer/mlp_eval.py).
Python 3.8.
"""
import os
import sys

sys.path.insert(0, os.environ["EDL_PEER_HARNESS"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlp_eval  # noqa: E402
import ps_train_fluid18  # noqa: E402

mlp_eval.patch(ps_train_fluid18)

if __name__ == "__main__":
    ps_train_fluid18.main()
