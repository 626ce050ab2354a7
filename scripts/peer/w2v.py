"""The word2vec rows of scripts/bench_peer.py: skip-gram with negative sampling on the
Penn Treebank text (../shared/data/ptb.{valid,test}.txt, the "imikolov" corpus), edl
against Paddle 2.6.2's parameter server (scripts/peer/ps_w2v.py), both async with sparse
embedding tables on one pserver.

The corpus: both PTB files, every 10th sentence held out. edl converts the training
sentences (`edl data convert --format text`, which also writes the vocabulary, ids by
descending frequency); the held-out sentences are converted with that vocabulary. The
same sentences become Paddle's data: every (centre, context) pair within a fixed window,
each with K negatives drawn from the distribution of edl's `zipf` sampler (numpy draws
them; edl's trainers draw their own, so the pairs are the same and the negatives the
same in distribution). Paddle's trainers each get a contiguous half of the pairs; edl's
lease tasks.

Figures: pairs/s (edl's records are sentences, so its samples/s is multiplied by the
training set's pairs per sentence); the held-out loss (mean over held-out pairs of
softplus(-u_o.v_c) + sum_k softplus(u_nk.v_c)): edl's evaluation at the end of the job,
Paddle's in numpy from the tables its pservers save; bytes sent per pair (from the
pserver's own counters: edl's `/metrics`, not available for Paddle).
"""

import json
import os
import subprocess

import numpy as np

DIM = 64
WINDOW = 2
NEGATIVES = 5
LR = 2.0
BATCH_SENTENCES = 8
EPOCHS = 1
HELD_OUT_EVERY = 10
SEED = 7


def zipf(rng, vocab, n):
    """edl's `zipf` sampler (trainer/src/word2vec.rs `draw_negative`), vectorised."""
    top = (vocab + 1) ** 0.25 - 1.0
    x = (1.0 + rng.random(n) * top) ** 4
    return np.minimum(np.maximum(x.astype(np.int64) - 1, 0), vocab - 1)


def pairs_of(sentences):
    c, o = [], []
    for ids in sentences:
        for i, w in enumerate(ids):
            for j in range(max(0, i - WINDOW), min(len(ids), i + WINDOW + 1)):
                if j != i:
                    c.append(w)
                    o.append(ids[j])
    return np.asarray(c, dtype=np.int64), np.asarray(o, dtype=np.int64)


def prepare(a, data):
    """Writes the edl RecordIO (work/edl-w2v) and Paddle's pairs (data/w2v) once;
    returns (edl_dir, meta)."""
    pd = os.path.join(data, "w2v")
    edl_dir = os.path.join(a.work, "edl-w2v")
    done = os.path.join(pd, "DONE-v1")
    if os.path.exists(done):
        return edl_dir, json.load(open(os.path.join(pd, "meta.json")))
    os.makedirs(pd, exist_ok=True)
    os.makedirs(edl_dir, exist_ok=True)
    src = os.path.join(a.harness, "..", "..", "data")
    lines = [l for f in ("ptb.valid.txt", "ptb.test.txt")
             for l in open(os.path.join(src, f)) if l.strip()]
    train = [l for i, l in enumerate(lines) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [l for i, l in enumerate(lines) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    for name, ls in (("train", train), ("test", held)):
        open(os.path.join(pd, name + ".txt"), "w").write("".join(ls))
    conv = [a.edl, "data", "convert", "--format", "text", "--chunk-size", "16KiB", "--out", edl_dir]
    subprocess.run(conv + ["--prefix", "train", os.path.join(pd, "train.txt")], check=True,
                   stdout=subprocess.DEVNULL)
    vocab_file = os.path.join(edl_dir, "train.vocab")
    subprocess.run(conv + ["--prefix", "test", "--vocab", vocab_file, os.path.join(pd, "test.txt")],
                   check=True, stdout=subprocess.DEVNULL)
    words = [w.rstrip("\n") for w in open(vocab_file)]
    ids = {w: i for i, w in enumerate(words)}
    bos, eos, unk = ids["<s>"], ids["<e>"], ids["<unk>"]
    V = len(words)

    def sentence(l):
        return [bos] + [ids.get(w, unk) for w in l.split()] + [eos]

    rng = np.random.default_rng(SEED)
    tr = [sentence(l) for l in train]
    for t in (1, 2):
        per = (len(tr) + t - 1) // t
        for i in range(t):
            c, o = pairs_of(tr[i * per:(i + 1) * per])
            n = zipf(rng, V, c.shape[0] * NEGATIVES).reshape(-1, NEGATIVES)
            with open(os.path.join(pd, f"part-{i}-of-{t}.txt"), "w") as f:
                for k in range(0, c.shape[0], 4096):
                    f.write("".join(f"1 {ci} 1 {oi} {NEGATIVES} {' '.join(map(str, ni))}\n"
                                    for ci, oi, ni in zip(c[k:k + 4096].tolist(), o[k:k + 4096].tolist(),
                                                          n[k:k + 4096].tolist())))
    c, o = pairs_of(tr)
    hc, ho = pairs_of([sentence(l) for l in held])
    hn = zipf(rng, V, hc.shape[0] * NEGATIVES).reshape(-1, NEGATIVES)
    np.savez(os.path.join(pd, "heldout.npz"), c=hc, o=ho, n=hn)
    pairs_per_sentence = c.shape[0] / len(tr)
    meta = {"vocab": V, "dim": DIM, "window": WINDOW, "negatives": NEGATIVES, "lr": LR,
            "sentences": len(tr), "pairs": int(c.shape[0]), "pairs_per_sentence": pairs_per_sentence,
            "heldout_pairs": int(hc.shape[0]),
            "batch_pairs": int(round(BATCH_SENTENCES * pairs_per_sentence))}
    json.dump(meta, open(os.path.join(pd, "meta.json"), "w"), indent=1)
    # The harness's launcher runs its gen_data.py for the model it is given (here
    # "w2v"), which would write its MLP data over these files: its own markers tell it
    # that the data is there.
    for t in (1, 2):
        open(os.path.join(pd, f"DONE-v2-{t}"), "w").write("ok\n")
    open(done, "w").write("ok\n")
    return edl_dir, meta


def edl_spec(edl_dir, meta, trainers, per_push):
    path = os.path.join(edl_dir, f"job-w2v-{trainers}-{per_push}.toml")
    with open(path, "w") as f:
        f.write(f"""# written by scripts/peer/w2v.py: skip-gram on PTB, the side-by-side with Paddle
name = "peer-w2v-{trainers}-{per_push}"

[data]
train = "train-*.recordio"
test = "test-*.recordio"

[model]
kind = "word2vec"
vocab_size = {meta['vocab']}
dim = {DIM}
window = {WINDOW}
negatives = {NEGATIVES}
sampler = "zipf"

[train]
mode = "async"
passes = {EPOCHS}
batch_size = {BATCH_SENTENCES}
eval_batch_size = 64
optimizer = "sgd"
learning_rate = {LR}
batches_per_push = {json.dumps(per_push)}

[cluster]
masters = 1
pservers = 1
trainers = {trainers}
""")
    return path
