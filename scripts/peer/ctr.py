"""The CTR rows of scripts/bench_peer.py: PaddleRec's CTR-DNN shape (13 dense
features, 26 categorical slots of one id each in one embedding table of over a million
rows, a 400-400-400 ReLU network, 2 logits), edl's `ctr` model against Paddle 2.6.2's
parameter server (scripts/peer/ps_ctr.py), both async, one pserver, plain SGD.

The data is synthetic, of known structure (seed 11): slot s draws its token t from
0..40,000 with probability about 1/(t+1) (a few ids are frequent, most are rare), the
id is s * 40,000 + t (1,040,000 ids in all); the 13 features are standard normal; the
click is drawn with probability sigmoid(w . features + sum of the 26 ids' effects - 1),
every id's effect drawn once from N(0, 0.25^2). The best achievable loss (the data's own
entropy) is reported with the data.

One file feeds both systems: Paddle's MultiSlot text (`13 f.. 1 id .. 1 click`);
edl converts it (`edl data convert --format multislot --slots dense,sparse*26,label
--label class`). Paddle's trainers read contiguous halves of it; edl's lease tasks.
The held-out loss: edl's evaluation of the test split at the end of the job; Paddle's
in numpy from its pservers' tables (dense pulled, the sparse table saved).
"""

import json
import os
import subprocess

import numpy as np

SLOTS = 26
DENSE = 13
PER_SLOT = 40_000
VOCAB = SLOTS * PER_SLOT
DIM = 9
HIDDEN = (400, 400, 400)
TRAIN = 200_000
TEST = 20_000
BATCH = 256
LR = 0.1
EPOCHS = 1
SEED = 11


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def generate(n, rng, w, theta):
    u = rng.random((n, SLOTS))
    tokens = np.minimum(np.floor((PER_SLOT + 1.0) ** u - 1.0), PER_SLOT - 1).astype(np.int64)
    ids = tokens + np.arange(SLOTS, dtype=np.int64) * PER_SLOT
    x = rng.standard_normal((n, DENSE)).astype(np.float32)
    p = sigmoid(x @ w + theta[ids].sum(axis=1) - 1.0)
    y = (rng.random(n) < p).astype(np.int64)
    return x, ids, y, p


def write_multislot(path, x, ids, y):
    with open(path, "w") as f:
        for k in range(0, x.shape[0], 4096):
            rows = zip(x[k:k + 4096].tolist(), ids[k:k + 4096].tolist(), y[k:k + 4096].tolist())
            f.write("".join(
                f"{DENSE} {' '.join('%.4f' % v for v in xr)} {' '.join('1 %d' % i for i in ir)} 1 {yr}\n"
                for xr, ir, yr in rows))


def entropy(p):
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(np.mean(-(p * np.log(p) + (1 - p) * np.log(1 - p))))


def prepare(a, data):
    """Writes the data once (data/ctr for Paddle, work/edl-ctr for edl); returns
    (edl_dir, meta)."""
    pd = os.path.join(data, "ctr")
    edl_dir = os.path.join(a.work, "edl-ctr")
    done = os.path.join(pd, "DONE-v1")
    if os.path.exists(done):
        return edl_dir, json.load(open(os.path.join(pd, "meta.json")))
    os.makedirs(pd, exist_ok=True)
    os.makedirs(edl_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    w = rng.normal(0, 0.4, DENSE).astype(np.float32)
    theta = rng.normal(0, 0.25, VOCAB).astype(np.float32)
    x, ids, y, p = generate(TRAIN, rng, w, theta)
    hx, hids, hy, hp = generate(TEST, rng, w, theta)
    write_multislot(os.path.join(pd, "train.txt"), x, ids, y)
    write_multislot(os.path.join(pd, "test.txt"), hx, hids, hy)
    for t in (1, 2):
        per = (TRAIN + t - 1) // t
        for i in range(t):
            sl = slice(i * per, (i + 1) * per)
            write_multislot(os.path.join(pd, f"part-{i}-of-{t}.txt"), x[sl], ids[sl], y[sl])
        # The harness's gen_data.py, run by its launcher for the model "ctr", would
        # write its MLP data here: its own markers say the data is there.
        open(os.path.join(pd, f"DONE-v2-{t}"), "w").write("ok\n")
    np.savez(os.path.join(pd, "heldout.npz"), x=hx, ids=hids, y=hy)
    conv = [a.edl, "data", "convert", "--format", "multislot", "--slots", f"dense,sparse*{SLOTS},label",
            "--label", "class", "--chunk-size", "256KiB", "--out", edl_dir]
    subprocess.run(conv + ["--prefix", "train", os.path.join(pd, "train.txt")], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(conv + ["--prefix", "test", os.path.join(pd, "test.txt")], check=True,
                   stdout=subprocess.DEVNULL)
    touched = int(np.unique(ids).shape[0])
    meta = {"vocab": VOCAB, "dim": DIM, "slots": SLOTS, "dense": DENSE, "hidden": list(HIDDEN),
            "lr": LR, "batch": BATCH, "train": TRAIN, "test": TEST, "ids_touched": touched,
            "floor_loss_test": entropy(hp), "base_rate": float(y.mean())}
    json.dump(meta, open(os.path.join(pd, "meta.json"), "w"), indent=1)
    open(done, "w").write("ok\n")
    return edl_dir, meta


def edl_spec(edl_dir, meta, trainers, per_push):
    path = os.path.join(edl_dir, f"job-ctr-{trainers}-{per_push}.toml")
    with open(path, "w") as f:
        f.write(f"""# written by scripts/peer/ctr.py: CTR-DNN on synthetic clicks, the side-by-side with Paddle
name = "peer-ctr-{trainers}-{per_push}"

[data]
train = "train-*.recordio"
test = "test-*.recordio"

[model]
kind = "ctr"
vocab_size = {meta['vocab']}
dim = {DIM}
slots = {SLOTS}
dense = {DENSE}
hidden = {json.dumps(list(HIDDEN))}

[train]
mode = "async"
passes = {EPOCHS}
batch_size = {BATCH}
eval_batch_size = 1024
optimizer = "sgd"
learning_rate = {LR}
batches_per_push = {json.dumps(per_push)}

[cluster]
masters = 1
pservers = 1
trainers = {trainers}
""")
    return path
