"""End-to-end retrieval (``dsa needle``): does the teacher still answer when every layer attends only to k positions?

Tasks in the spirit of RULER (Hsieh et al., 2024), hidden in natural filler text (held-out prose):

    needle     one "special magic" value (a 7-digit number, a word or a UUID-like code, in turn) for a key
               at a depth of 10-90 % of the context, asked for at the end
    multikey   the same with four keys, each with its own 7-digit number: three are distractors
    passkey    the pass-key prompt of ``dsa recall --teacher`` (5 digits, no preamble)

Each sample is scored by teacher forcing: one forward of prompt + answer under a selection rule applied
in every layer (:mod:`dsa.quality.sparse_loss`: dense, the oracle top-k, the fitted FP8 indexers' top-k,
sink + recent); the answer is retrieved when each of its tokens is the argmax, and its log-probability
(nats, summed over its tokens) is kept beside it. Accuracy comes with a 95 % Wilson interval; where the
dense teacher itself gets < 0.5, the cell is information, not a target.
"""
import math
from collections import defaultdict

import torch

from dsa.quality.choices import TASKS
from dsa.quality.sequences import PASSKEY, QUESTION as PASSKEY_QUESTION
from dsa.quality.sparse_loss import fitted_rule, oracle_rule, sink_recent_rule
from dsa.report import save_figure

FIGURE = "needle_accuracy.png"  # what plot() writes
KINDS = ("number", "word", "uuid")
LABELS = {"dense": "dense", "oracle": "oracle top-k", "fitted": "fitted FP8 top-k", "sink_recent": "sink + recent"}
DEPTHS = tuple(round(0.1 * d, 1) for d in range(1, 10))
DISTRACTORS = 3  # multikey: keys besides the one asked for
WORDS = ("apple", "river", "candle", "garden", "mirror", "pencil", "window", "castle", "forest", "rocket",
         "violin", "harbor", "pillow", "meadow", "anchor", "basket", "carpet", "desert", "engine", "falcon",
         "glacier", "hammer", "island", "jacket", "kettle", "ladder", "marble", "napkin", "orange", "parrot",
         "quartz", "saddle", "tunnel", "velvet", "wallet", "yogurt", "bridge", "cactus", "dragon", "feather",
         "helmet", "lantern", "magnet", "oyster", "planet", "rabbit", "silver", "tomato", "walnut", "zipper")
PREAMBLE = ("Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {kind}s afterwards.\n")
NEEDLE = " One of the special magic {kind}s for {key} is: {value}."
QUESTION = ("\nWhat is the special magic {kind} for {key} mentioned in the provided text? "
            "The special magic {kind} for {key} mentioned in the provided text is:")
SNAP = 64  # a needle goes after the first sentence end within this many tokens of its depth


# ---- samples -----------------------------------------------------------------------------------
def _digits(n: int, g: torch.Generator) -> str:
    return "".join(str(int(d)) for d in torch.randint(0, 10, (n,), generator=g))


def _value(kind: str, g: torch.Generator, avoid=()) -> str:
    if kind == "number":
        return str(int(torch.randint(1_000_000, 10_000_000, (), generator=g)))
    if kind == "word":
        return _words(1, g, avoid)[0]
    hexa = "".join("0123456789abcdef"[int(i)] for i in torch.randint(0, 16, (12,), generator=g))
    return f"{hexa[:8]}-{hexa[8:]}"


def _words(n: int, g: torch.Generator, avoid=()) -> list:
    pool = [w for w in WORDS if w not in avoid]
    return [pool[int(i)] for i in torch.randperm(len(pool), generator=g)[:n]]


def split_answer(tokenizer, question: str, answer: str) -> tuple:
    """``(question ids, answer ids)`` from one encoding of ``question + answer``: the answer's tokens are
    those that end past the question's text (a token spanning both counts as the answer's)."""
    enc = tokenizer.encode(question + answer)
    j = next(i for i, (_, e) in enumerate(enc.offsets) if e > len(question))
    return enc.ids[:j], enc.ids[j:]


def _insert_at(filler: torch.Tensor, depth: float, tokenizer) -> int:
    """The filler position for a needle at ``depth``: just after the first sentence end (a token ending in
    '.' or a newline) within ``SNAP`` tokens, else the depth itself."""
    at = min(int(depth * len(filler)), len(filler))
    for p in range(at, min(at + SNAP, len(filler))):
        text = tokenizer.id_to_token(int(filler[p])) or ""
        if text.endswith(".") or text.endswith("Ċ"):
            return p + 1
    return at


