"""A tiny offline dataset and tokenizer in the layout nanochat expects.

nanochat reads its pretraining text from ``$NANOCHAT_BASE_DIR/base_data_climbmix/
shard_NNNNN.parquet`` (a ``text`` column; the last shard is the validation split; the
loader strides over row groups by rank, so every shard has several) and its tokenizer
from ``$NANOCHAT_BASE_DIR/tokenizer/{tokenizer.pkl,token_bytes.pt}`` (written by
``scripts/tok_train.py``). Nothing here downloads anything: the text is generated from a
small grammar with a fixed seed, so the same files come out on every machine, and the
tokenizer is trained by nanochat's own ``scripts/tok_train.py`` on that text.

    python benchmarks/nanochat/setup_data.py --nanochat DIR --base-dir DIR
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

# 3 train shards + 1 val shard, 4 row groups of 400 documents each: 6400 documents,
# ~1M characters. The loader cycles epochs, so a short run never runs out.
SHARDS = 4
ROW_GROUPS = 4
DOCS_PER_ROW_GROUP = 400
# 500 = 256 bytes + 235 merges + 9 special tokens. nanochat pads the embedding to a
# multiple of 64 (512), so ids 500..511 exist in the model but never come from the
# tokenizer: the nan_sample fault uses one of them as its corrupt token.
VOCAB_SIZE = 500

SUBJECTS = [
    "the old sailor",
    "a young farmer",
    "the king",
    "my neighbour",
    "the quiet child",
    "a tired soldier",
    "the merchant",
    "her brother",
    "the village priest",
    "a stranger",
]
VERBS = [
    "walked to",
    "looked at",
    "remembered",
    "carried",
    "sold",
    "painted",
    "forgot",
    "wrote about",
    "dreamed of",
    "built",
]
OBJECTS = [
    "the river",
    "a red boat",
    "the long road",
    "an empty house",
    "the market",
    "seven apples",
    "the northern hills",
    "a silver ring",
    "the harbour",
    "the winter sky",
]
TAILS = [
    "before the sun went down",
    "in the spring of that year",
    "without a word",
    "with great care",
    "for the last time",
    "as the bells rang",
    "under the rain",
    "while the town slept",
]


def document(rng: random.Random) -> str:
    """A few sentences: small vocabulary, lots of repetition, some numbers."""
    sentences = []
    for _ in range(rng.randint(2, 8)):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(TAILS)}"
        if rng.random() < 0.2:
            s += f", {rng.randint(2, 99)} times"
        sentences.append(s[0].upper() + s[1:] + ".")
    return " ".join(sentences)


def write_shards(data_dir: Path, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    n = ROW_GROUPS * DOCS_PER_ROW_GROUP
    for i in range(SHARDS):
        table = pa.table({"text": [document(rng) for _ in range(n)]})
        path = data_dir / f"shard_{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=DOCS_PER_ROW_GROUP)


def setup(nanochat: Path, base_dir: Path, python: str = sys.executable) -> None:
    """Write the shards and train the tokenizer, unless both are already there."""
    data_dir = base_dir / "base_data_climbmix"
    tok_dir = base_dir / "tokenizer"
    if not (data_dir / f"shard_{SHARDS - 1:05d}.parquet").exists():
        write_shards(data_dir)
    if not (tok_dir / "token_bytes.pt").exists():
        env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir)}
        cmd = [python, "-m", "scripts.tok_train", f"--vocab-size={VOCAB_SIZE}"]
        done = subprocess.run(cmd, cwd=nanochat, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # rustbpe logs every merge: shown only when it failed
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"tokenizer training failed: {' '.join(cmd)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanochat", type=Path, required=True, help="nanochat source tree")
    p.add_argument("--base-dir", type=Path, required=True, help="NANOCHAT_BASE_DIR to fill")
    args = p.parse_args()
    setup(args.nanochat.resolve(), args.base_dir.resolve())
    print(f"data and tokenizer in {args.base_dir}")


if __name__ == "__main__":
    main()
