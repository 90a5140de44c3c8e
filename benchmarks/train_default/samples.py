"""Sampling settings for the embedded default model, chosen from measured samples.

    python benchmarks/train_default/samples.py --out benchmarks/results/train_default/samples-cpu-2026-12-01.json

For each setting (temperature, top_p) it generates ``--max-tokens`` tokens after ``--prompt`` for seeds
0-9 through ``dsa.LLM`` on CPU and scores each completion: distinct-2 (distinct word bigrams / bigrams)
and the share of its words found in an English word list (Debian's ``wamerican``:
/usr/share/dict/american-english; words are runs of letters, compared lower-case, possessive 's cut).
"""
import argparse
import json
import re
import sys

DEFAULT_SETTINGS = ["0:1", "0.5:0.95", "0.6:0.9", "0.6:0.95", "0.7:0.9", "0.7:0.95", "0.8:0.95", "1.0:0.95", "1.0:1.0"]


def words(text: str) -> list:
    return [w.lower().removesuffix("'s") for w in re.findall(r"[A-Za-z]+(?:'[a-z]+)?", text)]


def distinct2(ws: list) -> float:
    pairs = list(zip(ws, ws[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 0.0


def english_share(ws: list, vocab: set) -> float:
    return sum(w in vocab for w in ws) / len(ws) if ws else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, help="TEMPERATURE:TOP_P pairs")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--words", default="/usr/share/dict/american-english")
    args = p.parse_args(argv)
    import dsa

    with open(args.words, encoding="utf-8", errors="replace") as f:
        vocab = {w.strip().lower().removesuffix("'s") for w in f if w.strip()}
    llm = dsa.LLM(device="cpu")
    rows = []
    for setting in args.settings:
        t, top_p = (float(x) for x in setting.split(":"))
        params = [dsa.SamplingParams(max_tokens=args.max_tokens, temperature=t, top_p=top_p, seed=s)
                  for s in range(args.seeds)]
        outs = llm.generate([args.prompt] * args.seeds, params)
        texts = [o.text for o in outs]
        d2 = [distinct2(words(x)) for x in texts]
        en = [english_share(words(x), vocab) for x in texts]
        row = {"temperature": t, "top_p": top_p, "distinct2_mean": sum(d2) / len(d2),
               "english_mean": sum(en) / len(en), "samples": [{"seed": s, "text": x, "distinct2": a, "english": b}
                                                                for s, x, a, b in zip(range(args.seeds), texts, d2, en)]}
        rows.append(row)
        print(f"T={t} top_p={top_p}: distinct-2 {row['distinct2_mean']:.3f}, English words {row['english_mean']:.3f}",
              flush=True)
    record = {"command": " ".join(["python"] + sys.argv), "prompt": args.prompt, "max_tokens": args.max_tokens,
              "seeds": args.seeds, "words": args.words, "settings": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
