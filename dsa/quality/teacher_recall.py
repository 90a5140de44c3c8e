"""``dsa recall --teacher``: how much of a pretrained model's attention fitted lightning indexers select.

On held-out text, for every layer and every ``k``, the share of the layer's true attention (averaged over
heads) that falls on

    fitted_fp8    the fitted indexer's selection through the deployed FP8 path (132-byte cache, our kernels)
    fitted_exact  the same indexer in exact precision
    oracle        the true top-k of that attention (the most any k positions can hold)
    sink_recent   tokens 0-3 and the last k - 4 (StreamingLLM's rule)
    untrained     a freshly initialized indexer (FP8)

over query positions whose past exceeds ``k`` (others attend densely and are left out), with and
without token 0 (``no_sink``: the share of the attention on positions >= 1). Beside them: FP8-vs-exact
top-k agreement; the mass kept by the skip patterns (a layer without its own indexer reuses the nearest
earlier one's selection, every 1/2/4 layers); exact-target hits (the source of a copied random-token
span, the digits of a pass key hidden in prose: is the position the query must copy from selected);
optionally (``--sparse-loss``) the teacher's loss with every layer restricted to the selections.
"""
import json
import os
import platform
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from dsa.quality.choices import TEACHER_PRESETS

METHODS = ("fitted_fp8", "fitted_exact", "oracle", "sink_recent", "untrained")
PATTERNS = (1, 2, 4)
FILES = ("quality.json", "quality_by_layer.png", "quality_by_k.png", "sparse_loss.png")  # what run() writes
PASSKEY = " The pass key is {key}. Remember it. "
QUESTION = " What is the pass key? The pass key is {key}"


# ---- evaluation sequences ---------------------------------------------------------------------
def copy_sequence(prose: torch.Tensor, span: int, vocab: int, g: torch.Generator):
    """Prose with one random-token span at T/4 and again at the end. The query at the j-th token of the
    second copy must copy the token after the j-th of the first: ``(ids, queries, targets)``."""
    t = prose.numel()
    ids = prose.clone()
    tokens = torch.randint(17, vocab, (span,), generator=g)  # ids 0-16 are SmolLM2's control tokens
    a, b = t // 4, t - span - 8
    ids[a:a + span] = tokens
    ids[b:b + span] = tokens
    return ids, torch.arange(b, b + span - 1), torch.arange(a + 1, a + span)


def _digit_tokens(tokenizer, text: str, key: str) -> tuple:
    enc = tokenizer.encode(text)
    start = text.index(key)
    pos = [next(j for j, (s, e) in enumerate(enc.offsets) if s <= start + d < e) for d in range(len(key))]
    return enc.ids, pos


def passkey_sequence(prose: torch.Tensor, tokenizer, g: torch.Generator):
    """A 5-digit pass key stated once at a random depth of the prose and asked for at the end. The query
    before each digit of the answer must copy that digit from the statement: ``(ids, queries, targets)``."""
    key = "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=g))
    hidden, hidden_pos = _digit_tokens(tokenizer, PASSKEY.format(key=key), key)
    question, answer_pos = _digit_tokens(tokenizer, QUESTION.format(key=key), key)
    t = prose.numel()
    fill = t - len(hidden) - len(question)
    depth = int(fill * (0.1 + 0.6 * float(torch.rand((), generator=g))))
    ids = torch.cat((prose[:depth], torch.tensor(hidden), prose[depth:fill], torch.tensor(question)))
    q0 = fill + len(hidden)  # where the question starts
    return ids, torch.tensor([q0 + p - 1 for p in answer_pos]), torch.tensor([depth + p for p in hidden_pos])


# ---- accumulation -------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.sum, self.n = defaultdict(float), defaultdict(int)

    def add(self, key, values: torch.Tensor):
        self.sum[key] += float(values.float().sum())
        self.n[key] += values.numel()

    def mean(self, key):
        return self.sum[key] / self.n[key] if self.n.get(key) else None


