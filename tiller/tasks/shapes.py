"""`tiller/shapes`: "how many red squares?", a synthetic visual counting task drawn with PIL (no download).

Each 64 x 64 image is a 4 x 4 grid of 16-pixel cells; 1-4 cells hold a red square and up to 3 more hold a
distractor that differs by colour only (a blue or green square), each square 11-14 px at a random offset inside
its cell (so it fills most of the cell), on a light background. With the tiny VLM's 8-px patches and 2 x 2
merge, each cell is one image token: counting is "how many tokens show a red square". Rows are in verl's
multimodal schema (an `images` column of `{"bytes": png}`, `<image>` in the prompt; ground truth the count as a
string; `data_source` `tiller/shapes`, scored by the last integer in the response). Splits are disjoint by
construction (the test split is drawn from a different seed stream and any image equal to a training one is
redrawn).

(Until SHAPES_VERSION 3 of the demo, squares were 8-12 px and red circles were distractors too: supervised
training from scratch reached 0.68 greedy accuracy in 200 steps there, 0.70 here, 0.85-0.87 at 300-400.)
"""

from __future__ import annotations

import io
import random
from pathlib import Path

from tiller.data.rl_dataset import write_rows

DATA_SOURCE = "tiller/shapes"
QUESTION = "<image>How many red squares?"
SIZE, CELL = 64, 16
COLORS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
DISTRACTORS = ("blue", "green")
MIN_SIDE = 11


def draw(rng: random.Random) -> tuple[bytes, int]:
    """(PNG bytes, number of red squares) of one random image."""
    from PIL import Image, ImageDraw

    cells = rng.sample(range((SIZE // CELL) ** 2), 7)
    n_red = rng.randint(1, 4)
    n_other = rng.randint(0, 3)
    img = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    pen = ImageDraw.Draw(img)
    colors = ["red"] * n_red + [rng.choice(DISTRACTORS) for _ in range(n_other)]
    for cell, color in zip(cells, colors):
        side = rng.randint(MIN_SIDE, CELL - 2)
        x0 = (cell % 4) * CELL + rng.randint(0, CELL - side)
        y0 = (cell // 4) * CELL + rng.randint(0, CELL - side)
        pen.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), fill=COLORS[color])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), n_red


def make_row(png: bytes, count: int, split: str, index: int) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": QUESTION}],
            "images": [{"bytes": png, "path": None}], "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(count)},
            "extra_info": {"split": split, "index": index}}


def make_splits(n_train: int = 2000, n_test: int = 256, seed: int = 0) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows}; the same seed gives the same images."""
    train_rng, test_rng = random.Random(f"shapes-train-{seed}"), random.Random(f"shapes-test-{seed}")
    train = [draw(train_rng) for _ in range(n_train)]
    seen = {png for png, _ in train}
    test = []
    while len(test) < n_test:
        png, count = draw(test_rng)
        if png not in seen:
            test.append((png, count))
    return {"train": [make_row(p, c, "train", i) for i, (p, c) in enumerate(train)],
            "test": [make_row(p, c, "test", i) for i, (p, c) in enumerate(test)]}


def write_task(out_dir: str | Path, n_train: int = 2000, n_test: int = 256, seed: int = 0) -> dict[str, Path]:
    """Write `out_dir/{train,test}.parquet`; returns the paths."""
    out = Path(out_dir).expanduser()
    return {split: write_rows(rows, out / f"{split}.parquet")
            for split, rows in make_splits(n_train, n_test, seed).items()}