def build(task: str, length: int, depth: float, kind: str, filler_of, tokenizer, g: torch.Generator) -> dict:
    """One sample of ``length`` tokens: ``{"ids", "question_at", "answer_at", "answer", "needles", ...}``.
    ``filler_of(n)`` returns ``n`` filler tokens; ``needles`` are the start positions of the needles, the one
    asked for first."""
    enc = lambda text: tokenizer.encode(text).ids  # noqa: E731
    if task == "passkey":
        kind, value = "digits", _digits(5, g)
        prefix, needles = [], [enc(PASSKEY.format(key=value))]
        question, answer = split_answer(tokenizer, PASSKEY_QUESTION.split("{key}")[0].rstrip(), " " + value)
    elif task in ("needle", "multikey"):
        kind = "number" if task == "multikey" else kind
        keys = _words(1 + (DISTRACTORS if task == "multikey" else 0), g)
        values = []
        for _ in keys:
            values.append(_value(kind, g, avoid=set(keys) | set(values)))
        value = values[0]
        prefix = enc(PREAMBLE.format(kind=kind))
        needles = [enc(NEEDLE.format(kind=kind, key=k, value=v)) for k, v in zip(keys, values)]
        question, answer = split_answer(tokenizer, QUESTION.format(kind=kind, key=keys[0]), " " + value)
    else:
        raise ValueError(f"--tasks: unknown task {task!r} (choose from {', '.join(TASKS)})")
    fill = length - len(prefix) - sum(map(len, needles)) - len(question) - len(answer)
    if fill < 2 * SNAP:
        raise ValueError(f"--lengths: {length} tokens leave {fill} for the filler of a {task} sample")
    filler = filler_of(fill)
    depths = [depth] + [0.05 + 0.9 * float(torch.rand((), generator=g)) for _ in needles[1:]]
    at = [_insert_at(filler, d, tokenizer) for d in depths]
    pieces, starts, pos, done = [torch.tensor(prefix, dtype=torch.long)], [0] * len(needles), len(prefix), 0
    for j in sorted(range(len(needles)), key=lambda j: (at[j], j)):
        pieces.append(filler[done:at[j]])
        pos += at[j] - done
        starts[j], done = pos, at[j]
        pieces.append(torch.tensor(needles[j], dtype=torch.long))
        pos += len(needles[j])
    pieces += [filler[done:], torch.tensor(question + answer, dtype=torch.long)]
    ids = torch.cat(pieces)
    assert ids.numel() == length
    return {"task": task, "kind": kind, "depth": depth, "ids": ids, "answer_at": length - len(answer),
            "question_at": length - len(answer) - len(question),
            "answer": value, "answer_tokens": answer, "filler_tokens": fill, "needles": starts, "needle_tokens": [len(n) for n in needles]}