def score(teacher, ids, queries, ks, ev, tally: Tally, targets=None, kind="prose") -> None:
    """One sequence through the teacher; every layer's selections scored into ``tally``.

    ``ev``: ``fitted_fp8`` / ``fitted_exact`` / ``untrained`` ``{layer: indexer}``, ``sources``
    ``{pattern: {layer: source layer}}``, ``layers`` (reported), ``cos``, ``sin``.
    """
    from dsa.quality.selection import agreement, hits, indexer_logits, mass, oracle, select, sink_recent
    from dsa.quality.teacher import attention_probs

    queries = queries.to(teacher.device)
    targets = None if targets is None else targets.to(teacher.device)
    fp8_logits = {}
    t = ids.numel()

    def observe(i, x, q, k):
        if i in ev["fitted_fp8"]:
            fp8_logits[i] = indexer_logits(ev["fitted_fp8"][i], x, queries, ev["cos"], ev["sin"], "fp8")
        if i not in ev["layers"]:
            return
        probs = attention_probs(q, k, queries)
        if kind == "prose":
            tally.add(("token0", i, 0, "attention"), probs[:, 0])
        exact = (indexer_logits(ev["fitted_exact"][i], x, queries, ev["cos"], ev["sin"], "exact")
                 if i in ev["fitted_exact"] else None)
        untrained = indexer_logits(ev["untrained"][i], x, queries, ev["cos"], ev["sin"], "fp8")
        for kk in ks:
            rows = queries + 1 > kk
            if not bool(rows.any()):
                continue
            qs, p = queries[rows], probs[rows]
            sel = {"oracle": oracle(p, qs, kk), "sink_recent": sink_recent(qs, kk), "untrained": select(untrained[rows], qs, kk)}
            if i in fp8_logits:
                sel["fitted_fp8"] = select(fp8_logits[i][rows], qs, kk)
            if exact is not None:
                sel["fitted_exact"] = select(exact[rows], qs, kk)
            if kind != "prose":
                for name, s in sel.items():
                    tally.add((kind, i, kk, name), hits(s, targets[rows]))
                continue
            for name, s in sel.items():
                tally.add(("mass", i, kk, name), mass(p, s))
                if name != "oracle":
                    tally.add(("no_sink", i, kk, name), mass(p, s, skip_first=True))
            tally.add(("no_sink", i, kk, "oracle"), mass(p, oracle(p, qs, kk, skip_first=True), skip_first=True))
            if "fitted_fp8" in sel and "fitted_exact" in sel:
                tally.add(("agree", i, kk, "fp8_vs_exact"), agreement(sel["fitted_fp8"], sel["fitted_exact"], t))
            for f, src in ev["sources"].items():
                if i in src:
                    tally.add(("reuse", i, kk, str(f)), mass(p, select(fp8_logits[src[i]][rows], qs, kk)))

    teacher.hidden(ids, layers=max(ev["layers"]) + 1, observe=observe)


# ---- tables ---------------------------------------------------------------------------------------
def table(tally: Tally, layers, ks) -> list:
    rows = []
    for i in layers:
        for k in ks:
            r = {"layer": i, "k": k, "queries": tally.n.get(("mass", i, k, "oracle"), 0),
                 "attention_on_token0": tally.mean(("token0", i, 0, "attention"))}
            r.update({m: tally.mean(("mass", i, k, m)) for m in METHODS})
            r["no_sink"] = {m: tally.mean(("no_sink", i, k, m)) for m in METHODS}
            r["fp8_vs_exact"] = tally.mean(("agree", i, k, "fp8_vs_exact"))
            r["skip_pattern"] = {str(f): tally.mean(("reuse", i, k, str(f))) for f in PATTERNS}
            for kind in ("copy", "passkey"):
                r[f"{kind}_hits"] = {m: tally.mean((kind, i, k, m)) for m in METHODS}
            rows.append(r)
    return rows


def _avg(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list, ks, target_k: int) -> dict:
    """Means over the layers that have a fitted indexer (all of them in a full run), per ``k``."""
    by_k = []
    for k in ks:
        at = [r for r in rows if r["k"] == k and r["fitted_fp8"] is not None]
        mid = [r for r in at if 3 <= r["layer"] <= 8]
        s = {"k": k, **{m: _avg([r[m] for r in at]) for m in METHODS},
             "no_sink": {m: _avg([r["no_sink"][m] for r in at]) for m in METHODS},
             "layers_3_8": {m: _avg([r[m] for r in mid]) for m in METHODS},
             "fp8_vs_exact": _avg([r["fp8_vs_exact"] for r in at]),
             "skip_pattern": {f: _avg([r["skip_pattern"][f] for r in at]) for f in map(str, PATTERNS)}}
        by_k.append(s)
    return {"by_k": by_k, "targets": targets(rows, by_k, target_k)}


def targets(rows, by_k, target_k: int) -> dict:
    """The issue's targets at ``target_k`` (hits at k = 64), each with the value measured and whether it holds."""
    s = next((b for b in by_k if b["k"] == target_k), None)
    out = {}
    if s is None or s["oracle"] is None or s["fitted_fp8"] is None:
        return out
    ratio = s["fitted_fp8"] / s["oracle"]
    out["fitted_over_oracle_all_layers"] = {"value": ratio, "target": ">= 0.90", "met": ratio >= 0.90}
    mid, sr = s["layers_3_8"]["fitted_fp8"], s["layers_3_8"]["sink_recent"]
    if mid is not None:
        out["fitted_layers_3_8"] = {"value": mid, "target": ">= 0.70", "met": mid >= 0.70}
        out["fitted_minus_sink_recent_layers_3_8"] = {"value": mid - sr, "target": ">= 0.25", "met": mid - sr >= 0.25}
    if s["fp8_vs_exact"] is not None:
        out["fp8_vs_exact"] = {"value": s["fp8_vs_exact"], "target": ">= 0.95", "met": s["fp8_vs_exact"] >= 0.95}
    for kind in ("copy", "passkey"):
        strong = [r for r in rows if r["k"] == 64 and (r[f"{kind}_hits"]["oracle"] or 0) >= 0.95
                  and r[f"{kind}_hits"]["fitted_fp8"] is not None]
        if strong:
            worst = min(r[f"{kind}_hits"]["fitted_fp8"] for r in strong)
            out[f"{kind}_hits_top64"] = {"layers": [r["layer"] for r in strong], "value": worst,
                                        "mean": _avg([r[f"{kind}_hits"]["fitted_fp8"] for r in strong]),
                                        "target": ">= 0.95 in every layer where the oracle has >= 0.95",
                                        "met": worst >= 0.95}
    return out


def sparse_targets(sparse: dict, target_k: int) -> dict:
    row = next((r for r in sparse["by_k"] if r["k"] == target_k), None)
    if row is None:
        return {}
    gap = row["fitted"]["1"]["all"] - sparse["dense"]["all"]
    return {"sparse_loss_gap": {"value": gap, "oracle_gap": row["oracle"]["all"] - sparse["dense"]["all"],
                                "target": "<= 0.05 nats/token", "met": gap <= 0.05}}


# ---- plots and text ---------------------------------------------------------------------------------
LABELS = {"fitted_fp8": "fitted indexer, FP8", "fitted_exact": "fitted indexer, exact", "oracle": "oracle top-k",
          "sink_recent": "sink + recent", "untrained": "untrained indexer"}
STYLES = {"fitted_fp8": "o-", "fitted_exact": "x--", "oracle": "s-", "sink_recent": "v:", "untrained": "d:"}


def plot(result: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsa.bench.plot import save_figure

    a, rows, paths = result["args"], result["table"], []
    k0 = a["target_k"] if a["target_k"] in a["topk"] else a["topk"][len(a["topk"]) // 2]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    at = [r for r in rows if r["k"] == k0]
    for m in METHODS:
        pts = [(r["layer"], r[m]) for r in at if r[m] is not None]
        if pts:
            ax.plot(*zip(*pts), STYLES[m], label=LABELS[m], ms=4)
    ax.set(ylabel="attention mass kept", ylim=(0, 1.02),
           title=f"{result['teacher']['name']}: top-{k0} of {a['context']} tokens, held-out text")
    ax.legend(fontsize=8, ncol=2)
    at64 = [r for r in rows if r["k"] == 64]
    for kind, style in (("copy", "-"), ("passkey", "--")):
        for m, color in (("oracle", "C2"), ("fitted_fp8", "C0")):
            pts = [(r["layer"], r[f"{kind}_hits"][m]) for r in at64 if r[f"{kind}_hits"][m] is not None]
            if pts:
                bx.plot(*zip(*pts), style, color=color, marker=".", label=f"{kind} target, {LABELS[m]}")
    bx.set(xlabel="layer", ylabel="target in the top-64 (share of queries)", ylim=(-0.02, 1.02))
    if bx.get_legend_handles_labels()[0]:
        bx.legend(fontsize=8, ncol=2)
    paths.append(save_figure(fig, out_dir, FILES[1]))

    fig, ax = plt.subplots(figsize=(7, 4))
    by_k = result["summary"]["by_k"]
    ks = [b["k"] for b in by_k]
    for m in METHODS:
        if any(b[m] is not None for b in by_k):
            ax.plot(ks, [b[m] for b in by_k], STYLES[m], label=LABELS[m])
    for f in ("2", "4"):
        ax.plot(ks, [b["skip_pattern"][f] for b in by_k], "-", alpha=0.6, label=f"fitted FP8, indexer every {f} layers")
    ax.set(xscale="log", xlabel="k (positions kept)", ylabel="attention mass kept (mean over layers)", ylim=(0, 1.02),
           title=f"selection quality vs k ({a['context']}-token held-out windows)")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir, FILES[2]))

    sp = result.get("sparse_loss")
    if sp:
        fig, ax = plt.subplots(figsize=(7, 4))
        ks = [r["k"] for r in sp["by_k"]]
        ax.axhline(sp["dense"]["all"], color="k", lw=1, label=f"dense ({sp['dense']['all']:.3f})")
        ax.plot(ks, [r["oracle"]["all"] for r in sp["by_k"]], "s-", label="oracle top-k")
        for f in sp["by_k"][0]["fitted"]:
            ax.plot(ks, [r["fitted"][f]["all"] for r in sp["by_k"]], "o-", label=f"fitted FP8, indexer every {f}")
        ax.set(xscale="log", xlabel="k (positions each query attends to)", ylabel="held-out loss [nats/token]",
               title="loss with every layer's attention restricted to top-k")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir, FILES[3]))
    return paths