def samples(task: str, length: int, count: int, filler_of, tokenizer, g: torch.Generator) -> list:
    """``count`` samples, depths cycling through ``DEPTHS``, needle kinds through ``KINDS`` every round of depths."""
    return [build(task, length, DEPTHS[j % len(DEPTHS)], KINDS[(j // len(DEPTHS)) % len(KINDS)], filler_of, tokenizer, g)
            for j in range(count)]


# ---- scoring ------------------------------------------------------------------------------------
def selection_rules(names, k: int, teacher, indexers_fp8: dict, cos, sin) -> dict:
    """``{name: select}`` for ``teacher.block``: every layer restricted to ``k`` positions (None: dense)."""
    chunk = 512 if teacher.device.type == "cuda" else 64
    make = {"dense": lambda: None, "oracle": lambda: oracle_rule(k, chunk),
            "fitted": lambda: fitted_rule(indexers_fp8, 1, k, cos, sin, teacher.config.num_layers),
            "sink_recent": lambda: sink_recent_rule(k)}
    return {n: make[n]() for n in names}


def score(teacher, sample: dict, select=None) -> dict:
    """Teacher-forced answer: ``{"retrieved": every answer token is the argmax, "logprob": nats summed}``."""
    ids, a = sample["ids"].to(teacher.device), sample["answer_at"]
    logits = teacher.logits_at(ids, torch.arange(a - 1, ids.numel() - 1), select)
    target = ids[a:]
    logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])
    return {"retrieved": bool((logits.argmax(-1) == target).all()), "logprob": float(logp.sum())}


# ---- statistics and tables ----------------------------------------------------------------------
def wilson(successes: int, n: int, z: float = 1.96) -> tuple:
    """The Wilson score interval of ``successes / n`` (95 % at the default ``z``); ``(0, 1)`` for ``n = 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def group(records: list, keys: tuple) -> list:
    """Per value of ``keys`` (e.g. ``("task", "length")``) and rule: n, accuracy, its Wilson interval and
    the mean answer log-probability; ``information_only`` where dense accuracy is < 0.5; beside dense, each
    rule's paired counts on the same samples: ``dense_answered_missed`` (the issue's target: at most 3 of 100)
    and ``answered_dense_missed``."""
    by = defaultdict(list)
    for r in records:
        by[tuple(r[k] for k in keys)].append(r)
    out = []
    order = lambda key: tuple((TASKS.index(v), "") if v in TASKS else (-1, v) for v in key)  # noqa: E731
    for key in sorted(by, key=order):
        rs = by[key]
        row = {**dict(zip(keys, key)), "n": len(rs), "rules": {}}
        for rule in rs[0]["rules"]:
            hit = sum(r["rules"][rule]["retrieved"] for r in rs)
            lo, hi = wilson(hit, len(rs))
            row["rules"][rule] = {"accuracy": hit / len(rs), "low": lo, "high": hi,
                                  "logprob": sum(r["rules"][rule]["logprob"] for r in rs) / len(rs)}
        if "dense" in row["rules"]:
            row["information_only"] = row["rules"]["dense"]["accuracy"] < 0.5
            dense = [r["rules"]["dense"]["retrieved"] for r in rs]
            for rule, cell in row["rules"].items():  # paired on the same samples
                if rule != "dense":
                    got = [r["rules"][rule]["retrieved"] for r in rs]
                    cell["dense_answered_missed"] = sum(d and not g for d, g in zip(dense, got))
                    cell["answered_dense_missed"] = sum(g and not d for d, g in zip(dense, got))
        out.append(row)
    return out


def summarize(records: list) -> dict:
    return {"by_task_length": group(records, ("task", "length")), "by_task_depth": group(records, ("task", "depth")),
            "by_task_kind": group(records, ("task", "kind"))}


def table_text(result: dict) -> str:
    """The README table (markdown): accuracy [95 % interval], mean answer log-probability in nats, and beside
    dense each rule's -missed/+gained on the same samples (dense answered and the rule did not / the reverse)."""
    rules = result["args"]["rules"]
    lines = ["| task | context | k | n | " + " | ".join(LABELS[r] for r in rules) + " | reading |",
             "|---|---|---|---|" + "---|" * len(rules) + "---|"]
    ks = {(r["length"]): r["k"] for r in result["records"]}
    for row in result["summary"]["by_task_length"]:
        paired = lambda c: f", -{c['dense_answered_missed']}/+{c['answered_dense_missed']}" \
            if "dense_answered_missed" in c else ""  # noqa: E731
        cells = [f"{c['accuracy']:.2f} [{c['low']:.2f}, {c['high']:.2f}], {c['logprob']:.2f}{paired(c)}"
                 for c in (row["rules"][r] for r in rules)]
        reading = "-" if "information_only" not in row else \
            ("information (dense < 0.5)" if row["information_only"] else "target")
        lines.append(f"| {row['task']} | {row['length']} | {ks[row['length']]} | {row['n']} | "
                     + " | ".join(cells) + f" | {reading} |")
    return "\n".join(lines)


def plot(result: dict, out_dir: str) -> str:
    """One row per task: accuracy by needle depth (all lengths) and by context length (all depths),
    one line per rule (nudged sideways so they stay apart), 95 % Wilson intervals as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, s = result["args"], result["summary"]
    tasks = a["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.2 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        for ax, (key, table, xlabel) in zip(row, (("depth", "by_task_depth", "needle depth (% of the context)"),
                                                  ("length", "by_task_length", "context length (tokens)"))):
            pts = [r for r in s[table] if r["task"] == task]
            xs = [100 * r[key] if key == "depth" else r[key] for r in pts]
            for j, rule in enumerate(a["rules"]):
                acc = [r["rules"][rule]["accuracy"] for r in pts]
                err = [[max(0.0, y - r["rules"][rule]["low"]) for y, r in zip(acc, pts)],  # >= 0 despite rounding
                       [max(0.0, r["rules"][rule]["high"] - y) for y, r in zip(acc, pts)]]
                shift = j - (len(a["rules"]) - 1) / 2  # rules side by side, not on top of each other
                at = [x + shift if key == "depth" else x * 2 ** (0.03 * shift) for x in xs]
                ax.errorbar(at, acc, yerr=err, marker="o", ms=4, capsize=3, label=LABELS[rule], alpha=0.85)
            n = sum(r["n"] for r in pts)
            ax.set(xlabel=xlabel, ylabel="accuracy (share retrieved)", ylim=(-0.03, 1.03),
                   title=f"{task}: accuracy by {key} ({n} samples, k = context/{a['k_fraction']})")
            if key == "length":
                ax.set_xscale("log", base=2)
                ax.set_xticks(a["lengths"], [str(t) for t in a["lengths"]])
                ax.minorticks_off()
        row[0].legend(fontsize=8)
    fig.suptitle(f"{result['teacher']['name']}: retrieval with every layer restricted to k positions "
                 "(teacher-forced, 95% Wilson intervals)", fontsize=10)
    return save_figure(fig, out_dir, FIGURE)