def summary_text(result: dict) -> str:
    a = result["args"]
    fmt = lambda x: "    -" if x is None else f"{x:5.3f}"  # noqa: E731
    k0 = a["target_k"] if a["target_k"] in a["topk"] else a["topk"][len(a["topk"]) // 2]
    lines = [f"{result['teacher']['name']}, {a['context']}-token windows, k = {k0}: attention mass kept",
             "layer  fp8   exact oracle sink+rec untrained  fp8(no tok0) oracle(no tok0)  fp8~exact  copy@64 passkey@64"]
    r64 = {r["layer"]: r for r in result["table"] if r["k"] == 64}
    for r in (r for r in result["table"] if r["k"] == k0):
        h = r64.get(r["layer"], {})
        lines.append(f"{r['layer']:5d}  {fmt(r['fitted_fp8'])} {fmt(r['fitted_exact'])} {fmt(r['oracle'])}  "
                     f"{fmt(r['sink_recent'])}    {fmt(r['untrained'])}     {fmt(r['no_sink']['fitted_fp8'])}"
                     f"        {fmt(r['no_sink']['oracle'])}       {fmt(r['fp8_vs_exact'])}   "
                     f"{fmt(h.get('copy_hits', {}).get('fitted_fp8'))}   {fmt(h.get('passkey_hits', {}).get('fitted_fp8'))}")
    lines.append("mean over layers by k: " + "; ".join(
        f"k={b['k']}: fp8 {fmt(b['fitted_fp8'])} oracle {fmt(b['oracle'])} sink+recent {fmt(b['sink_recent'])}"
        for b in result["summary"]["by_k"]))
    for name, t in result["summary"]["targets"].items():
        lines.append(f"target {name}: {t['value']:.3f} ({t['target']}) {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def sparse_text(result: dict) -> str:
    sp = result["sparse_loss"]
    lines = [f"held-out loss, nats/token (all tokens / second half): dense {sp['dense']['all']:.4f} / "
             f"{sp['dense']['second_half']:.4f}"]
    for r in sp["by_k"]:
        fitted = "  ".join(f"every {f}: {v['all']:.4f} / {v['second_half']:.4f}" for f, v in r["fitted"].items())
        lines.append(f"k={r['k']:5d}  oracle {r['oracle']['all']:.4f} / {r['oracle']['second_half']:.4f}  fitted FP8 {fitted}")
    for name, t in result["summary"]["targets"].items():
        if name.startswith("sparse"):
            lines.append(f"target {name}: {t['value']:.4f} ({t['target']}; oracle {t['oracle_gap']:.4f}) "
                         f"{'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------------
def save(result: dict, path: str, t_start: float) -> None:
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run(args) -> int:
    from dsa.bench.harness import env_info
    from dsa.indexer import LightningIndexer
    from dsa.quality.corpus import read_streams, windows
    from dsa.quality.fit import parse_layers, sample_queries
    from dsa.quality.selection import PACKAGED, indexer_config, load_indexers, reuse_source, rope_tables
    from dsa.quality.sparse_loss import sparse_losses
    from dsa.quality.teacher import LlamaTeacher

    preset = TEACHER_PRESETS[args.teacher_preset]
    pick = lambda name: getattr(args, name) if getattr(args, name, None) is not None else preset[name]  # noqa: E731
    context, n_queries, n_windows = pick("context"), pick("queries"), pick("windows")
    ks = sorted({int(k) for k in pick("topk").split(",")})
    if not args.text:
        raise SystemExit("dsa recall --teacher: give held-out text with --text (benchmarks/quality/fetch_text.py "
                         "writes some)")
    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gguf = None if args.teacher == "smollm2" else args.teacher
    teacher = LlamaTeacher.from_gguf(gguf, device=device)
    cfg = teacher.config
    context = min(context, cfg.context_length)
    layers = parse_layers(pick("layers"), cfg.num_layers)
    folder = args.indexers or PACKAGED
    fitted = load_indexers(folder, cfg, device=device)
    fitted_bf16 = {i: LightningIndexer(m.config).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
                   for i, m in fitted.items()}
    for i, m in fitted_bf16.items():
        m.load_state_dict(fitted[i].state_dict())
    heads = next(iter(fitted.values())).config.index_n_heads
    torch.manual_seed(args.seed)
    untrained = {i: LightningIndexer(indexer_config(cfg, heads)).to(device=device, dtype=torch.bfloat16)
                 .requires_grad_(False) for i in layers}
    icfg = next(iter(fitted.values())).config
    cos, sin = rope_tables(icfg, context, device)
    ev = {"fitted_fp8": fitted_bf16, "fitted_exact": fitted, "untrained": untrained, "layers": set(layers),
          "sources": {f: reuse_source(fitted, f, cfg.num_layers) for f in PATTERNS}, "cos": cos, "sin": sin}
    streams = read_streams(args.text, teacher.tokenizer, min_tokens=context)
    g = torch.Generator().manual_seed(args.seed)
    prose = [(name, w) for name, s in streams.items() for w in windows(s, context, n_windows)]
    low = int(args.query_from * context)
    copies = [copy_sequence(prose[j % len(prose)][1], 32, cfg.vocab_size, g) for j in range(pick("copy_seqs"))]
    keys = [passkey_sequence(prose[j % len(prose)][1], teacher.tokenizer, g) for j in range(pick("passkey_seqs"))]
    tally = Tally()
    with torch.no_grad():
        jobs = ([(w, sample_queries(context, n_queries, low, g), None, "prose") for _, w in prose]
                + [(ids, q, tg, "copy") for ids, q, tg in copies] + [(ids, q, tg, "passkey") for ids, q, tg in keys])
        for ids, q, tg, kind in tqdm(jobs, desc="recall --teacher"):
            score(teacher, ids, q, ks, ev, tally, targets=tg, kind=kind)
    rows = table(tally, layers, ks)
    summary = summarize(rows, ks, args.target_k)
    result = {"args": {**{k: v for k, v in vars(args).items() if k != "func"}, "context": context, "topk": ks,
                       "layers": layers, "queries": n_queries, "windows": n_windows, "indexers": folder},
              "env": {**env_info(), "platform": platform.platform()}, "teacher": cfg.__dict__,
              "texts": {name: int(len(s)) for name, s in streams.items()},
              "sequences": {"prose": len(prose), "copy": len(copies), "passkey": len(keys)},
              "table": rows, "summary": summary}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, FILES[0])
    save(result, path, t_start)  # the recall table stands on its own if the sparse loss is cut short
    print(summary_text(result), flush=True)
    if args.sparse_loss:
        loss_windows = [next(w for n, w in prose if n == name) for name in streams]  # the first window of each text
        with tqdm(total=1 + len(ks) * (1 + len(PATTERNS)), desc="sparse loss") as bar:
            result["sparse_loss"] = sparse_losses(teacher, loss_windows, fitted_bf16, ks, list(PATTERNS), cos, sin, bar)
        result["sparse_loss"]["windows"] = [f"{name}: first {context} tokens" for name in streams]
        summary["targets"].update(sparse_targets(result["sparse_loss"], args.target_k))
        save(result, path, t_start)
        print(sparse_text(result), flush=True)
    plots = plot(result, args.out)
    print(f"wrote {path} and {', '.join(os.path.basename(p) for p in plots)}")
    return 0
